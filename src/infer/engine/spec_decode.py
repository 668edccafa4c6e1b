"""Speculative decoding (phase 12): propose tokens cheaply, verify them in one forward of the model.

At batch 1 a decode step reads every weight to produce one token. A *proposer* guesses the next
``k`` tokens of a sequence; the next step runs the sequence's last token and the ``k`` guesses
(``k + 1`` positions, one forward: an "extend" over its cached context, the shape chunked prefill
already runs) and samples a token at every position. Position ``i``'s token is what decoding would
have produced after the guesses before it, so the guesses are accepted while they equal the
sampled tokens, and the first sampled token that differs (or, when all ``k`` are accepted, the
token after them: the *bonus* token) is emitted too. A step gives 1 to ``k + 1`` tokens.

Where each part lives (vLLM v1's ``spec_decode/`` split):

* the proposers, here: :class:`NgramProposer` (prompt lookup, :func:`ngram_propose`) and, with a
  draft model, :class:`~infer.engine.draft.DraftProposer`; both propose *greedily*, a point mass;
* the scheduler budgets ``1 + len(seq.spec_token_ids)`` tokens for a speculating sequence
  (:class:`~infer.engine.scheduler.Scheduler`), the model runner samples every position
  (:func:`~infer.engine.step.flatten_with_drafts`, each row at its own place in the sequence's
  random stream), the output processor accepts (:func:`num_accepted`), appends the tokens one by one
  (stop strings, EOS and ``max_tokens`` inside an accepted run stop exactly where decoding would)
  and rolls ``num_computed_tokens`` back; the engine returns the blocks past the sequence's end
  (:meth:`~infer.engine.kv_cache_manager.KVCacheManager.truncate`).

Why this is lossless. For a draft distribution ``q`` and target ``p``, the rule of Leviathan et al.
(arXiv:2211.17192) and Chen et al. (arXiv:2302.01318) accepts a drafted ``x`` with probability
``min(1, p(x) / q(x))`` and otherwise samples from ``norm(max(0, p - q))``; the emitted token is then
distributed exactly as ``p`` (:func:`infer.sampling.rejection.rejection_sample` implements it for any
``q``). With a point mass ``q = 1[x]`` it says: accept with probability ``p(x)``, else sample from
``p`` without ``x``, renormalized. Sampling ``y ~ p`` and accepting when ``y == x`` does exactly that
(``P(y = x) = p(x)``, and given ``y != x``, ``y`` is distributed as ``p`` without ``x``), so the
engine samples each position with the sampler it always uses (every sampling parameter applied the
same way) and compares. Since row ``i`` of a sequence draws from its random stream at the place the
``i``-th next token would (:mod:`infer.sampling.rng`), a seeded request even gets the same tokens as
without speculation, not only the same distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from infer.config import SpeculativeConfig
from infer.engine.sequence import Sequence

__all__ = ["BACKOFF_AFTER", "BACKOFF_MAX_STEPS", "NgramProposer", "SpecDecodingStats", "can_speculate", "draft_budget",
           "ngram_propose", "num_accepted", "proposing", "record_round", "take_pause"]

#: the backoff: verify rounds in a row that accept no draft before a sequence pauses speculating
BACKOFF_AFTER = 3
#: the longest pause, in steps (the pauses double from one step: 1, 2, 4, 8, 16, 16, ...)
BACKOFF_MAX_STEPS = 16


def ngram_propose(tokens: list[int] | np.ndarray, min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup (Saxena 2023; vLLM's ``ngram`` method): find the longest n-gram, ``min_n <= n <= max_n``,
    that ends the sequence and occurred before; return up to ``k`` tokens that followed its earliest
    earlier occurrence (fewer when the sequence ends sooner; the proposal may run into the suffix itself).

    Args:
        tokens: the prompt and the output so far.
        min_n, max_n: the n-gram lengths tried, longest first (``1 <= min_n <= max_n``).
        k: the most tokens proposed.

    Returns:
        The proposed token ids (``[]`` when no n-gram matches).
    """
    # >>> EXERCISE ngram_lookup
    t = np.asarray(tokens, dtype=np.int64)
    length = len(t)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # every earlier window of n tokens that starts at s <= length - n - 1 (so a token follows it)
        windows = np.lib.stride_tricks.sliding_window_view(t[: length - 1], n)
        hits = np.flatnonzero((windows == t[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n  # the earliest occurrence, as vLLM
            return t[start : start + k].tolist()
    return []
    # <<< EXERCISE ngram_lookup


def num_accepted(sampled: list[int], draft: list[int]) -> int:
    """How many leading draft tokens the target accepted: ``sampled[i]`` is the token sampled at the
    position of ``draft[i]`` (after ``draft[:i]``); accepted while they agree. ``len(sampled)`` is
    ``len(draft) + 1``: the tokens emitted are ``sampled[: num_accepted + 1]``."""
    # >>> EXERCISE greedy_acceptance
    a = 0
    while a < len(draft) and sampled[a] == draft[a]:
        a += 1
    return a
    # <<< EXERCISE greedy_acceptance


def record_round(seq: Sequence, accepted: int) -> None:
    """The backoff's bookkeeping after ``seq`` verified drafts and ``accepted`` of them held.

    A verify step of ``k + 1`` tokens costs more than a decode step (1.4x at batch 1 on an H100 with
    Qwen3-8B's shapes: ``benchmarks/speculative.py``'s ``verify_cost``), so drafts that are never right
    make decoding slower, not faster. After :data:`BACKOFF_AFTER` rounds in a row that accepted nothing,
    the sequence skips speculating for a pause that doubles with each further miss (1, 2, 4, ... up to
    :data:`BACKOFF_MAX_STEPS` steps, TCP's exponential backoff); one accepted draft ends it. With drafts
    that are never right, 1 step in 17 verifies; with a per-draft acceptance of 0.75, three misses in a
    row happen in 1.6% of the rounds. Output is unchanged either way (a paused sequence decodes)."""
    # >>> EXERCISE draft_backoff
    if accepted:
        seq.spec_misses = 0
        return
    seq.spec_misses += 1
    if seq.spec_misses >= BACKOFF_AFTER:
        seq.spec_pause = min(2 ** (seq.spec_misses - BACKOFF_AFTER), BACKOFF_MAX_STEPS)
    # <<< EXERCISE draft_backoff


def take_pause(seq: Sequence) -> bool:
    """Whether ``seq`` skips speculating this step (:func:`record_round`), counting the step off its pause."""
    if seq.spec_pause > 0:
        seq.spec_pause -= 1
        return True
    return False


def proposing(seqs: list[Sequence], backoff: bool) -> list[Sequence]:
    """Of ``seqs`` (running, each sampled a token this step), those that propose next. With the ``backoff``,
    each counts this step off its pause (:func:`take_pause`), and one still pausing gets no drafts."""
    if not backoff:
        return seqs
    out = []
    for seq in seqs:
        if take_pause(seq):
            seq.spec_token_ids = []
        else:
            out.append(seq)
    return out


def can_speculate(seq: Sequence) -> bool:
    """Whether ``seq``'s next step may verify drafts: its sampling keeps no per-token state the drafted
    positions would have to replay (penalties count the output, a structured-output guide moves with
    each token, ``min_tokens`` bans EOS until enough tokens are out). Such sequences decode one token at
    a time, as before."""
    return seq.guide is None and not seq.has_penalties and seq.num_output_tokens >= seq.params.min_tokens


def draft_budget(seq: Sequence, k: int, max_model_len: int) -> int:
    """The most drafts worth verifying for ``seq`` next step: ``k``, less what would run past
    ``max_tokens`` (a step emits up to drafts + 1 tokens) or past the context (the drafts take
    positions ``len(token_ids) .. len(token_ids) + drafts - 1``)."""
    left = max_model_len - len(seq.token_ids)
    if seq.params.max_tokens is not None:
        left = min(left, seq.params.max_tokens - seq.num_output_tokens - 1)
    return max(0, min(k, left))


class NgramProposer:
    """Proposes by :func:`ngram_propose` over each sequence's prompt and output (no model, no device)."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.k, self.min_n, self.max_n = spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, seqs: list[Sequence]) -> None:
        """Set ``seq.spec_token_ids`` of each of ``seqs`` (running, its last token sampled) to its drafts."""
        for seq in seqs:
            k = draft_budget(seq, self.k, self.max_model_len) if can_speculate(seq) else 0
            seq.spec_token_ids = ngram_propose(seq.token_ids, self.min_n, self.max_n, k) if k else []


@dataclass
class SpecDecodingStats:
    """Counters of speculative decoding (vLLM's ``spec_decode`` metrics).

    Attributes:
        num_drafts: verify rounds (a sequence that verified at least one draft in a step).
        num_draft_tokens: draft tokens verified.
        num_accepted_tokens: of those, accepted.
        accepted_per_pos: ``[k]``: how often the draft at position ``i`` was accepted.
    """

    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.k

    def observe(self, num_draft_tokens: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict[str, float]:
        """The counters, the acceptance rate (accepted / drafted) and the mean acceptance length (tokens
        a verify round emits: 1 + accepted drafts, vLLM's definition)."""
        d, n, a = self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
        return {"spec_decode_num_drafts": d, "spec_decode_num_draft_tokens": n,
                "spec_decode_num_accepted_tokens": a,
                "spec_decode_acceptance_rate": a / n if n else 0.0,
                "spec_decode_mean_acceptance_length": 1 + a / d if d else 0.0}

    def reset(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k
