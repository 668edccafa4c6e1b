"""Logits processors: the transforms that reshape a batch's ``[B, V]`` logits before a token is drawn.

Each function takes ``[B, V]`` float32 logits and per-row ``[B]`` parameters and returns logits in
which the tokens a row removes hold ``-inf``, in one batched tensor operation for every row (no
Python loop over rows). A row whose parameter disables a transform (``top_k = V``, ``top_p = 1``,
``min_p = 0``, penalties ``1/0/0``) passes through it bit for bit unchanged, which is what makes a
row's result independent of the other rows of the batch. Hugging Face transformers calls these
``LogitsProcessor`` objects (the truncations were once its "logits warpers"), and vLLM uses the same
name; here they are plain functions, which :mod:`infer.sampling.sampler` applies in this order:

* :func:`suppress_tokens`: ban ids (EOS and the stop tokens while a request is under its
  ``min_tokens``, vLLM's ``MinTokensLogitsProcessor``).
* :func:`apply_penalties`: the repetition penalty (Keskar et al. 2019, "CTRL: A Conditional
  Transformer Language Model for Controllable Generation", arXiv:1909.05858, with Hugging Face's
  ``RepetitionPenaltyLogitsProcessor`` semantics), then the presence and frequency penalties
  (OpenAI API reference). :func:`apply_penalties_sparse`: the same values, touching only the
  history's tokens.
* :func:`apply_temperature`: ``l / T`` (the Boltzmann distribution ``p ∝ exp(l / T)``).
* :func:`apply_min_p` (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling for Creative and
  Coherent LLM Outputs", arXiv:2407.01082).
* :func:`apply_top_k` (Fan, Lewis and Dauphin 2018, "Hierarchical Neural Story Generation",
  arXiv:1805.04833) and :func:`apply_top_k_partial`, the same kept set from ``torch.topk``.
* :func:`apply_top_p`, nucleus sampling (Holtzman et al. 2019, "The Curious Case of Neural Text
  Degeneration", arXiv:1904.09751), and :func:`apply_top_p_rows`, on the rows that ask for it.

The structured-output mask (phase 13) is applied before all of these, by
:mod:`infer.sampling.structured` or its kernel in :mod:`infer.sampling.triton_sampler`. The
exponential race that draws from the processed logits is in :mod:`infer.sampling.rng`; the
``[B]`` parameter tensors come from :mod:`infer.sampling.metadata`.
"""

from __future__ import annotations

import torch

__all__ = [
    "apply_min_p",
    "apply_penalties",
    "apply_penalties_sparse",
    "apply_temperature",
    "apply_top_k",
    "apply_top_k_partial",
    "apply_top_p",
    "apply_top_p_rows",
    "suppress_tokens",
]


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
    random draw is thrown away, see :func:`~infer.sampling.sampler.sample`); a positive
    temperature is likewise clamped to >= 1e-6 so that ``l / T`` stays finite.

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

    ``top_k >= V`` keeps every token (:meth:`~infer.sampling.metadata.SamplingTensors.from_params`
    encodes "disabled" as ``V``); values are clamped to ``[1, V]``.

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
    ``top_k <= max_k``. Rows with ``top_k > max_k`` are left unchanged:
    :meth:`~infer.sampling.metadata.SamplingTensors.from_params` sets ``max_k`` to the largest k among
    the rows that truncate, so those rows are disabled (``top_k = V``) or greedy (their token does not
    depend on truncation).

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
