"""Batched multi-adapter LoRA (phase 16) in Triton: shrink and expand over rows grouped by adapter.

The same functions and values as :mod:`.lora_reference` (read its docstring first). Both kernels take
the step's rows grouped by slot (:func:`~.lora_reference.make_lora_meta`) and run on a grid of
``(row blocks, column blocks, the step's adapters)``: program ``(m, n, i)`` takes the ``i``-th slot with
rows (``l = active_slots[i]``), its rows ``m * BLOCK_M ...``, gathers them from ``x`` by row index, and
multiplies them by one tile of slot ``l``'s A (shrink) or B (expand). So one tile of an adapter read
from memory serves every row of that adapter in the step, which is Punica's SGMV (segmented gather matrix-vector; for a decode step where each
adapter has one row it is their BGMV), in the single-kernel form vLLM v1 uses for both prefill and
decode. Programs of a slot with fewer rows than ``m * BLOCK_M``, or past the step's adapters (an
``active_slots`` entry of -1), return at once: rows without an adapter are in no segment and cost nothing.

Two refinements for a decode step, where each adapter has a row or two (phase 16's page, Measured):

* **split-K shrink** (:func:`_split_k`): the shrink's third grid axis is ``adapters x split``, each program
  taking a slice of the ``in`` columns and writing a float32 partial sum, and the program that finishes a
  tile last adds the tile's partial sums in a fixed order (an arrival counter per tile); without the split
  a single program streamed an adapter's whole A. (The expand once added the partial sums itself as it
  loaded them, every one of its column tiles re-reading all of them: 1.45x the base's TPOT against 1.39x
  at 32 rows over 8 adapters on an H200.)
* **one expand per merged projection** (:func:`add_lora_stacked`: stacked B, each column tile reading its
  part's R columns of the shrink output).

The grid depends only on ``T``, the ranks, ``in`` and ``max_loras``, never on which rows use which
adapter (the segments are device tensors the kernels load), so a graph captured for ``T`` rows would
replay for any adapter mix. With PDL (``EngineConfig.pdl``, :mod:`infer.kernels.pdl`) each kernel loads
the row groups and its first tile of A or B before it waits for the kernel before it, like the
projections around it; without, the kernels after a LoRA kernel would lose their early start too. On
the CPU this runs only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.lora_reference import LoRAKernelMeta
from infer.kernels.pdl import launch_options, wait_for_previous
from infer.kernels.skinny_gemm import row_squares, x_slice
from infer.kernels.triton_common import manual_bf16, rank_in_sectors, round_to

__all__ = ["lora_shrink", "lora_expand", "add_lora", "add_lora_stacked", "lora_shrink_row", "split_counters",
           "lora_expand_stacked"]


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, out_ptr, part_ptr, counter_ptr, rows_ptr, starts_ptr, counts_ptr, active_ptr,
                        ranks_ptr, K, R, PART_R, K_PER_SPLIT, stride_xm, stride_al, stride_ar, stride_ps, stride_om,
                        SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr, IEEE: tl.constexpr, HAS_RANKS: tl.constexpr, USE_PDL: tl.constexpr):
    pid_m, pid_r, pid_ls = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the grid's third axis: the step's adapters (active_slots), each split-K ways (a slice of K columns)
    slot = tl.load(active_ptr + pid_ls // SPLIT_K)
    if HAS_RANKS:  # the slot's rank, loaded beside the slot (not looked up by it: no load waits for another)
        rank = tl.load(ranks_ptr + pid_ls // SPLIT_K)
    split = pid_ls % SPLIT_K
    if slot < 0:
        return  # fewer adapters in this step than the grid has room for
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return  # this slot has no rows in this block
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(rows_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    store_r = offs_r < R
    mask_r = store_r
    if HAS_RANKS:  # only the slot's own rank of each part's PART_R rows is read (the sums past it: zeros)
        mask_r = mask_r & (offs_r % PART_R < rank)
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    # A's first tile before the PDL wait (infer.kernels.pdl): no kernel of the step writes the adapters (nor
    # the row groups above, staged by the host), only x, which the kernel before this one writes
    offs_k = k_start + tl.arange(0, BLOCK_K)
    a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None], mask=mask_r[None, :] & (offs_k < k_end)[:, None],
                other=0.0)  # [BLOCK_K, BLOCK_R]: A^T's tile
    wait_for_previous(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & (offs_k < k_end)[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, a, input_precision="ieee")
        else:
            acc += tl.dot(x, a)
        offs_k += BLOCK_K  # the next tile of A (nothing past k_end: the last load is masked off)
        a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None],
                    mask=mask_r[None, :] & (offs_k < k_end)[:, None], other=0.0)
    mask = mask_m[:, None] & store_r[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_r[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=mask)
    else:
        # Each split stores its partial sum; the one that arrives last at the tile's counter adds all of them
        # in split order (the same bits every run, unlike atomic adds of the sums), stores the tile and resets
        # the counter for the next launch. The barrier and the counter's acquire-release order every split's
        # stores before the last one's loads, which bypass L1 (.cg: another SM wrote them).
        part_ptrs = part_ptr + rows[:, None] * stride_om + offs_r[None, :]
        tl.store(part_ptrs + split * stride_ps, acc, mask=mask)
        tl.debug_barrier()
        tile = ((pid_ls // SPLIT_K) * tl.num_programs(0) + pid_m) * tl.num_programs(1) + pid_r
        if tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptrs + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total, mask=mask)
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _lora_expand_kernel(t_ptr, b_ptr, y_ptr, rows_ptr, starts_ptr, counts_ptr, active_ptr, ranks_ptr, N, R, y_offset,
                        P1, P2, stride_tm, stride_bl, stride_bn, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, IEEE: tl.constexpr, HAS_RANKS: tl.constexpr, USE_PDL: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    slot = tl.load(active_ptr + tl.program_id(2))
    rank = R
    if HAS_RANKS:  # the slot's own rank, loaded beside it: B's padding columns past it are neither read nor
        rank = tl.minimum(rank_in_sectors(tl.load(ranks_ptr + tl.program_id(2))), R)  # multiplied
    if slot < 0:
        return
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    start = tl.load(starts_ptr + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(rows_ptr + start + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # a merged projection's parts (stacked B): the part of this column tile reads its own R columns of t
    part = (pid_n * BLOCK_N >= P1).to(tl.int32) + (pid_n * BLOCK_N >= P2).to(tl.int32)
    b_base = b_ptr + slot.to(tl.int64) * stride_bl
    # B's first tile before the PDL wait, as the shrink's A; t (the shrink's) and y (the base product's)
    # are written by the kernels before this one
    offs_r = tl.arange(0, BLOCK_R)
    b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None],
                mask=mask_n[None, :] & (offs_r < rank)[:, None], other=0.0)  # [BLOCK_R, BLOCK_N]: B^T's tile
    wait_for_previous(USE_PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        t = tl.load(t_ptr + rows[:, None] * stride_tm + (part * R + offs_r)[None, :],
                    mask=mask_m[:, None] & (offs_r < rank)[None, :], other=0.0)
        t = t.to(b.dtype)  # the shrink output rounded to the adapter's dtype (the reference does the same)
        if IEEE:
            acc += tl.dot(t, b, input_precision="ieee")
        else:
            acc += tl.dot(t, b)
        offs_r += BLOCK_R  # the next tile of B (none past the rank: masked off)
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None],
                    mask=mask_n[None, :] & (offs_r < rank)[:, None], other=0.0)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + y_offset + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=mask)


@triton.jit
def _lora_shrink_row_kernel(x_ptr, r_ptr, r_out_ptr, nw_ptr, xn_ptr, a_ptr, slot_ptr, rank_ptr, t_ptr, K, PR, PART_R,
                            eps, stride_al, stride_ar, NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
                            MANUAL_BF16: tl.constexpr, BLOCK_R: tl.constexpr, K_PAD: tl.constexpr,
                            HAS_RANKS: tl.constexpr, USE_PDL: tl.constexpr):
    # Grid (cdiv(PR, BLOCK_R),): program p computes t[p BLOCK_R ... (p + 1) BLOCK_R - 1], whole dot products of
    # the row with BLOCK_R rows of the slot's A ([PR, K]: every part's rows). Each program loads its rows of A
    # in one tile before the PDL wait (no kernel writes A), then the row from L2: one trip to memory after the
    # wait and no sum across programs (split-K would need one: measured on an H200, an arrival counter and
    # the last program's sum cost 1.3 us of 3.2 at QKV's shapes).
    #   NORM 1 / 2: the row is rms_norm(x) (2: of x + residual), with the skinny GEMM's roundings; program 0
    #   stores the normalized row (xn) for the projection that follows (and, NORM 2, x + residual: r_out), so
    #   a LoRA step launches no norm kernel of its own.
    pid = tl.program_id(0)
    slot = tl.maximum(tl.load(slot_ptr), 0)  # (a row without adapter: slot 0's values, which no epilogue adds)
    offs_r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < PR
    a_mask = r_mask
    if HAS_RANKS:  # rows past the slot's rank (each part's; loaded beside the slot) are padding: not read
        a_mask = a_mask & (offs_r % PART_R < tl.load(rank_ptr))
    k = tl.arange(0, K_PAD)
    a = tl.load(a_ptr + slot.to(tl.int64) * stride_al + offs_r[:, None] * stride_ar + k[None, :],
                mask=a_mask[:, None] & (k < K)[None, :], other=0.0)
    wait_for_previous(USE_PDL)
    m_mask = tl.arange(0, 1) < 1
    x_rows = x_ptr + tl.zeros([1, 1], dtype=tl.int64)
    r_rows = r_ptr + tl.zeros([1, 1], dtype=tl.int64)
    dtype = xn_ptr.dtype.element_ty
    rstd = tl.zeros([1], dtype=tl.float32)
    if NORM:
        sq = row_squares(x_rows, r_rows, r_out_ptr + tl.zeros([1, 1], dtype=tl.int64), k, m_mask, K, pid, NORM, dtype,
                      MANUAL_BF16)
        rstd = tl.rsqrt(tl.sum(sq, 1) / K + eps)
    xk = x_slice(x_rows, r_rows, nw_ptr, rstd, k, m_mask, K, NORM, UNIT_OFFSET, dtype, MANUAL_BF16)  # [1, K_PAD]
    if NORM:
        if pid == 0:
            tl.store(xn_ptr + k[None, :], round_to(xk, dtype, MANUAL_BF16), mask=(k < K)[None, :])
    tl.store(t_ptr + offs_r, tl.sum(xk * a.to(tl.float32), 1), mask=r_mask)


def _block_m(meta: LoRAKernelMeta) -> int:
    # decode: about one row per adapter, so the smallest tile tl.dot takes; prefill: larger tiles
    return 16 if meta.num_tokens <= 64 else 64


def _check(x: torch.Tensor, w: torch.Tensor, name: str) -> None:
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"lora_{name}: the inputs' last dimension must be contiguous")


def _split_k(num_tokens: int, k: int, num_programs: int) -> int:
    """How many programs share one row block's K columns (split-K); ``num_programs``: the launch's rank
    blocks. A decode step has one row block per adapter: without a split, one program would stream the
    adapter's whole A (``R x in``: 393 KB at rank 48 and 4,096 inputs) alone, on one SM, while the others
    idle. Each split takes at least 256 columns, and the grid is kept near 128 programs. A prefill chunk
    of a few thousand rows has about ``T / 64`` row blocks with rows: fewer programs than SMs at 2,048 rows
    and a merged projection's 3 rank blocks, each looping over all of K (measured on an H200: 59 us a
    shrink at Qwen3-8B's shapes, 8 adapters), so it is split too, to about 2 programs an SM, in slices of
    at least 1,024 columns."""
    if num_tokens <= 64:  # (at most 16: down's 12,288 inputs at 32 rows took 19.0 us in 32 splits, 15.3 in 16)
        return max(1, min(k // 256, 128 // max(num_programs, 1), 16))
    programs = triton.cdiv(num_tokens, 64) * max(num_programs, 1)
    return max(1, min(k // 1024, 264 // programs, 8))


def split_counters(num_tiles: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed int32 arrival counters for :func:`lora_shrink`'s split-K: one per output tile of a launch (row
    blocks x rank blocks x adapters), reset to zero by the kernel that used them, so a buffer made once serves
    every launch and every CUDA graph replay (:attr:`~.lora_reference.LoRAKernelMeta.split_counters`)."""
    return torch.zeros(num_tiles, dtype=torch.int32, device=device)


