"""Triton kernels of the sampler (phase 8): row statistics and the fused exponential race.

The plain-PyTorch pipeline of :mod:`infer.sampling.sampler` makes many passes over the ``[B, V]``
logits, and its counter-based random numbers (:func:`~infer.sampling.rng.random_uniform`)
materialise several ``[B, V]`` int64 tensors (8 bytes per element each, written and read back):
at 256 rows x 151,936 vocabulary that is gigabytes of memory traffic per step. Two steps replace
it, each splitting every row into tiles of ``BLOCK`` columns (one program per row and tile, so
that even a batch of one row keeps many SMs busy; the tiling depends on ``V`` only):

* :func:`row_stats` (one program per tile of a row, one read of the logits, then one program per
  row to combine the tiles): the row's maximum and its *first* index (greedy's argmax,
  ``torch.argmax``'s tie rule), the log-sum-exp (the raw logprobs' normaliser), and the softmax
  normaliser of the temperature-scaled row ``y = x / T``: ``m = max(y)`` and
  ``s = sum(exp(y - m))``; with min-p and/or top-k, a second read sums ``s_kept`` over the tokens
  they keep (top-k arrives as the k-th largest value, from ``torch.topk`` to the batch's largest
  k). :func:`argmax_lse`, greedy's fast path, is its first read alone.
* :func:`exponential_race` (one program per tile of a row, then an exact combine of the tiles'
  winners): ``argmax_v p[v] / -log(u[v])`` with ``p`` computed on the fly from the
  logits (``p = exp(y - m) / s_kept`` on the kept tokens, 0 elsewhere; top-p arrives as a floor
  too, or as ``-inf`` in the logits) and the uniforms ``u`` hashed in registers from
  ``(seed, step, v)``, exactly as ``random_uniform`` does with int64
  tensors (splitmix64 in uint64 arithmetic, whose multiplies wrap modulo 2**64 like int64's do).
  Nothing of size ``[B, V]`` is written.

Same tokens as the reference
----------------------------
Every value the kernels compute is the same float32 operation as the reference's: ``x / T``
(IEEE division, ``div_rn``; Triton's plain ``/`` is an approximate division on NVIDIA GPUs),
``exp(y - m)``, ``e / s``, ``-log(u)``, ``p / E``, with libdevice's ``expf``/``logf`` on the GPU
(the functions behind CUDA's ``expf``/``logf``, which PyTorch calls; Triton's ``tl.exp``/``tl.log``
are faster approximations). The uniforms are bit-identical (integer hashing, then an exact
conversion). One thing differs: how the row sum ``s`` is accumulated (PyTorch's reduction tree
vs this module's tiles, each rescaled to the row max), so ``s`` may differ in its last bits, and
with it some ``p[v]``. A token can therefore differ from the reference only when the two best
race scores of a row are within about two float32 ulps of each other (a relative gap below
~2.4e-7): for an exponential race that happens with probability of the order of 1e-7 per token.
The same goes for a min-p or top-p threshold that falls within an ulp of a token's probability.
The kernels are deterministic and a row's reductions run in an order that depends on ``V``
only, so a seeded request's tokens never depend on the batch.

Importing needs Triton (:mod:`infer.sampling.sampler` imports this module only when the kernels
run); launching needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1``
set before Triton is imported (the tests' conftest does it). Under the interpreter the kernels use
``tl.exp``/``tl.log`` (NumPy's), since libdevice does not run there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from infer.kernels.triton_common import INTERPRET, first_argmax

__all__ = ["INTERPRET", "RowStats", "apply_token_bitmask", "argmax_logprob", "argmax_lse", "exponential_race",
           "race_from_probs", "row_stats"]


# ----------------------------------------------------------------------------- device helpers


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _log(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _div(x, y):
    """IEEE round-to-nearest ``x / y`` of a block by a scalar (``tl.div_rn`` does not broadcast;
    Triton's plain ``/`` is an approximate division on NVIDIA GPUs)."""
    return tl.div_rn(x, tl.broadcast_to(y, x.shape))


@triton.jit
def _mix64(z):
    """splitmix64's finaliser on uint64 (multiplies wrap modulo 2**64, shifts are logical)."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _uniform(key, idx):
    """``random_uniform``'s value at column ``idx`` of the row whose stream key is ``key``."""
    counter = (idx + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
    z = _mix64(key + counter)
    # (k + 0.5) / 2**24 rounded to float32, kept below 1 exactly as random_uniform does (for k = 2**24 - 1
    # the sum rounds to 2**24: u would be 1 and -log(u) zero)
    return tl.minimum(((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0), 0.99999994039535522)


# ----------------------------------------------------------------------------- row statistics
#
# Split over (row, tile of BLOCK columns) programs, so that even one row spreads over many SMs,
# then one program per row combines the tiles' partial results in tile order. The tiling
# depends on V only, never on the batch: a row's statistics do not depend on its neighbours.


@triton.jit(do_not_specialize=["V", "stride_x"])
def _stats_tile_kernel(
    x_ptr, stride_x, V, temp_ptr, tile_max_ptr, tile_arg_ptr, tile_sum_x_ptr, tile_sum_y_ptr, num_tiles,
    SCALED: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr,
):
    # One read of the tile: its max and the first index of it, sum(exp(x - tile max)) and, for the
    # temperature-scaled y = x / T, sum(exp(y - max y)) (max y = max x / T: rounding is monotone).
    row = tl.program_id(0)
    tile = tl.program_id(1)
    idx = tile * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    m, arg = first_argmax(x, idx, V)
    empty = m == float("-inf")  # an all -inf tile adds nothing (and exp(-inf - -inf) is nan)
    out = row * num_tiles + tile
    tl.store(tile_max_ptr + out, m)
    tl.store(tile_arg_ptr + out, arg)
    tl.store(tile_sum_x_ptr + out, tl.where(empty, 0.0, tl.sum(_exp(x - m, EXACT), axis=0)))
    if SCALED:
        t = tl.load(temp_ptr + row)
        y = _div(x, t)
        s_y = tl.sum(_exp(y - tl.div_rn(m, t), EXACT), axis=0)
        tl.store(tile_sum_y_ptr + out, tl.where(empty, 0.0, s_y))


@triton.jit
def _stats_combine_kernel(
    tile_max_ptr, tile_arg_ptr, tile_sum_x_ptr, tile_sum_y_ptr, num_tiles, V, temp_ptr,
    argmax_ptr, lse_ptr, m_ptr, s_ptr, logprob_ptr,
    SCALED: tl.constexpr, EXACT: tl.constexpr, TILES: tl.constexpr, LOGPROB: tl.constexpr,
):
    # The row max is the largest tile max, its first index the smallest among the tiles holding it
    # (both exact); the sums are rescaled to the row max and added (the online-softmax combination
    # of Milakov and Gimelshein 2018, "Online normalizer calculation for softmax", arXiv:1805.02867).
    row = tl.program_id(0)
    offs = tl.arange(0, TILES)
    valid = offs < num_tiles
    base = row * num_tiles + offs
    m = tl.load(tile_max_ptr + base, mask=valid, other=float("-inf"))
    arg = tl.load(tile_arg_ptr + base, mask=valid, other=V)
    s_x = tl.load(tile_sum_x_ptr + base, mask=valid, other=0.0)
    top, first = first_argmax(m, arg, V)  # a tile's arg is its first index of its max (or first NaN)
    total_x = tl.sum(tl.where(s_x > 0.0, s_x * _exp(m - top, EXACT), 0.0), axis=0)
    lse = top + _log(total_x, EXACT)
    tl.store(argmax_ptr + row, first.to(tl.int64))
    tl.store(lse_ptr + row, lse)
    if LOGPROB:  # the argmax's logprob, x[argmax] - lse: greedy's chosen logprob without a gather
        tl.store(logprob_ptr + row, top - lse)
    if SCALED:
        t = tl.load(temp_ptr + row)
        s_y = tl.load(tile_sum_y_ptr + base, mask=valid, other=0.0)
        top_y = tl.div_rn(top, t)
        total_y = tl.sum(tl.where(s_y > 0.0, s_y * _exp(_div(m, t) - top_y, EXACT), 0.0), axis=0)
        tl.store(m_ptr + row, top_y)
        tl.store(s_ptr + row, total_y)
    else:
        tl.store(m_ptr + row, top)
        tl.store(s_ptr + row, total_x)


@triton.jit(do_not_specialize=["V", "stride_x"])
def _kept_sum_tile_kernel(
    x_ptr, stride_x, V, temp_ptr, min_p_ptr, floor_ptr, m_ptr, s_ptr, tile_kept_ptr, num_tiles,
    SCALED: tl.constexpr, MIN_P: tl.constexpr, FLOOR: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr,
):
    # The normaliser over the tokens min-p and top-k keep, with the row's m and s. Min-p keeps
    # p >= min_p * max(p), max(p) = exp(0) / s = 1 / s; top-k keeps y >= floor (the k-th largest y).
    # Both keep every token above some value of y (p grows with y), so applying them together is
    # the same as top-k after min-p: if min-p removed the k-th token, fewer than k survive min-p,
    # all above the floor, and top-k keeps them all.
    row = tl.program_id(0)
    tile = tl.program_id(1)
    idx = tile * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(x_ptr + row.to(tl.int64) * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    if SCALED:
        y = _div(y, tl.load(temp_ptr + row))
    e = _exp(y - tl.load(m_ptr + row), EXACT)
    if MIN_P:
        s = tl.load(s_ptr + row)
        threshold = tl.load(min_p_ptr + row) * tl.div_rn(1.0, s)
        e = tl.where(_div(e, s) >= threshold, e, 0.0)
    if FLOOR:
        e = tl.where(y >= tl.load(floor_ptr + row), e, 0.0)
    tl.store(tile_kept_ptr + row * num_tiles + tile, tl.sum(e, axis=0))


@triton.jit
def _sum_tiles_kernel(tile_ptr, num_tiles, out_ptr, TILES: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, TILES)
    part = tl.load(tile_ptr + row * num_tiles + offs, mask=offs < num_tiles, other=0.0)
    tl.store(out_ptr + row, tl.sum(part, axis=0))


class RowStats(NamedTuple):
    """Per-row statistics of ``[B, V]`` logits ``x`` (all ``[B]``), see :func:`row_stats`."""

    argmax: torch.Tensor  # int64, first index of max(x)
    lse: torch.Tensor  # float32, log(sum(exp(x)))
    m: torch.Tensor  # float32, max(x / T)
    s: torch.Tensor  # float32, sum(exp(x / T - m))
    s_kept: torch.Tensor  # float32, the same sum over the tokens min-p and top-k keep (= s without them)


def _block(vocab_size: int) -> int:
    if INTERPRET:
        return min(1024, triton.next_power_of_2(vocab_size))
    return min(4096, triton.next_power_of_2(vocab_size))


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating [B, V] tensor, got {tuple(x.shape)} {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have a contiguous last dimension (strides {x.stride()})")
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the sampler's Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
                           f"triton is imported to run them on the CPU (got a {x.device} tensor)")


def row_stats(
    x: torch.Tensor,
    temperature: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    top_k_floor: torch.Tensor | None = None,
    logprob: torch.Tensor | None = None,
) -> RowStats:
    """Argmax, log-sum-exp, and the softmax normaliser of ``x / T``: one or two reads of ``x``.

    Plain-PyTorch equivalent (up to the order of the sums): ``argmax = x.argmax(-1)``,
    ``lse = x.float().logsumexp(-1)``, ``y = x.float() / temperature[:, None]``, ``m = y.amax(-1)``,
    ``s = exp(y - m).sum(-1)``, and ``s_kept`` the same sum over the tokens that survive
    :func:`~infer.sampling.apply_min_p` then :func:`~infer.sampling.apply_top_k` on ``y`` (a
    second read of ``x``, only with ``min_p`` or ``top_k_floor``).

    Args:
        x: ``[B, V]`` float32/bf16/fp16 logits (read in place; the last dimension contiguous).
        temperature: ``[B]`` float32, > 0 (clamped by the caller), or ``None`` for ``T = 1``.
        min_p: ``[B]`` float32 in [0, 1], or ``None`` for no min-p.
        top_k_floor: ``[B]`` float32, the k-th largest value of ``x / T`` (``-inf`` for rows
            without top-k), or ``None`` for no top-k.
        logprob: ``[B]`` float32 to fill with ``max(x) - lse`` (the argmax's logprob, written by the
            kernel that combines the tiles), or ``None``.

    Returns:
        :class:`RowStats`.

    Raises:
        ValueError: ``x`` is not a floating ``[B, V]`` tensor with a contiguous last dimension.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check(x)
    b, v = x.shape
    dev = x.device
    f32 = {"dtype": torch.float32, "device": dev}
    argmax, lse, m, s = torch.empty(b, dtype=torch.int64, device=dev), *(torch.empty(b, **f32) for _ in range(3))
    if b == 0:
        return RowStats(argmax, lse, m, s, s)
    block = _block(v)
    num_tiles = triton.cdiv(v, block)
    tiles = triton.next_power_of_2(num_tiles)
    scaled = temperature is not None
    temp = temperature if scaled else m
    tile_max, tile_sum_x, tile_sum_y = (torch.empty(b, num_tiles, **f32) for _ in range(3))
    tile_arg = torch.empty(b, num_tiles, dtype=torch.int32, device=dev)
    _stats_tile_kernel[(b, num_tiles)](
        x, x.stride(0), v, temp, tile_max, tile_arg, tile_sum_x, tile_sum_y, num_tiles,
        SCALED=scaled, EXACT=not INTERPRET, BLOCK=block, num_warps=8,
    )
    _stats_combine_kernel[(b,)](
        tile_max, tile_arg, tile_sum_x, tile_sum_y, num_tiles, v, temp, argmax, lse, m, s,
        logprob if logprob is not None else m, SCALED=scaled, EXACT=not INTERPRET, TILES=tiles,
        LOGPROB=logprob is not None, num_warps=1,
    )
    if min_p is None and top_k_floor is None:
        return RowStats(argmax, lse, m, s, s)
    s_kept = torch.empty(b, **f32)
    _kept_sum_tile_kernel[(b, num_tiles)](
        x, x.stride(0), v, temp, min_p if min_p is not None else m, top_k_floor if top_k_floor is not None else m,
        m, s, tile_sum_x, num_tiles,  # tile_sum_x is free again: reused for the partial sums
        SCALED=scaled, MIN_P=min_p is not None, FLOOR=top_k_floor is not None, EXACT=not INTERPRET,
        BLOCK=block, num_warps=8,
    )
    _sum_tiles_kernel[(b,)](tile_sum_x, num_tiles, s_kept, TILES=tiles, num_warps=1)
    return RowStats(argmax, lse, m, s, s_kept)


def argmax_lse(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy's fast path in one read of the logits: ``(x.argmax(-1), x.float().logsumexp(-1))``.

    The argmax is exact (the first index of the maximum, ``torch.argmax``'s rule); the
    log-sum-exp (the raw logprobs' normaliser) agrees with PyTorch's to float32 rounding.

    Args:
        x: ``[B, V]`` float32/bf16/fp16 (the last dimension contiguous).

    Returns:
        ``([B] int64, [B] float32)``.

    Raises:
        ValueError: ``x`` is not a floating ``[B, V]`` tensor with a contiguous last dimension.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    stats = row_stats(x)
    return stats.argmax, stats.lse


def argmax_logprob(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy's fast path with its chosen logprob, in one read of the logits and two kernels:
    ``(x.argmax(-1), lse, x.float().max(-1) - lse)`` with ``lse = x.float().logsumexp(-1)``.

    The third is the argmax's logprob, ``x[argmax].float() - lse`` (the row's maximum is the value at
    its argmax), computed by the kernel that combines the tiles: the sampler's greedy path returns it
    without a gather, a cast and a subtraction (three kernels a step, ~2.5 us each between a decode
    step's graph and the copy of its token to the host).

    Args:
        x: ``[B, V]`` float32/bf16/fp16 (the last dimension contiguous).

    Returns:
        ``([B] int64, [B] float32, [B] float32)``.

    Raises:
        ValueError: ``x`` is not a floating ``[B, V]`` tensor with a contiguous last dimension.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    logprob = x.new_empty(x.shape[:-1], dtype=torch.float32)  # [B] (row_stats checks x before any use)
    stats = row_stats(x, logprob=logprob)
    return stats.argmax, stats.lse, logprob


# ----------------------------------------------------------------------------- the race


@triton.jit(do_not_specialize=["V", "stride_x"])
def _race_kernel(
    x_ptr, stride_x, V, temp_ptr, min_p_ptr, m_ptr, s_ptr, s_kept_ptr, floor_ptr, seeds_ptr, steps_ptr,
    best_ptr, best_i_ptr, num_tiles,
    FROM_PROBS: tl.constexpr, SCALED: tl.constexpr, MIN_P: tl.constexpr, FLOOR: tl.constexpr,
    EXACT: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per (row, tile of BLOCK columns): the race is compute-bound (a 64-bit hash, a log
    # and divisions per column), so even one row spreads over many SMs. The tiling depends on V
    # only, never on the batch, and combining the tiles' winners is exact.
    row = tl.program_id(0)
    tile = tl.program_id(1)
    idx = tile * BLOCK + tl.arange(0, BLOCK)
    valid = idx < V
    ptrs = x_ptr + row.to(tl.int64) * stride_x + idx

    # the row's stream key, random_uniform's mix(mix(seed + golden) ^ step) in uint64
    seed = tl.load(seeds_ptr + row).to(tl.uint64, bitcast=True)
    step = tl.load(steps_ptr + row).to(tl.uint64, bitcast=True)
    key = _mix64(_mix64(seed + 0x9E3779B97F4A7C15) ^ step)

    if FROM_PROBS:
        p = tl.load(ptrs, mask=valid, other=0.0).to(tl.float32)
    else:
        y = tl.load(ptrs, mask=valid, other=float("-inf")).to(tl.float32)
        if SCALED:
            y = _div(y, tl.load(temp_ptr + row))
        e = _exp(y - tl.load(m_ptr + row), EXACT)
        if MIN_P:
            s = tl.load(s_ptr + row)
            threshold = tl.load(min_p_ptr + row) * tl.div_rn(1.0, s)
            e = tl.where(_div(e, s) >= threshold, e, 0.0)
        if FLOOR:
            e = tl.where(y >= tl.load(floor_ptr + row), e, 0.0)
        p = _div(e, tl.load(s_kept_ptr + row))
    exp1 = -_log(_uniform(key, idx), EXACT)  # Exponential(1), > 0
    score = tl.where(valid, tl.div_rn(p, exp1), -1.0)  # scores are >= 0: any real column beats -1
    best, best_i = first_argmax(score, idx, V)
    tl.store(best_ptr + row * num_tiles + tile, best)
    tl.store(best_i_ptr + row * num_tiles + tile, best_i.to(tl.int64))


def _launch_race(x, temp, min_p, floor, stats, seeds, steps, *, from_probs, scaled, use_min_p) -> torch.Tensor:
    b, v = x.shape
    block = _block(v)
    num_tiles = triton.cdiv(v, block)
    best = torch.empty(b, num_tiles, dtype=torch.float32, device=x.device)
    best_i = torch.empty(b, num_tiles, dtype=torch.int64, device=x.device)
    _race_kernel[(b, num_tiles)](
        x, x.stride(0), v, temp, min_p, stats.m, stats.s, stats.s_kept,
        floor if floor is not None else stats.m, seeds, steps, best, best_i, num_tiles,
        FROM_PROBS=from_probs, SCALED=scaled, MIN_P=use_min_p, FLOOR=floor is not None, EXACT=not INTERPRET,
        BLOCK=block, num_warps=8,
    )
    # the first tile holding the row's best score (argmax takes the first maximum), then its column
    return best_i.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)


def _check_rng(seeds: torch.Tensor, steps: torch.Tensor, b: int) -> None:
    for name, t in (("seeds", seeds), ("steps", steps)):
        if t.dtype != torch.int64 or t.shape != (b,):
            raise ValueError(f"{name} must be a [{b}] int64 tensor, got {tuple(t.shape)} {t.dtype}")


def exponential_race(
    x: torch.Tensor,
    stats: RowStats,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    temperature: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    top_k_floor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token per row from ``softmax(x / T)`` (min-p, top-k applied) by the exponential race.

    Plain-PyTorch equivalent: ``sample_from_probs(softmax(apply_top_k(apply_min_p(x.float() / T,
    min_p), k)), seeds, steps)`` (:func:`~infer.sampling.sample_from_probs`); columns of ``x`` that
    hold ``-inf`` (masked beforehand) have probability 0.

    Args:
        x: ``[B, V]`` float logits (the last dimension contiguous).
        stats: :func:`row_stats` of ``x`` with the same ``temperature``, ``min_p`` and top-k floor.
        seeds, steps: ``[B]`` int64 (see :func:`~infer.sampling.random_uniform`).
        temperature: ``[B]`` float32 > 0, or ``None`` for ``T = 1``.
        min_p: ``[B]`` float32, or ``None``.
        top_k_floor: ``[B]`` float32, as given to :func:`row_stats`, or ``None``.

    Returns:
        ``[B]`` int64 token ids.

    Raises:
        ValueError: bad shapes or dtypes. RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check(x)
    b, v = x.shape
    _check_rng(seeds, steps, b)
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    return _launch_race(
        x, temperature if temperature is not None else stats.m, min_p if min_p is not None else stats.m,
        top_k_floor, stats, seeds, steps, from_probs=False, scaled=temperature is not None,
        use_min_p=min_p is not None,
    )


def race_from_probs(probs: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """:func:`~infer.sampling.sample_from_probs` in one pass: ``argmax(probs / -log(u))``, ``u`` hashed in registers.

    Bit-identical to the reference's choice on the same ``probs`` (the same float32 operations on
    the same uniforms), up to ``logf`` itself: on the GPU it is libdevice's, the function PyTorch's
    CUDA ``log`` calls.

    Args:
        probs: ``[B, V]`` float32 (the last dimension contiguous).
        seeds, steps: ``[B]`` int64.

    Returns:
        ``[B]`` int64 token ids.
    """
    _check(probs)
    b, v = probs.shape
    _check_rng(seeds, steps, b)
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=probs.device)
    unused = RowStats(probs, probs, probs, probs, probs)
    return _launch_race(probs, probs, probs, None, unused, seeds, steps, from_probs=True, scaled=False,
                        use_min_p=False)


# ----------------------------------------------------------------------------- structured output


@triton.jit(do_not_specialize=["V", "W", "stride_x"])
def _token_bitmask_kernel(x_ptr, mask_ptr, rows_ptr, V, W, stride_x, BLOCK: tl.constexpr):
    # Grid (R, cdiv(V, BLOCK)): program (r, j) masks tokens j*BLOCK .. of logits row rows[r] in place.
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + r)
    words = tl.load(mask_ptr + r.to(tl.int64) * W + offs // 32, mask=offs < 32 * W, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    ptrs = x_ptr + row * stride_x + offs
    tl.store(ptrs, tl.full([BLOCK], float("-inf"), x_ptr.dtype.element_ty), mask=(offs < V) & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """:func:`infer.sampling.structured.apply_token_bitmask` (its plain-PyTorch reference) in two
    launches: a copy of the logits, then one kernel that reads each constrained row's packed mask
    and writes ``-inf`` over its disallowed tokens (the unpacked ``[R, V]`` booleans never exist).

    Args:
        logits: ``[B, V]`` float (last dimension contiguous).
        bitmask: ``[R, W]`` int32 (bit ``v % 32`` of word ``v // 32``: token ``v`` allowed); tokens
            past ``32 W`` are disallowed.
        rows: ``[R]`` int64, distinct rows of ``logits``.

    Returns:
        A new ``[B, V]`` tensor; rows not in ``rows`` are bit-for-bit the input's.
    """
    _check(logits)
    out = logits.clone()
    r, w = bitmask.shape
    if r == 0:
        return out
    block = _block(logits.shape[1])
    _token_bitmask_kernel[(r, triton.cdiv(logits.shape[1], block))](
        out, bitmask.contiguous(), rows, logits.shape[1], w, out.stride(0), BLOCK=block,
    )
    return out
