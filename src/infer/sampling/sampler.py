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
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.sampling.params import SamplingParams

__all__ = [
    "SamplerOutput",
    "SamplingTensors",
    "apply_min_p",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "random_uniform",
    "sample",
    "sample_from_probs",
    "suppress_tokens",
]

# ----------------------------------------------------------------------------- counter-based RNG


def _signed64(x: int) -> int:
    """A Python int reduced modulo 2**64 into int64's range (two's complement)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _signed64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: splitmix64's increment
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64: torch's ``>>`` is arithmetic, so mask the sign copies."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of int64 with good avalanche (multiplies wrap)."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def random_uniform(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Counter-based uniforms: ``u[b, v] = hash(seeds[b], steps[b], v)`` in the open ``(0, 1)``.

    The same ``(seed, step, v)`` always gives the same value, on any device and in any batch.
    Each row is the splitmix64 stream of the key ``mix(mix(seed + golden) ^ step)``; the top 24
    bits of each output become a float32 ``(k + 0.5) / 2**24``, so ``u`` is never 0 or 1 and
    ``-log(u)`` is finite and > 0.

    Args:
        seeds: ``[B]`` int64, the request's seed.
        steps: ``[B]`` int64, the request's position in its random stream.
        vocab_size: V, the number of uniforms per row.

    Returns:
        ``[B, V]`` float32 on ``seeds.device``.
    """
    if seeds.dtype != torch.int64 or steps.dtype != torch.int64:
        raise TypeError(f"seeds and steps must be int64, got {seeds.dtype} and {steps.dtype}")
    key = _mix64(_mix64(seeds + _GOLDEN) ^ steps)  # [B]
    counter = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64) * _GOLDEN
    z = _mix64(key[:, None] + counter[None, :])  # [B, V]
    return (_shr(z, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample_from_probs(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from ``probs`` by the exponential race ``argmax(p / E)``.

    Args:
        probs: ``[B, V]`` float32, rows summing to 1 (zeros are never drawn).
        seeds, steps: ``[B]`` int64, see :func:`random_uniform`.

    Returns:
        ``[B]`` int64 token ids.
    """
    exp = -torch.log(random_uniform(seeds, steps, probs.shape[-1]))  # Exponential(1), > 0
    return (probs / exp).argmax(dim=-1)


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


# ----------------------------------------------------------------------------- batch tensors


def _pad(rows: Sequence[Sequence[int]], device: torch.device | str) -> torch.Tensor:
    """Ragged lists of ids -> ``[B, max_len]`` int64 padded with -1 (``max_len`` may be 0)."""
    width = max((len(r) for r in rows), default=0)
    if width == 0:
        return torch.empty(len(rows), 0, dtype=torch.int64, device=device)
    padded = [list(r) + [-1] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.int64).to(device)


@dataclass
class SamplingTensors:
    """The sampling parameters of a batch, one row per sequence, as device tensors.

    Build it with :meth:`from_params`; building it by hand is fine too (the shapes and dtypes
    are checked, the values are not). The ``do_*`` and ``all_greedy`` host flags let
    :func:`sample` skip a transform that no row needs; ``True`` (the default) is always
    correct, since a row whose parameter disables a transform passes through it unchanged.

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

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

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
    ) -> SamplingTensors:
        """Build the batch tensors on the host, then move each to ``device`` once.

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

        Raises:
            ValueError: a list's length is not B, or a token id is outside ``[0, V)``.
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
        empty: list[list[int]] = [[] for _ in range(batch)]
        prompts = list(prompt_ids_list) if prompt_ids_list is not None else empty
        outputs = list(output_ids_list) if output_ids_list is not None else empty
        suppress = list(suppress_list) if suppress_list is not None else empty
        for name, rows in (
            ("prompt_ids_list", prompts),
            ("output_ids_list", outputs),
            ("suppress_list", suppress),
        ):
            for i, row in enumerate(rows):
                bad = [tok for tok in row if not (0 <= tok < vocab_size)]
                if bad:
                    raise ValueError(f"{name}[{i}] has token ids outside [0, {vocab_size}): {bad[:5]}")

        row_seeds: list[int] = []
        row_steps: list[int] = []
        for i, p in enumerate(params_list):
            s = seeds[i] if seeds is not None else None
            if s is None:
                s = p.seed if p.seed is not None else random.getrandbits(64)
            row_seeds.append(_signed64(int(s)))
            row_steps.append(int(steps[i]) if steps is not None else len(outputs[i]))

        # Histories are only needed by rows with a penalty; others get an empty (all -1) row,
        # which is equivalent and keeps the padded width small.
        needs_rep = [p.repetition_penalty != 1.0 for p in params_list]
        needs_out = [
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            for p in params_list
        ]
        prompt_rows = [prompts[i] if needs_rep[i] else [] for i in range(batch)]
        output_rows = [outputs[i] if needs_out[i] else [] for i in range(batch)]

        def f32(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device)

        def i64(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device)

        return cls(
            temperature=f32([p.temperature for p in params_list]),
            top_k=i64([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params_list]),
            top_p=f32([p.top_p for p in params_list]),
            min_p=f32([p.min_p for p in params_list]),
            repetition_penalty=f32([p.repetition_penalty for p in params_list]),
            presence_penalty=f32([p.presence_penalty for p in params_list]),
            frequency_penalty=f32([p.frequency_penalty for p in params_list]),
            seeds=i64(row_seeds),
            steps=i64(row_steps),
            prompt_ids=_pad(prompt_rows, device),
            output_ids=_pad(output_rows, device),
            suppress_ids=_pad(suppress, device),
            max_num_logprobs=max((p.logprobs or 0 for p in params_list), default=0),
            all_greedy=all(p.greedy for p in params_list),
            do_penalties=any(needs_out),
            do_min_p=any(p.min_p > 0.0 and not p.greedy for p in params_list),
            do_top_k=any(0 < p.top_k < vocab_size and not p.greedy for p in params_list),
            do_top_p=any(p.top_p < 1.0 and not p.greedy for p in params_list),
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


def sample(logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
    """Pick the next token of every row (the pipeline of the module docstring).

    No host synchronisation happens here: every decision that depends on values is a tensor
    operation, and the only host-side branches read :class:`SamplingTensors`' host flags.

    Args:
        logits: ``[B, V]``, any floating dtype, on the same device as ``t``'s tensors.
        t: the batch's parameters (``B`` rows).

    Returns:
        :class:`SamplerOutput`.

    Raises:
        ValueError: ``logits`` is not ``[B, V]`` floating point with ``B == t.batch_size``.
    """
    if logits.dim() != 2 or logits.shape[0] != t.batch_size or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a floating [B, V] tensor with B = {t.batch_size}, "
            f"got shape {tuple(logits.shape)} {logits.dtype}"
        )
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

    chosen_logprobs = (raw_logits.gather(1, next_tokens[:, None]) - log_z).squeeze(1)
    k = t.max_num_logprobs
    if k > 0:
        top = raw_logits.topk(min(k, raw_logits.shape[-1]), dim=-1)
        top_ids, top_lps = top.indices, top.values - log_z
    else:
        top_ids = torch.empty(t.batch_size, 0, dtype=torch.int64, device=logits.device)
        top_lps = torch.empty(t.batch_size, 0, dtype=torch.float32, device=logits.device)
    return SamplerOutput(
        next_tokens=next_tokens, logprobs=chosen_logprobs, top_logprob_ids=top_ids, top_logprobs=top_lps
    )
