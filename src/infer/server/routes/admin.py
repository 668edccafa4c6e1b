"""The operator's endpoints: vLLM's ``POST /reset_prefix_cache`` (``router``: it needs the API key
when the server has one) and Prometheus' ``GET /metrics`` (``metrics_router``: open, as vLLM's, for
the scraper)."""

from __future__ import annotations

import operator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from infer.server.async_engine import EngineDead
from infer.server.protocol import ResetPrefixCacheResponse
from infer.server.responses import error_response, openapi_responses
from infer.server.serving import State

router = APIRouter()
metrics_router = APIRouter()


@router.post("/reset_prefix_cache", responses=openapi_responses(ResetPrefixCacheResponse,
                                                                "The prefix cache was reset", 503))
async def reset_prefix_cache(state: State) -> JSONResponse:
    """vLLM's endpoint: forget every cached KV block (phase 7), e.g. between benchmark runs."""
    try:
        dropped = await state.engine.call(operator.methodcaller("reset_prefix_cache"))
    except EngineDead:
        return error_response(503, "the engine is not running", None, "server_unavailable")
    return JSONResponse({"prefix_caching": state.prefix_caching, "num_blocks_dropped": dropped})


@metrics_router.get("/metrics", response_class=PlainTextResponse,
                    responses={200: {"description": "Prometheus text exposition format",
                                     "content": {"text/plain": {"schema": {"type": "string"}}}}})
async def prom(state: State) -> Response:
    engine = state.engine
    try:
        scheduler, output_processor, kv_usage = await engine.metrics_sources()
    except EngineDead:  # the counters recorded so far are still served
        scheduler, output_processor, kv_usage = None, None, 0.0
    body = state.metrics.render(engine.num_running, engine.num_waiting, kv_usage, engine.num_preemptions,
                                scheduler=scheduler, output_processor=output_processor)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
