"""``POST /v1/chat/completions``: OpenAI's chat completions, with tool calls (phase 13).

The path of a request: :func:`parse_chat` (the messages rendered by the model's chat template and
tokenized, the sampling parameters, the tools; or a 4xx), ``submit_all`` (to the engine thread),
then :func:`chat_response` (one JSON body) or :func:`chat_events` (the Server-Sent Events of
``stream: true``, built by a :class:`ChatStream`). With tools, the generated text is read back as
OpenAI ``tool_calls`` (``ToolSpec.calls_from_output``).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from infer.errors import InvalidRequestError
from infer.outputs import PositionLogprobs, RequestOutput
from infer.sampling import SamplingParams
from infer.server.protocol import ChatCompletionRequest, ChatCompletionResponse
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
    close_streams,
    collect,
    outputs_of,
    render_chat,
    response_model,
    sampling_or_reject,
    submit_all,
)
from infer.server.tools import ToolSpec

log = logging.getLogger("infer.server")
router = APIRouter()


async def parse_chat(req: ChatCompletionRequest, state: ServerState) -> tuple[list[int], SamplingParams, ToolSpec]:
    """The prompt's token ids (the messages, and the tools if any, rendered by the chat template),
    the sampling parameters and the request's tools. The template is rendered and its text tokenized
    on the engine handle's tokenizer threads (:meth:`AsyncEngine.preprocess`), after a size check
    that refuses messages too long for the context unread.

    Raises:
        Reject: 404 for another model's name; 400 naming the field for a bad value, a field infer
            does not implement, messages longer than the context can hold, messages the chat template
            refuses or renders to zero tokens.
    """
    check_model(req.model, state)
    params = sampling_or_reject(req)
    tools = req.tool_spec()  # checked by sampling_or_reject
    template_kwargs = req.chat_template_kwargs
    if tools.template_tools is not None:
        template_kwargs = {**(template_kwargs or {}), "tools": tools.template_tools}
    messages = req.message_dicts()
    inputs = state.engine.info.input_processor
    try:
        inputs.check_chars(_text_size(messages), "messages")
    except InvalidRequestError as e:
        raise Reject(error_response(400, str(e), "messages")) from None
    ids = await state.engine.preprocess(_render_and_encode, state.tokenizer, inputs, messages,
                                        req.add_generation_prompt, template_kwargs)
    return ids, params, tools


def _text_size(obj) -> int:
    """Characters of every string of a message structure: what a chat template can put into the prompt."""
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return sum(map(_text_size, obj.values()))
    if isinstance(obj, (list, tuple)):
        return sum(map(_text_size, obj))
    return 0


def _render_and_encode(tokenizer, inputs, messages: list[dict], add_generation_prompt: bool,
                       template_kwargs: dict | None) -> list[int]:
    """On a tokenizer thread: the messages rendered by the chat template, then tokenized (the template
    writes the special tokens itself).

    Raises:
        Reject: 400 naming ``messages`` (the template refused them, or they render to zero tokens or
            to more text than the context can hold) or ``chat_template_kwargs``.
    """
    text = render_chat(tokenizer, messages, add_generation_prompt, template_kwargs)
    try:
        inputs.check_text_size(text, "messages")
    except InvalidRequestError as e:
        raise Reject(error_response(400, str(e), "messages")) from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise Reject(error_response(400, "the chat template rendered these messages to zero tokens", "messages"))
    return ids


def chat_lp_block(entries: list[PositionLogprobs]) -> dict:
    """The chat ``logprobs`` object: ``content``, one entry per token (``token``, ``logprob``,
    ``bytes``, ``top_logprobs``)."""
    def one(t):
        return {"token": t.decoded, "logprob": json_logprob(t.logprob), "bytes": list(t.decoded.encode("utf-8"))}

    return {"content": [{**one(e.token), "top_logprobs": [one(t) for t in e.top]} for e in entries]}


def chat_response(req: ChatCompletionRequest, rid: str, out: RequestOutput, tools: ToolSpec,
                  state: ServerState) -> dict:
    """The ``chat.completion`` body of a plain request from its final output (``n`` choices). With
    tools, a choice whose text holds calls answers them as ``message.tool_calls``, and
    ``finish_reason`` "stop" becomes "tool_calls"."""
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
    return {"id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": response_model(req.model, state),
            "choices": choices, "usage": usage([out], state.prefix_caching)}


@dataclass
class ChatStream:
    """One streamed chat completion: what its request asked for, and how its chunks are built.

    :meth:`chat_sse` (or :meth:`chat_sse_tools`, with tools) turns the request's outputs into
    the SSE lines of the response.
    """

    rid: str  # the completion's id, in every chunk
    model: str  # the served model's name
    n: int  # choices
    prompt_tokens: int
    logprobs: bool  # each chunk's choice carries its tokens' logprobs
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool  # stream_options.continuous_usage_stats: the usage so far in every chunk
    prefix_caching: bool  # the usage reports cached prompt tokens
    tools: ToolSpec

    def chunk(self, choices: list[dict], **extra) -> str:
        """One ``chat.completion.chunk`` event: ``data: {"id", "object", "created", "model",
        "choices", **extra}`` and a blank line."""
        return sse_event({"id": self.rid, "object": "chat.completion.chunk", "created": int(time.time()),
                          "model": self.model, "choices": choices, **extra})

    def usage(self, outs: list[RequestOutput]) -> dict:
        """The ``usage`` object of ``outs`` (each request's latest output)."""
        return usage(outs, self.prefix_caching)

    def usage_so_far(self, out: RequestOutput | None) -> dict:
        """``stream_options.continuous_usage_stats``: the usage up to this chunk, in every chunk."""
        if not self.continuous_usage:
            return {}
        if out is None:
            return {"usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": 0,
                              "total_tokens": self.prompt_tokens}}
        return {"usage": self.usage([out])}

    def role_chunk(self) -> str:
        """The first chunk: each of the ``n`` choices gets its ``role``."""
        return self.chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for j in range(self.n)], **self.usage_so_far(None))

    async def chat_sse(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        """The SSE lines of a streamed chat completion, from the request's outputs.

        First a chunk giving each of the ``n`` choices its role; then, per output and per
        sequence with something new, a chunk with that choice's ``delta`` (its new text) and, on
        its last chunk, its ``finish_reason`` (each index ends once); with
        ``stream_options.include_usage`` a chunk with empty ``choices`` and ``usage``; then
        ``data: [DONE]``.
        """
        yield self.role_chunk()
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
                yield self.chunk([{"index": c.index, "delta": delta,
                                   "logprobs": chat_lp_block(c.delta_logprobs or []) if self.logprobs else None,
                                   "finish_reason": c.finish_reason}], **self.usage_so_far(out))
        if self.include_usage and last is not None:
            yield self.chunk([], usage=self.usage([last]))
        yield "data: [DONE]\n\n"
        # <<< EXERCISE chat_sse

    async def chat_sse_tools(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        """Streaming with tools (phase 13): a constrained call (named, required) is held back and
        sent as one ``tool_calls`` delta when it is complete; with ``auto``, text streams until a
        ``<tool_call>`` tag may begin, and what follows is held back and parsed at the end."""
        yield self.role_chunk()
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
                if self.tools.choice == "auto" and not held.get(c.index):
                    at = text.find(tag, n)
                    end = at if at >= 0 else len(text)
                    if at < 0:  # keep back a tail that could be the start of the tag
                        end = next((k for k in range(max(n, len(text) - len(tag) + 1), len(text))
                                    if tag.startswith(text[k:])), len(text))
                    if at >= 0:
                        held[c.index] = True
                    if end > n:
                        yield self.chunk([{"index": c.index, "delta": {"content": text[n:end]}, "logprobs": None,
                                           "finish_reason": None}], **self.usage_so_far(out))
                        sent[c.index] = n = end
                if not c.finish_reason:
                    continue
                content, calls = self.tools.calls_from_output(text)
                if calls:
                    delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
                    reason = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
                else:
                    delta = {"content": text[n:]} if text[n:] else {}
                    reason = c.finish_reason
                held[c.index] = None
                yield self.chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": reason}],
                                 **self.usage_so_far(out))
        if self.include_usage and last is not None:
            yield self.chunk([], usage=self.usage([last]))
        yield "data: [DONE]\n\n"


async def chat_events(stream: ChatStream, streams: Streams) -> AsyncIterator[str]:
    """The body of a streamed chat response: ``stream``'s SSE lines from the request's outputs. A
    request the engine failed ends with an error event, then ``[DONE]``; whatever ends the body
    (the last line, a failure, the client going away) closes the request's stream, which aborts
    it if it is still running."""
    sse_lines = stream.chat_sse if stream.tools.choice == "none" else stream.chat_sse_tools
    try:
        async with contextlib.aclosing(sse_lines(outputs_of(*streams[0]))) as lines:
            async for line in lines:
                yield line
    except ENGINE_FAILURES as e:
        yield failure_event(e)
        yield "data: [DONE]\n\n"
    finally:
        await close_streams([], streams)


@router.post("/v1/chat/completions", responses=openapi_responses(ChatCompletionResponse, "The chat completion",
                                                                 400, 404, 413, 500, 503, stream=True))
async def chat(req: ChatCompletionRequest, request: Request, state: State) -> Response:
    ids, params, tools = await parse_chat(req, state)
    streams = await submit_all(state.engine, [ids], params, check_model(req.model, state))
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    if req.ignored_fields():
        log.debug("%s: ignoring %s (no effect on generation)", rid, ", ".join(req.ignored_fields()))
    if req.stream:
        stream = ChatStream(rid, response_model(req.model, state), params.n, len(ids), req.logprobs, req.include_usage,
                            req.continuous_usage, state.prefix_caching, tools)
        return StreamingResponse(chat_events(stream, streams), media_type="text/event-stream")
    try:
        outs = await collect(streams, request)
    except ENGINE_FAILURES as e:
        return failure_response(e)
    if outs is None:
        return Response(status_code=499)
    return JSONResponse(chat_response(req, rid, outs[0], tools, state))
