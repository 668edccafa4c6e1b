"""The OpenAI-compatible HTTP API (FastAPI).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics``, and vLLM's ``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info``. Response shapes are OpenAI's, so the official ``openai``
client works unchanged; streaming is Server-Sent Events (``data: {...}`` chunks, then
``data: [DONE]``). Every bad request gets a 4xx with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``; the engine never sees it. A request whose
engine step failed gets a 500 (a stream: a last error event), and 503 once the engine has
stopped (see ``async_engine.py``). ``GET /openapi.json`` types every request and response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.chat import apply_chat_template
from infer.errors import InvalidRequestError
from infer.outputs import PositionLogprobs, RequestOutput
from infer.sampling import SamplingParams
from infer.server.async_engine import AsyncEngine, EngineDead, EngineOverloaded, RequestFailed
from infer.server.metrics import Metrics
from infer.server.protocol import (
    MAX_N,
    MAX_SEQS_PER_REQUEST,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    UnsupportedField,
)

log = logging.getLogger("infer.server")

MAX_BODY_BYTES = 8 << 20
# MAX_SEQS_PER_REQUEST: sequences (prompts x n) one completions request may carry; what does not
# fit max_num_seqs waits in the engine's queue (evaluation harnesses send hundreds of prompts)

_ERROR_DOCS = {
    400: "Invalid request: OpenAI's error body, `param` names the field",
    404: "Unknown model (`code`: model_not_found)",
    405: "Method not allowed on this path (the `Allow` header lists the allowed one)",
    413: "Request body larger than the limit (8 MiB)",
    500: "The engine step that ran this request failed; the server serves on",
    503: "The waiting queue is full (`server_overloaded`) or the engine stopped (`server_unavailable`)",
}
# One Server-Sent Event (Open API 3.1: a text/event-stream ``schema`` describes each event)
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "description": "with `stream: true`: one event per chunk (the JSON of a chunk, shaped like the 200 body with "
                   "one choice: `text` or `delta`), an error body as the last event if the request failed, then "
                   "`[DONE]`",
    "properties": {"data": {"type": "string", "description": "a JSON chunk, an error body, or [DONE]"},
                   "event": {"type": "string"}}}}}


def _responses(ok_model, ok_description: str, *errors: int, stream: bool = False) -> dict:
    """FastAPI ``responses=`` for the OpenAPI schema: the 200 body and the documented errors."""
    ok: dict[str, Any] = {"model": ok_model, "description": ok_description}
    if stream:
        ok["content"] = _SSE
    return {200: ok, **{c: {"model": ErrorResponse, "description": _ERROR_DOCS[c]} for c in (*errors, 405)}}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}  # pydantic's union tags in an error's loc


def _fill_limits(node: Any, limits: dict[str, int]) -> None:
    """Replace the ``x-infer-limit`` markers of the request models (protocol.py) by the served
    model's bounds: ``maximum`` for an integer, ``maxItems`` for an array."""
    if isinstance(node, dict):
        kind = node.pop("x-infer-limit", None)
        if kind is not None:
            node["maxItems" if node.get("type") == "array" else "maximum"] = limits[kind]
        for v in node.values():
            _fill_limits(v, limits)
    elif isinstance(node, list):
        for v in node:
            _fill_limits(v, limits)


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(message, param, type_, code))


# what a request's stream may end with instead of a final output
ENGINE_FAILURES = (RequestFailed, EngineDead)


def failure_status_and_body(exc: BaseException) -> tuple[int, dict]:
    """A request the engine failed: 500 (its step failed; the engine serves on) or 503 (the
    engine stopped)."""
    if isinstance(exc, EngineDead):
        return 503, error_body(str(exc), None, "server_unavailable")
    return 500, error_body(str(exc), None, "internal_error")


def failure_response(exc: BaseException) -> JSONResponse:
    status, body = failure_status_and_body(exc)
    return JSONResponse(status_code=status, content=body)


