"""Skinny GEMM: ``y = x @ W^T`` for a handful of rows of ``x`` (decode at small batch), in Triton.

At batch 1 to 8 a decoder layer's projections are matrix-vector products: every weight byte is read
once and used for one to eight multiply-adds, so the time is the weight's bytes over the memory
bandwidth, plus whatever latency the kernel cannot hide. cuBLAS picks tile shapes made for matrices
and, at Qwen3-0.6B's sizes (4-12 MB per projection), reaches about a quarter to a third of an H200's
bandwidth (measured: ``benchmarks/skinny_gemm.py``). Kernels written for the skinny case (vLLM's
``wvSplitK`` on ROCm, the GEMV paths of llama.cpp and TensorRT-LLM) give each program a few output
features and stream their whole rows of ``W``: many programs in flight, 16-byte loads along ``K``,
a reduction per output and nothing else.

:func:`skinny_linear` is that kernel; :func:`skinny_linear_reference` computes the same function in
plain PyTorch (float32 accumulation, one rounding to the output dtype). With ``fused_kernels`` the
model layers call it through :func:`linear` for the projections where it beats cuBLAS
(:func:`use_skinny`: one row, narrow or very wide outputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from infer.kernels import activations, fused_reference
from infer.kernels.pdl import launch_options, wait_for_previous
from infer.kernels.triton_common import (
    INTERPRET,
    manual_bf16,
    rank_in_sectors,
    round_to,
    silu_or_gelu_tanh,
    sm_count,
)

MAX_ROWS = 8  # the most rows skinny_linear takes


@triton.jit
def row_squares(x_rows, r_rows, r_out_rows, k, m_mask, K, pid, NORM: tl.constexpr, DTYPE: tl.constexpr,
             MANUAL_BF16: tl.constexpr):
    """The squares of columns ``k`` of the rows of x (NORM 2: of x + residual rounded to ``DTYPE``, which
    program 0 also stores in ``r_out``, the new residual stream), ``[M_PAD, len(k)]`` float32; 0 where masked."""
    mk = m_mask[:, None] & (k < K)[None, :]
    s = tl.load(x_rows + k[None, :], mask=mk, other=0.0).to(tl.float32)
    if NORM == 2:
        s = round_to(s + tl.load(r_rows + k[None, :], mask=mk, other=0.0).to(tl.float32), DTYPE, MANUAL_BF16)
        if pid == 0:
            tl.store(r_out_rows + k[None, :], s, mask=mk)
        s = s.to(tl.float32)
    return s * s


@triton.jit
def x_slice(x_rows, r_rows, nw_ptr, rstd, k, m_mask, K, NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
             DTYPE: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """Columns ``k`` of the rows of x as the product reads them, ``[M_PAD, len(k)]`` float32 (0 where masked):
    with NORM, ``rms_norm``'s rounding steps (fused_triton._rms_norm_row) on them (NORM 2: on x + residual)."""
    k_mask = k < K
    mk = m_mask[:, None] & k_mask[None, :]
    xk = tl.load(x_rows + k[None, :], mask=mk, other=0.0).to(tl.float32)
    if NORM:
        if NORM == 2:
            xk = round_to(xk + tl.load(r_rows + k[None, :], mask=mk, other=0.0).to(tl.float32), DTYPE,
                        MANUAL_BF16).to(tl.float32)
        nw = tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        h = xk * rstd[:, None]
        if UNIT_OFFSET:
            xk = round_to(h * (1.0 + nw), DTYPE, MANUAL_BF16).to(tl.float32)
        else:
            xk = round_to(round_to(h, DTYPE, MANUAL_BF16).to(tl.float32) * nw, DTYPE, MANUAL_BF16).to(tl.float32)
    return xk


@triton.jit
def _lora_b_tile(cols, n_mask, lora, j, LORA_RANKS: tl.constexpr):
    """The row's slot's B at output columns ``cols`` and columns ``j`` of ``t``, ``[BLOCK_N, len(j)]``: element
    ``(n, j)`` is ``B[slot, n, j - part(n) R]`` inside column ``n``'s part's ``R`` columns of ``t``, else 0.

    ``lora`` = ``(t_ptr, b_ptr, slot_ptr, rank_ptr, R, PR, P1, P2, stride_bl, stride_bn)``: ``t`` the shrink's
    float32 ``[PR]`` (``PR = P R``, ``P`` parts), ``B [L, N, R]`` (a merged projection's parts stacked: column
    ``n``'s part is ``(n >= P1) + (n >= P2)``), the row's slot read on the device (a CUDA graph's input), and
    with ``LORA_RANKS`` the slot's rank, loaded beside the slot (B's columns past it are padding: not read).
    Neither B, the slot nor the rank are written by a kernel of the step: this may run before the PDL wait."""
    t_ptr, b_ptr, slot_ptr, rank_ptr, R, PR, P1, P2, stride_bl, stride_bn = lora
    slot = tl.load(slot_ptr)
    rank = R
    if LORA_RANKS:
        rank = tl.minimum(rank_in_sectors(tl.load(rank_ptr)), R)
    part = (cols >= P1).to(tl.int32) + (cols >= P2).to(tl.int32)
    r = j[None, :] - (part * R)[:, None]  # column j of t is rank r of column n's part
    return tl.load(b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bl + cols.to(tl.int64)[:, None] * stride_bn + r,
                   mask=n_mask[:, None] & (r >= 0) & (r < rank) & (slot >= 0), other=0.0)


