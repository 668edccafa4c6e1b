"""The batched sampler: logits of B sequences in, B next tokens (and their logprobs) out.

Every row of the batch is a sequence with its own :class:`~infer.sampling.SamplingParams`;
the parameters travel as ``[B]`` device tensors (:class:`SamplingTensors`), so one call of
:func:`sample` handles 1 or 256 sequences with different settings in the same few tensor
operations: no per-request Python loop and no host synchronisation (no ``.item()``, no
``.tolist()``, no data-dependent shapes) inside :func:`sample`. What must be decided on the
host (which transforms any row needs at all, how many top logprobs to return) is decided
once, when :meth:`SamplingTensors.from_params` builds the batch.

Pipeline (in this order; ``l`` is a row of logits, ``p = softmax(l)``)
-----------------------------------------------------------------------

1. **Upcast** the logits to float32 (bf16/fp16 logits lose too much in ``exp``).
2. **Raw logprobs**: ``log_softmax(l)`` of the model's logits, *before* any of the transforms
   below. This is what vLLM v1 returns by default (``logprobs_mode="raw_logprobs"``); it says
   how likely the *model* found the token, whatever the request's sampling settings.
3. **Suppression** (:func:`suppress_tokens`): ``l[v] = -inf`` for the ids in
   ``suppress_ids``. The engine fills them with EOS + ``stop_token_ids`` while a request has
   generated fewer than ``min_tokens`` tokens (vLLM's ``MinTokensLogitsProcessor``).
4. **Repetition penalty** (:func:`apply_penalties`; Keskar et al. 2019, "CTRL: A Conditional
   Transformer Language Model for Controllable Generation", arXiv:1909.05858, with Hugging
   Face's ``RepetitionPenaltyLogitsProcessor`` semantics): for every token ``v`` that occurs in
   the prompt or the output so far, ``l[v] = l[v] / r`` if ``l[v] > 0`` else ``l[v] * r``.
   ``r > 1`` makes repeated tokens less likely whatever the sign of their logit.
5. **Presence and frequency penalties** (:func:`apply_penalties`; OpenAI API reference,
   "frequency and presence penalties"): with ``c[v]`` the number of times ``v`` occurs in the
   *output* (not the prompt), ``l[v] -= frequency * c[v] + presence * (c[v] > 0)``.
6. **Greedy rows** (``temperature == 0``) take ``argmax(l)`` here (first index on ties), so
   temperature, min-p, top-k and top-p do not apply to them.
7. **Temperature** (:func:`apply_temperature`): ``l = l / T`` (the Boltzmann distribution
   ``p ∝ exp(l / T)``; ``T < 1`` sharpens, ``T > 1`` flattens).
8. **Min-p** (:func:`apply_min_p`; Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling
   for Creative and Coherent LLM Outputs", arXiv:2407.01082): keep ``v`` iff
   ``p[v] >= min_p * max(p)``.
9. **Top-k** (:func:`apply_top_k`; Fan, Lewis and Dauphin 2018, "Hierarchical Neural Story
   Generation", arXiv:1805.04833): keep the ``k`` largest logits. Tokens tied with the k-th
   largest are kept too, so the kept set never depends on how ``sort`` breaks ties.
10. **Top-p / nucleus** (:func:`apply_top_p`; Holtzman et al. 2019, "The Curious Case of
    Neural Text Degeneration", arXiv:1904.09751): on the distribution renormalised after the
    steps above, keep the smallest set of most likely tokens whose total probability is
    ``>= top_p`` (the top token is always kept; tokens tied with the last one kept are kept
    too; ``top_p = 1`` keeps everything).
11. **Sample** (:func:`sample_from_probs`) by the *exponential race*: with
    ``E[v] ~ Exponential(1)`` independent, ``argmax_v p[v] / E[v]`` is distributed as ``p``
    (``P(E[v]/p[v] is the smallest) = p[v] / sum(p)``: the minimum of independent exponential
    clocks with rates ``p[v]``). Taking logs, it is the Gumbel-max trick (Gumbel 1954;
    Maddison, Tarlow and Minka 2014, "A* Sampling"). vLLM samples the same way.

Each masking step writes ``-inf`` into the logits of the tokens it removes, and a row whose
parameter disables a step (``top_k = V``, ``top_p = 1``, ``min_p = 0``, penalties ``1/0/0``)
passes through that step bit-for-bit unchanged, which is what makes a row's result
independent of the other rows in the batch.

Randomness
----------
There is no shared ``torch.Generator``: a shared generator would make a request's tokens
depend on which other requests were in the batch and in which order. Instead the uniform
``u[b, v]`` is a *hash* of ``(seeds[b], steps[b], v)`` (a counter-based random number
generator, as in Salmon et al. 2011, "Parallel Random Numbers: As Easy as 1, 2, 3"), computed
with int64 tensor operations by the splitmix64 mixer (Steele, Lea and Flood 2014, "Fast
Splittable Pseudorandom Number Generators"; constants from Vigna's ``splitmix64.c``). So a
request with a given seed gets the same tokens whether it runs alone, in a batch of 256, or
after a preemption, on any device. ``steps[b]`` is the request's own position in its random
stream (how many tokens it has sampled so far).

Fast paths (phase 8)
--------------------
:func:`sample_reference` runs the pipeline above as written: a dozen full ``[B, V]`` passes,
and the uniforms as ``[B, V]`` int64 tensors (about 50 MB of memory traffic per row at Qwen3's
151,936-token vocabulary). :func:`sample` computes the same tokens with less work, deciding
on the host (:meth:`SamplingTensors.from_params`' flags) what the batch needs:

* an all-greedy batch without penalties or suppression is an argmax (and a log-sum-exp for the
  logprob), in one read of the logits;
* suppression and penalties gather and scatter the history's ids only
  (:func:`apply_penalties_sparse`), never building ``[B, V]`` counts;
* top-k takes ``torch.topk`` to the batch's largest k (:func:`apply_top_k_partial`), not a sort;
  top-p sorts only the rows that ask for it (:func:`apply_top_p_rows`), and on a GPU, when every
  such row also has a top-k, only the top-k candidates (already sorted by ``topk``);
* on a GPU, temperature, softmax, min-p, top-k and the exponential race run in Triton kernels
  that read the logits in place and hash the uniforms in registers
  (:mod:`infer.sampling.triton_sampler`): nothing of size ``[B, V]`` is written.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from infer.sampling.params import SamplingParams

if TYPE_CHECKING:
    from infer.sampling.triton_sampler import RowStats

__all__ = [
    "SamplerOutput",
    "SamplingTensors",
    "apply_min_p",
    "apply_penalties",
    "apply_penalties_sparse",
    "apply_temperature",
    "apply_top_k",
    "apply_top_k_partial",
    "apply_top_p",
    "apply_top_p_rows",
    "random_uniform",
    "sample",
    "sample_from_probs",
    "sample_reference",
    "suppress_tokens",
]

# ----------------------------------------------------------------------------- counter-based RNG


def _signed64(x: int) -> int:
    """A Python int reduced modulo 2**64 into int64's range (two's complement)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= (1 << 63) else x


