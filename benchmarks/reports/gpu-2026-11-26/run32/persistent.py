"""GPU run 32's experiment (not part of the engine): the one-row skinny GEMM with a persistent grid.

The engine's kernel (src/infer/kernels/skinny_gemm.py) launches one program per BLOCK_N outputs: Qwen3-4B's
gate/up is 4,864 programs, 4.6 waves of what fits on an H100's SMs at once. Each new program starts its weight
stream from nothing (its first tile's latency), computes the norm's mean square again (a pass over x), and the
last wave runs on part of the GPU. Run 27 named the alternative as the next thing to measure: a persistent
grid, ``programs`` programs (a few per SM) that each loop over row blocks ``pid, pid + P, pid + 2P, ...``,
compute the norm once, and walk one flattened loop over (row block, K slice) so that the next tile's load is
in flight across a row block's end (STAGES 0: one tile ahead in registers, as the engine's kernel) or the
pipeliner keeps STAGES - 1 tiles in flight through shared memory (STAGES >= 2). ``nested``: a loop over row
blocks around the engine's own K loop instead (its last step loads the next row block's first tile). Per output the products are
summed in the same order as the engine's STAGES-0 loop, so where the engine does not pipeline the outputs are
bit-identical to it.

:func:`persistent_linear` takes the engine kernel's arguments (no bias: Qwen3 has none);
:func:`infer.kernels.skinny_gemm.skinny_norm_linear_reference` is its plain-PyTorch reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.fused_triton import _act, _manual_bf16, _round
from infer.kernels.pdl import launch_options, wait_for_previous
from infer.kernels.skinny_gemm import ACTIVATIONS, _norm_k_pad, _squares, _x_slice, default_config


@triton.jit
def _epilogue(acc, acc_u, tile, offs_b, offs_m, m_mask, add_ptr, y_ptr, N, stride_am, stride_ym,
              BLOCK_N: tl.constexpr, ACT: tl.constexpr, ADD: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """Reduce a row block's sums and store its outputs (the engine kernel's epilogue, no bias)."""
    offs_n = tile * BLOCK_N + offs_b
    n_mask = offs_n < N
    dtype = y_ptr.dtype.element_ty
    y = tl.sum(acc, 2)
    if ACT:
        g = _round(y, dtype, MANUAL_BF16).to(tl.float32)
        y = _act(g, ACT == 2) * _round(tl.sum(acc_u, 2), dtype, MANUAL_BF16).to(tl.float32)
    if ADD:
        y = _round(y, dtype, MANUAL_BF16).to(tl.float32) + tl.load(
            add_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_n[None, :],
            mask=m_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
    out = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, _round(y, dtype, MANUAL_BF16), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _persistent_kernel(
    x_ptr, r_ptr, r_out_ptr, nw_ptr, w_ptr, add_ptr, y_ptr, M, N, K, stride_xm, stride_rm, stride_om,
    stride_wn, stride_am, stride_ym, up_offset, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr, ACT: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr,
    MANUAL_BF16: tl.constexpr, NORM_K_PAD: tl.constexpr, STAGES: tl.constexpr, NESTED: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    total = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, P) * k_tiles  # this program's (row block, K slice) steps
    offs_b = tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    offs_n = pid * BLOCK_N + offs_b
    first_mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    w = tl.zeros([BLOCK_N, BLOCK_K], dtype=w_ptr.dtype.element_ty)
    u = w
    if STAGES == 0:  # the first tile before the wait (no kernel writes the weights)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=first_mask, other=0.0)
        if ACT:
            u = tl.load(w_ptr + up_offset + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
                        mask=first_mask, other=0.0)
    wait_for_previous(USE_PDL)

    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    r_rows = r_ptr + offs_m.to(tl.int64)[:, None] * stride_rm
    dtype = y_ptr.dtype.element_ty
    rstd = tl.zeros([M_PAD], dtype=tl.float32)
    if NORM:  # once per program, not once per row block
        r_out_rows = r_out_ptr + offs_m.to(tl.int64)[:, None] * stride_om
        if NORM_K_PAD:
            sq = _squares(x_rows, r_rows, r_out_rows, tl.arange(0, NORM_K_PAD), m_mask, K, pid, NORM, dtype,
                          MANUAL_BF16)
        else:
            sq = tl.zeros([M_PAD, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                sq += _squares(x_rows, r_rows, r_out_rows, k0 + offs_k, m_mask, K, pid, NORM, dtype, MANUAL_BF16)
        rstd = tl.rsqrt(tl.sum(sq, 1) / K + eps)

    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = acc
    if ACT:
        acc_u = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    if NESTED:  # a loop over row blocks around the engine's K loop (no division per step, the epilogue outside)
        num_tiles = tl.cdiv(N, BLOCK_N)
        for tile in range(pid, num_tiles, P):
            offs_n = tile * BLOCK_N + offs_b
            n_mask = offs_n < N
            w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
            acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
            if ACT:
                acc_u = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
            if STAGES == 0:  # one tile ahead; the last step loads the next row block's first tile
                n_next = offs_n + P * BLOCK_N
                next_rows = w_ptr + n_next.to(tl.int64)[:, None] * stride_wn
                for k0 in range(0, K, BLOCK_K):
                    k = k0 + offs_k
                    xk = _x_slice(x_rows, r_rows, nw_ptr, rstd, k, m_mask, K, NORM, UNIT_OFFSET, dtype, MANUAL_BF16)
                    last = k0 + BLOCK_K >= K
                    kn = tl.where(last, offs_k, k + BLOCK_K)
                    rows_n = tl.where(last, n_next, offs_n)
                    base = tl.where(last, next_rows, w_rows)
                    mask1 = (rows_n < N)[:, None] & (kn < K)[None, :]
                    w_next = tl.load(base + kn[None, :], mask=mask1, other=0.0)
                    acc += xk[:, None, :] * w.to(tl.float32)[None, :, :]
                    w = w_next
                    if ACT:
                        u_next = tl.load(base + up_offset + kn[None, :], mask=mask1, other=0.0)
                        acc_u += xk[:, None, :] * u.to(tl.float32)[None, :, :]
                        u = u_next
            else:
                for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
                    k = k0 + offs_k
                    xk = _x_slice(x_rows, r_rows, nw_ptr, rstd, k, m_mask, K, NORM, UNIT_OFFSET, dtype, MANUAL_BF16)
                    mask = n_mask[:, None] & (k < K)[None, :]
                    acc += xk[:, None, :] * tl.load(w_rows + k[None, :], mask=mask, other=0.0).to(tl.float32)[None, :, :]
                    if ACT:
                        acc_u += xk[:, None, :] * tl.load(w_rows + up_offset + k[None, :], mask=mask,
                                                          other=0.0).to(tl.float32)[None, :, :]
            _epilogue(acc, acc_u, tile, offs_b, offs_m, m_mask, add_ptr, y_ptr, N, stride_am, stride_ym,
                      BLOCK_N, ACT, ADD, MANUAL_BF16)
    elif STAGES == 0:
        for it in range(0, total):
            t = it // k_tiles
            kk = it - t * k_tiles
            tile = pid + t * P
            k = kk * BLOCK_K + offs_k
            it1 = it + 1  # the next step's tile, loaded before this one is used
            t1 = it1 // k_tiles
            k1 = (it1 - t1 * k_tiles) * BLOCK_K + offs_k
            n1 = (pid + t1 * P) * BLOCK_N + offs_b
            mask1 = (n1 < N)[:, None] & (k1 < K)[None, :]
            w_next = tl.load(w_ptr + n1.to(tl.int64)[:, None] * stride_wn + k1[None, :], mask=mask1, other=0.0)
            xk = _x_slice(x_rows, r_rows, nw_ptr, rstd, k, m_mask, K, NORM, UNIT_OFFSET, dtype, MANUAL_BF16)
            acc += xk[:, None, :] * w.to(tl.float32)[None, :, :]
            w = w_next
            if ACT:
                u_next = tl.load(w_ptr + up_offset + n1.to(tl.int64)[:, None] * stride_wn + k1[None, :], mask=mask1,
                                 other=0.0)
                acc_u += xk[:, None, :] * u.to(tl.float32)[None, :, :]
                u = u_next
            if kk == k_tiles - 1:
                _epilogue(acc, acc_u, tile, offs_b, offs_m, m_mask, add_ptr, y_ptr, N, stride_am, stride_ym,
                          BLOCK_N, ACT, ADD, MANUAL_BF16)
                acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
                if ACT:
                    acc_u = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:  # Triton's pipeliner: STAGES - 1 steps' tiles in flight through shared memory, across row blocks too
        for it in tl.range(0, total, num_stages=STAGES):
            t = it // k_tiles
            kk = it - t * k_tiles
            tile = pid + t * P
            k = kk * BLOCK_K + offs_k
            n = tile * BLOCK_N + offs_b
            mask = (n < N)[:, None] & (k < K)[None, :]
            xk = _x_slice(x_rows, r_rows, nw_ptr, rstd, k, m_mask, K, NORM, UNIT_OFFSET, dtype, MANUAL_BF16)
            acc += xk[:, None, :] * tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=mask,
                                            other=0.0).to(tl.float32)[None, :, :]
            if ACT:
                acc_u += xk[:, None, :] * tl.load(w_ptr + up_offset + n.to(tl.int64)[:, None] * stride_wn + k[None, :],
                                                  mask=mask, other=0.0).to(tl.float32)[None, :, :]
            if kk == k_tiles - 1:
                _epilogue(acc, acc_u, tile, offs_b, offs_m, m_mask, add_ptr, y_ptr, N, stride_am, stride_ym,
                          BLOCK_N, ACT, ADD, MANUAL_BF16)
                acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
                if ACT:
                    acc_u = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)


def persistent_linear(x: torch.Tensor, weight: torch.Tensor, programs: int, config: tuple[int, ...] | None = None,
                      residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6, unit_offset: bool = False, activation: str | None = None,
                      add: torch.Tensor | None = None, nested: bool = False,
                      info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``skinny_norm_linear`` / ``skinny_linear(..., residual=add)`` on ``min(programs, row blocks)`` programs.
    ``config``: ``(BLOCK_N, BLOCK_K, num_warps, STAGES)``, default the engine's. Returns ``(y, new residual)``."""
    m, k = x.shape
    act = ACTIVATIONS[activation]
    n = weight.shape[0] // 2 if act else weight.shape[0]
    norm = 0 if norm_weight is None else 1 if residual is None else 2
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r_out = torch.empty(m, k, dtype=x.dtype, device=x.device) if norm == 2 else None
    block_n, block_k, warps, stages = config or default_config(m, n, k, act=bool(act), norm=norm > 0)
    r = residual if residual is not None else x
    grid = (max(1, min(programs, triton.cdiv(n, block_n))),)
    compiled = _persistent_kernel[grid](
        x, r, r_out if r_out is not None else y, norm_weight if norm else weight, weight,
        add if add is not None else y, y, m, n, k, x.stride(0), r.stride(0), r_out.stride(0) if r_out is not None else 0,
        weight.stride(0), add.stride(0) if add is not None else 0, y.stride(0), n * weight.stride(0) if act else 0, eps,
        M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm, UNIT_OFFSET=bool(unit_offset),
        ACT=act, ADD=add is not None, MANUAL_BF16=_manual_bf16(x), NORM_K_PAD=norm and _norm_k_pad(m, k, warps),
        STAGES=stages, NESTED=nested, num_warps=warps, **launch_options(x))
    if info is not None:  # ptxas' registers per thread and spills (not under the interpreter)
        info.update(regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None))
    return y, r_out
