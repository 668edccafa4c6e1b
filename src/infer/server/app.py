"""The OpenAI-compatible HTTP API (FastAPI): the app factory, :func:`build_app`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``, and vLLM's ``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info``, ``POST /reset_prefix_cache``, and with ``--live-page``
the live page's ``GET /live``, ``/live/snapshot`` and ``/live/events``. Response shapes are
OpenAI's, so the official ``openai`` client works unchanged; streaming is Server-Sent Events
(``data: {...}`` chunks, then ``data: [DONE]``). Every bad request gets a 4xx with OpenAI's error
body ``{"error": {"message", "type", "param", "code"}}``; the engine never sees it. A request whose
engine step failed gets a 500 (a stream: a last error event), and 503 once the engine has
stopped (see ``async_engine.py``). ``GET /openapi.json`` types every request and response.
With an API key (``auth.py``), every route but ``/health`` and ``/metrics`` answers 401 to a
request without ``Authorization: Bearer <key>``.

A request's path, e.g. ``POST /v1/chat/completions`` (``routes/chat.py``):

1. FastAPI parses the JSON body into the request model of ``protocol.py`` (a pydantic error
   becomes a 400 here, in :func:`validation_error`), then calls the route's handler (``chat``)
   with it and the server's state (``serving.ServerState``).
2. Parse: ``parse_chat`` turns the request into engine inputs (token ids, ``SamplingParams``),
   or raises ``Reject`` with an OpenAI-shaped 4xx, which :func:`rejected` sends.
3. Engine: ``submit_all`` hands the prompts to the engine thread (``AsyncEngine``) and gets one
   stream of outputs per prompt; ``collect`` reads them to the end, or the response reads them
   as they come.
4. Shape: ``chat_response`` builds the JSON body, or ``ChatStream.chat_sse`` the SSE chunks.

This module only wires: the state the handlers read (``app.state.server``), the error handlers,
the body-size limit, the HTTP metrics, the OpenAPI schema with the served model's bounds, and the
routers of ``routes/`` (each endpoint's code), the API key's check attached to those it protects.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.engine.live_view import LiveView
from infer.server.async_engine import AsyncEngine
from infer.server.auth import api_key_dependency
from infer.server.metrics import Metrics
from infer.server.protocol import MAX_N
from infer.server.responses import Reject, error_response
from infer.server.routes import admin, chat, completions, health, live, lora, models
from infer.server.serving import ServerState

MAX_BODY_BYTES = 8 << 20  # a larger request body is answered 413

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's union tags in an error's loc

# ---------------------------------------------------------------------------- errors


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body pydantic refused: 400 (not FastAPI's 422) naming the first field at fault in
    ``param``; a body that is not JSON at all: 400 without ``param``."""
    errs = exc.errors()
    # for a union (prompt: str | list...), a value of the right shape but out of range says more
    # than "Input should be a valid string" from the first member
    first = next((e for e in errs if not e.get("type", "").endswith("_type")), errs[0] if errs else {})
    # "body" and the union members' tags ("list[str]", "Chat"...) are not fields
    loc = [str(p) for p in first.get("loc", []) if isinstance(p, int) or (
        p != "body" and p.isidentifier() and p[:1].islower() and p not in _TYPE_TAGS)]
    if first.get("type") == "json_invalid":
        return error_response(400, "the request body is not valid JSON", None)
    param = loc[0] if loc else None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        msg = f"unknown or unsupported field {'.'.join(loc)!r}"
    elif loc:
        msg = f"{'.'.join(loc)}: {msg}"
    return error_response(400, msg, param)


async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (404 unknown path, 405 wrong method, 413) in OpenAI's error body."""
    r = error_response(exc.status_code, str(exc.detail), None,
                       "not_found_error" if exc.status_code == 404 else "invalid_request_error")
    r.headers.update(exc.headers or {})  # 405: Allow
    return r


async def rejected(request: Request, exc: Reject) -> JSONResponse:
    """A request a handler refused before the engine saw it: the response it was refused with."""
    return exc.response


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Any other exception: 500 ``internal_error`` in OpenAI's body, never a bare 500 page."""
    return error_response(500, f"internal error: {type(exc).__name__}", None, "internal_error")