#: the logprob reported for a token the distribution gives no probability: OpenAI's value, and vLLM's
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    """``logprob`` as a JSON number: -inf (a token that a constraint, top-k or top-p took out of the
    distribution, listed among the ``top_logprobs``) and NaN (non-finite logits) become
    :data:`LOGPROB_FLOOR`, as do values below it. JSON has no -Infinity or NaN: Starlette refuses to
    encode them (a 500) and a stream would carry text no JSON parser reads."""
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def sse_event(obj: Any) -> str:
    """One Server-Sent Event carrying ``obj`` as JSON: ``data: {...}`` and a blank line.

    The JSON is ASCII-escaped. SSE itself ends lines only at CR or LF, but generated text can hold
    any character, and clients that split lines as Python's ``str.splitlines`` does (httpx's
    ``iter_lines``, and so every client built on it) also break at U+0085, U+2028, U+2029 and the
    control characters 0x0B-0x0C, 0x1C-0x1E: raw in the payload, they would cut the event in two.
    Escaped (``\\u2028``), they cannot, and every JSON parser reads them back.
    """
    return f"data: {json.dumps(obj, ensure_ascii=True)}\n\n"


def failure_event(exc: BaseException) -> str:
    """The last SSE event of a stream whose request failed (vLLM's shape: the error body, then
    ``data: [DONE]``); the ``openai`` client raises ``APIError`` on it."""
    return sse_event(failure_status_and_body(exc)[1])


def _param_of(exc: ValueError) -> str | None:
    """SamplingParams' messages start with the field name ("temperature must be ...")."""
    param = getattr(exc, "param", None)
    if param:
        return param
    first = str(exc).split(" ", 1)[0].split("[", 1)[0]
    return first if first.isidentifier() and first.islower() else None


