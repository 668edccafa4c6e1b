"""The engine in a process of its own: ``python -m infer.server --engine-process`` (vLLM's ``EngineCore``
process, SGLang's scheduler process).

**Why.** :class:`~infer.server.async_engine.AsyncEngine` steps the engine on a thread of the server's
process, and Python runs one thread at a time (the GIL). While the event loop parses a request, sends
response headers or formats an SSE chunk, the engine's host work (scheduling, metadata, launching
kernels, sampling, detokenizing) waits, and the other way round. Measured on the 2-core development
machine with a host-bound model (tiny-qwen3, a 128-token prompt, 16 tokens streamed): the prefill step
took 5.1 ms in the server against 3.0 ms offline, each decode step 1.41 ms against 0.95 ms, because the
loop's ~1 ms of response set-up and ~0.3 ms per streamed token ran *inside* the engine's steps. Two
processes have two interpreters: the loop's work and the engine's overlap instead of adding up.

**How.** The server's process keeps everything HTTP and the prompts' tokenization (the
:class:`~infer.server.async_engine.EngineInfo` the engine sends once: tokenizer, limits); the engine
process builds :class:`~infer.engine.LLMEngine` from the :class:`~infer.config.EngineConfig` and runs
the step loop (:func:`engine_main`). They talk over one duplex pipe (``multiprocessing.Pipe``, pickled
tuples):

* server -> engine: ``("add", key, (request_id, prompt ids, SamplingParams, LoRARequest))``,
  ``("abort", None, request_id)``, ``("call", key, fn)`` (``fn(engine)``, a picklable callable such as
  ``operator.methodcaller("reset_prefix_cache")``), ``("shutdown", None, None)``;
* engine -> server: ``("ready", EngineInfo)`` (or ``("error", exception)``), ``("reply", key, ok,
  value)``, ``("outs", [RequestOutput, ...], counts)`` after each step that produced any (counts:
  running, waiting, preempted so far), ``("unknown", None, request_id)`` (an abort of a request the engine
  no longer has), ``("failed", fatal, (request_ids, final outputs, message))`` (a step that raised),
  ``("dead", None, message)`` and ``("bye", None, None)``.

A thread of the server's process (:meth:`EngineProcess._read`) blocks on the pipe (the GIL released)
and hands each step's outputs to the requests' asyncio queues exactly as the engine thread does in
:class:`AsyncEngine` (:meth:`AsyncEngine._deliver_step`): the routes cannot tell the two apart. The
engine process is started with ``spawn`` (a fresh interpreter: CUDA cannot be forked) and ends when the
server asks it to, or as soon as it reads the end of the pipe (the server died).

Not available this way: the live page (``--live-page``), which reads the engine's steps in-process.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import pickle
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any

from infer.config import EngineConfig
from infer.engine.output_processor import OutputProcessor
from infer.errors import EngineStepError
from infer.outputs import RequestOutput
from infer.server.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineInfo,
    RequestFailed,
    failure_message,
    step_engine,
)

log = logging.getLogger("infer.server")


# ---------------------------------------------------------------------------- the engine process


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling as itself, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def engine_main(config: EngineConfig, conn, max_step_failures: int = 3, log_level: str = "INFO",
                busy_poll_s: float = 0.0) -> None:
    """The engine process: build the engine, say ``ready`` (or ``error``), then serve the pipe and step.

    Each turn drains the commands waiting in the pipe (waiting for one when no request is unfinished: for
    ``busy_poll_s`` seconds after the last step by polling the pipe in a loop, then asleep), runs one step
    and sends its outputs. A step that raises :class:`~infer.errors.EngineStepError` fails its requests and
    the loop goes on, until ``max_step_failures`` in a row; any other exception ends the process (``dead``).
    On the way out every request still unfinished is aborted and its final output sent."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server shuts us down
    from infer.engine import LLMEngine

    try:
        eng = LLMEngine(config)
    except BaseException as e:  # reported to EngineProcess.__init__, which raises it
        conn.send(("error", None, _portable(e)))
        return
    try:
        conn.send(("ready", None, EngineInfo.of(eng)))
        _EngineLoop(eng, conn, max_step_failures, busy_poll_s).run()
    finally:
        try:
            eng.shutdown()
        except Exception:
            log.exception("engine shutdown failed")


