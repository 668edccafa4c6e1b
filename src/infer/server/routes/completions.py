"""``POST /v1/completions``: OpenAI's legacy completions, for one prompt or many.

The path of a request: :func:`parse_completion` (the body to prompts and
:class:`~infer.sampling.SamplingParams`, or a 4xx), ``submit_all`` (every prompt to the engine
thread at once), then :func:`completion_response` (one JSON body) or :func:`completion_sse` (the
Server-Sent Events of ``stream: true``). Choice ``i * n + j`` is the ``j``-th sequence of the
``i``-th prompt. With ``echo`` the prompt comes first in each choice's text (and in its logprobs);
``echo`` with ``max_tokens: 0`` only scores the prompt (``score_only``: the one token the engine
generates is dropped).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from infer.outputs import PositionLogprobs, RequestOutput
from infer.sampling import SamplingParams
from infer.server.protocol import (
    MAX_SEQS_PER_REQUEST,
    CompletionRequest,
    CompletionResponse,
    UnsupportedField,
)
from infer.server.responses import (
    ENGINE_FAILURES,
    Reject,
    error_response,
    failure_event,
    failure_response,
    json_logprob,
    openapi_responses,
    sse_event,
    usage,
)
from infer.server.serving import (
    ServerState,
    State,
    Streams,
    check_model,
    collect,
    merged_outputs,
    response_model,
    sampling_or_reject,
    submit_all,
)

log = logging.getLogger("infer.server")
router = APIRouter()


def parse_completion(req: CompletionRequest, state: ServerState) -> tuple[list[str | list[int]], SamplingParams]:
    """The request's prompts (texts or token-id lists) and its sampling parameters.

    Raises:
        Reject: 404 for another model's name; 400 naming the field for a bad value, a field infer
            does not implement, or more than ``MAX_SEQS_PER_REQUEST`` sequences (prompts x ``n``).
    """
    check_model(req.model, state)
    params = sampling_or_reject(req)
    try:
        prompts = req.prompts()
    except UnsupportedField as e:
        raise Reject(error_response(400, str(e), e.param)) from None
    # what does not fit max_num_seqs waits in the engine's queue (evaluation harnesses send hundreds of prompts)
    if len(prompts) * params.n > MAX_SEQS_PER_REQUEST:
        raise Reject(error_response(
            400, f"a request may carry at most {MAX_SEQS_PER_REQUEST} sequences (prompts x n); got "
            f"{len(prompts)} prompts x n={params.n}: split the prompt list", "prompt"))
    return prompts, params


def completion_lp_block(tokenizer, prompt_ids: list[int] | None, prompt_lps, gen_lps, start: int = 0) -> dict:
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


def echo_text(out: RequestOutput, tokenizer) -> str:
    """The prompt as ``echo`` repeats it: the text sent, or the decoded token ids."""
    return out.prompt or tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)


def completion_response(req: CompletionRequest, n: int, rid: str, outs: list[RequestOutput],
                        state: ServerState) -> dict:
    """The ``text_completion`` body of a plain request: ``outs`` holds each prompt's final output,
    ``n`` sequences each; the choices are sorted by index."""
    score_only = req.score_only  # echo with max_tokens 0: the generated token is dropped
    choices = []
    for i, out in enumerate(outs):
        prefix = echo_text(out, state.tokenizer) if req.echo else ""
        for c in out.outputs:
            lp = None
            if req.logprobs is not None:
                lp = completion_lp_block(state.tokenizer, out.prompt_token_ids if req.echo else None,
                                         out.prompt_logprobs, None if score_only else c.logprobs)
            choices.append({"index": i * n + c.index, "text": prefix + ("" if score_only else c.text),
                            "logprobs": lp, "finish_reason": c.finish_reason})
    choices.sort(key=lambda ch: ch["index"])
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": response_model(req.model, state),
            "choices": choices, "usage": usage(outs, state.prefix_caching, score_only)}


async def completion_sse(req: CompletionRequest, n: int, rid: str, streams: Streams,
                         state: ServerState) -> AsyncIterator[str]:
    """The SSE body of a streamed request: per output and per sequence with something new, a
    ``text_completion`` chunk with one choice (its new text; the echoed prompt first; its
    ``finish_reason`` on its last chunk, and nothing for that index after); with
    ``stream_options.include_usage`` a chunk with empty ``choices`` and ``usage``; then
    ``data: [DONE]``. A request the engine failed ends with an error event, then ``[DONE]``."""
    score_only, want_lp = req.score_only, req.logprobs is not None
    finals: dict[int, RequestOutput] = {}
    echoed: set[tuple[int, int]] = set()
    ended: set[tuple[int, int]] = set()
    offsets: dict[tuple[int, int], int] = {}  # text_offset reached by each choice

    def chunk(choices: list[dict], **extra) -> str:
        return sse_event({"id": rid, "object": "text_completion", "created": int(time.time()),
                          "model": response_model(req.model, state), "choices": choices, **extra})

    try:
        async with contextlib.aclosing(merged_outputs(streams)) as outputs:
            async for i, out in outputs:
                for c in out.outputs:
                    key = (i, c.index)
                    if key in ended:
                        continue
                    if c.finish_reason:
                        ended.add(key)
                    text, lp, echo_ids = "" if score_only else c.delta_text, None, None
                    if req.echo and key not in echoed:
                        echoed.add(key)
                        text, echo_ids = echo_text(out, state.tokenizer) + text, out.prompt_token_ids
                    if want_lp:
                        lp = completion_lp_block(state.tokenizer, echo_ids, out.prompt_logprobs,
                                                 None if score_only else c.delta_logprobs, offsets.get(key, 0))
                        offsets[key] = offsets.get(key, 0) + sum(len(t) for t in lp["tokens"])
                    if not text and not c.finish_reason and not (c.delta_token_ids and not score_only):
                        continue
                    extra = {"usage": usage([out], state.prefix_caching, score_only)} if req.continuous_usage else {}
                    yield chunk([{"index": i * n + c.index, "text": text, "logprobs": lp,
                                  "finish_reason": c.finish_reason}], **extra)
                if out.finished:
                    finals[i] = out
    except ENGINE_FAILURES as e:
        yield failure_event(e)
        yield "data: [DONE]\n\n"
        return
    if req.include_usage:
        yield chunk([], usage=usage(list(finals.values()), state.prefix_caching, score_only))
    yield "data: [DONE]\n\n"


@router.post("/v1/completions", responses=openapi_responses(CompletionResponse, "The completion", 400, 404, 413,
                                                            500, 503, stream=True))
async def completions(req: CompletionRequest, request: Request, state: State) -> Response:
    prompts, params = parse_completion(req, state)
    streams = await submit_all(state.engine, prompts, params, check_model(req.model, state))
    rid = f"cmpl-{uuid.uuid4().hex}"
    if req.ignored_fields():
        log.debug("%s: ignoring %s (no effect on generation)", rid, ", ".join(req.ignored_fields()))
    if req.stream:
        return StreamingResponse(completion_sse(req, params.n, rid, streams, state), media_type="text/event-stream")
    try:
        outs = await collect(streams, request)
    except ENGINE_FAILURES as e:
        return failure_response(e)
    if outs is None:
        return Response(status_code=499)  # the client closed the connection: nobody reads this
    return JSONResponse(completion_response(req, params.n, rid, outs, state))