def _shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta, out: torch.Tensor | None,
            split_k: int | None, part_rank: int | None = None) -> torch.Tensor:
    """The shrink launch into ``out`` (float32 ``[T, R]``, allocated if None); ``part_rank``: each stacked
    part's rows (default: all of A's)."""
    _check(x, lora_a, "shrink")
    _, r, k = lora_a.shape
    bm, br = _block_m(meta), max(16, min(64, triton.next_power_of_2(r)))
    blocks = (triton.cdiv(meta.num_tokens, bm), triton.cdiv(r, br))
    split = split_k or _split_k(meta.num_tokens, k, blocks[1])
    block_k = 64 if split == 1 else min(128, triton.next_power_of_2(triton.cdiv(k, split)))
    per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, per_split)  # (no empty splits)
    if out is None:
        out = torch.empty(x.shape[0], r, dtype=torch.float32, device=x.device)
    adapters = meta.active_slots.numel()
    part, counters = out, meta.slot_counts  # (not read without a split)
    if split > 1:
        part = torch.empty(split, x.shape[0], r, dtype=torch.float32, device=x.device)
        counters = meta.split_counters
        if counters is None or counters.numel() < blocks[0] * blocks[1] * adapters:
            counters = split_counters(blocks[0] * blocks[1] * adapters, x.device)  # (a launch outside a graph)
    ranks = meta.active_ranks
    _lora_shrink_kernel[(*blocks, adapters * split)](
        x, lora_a, out, part, counters, meta.sorted_rows, meta.slot_starts, meta.slot_counts, meta.active_slots,
        ranks if ranks is not None else meta.slot_counts, k, r, part_rank or r, per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), part.stride(0) if split > 1 else 0, out.stride(0),
        SPLIT_K=split, BLOCK_M=bm, BLOCK_R=br, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
        HAS_RANKS=ranks is not None, **launch_options(x))
    return out


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, meta: LoRAKernelMeta, out: torch.Tensor,
                part_rank: int | None = None, split_k: int | None = None) -> torch.Tensor:
    """:func:`infer.kernels.lora_reference.lora_shrink` in Triton: ``x [T, in]``, ``lora_a [L, R, in]``,
    float32 ``out [T, R]`` (contiguous rows); its rows without an adapter are left as they were.

    With ``split_k`` > 1 (default: :func:`_split_k`, > 1 for a decode step's few rows) each row block's
    K columns are split among that many programs, which write float32 partial sums ``[split_k, T, R]``;
    the program that finishes a tile last (an arrival counter per tile, ``meta.split_counters``) adds them
    in split order (the same bits every run, unlike atomic adds into ``out``), so the expand reads one sum
    per row. Split-K is the usual cure for a GEMM whose M and N are too small to fill the GPU (CUTLASS,
    vLLM's LoRA shrink; the last-arriving reduction is CUTLASS's "serial" split-K). With
    ``meta.active_ranks`` only each slot's own rank of A's rows is read (of each part's ``part_rank`` rows
    when ``lora_a`` stacks a merged projection's parts; default: A's ``R``); the other columns of ``out``
    are zeros."""
    if out.stride(-1) != 1:
        raise ValueError("lora_shrink: out's last dimension must be contiguous")
    return _shrink(x, lora_a, meta, out, split_k, part_rank)


