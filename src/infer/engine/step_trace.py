"""Step traces: what every engine step did, kept per step and written as a Chrome / Perfetto trace.

A step of the engine is a handful of decisions: which sequences run and how many tokens each (a
prompt chunk or one decode token), whether the KV cache had room or a request was preempted, how
much of a new prompt the prefix cache already held, whether the step replayed a captured CUDA graph,
and how long the host and the device took. With ``EngineConfig.trace`` set, a :class:`StepRecorder`
keeps those for each step (:class:`StepRecord`), and :meth:`StepRecorder.trace_events` lays them out
in the Trace Event Format (the JSON that chrome://tracing and ui.perfetto.dev read and that
``torch.profiler``'s ``export_chrome_trace`` writes; Google's "Trace Event Format" document):

* process ``infer engine``, thread ``steps``: one complete event (``ph: "X"``, ``ts`` and ``dur`` in
  microseconds) per step, named for what it ran (``prefill``, ``decode`` or ``mixed``; ``outputs only``
  for async scheduling's last step, which only processes the step before it), with the step's three
  host phases nested inside: ``schedule``, ``forward`` (the inputs built and the forward and sampling
  launched; on a CPU, run) and ``outputs`` (stop checks, detokenization, freeing; under async
  scheduling the previous step's tokens); an instant (``ph: "i"``) per preemption;
* counters (``ph: "C"``) on that process, sampled after each step's scheduling: ``KV cache blocks``
  (used, cached: free but holding a prefix-cache block, free), ``sequences`` (running, waiting),
  ``step tokens`` (prefill, decode) and, with ``kv_offload``, ``KV offload blocks`` (host, disk: the
  blocks each lower tier holds);
* process ``requests``: one thread per sequence (named by its request id; ``#i`` marks sequence ``i``
  of an ``n > 1`` request): ``queued`` from arrival to admission (``preempted`` from a preemption to
  the readmission), one event per step it ran in (``prefill``; ``prefill chunk`` when the prompt is
  not finished; ``recompute``, the prefill of prompt and generated tokens after a preemption;
  ``decode``), and instants when it is preempted and when it finishes;
* metadata events (``ph: "M"``) naming the processes and threads.

Neither vLLM nor SGLang records per-step events of this kind (they expose counters: Prometheus
metrics and logged step statistics); the format is the one ``torch.profiler`` writes, so a step
trace opens like a profiler trace of the same run.

Off (the default) the engine holds no recorder and a step pays four ``is not None`` checks (the
engine's step, schedule and finish; the model runner's execute), nothing allocated. On, a step costs
a few ``time.perf_counter`` calls, one small tuple per scheduled sequence and, on CUDA, two events.
What is kept is bounded: the last :data:`MAX_STEPS` steps, and no more than :data:`MAX_SEQ_ENTRIES`
scheduled sequences over them (the oldest steps go first).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

log = logging.getLogger("infer")

#: the most steps a recorder keeps (the oldest are dropped first)
MAX_STEPS = 20_000
#: the most scheduled sequences kept over those steps (a 256-sequence decode step is 256); ~100 bytes each
#: in memory, ~200 bytes each in the written trace
MAX_SEQ_ENTRIES = 500_000

#: the engine counters whose change over a step each :class:`StepRecord` keeps (``counts``), in order
COUNTS = ("preemptions", "prefix_hit_tokens", "offload_hit_tokens", "evictions", "offloaded_blocks",
          "restored_blocks", "device_copied_blocks")


class SeqWork(NamedTuple):
    """One sequence's share of a step, taken when the step is scheduled.

    Attributes:
        request_id, index: its request, and its index there (0 unless ``n > 1``).
        start: its ``num_computed_tokens`` before the step: tokens whose K/V is in the cache (at an
            admission, what the prefix cache supplied).
        num_tokens: tokens it runs this step.
        num_prompt_tokens: the length of its prompt.
        samples: it samples a token after this step (a decode, or the chunk that ends its prefill).
        forks: sibling sequences (``n > 1``) that share this prefill.
    """

    request_id: str
    index: int
    start: int
    num_tokens: int
    num_prompt_tokens: int
    samples: bool
    forks: int

    @property
    def kind(self) -> str:
        """``"decode"`` (one token after the prompt) or ``"prefill"`` (prompt tokens, or after a
        preemption the prompt and generated tokens recomputed): the scheduler's own split
        (``Scheduler._record``: more than one token, or still in the prompt)."""
        return "decode" if self.num_tokens == 1 and self.start >= self.num_prompt_tokens else "prefill"

    @property
    def phase(self) -> str:
        """What the trace names its slice: ``decode``; ``prefill`` (the chunk that ends the prompt),
        ``prefill chunk`` (the prompt goes on next step) or ``recompute`` (after a preemption, the
        prompt and generated tokens computed again)."""
        if self.kind == "decode":
            return "decode"
        if self.context_len > self.num_prompt_tokens:
            return "recompute"
        return "prefill" if self.samples else "prefill chunk"

    @property
    def context_len(self) -> int:
        """Tokens in the cache after the step (``start + num_tokens``): the keys its attention reads."""
        return self.start + self.num_tokens


@dataclass(slots=True)
class StepRecord:
    """What one engine step did. Times are ``time.perf_counter()`` seconds.

    Attributes:
        index: the step's number among the recorded steps (from 0).
        t_start, t_scheduled, t_forward, t_end: the step began; the scheduler returned; the model
            runner had launched the forward and the sampling (on a CPU: run them; None if the runner
            did not say); the outputs were processed.
        seqs: the scheduled sequences (:class:`SeqWork`), in the scheduler's order.
        admitted: ``(request id, index, cached tokens, arrival time)`` of each sequence admitted
            this step (made running: fresh, or back after a preemption).
        preempted: request ids preempted while scheduling this step.
        finished: ``(request id, index, finish reason)`` of the sequences that finished (under async
            scheduling, those of the step before, whose tokens this step processed).
        running, waiting: sequences running and requests waiting after scheduling.
        kv_used, kv_cached, kv_free: KV-cache blocks after scheduling: held by sequences; free but
            holding a cached prefix block (evictable); free and empty.
        tier_blocks: with ``kv_offload``, the blocks the host and disk tiers hold after scheduling
            (``(host, disk)``); None without.
        graph: the captured graph that ran the step (``"decode"``, ``"verify"``, ``"prefill"``,
            ``"mixed-whole"``, ``"mixed-pieces"``), None when it ran eagerly; ``graph_size``: its bucket (tokens).
        counts: the change over the step of each engine counter of :data:`COUNTS` (preemptions,
            prefix-cache hit tokens, tokens restored from the KV offload tiers, cached blocks evicted,
            blocks copied to the offload tiers, blocks restored from them, blocks copied on the device).
        device_ms: CUDA: the step's span on the device's stream (events recorded before its first
            launch and after its last, milliseconds), None until read; a CPU: None (the forward span
            is the device's work, :meth:`forward_ms`).
    """

    index: int
    t_start: float
    t_scheduled: float = 0.0
    t_forward: float | None = None
    t_end: float = 0.0
    seqs: list[SeqWork] = field(default_factory=list)
    admitted: list[tuple[str, int, int, float]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[tuple[str, int, str | None]] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    kv_used: int = 0
    kv_cached: int = 0
    kv_free: int = 0
    tier_blocks: tuple[int, int] | None = None
    graph: str | None = None
    graph_size: int | None = None
    counts: dict[str, int] = field(default_factory=dict)
    device_ms: float | None = None
    events: tuple[Any, Any] | None = None  # CUDA: (start, end) torch.cuda.Event until device_ms is read

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def name(self) -> str:
        """``prefill``, ``decode``, ``mixed`` (both), or ``outputs only`` (nothing scheduled)."""
        kinds = {s.kind for s in self.seqs}
        return "outputs only" if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"

    def forward_ms(self) -> float | None:
        """Milliseconds from the scheduler's return to the forward's launch (CPU: its end)."""
        return None if self.t_forward is None else 1e3 * (self.t_forward - self.t_scheduled)


def _counters(engine) -> tuple[int, ...]:
    """The engine's cumulative counters of :data:`COUNTS`, now."""
    kv, off = engine.kv_manager, engine.offloader
    c = off.counters if off is not None else None
    return (engine.scheduler.num_preemptions, kv.prefix_cache_hits, kv.offload_hit_tokens,
            getattr(kv.pool, "num_evictions", 0),
            c["kv_offload_stored_blocks"] if c else 0,
            c["kv_offload_host_hits"] + c["kv_offload_disk_hits"] if c else 0,
            c["kv_offload_device_copies"] if c else 0)


class StepRecorder:
    """Records every engine step (:class:`StepRecord`) and writes them as a Chrome trace.

    The engine calls it at fixed points of a step: :meth:`begin`, :meth:`scheduled` (after the
    scheduler), :meth:`executed` (the model runner's ``on_executed``), :meth:`preempted` (the
    scheduler's ``on_preempt``), :meth:`finished` and :meth:`end` (or :meth:`abandon` when the step
    raised).

    Args:
        path: where :meth:`write` writes the trace (JSON); None: no file (a recorder that only feeds
            :attr:`listeners`, as the server's live page does).
        cuda: time the device with CUDA events.
        budget: the scheduler's token budget per step (``max_num_batched_tokens``).
        info: what the trace's ``otherData`` says about the run (model, flags).
        max_steps, max_seq_entries: the bounds on what is kept (:data:`MAX_STEPS`,
            :data:`MAX_SEQ_ENTRIES`).

    Attributes:
        steps: the records kept, oldest first.
        dropped: records dropped to keep within the bounds.
        listeners: callables ``(engine, record)`` called on the engine thread with each record kept,
            as :meth:`end` keeps it (:meth:`~infer.engine.LLMEngine.add_step_listener`); they must
            return quickly and never block.
    """

    def __init__(self, path: str | None, cuda: bool = False, budget: int = 0, info: dict | None = None,
                 max_steps: int = MAX_STEPS, max_seq_entries: int = MAX_SEQ_ENTRIES) -> None:
        self.path = path
        self.cuda = cuda
        self.budget = budget
        self.info = dict(info or {})
        self.max_steps, self.max_seq_entries = max_steps, max_seq_entries
        self.steps: deque[StepRecord] = deque()
        self.dropped = 0
        self.listeners: list = []
        self.origin = time.perf_counter()  # ts 0 of the trace
        self.origin_unix_s = time.time()
        self._num_entries = 0
        self._next_index = 0
        self._rec: StepRecord | None = None
        self._before: tuple[int, ...] = ()
        self._running: set[int] = set()  # seq ids running after the last step's scheduling
        self._pending: deque[StepRecord] = deque()  # CUDA: records whose device time is not read yet

    # ------------------------------------------------------------------ the engine's hooks

    def begin(self, engine) -> None:
        self._rec = StepRecord(self._next_index, time.perf_counter())
        self._before = _counters(engine)

    def scheduled(self, engine, scheduled: list) -> None:
        """The scheduler returned ``scheduled`` (:class:`~infer.engine.scheduler.ScheduledSeq` s)."""
        rec = self._rec
        if rec is None:
            return
        rec.t_scheduled = time.perf_counter()
        rec.seqs = [SeqWork(s.seq.request.request_id, s.seq.index, s.seq.num_computed_tokens, s.num_tokens,
                            s.seq.num_prompt_tokens, s.seq.num_computed_tokens + s.num_tokens >= len(s.seq.token_ids),
                            len(s.forks)) for s in scheduled]
        sch, kv = engine.scheduler, engine.kv_manager
        before = self._running
        self._running = {s.seq_id for s in sch.running}
        rec.admitted = [(s.request.request_id, s.index, s.num_computed_tokens, s.request.arrival_time)
                        for s in sch.running if s.seq_id not in before]
        rec.running, rec.waiting = len(sch.running), len(sch.waiting)
        free = kv.num_free_blocks
        rec.kv_cached = getattr(kv.pool, "num_cached_free", 0)
        rec.kv_used, rec.kv_free = kv.num_blocks - free, free - rec.kv_cached
        off = engine.offloader
        if off is not None:
            rec.tier_blocks = (len(off.host), len(off.disk) if off.disk is not None else 0)
        if self.cuda and scheduled:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            rec.events = (start, None)

    def executed(self, out) -> None:
        """The model runner launched the step's forward and sampling (``out``: its ``ForwardOutput``)."""
        rec = self._rec
        if rec is None:
            return
        rec.t_forward = time.perf_counter()
        rec.graph = out.graph
        if rec.events is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            rec.events = (rec.events[0], end)

    def preempted(self, request) -> None:
        if self._rec is not None:
            self._rec.preempted.append(request.request_id)

    def finished(self, seqs: list) -> None:
        if self._rec is not None:
            self._rec.finished.extend((s.request.request_id, s.index, s.finish_reason) for s in seqs)

    def abandon(self) -> None:
        """The step raised: its record is dropped."""
        self._rec = None

    def end(self, engine) -> None:
        """The step's outputs are processed: keep its record (if it did anything)."""
        rec, self._rec = self._rec, None
        if rec is None or not (rec.seqs or rec.finished or rec.preempted):
            return
        rec.t_end = time.perf_counter()
        rec.counts = dict(zip(COUNTS, (a - b for a, b in zip(_counters(engine), self._before))))
        if rec.graph is not None:
            rec.graph_size = self._graph_size(engine, rec)
        self._next_index += 1
        self.steps.append(rec)
        self._num_entries += len(rec.seqs)
        while len(self.steps) > self.max_steps or self._num_entries > self.max_seq_entries:
            old = self.steps.popleft()
            self._num_entries -= len(old.seqs)
            self.dropped += 1
        if rec.events is not None:
            if rec.events[1] is None:  # the runner did not say when it was done: no device time
                rec.events = None
            else:
                self._pending.append(rec)
        self.read_device_times(wait=False)
        for listener in self.listeners:
            listener(engine, rec)

    @staticmethod
    def _graph_size(engine, rec: StepRecord) -> int | None:
        from infer.engine.cuda_graphs import bucket_for

        g = engine.runner.graphs
        sizes = {"decode": g.sizes, "verify": g.sizes, "prefill": g.prefill_sizes}.get(rec.graph, g.mixed_sizes)
        return bucket_for(rec.num_tokens, sizes)

    def read_device_times(self, wait: bool) -> None:
        """CUDA: read the device time of the steps whose events have completed (all of them, waiting
        for the device, with ``wait``), and let their events go."""
        while self._pending:
            rec = self._pending[0]
            start, end = rec.events
            if wait:
                end.synchronize()
            elif not end.query():
                return
            rec.device_ms = start.elapsed_time(end)
            rec.events = None
            self._pending.popleft()

    def clear(self) -> None:
        """Forget the steps kept so far: the trace starts again at the next step, numbered from 0 and
        timed from now (a benchmark's warm-up left out of its trace). Call it between steps."""
        self.read_device_times(wait=True)
        self.steps.clear()
        self.dropped = self._num_entries = self._next_index = 0
        self.origin, self.origin_unix_s = time.perf_counter(), time.time()

    # ------------------------------------------------------------------ the trace

    def trace_events(self) -> list[dict]:
        """The kept steps as Trace Event Format events (module docstring), each track's events in
        time order (``ts`` in microseconds from the recorder's creation)."""
        self.read_device_times(wait=True)
        return _TraceBuilder(self).build()

    def trace(self) -> dict:
        """The whole trace: ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``."""
        other = {**self.info, "steps_kept": len(self.steps), "steps_dropped": self.dropped,
                 "token_budget": self.budget, "origin_unix_s": self.origin_unix_s}
        return {"traceEvents": self.trace_events(), "displayTimeUnit": "ms", "otherData": other}

    def write(self, path: str | None = None) -> str:
        """Write the trace (JSON) to ``path`` (default: the recorder's), replacing the file whole.

        Returns:
            The path written.

        Raises:
            OSError: the file cannot be written.
            ValueError: neither ``path`` nor the recorder's.
        """
        path = path or self.path
        if path is None:
            raise ValueError("this step recorder has no trace file: pass a path")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.trace(), f, separators=(",", ":"))
        os.replace(tmp, path)
        log.info("step trace: %d steps written to %s", len(self.steps), path)
        return path


