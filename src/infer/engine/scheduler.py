"""The scheduler decides *what* runs at each step: which sequences, and how many tokens each.

It never touches tensors. Its output is a list of :class:`ScheduledSeq` (a sequence and its
number of new tokens); the model runner turns that into one flattened forward, prefill and
decode alike.

Three admission policies share everything else (``EngineConfig.batching``):

* ``"none"`` (phase 1): one request at a time. A request is admitted when nothing runs.
* ``"static"`` (phase 3): a *batch* of up to ``max_num_seqs`` sequences is admitted when
  nothing runs and either the batch is full or the oldest waiting request has waited
  ``batch_wait_timeout_ms``. The batch runs until every member finishes; arrivals wait for
  the next batch (FasterTransformer-style request-level batching).
* ``"continuous"`` (phase 4): iteration-level scheduling from Orca (Yu et al., OSDI 2022):
  at *every* step, waiting requests are admitted while the token budget, the sequence
  limit and the KV cache allow, and finished sequences leave at once.

Each step is built the same way whatever the policy (vLLM v1's scheduler order):

1. running sequences first: one decode token each, or their whole prompt if they were
   admitted but their prefill did not fit an earlier step's budget;
2. then admission (policy above), FIFO, stopping at the first request that does not fit,
   so no request is overtaken forever.

A request with ``n > 1`` holds ``n`` cache rows but prefills once: its sequence 0 runs the
prompt with the others attached as ``forks``; the model runner copies the prompt's K/V to
the forks' rows and samples every fork's first token from the same logits.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from infer.engine.sequence import Request, SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    """``num_tokens`` tokens of ``seq`` run this step, from ``seq.num_computed_tokens`` on.

    ``forks``: sibling sequences (same request, ``n > 1``) that share this prefill; after the
    step they hold a copy of the prompt's K/V and a first token of their own.
    """

    seq: Sequence
    num_tokens: int
    forks: list[Sequence] = field(default_factory=list)


class Scheduler:
    """FIFO admission into a fixed number of KV-cache rows under a per-step token budget.

    Args:
        num_rows: rows of the contiguous KV cache (the most sequences that hold cache space).
        policy: ``"none"``, ``"static"`` or ``"continuous"`` (module docstring).
        max_num_seqs: the most sequences running at once.
        max_num_batched_tokens: the most tokens (prefill + decode) in one step.
        batch_wait_timeout_s: static batching: the longest the oldest request waits for a
            batch to fill.
    """

    def __init__(
        self,
        num_rows: int,
        policy: str = "none",
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int = 1 << 62,
        batch_wait_timeout_s: float = 0.0,
    ) -> None:
        if policy not in ("none", "static", "continuous"):
            raise ValueError(f"unknown batching policy {policy!r}")
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        # a min-heap: the lowest free row is handed out first, so rows in use stay packed at
        # the bottom of the cache (the decode attention reads rows [0, highest used row])
        self.free_rows: list[int] = list(range(num_rows))
        self.num_rows = num_rows
        self.max_num_seqs = min(max_num_seqs or num_rows, num_rows)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def kv_cache_usage(self) -> float:
        """Fraction (0-1) of the KV cache held by sequences: rows in use / rows."""
        return 1.0 - len(self.free_rows) / self.num_rows

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ admission

    def _has_room(self, request: Request) -> bool:
        """Are there cache rows and sequence slots for all of ``request``'s sequences?"""
        n = len(request.seqs)
        return n <= len(self.free_rows) and len(self.running) + n <= self.max_num_seqs

    def _batch_ready(self) -> bool:
        """Static batching: is it time to start a batch?

        Yes when nothing runs and either the waiting requests' sequences fill a batch
        (``max_num_seqs``) or the oldest has waited ``batch_wait_timeout_s``.
        """
        # >>> EXERCISE batch_ready
        if self.running or not self.waiting:
            return False
        queued = sum(len(r.seqs) for r in self.waiting)
        if queued >= self.max_num_seqs:
            return True
        return time.perf_counter() - self.waiting[0].arrival_time >= self.batch_wait_timeout_s
        # <<< EXERCISE batch_ready

    def _admit(self, request: Request) -> None:
        for seq in request.seqs:
            seq.cache_row = heapq.heappop(self.free_rows)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        """Admit waiting requests (FIFO) while they fit; append their prefills to ``scheduled``.

        Returns the token budget left. The first request that does not fit stops admission
        (later ones never overtake it). ``"none"`` admits one request into an empty engine;
        ``"static"`` admits a whole batch when :meth:`_batch_ready` (a member whose prompt does
        not fit this step's budget is admitted anyway and prefills in a later step);
        ``"continuous"`` admits at every step while rows, sequence slots and budget allow.
        """
        # >>> EXERCISE admission
        if self.policy == "none" and self.running:
            return budget
        if self.policy == "static" and not self._batch_ready():
            return budget
        while self.waiting and self._has_room(self.waiting[0]):
            request = self.waiting[0]
            fits_budget = request.prompt_len <= budget
            if not fits_budget and self.policy != "static":
                break
            self.waiting.popleft()
            self._admit(request)
            if fits_budget:
                first, *forks = request.seqs
                scheduled.append(ScheduledSeq(first, request.prompt_len, forks))
                budget -= request.prompt_len
            if self.policy == "none":
                break
        return budget
        # <<< EXERCISE admission

    # ------------------------------------------------------------------ the step

    def schedule(self) -> list[ScheduledSeq]:
        """The sequences that run this step and how many new tokens each contributes."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        for seq in self.running:
            if seq.in_prefill:
                # a fork waits for its sequence 0, which prefills for it
                if seq.index > 0 and seq.num_computed_tokens == 0:
                    continue
                n = len(seq.token_ids) - seq.num_computed_tokens
                if n > budget:
                    continue
                forks = [s for s in seq.request.seqs[1:] if s.num_computed_tokens == 0] if seq.index == 0 else []
                scheduled.append(ScheduledSeq(seq, n, forks))
            else:
                if budget < 1:
                    break
                scheduled.append(ScheduledSeq(seq, 1))
                n = 1
            budget -= n
        self._admit_waiting(budget, scheduled)
        if scheduled:
            self.num_steps += 1
        return scheduled

    # ------------------------------------------------------------------ leaving

    def free(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's cache row at once."""
        if seq.cache_row is not None:
            heapq.heappush(self.free_rows, seq.cache_row)
            seq.cache_row = None
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is; returns it, or None if unknown."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return req
        found = None
        for seq in list(self.running):
            if seq.request.request_id == request_id:
                self.free(seq)
                found = seq.request
        return found