class _EngineLoop:
    """The engine process's side of the pipe (see the module docstring)."""

    def __init__(self, eng, conn, max_step_failures: int, busy_poll_s: float = 0.0) -> None:
        self.eng, self.conn, self.max_step_failures = eng, conn, max_step_failures
        self.busy_poll_s = busy_poll_s
        self.counts = (0, 0, 0)  # what the server last heard: running, waiting, preempted

    def wait_for_command(self, since: float) -> None:
        """Idle: return when a command (or the end of the pipe) is there. Until ``busy_poll_s`` after
        ``since`` (the last step's end, ``time.perf_counter``) by polling the pipe in a loop, then asleep in
        the kernel. Busy polling spares the next request a wake-up from sleep, and its first step a CPU
        core that has slowed down meanwhile: on an H200 host the first token of a request sent 20 ms after
        the previous one ended reached the client ~0.4 ms sooner (docs/phases/02-server.md). It costs one
        core for that long after each burst of work (SGLang's scheduler polls for requests all the time)."""
        end = since + self.busy_poll_s
        while time.perf_counter() < end:
            if self.conn.poll(0):
                return
        self.conn.poll(None)

    def send(self, kind: str, key: Any, value: Any) -> None:
        self.conn.send((kind, key, value))

    def _counts(self) -> tuple[int, int, int]:
        eng = self.eng
        return eng.num_running, eng.num_waiting, getattr(eng, "num_preemptions", 0)

    def handle(self, kind: str, key: Any, arg: Any) -> bool:
        """One command; True for ``shutdown``."""
        eng = self.eng
        if kind == "add":
            rid, prompt, params, lora_request = arg
            try:
                eng.add_request(prompt, params, request_id=rid, lora_request=lora_request)
            except Exception as e:  # rejected: nothing is queued
                self.send("reply", key, (False, _portable(e)))
                return False
            self.counts = self._counts()
            self.send("reply", key, (True, self.counts))
        elif kind == "abort":
            req = eng.requests.get(arg)
            if eng.abort_request(arg):
                self.counts = self._counts()
                self.send("outs", None, ([OutputProcessor.make_output(req)], self.counts))
            else:
                self.send("unknown", None, arg)
        elif kind == "call":
            try:
                result = (True, arg(eng))
            except Exception as e:
                result = (False, _portable(e))
            try:
                self.send("reply", key, result)
            except (pickle.PicklingError, TypeError, AttributeError) as e:  # a result the pipe cannot carry
                self.send("reply", key, (False, TypeError(f"the call's result cannot be sent back: {e}")))
        return kind == "shutdown"

    def _fail_step(self, e: EngineStepError, failures: int) -> None:
        """A failed step: its requests' final outputs and message to the server; re-raised after
        ``max_step_failures`` in a row (the process ends)."""
        fatal = failures >= self.max_step_failures
        self.send("failed", fatal, (e.request_ids, e.outputs, failure_message(e)))
        if fatal:
            raise e

    def run(self) -> None:
        eng, conn = self.eng, self.conn
        failures = 0
        try:
            stop = False
            last_step = time.perf_counter()
            while not stop:
                if not eng.has_unfinished_requests():
                    self.wait_for_command(last_step)  # idle: until a command (or the end of the pipe) arrives
                while not stop and conn.poll(0):
                    stop = self.handle(*conn.recv())  # EOFError: the server is gone
                if stop:
                    break
                outs, failures = step_engine(eng, failures, self._fail_step)
                last_step = time.perf_counter()
                counts = self._counts()
                if outs or counts != self.counts:
                    self.counts = counts
                    self.send("outs", None, (outs, counts))
                if counts[1] and not counts[0]:
                    time.sleep(0.001)  # static batching is waiting for its batch to fill
        except (EOFError, OSError, BrokenPipeError):
            return  # the server's end of the pipe is closed: nobody to answer
        except BaseException as e:
            if isinstance(e, EngineStepError):
                log.error("%d engine steps failed in a row: the engine stops", failures)
            else:
                log.exception("engine process crashed")
            try:
                self.send("dead", None, f"the engine stopped: {e!r}")
            except OSError:
                pass
            return
        finals = []  # shutdown: every request still unfinished ends with finish_reason "abort"
        for rid in list(eng.requests):
            req = eng.requests.get(rid)
            if eng.abort_request(rid):
                finals.append(OutputProcessor.make_output(req))
        try:
            if finals:
                self.send("outs", None, (finals, (0, 0, self.counts[2])))
            self.send("bye", None, None)
        except OSError:
            pass


