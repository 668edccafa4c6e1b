"""``GET /health``: is the engine thread alive? (200, or 503 once it has stopped)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from infer.server.protocol import ErrorResponse, HealthResponse
from infer.server.responses import error_response
from infer.server.serving import State

router = APIRouter()


@router.get("/health", responses={200: {"model": HealthResponse, "description": "The engine is running"},
                                  503: {"model": ErrorResponse, "description": "The engine stopped"}})
async def health(state: State) -> Response:
    if not state.engine.alive:
        return error_response(503, "the engine is not running", None, "server_unavailable")
    return JSONResponse({"status": "ok"})
