"""The scheduler decides *what* runs at each step: which sequences, and how many tokens each.

It never touches tensors. Its output is a list of :class:`ScheduledSeq` (a sequence and its
number of new tokens); the model runner turns that into one flattened forward, prefill and
decode alike. KV-cache space is handed out in blocks by a
:class:`~infer.engine.kv_cache_manager.KVCacheManager` (one block of ``max_model_len`` tokens
per sequence for the contiguous cache, ``block_size``-token blocks for the paged one).

The admission policy (``EngineConfig.batching``: one request at a time, static batches, or
continuous batching) is an object chosen once (:mod:`infer.engine.batching`); everything else is
shared.

Each step is built the same way whatever the policy (vLLM v1's scheduler order):

1. running sequences first: one decode token each, or all their uncomputed tokens if they
   were admitted but their prefill did not fit an earlier step's budget. A sequence that
   crosses a block boundary takes a new block; when none is free, the most recently admitted
   request is *preempted* (phase 5, recompute): its blocks are freed, it goes back to the
   front of the waiting queue, and when it is admitted again it prefills its prompt and the
   tokens it had generated, then carries on where it stopped (vLLM's default policy);
2. then admission (policy above), FIFO, stopping at the first request that does not fit,
   so no request is overtaken forever.

A request with ``n > 1`` prefills once: its sequence 0 runs the prompt with the others
attached as ``forks``, which share the prompt's full blocks and get a copy of its last,
partly filled block (the model runner copies it after the forward); every fork samples its
first token from the same logits.

Chunked prefill (phase 6, ``chunked_prefill=True``; Sarathi-Serve, Agrawal et al., OSDI 2024,
and vLLM v1's scheduler): a prefill no longer has to fit one step. Each step spends the
budget on the running decodes first (one token each: *decode-maximal* batching), then hands
what is left to prefills, in admission order, as *chunks* of at most the budget left (and at
most ``long_prefill_token_threshold`` tokens per request). A sequence whose prefill is cut
carries on with its next chunk in the next step; it samples only after its last chunk (the
model runner samples a sequence once all its tokens are computed), and a request's forks
(``n > 1``) are attached to that last chunk only, so their copy of the prompt's last block
is made once the whole prompt is in the cache. Admission still reserves the blocks of the
whole prompt, so a half-prefilled sequence needs no new block until it decodes.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from infer.engine.batching import make_batching_policy
from infer.engine.histogram import BucketCounts
from infer.engine.kv_cache_manager import KVCacheManager
from infer.engine.sequence import Request, SeqStatus, Sequence

#: upper bounds (inclusive) of the prefill-tokens-per-step histogram (``infer:iteration_prefill_tokens``)
#: and of the tokens-per-step one (``infer:iteration_tokens_total``; vLLM's buckets)
PREFILL_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class ScheduledSeq:
    """``num_tokens`` tokens of ``seq`` run this step, from ``seq.num_computed_tokens`` on.

    ``forks``: sibling sequences (same request, ``n > 1``) that share this prefill; after the
    step they hold the prompt's K/V (shared blocks plus a copy of the last one) and a first
    token of their own.

    ``spec_token_ids``: speculative decoding (phase 12): draft tokens verified this step after the
    sequence's last token; ``num_tokens`` counts them (``1 + len(spec_token_ids)``).

    ``state_restore`` and ``state_snapshots``: hybrid prefix caching (phase 17,
    :meth:`~infer.engine.kv_cache_manager.KVCacheManager.plan_state_snapshots`): the snapshot slot the
    sequence's state starts from this step (a prefix hit; -1: its own slot), and ``(offset, slot)`` pairs:
    after ``offset`` of this step's tokens, the linear layers split their prefill there and copy their
    state into ``slot`` (-1: split only).
    """

    seq: Sequence
    num_tokens: int
    forks: list[Sequence] = field(default_factory=list)
    spec_token_ids: list[int] | tuple = ()
    state_restore: int = -1
    state_snapshots: list[tuple[int, int]] = field(default_factory=list)


class Scheduler:
    """FIFO admission into a block-managed KV cache under a per-step token budget.

    Args:
        kv: the block manager of the KV cache.
        policy: ``"none"``, ``"static"`` or ``"continuous"``: the batching policy
            (:mod:`infer.engine.batching`), made once here.
        max_num_seqs: the most sequences running at once.
        max_num_batched_tokens: the most tokens (prefill + decode) in one step.
        batch_wait_timeout_s: static batching: the longest the oldest request waits for a
            batch to fill.
        chunked_prefill: split prefills into chunks under the budget, decodes first (module
            docstring); without it a prefill that does not fit the budget left waits.
        long_prefill_token_threshold: with chunked prefill, the most tokens one sequence's
            prefill takes in one step (None: no cap but the budget).
        max_loras: LoRA (phase 16): the most distinct adapters among the running requests (the
            device's adapter slots), or None without LoRA. A request whose adapter would be one more
            waits, like one that does not fit the KV cache.
        prefill_chunk_alignment: with chunked prefill, a chunk that leaves part of its prefill for
            later ends at a multiple of this many tokens of its sequence; when the budget left does not
            reach one, the chunk waits for a later step (whose budget does reach one as long as
            ``max_num_batched_tokens - max_num_seqs`` is at least the alignment; below that it runs where
            the budget ends). Hybrid models with prefix caching (phase 17) set it to their chunked
            rule's chunk size: a chunk that starts on a chunk boundary has its state snapshots at chunk
            ends, which the prefill kernels store in the same pass.

    Attributes:
        num_preemptions: requests preempted so far (``infer:num_preemptions_total``).
        num_steps, max_running, running_sum, kv_utilization_sum: for :meth:`stats`.
        num_prefill_tokens, num_chunked_steps, prefill_tokens_buckets: prefill tokens run so far,
            steps that ran a partial prefill (a chunk that left some of its sequence's tokens for
            a later step), and a histogram of prefill tokens per step (counts per bucket of
            :data:`PREFILL_TOKEN_BUCKETS`, the last counting steps above the largest bound; only
            steps with prefill tokens are counted).
        iteration_tokens: tokens (prefill and decode) run by each step, a
            :class:`~infer.engine.histogram.BucketCounts` over :data:`PREFILL_TOKEN_BUCKETS`.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        policy: str = "none",
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 1 << 62,
        batch_wait_timeout_s: float = 0.0,
        chunked_prefill: bool = False,
        long_prefill_token_threshold: int | None = None,
        max_loras: int | None = None,
        prefill_chunk_alignment: int = 1,
    ) -> None:
        self.policy = make_batching_policy(policy, max_num_seqs, batch_wait_timeout_s)
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        if long_prefill_token_threshold is not None and long_prefill_token_threshold < 1:
            raise ValueError(f"long_prefill_token_threshold must be >= 1, got {long_prefill_token_threshold}")
        self.long_prefill_token_threshold = long_prefill_token_threshold if chunked_prefill else None
        self.max_loras = max_loras
        if prefill_chunk_alignment < 1:
            raise ValueError(f"prefill_chunk_alignment must be >= 1, got {prefill_chunk_alignment}")
        self.prefill_chunk_alignment = prefill_chunk_alignment
        self.num_prefill_tokens = 0
        self.num_chunked_steps = 0
        self.prefill_tokens_buckets = [0] * (len(PREFILL_TOKEN_BUCKETS) + 1)
        self.iteration_tokens = BucketCounts(PREFILL_TOKEN_BUCKETS)
        self.speculative = False  # phase 12: set by the engine when a proposer drafts tokens (_add_drafts)
        self.num_steps = 0
        self.num_preemptions = 0
        self.max_running = 0
        self.running_sum = 0
        self.kv_utilization_sum = 0.0
        #: step traces (:mod:`infer.engine.step_trace`): called with each request :meth:`preempt` preempts
        self.on_preempt: Callable[[Request], None] | None = None

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def kv_cache_usage(self) -> float:
        """Fraction (0-1) of the KV cache held by sequences: blocks in use / blocks."""
        return self.kv.usage()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ admission

    def _has_room(self, request: Request) -> bool:
        """Are there KV blocks and sequence slots for all of ``request``'s unfinished sequences?"""
        n = len(request.unfinished_seqs)
        return (len(self.running) + n <= self.max_num_seqs and self.kv.can_admit(request)
                and self._has_lora_slot(request))

    def running_loras(self) -> set[int]:
        """The ``lora_int_id`` s of the running requests' adapters (LoRA, phase 16)."""
        return {s.request.lora_int_id for s in self.running if s.request.lora_request is not None}

    def _has_lora_slot(self, request: Request) -> bool:
        """LoRA: is ``request``'s adapter already running, or is there a slot for one more? Every adapter
        of the running set must be resident at once, so a step never needs more than ``max_loras``."""
        if self.max_loras is None or request.lora_request is None:
            return True
        running = self.running_loras()
        return request.lora_int_id in running or len(running) < self.max_loras

    def _first_prefill(self, request: Request) -> int:
        """Tokens of the first prefill an admitted request runs (its prompt, or after a
        preemption its first unfinished sequence's prompt and generated tokens), less what the
        prefix cache holds (phase 7)."""
        n = request.prompt_len if request.shares_prefill else len(request.unfinished_seqs[0].token_ids)
        return n - self.kv.cached_prefix_tokens(request) if self.kv.prefix_caching else n

    def _chunk(self, num_tokens: int, budget: int, start: int = 0) -> int:
        """Tokens of a ``num_tokens``-token prefill starting at token ``start`` of its sequence to run this
        step with ``budget`` tokens left: all of it, or nothing when it does not fit; with chunked prefill,
        as many as the budget and ``long_prefill_token_threshold`` allow (0 when the budget is spent), a
        partial chunk cut back to end at a multiple of ``prefill_chunk_alignment`` (see ``__init__``)."""
        if not self.chunked_prefill:
            return num_tokens if num_tokens <= budget else 0
        n = min(num_tokens, budget, self.long_prefill_token_threshold or num_tokens)
        align = self.prefill_chunk_alignment
        if n < num_tokens and align > 1:
            aligned = max(0, (start + n) // align * align - start)
            # no boundary within this budget: wait (0) when a later step's is sure to reach one (the first
            # prefill in line gets at least the budget less one token per running decode), else run unaligned
            if aligned or self.max_num_batched_tokens - self.max_num_seqs >= align:
                n = aligned
        return n

    def _admit(self, request: Request, budget: int, scheduled: list[ScheduledSeq]) -> int:
        """Give ``request`` its KV blocks, make it running, and schedule the prefills (or, with
        chunked prefill, their first chunks) that fit ``budget`` (the others run in later steps).
        Returns the budget left."""
        self.kv.admit(request)  # prefix caching: sets num_computed_tokens past the cached prefix
        if request.first_scheduled_time is None:  # its queueing ends (infer:request_queue_time_seconds)
            request.first_scheduled_time = time.perf_counter()
        seqs = request.unfinished_seqs
        for seq in seqs:
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        if request.shares_prefill:  # one prefill for all n sequences
            items = [ScheduledSeq(seqs[0], seqs[0].num_uncomputed_tokens, seqs[1:])]
        else:
            items = [ScheduledSeq(s, s.num_uncomputed_tokens) for s in seqs]
        for item in items:
            n = self._chunk(item.num_tokens, budget, item.seq.num_computed_tokens)
            if n:
                if n < item.num_tokens:  # a first chunk: the forks join the last one
                    item = ScheduledSeq(item.seq, n)
                scheduled.append(item)
                budget -= n
        return budget

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        """Admit waiting requests (FIFO) while they fit; append their prefills to ``scheduled``.

        Returns the token budget left. The first request that does not fit stops admission
        (later ones never overtake it). The policy (:mod:`infer.engine.batching`) says whether
        admission runs this step (``admits_now``: "none" into an empty engine, "static" when a batch
        is ready, "continuous" always), whether a request whose first prefill does not fit the budget
        left is admitted anyway (``admits_past_budget``: a static batch starts together) and whether
        admission stops after one request (``one_request_at_a_time``: "none").
        """
        # >>> EXERCISE admission
        if not self.policy.admits_now(self):
            return budget
        while self.waiting and self._has_room(self.waiting[0]):
            request = self.waiting[0]
            need = 1 if self.chunked_prefill else self._first_prefill(request)  # chunked: any room starts it
            if need > budget and not self.policy.admits_past_budget:
                break
            self.waiting.popleft()
            budget = self._admit(request, budget, scheduled)
            if self.policy.one_request_at_a_time:
                break
        return budget
        # <<< EXERCISE admission

    # ------------------------------------------------------------------ the step

    @staticmethod
    def _waits_for_shared_prefill(seq: Sequence) -> bool:
        """A fork of a fresh request: its sequence 0 prefills for it."""
        return seq.index > 0 and seq.num_computed_tokens == 0 and seq.request.shares_prefill

    def schedule(self) -> list[ScheduledSeq]:
        """The sequences that run this step and how many new tokens each contributes."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        # >>> EXERCISE chunk_schedule
        order = list(self.running)
        if self.chunked_prefill:  # decode-maximal batching: every decode before any prefill chunk
            order.sort(key=lambda s: s.num_uncomputed_tokens > 1)  # stable: admission order otherwise
        for seq in order:
            if seq.status is not SeqStatus.RUNNING or self._waits_for_shared_prefill(seq):
                continue  # preempted earlier in this step, or a fork
            want = seq.num_uncomputed_tokens
            n = self._chunk(want, budget, seq.num_computed_tokens)
            if n == 0:
                if want == 1 or self.chunked_prefill:
                    break  # the budget is spent
                continue  # a prefill that does not fit this step; smaller work may
            if not self._reserve_blocks(seq, n, scheduled):
                budget = self.max_num_batched_tokens - sum(s.num_tokens for s in scheduled)
                continue  # seq itself was preempted
            last = n == want  # the forks join the chunk that completes the shared prompt
            forks = [s for s in seq.request.seqs[1:] if self._waits_for_shared_prefill(s)] if seq.index == 0 and last else []
            scheduled.append(ScheduledSeq(seq, n, forks))
            budget -= n
        # <<< EXERCISE chunk_schedule
        if self.speculative:
            budget = self._add_drafts(scheduled, budget)
        self._admit_waiting(budget, scheduled)
        if getattr(self.kv, "snapshots", None) is not None:  # hybrid prefix caching (phase 17): state snapshots
            self.kv.plan_state_snapshots(scheduled)
        if scheduled:
            self._record(scheduled)
        return scheduled

    def _add_drafts(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        """Speculative decoding (phase 12): let each scheduled decode with draft tokens
        (``seq.spec_token_ids``, set by the proposer after the last step) verify them this step, as many
        as the budget left after every decode and prefill chunk allows, in schedule order. Drafts are
        extra work that may be thrown away, so they take only free blocks (no preemption for them) and
        never delay a decode or a prefill. Returns the budget left."""
        for i, item in enumerate(scheduled):
            seq = item.seq
            if budget <= 0:
                break
            if item.num_tokens != 1 or not seq.spec_token_ids or seq.num_uncomputed_tokens != 1:
                continue
            spec = seq.spec_token_ids[:budget]
            while spec and not self.kv.allocate_slots(seq, 1 + len(spec)):
                spec = spec[:-1]
            if spec:
                scheduled[i] = ScheduledSeq(seq, 1 + len(spec), item.forks, spec)
                budget -= len(spec)
        return budget

    def _record(self, scheduled: list[ScheduledSeq]) -> None:
        """Per-step statistics: batch width, tokens run, and how full the reserved KV slots are."""
        self.num_steps += 1
        num_tokens = sum(s.num_tokens for s in scheduled)
        self.iteration_tokens.observe(num_tokens)
        self.max_running = max(self.max_running, len(self.running))
        self.running_sum += len(self.running)
        prefill = [s for s in scheduled if s.num_tokens - len(s.spec_token_ids) > 1 or s.seq.in_prefill]
        if prefill:
            tokens = sum(s.num_tokens for s in prefill)
            self.num_prefill_tokens += tokens
            self.prefill_tokens_buckets[bisect.bisect_left(PREFILL_TOKEN_BUCKETS, tokens)] += 1
            if any(s.num_tokens < s.seq.num_uncomputed_tokens for s in prefill):
                self.num_chunked_steps += 1
        reserved = (self.kv.num_blocks - self.kv.num_free_blocks) * self.kv.block_size
        if reserved:
            held = sum(s.num_computed_tokens for s in self.running) + num_tokens
            self.kv_utilization_sum += min(1.0, held / reserved)

    def reset_stats(self) -> None:
        self.num_steps = self.num_preemptions = self.max_running = self.running_sum = 0
        self.num_prefill_tokens = self.num_chunked_steps = 0
        self.prefill_tokens_buckets = [0] * (len(PREFILL_TOKEN_BUCKETS) + 1)
        self.iteration_tokens.reset()
        self.kv_utilization_sum = 0.0
        self.kv.prefix_cache_queries = self.kv.prefix_cache_hits = 0

    def stats(self) -> dict[str, float]:
        """Totals since start: steps, preemptions, the widest batch, the mean batch (running
        sequences per step: static batching's shrinking batches show here), and the mean KV
        utilization (tokens whose K/V is cached / token slots reserved in blocks, averaged over
        steps; the contiguous cache reserves ``max_model_len`` slots per sequence, a paged one
        rounds each sequence up to a block), prefill tokens (all of them, and per step with any)
        and the steps that ran a partial prefill chunk (chunked prefill)."""
        steps_with_prefill = sum(self.prefill_tokens_buckets)
        return {
            "num_steps": self.num_steps,
            "num_preemptions": self.num_preemptions,
            "max_running_seqs": self.max_running,
            "mean_running_seqs": self.running_sum / self.num_steps if self.num_steps else 0.0,
            "mean_kv_utilization": self.kv_utilization_sum / self.num_steps if self.num_steps else 0.0,
            "num_prefill_tokens": self.num_prefill_tokens,
            "mean_prefill_tokens_per_step": self.num_prefill_tokens / steps_with_prefill if steps_with_prefill else 0.0,
            "num_chunked_prefill_steps": self.num_chunked_steps,
        }

    # ------------------------------------------------------------------ preemption

    def _reserve_blocks(self, seq: Sequence, n: int, scheduled: list[ScheduledSeq]) -> bool:
        """Make room in the cache for ``n`` new tokens of ``seq``, preempting if need be.

        While the pool is short, the request of the last running sequence (the most recently
        admitted) is preempted. Returns False if that was ``seq``'s own request.
        """
        # >>> EXERCISE preemption
        while not self.kv.allocate_slots(seq, n):
            victim = self.running[-1].request
            self.preempt(victim)
            scheduled[:] = [s for s in scheduled if s.seq.request is not victim]
            if victim is seq.request:
                return False
        return True
        # <<< EXERCISE preemption

    def preempt(self, request: Request) -> None:
        """Preempt by recompute: free ``request``'s blocks and put it back at the front of the
        waiting queue. Its sequences keep their tokens; readmitted, they recompute their K/V."""
        for seq in request.seqs:
            if seq.status is SeqStatus.RUNNING:
                self.kv.free(seq)
                self.running.remove(seq)
                seq.status = SeqStatus.WAITING
                seq.num_computed_tokens = 0
                seq.spec_token_ids = []  # it prefills again first
                seq.draft_num_computed_tokens = 0  # (its blocks, the draft's K/V with them, are gone)
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(request)

    # ------------------------------------------------------------------ leaving

    def free(self, seq: Sequence) -> None:
        """Release a finished (or aborted) sequence's KV blocks at once."""
        self.kv.free(seq)
        if seq in self.running:
            self.running.remove(seq)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is; returns it, or None if unknown."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                for seq in req.seqs:
                    self.kv.free(seq)  # nothing held unless a bug; keep the pool exact
                return req
        found = None
        for seq in list(self.running):
            if seq.request.request_id == request_id:
                self.free(seq)
                found = seq.request
        return found
