"""A queue-based handle that runs :class:`~infer.engine.LLMEngine` in its own thread.

The engine loop (``step()``: schedule, forward, sample, detokenize) is synchronous and can take
tens of milliseconds; running it on the server's event loop would freeze every connection
for that long. So it lives in a thread of its own, and talks to the event loop only through
queues (vLLM's ``AsyncLLM`` does the same with a separate process):

* the event loop puts commands (add a request, abort one) into ``inbox``, a thread-safe queue;
  adding returns through a ``concurrent.futures.Future`` so a bad request is rejected (HTTP 400)
  before anything is streamed;
* the engine thread drains the inbox, runs a step, and hands each :class:`RequestOutput` to the
  request's ``asyncio.Queue``: one ``loop.call_soon_threadsafe`` per step puts them all;
* prompts are checked and tokenized *before* they reach the engine thread, on a small pool of
  tokenizer threads (:meth:`AsyncEngine.preprocess`; the tokenizer releases the GIL), so a long
  prompt stalls neither the event loop nor the engine's steps, and one too long for the context is
  rejected unread (:class:`~infer.engine.input_processor.InputProcessor`). The engine thread only
  schedules and runs steps.

The engine object is touched by the engine thread only, so it needs no locks.

**Build the engine on the engine thread** (pass a factory, as ``python -m infer.server`` does).
On the CPU, torch runs its parallel regions on OpenMP (libgomp), and every thread that enters one
gets a pool of worker threads of its own that lives as long as the thread. An engine built on
the main thread (loading and dequantizing the weights run parallel ops) and stepped on this
thread leaves the process with two pools: four OpenMP threads on a 2-core machine. libgomp then
counts more threads than CPUs and cuts the spin-wait of idle workers to almost nothing (``do_spin``
in libgomp's ``config/linux/wait.h`` switches to its throttled spin count), so every parallel
region pays for waking its worker from sleep, as under ``OMP_WAIT_POLICY=PASSIVE``: measured here,
a decode step went from 47 to 90 ms as soon as a second, idle pool existed in the process, and
back when its thread exited. With the engine built and stepped on one thread, the server's engine
runs like the offline ``LLM`` in a main thread, with infer's short spin (``src/infer/__init__.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from infer.engine import LLMEngine
from infer.engine.input_processor import TokensPrompt
from infer.engine.output_processor import OutputProcessor
from infer.errors import EngineStepError
from infer.lora import LoRARequest
from infer.outputs import RequestOutput
from infer.sampling import SamplingParams
from infer.server.metrics import cache_config_labels

log = logging.getLogger("infer.server")


class EngineOverloaded(Exception):
    """The waiting queue is full (HTTP 503)."""


class EngineDead(Exception):
    """The engine thread stopped (shutdown or a crash): HTTP 503."""


class RequestFailed(Exception):
    """The engine step that ran this request failed (HTTP 500); the engine serves on."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


def _put_all(items: list[tuple[asyncio.Queue, Any]], taken: threading.Event | None = None) -> None:
    """On the event loop: put each item into its queue (a step's outputs, see ``_deliver_step``);
    then set ``taken``, if given, once the loop has run what those puts woke (the first-token
    hand-off of :meth:`AsyncEngine._deliver_step`)."""
    for q, item in items:
        q.put_nowait(item)
    if taken is not None:
        # each call_soon runs one loop iteration later: the readers woken above (the response's
        # pump), then the ones they woke (the SSE body that formats and sends the chunk)
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, taken.set)