def _expand(t: torch.Tensor, lora_b: torch.Tensor, meta: LoRAKernelMeta, y: torch.Tensor,
            y_offset: int, part_starts: tuple[int, ...] = (0,)) -> torch.Tensor:
    """The expand launch over ``t`` (``[T, P R]``) and ``lora_b`` ``[L, N, R]``, whose columns from
    ``part_starts[i]`` on read columns ``i R ...`` of ``t`` (one part unless a merged projection's stacked B:
    at most 3 parts)."""
    _check(t, lora_b, "expand")
    if y.stride(-1) != 1:
        raise ValueError("lora_expand: y's last dimension must be contiguous")
    _, n, r = lora_b.shape
    bounds = [*part_starts[1:], n, n][:2]
    prefill = meta.num_tokens > 64
    # tiles measured on an H200 at Qwen3-8B's shapes, 8 adapters (ranks 8-64), each projection's expand alone:
    # 128 x 128 at a 2,048-row prefill chunk (gate/up > 143 -> 118 us, down > 37 -> 27, against 64 x 64), one
    # row block of 16 x 128 columns at a decode step of 32 rows (gate/up 21.4 -> 19.3 us)
    bm, bn, br = 128 if prefill else 16, _block_n(part_starts, n), max(16, min(64, triton.next_power_of_2(r)))
    grid = (triton.cdiv(meta.num_tokens, bm), triton.cdiv(n, bn), meta.active_slots.numel())
    ranks = meta.active_ranks
    _lora_expand_kernel[grid](t, lora_b, y, meta.sorted_rows, meta.slot_starts, meta.slot_counts, meta.active_slots,
                              ranks if ranks is not None else meta.slot_counts, n, r, y_offset, *bounds,
                              t.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                              BLOCK_R=br, IEEE=lora_b.dtype == torch.float32, HAS_RANKS=ranks is not None,
                              num_stages=1 if prefill else 3, **launch_options(y))
    return y


