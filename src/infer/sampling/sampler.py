"""The batched sampler: logits of B sequences in, B next tokens (and their logprobs) out.

Every row of the batch is a sequence with its own :class:`~infer.sampling.SamplingParams`;
the parameters travel as ``[B]`` device tensors (:class:`~infer.sampling.metadata.SamplingTensors`),
so one call of :func:`sample` handles 1 or 256 sequences with different settings in the same few
tensor operations: no per-request Python loop and no host synchronisation (no ``.item()``, no
``.tolist()``, no data-dependent shapes) inside :func:`sample`. What must be decided on the
host (which transforms any row needs at all, how many top logprobs to return) is decided
once, when :meth:`SamplingTensors.from_params` builds the batch.

This module is the pipeline itself, :func:`sample` and :func:`sample_reference`; its steps live in
sibling modules: the logits processors (suppression, penalties, temperature, min-p, top-k, top-p)
in :mod:`infer.sampling.logits_processors`, the random streams and the exponential race in
:mod:`infer.sampling.rng`, the batch's tensors in :mod:`infer.sampling.metadata`, the GPU kernels
in :mod:`infer.sampling.triton_sampler`, the structured-output mask in :mod:`infer.sampling.structured`.

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

A row with no token to sample
-----------------------------
A model that overflows (NaN or inf logits), or suppression and a grammar that together leave no
token, give a row that no rule can sample from; argmax would silently answer token 0. Such a row's
``logprobs`` entry is NaN instead (the raw logprob of its token is NaN whenever the raw logits are
not finite; rows whose edited or truncated logits hold no finite value are set to NaN), so the
engine ends that request with ``finish_reason="error"`` and keeps the token out of its output
(:class:`~infer.engine.output_processor.OutputProcessor`). The token itself stays a valid id: with
async scheduling it is on its way into the next step's input before the host sees it. Sampling
parameters cannot cause it: their ranges keep finite logits finite (:class:`SamplingParams`).

Randomness
----------
There is no shared ``torch.Generator``: the uniform ``u[b, v]`` of the race is a hash of
``(seeds[b], steps[b], v)``, a counter-based random number generator (:mod:`infer.sampling.rng`),
so a request with a given seed gets the same tokens whether it runs alone, in a batch of 256, or
after a preemption, on any device.

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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.sampling.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_penalties_sparse,
    apply_temperature,
    apply_top_k,
    apply_top_k_partial,
    apply_top_p,
    apply_top_p_rows,
    suppress_tokens,
)
from infer.sampling.metadata import SamplingTensors
from infer.sampling.rng import sample_from_probs

if TYPE_CHECKING:
    from infer.sampling.triton_sampler import RowStats

__all__ = ["SamplerOutput", "sample", "sample_reference"]


@dataclass
class SamplerOutput:
    """What :func:`sample` returns, all on the logits' device.

    Attributes:
        next_tokens: ``[B]`` int64, the chosen token of each row.
        logprobs: ``[B]`` float32, the raw logprob (``log_softmax`` of the model's logits) of
            the chosen token; NaN for a row that had no token to sample (see the module docstring).
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


def _without_samplable_token(out: SamplerOutput, *maxima: torch.Tensor) -> SamplerOutput:
    """Set ``out.logprobs`` to NaN in the rows where one of ``maxima`` (``[B]``: a row's largest edited or
    truncated logit) is not finite: nothing in that row could be sampled."""
    ok = torch.isfinite(maxima[0])
    for m in maxima[1:]:
        ok &= torch.isfinite(m)
    out.logprobs = torch.where(ok, out.logprobs, float("nan"))
    return out


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
    edited_max = logits.amax(dim=-1)
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
    return _without_samplable_token(_output(raw_logits, next_tokens, log_z[:, 0], t), edited_max)


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
        out = _output(raw, x.argmax(dim=-1), log_z, t)
        return out if x is raw else _without_samplable_token(out, x.amax(dim=-1))
    probs = torch.softmax(_truncate(x, t), dim=-1)
    random_tokens = sample_from_probs(probs, t.seeds, t.steps)
    greedy = x.argmax(dim=-1) if t.any_greedy else random_tokens
    return _without_samplable_token(_output(raw, _merge_greedy(t, greedy, random_tokens), log_z, t),
                                    x.amax(dim=-1))


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
        if x is raw:  # and the argmax's logprob from the same kernels (NaN for a row with none)
            greedy, log_z, chosen = argmax_logprob(raw)
            return _output(raw, greedy, log_z, t, chosen)
        greedy, lse_x = argmax_lse(x)
        return _without_samplable_token(_output(raw, greedy, argmax_lse(raw)[1], t), lse_x)
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
    return _without_samplable_token(_output(raw, _merge_greedy(t, stats.argmax, random_tokens), log_z, t),
                                    stats.m)


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