class _BodyLimit:
    """ASGI middleware: HTTP 413 for a request body over ``max_bytes``.

    A declared ``Content-Length`` is checked before anything is read; a body without one
    (``Transfer-Encoding: chunked``) is counted as it arrives, and reading stops at the limit
    (the 413 then comes from the ``HTTPException`` handler, which FastAPI lets through).
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"request body larger than {self.max_bytes} bytes"
        size = dict(scope["headers"]).get(b"content-length")
        if size is not None and (not size.isdigit() or int(size) > self.max_bytes):
            await error_response(413, message, None)(scope, receive, send)
            return
        seen = 0

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise StarletteHTTPException(413, message)
            return msg

        await self.app(scope, limited_receive, send)


# ---------------------------------------------------------------------------- OpenAPI schema


def _fill_limits(node: Any, limits: dict[str, Any]) -> None:
    """Replace the ``x-infer-limit`` markers of the request models (protocol.py) by the served
    model's bounds: ``maximum`` for an integer, ``maxItems`` for an array (``vocab``, ``context``,
    ``n``), ``enum`` for the model's name (``model``), ``pattern`` for a text prompt
    (``prompt_text``; none when every character has a token)."""
    if isinstance(node, dict):
        kind = node.pop("x-infer-limit", None)
        if kind is not None and limits.get(kind) is not None:
            key = {"model": "enum", "prompt_text": "pattern"}.get(kind)
            node[key or ("maxItems" if node.get("type") == "array" else "maximum")] = limits[kind]
        for v in node.values():
            _fill_limits(v, limits)
    elif isinstance(node, list):
        for v in node:
            _fill_limits(v, limits)


def _prompt_pattern(tokenizer) -> str | None:
    """A text prompt encodes to at least one token when it holds a character that has one: the
    regex of such a character, from the characters below U+0100 (every byte of a byte-level BPE)
    that encode to nothing alone (SmolLM2: six ASCII control characters). None if there are none."""
    none = [c for c in map(chr, range(0x100)) if not tokenizer.encode(c, add_special_tokens=False)]
    return "[^" + "".join(f"\\u{ord(c):04x}" for c in none) + "]" if none else None


def openapi_schema(app: FastAPI, limits: dict[str, int]) -> dict:
    """FastAPI's schema of ``app``, minus its 422 (this server answers 400), with the model's
    bounds (``limits``: ``vocab``, ``context``, ``n``; and, from ``app.state.server``, its name
    and the characters its tokenizer has no token for); built once, then cached on the app."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version="1.0", description=app.description, routes=app.routes)
        for path in schema["paths"].values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        state = app.state.server
        _fill_limits(schema, {**limits, "model": [state.model_name],
                              "prompt_text": _prompt_pattern(state.tokenizer)})
        app.openapi_schema = schema
    return app.openapi_schema


# ---------------------------------------------------------------------------- the app


def build_app(engine: AsyncEngine, model_name: str, max_body_bytes: int = MAX_BODY_BYTES,
              api_key: str | None = None, live_page: bool = False,
              lora_modules: dict[str, str] | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` under the model name ``model_name``.

    Wires what the routes need (``app.state.server``, a ``ServerState``; also ``app.state.engine``
    and ``app.state.metrics``), counts each finished request in the Prometheus metrics
    (``engine.on_finished``) and each HTTP request by route and status (``http_requests_total``),
    answers every error in OpenAI's body, refuses bodies over ``max_body_bytes`` (413) and
    includes the routers of ``routes/``. With ``api_key``, every router but ``/health``'s and
    ``/metrics``' requires ``Authorization: Bearer <api_key>`` (``auth.py``). With ``live_page``,
    the live page's routes (``routes/live.py``) are added and the engine publishes its steps to a
    :class:`~infer.engine.live_view.LiveView` (build the app before the engine serves requests).
    With an engine that has ``enable_lora`` (phase 16), ``lora_modules`` (``{name: adapter
    directory}``) are served under their names, and ``routes/lora.py`` loads and unloads adapters at
    runtime.

    Raises:
        ValueError: ``lora_modules`` without ``enable_lora``, a name taken twice, or an adapter the engine
            cannot serve (the reason).
    """
    app = FastAPI(title="infer", description="OpenAI-compatible API of the infer engine")
    info = engine.info
    limits = {"vocab": info.vocab_size - 1, "context": info.max_model_len - 1, "n": min(MAX_N, info.max_num_seqs)}
    app.openapi = lambda: openapi_schema(app, limits)

    metrics = Metrics(model_name, info.max_model_len, info.cache_config)
    engine.on_finished = metrics.request_finished
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.server = state = ServerState(engine, model_name, metrics, info.tokenizer, info.prefix_caching,
                                           int(time.time()))
    if lora_modules and not info.lora_enabled:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, path in (lora_modules or {}).items():
        if name == model_name:
            raise ValueError(f"LoRA module name {name!r} is the served model's name")
        # read and checked now (nothing runs yet)
        engine.call_blocking(functools.partial(lora.load_adapter, state.add_lora_name(name, path)))
    if live_page and engine.engine is None:
        raise ValueError("the live page (--live-page) watches the engine's steps in the server's process: it does "
                         "not work with --engine-process")

    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Reject, rejected)
    app.add_exception_handler(Exception, unexpected_error)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    # outermost middleware: counts every response, the 413s above and the 500s of an exception
    # included, labelled with the route's template (``/v1/models/{model_id:path}``, never the raw
    # path; ``none`` for an unknown path) and the exact status; /metrics and /health are left out
    # (polled by scrapers and probes, they would drown the API's counts), as vLLM does
    Instrumentator(should_group_status_codes=False, excluded_handlers=["^/metrics$", "^/health$", "^/live"],
                   registry=metrics.registry).instrument(app)

    protected = [api_key_dependency(api_key)] if api_key else []
    # in this order, the paths of /openapi.json (and /docs) are listed as they always were
    app.include_router(health.router)
    app.include_router(models.router, dependencies=protected)
    app.include_router(admin.router, dependencies=protected)
    app.include_router(admin.metrics_router)
    app.include_router(completions.router, dependencies=protected)
    app.include_router(chat.router, dependencies=protected)
    if live_page:  # the engine thread is idle (no request yet): hooking the listener in here is safe
        app.state.live = live.LiveState(engine, LiveView(engine.engine))
        app.include_router(live.page_router)
        app.include_router(live.data_router, dependencies=protected)
    if info.lora_enabled:
        app.include_router(lora.router, dependencies=protected)
    return app