_U_MAX = 1.0 - 2.0**-24  # the largest float32 below 1
_GOLDEN = _signed64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: splitmix64's increment
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _mix64_(z: torch.Tensor, tmp: torch.Tensor) -> None:
    """splitmix64's finaliser, in place on int64 ``z`` (``tmp``, same shape, is scratch): a
    bijection of int64 with good avalanche (multiplies wrap)."""
    for shift, mult in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)  # a logical shift: torch's >> copies the sign bit
        z.bitwise_xor_(tmp)
        if mult is not None:
            z.mul_(mult)


# CPU: elements hashed per slice of rows. The whole [B, V] at once allocates a fresh ~100 MB
# tensor per operation (256 x 49,152 int64), and the page faults of those allocations cost more
# than the hashing; two reused scratch slices of 4 MB each make it ~9x faster (256 rows x 49,152:
# 577 -> 62 ms on a 2-core EPYC) and give bit-identical values.
_CPU_SLICE_ELEMENTS = 1 << 19


def _row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: each row's splitmix64 stream key ``mix(mix(seed + golden) ^ step)``."""
    if seeds.dtype != torch.int64 or steps.dtype != torch.int64:
        raise TypeError(f"seeds and steps must be int64, got {seeds.dtype} and {steps.dtype}")
    key = seeds + _GOLDEN
    tmp = torch.empty_like(key)
    _mix64_(key, tmp)
    key.bitwise_xor_(steps)
    _mix64_(key, tmp)
    return key


def _uniforms_(z: torch.Tensor, tmp: torch.Tensor, out: torch.Tensor) -> None:
    """``z`` holds ``key + (v + 1) * golden`` per entry: hash it in place and write the uniforms of
    :func:`random_uniform` to ``out`` (float32, z's shape); ``tmp`` is scratch."""
    _mix64_(z, tmp)  # the (v + 1)-th output of the row's stream
    torch.bitwise_right_shift(z, 40, out=tmp)
    tmp.bitwise_and_((1 << 24) - 1)  # the top 24 bits
    # (k + 0.5) needs 25 bits for k = 2**24 - 1 and rounds to 2**24 in float32: u would be exactly 1,
    # -log(u) a (negative) zero, and that token's race score -inf here but +inf in a kernel computing
    # the same value another way. The clamp keeps u below 1 (one value in 2**24 moves by 2**-25).
    out.copy_(tmp).add_(0.5).mul_(1.0 / (1 << 24)).clamp_(max=_U_MAX)


def random_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counter-based uniforms: ``u[b, v] = hash(seeds[b], steps[b], v)`` in the open ``(0, 1)``.

    The same ``(seed, step, v)`` always gives the same value, on any device and in any batch.
    Each row is the splitmix64 stream of the key ``mix(mix(seed + golden) ^ step)``; the top 24
    bits of each output become a float32 ``(k + 0.5) / 2**24``, clamped to the largest float32
    below 1 (for ``k = 2**24 - 1`` the float32 sum rounds up to exactly 1), so ``u`` is never 0 or 1
    and ``-log(u)`` is finite and > 0.

    Args:
        seeds: ``[B]`` int64, the request's seed.
        steps: ``[B]`` int64, the request's position in its random stream.
        vocab_size: V, the number of uniforms per row.

    Returns:
        ``[B, V]`` float32 on ``seeds.device``.
    """
    key = _row_keys(seeds, steps)
    dev = key.device
    counter = torch.arange(1, vocab_size + 1, device=dev, dtype=torch.int64) * _GOLDEN
    b = key.shape[0]
    out = torch.empty((b, vocab_size), dtype=torch.float32, device=dev)
    rows = max(1, _CPU_SLICE_ELEMENTS // max(vocab_size, 1)) if dev.type == "cpu" else max(b, 1)
    z = torch.empty((min(rows, b), vocab_size), dtype=torch.int64, device=dev)
    tmp = torch.empty_like(z)
    for r in range(0, b, rows):
        n = min(rows, b - r)
        torch.add(key[r:r + n, None], counter, out=z[:n])
        _uniforms_(z[:n], tmp[:n], out[r:r + n])
    return out


def _random_uniform_at(seeds: torch.Tensor, steps: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``random_uniform(seeds, steps, V).gather(1, index)`` without the other columns: ``[B, K]``
    float32 for int64 ``index [B, K]`` (entries < V)."""
    z = _row_keys(seeds, steps)[:, None] + (index + 1) * _GOLDEN
    out = torch.empty(index.shape, dtype=torch.float32, device=index.device)
    _uniforms_(z, torch.empty_like(z), out)
    return out


# CPU: when every row has at most V / 16 nonzero probabilities (top-k, top-p, min-p truncation),
# only those candidates race (the others' score p / E is 0 and never wins).
_CANDIDATE_FRACTION = 16


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from ``probs`` by the exponential race ``argmax(p / E)``.

    On the CPU, when truncation left every row at most ``V / 16`` nonzero probabilities, only those
    race: the same ``p`` and the same ``E`` per token, so the same winner (ties go to the lowest
    token id either way), without hashing the whole vocabulary.

    Args:
        probs: ``[B, V]`` float32, rows summing to 1 (zeros are never drawn).
        seeds, steps: ``[B]`` int64, see :func:`random_uniform`.

    Returns:
        ``[B]`` int64 token ids.
    """
    v = probs.shape[-1]
    if probs.device.type == "cpu" and probs.shape[0] > 0:
        k = int((probs > 0).sum(dim=-1).max())
        if 0 < k <= v // _CANDIDATE_FRACTION:
            cand = probs.topk(k, dim=-1).indices.sort(dim=-1).values  # ascending ids: ties as below
            race = _random_uniform_at(seeds, steps, cand).log_().neg_()
            race = torch.div(probs.gather(1, cand), race, out=race)
            return cand.gather(1, race.argmax(dim=-1, keepdim=True)).squeeze(1)
    race = random_uniform(seeds, steps, v).log_().neg_()  # Exponential(1), > 0
    return torch.div(probs, race, out=race).argmax(dim=-1)


# ----------------------------------------------------------------------------- logit transforms


def _ids_to_counts(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, L]`` int64 ids with -1 padding -> ``[B, V]`` int32 occurrence counts."""
    counts = torch.zeros(ids.shape[0], vocab_size, dtype=torch.int32, device=ids.device)
    valid = ids >= 0
    # Padding scatters 0 onto token 0: harmless for a sum.
    counts.scatter_add_(1, ids.clamp(min=0), valid.to(torch.int32))
    return counts