# ---------------------------------------------------------------------------- what /metrics reads


class _OffloadStats:
    """A KV offloader's statistics as :class:`~infer.server.metrics.SchedulerCollector` reads them."""

    def __init__(self, stats: dict) -> None:
        self._stats = stats

    def stats(self) -> dict:
        return self._stats


def metrics_sources(eng) -> tuple[Any, Any, float]:
    """Run in the engine process at a scrape: picklable copies of what
    :class:`~infer.server.metrics.SchedulerCollector` and :class:`~infer.server.metrics.OutputCollector` read of
    the scheduler and the output processor, and the KV cache's usage."""
    s, kv = eng.scheduler, eng.scheduler.kv
    snapshots = None if kv.snapshots is None else SimpleNamespace(
        num_hits=kv.snapshots.num_hits, num_stored=kv.snapshots.num_stored, num_evicted=kv.snapshots.num_evicted)
    offloader = None if kv.offloader is None else _OffloadStats(kv.offloader.stats())
    scheduler = SimpleNamespace(
        prefill_tokens_buckets=list(s.prefill_tokens_buckets), num_prefill_tokens=s.num_prefill_tokens,
        iteration_tokens=s.iteration_tokens, num_chunked_steps=s.num_chunked_steps,
        kv=SimpleNamespace(prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
                           snapshots=snapshots, offloader=offloader, offload_hit_tokens=kv.offload_hit_tokens))
    op = eng.output_processor
    outputs = SimpleNamespace(inter_token_latency=op.inter_token_latency, spec_stats=op.spec_stats)
    return scheduler, outputs, s.kv_cache_usage()


# ---------------------------------------------------------------------------- the server's side


class _PipeInbox:
    """What :class:`AsyncEngine`'s event-loop side puts its commands into (``put((cmd, arg, future))``),
    here sent down the pipe; the futures wait in :attr:`EngineProcess._pending` for their replies."""

    def __init__(self, owner: EngineProcess) -> None:
        self.owner = owner

    def put(self, item: tuple) -> None:
        self.owner._command(*item)


