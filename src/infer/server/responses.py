"""OpenAI's response shapes that every route shares: error bodies, SSE events, logprob numbers, usage.

The last step of a request's path (parse -> engine -> shape, see ``app.py``) builds plain dicts
and strings from these helpers; the routes (``routes/``) add the fields of their own endpoint.

- Errors: every 4xx and 5xx carries OpenAI's body ``{"error": {"message", "type", "param",
  "code"}}`` (:func:`error_body`). A request refused before it reaches the engine is
  :class:`Reject`, raised anywhere below a route handler and answered by the app's exception
  handler; a request the engine failed answers 500 or 503 (:func:`failure_response`), or, once
  streaming, ends with an error event (:func:`failure_event`).
- Streams: one Server-Sent Event per chunk (:func:`sse_event`), then ``data: [DONE]``.
- The OpenAPI documentation of those responses (:func:`openapi_responses`), which the route
  decorators pass to FastAPI.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi.responses import JSONResponse

from infer.outputs import RequestOutput
from infer.server.async_engine import EngineDead, RequestFailed
from infer.server.protocol import ErrorResponse

# ---------------------------------------------------------------------------- errors


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: str | None = None) -> dict:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                   code: str | None = None) -> JSONResponse:
    """HTTP ``status`` with :func:`error_body` (``param`` names the request field at fault)."""
    return JSONResponse(status_code=status, content=error_body(message, param, type_, code))


class Reject(Exception):
    """A request refused before the engine sees it: raised with the error response to send
    (``Reject(error_response(400, message, param))``); the app's handler for it answers with
    ``response`` as it is."""

    def __init__(self, response: JSONResponse) -> None:
        self.response = response


# what a request's stream may end with instead of a final output
ENGINE_FAILURES = (RequestFailed, EngineDead)


def failure_status_and_body(exc: BaseException) -> tuple[int, dict]:
    """A request the engine failed: 500 (its step failed; the engine serves on) or 503 (the
    engine stopped)."""
    if isinstance(exc, EngineDead):
        return 503, error_body(str(exc), None, "server_unavailable")
    return 500, error_body(str(exc), None, "internal_error")


def failure_response(exc: BaseException) -> JSONResponse:
    """The answer to a non-streamed request whose stream ended with ``exc`` (one of
    :data:`ENGINE_FAILURES`): 500 ``internal_error`` or 503 ``server_unavailable``."""
    status, body = failure_status_and_body(exc)
    return JSONResponse(status_code=status, content=body)


# ---------------------------------------------------------------------------- bodies and events

#: the logprob reported for a token the distribution gives no probability: OpenAI's value, and vLLM's
LOGPROB_FLOOR = -9999.0


def json_logprob(logprob: float) -> float:
    """``logprob`` as a JSON number: -inf (a token that a constraint, top-k or top-p took out of the
    distribution, listed among the ``top_logprobs``) and NaN (non-finite logits) become
    :data:`LOGPROB_FLOOR`, as do values below it. JSON has no -Infinity or NaN: Starlette refuses to
    encode them (a 500) and a stream would carry text no JSON parser reads."""
    return logprob if math.isfinite(logprob) and logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def usage(outs: list[RequestOutput], prefix_caching: bool, score_only: bool = False) -> dict[str, Any]:
    """The ``usage`` object: token counts of ``outs`` (each request's latest output: a stream's
    outputs carry only their deltas, but ``num_generated_tokens`` counts them all). With
    ``prefix_caching`` it reports the prompt tokens served from the cache too; ``score_only``:
    nothing was generated (``completion_tokens`` 0)."""
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = 0 if score_only else sum(c.num_generated_tokens for o in outs for c in o.outputs)
    u: dict[str, Any] = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
    if prefix_caching:  # OpenAI's and vLLM's report of prompt tokens served from the cache
        u["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)}
    return u


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


# ---------------------------------------------------------------------------- OpenAPI documentation

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


def openapi_responses(ok_model, ok_description: str, *errors: int, stream: bool = False) -> dict:
    """FastAPI's ``responses=`` for a route: the 200 body (``ok_model``; with ``stream``, also one
    SSE event) and OpenAI's error body for each status in ``errors``, and for 405."""
    ok: dict[str, Any] = {"model": ok_model, "description": ok_description}
    if stream:
        ok["content"] = _SSE
    return {200: ok, **{c: {"model": ErrorResponse, "description": _ERROR_DOCS[c]} for c in (*errors, 405)}}


def text_responses(ok_description: str, *errors: int) -> dict:
    """:func:`openapi_responses` for a route whose 200 body is plain text (vLLM's LoRA endpoints)."""
    return {200: {"description": ok_description, "content": {"text/plain": {"schema": {"type": "string"}}}},
            **{c: {"model": ErrorResponse, "description": _ERROR_DOCS[c]} for c in (*errors, 405)}}