@dataclass
class EngineInfo:
    """What the server's routes know of the engine without asking it: fixed at start-up, so that they read
    them on the event loop even when the engine runs in another process
    (:class:`~infer.server.engine_core.EngineProcess`, which receives them from there)."""

    tokenizer: Any  # encode, decode, id_to_token, the chat template
    input_processor: Any  # InputProcessor: checks and tokenizes prompts (AsyncEngine.tokenize)
    max_model_len: int  # tokens
    vocab_size: int
    max_num_seqs: int
    prefix_caching: bool
    lora_enabled: bool  # enable_lora (phase 16): the LoRA routes are served
    cache_config: dict[str, str]  # the labels of infer:cache_config_info (metrics.cache_config_labels)
    device: str

    @classmethod
    def of(cls, eng: LLMEngine) -> EngineInfo:
        return cls(eng.tokenizer, eng.input_processor, eng.max_model_len, eng.vocab_size, eng.scheduler.max_num_seqs,
                   bool(eng.config.prefix_caching), eng.lora_manager is not None, cache_config_labels(eng),
                   str(eng.runner.device))


def failure_message(e: EngineStepError) -> str:
    """What a request whose step failed is told (its stream ends with :class:`RequestFailed`)."""
    cause = e.__cause__ or e
    return f"internal error while running this request: {type(cause).__name__}: {cause}"


def step_engine(eng: LLMEngine, failures: int, on_failure: Callable[[EngineStepError, int], None]
                ) -> tuple[list[RequestOutput], int]:
    """One streamed step of ``eng`` if a request is unfinished: ``(its outputs, failed steps in a row)``. A
    step that raises :class:`~infer.errors.EngineStepError` (the engine has aborted its requests) is logged
    with its cause and handed to ``on_failure(error, failures in a row)``, which may re-raise it."""
    if not eng.has_unfinished_requests():
        return [], failures
    try:
        return eng.step(stream=True), 0
    except EngineStepError as e:
        failures += 1
        log.error("engine step failed (%d in a row); failing its requests %s", failures, ", ".join(e.request_ids),
                  exc_info=e.__cause__ or e)
        on_failure(e, failures)
        return [], failures