class _Reject(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


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


def build_app(engine: AsyncEngine, model_name: str, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI application serving ``engine`` under the model name ``model_name``."""
    app = FastAPI(title="infer", description="OpenAI-compatible API of the infer engine")
    eng = engine.engine
    limits = {"vocab": eng.vocab_size - 1, "context": eng.max_model_len - 1,
              "n": min(MAX_N, eng.scheduler.max_num_seqs)}

    def openapi() -> dict:
        """FastAPI's schema, minus its 422 (this server answers 400), with the model's bounds."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1.0", description=app.description, routes=app.routes)
            for path in schema["paths"].values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            _fill_limits(schema, limits)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    metrics = Metrics(model_name)
    engine.on_finished = metrics.request_finished
    app.state.engine = engine
    app.state.metrics = metrics
    tokenizer = engine.engine.tokenizer
    created = int(time.time())

    # ------------------------------------------------------------------ errors

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
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

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        r = error_response(exc.status_code, str(exc.detail), None,
                           "not_found_error" if exc.status_code == 404 else "invalid_request_error")
        r.headers.update(exc.headers or {})  # 405: Allow
        return r

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # never a bare 500 page
        return error_response(500, f"internal error: {type(exc).__name__}", None, "internal_error")

    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)

    # ------------------------------------------------------------------ helpers

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise _Reject(error_response(404, f"model {name!r} does not exist; this server serves {model_name!r}",
                                         "model", "not_found_error", "model_not_found"))

    def sampling_or_reject(req) -> SamplingParams:
        """The request's :class:`SamplingParams`, or :class:`_Reject` with a 400 naming the bad field."""
        # >>> EXERCISE sampling_or_reject
        try:
            params = req.sampling_params()
        except UnsupportedField as e:
            raise _Reject(error_response(400, str(e), e.param)) from None
        except ValueError as e:
            raise _Reject(error_response(400, str(e), _param_of(e))) from None
        if params.n > MAX_N:
            raise _Reject(error_response(400, f"n must be <= {MAX_N}, got {params.n}", "n"))
        return params
        # <<< EXERCISE sampling_or_reject

    async def submit_all(prompts, params) -> list[tuple[AsyncIterator[RequestOutput], None]]:
        """Submit every prompt and wait for the engine to accept them (not to admit them);
        returns ``(stream, None)`` per prompt (the first output is awaited by the response, which
        notices disconnects). Nothing stays queued if one is rejected."""
        try:
            gens = await engine.submit_many(prompts, params)
        except EngineOverloaded as e:
            raise _Reject(error_response(503, str(e), None, "server_overloaded")) from None
        except EngineDead as e:
            raise _Reject(error_response(503, str(e), None, "server_unavailable")) from None
        except (InvalidRequestError, ValueError) as e:
            raise _Reject(error_response(400, str(e), _param_of(e))) from None
        return [(g, None) for g in gens]

    async def close_streams(tasks: list[asyncio.Task], streams) -> None:
        """Stop the tasks reading ``streams``, then close the streams (aborting unfinished requests).

        The tasks are waited for before closing: closing a stream that a task is still iterating
        raises "aclose(): asynchronous generator is already running". Shielded, because this runs
        while a streaming response is being cancelled (its client went away).
        """
        for t in tasks:
            t.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            for g, _ in streams:
                await g.aclose()

    async def collect(streams, request: Request) -> list[RequestOutput] | None:
        """Drain every stream to its final output; None (all aborted) if the client disconnects.

        Raises:
            RequestFailed / EngineDead: a stream ended with it (the others are aborted).
        """

        async def drain(gen, first):
            last = first
            if last is None or not last.finished:
                async for out in gen:
                    last = out
            return last

        tasks = [asyncio.create_task(drain(g, f)) for g, f in streams]
        try:
            while True:
                done, _ = await asyncio.wait(tasks, timeout=0.25)
                for t in done:
                    if t.exception() is not None:
                        raise t.exception()
                if len(done) == len(tasks):
                    return [t.result() for t in tasks]
                if await request.is_disconnected():
                    return None
        finally:
            await close_streams(tasks, streams)

    prefix_caching = engine.engine.config.prefix_caching

    def usage(outs: list[RequestOutput], score_only: bool = False) -> dict[str, Any]:
        """Token counts of ``outs`` (each request's latest output: a stream's outputs carry only
        their deltas, but ``num_generated_tokens`` counts them all); ``score_only``: nothing was
        generated."""
        p = sum(len(o.prompt_token_ids) for o in outs)
        c = 0 if score_only else sum(c.num_generated_tokens for o in outs for c in o.outputs)
        u: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if prefix_caching:  # OpenAI's and vLLM's report of prompt tokens served from the cache
            u["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)}
        return u

    def completion_lp_block(prompt_ids: list[int] | None, prompt_lps, gen_lps, start: int = 0) -> dict:
        """The legacy ``logprobs`` object: the echoed prompt's tokens (``prompt_ids``), then the
        generated ones. ``top_logprobs[i]`` is a dict wherever ``token_logprobs[i]`` is a number,
        None where it is None (the first prompt token); ``text_offset`` counts characters from
        ``start`` (a stream's earlier chunks)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        off = start

        def add(text: str, e: PositionLogprobs | None):
            nonlocal off
            tokens.append(text)
            token_lps.append(None if e is None else json_logprob(e.token.logprob))
            tops.append(None if e is None else {t.decoded: json_logprob(t.logprob) for t in e.top})
            offsets.append(off)
            off += len(text)

        if prompt_ids is not None:
            for i, tid in enumerate(prompt_ids):
                e = prompt_lps[i] if prompt_lps and i < len(prompt_lps) else None
                add(tokenizer.decode([tid], skip_special_tokens=False), e)
        for e in gen_lps or []:
            add(e.token.decoded, e)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def chat_lp_block(entries: list[PositionLogprobs]) -> dict:
        def one(t):
            return {"token": t.decoded, "logprob": json_logprob(t.logprob), "bytes": list(t.decoded.encode("utf-8"))}

        return {"content": [{**one(e.token), "top_logprobs": [one(t) for t in e.top]} for e in entries]}

    def render_chat(messages: list[dict], add_generation_prompt: bool, kwargs: dict | None) -> str:
        try:
            return apply_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                       **(kwargs or {}))
        except ValueError as e:
            raise _Reject(error_response(400, str(e), "messages")) from None
        except TypeError as e:  # chat_template_kwargs clashing with the renderer's own arguments
            raise _Reject(error_response(400, f"chat_template_kwargs: {e}", "chat_template_kwargs")) from None

    # ------------------------------------------------------------------ endpoints

    @app.get("/health", responses={200: {"model": HealthResponse, "description": "The engine is running"},
                                   503: {"model": ErrorResponse, "description": "The engine stopped"}})
    async def health() -> Response:
        if not engine.alive:
            return error_response(503, "the engine is not running", None, "server_unavailable")
        return JSONResponse({"status": "ok"})

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "infer",
                "max_model_len": engine.engine.max_model_len}

    @app.get("/v1/models", responses=_responses(ModelList, "The served model"))
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}", responses=_responses(ModelCard, "The model", 404))
    async def model(model_id: str) -> JSONResponse:
        try:
            check_model(model_id)
        except _Reject as r:
            return r.response
        return JSONResponse(model_card())

    # vLLM's tokenizer endpoints (lm-eval's remote tokenizer uses them)

    @app.post("/tokenize", responses=_responses(TokenizeResponse, "The prompt's token ids", 400, 404, 413))
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        try:
            check_model(req.model)
            if isinstance(req, TokenizeChatRequest):
                text = render_chat(req.message_dicts(), req.add_generation_prompt, req.chat_template_kwargs)
            else:
                text = req.prompt
        except _Reject as r:
            return r.response
        ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        strs = [tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.engine.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize", responses=_responses(DetokenizeResponse, "The text of the token ids", 400, 404, 413))
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        try:
            check_model(req.model)
        except _Reject as r:
            return r.response
        vocab = engine.engine.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            return error_response(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
        return JSONResponse({"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)})

    @app.get("/tokenizer_info", responses=_responses(TokenizerInfoResponse, "The tokenizer's special tokens, "
                                                     "chat template and lengths"))
    async def tokenizer_info() -> JSONResponse:
        specials = getattr(tokenizer, "special_tokens", None) or {}
        return JSONResponse({
            "tokenizer_class": type(tokenizer).__name__,
            **{k: specials.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")},
            "chat_template": getattr(tokenizer, "chat_template", None),
            "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False)),
            "model_max_length": engine.engine.max_model_len,
            "vocab_size": engine.engine.vocab_size,
        })

    @app.post("/reset_prefix_cache", responses=_responses(ResetPrefixCacheResponse, "The prefix cache was reset", 503))
    async def reset_prefix_cache() -> JSONResponse:
        """vLLM's endpoint: forget every cached KV block (phase 7), e.g. between benchmark runs."""
        try:
            dropped = await engine.call(lambda eng: eng.reset_prefix_cache())
        except EngineDead:
            return error_response(503, "the engine is not running", None, "server_unavailable")
        return JSONResponse({"prefix_caching": prefix_caching, "num_blocks_dropped": dropped})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prom() -> Response:
        body = metrics.render(engine.num_running, engine.num_waiting, engine.engine.scheduler.kv_cache_usage(),
                              engine.num_preemptions, scheduler=engine.engine.scheduler)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions", responses=_responses(CompletionResponse, "The completion", 400, 404, 413, 500,
                                                      503, stream=True))
    async def completions(req: CompletionRequest, request: Request):
        try:
            check_model(req.model)
            params = sampling_or_reject(req)
            try:
                prompts = req.prompts()
            except UnsupportedField as e:
                raise _Reject(error_response(400, str(e), e.param)) from None
            if len(prompts) * params.n > MAX_SEQS_PER_REQUEST:
                raise _Reject(error_response(
                    400, f"a request may carry at most {MAX_SEQS_PER_REQUEST} sequences (prompts x n); got "
                    f"{len(prompts)} prompts x n={params.n}: split the prompt list", "prompt"))
            streams = await submit_all(prompts, params)
        except _Reject as r:
            return r.response
        rid = f"cmpl-{uuid.uuid4().hex}"
        want_lp = req.logprobs is not None
        score_only = req.score_only  # echo with max_tokens 0: the generated token is dropped
        if req.ignored_fields():
            log.debug("%s: ignoring %s (no effect on generation)", rid, ", ".join(req.ignored_fields()))

        def choice_index(i: int, j: int) -> int:
            return i * params.n + j

        if not req.stream:
            try:
                outs = await collect(streams, request)
            except ENGINE_FAILURES as e:
                return failure_response(e)
            if outs is None:
                return Response(status_code=499)  # the client closed the connection: nobody reads this
            choices = []
            for i, out in enumerate(outs):
                prefix = (out.prompt or tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)) \
                    if req.echo else ""
                for c in out.outputs:
                    lp = None
                    if want_lp:
                        lp = completion_lp_block(out.prompt_token_ids if req.echo else None, out.prompt_logprobs,
                                                 None if score_only else c.logprobs)
                    choices.append({"index": choice_index(i, c.index), "text": prefix + ("" if score_only else c.text),
                                    "logprobs": lp, "finish_reason": c.finish_reason})
            choices.sort(key=lambda ch: ch["index"])
            return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()),
                                 "model": model_name, "choices": choices, "usage": usage(outs, score_only)})

        include_usage, continuous_usage = req.include_usage, req.continuous_usage

        async def events():
            finals: dict[int, RequestOutput] = {}
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i, gen, first):
                try:
                    if first is not None:
                        await queue.put((i, first))
                        if first.finished:
                            return
                    async for out in gen:
                        await queue.put((i, out))
                except ENGINE_FAILURES as e:
                    await queue.put((i, e))
                finally:
                    await queue.put((i, None))

            tasks = [asyncio.create_task(pump(i, g, f)) for i, (g, f) in enumerate(streams)]
            open_streams = len(tasks)
            echoed: set[tuple[int, int]] = set()
            ended: set[tuple[int, int]] = set()
            offsets: dict[tuple[int, int], int] = {}  # text_offset reached by each choice
            failed = None
            try:
                while open_streams:
                    i, out = await queue.get()
                    if out is None:
                        open_streams -= 1
                        continue
                    if isinstance(out, BaseException):
                        failed = out
                        break
                    for c in out.outputs:
                        if (i, c.index) in ended:
                            continue
                        if c.finish_reason:
                            ended.add((i, c.index))
                        key = (i, c.index)
                        text = "" if score_only else c.delta_text
                        lp = None
                        echo_ids = None
                        if req.echo and key not in echoed:
                            echoed.add(key)
                            text = (out.prompt or tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)) \
                                + text
                            echo_ids = out.prompt_token_ids
                        if want_lp:
                            lp = completion_lp_block(echo_ids, out.prompt_logprobs,
                                                     None if score_only else c.delta_logprobs, offsets.get(key, 0))
                            offsets[key] = offsets.get(key, 0) + sum(len(t) for t in lp["tokens"])
                        if not text and not c.finish_reason and not (c.delta_token_ids and not score_only):
                            continue
                        extra = {"usage": usage([out], score_only)} if continuous_usage else {}
                        yield sse_event({"id": rid, "object": "text_completion", "created": int(time.time()),
                                   "model": model_name, "choices": [{"index": choice_index(i, c.index), "text": text,
                                                                     "logprobs": lp,
                                                                     "finish_reason": c.finish_reason}], **extra})
                    if out.finished:
                        finals[i] = out
                if failed is not None:
                    yield failure_event(failed)
                elif include_usage:
                    yield sse_event({"id": rid, "object": "text_completion", "created": int(time.time()),
                               "model": model_name, "choices": [],
                               "usage": usage(list(finals.values()), score_only)})
                yield "data: [DONE]\n\n"
            finally:
                await close_streams(tasks, streams)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions", responses=_responses(ChatCompletionResponse, "The chat completion", 400, 404,
                                                           413, 500, 503, stream=True))
    async def chat(req: ChatCompletionRequest, request: Request):
        try:
            check_model(req.model)
            params = sampling_or_reject(req)
            tools = req.tool_spec()  # checked by sampling_or_reject
            template_kwargs = req.chat_template_kwargs
            if tools.template_tools is not None:
                template_kwargs = {**(template_kwargs or {}), "tools": tools.template_tools}
            text = render_chat(req.message_dicts(), req.add_generation_prompt, template_kwargs)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if not ids:
                raise _Reject(error_response(400, "the chat template rendered these messages to zero tokens",
                                             "messages"))
            streams = await submit_all([ids], params)
        except _Reject as r:
            return r.response
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.ignored_fields():
            log.debug("%s: ignoring %s (no effect on generation)", rid, ", ".join(req.ignored_fields()))

        if not req.stream:
            try:
                outs = await collect(streams, request)
            except ENGINE_FAILURES as e:
                return failure_response(e)
            if outs is None:
                return Response(status_code=499)
            out = outs[0]
            choices = [{"index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": chat_lp_block(c.logprobs) if req.logprobs else None,
                        "finish_reason": c.finish_reason} for c in out.outputs]
            if tools.choice != "none":  # phase 13: the output as OpenAI tool calls
                for ch, c in zip(choices, out.outputs):
                    content, calls = tools.calls_from_output(c.text)
                    if calls:
                        ch["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                        ch["finish_reason"] = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
            return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                                 "model": model_name, "choices": choices, "usage": usage(outs)})

        include_usage, continuous_usage = req.include_usage, req.continuous_usage
        gen, first = streams[0]

        def chunk(choices: list[dict], **extra) -> str:
            return sse_event({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                        "model": model_name, "choices": choices, **extra})

        def usage_so_far(out: RequestOutput | None) -> dict:
            """``stream_options.continuous_usage_stats``: the usage up to this chunk, in every chunk."""
            if not continuous_usage:
                return {}
            if out is None:
                return {"usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}}
            return {"usage": usage([out])}

        async def request_outputs() -> AsyncIterator[RequestOutput]:
            """The request's outputs (deltas), as the engine thread hands them over."""
            if first is not None:
                yield first
                if first.finished:
                    return
            async for o in gen:
                yield o

        async def chat_sse(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
            """The SSE lines of a streamed chat completion, from the request's outputs.

            First a chunk giving each of the ``n`` choices its role; then, per output and per
            sequence with something new, a chunk with that choice's ``delta`` (its new text) and, on
            its last chunk, its ``finish_reason`` (each index ends once); with
            ``stream_options.include_usage`` a chunk with empty ``choices`` and ``usage``; then
            ``data: [DONE]``.
            """
            yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for j in range(params.n)], **usage_so_far(None))
            # >>> EXERCISE chat_sse
            last = None
            ended: set[int] = set()
            async for out in outputs:
                last = out
                for c in out.outputs:
                    if c.index in ended:
                        continue
                    if c.finish_reason:
                        ended.add(c.index)
                    if not c.delta_text and not c.finish_reason and not c.delta_token_ids:
                        continue
                    delta = {"content": c.delta_text} if (c.delta_text or not c.finish_reason) else {}
                    yield chunk([{"index": c.index, "delta": delta,
                                  "logprobs": chat_lp_block(c.delta_logprobs or []) if req.logprobs else None,
                                  "finish_reason": c.finish_reason}], **usage_so_far(out))
            if include_usage and last is not None:
                yield chunk([], usage=usage([last]))
            yield "data: [DONE]\n\n"
            # <<< EXERCISE chat_sse

        async def chat_sse_tools(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
            """Streaming with tools (phase 13): a constrained call (named, required) is held back and
            sent as one ``tool_calls`` delta when it is complete; with ``auto``, text streams until a
            ``<tool_call>`` tag may begin, and what follows is held back and parsed at the end."""
            yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for j in range(params.n)], **usage_so_far(None))
            tag = "<tool_call>"
            sent: dict[int, int] = {}  # characters of each choice's text already streamed as content
            held: dict[int, bool] = {}  # a call began: hold the rest back
            texts: dict[int, str] = {}  # each choice's text so far (the outputs carry deltas)
            last = None
            async for out in outputs:
                last = out
                for c in out.outputs:
                    if c.index in held and held[c.index] is None:
                        continue  # ended
                    text = texts[c.index] = texts.get(c.index, "") + c.delta_text
                    n = sent.get(c.index, 0)
                    if tools.choice == "auto" and not held.get(c.index):
                        at = text.find(tag, n)
                        end = at if at >= 0 else len(text)
                        if at < 0:  # keep back a tail that could be the start of the tag
                            end = next((k for k in range(max(n, len(text) - len(tag) + 1), len(text))
                                        if tag.startswith(text[k:])), len(text))
                        if at >= 0:
                            held[c.index] = True
                        if end > n:
                            yield chunk([{"index": c.index, "delta": {"content": text[n:end]}, "logprobs": None,
                                          "finish_reason": None}], **usage_so_far(out))
                            sent[c.index] = n = end
                    if not c.finish_reason:
                        continue
                    content, calls = tools.calls_from_output(text)
                    if calls:
                        delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
                        reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
                    else:
                        delta = {"content": text[n:]} if text[n:] else {}
                        reason = c.finish_reason
                    held[c.index] = None
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": reason}],
                                **usage_so_far(out))
            if include_usage and last is not None:
                yield chunk([], usage=usage([last]))
            yield "data: [DONE]\n\n"

        async def events():
            sse_lines = chat_sse if tools.choice == "none" else chat_sse_tools
            try:
                async with contextlib.aclosing(sse_lines(request_outputs())) as lines:
                    async for line in lines:
                        yield line
            except ENGINE_FAILURES as e:
                yield failure_event(e)
                yield "data: [DONE]\n\n"
            finally:
                await close_streams([], streams)

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
