"""When the scheduler admits waiting requests: the batching policy (phases 1, 3 and 4).

``EngineConfig.batching`` names one of three policies; the engine makes the object once and the
scheduler asks it, at every step, whether admission runs now and how:

* :class:`NoBatching` (``"none"``, phase 1): one request at a time, admitted when nothing runs.
* :class:`StaticBatching` (``"static"``, phase 3): a *batch* of up to ``max_num_seqs`` sequences,
  admitted when nothing runs and either the batch is full or the oldest waiting request has waited
  ``batch_wait_timeout_ms``; it runs until every member finishes, and arrivals wait for the next
  batch (FasterTransformer-style request-level batching). A member whose prompt does not fit this
  step's token budget is admitted anyway and prefills in a later step.
* :class:`ContinuousBatching` (``"continuous"``, phase 4): iteration-level scheduling from Orca (Yu
  et al., OSDI 2022): waiting requests are admitted at *every* step while the token budget, the
  sequence limit and the KV cache allow.

Everything else (the order of a step, the token budget, preemption) is the scheduler's and the same
for all three (:mod:`infer.engine.scheduler`).
"""

from __future__ import annotations

import time
from typing import ClassVar

__all__ = ["BatchingPolicy", "ContinuousBatching", "NoBatching", "StaticBatching", "make_batching_policy"]


class BatchingPolicy:
    """The questions the scheduler's admission asks (:meth:`Scheduler._admit_waiting`).

    Attributes:
        name: the ``EngineConfig.batching`` value.
        one_request_at_a_time: admit at most one request per admission (``"none"``).
        admits_past_budget: admit a request even when its first prefill does not fit this step's
            token budget left (``"static"``: the whole batch starts together).
    """

    name: ClassVar[str]
    one_request_at_a_time: ClassVar[bool] = False
    admits_past_budget: ClassVar[bool] = False

    def admits_now(self, scheduler) -> bool:
        """Whether waiting requests may be admitted in this step (``scheduler``: its ``running`` and
        ``waiting`` queues)."""
        return True


class NoBatching(BatchingPolicy):
    """One request at a time: admitted into an empty engine."""

    name = "none"
    one_request_at_a_time = True

    def admits_now(self, scheduler) -> bool:
        return not scheduler.running


class StaticBatching(BatchingPolicy):
    """A batch of up to ``max_num_seqs`` sequences starts when nothing runs and it is full, or when the
    oldest waiting request has waited ``batch_wait_timeout_s`` seconds."""

    name = "static"
    admits_past_budget = True

    def __init__(self, max_num_seqs: int, batch_wait_timeout_s: float) -> None:
        self.max_num_seqs = max_num_seqs
        self.batch_wait_timeout_s = batch_wait_timeout_s

    def admits_now(self, scheduler) -> bool:
        return self.batch_ready(scheduler.running, scheduler.waiting)

    def batch_ready(self, running: list, waiting) -> bool:
        """Is it time to start a batch?

        Yes when nothing runs (``running``: the running sequences) and either the waiting requests'
        sequences fill a batch (``max_num_seqs``) or the oldest (``waiting[0]``; arrival times are
        ``time.perf_counter()`` seconds) has waited ``batch_wait_timeout_s``.
        """
        # >>> EXERCISE batch_ready
        if running or not waiting:
            return False
        queued = sum(len(r.seqs) for r in waiting)
        if queued >= self.max_num_seqs:
            return True
        return time.perf_counter() - waiting[0].arrival_time >= self.batch_wait_timeout_s
        # <<< EXERCISE batch_ready


class ContinuousBatching(BatchingPolicy):
    """Admit at every step, while sequence slots, KV blocks and the token budget allow."""

    name = "continuous"


def make_batching_policy(name: str, max_num_seqs: int, batch_wait_timeout_s: float = 0.0) -> BatchingPolicy:
    """The policy called ``name`` (``"none"``, ``"static"`` or ``"continuous"``).

    Raises:
        ValueError: another name.
    """
    if name == "none":
        return NoBatching()
    if name == "static":
        return StaticBatching(max_num_seqs, batch_wait_timeout_s)
    if name == "continuous":
        return ContinuousBatching()
    raise ValueError(f"unknown batching policy {name!r}")