class RequestStream:
    """The outputs of one submitted request, as an async iterator (see :meth:`AsyncEngine.submit`)."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        self.engine.keep_loop_polling()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def aclose(self) -> None:
        """Abort the request unless it already finished (idempotent)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    """Run ``engine`` in a background thread; serve many concurrent requests from asyncio.

    Args:
        engine: the synchronous engine (owned by the thread from now on), or better a
            zero-argument callable that builds it: it is then called on the engine thread, so
            that all of torch's work happens on one thread (see the module docstring).
            ``__init__`` returns once the engine is built and re-raises what building it raised.
        max_waiting: requests waiting for admission beyond which :meth:`generate` raises
            :class:`EngineOverloaded`.
        on_finished: optional callback ``(RequestOutput) -> None`` run on the engine thread
            when a request finishes (metrics).
        max_step_failures: consecutive failed steps after which the engine is declared dead.
        first_token_handoff_s: after a step that carries a request's first token, the engine thread
            waits up to this long (seconds; 0: not at all) for the event loop to take the outputs before
            it runs the next step (see :meth:`_deliver_step`).

    Faults: a step that raises :class:`~infer.errors.EngineStepError` (the engine has already
    aborted that step's requests and freed their blocks) ends those requests' streams with
    :class:`RequestFailed`, logs the traceback once, and the loop goes on for everybody else.
    ``max_step_failures`` failures in a row (a device that is gone fails every step), or any other
    exception out of the engine, stop the thread: :attr:`alive` turns False (``/health`` says
    503) and every open stream ends with :class:`EngineDead`.
    """

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], max_waiting: int = 256,
                 on_finished=None, max_step_failures: int = 3, first_token_handoff_s: float = 0.001) -> None:
        self._setup(max_waiting, on_finished, max_step_failures, first_token_handoff_s)
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(engine, built), name="infer-engine", daemon=True)
        self._thread.start()
        self.engine: LLMEngine | None = built.result()  # the build's exception, if any, is raised here

    @functools.cached_property
    def info(self) -> EngineInfo:
        """The engine's fixed facts (tokenizer, limits) for the routes."""
        return EngineInfo.of(self.engine)

    def _setup(self, max_waiting: int, on_finished, max_step_failures: int, first_token_handoff_s: float) -> None:
        """The event-loop side's state (shared with :class:`~infer.server.engine_core.EngineProcess`)."""
        self.max_waiting = max_waiting
        self.first_token_handoff_s = first_token_handoff_s
        self.first_token_handoff_max_outputs = 8  # (see _deliver_step)
        self._awaiting_first: set[str] = set()  # accepted requests that have not yet produced an output
        self._taken = threading.Event()
        self.max_step_failures = max_step_failures
        self.on_finished = on_finished
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._pending_adds = 0
        # prompts are tokenized here, off the event loop and the engine thread (see preprocess)
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="infer-tokenize")
        self.error: BaseException | None = None
        # numbers the event loop may read at any time (written by the engine thread)
        self.num_running = 0
        self.num_waiting = 0
        self.num_preemptions = 0  # cumulative (the engine's ``num_preemptions``, where it has one)
        self.loop_busy_poll_s = 0.0  # (see keep_loop_polling; EngineProcess sets it)
        self._poll_until = 0.0
        self._poller: asyncio.Task | None = None

    # ------------------------------------------------------------------ event-loop side

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def keep_loop_polling(self) -> None:
        """On the event loop, as each output reaches its stream: keep the loop polling its sockets and its
        wake-up pipe instead of sleeping until ``loop_busy_poll_s`` seconds from now (0: never). A task
        yields (``asyncio.sleep(0)``) in a loop, so each turn of the event loop polls with a zero timeout
        and the next request or output is picked up without a wake-up from sleep; the engine process's
        own busy polling (:meth:`~infer.server.engine_core._EngineLoop.wait_for_command`) does the same on
        its side of the pipe. Only with the engine in another process: on a thread the polling would take
        the GIL from the engine's steps."""
        if self.loop_busy_poll_s <= 0:
            return
        self._poll_until = time.perf_counter() + self.loop_busy_poll_s
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        try:
            while time.perf_counter() < self._poll_until and not self._stopping.is_set():
                await asyncio.sleep(0)
        finally:
            self._poller = None

    async def submit(
        self, prompt: str | list[int] | TokensPrompt, params: SamplingParams, request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Tokenize the prompt off the engine thread (:meth:`tokenize`), then queue the request; return
        once the engine has accepted it (not when it is admitted).

        Raises:
            InvalidRequestError / ValueError: the prompt is invalid or the engine rejected the request
                (nothing is queued).
            EngineOverloaded: too many requests are waiting.
            EngineDead: the engine is shutting down or has crashed.

        The returned :class:`RequestStream` yields the request's outputs (deltas); closing it
        before the request finished (a client that went away, even while still queued) aborts
        the request.
        """
        if not self.alive:
            raise EngineDead("the engine is not running")
        if self.num_waiting + self._pending_adds >= self.max_waiting:
            raise EngineOverloaded(f"{self.num_waiting} requests are already waiting (max {self.max_waiting})")
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._pending_adds += 1  # its place is taken while it is tokenized
        try:
            (prompt,) = await self.tokenize([prompt])
            self._inbox.put(("add", (rid, prompt, params, stream, lora_request), fut))
            if not self._thread.is_alive() and not fut.done():  # raced with a shutdown
                fut.set_exception(EngineDead("the engine is shutting down"))
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(rid)  # the caller went away while the engine was accepting it
            raise
        finally:
            self._pending_adds -= 1
        return RequestStream(self, rid, stream.queue)

    async def preprocess(self, fn: Callable, *args) -> Any:
        """``fn(*args)`` on a tokenizer thread (tokenizing, rendering a chat template): the event loop
        serves other connections and the engine thread steps meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    async def tokenize(self, prompts: list[str | list[int] | TokensPrompt]) -> list[TokensPrompt]:
        """Each prompt checked and tokenized on the tokenizer threads
        (:meth:`~infer.engine.input_processor.InputProcessor.process`).

        Raises:
            InvalidRequestError: the first bad prompt's, its message starting with ``prompt[i]:`` when
                there are several.
        """
        process = self.info.input_processor.process
        if all(not isinstance(p, str) for p in prompts):
            # token ids are only checked (no tokenizer): on the event loop, sparing a short request
            # two thread hand-offs on its way to the first token
            done = []
            for p in prompts:
                try:
                    done.append(process(p))
                except Exception as e:  # reported as the thread pool's would be, below
                    done.append(e)
        else:
            done = await asyncio.gather(*(self.preprocess(process, p) for p in prompts), return_exceptions=True)
        for i, r in enumerate(done):
            if isinstance(r, BaseException):
                if len(prompts) > 1 and isinstance(r, ValueError):
                    r.args = (f"prompt[{i}]: {r}", *r.args[1:])
                raise r
        return done

    async def submit_many(self, prompts: list[str | list[int] | TokensPrompt], params: SamplingParams,
                          lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Tokenize several prompts (one HTTP request's) off the engine thread (:meth:`tokenize`), then
        queue them as one unit; return once all are accepted.

        The ``max_waiting`` limit is checked once, for the unit: a request carrying more prompts
        than ``max_num_seqs`` queues the rest instead of being refused. All adds go to the
        engine thread at once (one round trip, not one step per prompt).

        Raises:
            InvalidRequestError / ValueError: a prompt is invalid or the engine rejected one (nothing
                stays queued); the message starts with ``prompt[i]:`` when there are several.
            EngineOverloaded, EngineDead: as :meth:`submit`.
        """
        if not self.alive:
            raise EngineDead("the engine is not running")
        if self.num_waiting + self._pending_adds >= self.max_waiting:
            raise EngineOverloaded(f"{self.num_waiting} requests are already waiting (max {self.max_waiting})")
        n = len(prompts)
        self._pending_adds += n  # their places are taken while they are tokenized
        adds = []
        try:
            prompts = await self.tokenize(prompts)
            loop = asyncio.get_running_loop()
            for prompt in prompts:
                rid = f"req-{next(self._ids)}"
                stream = _Stream(loop, asyncio.Queue())
                fut: concurrent.futures.Future = concurrent.futures.Future()
                adds.append((rid, stream, fut))
                self._inbox.put(("add", (rid, prompt, params, stream, lora_request), fut))
            if not self._thread.is_alive():  # raced with a shutdown
                for _, _, fut in adds:
                    if not fut.done():
                        fut.set_exception(EngineDead("the engine is shutting down"))
            results = await asyncio.gather(*(asyncio.wrap_future(f) for _, _, f in adds), return_exceptions=True)
        except asyncio.CancelledError:
            for rid, _, _ in adds:
                self.abort(rid)
            raise
        finally:
            self._pending_adds -= n
        errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            for rid, _, _ in adds:
                self.abort(rid)
            i, e = errors[0]
            if len(prompts) > 1 and isinstance(e, ValueError):
                e.args = (f"prompt[{i}]: {e}", *e.args[1:])
            raise e
        return [RequestStream(self, rid, stream.queue) for rid, stream, _ in adds]

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """:meth:`submit`, then yield the outputs until the request finishes."""
        request = await self.submit(prompt, params, request_id, lora_request)
        try:
            async for out in request:
                yield out
        finally:
            await request.aclose()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result (for
        operations on the engine's state, such as ``reset_prefix_cache``).

        Raises:
            EngineDead: the engine is not running. What ``fn`` raised is re-raised.
        """
        return await asyncio.wrap_future(self._post_call(fn))

    def call_blocking(self, fn: Callable[[LLMEngine], Any], timeout: float | None = None) -> Any:
        """:meth:`call` from a thread that is not the event loop's, waiting for the result (start-up:
        loading the ``--lora-modules`` before the server serves).

        Raises:
            EngineDead: the engine is not running. What ``fn`` raised is re-raised.
        """
        return self._post_call(fn).result(timeout)

    def _post_call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        if not self.alive:
            raise EngineDead("the engine is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return fut

    async def metrics_sources(self) -> tuple[Any, Any, float]:
        """What ``/metrics`` reads at a scrape: the engine's scheduler and output processor (their per-step
        statistics, :class:`~infer.server.metrics.SchedulerCollector`) and the KV cache's usage (0-1). Here the
        live objects, read from the event loop while the engine thread steps (counters and histograms: a
        scrape may see one step more in one than in another)."""
        eng = self.engine
        return eng.scheduler, eng.output_processor, eng.scheduler.kv_cache_usage()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once)."""
        self._inbox.put(("abort", request_id, None))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finish every in-flight request with ``finish_reason="abort"`` and stop the thread."""
        if self._stopping.is_set():
            return
        self._inbox.put(("shutdown", None, None))
        self._thread.join(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ engine-thread side

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed
            self._streams.pop(rid, None)
            self._awaiting_first.discard(rid)

    def _deliver_step(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each event loop per step, not
        one per output (``call_soon_threadsafe`` writes to the loop's self-pipe each time: a
        system call per request per step on the engine thread; measured on a 2-core CPU with the
        loop running, 256 such calls took 1.7-2.0 ms, one call carrying all 256 outputs 0.03 ms).

        **First-token hand-off.** The event loop and this thread share the GIL. Right after a
        delivery this thread starts the next step, whose Python holds the GIL, and the loop, woken to
        send the tokens, waits for it (up to the switch interval, each time it needs it back). For a
        request's *first* token that wait is TTFT, so after a step that carries one this thread waits
        (the GIL released) until the loop has taken the outputs and sent them on, at most
        ``first_token_handoff_s``. Later tokens are not waited for: TPOT is a rate, and the next
        step's launch matters more than a chunk's latency. Nor are steps with more than
        ``first_token_handoff_max_outputs`` outputs: under load the loop has many chunks to send, the
        wait would grow with them, and a TTFT there is dominated by queueing anyway. (vLLM avoids the
        shared GIL altogether by running its engine core in another process.)

        Measured on an H100 (Qwen3-0.6B, a 128-token prompt sent 20 ms after the previous request, one
        server, with and without, interleaved): the token reached the loop 0.08 ms after its step instead
        of 0.28 ms, and the client read it 0.33 ms sooner."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        first = False
        for out in outs:
            if out.finished:
                self._record_finished(out)
            if out.request_id in self._awaiting_first:
                self._awaiting_first.discard(out.request_id)
                first = True
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.queue, out))
            if out.finished:
                self._streams.pop(out.request_id, None)
        handoff = (first and self.first_token_handoff_s > 0 and len(batches) == 1
                   and len(outs) <= self.first_token_handoff_max_outputs)
        if handoff:
            self._taken.clear()
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items, self._taken if handoff else None)
            except RuntimeError:  # the event loop is closed: its streams are gone
                handoff = False
                for rid in [r for r, st in self._streams.items() if st.loop is loop]:
                    self._streams.pop(rid, None)
        if handoff:
            self._taken.wait(self.first_token_handoff_s)

    def _handle(self, cmd: str, arg: Any, fut: concurrent.futures.Future | None) -> None:
        eng = self.engine
        if cmd == "add":
            rid, prompt, params, stream, lora_request = arg
            try:
                eng.add_request(prompt, params, request_id=rid, lora_request=lora_request)
            except Exception as e:  # rejected: report to the caller, nothing is queued
                fut.set_exception(e)
                return
            self._streams[rid] = stream
            self._awaiting_first.add(rid)
            self.num_waiting = eng.num_waiting  # visible to the 503 check before the next step
            fut.set_result(rid)
        elif cmd == "abort":
            self._abort(arg)
        elif cmd == "call":
            try:
                fut.set_result(arg(eng))
            except Exception as e:
                fut.set_exception(e)
        elif cmd == "shutdown":
            self._stopping.set()

    def _record_finished(self, out: RequestOutput) -> None:
        out.metrics.setdefault("finished", time.perf_counter())
        if self.on_finished is not None:
            try:
                self.on_finished(out)
            except Exception:  # metrics must never kill the engine
                log.exception("on_finished callback failed")

    def _abort(self, rid: str) -> None:
        """Stop ``rid`` now (a client that went away, or shutdown): free it in the engine, count it
        as finished with ``"abort"`` and end its stream with a final output. A request that has
        already finished is left alone (its final output went out with its last step)."""
        self._awaiting_first.discard(rid)  # (the first-token hand-off's bookkeeping, see _deliver_step)
        # >>> EXERCISE abort_request
        req = self.engine.requests.get(rid)
        known = self.engine.abort_request(rid)
        if not known and rid not in self._streams:
            return
        if known:  # what the request's output kind asks for: all so far, or what is new since the last
            final = OutputProcessor.make_output(req)
            self._record_finished(final)
        else:  # finished already (its final output went out) or never admitted: nothing more to say
            final = RequestOutput(rid, None, [], [], finished=True)
        self._deliver(rid, final)
        self._streams.pop(rid, None)
        # <<< EXERCISE abort_request

    def _fail_step(self, e: EngineStepError, failures: int) -> None:
        """A step failed (:func:`step_engine` logged it): count its requests as finished
        (``finish_reason="error"``, from the final outputs ``e`` carries), end their streams with
        :class:`RequestFailed` (the engine has aborted them), and re-raise ``e`` after
        ``max_step_failures`` in a row."""
        for out in e.outputs:
            self._record_finished(out)
        if failures >= self.max_step_failures:
            raise e
        for rid in e.request_ids:
            self._deliver(rid, RequestFailed(failure_message(e)))
            self._streams.pop(rid, None)
            self._awaiting_first.discard(rid)

    def _finish_all(self) -> None:
        """End every open stream with a final output (used at shutdown)."""
        for rid in list(self._streams):
            self._abort(rid)

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        try:
            eng = engine() if callable(engine) and not isinstance(engine, LLMEngine) else engine
        except BaseException as e:  # reported to __init__, which raises it
            self._stopping.set()
            built.set_exception(e)
            return
        built.set_result(eng)
        failures = 0  # consecutive failed steps
        try:
            while not self._stopping.is_set():
                block = not eng.has_unfinished_requests()
                try:
                    cmd, arg, fut = self._inbox.get(block=block, timeout=0.5 if block else None)
                    self._handle(cmd, arg, fut)
                    while True:  # drain whatever else arrived
                        cmd, arg, fut = self._inbox.get_nowait()
                        self._handle(cmd, arg, fut)
                except queue.Empty:
                    pass
                if self._stopping.is_set():
                    break
                outs, failures = step_engine(eng, failures, self._fail_step)
                # published before the delivery, which may wait for the event loop (the first-token hand-off):
                # whoever reads an output must not then read the counts of before its step
                self.num_running, self.num_waiting = eng.num_running, eng.num_waiting
                self.num_preemptions = getattr(eng, "num_preemptions", 0)
                self._deliver_step(outs)
                if self.num_waiting and not self.num_running:
                    time.sleep(0.001)  # static batching is waiting for its batch to fill
        except BaseException as e:  # a crash: fail every open request instead of hanging it
            if isinstance(e, EngineStepError):  # its traceback is logged already
                log.error("%d engine steps failed in a row: the engine stops", failures)
            else:
                log.exception("engine thread crashed")
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDead(f"the engine stopped: {e!r}"))
        finally:
            self._stopping.set()
            self._finish_all()
            self.num_running = self.num_waiting = 0
            try:  # a parallel engine's worker processes (phase 14) exit with the engine thread; KV offload's
                # disk tier deletes its file
                if hasattr(eng, "shutdown"):
                    eng.shutdown()
            except Exception:
                log.exception("engine shutdown failed")
            # reject adds that raced with the shutdown
            while True:
                try:
                    cmd, arg, fut = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if fut is not None and not fut.done():
                    fut.set_exception(EngineDead("the engine is shutting down"))