@triton.jit
def _lora_terms(lora, j, b):
    """``t[j] * b[:, j]`` as ``[1, BLOCK_N, len(j)]`` float32 products: the LoRA delta's terms, added to the
    accumulator like more columns of K (its one reduction over K sums them with the product's). ``t`` is
    rounded to B's dtype first, as the expand kernel rounds it."""
    t_ptr, b_ptr, PR = lora[0], lora[1], lora[5]
    t = tl.load(t_ptr + j, mask=j < PR, other=0.0).to(b_ptr.dtype.element_ty).to(tl.float32)
    return (t[None, :] * b.to(tl.float32))[None, :, :]


@triton.jit
def _add_lora(acc, acc_u, b, b_u, offs_n, n_mask, offs_k, N, lora, ACT: tl.constexpr, LORA_CHUNKS: tl.constexpr,
              BLOCK_K: tl.constexpr, LORA_RANKS: tl.constexpr, LOADED: tl.constexpr):
    """The accumulators of a row block (gate and up with ACT) with the LoRA delta's terms added: with ``LOADED``
    from ``b`` (``b_u``), B's tiles loaded before the PDL wait (``PR`` fits one ``BLOCK_K``), else from B loaded
    here in ``LORA_CHUNKS`` slices of ``BLOCK_K`` columns of ``t``."""
    if LOADED:
        acc += _lora_terms(lora, offs_k, b)
        if ACT:
            acc_u += _lora_terms(lora, offs_k, b_u)
    else:
        for c in tl.static_range(LORA_CHUNKS):
            j = c * BLOCK_K + offs_k
            acc += _lora_terms(lora, j, _lora_b_tile(offs_n, n_mask, lora, j, LORA_RANKS))
            if ACT:
                acc_u += _lora_terms(lora, j, _lora_b_tile(N + offs_n, n_mask, lora, j, LORA_RANKS))
    return acc, acc_u


