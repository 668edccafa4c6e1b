"""Counter-based random streams: each sequence's uniforms and its draw by the exponential race.

The sampler (:mod:`infer.sampling.sampler`) needs, for every row ``b`` of a batch and every token
``v`` of the vocabulary, a uniform ``u[b, v]`` in ``(0, 1)``. There is no shared
``torch.Generator``: a shared generator would make a request's tokens depend on which other
requests were in the batch and in which order. Instead ``u[b, v]`` is a *hash* of
``(seeds[b], steps[b], v)``, a counter-based random number generator (Salmon et al. 2011,
"Parallel Random Numbers: As Easy as 1, 2, 3", the idea behind Philox, which PyTorch's CUDA
generator uses), computed with int64 tensor operations by the splitmix64 mixer (Steele, Lea and
Flood 2014, "Fast Splittable Pseudorandom Number Generators"; constants from Vigna's
``splitmix64.c``). So a request with a given seed gets the same tokens whether it runs alone, in a
batch of 256, or after a preemption, on any device. ``steps[b]`` is the request's own position in
its random stream (how many tokens it has sampled so far).

* :func:`random_uniform`: the ``[B, V]`` uniforms of a step (``_random_uniform_at``: a few
  columns of them, for a row truncated to a few candidates).
* :func:`sample_from_probs`: one token per row, by the *exponential race*: with
  ``E[v] = -log(u[v]) ~ Exponential(1)`` independent, ``argmax_v p[v] / E[v]`` is distributed as
  ``p`` (``P(E[v]/p[v] is the smallest) = p[v] / sum(p)``: the minimum of independent exponential
  clocks with rates ``p[v]``). Taking logs, it is the Gumbel-max trick (Gumbel 1954; Maddison,
  Tarlow and Minka 2014, "A* Sampling"). vLLM samples the same way.

Sibling modules: :mod:`infer.sampling.triton_sampler` hashes the same uniforms in registers,
bit for bit (its kernels never write them to memory); :mod:`infer.sampling.logits_processors`
shapes the distribution ``p`` that the race draws from; :mod:`infer.sampling.metadata` fixes each
row's seed and step once per batch.
"""

from __future__ import annotations

import torch

__all__ = ["random_uniform", "sample_from_probs"]


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