def _block_n(part_starts: tuple[int, ...], n: int) -> int:
    """128 columns a program, fewer (down to 16) if a part of a stacked B starts inside a 128-column tile."""
    bn = 128
    while bn > 16 and any(p % bn for p in part_starts):
        bn //= 2
    if any(p % bn for p in part_starts):
        raise ValueError(f"add_lora_stacked: the parts must start at multiples of 16 columns, got {part_starts}")
    return bn


def lora_expand(t: torch.Tensor, lora_b: torch.Tensor, meta: LoRAKernelMeta, y: torch.Tensor,
                y_offset: int = 0) -> torch.Tensor:
    """:func:`infer.kernels.lora_reference.lora_expand` as one Triton launch: float32 ``t [T, R]``,
    ``lora_b [L, out, R]``, ``y [T, N]`` updated in place at columns ``y_offset : y_offset + out``."""
    return _expand(t, lora_b, meta, y, y_offset)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             meta: LoRAKernelMeta, y_offset: int = 0, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`infer.kernels.lora_reference.add_lora`: shrink then expand, two launches."""
    if meta.num_lora_rows == 0:
        return y
    return _expand(_shrink(x, lora_a, meta, buffer, None), lora_b, meta, y, y_offset)


def add_lora_stacked(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     part_starts: tuple[int, ...], meta: LoRAKernelMeta) -> torch.Tensor:
    """:func:`infer.kernels.lora_reference.add_lora_stacked` in two launches: one shrink by every part's A,
    one expand over every part's B (each column tile finds its part from ``part_starts``)."""
    if meta.num_lora_rows == 0:
        return y
    if not 1 <= len(part_starts) <= 3 or part_starts[0] != 0:
        raise ValueError(f"add_lora_stacked: 1 to 3 parts starting at column 0, got {part_starts}")
    if lora_a.shape[1] != len(part_starts) * lora_b.shape[2]:
        raise ValueError(f"add_lora_stacked: A stacks {lora_a.shape[1]} rows for {len(part_starts)} parts of rank "
                         f"{lora_b.shape[2]}")
    return lora_expand_stacked(_shrink(x, lora_a, meta, None, None, lora_b.shape[2]), lora_b, part_starts, meta, y)