class _TraceBuilder:
    """Lays a recorder's steps out as Trace Event Format events (one call of :meth:`build`)."""

    ENGINE, REQUESTS = 1, 2  # pids
    STEPS_TID = 1

    def __init__(self, recorder: StepRecorder) -> None:
        self.r = recorder
        self.tracks: dict[tuple[str, int], int] = {}  # (request id, index) -> tid
        self.by_track: dict[int, list[dict]] = {}
        self.engine: list[dict] = []

    def us(self, t: float) -> float:
        return round((t - self.r.origin) * 1e6, 3)

    def tid(self, rid: str, index: int) -> int:
        key = (rid, index)
        if key not in self.tracks:
            self.tracks[key] = len(self.tracks) + 1
            self.by_track[self.tracks[key]] = []
        return self.tracks[key]

    def on_track(self, rid: str, index: int, event: dict) -> None:
        self.by_track[self.tid(rid, index)].append({**event, "pid": self.REQUESTS, "tid": self.tid(rid, index)})

    def build(self) -> list[dict]:
        preempted_at: dict[str, float] = {}  # request id -> when it was last preempted (us)
        indices: dict[str, set[int]] = {}  # request id -> its sequences seen so far
        for rec in self.r.steps:
            self.step_events(rec)
            ts = self.us(rec.t_start)
            for rid, index, cached, arrival in rec.admitted:
                indices.setdefault(rid, set()).add(index)
                start, name = (preempted_at[rid], "preempted") if rid in preempted_at else (self.us(arrival), "queued")
                if ts > start:
                    self.on_track(rid, index, {"name": name, "ph": "X", "ts": start, "dur": round(ts - start, 3),
                                               "args": {"cached_tokens": cached}})
            for s in rec.seqs:
                indices.setdefault(s.request_id, set()).add(s.index)
                self.on_track(s.request_id, s.index, self.seq_event(rec, s, ts))
            t_sched = self.us(rec.t_scheduled)
            for rid in rec.preempted:
                preempted_at[rid] = t_sched
                for index in sorted(indices.get(rid, {0})):
                    self.on_track(rid, index, {"name": "preempted", "ph": "i", "s": "t", "ts": t_sched})
            for rid, index, reason in rec.finished:
                preempted_at.pop(rid, None)
                self.on_track(rid, index, {"name": "finished", "ph": "i", "s": "t", "ts": self.us(rec.t_end),
                                           "args": {"finish_reason": reason}})
        return self.metadata() + _ordered(self.engine) + [e for t in self.by_track.values() for e in _ordered(t)]

    def seq_event(self, rec: StepRecord, s: SeqWork, ts: float) -> dict:
        name = s.phase
        args = {"step": rec.index, "tokens": s.num_tokens, "context_len": s.context_len, "start": s.start}
        if s.forks:
            args["forks"] = s.forks
        return {"name": name, "ph": "X", "ts": ts, "dur": round(self.us(rec.t_end) - ts, 3), "args": args}

    def step_events(self, rec: StepRecord) -> None:
        us, out = self.us, self.engine
        ts, t_sched, end = us(rec.t_start), us(rec.t_scheduled), us(rec.t_end)
        t_fwd = us(rec.t_forward) if rec.t_forward is not None else t_sched
        prefill = sum(s.num_tokens for s in rec.seqs if s.kind == "prefill")
        decode = rec.num_tokens - prefill
        forward_ms = rec.forward_ms()
        args = {"step": rec.index, "sequences": len(rec.seqs), "tokens": rec.num_tokens, "budget": self.r.budget,
                "prefill_tokens": prefill, "decode_tokens": decode, "graph": rec.graph or "eager",
                "graph_size": rec.graph_size, **rec.counts,
                "host_ms": round((t_sched - ts + end - t_fwd) / 1e3, 4),
                "forward_ms": None if forward_ms is None else round(forward_ms, 4),
                "device_ms": round(rec.device_ms, 4) if rec.device_ms is not None
                else None if self.r.cuda or forward_ms is None else round(forward_ms, 4)}
        common = {"ph": "X", "pid": self.ENGINE, "tid": self.STEPS_TID}
        out.append({"name": rec.name, **common, "ts": ts, "dur": round(end - ts, 3), "args": args})
        out.append({"name": "schedule", **common, "ts": ts, "dur": round(t_sched - ts, 3)})
        if rec.t_forward is not None:
            out.append({"name": "forward", **common, "ts": t_sched, "dur": round(t_fwd - t_sched, 3),
                        "args": {"graph": rec.graph or "eager"}})
        out.append({"name": "outputs", **common, "ts": t_fwd, "dur": round(end - t_fwd, 3)})
        for rid in rec.preempted:
            out.append({"name": "preempt", "ph": "i", "s": "t", "pid": self.ENGINE, "tid": self.STEPS_TID,
                        "ts": t_sched, "args": {"request": rid}})
        counter = {"ph": "C", "pid": self.ENGINE, "ts": t_sched}
        out.append({"name": "KV cache blocks", **counter,
                    "args": {"used": rec.kv_used, "cached": rec.kv_cached, "free": rec.kv_free}})
        out.append({"name": "sequences", **counter, "args": {"running": rec.running, "waiting": rec.waiting}})
        out.append({"name": "step tokens", **counter, "args": {"prefill": prefill, "decode": decode}})
        if rec.tier_blocks is not None:
            out.append({"name": "KV offload blocks", **counter,
                        "args": {"host": rec.tier_blocks[0], "disk": rec.tier_blocks[1]}})

    def metadata(self) -> list[dict]:
        m = [{"name": "process_name", "ph": "M", "pid": self.ENGINE, "args": {"name": "infer engine"}},
             {"name": "process_sort_index", "ph": "M", "pid": self.ENGINE, "args": {"sort_index": 0}},
             {"name": "thread_name", "ph": "M", "pid": self.ENGINE, "tid": self.STEPS_TID, "args": {"name": "steps"}},
             {"name": "process_name", "ph": "M", "pid": self.REQUESTS, "args": {"name": "requests"}},
             {"name": "process_sort_index", "ph": "M", "pid": self.REQUESTS, "args": {"sort_index": 1}}]
        for (rid, index), tid in self.tracks.items():
            name = rid if index == 0 else f"{rid}#{index}"
            m.append({"name": "thread_name", "ph": "M", "pid": self.REQUESTS, "tid": tid, "args": {"name": name}})
            m.append({"name": "thread_sort_index", "ph": "M", "pid": self.REQUESTS, "tid": tid,
                      "args": {"sort_index": tid}})
        return m


def _ordered(events: list[dict]) -> list[dict]:
    """``events`` by time; at the same ``ts`` an enclosing (longer) event first, so slices nest."""
    return sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0)))