def suppress_tokens(logits: torch.Tensor, suppress_ids: torch.Tensor) -> torch.Tensor:
    """Ban token ids: ``logits[b, suppress_ids[b, j]] = -inf`` for every ``j`` that is not -1.

    Args:
        logits: ``[B, V]`` float.
        suppress_ids: ``[B, S]`` int64, token ids to ban, padded with -1.

    Returns:
        A new ``[B, V]`` tensor (``logits`` is not modified).
    """
    if suppress_ids.shape[1] == 0:
        return logits
    valid = suppress_ids >= 0
    # scatter "min": banned ids receive -inf; padding sends +inf to token 0, which leaves it be.
    src = torch.where(valid, float("-inf"), float("inf")).to(logits.dtype)
    return logits.scatter_reduce(1, suppress_ids.clamp(min=0), src, reduce="amin", include_self=True)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Repetition penalty (CTRL, HF semantics), then OpenAI presence and frequency penalties.

    For every token ``v`` in ``prompt_ids[b]`` or ``output_ids[b]``::

        l[v] = l[v] / r  if l[v] > 0  else  l[v] * r         (r = repetition_penalty[b])

    then, with ``c[v]`` the number of occurrences of ``v`` in ``output_ids[b]`` only::

        l[v] = l[v] - frequency_penalty[b] * c[v] - presence_penalty[b] * (c[v] > 0)

    A row with ``r = 1`` and both penalties ``0`` is returned unchanged, bit for bit.

    Args:
        logits: ``[B, V]`` float32.
        prompt_ids: ``[B, Lp]`` int64, the prompt tokens, padded with -1 (``Lp`` may be 0).
        output_ids: ``[B, Lo]`` int64, the tokens generated so far, padded with -1.
        repetition_penalty, presence_penalty, frequency_penalty: ``[B]`` float32.

    Returns:
        A new ``[B, V]`` float32 tensor.
    """
    vocab_size = logits.shape[-1]
    out_counts = _ids_to_counts(output_ids, vocab_size)
    seen = out_counts > 0
    if prompt_ids.shape[1] > 0:
        seen = seen | (_ids_to_counts(prompt_ids, vocab_size) > 0)

    rep = repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)

    freq = frequency_penalty[:, None] * out_counts.to(logits.dtype)
    pres = presence_penalty[:, None] * (out_counts > 0).to(logits.dtype)
    return logits - (freq + pres)


def apply_penalties_sparse(
    logits: torch.Tensor,
    prompt_ids: torch.Tensor,
    output_ids: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """:func:`apply_penalties` touching only the history's tokens, **in place**: ``O(B L)``, not ``O(B V)``.

    The same formulas, on the same float32 values, as :func:`apply_penalties` (which builds
    ``[B, V]`` occurrence counts and rewrites every logit): the history's logits are gathered,
    penalised, and scattered back; a token's output count comes from a binary search in the
    sorted output ids. Each occurrence of a token writes the same value, so duplicates are
    harmless; the ``-1`` padding writes token 0's own (possibly penalised) value back to it.

    Args:
        logits: ``[B, V]`` float32, modified in place (pass a copy).
        prompt_ids, output_ids, repetition_penalty, presence_penalty, frequency_penalty: as
            :func:`apply_penalties`.

    Returns:
        ``logits``.
    """
    ids = torch.cat([prompt_ids, output_ids], dim=1)  # [B, L]: every token the repetition penalty sees
    if ids.shape[1] == 0:
        return logits
    ids = torch.cat([ids, torch.zeros_like(ids[:, :1])], dim=1)  # + token 0, whose value padding writes
    valid = ids >= 0
    safe = ids.clamp(min=0)
    if output_ids.shape[1] > 0:
        out_sorted = output_ids.sort(dim=1).values  # padding (-1) first, never matched
        counts = torch.searchsorted(out_sorted, safe, right=True) - torch.searchsorted(out_sorted, safe)
    else:
        counts = torch.zeros_like(safe)
    values = logits.gather(1, safe)
    rep = repetition_penalty[:, None]
    penalized = torch.where(values > 0, values / rep, values * rep)
    freq = frequency_penalty[:, None] * counts.to(logits.dtype)
    pres = presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    new = penalized - (freq + pres)
    # the appended token-0 column: penalised only if token 0 is in the history
    seen0 = (valid[:, :-1] & (ids[:, :-1] == 0)).any(dim=1)
    new[:, -1] = torch.where(seen0, new[:, -1], values[:, -1])
    new = torch.where(valid, new, new[:, -1:])  # padding writes token 0's final value
    return logits.scatter_(1, safe, new)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / temperature[:, None]``.

    Greedy rows (``temperature == 0``) are divided by a tiny positive number instead (their
    random draw is thrown away, see :func:`sample`); a positive temperature is likewise clamped
    to >= 1e-6 so that ``l / T`` stays finite.

    Args:
        logits: ``[B, V]`` float32.
        temperature: ``[B]`` float32, >= 0.

    Returns:
        A new ``[B, V]`` float32 tensor.
    """
    return logits / temperature.clamp(min=1e-6)[:, None]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p: keep token ``v`` iff ``p[v] >= min_p * max(p)``, with ``p = softmax(logits)``.

    ``min_p = 0`` keeps every token; ``min_p = 1`` keeps the top token and those tied with it.

    Args:
        logits: ``[B, V]`` float32 (already divided by the temperature).
        min_p: ``[B]`` float32 in [0, 1].

    Returns:
        A new ``[B, V]`` tensor with ``-inf`` at the removed tokens.
    """
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Top-k: keep the ``top_k[b]`` largest logits of row ``b`` (and any tied with the k-th).

    ``top_k >= V`` keeps every token (:meth:`SamplingTensors.from_params` encodes "disabled"
    as ``V``); values are clamped to ``[1, V]``.

    Args:
        logits: ``[B, V]`` float32.
        top_k: ``[B]`` int64.

    Returns:
        A new ``[B, V]`` tensor with ``-inf`` at the removed tokens.
    """
    # >>> EXERCISE top_k
    vocab_size = logits.shape[-1]
    k = top_k.clamp(min=1, max=vocab_size)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [B, 1], the k-th largest logit
    return logits.masked_fill(logits < kth, float("-inf"))
    # <<< EXERCISE top_k


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p (nucleus): keep the smallest most-likely set whose probability sum is >= top_p.

    With ``p = softmax(logits)`` sorted in decreasing order, the token at sorted position ``i``
    is kept iff the mass strictly before it, ``p[0] + ... + p[i-1]``, is ``< top_p``: that
    keeps tokens until the running sum first reaches ``top_p``, and always keeps the top token.
    Tokens tied with the last kept one are kept too (the set does not depend on how ``sort``
    breaks ties), and a row with ``top_p >= 1`` keeps every token.

    Args:
        logits: ``[B, V]`` float32 (after temperature, min-p and top-k).
        top_p: ``[B]`` float32 in (0, 1].

    Returns:
        A new ``[B, V]`` tensor with ``-inf`` at the removed tokens.
    """
    # >>> EXERCISE top_p
    probs = torch.softmax(logits, dim=-1)
    sorted_probs = probs.sort(dim=-1, descending=True).values
    # exclusive running sum (shifted cumsum, so it is non-decreasing like the exact one)
    mass_before = torch.nn.functional.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp(min=1)  # [B, 1]
    smallest_kept = sorted_probs.gather(1, num_kept - 1)  # [B, 1]
    remove = (probs < smallest_kept) & (top_p[:, None] < 1.0)
    return logits.masked_fill(remove, float("-inf"))
    # <<< EXERCISE top_p


def apply_top_k_partial(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """:func:`apply_top_k` without sorting the vocabulary: ``torch.topk`` to the batch's largest k.

    The k-th largest logit is the same value whether it comes from a full ``sort`` or from
    ``topk(max_k)`` (both list the largest values in decreasing order; ties only permute equal
    values), so the kept set is exactly :func:`apply_top_k`'s for every row with
    ``top_k <= max_k``. Rows with ``top_k > max_k`` are left unchanged: :meth:`SamplingTensors.from_params`
    sets ``max_k`` to the largest k among the rows that truncate, so those rows are disabled
    (``top_k = V``) or greedy (their token does not depend on truncation).

    Args:
        logits: ``[B, V]`` float32.
        top_k: ``[B]`` int64.
        max_k: host int, ``1 <= max_k``; ``max_k >= V`` falls back to :func:`apply_top_k`.

    Returns:
        A new ``[B, V]`` tensor with ``-inf`` at the removed tokens.
    """
    vocab_size = logits.shape[-1]
    if max_k >= vocab_size or max_k < 1:
        return apply_top_k(logits, top_k)
    largest = logits.topk(max_k, dim=-1).values  # [B, max_k], decreasing
    kth = largest.gather(1, (top_k.clamp(min=1, max=max_k) - 1)[:, None])  # [B, 1]
    remove = (logits < kth) & (top_k <= max_k)[:, None]
    return logits.masked_fill(remove, float("-inf"))


def apply_top_p_rows(logits: torch.Tensor, top_p: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """:func:`apply_top_p` on the rows that need it only (the others are returned unchanged).

    The vocabulary sort of top-p is the most expensive step of the sampler; rows with
    ``top_p = 1`` (and greedy rows) skip it. A row's result does not depend on the other rows,
    so this equals :func:`apply_top_p` on every row that needs it.

    Args:
        logits: ``[B, V]`` float32.
        top_p: ``[B]`` float32.
        rows: ``[R]`` int64 row indices (on ``logits.device``), or ``None`` for every row.

    Returns:
        A new ``[B, V]`` tensor.
    """
    if rows is None:
        return apply_top_p(logits, top_p)
    part = apply_top_p(logits.index_select(0, rows), top_p.index_select(0, rows))
    return logits.index_copy(0, rows, part)


# ----------------------------------------------------------------------------- batch tensors


def triton_usable(device: torch.device | str) -> bool:
    """Whether the sampler's Triton kernels can run on ``device``: Triton is installed, and the
    device is CUDA or the CPU interpreter is on (``TRITON_INTERPRET=1``). Triton is imported only
    when the kernels run, so this module works where Triton is not installed."""
    on_device = torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    return on_device and importlib.util.find_spec("triton") is not None


def _pad(rows: Sequence[Sequence[int]], vocab_size: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Ragged lists of ids -> (``[B, max_len]`` int64 padded with -1, ``[B]`` lengths), on the host.

    Raises:
        ValueError: an id is outside ``[0, vocab_size)`` (the message names ``name[row]``).
    """
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max(initial=0))
    padded = np.full((len(rows), width), -1, dtype=np.int64)
    if width:
        for i, r in enumerate(rows):
            if lengths[i]:
                padded[i, : lengths[i]] = r
        real = np.arange(width)[None, :] < lengths[:, None]
        bad = real & ((padded < 0) | (padded >= vocab_size))
        if bad.any():
            i = int(bad.any(axis=1).argmax())
            raise ValueError(f"{name}[{i}] has token ids outside [0, {vocab_size}): {padded[i][bad[i]][:5].tolist()}")
    return padded, lengths