def lora_expand_stacked(t: torch.Tensor, lora_b: torch.Tensor, part_starts: tuple[int, ...], meta: LoRAKernelMeta,
                        y: torch.Tensor) -> torch.Tensor:
    """:func:`infer.kernels.lora_reference.lora_expand_stacked` as one launch (each column tile finds its part
    from ``part_starts``)."""
    return _expand(t, lora_b, meta, y, 0, part_starts)


def lora_shrink_row(x: torch.Tensor, lora_a: torch.Tensor, slot: torch.Tensor, residual: torch.Tensor | None = None,
                    norm_weight: torch.Tensor | None = None, eps: float = 0.0, unit_offset: bool = False,
                    rank: torch.Tensor | None = None, part_rank: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shrink of one row (batch-1 decode), optionally after the norm before the projection, in one launch:
    the ``t`` a :class:`~infer.kernels.skinny_gemm.LoRAEpilogue` adds in the projection that follows.

    ``s = x + residual`` rounded (``x`` without a residual), ``h = rms_norm(s) * norm_weight`` with
    :func:`infer.kernels.fused_triton.rms_norm`'s roundings (``h = x`` without ``norm_weight``), and
    ``t = h A_slot^T`` in float32. One program per one or two rows of A, each a whole dot product over ``K``
    (a decode step's ``P R`` is 16-192 rows: enough programs, and none waits for another's partial sum).

    Args:
        x: ``[1, K]``, last dimension contiguous. residual: ``[1, K]`` or None (only with ``norm_weight``).
        lora_a: ``[L, P R, K]``: the slots' A (a merged projection's parts stacked).
        slot: int32 on the device, ``slot[0]`` the row's slot (-1: no adapter; ``t`` is then slot 0's, which
            the epilogue does not add).
        norm_weight: ``[K]`` or None; eps, unit_offset: as in ``rms_norm``.
        rank: int32 on the device, ``rank[0]`` the slot's adapter rank (a one-row step's
            :class:`~infer.kernels.lora_reference.LoRAKernelMeta` ``active_ranks``, beside ``active_slots``):
            A's rows past it (in each part of ``part_rank`` rows; default ``P R``) are not read, and ``t`` is 0
            there; None: every row is read.

    Returns:
        ``(t, h, s)``: float32 ``t [1, P R]``, the normalized row ``h`` (a new ``[1, K]`` tensor; ``x`` itself
        without a norm) and the new residual stream ``s`` (a new tensor with a residual, else ``x``).

    Raises:
        ValueError: not one row, a residual without a norm, shapes or dtypes that do not fit.
    """
    if x.dim() != 2 or x.shape[0] != 1 or lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1] or x.stride(1) != 1:
        raise ValueError(f"lora_shrink_row takes one row [1, K] and A [L, PR, K], got {tuple(x.shape)} and "
                         f"{tuple(lora_a.shape)}")
    if residual is not None and (norm_weight is None or residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError("lora_shrink_row: a residual goes with a norm weight, shaped like x")
    if lora_a.stride(2) != 1 or slot.dtype != torch.int32:
        raise ValueError("lora_shrink_row: A's last dimension must be contiguous and the slot int32")
    _, pr, k = lora_a.shape
    k_pad = triton.next_power_of_2(k)
    block_r = 2 if pr >= 64 else 1  # (QKV's 3 R rows at rank 32 and more: 2 rows a program)
    norm = 0 if norm_weight is None else 1 if residual is None else 2
    t = torch.empty(1, pr, dtype=torch.float32, device=x.device)
    h = torch.empty_like(x) if norm else x
    s = torch.empty_like(x) if norm == 2 else x
    _lora_shrink_row_kernel[(triton.cdiv(pr, block_r),)](
        x, residual if residual is not None else x, s, norm_weight if norm else x, h, lora_a, slot,
        rank if rank is not None else slot, t, k, pr, part_rank or pr, eps, lora_a.stride(0),
        lora_a.stride(1), NORM=norm, UNIT_OFFSET=bool(unit_offset), MANUAL_BF16=manual_bf16(x), BLOCK_R=block_r,
        K_PAD=k_pad, HAS_RANKS=rank is not None, num_warps=4 if k_pad <= 4096 else 8, **launch_options(x))
    return t, h, s