class EngineProcess(AsyncEngine):
    """:class:`~infer.server.async_engine.AsyncEngine` with the engine in another process (see the module
    docstring): the same methods for the routes (``submit``, ``submit_many``, ``call``, ``abort``,
    ``metrics_sources``, ``shutdown``), :attr:`info` received from the engine process, and ``engine`` None
    (nothing of the engine lives here).

    Args:
        config: the engine's configuration (pickled to the engine process, which builds the engine from it).
        max_waiting, on_finished, max_step_failures: as :class:`AsyncEngine`'s.
        log_level: the engine process's logging level.
        busy_poll_s: how long the idle engine process polls the pipe after its last step before it sleeps
            (seconds; 0: it sleeps at once; see :meth:`_EngineLoop.wait_for_command`), and the server's
            event loop its sockets after the last output (:meth:`AsyncEngine.keep_loop_polling`).

    ``__init__`` returns once the engine is built and re-raises what building it raised (a
    :class:`~infer.errors.ModelLoadError`, a ``ValueError`` of the configuration).

    Raises:
        EngineDead: the engine process exited before it said whether the engine was built.
    """

    def __init__(self, config: EngineConfig, max_waiting: int = 256, on_finished=None, max_step_failures: int = 3,
                 log_level: str = "INFO", busy_poll_s: float = 0.0) -> None:
        # no first-token hand-off: the reader thread waiting for the loop would delay no engine step here
        self._setup(max_waiting, on_finished, max_step_failures, 0.0)
        self.loop_busy_poll_s = busy_poll_s  # the event loop polls as long (keep_loop_polling)
        self.engine = None
        self._inbox = _PipeInbox(self)
        self._keys = itertools.count()
        self._pending: dict[int, tuple[concurrent.futures.Future, Any]] = {}  # key -> (future, what it is for)
        self._send_lock = threading.Lock()
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked; a fresh interpreter can use it
        self._conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=engine_main, name="infer-engine-core",  # not a daemon: a parallel
                                   daemon=False,  # engine starts workers of its own
                                   args=(config, child, max_step_failures, log_level, busy_poll_s))
        self.process.start()
        child.close()  # the engine process's end: ours reads EOF when that process is gone
        try:
            kind, _, value = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineDead(f"the engine process exited (code {self.process.exitcode}) while starting") from None
        if kind == "error":
            self.process.join(10)
            raise value
        self.info: EngineInfo = value
        self._thread = threading.Thread(target=self._read, name="infer-engine-pipe", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    # ------------------------------------------------------------------ event-loop side

    def _command(self, cmd: str, arg: Any, fut: concurrent.futures.Future | None) -> None:
        """Send one of AsyncEngine's commands (``add``, ``abort``, ``call``, ``shutdown``) down the pipe."""
        key = None
        if cmd == "add":
            rid, prompt, params, stream, lora_request = arg
            key = next(self._keys)
            self._pending[key] = (fut, (rid, stream))
            arg = (rid, prompt, params, lora_request)
        elif cmd == "call":
            key = next(self._keys)
            self._pending[key] = (fut, None)
        try:
            with self._send_lock:
                self._conn.send((cmd, key, arg))
        except (pickle.PicklingError, TypeError, AttributeError) as e:  # a call of a lambda, say
            self._pending.pop(key, None)
            fut.set_exception(TypeError(f"cannot send {cmd!r} to the engine process: {e}"))
        except OSError:
            self._pending.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_exception(EngineDead("the engine process is gone"))

    async def metrics_sources(self) -> tuple[Any, Any, float]:
        """As :meth:`AsyncEngine.metrics_sources`: copies made in the engine process (one round trip)."""
        return await self.call(metrics_sources)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the engine process to abort what runs and exit; kill it if it has not within ``timeout``."""
        if not self._stopping.is_set() and self.process.is_alive():
            self._command("shutdown", None, None)
        self._thread.join(timeout)
        self.process.join(timeout)
        if self.process.is_alive():
            log.error("the engine process did not exit within %.0f s: killed", timeout)
            self.process.kill()
            self.process.join(5)
        self._stopping.set()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the reader thread

    def _read(self) -> None:
        """Hand what the engine process sends to the requests' streams and the waiting futures."""
        try:
            while True:
                kind, key, value = self._conn.recv()
                if kind == "outs":
                    outs, (self.num_running, self.num_waiting, self.num_preemptions) = value
                    self._deliver_step(outs)
                elif kind == "reply":
                    self._reply(key, *value)
                elif kind == "unknown":  # finished already, or never admitted: end its stream if still open
                    self._awaiting_first.discard(value)
                    if value in self._streams:
                        self._deliver(value, RequestOutput(value, None, [], [], finished=True))
                        self._streams.pop(value, None)
                elif kind == "failed":
                    request_ids, outputs, message = value
                    for out in outputs:
                        self._record_finished(out)
                    if not key:  # not fatal: the engine serves on
                        for rid in request_ids:
                            self._deliver(rid, RequestFailed(message))
                            self._streams.pop(rid, None)
                            self._awaiting_first.discard(rid)
                elif kind == "dead":
                    self.error = RuntimeError(value)
                    break
                elif kind == "bye":
                    break
        except (EOFError, OSError):
            if not self._stopping.is_set():
                self.error = RuntimeError(f"the engine process exited (code {self.process.exitcode})")
                log.error("%s", self.error)
        finally:
            self._stopping.set()
            self.num_running = self.num_waiting = 0
            why = EngineDead(f"the engine stopped: {self.error}") if self.error is not None else None
            for rid in list(self._streams):  # what the engine did not end (a shutdown ended the rest)
                self._deliver(rid, why or RequestOutput(rid, None, [], [], finished=True))
            self._streams.clear()
            for fut, _ in list(self._pending.values()):
                if fut is not None and not fut.done():
                    fut.set_exception(EngineDead("the engine is shutting down"))
            self._pending.clear()

    def _reply(self, key: int, ok: bool, value: Any) -> None:
        fut, add = self._pending.pop(key, (None, None))
        if fut is None:
            return
        if not ok:
            fut.set_exception(value)
            return
        if add is None:  # a call's result
            fut.set_result(value)
            return
        rid, stream = add  # an accepted request: its outputs may follow at once
        self._streams[rid] = stream
        self._awaiting_first.add(rid)
        self.num_running, self.num_waiting, self.num_preemptions = value
        fut.set_result(rid)