def _to_device(padded: np.ndarray, lengths: np.ndarray, keep: np.ndarray | None, device) -> torch.Tensor:
    """The rows of ``padded`` where ``keep`` (all if ``None``), others emptied, trimmed, on ``device``."""
    if keep is not None:
        padded[~keep] = -1
        lengths = np.where(keep, lengths, 0)
    width = int(lengths.max(initial=0))
    return _to_device_async(np.ascontiguousarray(padded[:, :width]), device)


def _to_device_async(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A fresh host array as a tensor on ``device``, without blocking the host on a GPU.

    A copy from pageable memory makes the host wait for the GPU's queued work; from pinned
    memory (PyTorch's caching host allocator, which keeps the block until the copy is done) it
    is queued behind that work and the host moves on.
    """
    host = torch.from_numpy(array)
    if not array.size:  # nothing to copy (a zero-width history)
        return torch.empty(array.shape, dtype=host.dtype, device=device)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplingTensors:
    """The sampling parameters of a batch, one row per sequence, as device tensors.

    Build it with :meth:`from_params`; building it by hand is fine too (the shapes and dtypes
    are checked, the values are not). The host flags let :func:`sample` skip work that no row
    needs; their defaults (``do_* = True``, ``any_greedy = True``, ``max_top_k = 0``,
    ``top_p_rows = None``) are always correct, since a row whose parameter disables a transform
    passes through it unchanged.

    Attributes:
        temperature: ``[B]`` float32, >= 0 (0 = greedy).
        top_k: ``[B]`` int64, >= 1; the vocabulary size means "disabled".
        top_p: ``[B]`` float32 in (0, 1].
        min_p: ``[B]`` float32 in [0, 1].
        repetition_penalty: ``[B]`` float32, > 0.
        presence_penalty: ``[B]`` float32.
        frequency_penalty: ``[B]`` float32.
        seeds: ``[B]`` int64, each request's seed.
        steps: ``[B]`` int64, how many tokens the request has sampled so far (its position in
            its random stream).
        prompt_ids: ``[B, Lp]`` int64, prompt tokens for the repetition penalty, -1 padded.
        output_ids: ``[B, Lo]`` int64, generated tokens for all penalties, -1 padded.
        suppress_ids: ``[B, S]`` int64, ids banned this step (min_tokens), -1 padded.
        max_num_logprobs: host int, the largest ``logprobs`` (top-N) asked for in the batch.
        all_greedy: host bool, every row has ``temperature == 0``.
        do_penalties, do_min_p, do_top_k, do_top_p: host bools, some row needs the transform.
        any_greedy: host bool, some row has ``temperature == 0``.
        max_top_k: host int, the largest ``top_k`` among the rows that truncate with it (top-k
            then needs ``torch.topk`` to that k, not a sort); 0 means "unknown: sort".
        top_p_rows: ``[R]`` int64, the rows that need top-p, or ``None`` for "every row".
        top_p_in_top_k: host bool, every row that needs top-p also has a top-k (its nucleus is
            among the ``max_top_k`` largest logits: no sort of the vocabulary).
        use_triton: host bool, :func:`sample` runs the Triton kernels (CUDA tensors, or CPU
            tensors under ``TRITON_INTERPRET=1``) instead of the plain-PyTorch path.
        token_bitmask: ``[R, ceil(V / 32)]`` int32 or ``None``: the allowed tokens of the ``R``
            constrained rows (structured output, phase 13; bit ``v % 32`` of word ``v // 32``).
        token_bitmask_rows: ``[R]`` int64, the row each mask applies to (``None`` with no mask).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor
    suppress_ids: torch.Tensor
    max_num_logprobs: int = 0
    all_greedy: bool = False
    do_penalties: bool = True
    do_min_p: bool = True
    do_top_k: bool = True
    do_top_p: bool = True
    any_greedy: bool = True
    max_top_k: int = 0
    top_p_rows: torch.Tensor | None = None
    top_p_in_top_k: bool = False
    use_triton: bool = False
    token_bitmask: torch.Tensor | None = None
    token_bitmask_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b = self.temperature.shape[0] if self.temperature.dim() == 1 else -1
        one_d = {
            "temperature": torch.float32,
            "top_k": torch.int64,
            "top_p": torch.float32,
            "min_p": torch.float32,
            "repetition_penalty": torch.float32,
            "presence_penalty": torch.float32,
            "frequency_penalty": torch.float32,
            "seeds": torch.int64,
            "steps": torch.int64,
        }
        for name, dtype in one_d.items():
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != b or t.dtype != dtype:
                raise ValueError(
                    f"SamplingTensors.{name} must be a [B] {dtype} tensor with B = "
                    f"{b}, got shape {tuple(t.shape)} {t.dtype}"
                )
        for name in ("prompt_ids", "output_ids", "suppress_ids"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != b or t.dtype != torch.int64:
                raise ValueError(
                    f"SamplingTensors.{name} must be a [B, L] int64 tensor with B = {b}, "
                    f"got shape {tuple(t.shape)} {t.dtype}"
                )
        if not isinstance(self.max_num_logprobs, int) or self.max_num_logprobs < 0:
            raise ValueError(f"max_num_logprobs must be an int >= 0, got {self.max_num_logprobs!r}")
        if not isinstance(self.max_top_k, int) or self.max_top_k < 0:
            raise ValueError(f"max_top_k must be an int >= 0, got {self.max_top_k!r}")
        if self.top_p_rows is not None and (self.top_p_rows.dim() != 1 or self.top_p_rows.dtype != torch.int64):
            raise ValueError(
                f"SamplingTensors.top_p_rows must be None or a [R] int64 tensor, got "
                f"{tuple(self.top_p_rows.shape)} {self.top_p_rows.dtype}"
            )

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @property
    def greedy_fast_path(self) -> bool:
        """Every row is greedy and nothing edits the logits first: :func:`sample` is an argmax."""
        return self.all_greedy and not self.do_penalties and self.suppress_ids.shape[1] == 0

    @classmethod
    def from_params(
        cls,
        params_list: Sequence[SamplingParams],
        seeds: Sequence[int | None] | None,
        steps: Sequence[int] | None,
        prompt_ids_list: Sequence[Sequence[int]] | None,
        output_ids_list: Sequence[Sequence[int]] | None,
        suppress_list: Sequence[Sequence[int]] | None,
        vocab_size: int,
        device: torch.device | str = "cpu",
        use_triton: bool | None = None,
    ) -> SamplingTensors:
        """Build the batch on the host (NumPy), then move it to ``device`` in one copy.

        The nine ``[B]`` parameters travel in one packed buffer (one host-to-device copy; the
        tensors are views of it), and the token histories in one copy each, only when some row
        needs them. Rows that share one :class:`SamplingParams` object (an ``LLM.generate``
        call's prompts) are read once.

        Args:
            params_list: B :class:`SamplingParams`, one per row (sequence).
            seeds: B seeds, or ``None``. Row ``i`` uses ``seeds[i]``, else
                ``params_list[i].seed``, else a fresh random seed (not reproducible). The
                engine should fix each sequence's seed once and pass it at every step (and
                give the ``n`` sequences of one request different seeds).
            steps: B stream positions, or ``None`` for ``len(output_ids_list[i])`` (0 without
                outputs).
            prompt_ids_list: B prompt token lists (used by the repetition penalty), or ``None``.
            output_ids_list: B generated-token lists (used by every penalty), or ``None``.
            suppress_list: B lists of ids to ban this step, or ``None``. The engine passes
                EOS + ``stop_token_ids`` for rows that have not reached ``min_tokens``.
            vocab_size: V, the width of the logits.
            device: where the tensors live.
            use_triton: run :func:`sample`'s Triton kernels; ``None`` picks them on a CUDA
                device (``True`` on a CPU device needs ``TRITON_INTERPRET=1``).

        Raises:
            ValueError: a list's length is not B, a token id is outside ``[0, V)``, or
                ``use_triton=True`` where Triton cannot run.
        """
        batch = len(params_list)
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        for name, lst in (
            ("seeds", seeds),
            ("steps", steps),
            ("prompt_ids_list", prompt_ids_list),
            ("output_ids_list", output_ids_list),
            ("suppress_list", suppress_list),
        ):
            if lst is not None and len(lst) != batch:
                raise ValueError(f"{name} has {len(lst)} entries, expected one per row ({batch})")
        if use_triton is None:
            use_triton = torch.device(device).type == "cuda" and triton_usable(device)
        elif use_triton and not triton_usable(device):
            raise ValueError(
                f"use_triton=True on {device} needs Triton and a CUDA device, or TRITON_INTERPRET=1 set before "
                "triton is imported"
            )

        # One row of values per distinct params object (the prompts of one LLM.generate call
        # share one), then a gather: the per-row Python work is a few C-level maps.
        keys = list(map(id, params_list))
        distinct = dict(zip(keys, params_list))
        position = {key: i for i, key in enumerate(distinct)}
        uniq = list(distinct.values())
        uniq_table = np.array(
            [
                (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
                 p.top_k if 0 < p.top_k < vocab_size else vocab_size, p.logprobs or 0)
                for p in uniq
            ],
            dtype=np.float64,
        ).reshape(len(uniq), 8)
        temp_u, top_p_u, min_p_u, rep_u, pres_u, freq_u, top_k_u, logprobs_u = uniq_table.T
        # what each distinct params object needs (greedy rows ignore temperature and truncation)
        sampled_u = temp_u != 0.0
        top_k_on = sampled_u & (top_k_u < vocab_size)
        top_p_on = sampled_u & (top_p_u < 1.0)
        rep = rep_u != 1.0
        pen = rep | (pres_u != 0.0) | (freq_u != 0.0)
        row_of = np.fromiter(map(position.__getitem__, keys), dtype=np.int64, count=batch)

        # Histories are only needed by rows with a penalty; others get an empty (all -1) row,
        # which is equivalent and keeps the padded width small. Every given list is validated.
        # (a list not given is B empty rows: nothing to pad)
        none = np.zeros((batch, 0), dtype=np.int64), np.zeros(batch, dtype=np.int64)
        prompt_np, prompt_len = none if prompt_ids_list is None else _pad(prompt_ids_list, vocab_size,
                                                                          "prompt_ids_list")
        output_np, output_len = none if output_ids_list is None else _pad(output_ids_list, vocab_size,
                                                                          "output_ids_list")
        suppress_np, suppress_len = none if suppress_list is None else _pad(suppress_list, vocab_size,
                                                                            "suppress_list")
        do_penalties = bool(pen.any())
        if do_penalties:
            keep_prompt = rep[row_of]
            keep_output = pen[row_of]
            prompt_ids = _to_device(prompt_np, prompt_len, keep_prompt, device)
            output_ids = _to_device(output_np, output_len, keep_output, device)
        else:
            prompt_ids = output_ids = torch.empty(batch, 0, dtype=torch.int64, device=device)

        try:  # the engine passes one int64 seed per row: one C-level conversion
            row_seeds = np.asarray(seeds, dtype=np.int64) if seeds is not None else None
        except (TypeError, OverflowError, ValueError):
            row_seeds = None
        if row_seeds is None or row_seeds.shape != (batch,):
            row_seeds = np.empty(batch, dtype=np.int64)
            for i, p in enumerate(params_list):
                s = seeds[i] if seeds is not None else None
                if s is None:
                    s = p.seed if p.seed is not None else random.getrandbits(64)
                row_seeds[i] = _signed64(int(s))
        if steps is not None:
            row_steps = np.asarray(steps, dtype=np.int64)
        else:
            row_steps = output_len

        # the nine [B] parameters packed into one buffer: 6 float32 rows, then 3 int64 rows
        nf = 6 * batch * 4
        buf = np.empty(nf + 3 * batch * 8, dtype=np.uint8)
        floats = buf[:nf].view(np.float32).reshape(6, batch)
        ints = buf[nf:].view(np.int64).reshape(3, batch)
        if batch:
            table = uniq_table[row_of]  # [B, 7]
            floats[:] = table[:, :6].T
            ints[0] = table[:, 6]
        ints[1] = row_seeds
        ints[2] = row_steps
        if batch:
            packed = _to_device_async(buf, device)  # the one host-to-device copy
            f32 = packed[:nf].view(torch.float32).view(6, batch)
            i64 = packed[nf:].view(torch.int64).view(3, batch)
        else:
            f32 = torch.empty(6, 0, dtype=torch.float32, device=device)
            i64 = torch.empty(3, 0, dtype=torch.int64, device=device)

        top_p_rows = None
        if top_p_on.any():
            need = np.flatnonzero(top_p_on[row_of])
            if len(need) < batch:
                top_p_rows = _to_device_async(need.astype(np.int64), device)

        return cls(
            temperature=f32[0],
            top_p=f32[1],
            min_p=f32[2],
            repetition_penalty=f32[3],
            presence_penalty=f32[4],
            frequency_penalty=f32[5],
            top_k=i64[0],
            seeds=i64[1],
            steps=i64[2],
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            suppress_ids=_to_device(suppress_np, suppress_len, None, device),
            max_num_logprobs=int(logprobs_u.max(initial=0)),
            all_greedy=not sampled_u.any(),
            do_penalties=do_penalties,
            do_min_p=bool((sampled_u & (min_p_u > 0.0)).any()),
            do_top_k=bool(top_k_on.any()),
            do_top_p=bool(top_p_on.any()),
            any_greedy=not sampled_u.all(),
            max_top_k=int(top_k_u[top_k_on].max(initial=0)),
            top_p_rows=top_p_rows,
            top_p_in_top_k=bool((top_k_on | ~top_p_on).all()),
            use_triton=bool(use_triton),
        )


# ----------------------------------------------------------------------------- sample


@dataclass
class SamplerOutput:
    """What :func:`sample` returns, all on the logits' device.

    Attributes:
        next_tokens: ``[B]`` int64, the chosen token of each row.
        logprobs: ``[B]`` float32, the raw logprob (``log_softmax`` of the model's logits) of
            the chosen token.
        top_logprob_ids: ``[B, K]`` int64, the K most likely tokens under the raw logprobs,
            most likely first (``K = max_num_logprobs``; a row that asked for fewer uses a
            prefix).
        top_logprobs: ``[B, K]`` float32, their raw logprobs.
    """

    next_tokens: torch.Tensor
    logprobs: torch.Tensor
    top_logprob_ids: torch.Tensor
    top_logprobs: torch.Tensor


def _check_logits(logits: torch.Tensor, t: SamplingTensors) -> None:
    if logits.dim() != 2 or logits.shape[0] != t.batch_size or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a floating [B, V] tensor with B = {t.batch_size}, "
            f"got shape {tuple(logits.shape)} {logits.dtype}"
        )


def _output(raw: torch.Tensor, next_tokens: torch.Tensor, log_z: torch.Tensor, t: SamplingTensors,
            chosen_logprobs: torch.Tensor | None = None) -> SamplerOutput:
    """The chosen tokens' raw logprobs (``chosen_logprobs``, or computed here) and the top-K raw logprobs
    (``log_z``: ``[B]`` log-sum-exp)."""
    if chosen_logprobs is None:
        chosen_logprobs = raw.gather(1, next_tokens[:, None]).squeeze(1).float() - log_z
    k = t.max_num_logprobs
    if k > 0:
        top = raw.topk(min(k, raw.shape[-1]), dim=-1)  # on the model's dtype: upcasting keeps the order
        top_ids, top_lps = top.indices, top.values.float() - log_z[:, None]
    else:
        top_ids = torch.empty(t.batch_size, 0, dtype=torch.int64, device=raw.device)
        top_lps = torch.empty(t.batch_size, 0, dtype=torch.float32, device=raw.device)
    return SamplerOutput(
        next_tokens=next_tokens, logprobs=chosen_logprobs, top_logprob_ids=top_ids, top_logprobs=top_lps
    )


def _mask_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Step 0, structured output (phase 13): the constrained rows' disallowed tokens get ``-inf``
    before anything else, so the logprobs returned for those rows are of the *masked* distribution
    (the model's, renormalised over the allowed tokens). Unconstrained rows are untouched."""
    if t.token_bitmask is None:
        return logits
    if t.use_triton:  # one kernel over the packed words
        from infer.sampling.triton_sampler import apply_token_bitmask
    else:
        from infer.sampling.structured import apply_token_bitmask

    return apply_token_bitmask(logits, t.token_bitmask, t.token_bitmask_rows)


def sample_reference(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """The whole pipeline of the module docstring in plain PyTorch, one ``[B, V]`` pass per step.

    The reference that :func:`sample`'s fast paths are tested against (and the baseline of
    ``benchmarks/sampler.py``). It reads only the ``do_*``, ``all_greedy`` and
    ``max_num_logprobs`` host flags; every transform sorts or materialises the full vocabulary.

    Args, Returns, Raises: as :func:`sample`.
    """
    _check_logits(logits, t)
    logits = _mask_logits(logits, t)
    # 1. upcast (out of place from here on: the caller's tensor is never modified)
    logits = logits.float()

    # 2. raw logprobs, kept as [B] normaliser; gathered at the end
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, 1]
    raw_logits = logits

    # 3-5. suppression and penalties (they apply to greedy rows too)
    logits = suppress_tokens(logits, t.suppress_ids)
    if t.do_penalties:
        logits = apply_penalties(
            logits, t.prompt_ids, t.output_ids, t.repetition_penalty, t.presence_penalty, t.frequency_penalty
        )

    # 6. greedy rows
    greedy_tokens = logits.argmax(dim=-1)
    if t.all_greedy:
        next_tokens = greedy_tokens
    else:
        # 7-10. temperature and truncation
        logits = apply_temperature(logits, t.temperature)
        if t.do_min_p:
            logits = apply_min_p(logits, t.min_p)
        if t.do_top_k:
            logits = apply_top_k(logits, t.top_k)
        if t.do_top_p:
            logits = apply_top_p(logits, t.top_p)
        # 11. the exponential race
        probs = torch.softmax(logits, dim=-1)
        random_tokens = sample_from_probs(probs, t.seeds, t.steps)
        next_tokens = torch.where(t.temperature == 0, greedy_tokens, random_tokens)
    return _output(raw_logits, next_tokens, log_z[:, 0], t)


def _edit_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Steps 3-5 (suppression, penalties) on a float32 copy; ``logits`` itself if none applies.

    Both only touch the listed token ids (``O(B L)`` gathers and scatters, no ``[B, V]`` masks).
    """
    if t.suppress_ids.shape[1] == 0 and not t.do_penalties:
        return logits
    x = logits.float()
    if x is logits:
        x = x.clone()
    if t.suppress_ids.shape[1] > 0:
        # banned ids receive -inf; padding sends +inf to token 0, which leaves it be (as suppress_tokens)
        src = torch.where(t.suppress_ids >= 0, float("-inf"), float("inf"))
        x.scatter_reduce_(1, t.suppress_ids.clamp(min=0), src, reduce="amin", include_self=True)
    if t.do_penalties:
        apply_penalties_sparse(
            x, t.prompt_ids, t.output_ids, t.repetition_penalty, t.presence_penalty, t.frequency_penalty
        )
    return x


def _truncate(x: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Steps 7-10 (temperature, min-p, top-k, top-p) in PyTorch, skipping what no row needs."""
    x = apply_temperature(x.float(), t.temperature)
    if t.do_min_p:
        x = apply_min_p(x, t.min_p)
    if t.do_top_k:
        x = apply_top_k_partial(x, t.top_k, t.max_top_k)
    if t.do_top_p:
        x = apply_top_p_rows(x, t.top_p, t.top_p_rows)
    return x


def _merge_greedy(t: SamplingTensors, greedy: torch.Tensor, random_tokens: torch.Tensor) -> torch.Tensor:
    return torch.where(t.temperature == 0, greedy, random_tokens) if t.any_greedy else random_tokens


def _sample_torch(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """The plain-PyTorch path: the reference pipeline minus the work no row needs."""
    raw = logits.float()
    log_z = torch.logsumexp(raw, dim=-1)
    x = _edit_logits(raw, t)
    if t.all_greedy:  # the greedy fast path: an argmax (and the log-sum-exp for the logprob)
        return _output(raw, x.argmax(dim=-1), log_z, t)
    probs = torch.softmax(_truncate(x, t), dim=-1)
    random_tokens = sample_from_probs(probs, t.seeds, t.steps)
    greedy = x.argmax(dim=-1) if t.any_greedy else random_tokens
    return _output(raw, _merge_greedy(t, greedy, random_tokens), log_z, t)


def _top_k_floor(
    x: torch.Tensor, t: SamplingTensors, temperature: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k as a floor: ``([B] float32 k-th largest of x / T, -inf where off; [B, K] largest x)``.

    ``torch.topk`` to the batch's largest k on ``x`` as it is (bf16 values upcast exactly), then
    one division: the k-th largest of ``x / T`` is the k-th largest of ``x``, divided by ``T``
    (rounding is monotone), the very value :func:`apply_top_k` finds after the temperature.
    """
    vocab_size = x.shape[-1]
    k_cap = t.max_top_k if 0 < t.max_top_k < vocab_size else vocab_size
    largest = x.topk(k_cap, dim=-1).values
    kth = largest.gather(1, (t.top_k.clamp(min=1, max=k_cap) - 1)[:, None]).squeeze(1).float()
    return torch.where(t.top_k <= k_cap, kth / temperature, float("-inf")), largest


def _top_p_on_candidates(
    largest: torch.Tensor,
    t: SamplingTensors,
    temperature: torch.Tensor,
    stats: RowStats,
    min_p: torch.Tensor | None,
    floor: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p on the top-k candidates only: ``(new floor [B], normaliser after the cut [B])``.

    When every row that asks for top-p also has a top-k, its nucleus lies among the ``[B, K]``
    largest logits, already sorted by ``torch.topk``: :func:`apply_top_p`'s rule runs on them,
    not on a sorted vocabulary. Tokens tied with the k-th value beyond the K candidates matter
    only when the cut keeps every top-k token, and then nothing changes. The cut is returned as
    a floor on ``x / T`` (the smallest kept candidate's value), compared exactly by the kernels.
    """
    y = largest.float() / temperature[:, None]  # [B, K], decreasing; the kernels' x / T bit for bit
    e = torch.exp(y - stats.m[:, None])
    keep = y >= floor[:, None]  # top-k (ties with the k-th kept)
    if min_p is not None:
        keep &= e / stats.s[:, None] >= (min_p * (1.0 / stats.s))[:, None]
    probs = torch.where(keep, e / stats.s_kept[:, None], 0.0)  # the distribution after min-p and top-k
    mass_before = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))
    num_kept = (mass_before < t.top_p[:, None]).sum(dim=-1, keepdim=True).clamp(min=1)
    smallest_kept = probs.gather(1, num_kept - 1)  # [B, 1]
    least_likely = torch.where(keep, probs, float("inf")).amin(dim=-1, keepdim=True)
    cut = ((t.top_p[:, None] < 1.0) & (smallest_kept > least_likely)).squeeze(1)  # the cut removes a token
    final = keep & (probs >= smallest_kept)
    new_floor = torch.where(cut, torch.where(final, y, float("inf")).amin(dim=-1), floor)
    # the renormalised distribution's sum (it scales every score alike: it changes the choice only
    # through rounding, but keeps the race's p = e / s the reference's value)
    s_final = torch.where(cut, torch.where(final, e, 0.0).sum(dim=-1), stats.s_kept)
    return new_floor, s_final


def _sample_triton(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """The Triton path: row statistics + the fused exponential race (:mod:`infer.sampling.triton_sampler`)."""
    # imports triton
    from infer.sampling.triton_sampler import argmax_logprob, argmax_lse, exponential_race, row_stats
    raw = logits if logits.stride(-1) == 1 else logits.contiguous()
    x = _edit_logits(raw, t)
    if t.all_greedy:  # the greedy fast path: argmax + log-sum-exp in one read of the row
        if x is raw:  # and the argmax's logprob from the same kernels
            greedy, log_z, chosen = argmax_logprob(raw)
            return _output(raw, greedy, log_z, t, chosen)
        greedy = argmax_lse(x)[0]
        return _output(raw, greedy, argmax_lse(raw)[1], t)
    if t.do_top_p and not t.top_p_in_top_k:
        # top-p without top-k needs sorted probabilities: truncation in PyTorch (sorting only the
        # rows that need it), then the race on the masked, temperature-scaled logits
        stats = row_stats(x)
        y = _truncate(x, t)
        random_tokens = exponential_race(y, row_stats(y), t.seeds, t.steps)
    else:
        # temperature, min-p, top-k (and top-p among the top-k) fused: nothing of size [B, V] is written
        temperature = t.temperature.clamp(min=1e-6)
        min_p = t.min_p if t.do_min_p else None
        floor = largest = None
        if t.do_top_k:
            floor, largest = _top_k_floor(x, t, temperature)
        stats = row_stats(x, temperature, min_p, floor)
        race_stats = stats
        if t.do_top_p:
            floor, s_final = _top_p_on_candidates(largest, t, temperature, stats, min_p, floor)
            race_stats = stats._replace(s_kept=s_final)
        random_tokens = exponential_race(x, race_stats, t.seeds, t.steps, temperature, min_p, floor)
    log_z = stats.lse if x is raw else argmax_lse(raw)[1]
    return _output(raw, _merge_greedy(t, stats.argmax, random_tokens), log_z, t)


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """Pick the next token of every row (the pipeline of the module docstring).

    No host synchronisation happens here: every decision that depends on values is a tensor
    operation, and the only host-side branches read :class:`SamplingTensors`' host flags.
    Two implementations, chosen by ``t.use_triton`` (decided once, in
    :meth:`SamplingTensors.from_params`): the Triton kernels of
    :mod:`infer.sampling.triton_sampler`, or plain PyTorch. Both skip the steps no row needs;
    an all-greedy batch without penalties or suppression is one argmax (and a log-sum-exp for
    the logprob). Both choose the same tokens as :func:`sample_reference` for the same seeds
    (the Triton path up to float32 near-ties of the race, see that module).

    Args:
        logits: ``[B, V]``, any floating dtype, on the same device as ``t``'s tensors.
        t: the batch's parameters (``B`` rows).

    Returns:
        :class:`SamplerOutput`.

    Raises:
        ValueError: ``logits`` is not ``[B, V]`` floating point with ``B == t.batch_size``.
        RuntimeError: ``t.use_triton`` with CPU tensors and no ``TRITON_INTERPRET=1``.
    """
    _check_logits(logits, t)
    logits = _mask_logits(logits, t)
    if t.use_triton:
        return _sample_triton(logits, t)
    return _sample_torch(logits, t)
