"""What the routes share between parsing a request and shaping its answer.

- :class:`ServerState`: what a handler needs (the engine handle, the served model's name, its
  tokenizer, the metrics), set once by ``build_app`` on ``app.state.server`` and handed to each
  handler by FastAPI's dependency injection (a parameter annotated :data:`State`).
- Parsing helpers that refuse a request with OpenAI's error body (:class:`Reject`):
  :func:`check_model` (404), :func:`sampling_or_reject` and :func:`render_chat` (400).
- The engine call: :func:`submit_all` hands the prompts to the engine thread (through
  :class:`~infer.server.async_engine.AsyncEngine`) and returns one stream of outputs per prompt;
  :func:`collect` reads them to the end (a plain response), :func:`outputs_of` and
  :func:`merged_outputs` as they come (a streamed one). Closing a stream aborts its request
  (:func:`close_streams`): nothing keeps generating for a client that went away.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import anyio
from fastapi import Depends, Request

from infer.chat import apply_chat_template
from infer.errors import InvalidRequestError
from infer.lora import LoRARequest
from infer.outputs import RequestOutput
from infer.sampling import SamplingParams
from infer.server.async_engine import AsyncEngine, EngineDead, EngineOverloaded
from infer.server.metrics import Metrics
from infer.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest, UnsupportedField
from infer.server.responses import ENGINE_FAILURES, Reject, error_response

# each prompt's stream of outputs, and its first output if it was already read (submit_all: None)
Streams = list[tuple[AsyncIterator[RequestOutput], RequestOutput | None]]


@dataclass
class ServerState:
    """What the route handlers need, built once by ``build_app``."""

    engine: AsyncEngine  # the engine thread's handle (or the engine process's: EngineProcess); ``engine.info``: its facts
    model_name: str  # the name clients send in ``model``
    metrics: Metrics
    tokenizer: Any  # the engine's tokenizer (encode, decode, id_to_token, chat template)
    prefix_caching: bool  # ``usage`` then reports cached prompt tokens
    created: int  # when the app was built: the model card's ``created``
    #: LoRA (phase 16): the adapters served, by the name clients send in ``model``
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    next_lora_id: int = 1  # each adapter loaded gets a new lora_int_id (never reused: prefix-cache keys)

    def add_lora_name(self, name: str, path: str) -> LoRARequest:
        """Register an adapter under ``name`` with a fresh ``lora_int_id``."""
        req = LoRARequest(name, self.next_lora_id, path)
        self.next_lora_id += 1
        self.loras[name] = req
        return req


async def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the app's :class:`ServerState` (``async``, so that FastAPI runs it on
    the event loop rather than in its thread pool)."""
    return request.app.state.server


#: a handler parameter annotated ``State`` receives the app's :class:`ServerState`
State = Annotated[ServerState, Depends(server_state)]

# ---------------------------------------------------------------------------- parsing


def check_model(name: str | None, state: ServerState) -> LoRARequest | None:
    """Accept a request for the served model (or one naming none), or for one of its LoRA adapters
    (phase 16: vLLM's convention, the adapter's name in ``model``).

    Returns:
        The adapter's :class:`~infer.lora.LoRARequest`, or None for the base model.

    Raises:
        Reject: 404 ``not_found_error`` with ``code: model_not_found`` for any other name.
    """
    if name is None or name == state.model_name:
        return None
    lora = state.loras.get(name)
    if lora is None:
        served = ", ".join(repr(n) for n in (state.model_name, *state.loras))
        raise Reject(error_response(404, f"model {name!r} does not exist; this server serves {served}",
                                    "model", "not_found_error", "model_not_found"))
    return lora


def response_model(name: str | None, state: ServerState) -> str:
    """The ``model`` a response names: the adapter asked for, else the served model."""
    return name if name in state.loras else state.model_name


