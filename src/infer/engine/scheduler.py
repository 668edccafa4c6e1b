"""The scheduler decides *what* runs at each step: which sequences, and how many tokens each.

It never touches tensors. Its output is a list of ``(sequence, num_new_tokens)``; the model
runner turns that into one flattened forward (prefill and decode alike).

Policy of ``batching="none"`` (the phase-1 baseline): one request at a time. A request is
admitted when nothing is running; its sequences prefill their whole prompt in the first step
and then decode one token per step until every one of them has finished.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from infer.engine.sequence import Request, SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    """``num_tokens`` tokens of ``seq`` run this step, from ``seq.num_computed_tokens`` on."""

    seq: Sequence
    num_tokens: int


class Scheduler:
    """FIFO admission into a fixed number of KV-cache rows.

    Args:
        num_rows: rows of the contiguous KV cache (the most sequences that can run at once).
    """

    def __init__(self, num_rows: int) -> None:
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        self.free_rows: list[int] = list(range(num_rows - 1, -1, -1))
        self.num_rows = num_rows

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def kv_cache_usage(self) -> float:
        """Fraction (0-1) of the KV cache held by sequences: rows in use / rows."""
        return 1.0 - len(self.free_rows) / self.num_rows

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self, request: Request) -> None:
        for seq in request.seqs:
            seq.cache_row = self.free_rows.pop()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def schedule(self) -> list[ScheduledSeq]:
        """The sequences that run this step and how many new tokens each contributes."""
        if not self.running and self.waiting:
            self._admit(self.waiting.popleft())
        return [ScheduledSeq(s, len(s.token_ids) - s.num_computed_tokens) for s in self.running]

    def free(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's cache row at once."""
        if seq.cache_row is not None:
            self.free_rows.append(seq.cache_row)
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
