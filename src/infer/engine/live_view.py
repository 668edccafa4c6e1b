"""The engine as a live page shows it: step events and snapshots of its queues and KV cache.

``python -m infer.server --live-page`` serves a page that draws the engine while it works
(``infer.server.routes.live``). This module is its engine half, and knows nothing of HTTP:

* a :class:`LiveView` listens to the engine's steps (:meth:`~infer.engine.LLMEngine.add_step_listener`,
  the hooks of :mod:`infer.engine.step_trace`) and keeps the last ``max_events`` of them in a ring
  (a ``deque`` with ``maxlen``: when a reader falls behind, the oldest events are dropped, never the
  engine held up). Each event is numbered; a reader asks for the events after the last number it saw
  (:meth:`LiveView.since`) and learns how many it missed;
* every ``snapshot_interval_s`` (and after a step that leaves the engine idle) the listener also
  takes a :meth:`LiveView.snapshot`: the running and waiting requests and the owner of every KV-cache
  block, which only the engine thread may read (the engine is not locked). A fresh page asks for
  one at once (the server runs :meth:`LiveView.snapshot` on the engine thread between two steps).

What the engine thread pays per step with the page on: the step recorder's hooks (measured by
``benchmarks/trace_overhead.py``), a few dictionary operations for the time to first token, and one
append under a lock that readers hold only to copy references. A step event is turned into JSON by
the reader (:func:`step_event`), off the engine thread; a snapshot costs a pass over the blocks
(``num_blocks`` list slots; about 1 ms per 30,000 blocks in CPython) four times a second.

No engine among vLLM, SGLang and nano-vllm draws its scheduler or its block map; vLLM and SGLang
expose counters (Prometheus) and logged step statistics. The block map's states are those of
:class:`~infer.engine.prefix_cache.PrefixCachingBlockPool`: in use, cached free, free.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any

from infer.engine.step_trace import COUNTS, StepRecord

#: block-map codes of the blocks no running request holds alone (others are the index of the owner
#: in the snapshot's ``running`` list)
FREE, CACHED, SHARED = -1, -2, -3
#: the most sequences of one step an event lists (the rest are counted in ``more``)
MAX_SEQS_PER_EVENT = 64
#: the most waiting requests a snapshot lists (the rest are counted)
MAX_WAITING_LISTED = 256


def run_length(codes: list[int]) -> list[list[int]]:
    """``[[code, count], ...]``: runs of equal codes in order (the block map on the wire; blocks are
    handed out lowest id first, so the map is mostly long runs)."""
    return [[code, sum(1 for _ in run)] for code, run in itertools.groupby(codes)]


class LiveView:
    """Step events and snapshots of one :class:`~infer.engine.LLMEngine`, for the live page.

    Construct it on the engine thread, or before the engine serves requests: it hooks a step
    listener into the engine.

    Args:
        engine: the engine (an :class:`~infer.engine.LLMEngine`).
        max_events: how many events the ring keeps (a reader further behind misses the oldest).
        snapshot_interval_s: at most how often a step also takes a snapshot (seconds).

    Attributes:
        num_events: events published so far (the next one's number).
        origin: ``time.perf_counter()`` at which event times (``t``, milliseconds) start.
        info: what does not change while serving: model, flags, KV-cache shape, token budget.
    """

    def __init__(self, engine, max_events: int = 2048, snapshot_interval_s: float = 0.25) -> None:
        if max_events < 1 or snapshot_interval_s < 0:
            raise ValueError(f"max_events must be >= 1 and snapshot_interval_s >= 0, got {max_events}, "
                             f"{snapshot_interval_s}")
        self.engine = engine
        self.snapshot_interval_s = snapshot_interval_s
        self._lock = threading.Lock()
        self._ring: deque[tuple[int, str, Any]] = deque(maxlen=max_events)
        self.num_events = 0
        self._awaiting_first: dict[str, float] = {}  # request id -> arrival, until its first token
        self._last_snapshot = 0.0
        engine.add_step_listener(self._on_step)
        self.origin = engine.tracer.origin
        c, kv = engine.config, engine.kv_manager
        self.info = {"model": c.model, "device": str(engine.runner.device), "flags": c.optimization_summary(),
                     "num_blocks": kv.num_blocks, "block_size": kv.block_size,
                     "token_budget": engine.scheduler.max_num_batched_tokens,
                     "max_num_seqs": engine.scheduler.max_num_seqs, "prefix_caching": kv.prefix_caching,
                     "kv_offload": c.kv_offload}

    # ------------------------------------------------------------------ engine thread

    def _publish(self, kind: str, payload: Any) -> None:
        with self._lock:
            self._ring.append((self.num_events, kind, payload))
            self.num_events += 1

    def _on_step(self, engine, rec: StepRecord) -> None:
        """The step listener: the step's record (with the times to first token it saw and the
        inter-token latency totals), then a snapshot when one is due."""
        waiting = self._awaiting_first
        for rid, index, _cached, arrival in rec.admitted:
            if index == 0:
                waiting.setdefault(rid, arrival)
        ttft = []
        for s in rec.seqs:
            if s.samples and s.index == 0 and s.context_len == s.num_prompt_tokens and s.request_id in waiting:
                ttft.append((s.request_id, rec.t_end - waiting.pop(s.request_id)))
        for rid, index, _reason in rec.finished:
            if index == 0:
                waiting.pop(rid, None)  # aborted before its first token
        itl = engine.output_processor.inter_token_latency
        self._publish("step", (rec, ttft, (itl.sum, sum(itl.counts))))
        now = time.perf_counter()
        idle = not engine.scheduler.has_unfinished()  # after the step (rec's counts are before its finishes)
        if idle or now - self._last_snapshot >= self.snapshot_interval_s:
            self._publish("state", self.snapshot())

    def snapshot(self) -> dict:
        """The engine's queues and KV-cache blocks now. Call it on the engine thread only (between
        steps, or from a step listener): it reads the scheduler's and the block pool's state.

        Returns:
            A JSON-able dict: ``running`` (one entry per running request: ``id``, ``seqs`` running,
            ``prompt`` tokens, ``computed`` tokens in the cache, ``generated`` tokens, ``blocks``
            held, ``cached`` prompt tokens the prefix cache supplied, ``age_ms`` since arrival,
            ``ttft_ms`` once it has its first token), ``waiting`` (``id``, ``prompt``, ``generated``:
            non-zero after a preemption, ``preempted``, ``age_ms``; the first
            :data:`MAX_WAITING_LISTED`, ``waiting_more`` the rest), ``blocks``: the block map as
            :func:`run_length` runs of codes (the index of the owning request in ``running``,
            :data:`FREE`, :data:`CACHED` free, :data:`SHARED` by several requests), ``kv``: blocks
            ``used``, ``cached``, ``free`` and ``usage`` (the fraction ``/metrics`` reports as
            ``infer:kv_cache_usage_perc``), ``offload``: the host (and disk) tier's blocks and
            capacity (None without ``kv_offload``), and totals (``preemptions``, ``steps``,
            ``prefix_hit_tokens``, ``itl``: the inter-token latency's sum (s) and count).
        """
        eng = self.engine
        sch, kv = eng.scheduler, eng.kv_manager
        pool, now = kv.pool, time.perf_counter()
        codes = [FREE] * kv.num_blocks
        for b in getattr(pool, "cached_free", ()):
            codes[b] = CACHED
        running: dict[str, dict] = {}
        owners: dict[str, int] = {}  # request id -> its index in running (its code in the block map)
        for seq in sch.running:
            req = seq.request
            entry = running.get(req.request_id)
            if entry is None:
                owners[req.request_id] = len(running)
                entry = running[req.request_id] = {
                    "id": req.request_id, "seqs": 0, "prompt": req.prompt_len, "computed": 0, "generated": 0,
                    "blocks": 0, "cached": req.num_cached_tokens or 0, "age_ms": round(1e3 * (now - req.arrival_time), 1),
                    "ttft_ms": None if req.first_token_time is None
                    else round(1e3 * (req.first_token_time - req.arrival_time), 2)}
            owner = owners[req.request_id]
            entry["seqs"] += 1
            entry["computed"] = max(entry["computed"], seq.num_computed_tokens)
            entry["generated"] = max(entry["generated"], seq.num_output_tokens)
            entry["blocks"] += len(seq.block_table)
            for b in seq.block_table:
                codes[b] = owner if codes[b] in (FREE, owner) else SHARED
        waiting = [{"id": r.request_id, "prompt": r.prompt_len,
                    "generated": max((s.num_output_tokens for s in r.seqs), default=0),
                    "preempted": r.first_scheduled_time is not None,
                    "age_ms": round(1e3 * (now - r.arrival_time), 1)}
                   for r in itertools.islice(sch.waiting, MAX_WAITING_LISTED)]
        free = kv.num_free_blocks
        cached = getattr(pool, "num_cached_free", 0)
        off = eng.offloader
        itl = eng.output_processor.inter_token_latency
        self._last_snapshot = now
        return {"t": round(1e3 * (now - self.origin), 3), "running": list(running.values()), "waiting": waiting,
                "waiting_more": max(0, len(sch.waiting) - MAX_WAITING_LISTED),
                "blocks": run_length(codes),
                "kv": {"used": kv.num_blocks - free, "cached": cached, "free": free - cached,
                       "usage": sch.kv_cache_usage()},
                "offload": None if off is None else {
                    "host_used": len(off.host), "host_capacity": off.host.num_slots,
                    "disk_used": len(off.disk) if off.disk is not None else 0,
                    "disk_capacity": off.disk.num_slots if off.disk is not None else 0},
                "preemptions": sch.num_preemptions, "steps": sch.num_steps,
                "prefix_hit_tokens": kv.prefix_cache_hits, "itl": [itl.sum, sum(itl.counts)]}

    # ------------------------------------------------------------------ readers (any thread)

    def since(self, after: int) -> tuple[list[tuple[int, str, Any]], int]:
        """The events numbered ``after`` and later that the ring still holds, and how many of those
        numbers it no longer holds (dropped before this reader got them)."""
        with self._lock:
            ring = list(self._ring)
        if not ring:
            return [], 0
        first = ring[0][0]
        dropped = max(0, first - after)
        return ring[max(0, after - first):], dropped

    def step_event(self, rec: StepRecord, ttft: list[tuple[str, float]], itl: tuple[float, int]) -> dict:
        """A step's record as the page reads it (JSON-able; times in milliseconds from :attr:`origin`).

        Keys: ``step`` (its number), ``t`` and ``ms`` (start, duration), ``name`` (``prefill``,
        ``decode``, ``mixed``, ``outputs only``), ``prefill`` and ``decode`` tokens, ``seqs``
        (``[request id, index, phase, tokens, context length]`` for the first
        :data:`MAX_SEQS_PER_EVENT`, ``more`` the rest; phases as :attr:`SeqWork.phase
        <infer.engine.step_trace.SeqWork.phase>`), ``admitted`` (``[request id, index, cached
        tokens]``), ``preempted``, ``finished`` (``[request id, index, reason]``), ``running`` and
        ``waiting`` after scheduling, ``kv`` (blocks used, cached, free after scheduling), ``graph``
        (the captured graph that ran it, or None), ``counts`` (the engine counters that changed),
        ``host_ms`` (schedule, forward, outputs), ``ttft`` (``[request id, ms]`` of the requests
        whose first token this step made) and ``itl`` (inter-token latency sum (s) and count so far).
        """
        prefill = sum(s.num_tokens for s in rec.seqs if s.kind == "prefill")
        fwd = rec.t_forward if rec.t_forward is not None else rec.t_scheduled
        return {
            "step": rec.index, "t": round(1e3 * (rec.t_start - self.origin), 3),
            "ms": round(1e3 * (rec.t_end - rec.t_start), 3), "name": rec.name,
            "prefill": prefill, "decode": rec.num_tokens - prefill,
            "seqs": [[s.request_id, s.index, s.phase, s.num_tokens, s.context_len]
                     for s in rec.seqs[:MAX_SEQS_PER_EVENT]],
            "more": max(0, len(rec.seqs) - MAX_SEQS_PER_EVENT),
            "admitted": [[rid, index, cached] for rid, index, cached, _ in rec.admitted],
            "preempted": list(rec.preempted), "finished": [list(f) for f in rec.finished],
            "running": rec.running, "waiting": rec.waiting,
            "kv": [rec.kv_used, rec.kv_cached, rec.kv_free], "graph": rec.graph,
            "counts": {k: v for k, v in rec.counts.items() if v and k in COUNTS},
            "host_ms": [round(1e3 * (rec.t_scheduled - rec.t_start), 3), round(1e3 * (fwd - rec.t_scheduled), 3),
                        round(1e3 * (rec.t_end - fwd), 3)],
            "ttft": [[rid, round(1e3 * t, 2)] for rid, t in ttft],
            "itl": [itl[0], itl[1]],
        }