def _param_of(exc: ValueError) -> str | None:
    """SamplingParams' messages start with the field name ("temperature must be ...")."""
    param = getattr(exc, "param", None)
    if param:
        return param
    first = str(exc).split(" ", 1)[0].split("[", 1)[0]
    return first if first.isidentifier() and first.islower() else None


def sampling_or_reject(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """The request's :class:`SamplingParams`, or :class:`Reject` with a 400 naming the bad field."""
    # >>> EXERCISE sampling_or_reject
    try:
        params = req.sampling_params()
    except UnsupportedField as e:
        raise Reject(error_response(400, str(e), e.param)) from None
    except ValueError as e:
        raise Reject(error_response(400, str(e), _param_of(e))) from None
    if params.n > MAX_N:
        raise Reject(error_response(400, f"n must be <= {MAX_N}, got {params.n}", "n"))
    return params
    # <<< EXERCISE sampling_or_reject


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None) -> str:
    """The conversation as the model's chat template renders it (``infer.chat.apply_chat_template``).

    Raises:
        Reject: 400 naming ``messages`` (the template refused them) or ``chat_template_kwargs``
            (they clash with the renderer's own arguments).
    """
    try:
        return apply_chat_template(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                                   **(kwargs or {}))
    except ValueError as e:
        raise Reject(error_response(400, str(e), "messages")) from None
    except TypeError as e:  # chat_template_kwargs clashing with the renderer's own arguments
        raise Reject(error_response(400, f"chat_template_kwargs: {e}", "chat_template_kwargs")) from None


# ---------------------------------------------------------------------------- the engine call


async def submit_all(engine: AsyncEngine, prompts: list[str | list[int]], params: SamplingParams,
                     lora_request: LoRARequest | None = None) -> Streams:
    """Submit every prompt (under the LoRA adapter ``lora_request``, or the base model) and wait for the
    engine to accept them (not to admit them); returns ``(stream, None)`` per prompt (the first output
    is awaited by the response, which notices disconnects). Nothing stays queued if one is rejected.

    Raises:
        Reject: 503 ``server_overloaded`` (the waiting queue is full), 503 ``server_unavailable``
            (the engine stopped), or 400 for a request the engine refuses (prompt too long, token
            ids outside the vocabulary...).
    """
    try:
        gens = await engine.submit_many(prompts, params, lora_request)
    except EngineOverloaded as e:
        raise Reject(error_response(503, str(e), None, "server_overloaded")) from None
    except EngineDead as e:
        raise Reject(error_response(503, str(e), None, "server_unavailable")) from None
    except (InvalidRequestError, ValueError) as e:
        raise Reject(error_response(400, str(e), _param_of(e))) from None
    return [(g, None) for g in gens]


async def close_streams(tasks: list[asyncio.Task], streams: Streams) -> None:
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


async def collect(streams: Streams, request: Request) -> list[RequestOutput] | None:
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


async def outputs_of(gen: AsyncIterator[RequestOutput], first: RequestOutput | None) -> AsyncIterator[RequestOutput]:
    """One request's outputs (deltas), as the engine thread hands them over; ``first``, if not
    None, was read already."""
    if first is not None:
        yield first
        if first.finished:
            return
    async for o in gen:
        yield o


async def merged_outputs(streams: Streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several requests, interleaved as the engine thread hands them over:
    ``(i, output)`` with ``i`` the request's index in ``streams``. Ends when every stream has
    ended; closing it earlier closes the streams (aborting unfinished requests).

    Raises:
        RequestFailed / EngineDead: a stream ended with it (the others are then aborted).
    """
    if len(streams) == 1:  # one request (most): read it here, without a pump task and its queue, whose
        # hop would cost every token one more turn of the event loop
        try:
            async for out in outputs_of(*streams[0]):
                yield 0, out
        finally:
            await close_streams([], streams)
        return
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
    try:
        while open_streams:
            i, out = await queue.get()
            if out is None:
                open_streams -= 1
            elif isinstance(out, BaseException):
                raise out
            else:
                yield i, out
    finally:
        await close_streams(tasks, streams)