@triton.jit
def _store_outputs(acc, acc_u, offs_n, n_mask, offs_m, m_mask, b_ptr, add_ptr, y_ptr, N, stride_am, stride_ym,
                   HAS_BIAS: tl.constexpr, ACT: tl.constexpr, ADD: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """The epilogue of one row block: reduce the ``[M_PAD, BLOCK_N, BLOCK_K]`` sums over K, then bias, activation
    and residual add as the kernel's flags say, rounded as the unfused layers round, and store ``y``."""
    dtype = y_ptr.dtype.element_ty
    y = tl.sum(acc, 2)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if ACT:  # the projection's outputs are rounded to the dtype first, as the unfused MLP's are
        g = round_to(y, dtype, MANUAL_BF16).to(tl.float32)
        up = tl.sum(acc_u, 2)
        if HAS_BIAS:
            up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = silu_or_gelu_tanh(g, ACT == 2) * round_to(up, dtype, MANUAL_BF16).to(tl.float32)
    if ADD:  # rounded as the unfused `linear(x) + residual` is: the product, then the sum. Loaded here, not
        # before the loop: held through it, the two values per program cost o and down 2.3 us per call on an
        # H200; here 0.2-0.3 us.
        y = round_to(y, dtype, MANUAL_BF16).to(tl.float32) + tl.load(
            add_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :],
            mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, round_to(y, dtype, MANUAL_BF16), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, r_ptr, r_out_ptr, nw_ptr, w_ptr, b_ptr, add_ptr, y_ptr, M, N, K, stride_xm, stride_rm, stride_om,
    stride_wn, stride_am, stride_ym, up_offset, eps,
    t_ptr, lb_ptr, slot_ptr, rank_ptr, lora_r, lora_pr, lora_p1, lora_p2, stride_bl, stride_bn,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr, ACT: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr,
    MANUAL_BF16: tl.constexpr, NORM_K_PAD: tl.constexpr, STAGES: tl.constexpr, PERSISTENT: tl.constexpr,
    X_AHEAD: tl.constexpr, LORA_CHUNKS: tl.constexpr, LORA_RANKS: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK_N),): program j computes outputs [j * BLOCK_N, (j + 1) * BLOCK_N) of every row
    # of x, walking K in BLOCK_K slices: the [BLOCK_N, BLOCK_K] tile of W (contiguous along K) is read
    # once and multiplied by the same slice of each of the M rows of x; the products are summed per
    # element and reduced over K once, at the end. STAGES 0: the next tile is loaded into registers before
    # the current one is used (two tiles in flight per program); STAGES S >= 2: Triton's pipeliner keeps
    # S - 1 tiles in flight through shared memory (more bytes in flight per SM, for the long weight streams).
    #   NORM 1: x is replaced by rms_norm(x) * norm weight (the norm before a projection); NORM 2: by
    #     rms_norm(x + residual), and program 0 stores x + residual (the new residual stream) in r_out.
    #     Each program computes the rows' mean squares itself (a first pass over x: K values per row,
    #     from L2: the whole padded rows in one load (NORM_K_PAD > 0) where they fit, else BLOCK_K at a time),
    #     then the normalized slices as it goes: no kernel of its own, no tensor in between.
    #   ACT 1 (SiLU) / 2 (GELU-tanh): W is a merged gate/up weight of 2N rows; program j also reads the
    #     up rows N + j * BLOCK_N ... and stores act(gate) * up (the MLP's activation, no kernel of its own).
    #   ADD: the outputs, rounded, plus the same outputs of add ([M, N], the residual stream), rounded
    #     again: the block's residual add in the epilogue (the next norm then reads one row, not two).
    #   USE_PDL: the first weight tiles, which no kernel writes, are loaded before waiting for the
    #     previous kernel (infer.kernels.pdl): the weight stream starts while that kernel finishes.
    #   PERSISTENT (STAGES 0 only): a grid of P < cdiv(N, BLOCK_N) programs; program j computes row blocks
    #     j, j + P, j + 2P, ..., and the last K step of each loads the next one's first tile, so a program's
    #     weight stream does not stop between its row blocks (see persistent_programs).
    #   X_AHEAD (STAGES 0, one program per row block): x's next slice is loaded with the next weight tile,
    #     not at the top of its step (see x_ahead).
    #   LORA_CHUNKS > 0 (one row): the row's LoRA delta t B^T (see skinny_linear's lora) enters the accumulator
    #     as PR more terms of the sum over K, before the loop (B's tile loaded before the PDL wait, t after
    #     it): no reduction of its own, one rounding; LORA_CHUNKS slices of BLOCK_K when PR > BLOCK_K.
    pid = tl.program_id(0)
    lora = (t_ptr, lb_ptr, slot_ptr, rank_ptr, lora_r, lora_pr, lora_p1, lora_p2, stride_bl, stride_bn)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = w_rows + up_offset  # the up rows (ACT only): N rows further
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    u = w
    if ACT:
        u = tl.load(u_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    lora_b = w
    lora_bu = w
    if LORA_CHUNKS == 1:  # B's tiles too (no kernel writes them): the chain slot -> B is off the path
        if not PERSISTENT:
            lora_b = _lora_b_tile(offs_n, n_mask, lora, offs_k, LORA_RANKS)
            if ACT:
                lora_bu = _lora_b_tile(N + offs_n, n_mask, lora, offs_k, LORA_RANKS)
    wait_for_previous(USE_PDL)

    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    r_rows = r_ptr + offs_m.to(tl.int64)[:, None] * stride_rm
    dtype = y_ptr.dtype.element_ty
    rstd = tl.zeros([M_PAD], dtype=tl.float32)
    if NORM:  # the rows' mean squares
        r_out_rows = r_out_ptr + offs_m.to(tl.int64)[:, None] * stride_om
        if NORM_K_PAD:  # the whole padded rows in one load: one trip to L2, not one per slice
            sq = row_squares(x_rows, r_rows, r_out_rows, tl.arange(0, NORM_K_PAD), m_mask, K, pid, NORM, dtype,
                          MANUAL_BF16)
        else:  # BLOCK_K columns at a time
            sq = tl.zeros([M_PAD, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                sq += row_squares(x_rows, r_rows, r_out_rows, k0 + offs_k, m_mask, K, pid, NORM, dtype, MANUAL_BF16)
        rstd = tl.rsqrt(tl.sum(sq, 1) / K + eps)

    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = acc
    if ACT:
        acc_u = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PERSISTENT:  # row blocks pid, pid + P, ...; the norm's mean squares above were computed once for all
        P = tl.num_programs(0)
        for block in range(pid, tl.cdiv(N, BLOCK_N), P):
            offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
            n_next = offs_n + P * BLOCK_N  # the next row block's
            next_rows = w_ptr + n_next.to(tl.int64)[:, None] * stride_wn
            acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
            if ACT:
                acc_u = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
            if LORA_CHUNKS:  # this row block's B, loaded here
                acc, acc_u = _add_lora(acc, acc_u, lora_b, lora_bu, offs_n, n_mask, offs_k, N, lora, ACT, LORA_CHUNKS,
                                       BLOCK_K, LORA_RANKS, False)
            for k0 in range(0, K, BLOCK_K):  # as the STAGES 0 loop below, but the last step's "next tile" is
                k = k0 + offs_k  # the first of the next row block
                xk = x_slice(x_rows, r_rows, nw_ptr, rstd, k, m_mask, K, NORM, UNIT_OFFSET, dtype, MANUAL_BF16)
                last = k0 + BLOCK_K >= K
                kn = tl.where(last, offs_k, k + BLOCK_K)
                base = tl.where(last, next_rows, w_rows)
                next_mask = (tl.where(last, n_next, offs_n) < N)[:, None] & (kn < K)[None, :]
                w_next = tl.load(base + kn[None, :], mask=next_mask, other=0.0)
                acc += xk[:, None, :] * w.to(tl.float32)[None, :, :]
                w = w_next
                if ACT:
                    u_next = tl.load(base + up_offset + kn[None, :], mask=next_mask, other=0.0)
                    acc_u += xk[:, None, :] * u.to(tl.float32)[None, :, :]
                    u = u_next
            _store_outputs(acc, acc_u, offs_n, n_mask, offs_m, m_mask, b_ptr, add_ptr, y_ptr, N, stride_am,
                           stride_ym, HAS_BIAS, ACT, ADD, MANUAL_BF16)
    else:  # one program per row block
        if LORA_CHUNKS:
            acc, acc_u = _add_lora(acc, acc_u, lora_b, lora_bu, offs_n, n_mask, offs_k, N, lora, ACT, LORA_CHUNKS,
                                   BLOCK_K, LORA_RANKS, LORA_CHUNKS == 1)
        if STAGES == 0:  # one tile ahead, in registers: the next tile is loaded before the current one is used
            if X_AHEAD:  # and x's next slice with it (see x_ahead)
                xk = x_slice(x_rows, r_rows, nw_ptr, rstd, offs_k, m_mask, K, NORM, UNIT_OFFSET, dtype, MANUAL_BF16)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                kn = k + BLOCK_K
                if X_AHEAD:
                    xk_next = x_slice(x_rows, r_rows, nw_ptr, rstd, kn, m_mask, K, NORM, UNIT_OFFSET, dtype,
                                       MANUAL_BF16)
                else:
                    xk = x_slice(x_rows, r_rows, nw_ptr, rstd, k, m_mask, K, NORM, UNIT_OFFSET, dtype, MANUAL_BF16)
                next_mask = n_mask[:, None] & (kn < K)[None, :]
                w_next = tl.load(w_rows + kn[None, :], mask=next_mask, other=0.0)
                acc += xk[:, None, :] * w.to(tl.float32)[None, :, :]
                w = w_next
                if ACT:
                    u_next = tl.load(u_rows + kn[None, :], mask=next_mask, other=0.0)
                    acc_u += xk[:, None, :] * u.to(tl.float32)[None, :, :]
                    u = u_next
                if X_AHEAD:
                    xk = xk_next
        else:  # STAGES - 1 tiles ahead: Triton's pipeliner copies them into shared memory (cp.async) while the
            # loop works; the first tile (loaded before the wait) is used last
            for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
                k = k0 + offs_k
                xk = x_slice(x_rows, r_rows, nw_ptr, rstd, k, m_mask, K, NORM, UNIT_OFFSET, dtype, MANUAL_BF16)
                tile_mask = n_mask[:, None] & (k < K)[None, :]
                acc += xk[:, None, :] * tl.load(w_rows + k[None, :], mask=tile_mask, other=0.0).to(tl.float32)[None, :, :]
                if ACT:
                    acc_u += xk[:, None, :] * tl.load(u_rows + k[None, :], mask=tile_mask,
                                                      other=0.0).to(tl.float32)[None, :, :]
            xk = x_slice(x_rows, r_rows, nw_ptr, rstd, offs_k, m_mask, K, NORM, UNIT_OFFSET, dtype, MANUAL_BF16)
            acc += xk[:, None, :] * w.to(tl.float32)[None, :, :]
            if ACT:
                acc_u += xk[:, None, :] * u.to(tl.float32)[None, :, :]
        _store_outputs(acc, acc_u, offs_n, n_mask, offs_m, m_mask, b_ptr, add_ptr, y_ptr, N, stride_am, stride_ym,
                       HAS_BIAS, ACT, ADD, MANUAL_BF16)


def default_config(m: int, n: int, k: int, act: bool = False, norm: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, STAGES)`` for ``m`` rows and a ``[n, k]`` weight (``act``: a merged
    gate/up weight whose ``n`` output pairs are read as two tiles; ``norm``: the projection right after a
    norm, QKV or gate/up, whether the norm is computed in the kernel (:func:`skinny_norm_linear`) or by
    its own kernel just before (what the engine does, :func:`infer.kernels.fused_triton.add_rms_norm_linear`)).

    The products are summed per element in a ``[M_PAD, BLOCK_N, BLOCK_K]`` float32 tile, in registers,
    and reduced once at the end. One row (what the engine uses): two outputs per program and 8 weights
    of each row per thread per step, i.e. many small programs, which spread the weight stream over every
    SM and start it soonest; longer steps along longer rows. These are the best tiles of
    ``benchmarks/skinny_gemm.py --tune --pdl`` at Qwen3-4B's shapes on an H100 (1.1-1.5x cuBLAS),
    or within 3% of the best. After the norm (no activation) with rows of K >= 2,048 (QKV): a one-warp tile,
    (2, 256, 1), whose register loop loads x's next slice ahead (:func:`x_ahead`): 8 weights of each row per
    thread per step, the most and smallest programs. Measured in the engine on an H200 (Qwen3-4B,
    ms per token, alternated): 2.67-2.68 -> 2.63-2.64 against the 8-output (8, 256, 8) it replaced (which
    had been the best of three when x was loaded at the top of each step: (2, 512, 2) 2.73,
    (4, 512, 4, 3) 2.71-2.72); (2, 512, 1) 2.71, (4, 256, 1) 2.67, (2, 512, 2) with x ahead 2.71. Qwen3-0.6B's
    QKV of K = 1,024 keeps the plain tile (2, 512, 2) (0.941-0.944 against 0.950-0.951 at (8, 256, 8)).
    Not measured on an H100, nor on other models' QKV. More rows: BLOCK_K shrinks.

    STAGES: one tile ahead in registers (0) everywhere but the weights of :data:`PIPELINE_ELEMENTS` or
    more (the LM head, a large gate/up), which keep :data:`PIPELINE_STAGES` - 1 tiles in flight through
    shared memory. A one-wave projection is slower that way (its loads wait on the extra trip through
    shared memory, with no later wave to hide it); a stream of many waves needs the bytes in flight
    (H100, us per call: Qwen3-4B's gate/up 39.5 -> 38.0, Qwen3-8B's 77.0 -> 69.8 and its down
    39.0 -> 38.0, Qwen3-0.6B's LM head 117 -> 102; Qwen3-4B's QKV, o and down 0.3-1.8 us slower).
    """
    if INTERPRET:
        return 8, 32, 1, 0
    if m <= 1:
        stages = PIPELINE_STAGES if n * k * (2 if act else 1) >= PIPELINE_ELEMENTS else 0
        if norm and not act and k >= 2048:
            return 2, 256, 1, stages
        return ((2, 512, 2) if k < 4096 else (2, 1024, 4) if k < 8192 else (2, 2048, 8)) + (stages,)
    m_pad = triton.next_power_of_2(m)
    return 8, max(64, 512 // m_pad), 4, 0


def after_norm_config(weight: torch.Tensor, activation: str | None = None) -> tuple[int, int, int, int]:
    """:func:`default_config` of a one-row projection right after its norm (QKV, or gate/up with its
    ``activation``): the tile :func:`infer.kernels.fused_triton.add_rms_norm_linear` launches ``weight``
    (``[N, K]``; a merged gate/up's ``N / 2`` outputs with an activation) with."""
    n, k = weight.shape
    return default_config(1, n // 2 if activation else n, k, act=activation is not None, norm=True)


#: one-row weights of at least this many elements are streamed with Triton's pipeliner (default_config)
PIPELINE_ELEMENTS = 40 << 20
PIPELINE_STAGES = 3


#: the norm's first pass loads whole rows of x at once when that is at most this many values per thread
NORM_ONE_LOAD_PER_THREAD = 16

#: programs per SM of a persistent grid (persistent_programs)
PERSISTENT_PROGRAMS_PER_SM = 6


def persistent_programs(m: int, n: int, config: tuple[int, int, int, int], norm: bool, act: bool,
                        device: torch.device) -> int:
    """The number of programs of a persistent grid for this product (the kernel's ``PERSISTENT``: each program
    computes every P-th row block and streams its weights without a stop between them), or 0 for one
    program per row block.

    Persistent: one row, no norm, no activation, the register loop of 8 warps (K >= 8192: only 4 such
    programs fit an SM, so one program per row block takes several waves), on a CUDA device, when there
    are more row blocks than :data:`PERSISTENT_PROGRAMS_PER_SM` per SM. Measured in a chain of 36 Qwen3-4B
    layers' projections with PDL on an H100: its
    down projection (1,280 row blocks, 2.4 waves) 0.8 us a layer faster at 6 programs an SM (4: no
    faster; 8: 0.5 us); the persistent grid lost everywhere else, by 0.3-5 us (o, QKV and gate/up, either
    K loop, with the loop over (row block, K slice) flattened into one as well).
    """
    block_n, _, warps, stages = config
    if m != 1 or norm or act or stages or warps < 8 or device.type != "cuda" or INTERPRET:
        return 0
    programs = PERSISTENT_PROGRAMS_PER_SM * sm_count(device)
    return programs if triton.cdiv(n, block_n) > programs else 0


#: the register loop loads x's next slice ahead in tiles of at most this many warps (x_ahead)
X_AHEAD_MAX_WARPS = 2


def x_ahead(stages: int, programs: int, warps: int) -> bool:
    """Whether the kernel's register loop (STAGES 0, one program per row block) loads x's next slice
    together with the next weight tile (the kernel's ``X_AHEAD``), instead of at the top of each step.

    Each step's slice of x comes from L2 (the previous kernel wrote it); loaded at the top of the step,
    its round trip is paid before the step's products, and by the first programs of an SM on every step.
    Loaded ahead it travels with the weights. Measured in the engine on an H200 (batch 1,
    every phase 8-9 flag and ``pdl``, alternated, with the attention's unrolled merge), ms per token:
    Qwen3-0.6B, whose QKV, o, gate/up and down all take the two-warp tile (2, 512, 2), 0.937 -> 0.876;
    Qwen3-4B's QKV at (8, 256, 8) 2.67 either way, its o at (2, 1024, 4) 2.67 -> 2.71, its persistent
    down at (2, 2048, 8) 2.67 -> 2.71, its o at (2, 512, 2) with x ahead 2.69. So: only tiles of at most
    :data:`X_AHEAD_MAX_WARPS` warps, among them the one-warp tile Qwen3-4B's QKV now takes (2.67 -> 2.63-2.64,
    see :func:`default_config`)."""
    return stages == 0 and not programs and warps <= X_AHEAD_MAX_WARPS


def _norm_k_pad(m: int, k: int, warps: int) -> int:
    """The rows' padded width when the norm's first pass (their mean squares) loads the whole ``[M, K]``
    rows at once (the kernel's ``NORM_K_PAD``), else 0 (one ``BLOCK_K`` slice at a time).

    One load is one trip to L2 instead of ``K / BLOCK_K`` trips one after the other, before any product
    can start; but it holds ``M_PAD * K_PAD / threads`` values per thread at once. Measured on an H200
    (with PDL): up to 16 values per thread it is faster (Qwen3-4B norm + QKV 12.3 -> 11.6 us,
    Qwen3-0.6B norm + QKV 6.26 -> 5.76 and norm + gate/up + SiLU 7.17 -> 6.84), at 64 (Qwen3-4B's gate/up
    tile of 2 warps) slower (31.3 -> 31.6 us): the registers it holds cost the weight stream occupancy."""
    k_pad = triton.next_power_of_2(k)
    return k_pad if triton.next_power_of_2(m) * k_pad <= NORM_ONE_LOAD_PER_THREAD * 32 * warps else 0


def use_skinny(m: int, n: int) -> bool:
    """Does :func:`skinny_linear` beat cuBLAS for ``m`` rows and ``n`` outputs?

    At one row, everywhere measured: on an H100 (``benchmarks/skinny_gemm.py --tune --pdl``)
    1.08-1.47x at every Qwen3-4B projection and 1.24x on its LM head (cuBLAS splits K on the narrow
    ones and reaches 1.7-2.5 TB/s); on an H200 (an earlier version of the kernel) 1.4-3.1x on
    Qwen3-0.6B's narrow projections. From two rows on this kernel (a broadcast and a sum, no tensor
    cores) falls behind.
    """
    return m == 1


def check_skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        residual: torch.Tensor | None = None, activation: str | None = None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K] with the same K, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {x.shape[0]}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) differ")
    if x.shape[1] > 1 and (x.stride(1) != 1 or weight.stride(1) != 1):
        raise ValueError(f"x and weight need a contiguous last dimension (strides {x.stride()}, {weight.stride()})")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] in {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(str, ACTIVATIONS))}, got {activation!r}")
    if activation is not None and weight.shape[0] % 2:
        raise ValueError(f"a gate/up weight has an even number of rows (gate, then up), got {weight.shape[0]}")
    if activation is not None and residual is not None:
        raise ValueError("an activation and a residual add in one epilogue are not supported")
    _check_residual(residual, (x.shape[0], weight.shape[0]), x, "the output")


def _check_residual(residual: torch.Tensor | None, shape: tuple[int, int], x: torch.Tensor, like: str) -> None:
    """A residual (None, or ``shape`` in ``x``'s dtype and device with a contiguous last dimension)."""
    if residual is not None and (residual.shape != shape or residual.dtype != x.dtype or residual.device != x.device
                                 or (shape[1] > 1 and residual.stride(1) != 1)):
        raise ValueError(f"residual must be like {like} ({shape}, {x.dtype}, {x.device}, last dimension "
                         f"contiguous), got {tuple(residual.shape)}, {residual.dtype}, {residual.device}")


ACTIVATIONS = {None: 0, "silu": 1, "gelu_tanh": 2, "gelu_pytorch_tanh": 2}  # the kernel's ACT


@dataclass(frozen=True)
class LoRAEpilogue:
    """One row's LoRA delta, added by :func:`skinny_linear` (phase 16's batch-1 decode: no expand kernel of
    its own).

    Attributes:
        t: float32 ``[1, P R]``: ``x A_slot^T`` for ``P`` parts of rank ``R``
            (:func:`infer.kernels.lora_triton.lora_shrink_row`), rounded to ``lora_b``'s dtype by the kernel
            (as the expand kernel rounds it).
        lora_b: ``[L, N, R]``: the slots' B (scale folded in), ``N`` the weight's rows; a merged projection's
            parts stacked, part ``i`` from row ``part_starts[i]`` on, reading columns ``i R ...`` of ``t``.
        slot: int32 on the device: ``slot[0]`` the row's slot (-1: no adapter), read by the kernel (a CUDA
            graph's input, never a launch argument).
        part_starts: the parts' first rows of ``lora_b``, ascending from 0; at most 3 parts.
        rank: int32 on the device, ``rank[0]`` the slot's adapter rank (B's columns past it are padding, not
            read; a one-row step's ``LoRAKernelMeta.active_ranks``), or None (all ``R`` read).
    """

    t: torch.Tensor
    lora_b: torch.Tensor
    slot: torch.Tensor
    part_starts: tuple[int, ...] = (0,)
    rank: torch.Tensor | None = None

    def check(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        """Raise ``ValueError`` unless this delta fits one row ``x`` and ``weight [N, K]``."""
        rows, pr = self.t.shape if self.t.dim() == 2 else (0, 0)
        nb = self.lora_b.shape[1] if self.lora_b.dim() == 3 else -1
        if (x.shape[0] != 1 or self.t.dtype != torch.float32 or rows != 1 or nb != weight.shape[0]
                or pr != len(self.part_starts) * self.lora_b.shape[2] or self.lora_b.stride(2) != 1
                or not 1 <= len(self.part_starts) <= 3 or self.part_starts[0] != 0 or self.slot.dtype != torch.int32
                or self.t.stride(1) != 1):
            raise ValueError(
                f"a LoRA epilogue takes one row, float32 t [1, P R], B [L, {weight.shape[0]}, R] and an int32 slot, "
                f"1-3 parts from row 0; got {tuple(x.shape)} rows, t {tuple(self.t.shape)} {self.t.dtype}, "
                f"B {tuple(self.lora_b.shape)}, slot {self.slot.dtype}, parts {self.part_starts}")

    def args(self) -> tuple:
        """The kernel's ``t_ptr ... stride_bn`` arguments."""
        bounds = [*self.part_starts[1:], 1 << 30, 1 << 30][:2]
        rank = self.rank if self.rank is not None else self.slot
        return (self.t, self.lora_b, self.slot, rank, self.lora_b.shape[2], self.t.shape[1], *bounds,
                self.lora_b.stride(0), self.lora_b.stride(1))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int,
            config: tuple[int, ...] | None, residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0, unit_offset: bool = False,
            act: int = 0, add: torch.Tensor | None = None, lora: LoRAEpilogue | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the kernel for ``n`` outputs per row; returns ``(y [M, n], new residual or None)``."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    norm = 0 if norm_weight is None else 1 if residual is None else 2
    r_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if norm == 2 else None
    if m == 0:
        return y, r_out
    block_n, block_k, warps, *rest = config or default_config(m, n, k, act=bool(act), norm=norm > 0)
    stages = rest[0] if rest else 0
    programs = rest[1] if len(rest) > 1 else persistent_programs(m, n, (block_n, block_k, warps, stages), norm > 0,
                                                                 bool(act), x.device)
    if programs and stages:
        raise ValueError(f"a persistent grid ({programs} programs) takes the register loop (STAGES 0), got {stages}")
    r = residual if residual is not None else x
    _skinny_gemm_kernel[(programs or triton.cdiv(n, block_n),)](
        x, r, r_out if r_out is not None else y, norm_weight if norm else weight, weight,
        bias if bias is not None else weight, add if add is not None else y, y, m, n, k, x.stride(0), r.stride(0),
        r_out.stride(0) if r_out is not None else 0, weight.stride(0), add.stride(0) if add is not None else 0,
        y.stride(0), n * weight.stride(0) if act else 0, eps, *(lora.args() if lora is not None else (y,) * 4 + (0,) * 6),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        NORM=norm, UNIT_OFFSET=bool(unit_offset), ACT=act, ADD=add is not None, MANUAL_BF16=manual_bf16(x),
        num_warps=warps,
        NORM_K_PAD=norm and _norm_k_pad(m, k, warps), STAGES=stages, PERSISTENT=programs > 0,
        X_AHEAD=x_ahead(stages, programs, warps),
        LORA_CHUNKS=triton.cdiv(lora.t.shape[1], block_k) if lora is not None else 0,
        LORA_RANKS=lora is not None and lora.rank is not None, **launch_options(x),
    )
    return y, r_out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, ...] | None = None, residual: torch.Tensor | None = None,
                  activation: str | None = None, lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``M <= MAX_ROWS`` rows, accumulated in float32, rounded once; with a
    ``residual``, that rounded product plus ``residual``, rounded again (the values of ``linear(x) +
    residual``: a block's last projection and its residual add in one kernel); with an ``activation``
    (``weight`` a merged gate/up ``[2 I, K]``), ``act(gate) * up`` of the product's rounded halves, rounded
    once (the values of :func:`~infer.kernels.fused_triton.act_and_mul` after the projection: the MLP's
    activation in the epilogue, ``[M, I]``). With ``lora`` (one row), the row's LoRA delta ``t B_slot^T`` is
    summed with the product in float32 before its one rounding (then the activation or the residual add): the
    expand needs no kernel of its own, and its terms no reduction of their own (the unfused ops round the
    product, then the sum with the delta: within a rounding of these values).

    Launched with programmatic dependent launch inside an enabled :func:`infer.kernels.pdl.scope`
    (the first weight tiles are loaded before the previous kernel has finished).

    Args:
        x: ``[M, K]``, last dimension contiguous (rows may be strided).
        weight: ``[N, K]`` (an ``nn.Linear``'s), last dimension contiguous, ``x``'s dtype and device.
        bias: ``[N]`` or None.
        config: ``(BLOCK_N, BLOCK_K, num_warps)``, ``(BLOCK_N, BLOCK_K, num_warps, STAGES)`` (STAGES 0 when
            left out) or ``(..., STAGES, PROGRAMS)`` (PROGRAMS > 0: a persistent grid of that many programs,
            with STAGES 0; 0: one program per row block; left out: :func:`persistent_programs` decides);
            None: :func:`default_config`.
        residual: ``[M, N]`` in ``x``'s dtype, last dimension contiguous, or None; not modified.
        activation: None, ``"silu"``, ``"gelu_tanh"`` or ``"gelu_pytorch_tanh"`` (not with a residual).
        lora: a :class:`LoRAEpilogue` (one row only) or None.

    Returns:
        A new ``[M, N]`` tensor in ``x``'s dtype (``[M, N / 2]`` with an activation).

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit, more than ``MAX_ROWS`` rows; a
            persistent grid with the pipelined loop; an unknown activation, a gate/up weight of an odd
            number of rows, an activation with a residual; a LoRA epilogue that does not fit
            (:meth:`LoRAEpilogue.check`).
    """
    check_skinny_linear(x, weight, bias, residual, activation)
    if lora is not None:
        lora.check(x, weight)
    act = ACTIVATIONS[activation]
    return _launch(x, weight, bias, weight.shape[0] // 2 if act else weight.shape[0], config, act=act,
                   add=residual, lora=lora)[0]


def check_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> None:
    check_skinny_linear(x, weight, bias, activation=activation)
    _check_residual(residual, tuple(x.shape), x, "x")
    if norm_weight.shape != (x.shape[1],) or norm_weight.dtype != x.dtype or norm_weight.device != x.device:
        raise ValueError(f"norm_weight must be [{x.shape[1]}] in {x.dtype} on {x.device}, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype} {norm_weight.device}")


def skinny_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       unit_offset: bool, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       activation: str | None = None, config: tuple[int, ...] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm before a projection, the projection and (optionally) the MLP's activation, one kernel.

    ``s = x + residual`` rounded to the dtype (``s = x`` without a residual), ``y = rms_norm(s) @
    weight.T (+ bias)`` with :func:`infer.kernels.fused_triton.rms_norm`'s rounding steps, and with an
    ``activation`` (``weight`` a merged gate/up ``[2 I, K]``) ``act(gate) * up`` of ``y``'s rounded
    halves, rounded once (as :func:`~infer.kernels.fused_triton.act_and_mul`). At batch-1 decode this
    replaces three launches (the residual add + norm, the projection, the activation) by one: each
    program computes the row's norm itself from ``K`` values in L2.

    Args:
        x: ``[M, K]``, ``M <= MAX_ROWS``, last dimension contiguous; not modified.
        residual: ``[M, K]`` like ``x``, or None; not modified.
        norm_weight: ``[K]``, ``x``'s dtype. eps, unit_offset: as in ``rms_norm`` (Gemma's ``1 + w``).
        weight: ``[N, K]``; bias: ``[N]`` or None.
        activation: None, ``"silu"``, ``"gelu_tanh"`` or ``"gelu_pytorch_tanh"``.
        config: ``(BLOCK_N, BLOCK_K, num_warps)``, ``(BLOCK_N, BLOCK_K, num_warps, STAGES)`` (STAGES 0 when
            left out) or ``(..., STAGES, PROGRAMS)`` (PROGRAMS > 0: a persistent grid of that many programs,
            with STAGES 0; 0: one program per row block; left out: :func:`persistent_programs` decides);
            None: :func:`default_config`.

    Returns:
        ``(y, s)``: ``y`` a new ``[M, N]`` tensor (``[M, N / 2]`` with an activation), and the new
        residual stream ``s`` (a new tensor; ``x`` itself without a residual).

    Raises:
        ValueError: as :func:`skinny_linear`, plus a residual or norm weight that does not fit ``x``, an
            unknown activation, a gate/up weight of an odd number of rows.
    """
    check_norm_linear(x, residual, norm_weight, weight, bias, activation)
    act = ACTIVATIONS[activation]
    n = weight.shape[0] // 2 if act else weight.shape[0]
    y, r_out = _launch(x, weight, bias, n, config, residual, norm_weight, eps, unit_offset, act)
    return y, (r_out if r_out is not None else x)


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            residual: torch.Tensor | None = None, activation: str | None = None,
                            lora: LoRAEpilogue | None = None) -> torch.Tensor:
    """The same function in plain PyTorch: float32 products and sums (with ``lora``, the delta of ``t`` rounded
    to B's dtype times each part's B among them), one rounding to ``x.dtype``; then ``+ residual`` in
    ``x.dtype`` (float32 sum, one rounding), or the activation in float32 on the rounded halves, rounded once."""
    check_skinny_linear(x, weight, bias, residual, activation)
    y = x.float() @ weight.float().T
    if lora is not None:
        lora.check(x, weight)
        slot = int(lora.slot[0])
        if slot >= 0:
            t, b, r = lora.t[0].to(lora.lora_b.dtype).float(), lora.lora_b[slot].float(), lora.lora_b.shape[2]
            ends = [*lora.part_starts[1:], weight.shape[0]]
            y = y + torch.cat([t[i * r:(i + 1) * r] @ b[s:e].T for i, (s, e) in enumerate(zip(lora.part_starts, ends))])
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if activation is not None:
        i = y.shape[1] // 2
        return (activations.ACTIVATIONS[activation](y[:, :i].float()) * y[:, i:].float()).to(x.dtype)
    return y if residual is None else y + residual


def skinny_norm_linear_reference(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                                 eps: float, unit_offset: bool, weight: torch.Tensor,
                                 bias: torch.Tensor | None = None, activation: str | None = None,
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`skinny_norm_linear` in plain PyTorch: :func:`~infer.kernels.fused_reference.rms_norm`,
    :func:`skinny_linear_reference`, and the activation in float32 on the rounded halves, rounded once."""
    check_norm_linear(x, residual, norm_weight, weight, bias, activation)
    s = x if residual is None else x + residual
    return skinny_linear_reference(fused_reference.rms_norm(s, norm_weight, eps, unit_offset), weight, bias,
                                   activation=activation), s


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """``layer(x)`` (an ``nn.Linear`` of one process: no tensor-parallel all-reduce), through
    :func:`skinny_linear` where :func:`use_skinny` says it is faster, else ``F.linear`` (cuBLAS).
    ``x``: ``[M, K]``; returns ``[M, N]``."""
    w = layer.weight
    if use_skinny(x.shape[0], w.shape[0]) and fits(x, w):
        return skinny_linear(x, layer.weight, layer.bias)
    return F.linear(x, layer.weight, layer.bias)


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Can the kernel run on these tensors here (CUDA, or the interpreter; contiguous last dimensions)?"""
    return (x.is_cuda or INTERPRET) and x.stride(-1) == 1 and weight.stride(-1) == 1
