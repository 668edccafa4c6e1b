"""GPU run 31's experiment, not part of the engine (it lost: see NOTES.md). Run from src/infer/kernels/ it was
importable as infer.kernels.fused_mlp; mlp_bench.py imports it from here.

The whole MLP block of one token in one kernel: norm, gate/up, activation, down and the residual add.

At batch-1 decode the MLP is two one-row products (:mod:`infer.kernels.skinny_gemm`): the norm +
gate/up + activation kernel, then the down projection with the residual add in its epilogue. Between
them the GPU pays a kernel boundary: the first kernel's last programs stream with part of the GPU, the
second's first loads wait for them. Here one grid does both, split along the intermediate dimension
(the split-K of the down projection, as stream-K GEMMs and FlashDecoding++'s "flat GEMM" split work):

* program ``p`` owns ``BI`` intermediate units ``[p * BI, (p + 1) * BI)``: it computes their gate and up
  rows against the normalized token (``h = act(gate) * up``, ``BI`` values, rounded as the unfused
  kernels round them), then multiplies them by the matching ``BI`` columns of the down weight, a partial
  sum for every one of the ``H`` outputs, stored in float32 in row ``p`` of a ``[P, H]`` buffer;
* the programs that arrive last (a ticket from an atomic counter) each sum one ``BLOCK_C``-wide column
  slice of that buffer over ``p`` in a fixed order, round, add the residual and store it. The order of
  the sums does not depend on which program finished when: the result is the same bits every run.

The down weight is read by columns, ``BI`` contiguous values of each of its ``H`` rows per program.
:func:`fused_mlp_reference` computes the same function in plain PyTorch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from infer.kernels.fused_triton import _act, _manual_bf16, _round
from infer.kernels.pdl import launch_options, wait_for_previous
from infer.kernels.skinny_gemm import ACTIVATIONS, _squares, _x_slice

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _fused_mlp_kernel(
    x_ptr, nw_ptr, wgu_ptr, wd_ptr, part_ptr, counter_ptr, y_ptr, H, I, stride_wgu, stride_wd_n, stride_wd_i, eps,
    num_reducers,
    BI: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    P_CHUNK: tl.constexpr, H_PAD: tl.constexpr, UNIT_OFFSET: tl.constexpr, ACT: tl.constexpr,
    USE_PDL: tl.constexpr, MANUAL_BF16: tl.constexpr, STAGES: tl.constexpr, EXP: tl.constexpr = 0,
):
    # EXP (run 31's measurements only): 1 no reduction (no ticket, no wait), 2 no down phase either, 3 the
    # reducers spin on a volatile load, not an atomic
    pid = tl.program_id(0)
    num_p = tl.num_programs(0)
    offs_i = pid * BI + tl.arange(0, BI)
    i_mask = offs_i < I
    offs_k = tl.arange(0, BLOCK_K)
    g_rows = wgu_ptr + offs_i.to(tl.int64)[:, None] * stride_wgu
    u_rows = g_rows + I * stride_wgu
    wait_for_previous(USE_PDL)

    dtype = y_ptr.dtype.element_ty
    one = tl.full([1], 1, tl.int1)
    x_row = x_ptr + tl.zeros([1], tl.int64)[:, None]  # [1, 1]: the one row, as skinny_gemm's helpers take rows
    sq = _squares(x_row, x_row, x_row, tl.arange(0, H_PAD), one, H, 1, 1, dtype, MANUAL_BF16)
    rstd = tl.rsqrt(tl.sum(sq, 1) / H + eps)  # [1]

    # 1. gate and up: [BI, BLOCK_K] tiles of each, summed per element, reduced once
    acc_g = tl.zeros([BI, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BI, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        k = k0 + offs_k
        xk = _x_slice(x_row, x_row, nw_ptr, rstd, k, one, H, 1, UNIT_OFFSET, dtype, MANUAL_BF16)  # [1, BLOCK_K]
        tile_mask = i_mask[:, None] & (k < H)[None, :]
        acc_g += xk * tl.load(g_rows + k[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        acc_u += xk * tl.load(u_rows + k[None, :], mask=tile_mask, other=0.0).to(tl.float32)
    g = _round(tl.sum(acc_g, 1), dtype, MANUAL_BF16).to(tl.float32)
    u = _round(tl.sum(acc_u, 1), dtype, MANUAL_BF16).to(tl.float32)
    h = _round(_act(g, ACT == 2) * u, dtype, MANUAL_BF16).to(tl.float32)  # [BI]; 0 past I

    # 2. this program's share of down: partial[p, n] = sum_i W_down[n, i] h[i] over its BI units i
    offs_h = tl.arange(0, BLOCK_H)
    part_row = part_ptr + pid.to(tl.int64) * H
    for n0 in tl.range(0, H if EXP != 2 else 0, BLOCK_H, num_stages=STAGES):
        n = n0 + offs_h
        n_mask = n < H
        wd = tl.load(wd_ptr + n.to(tl.int64)[:, None] * stride_wd_n + offs_i.to(tl.int64)[None, :] * stride_wd_i,
                     mask=n_mask[:, None] & i_mask[None, :], other=0.0)
        tl.store(part_row + n, tl.sum(wd.to(tl.float32) * h[None, :], 1), mask=n_mask)

    # 3. the last num_reducers programs to arrive wait for the rest, then each sums one column slice
    if EXP == 1 or EXP == 2:
        if pid == 0:
            tl.store(part_row + offs_h, h.sum(0) + tl.zeros([BLOCK_H], tl.float32), mask=offs_h < H)
        return
    tl.debug_barrier()  # every thread's partial stores before the ticket (acq_rel publishes them)
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    first_reducer = num_p - num_reducers
    if ticket >= first_reducer:
        if EXP == 3:
            while tl.load(counter_ptr, volatile=True) < num_p:
                pass
            tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        else:
            while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < num_p:
                pass
        tl.debug_barrier()
        cols = (ticket - first_reducer) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = cols < H
        offs_p = tl.arange(0, P_CHUNK)
        total = tl.zeros([P_CHUNK, BLOCK_C], dtype=tl.float32)
        for p0 in range(0, num_p, P_CHUNK):
            rows = p0 + offs_p
            total += tl.load(part_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :],
                             mask=(rows < num_p)[:, None] & c_mask[None, :], other=0.0, cache_modifier=".cg")
        y = _round(tl.sum(total, 0), dtype, MANUAL_BF16).to(tl.float32)
        y += tl.load(x_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)  # the residual add
        tl.store(y_ptr + cols, _round(y, dtype, MANUAL_BF16), mask=c_mask)
        done = tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if done == num_reducers - 1:  # the last reducer re-arms both counters for the next launch
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")


def default_config(h: int, i: int) -> tuple[int, int, int, int, int, int]:
    """``(BI, BLOCK_K, BLOCK_H, BLOCK_C, num_warps, STAGES)`` for hidden size ``h`` and intermediate size ``i``."""
    if INTERPRET:  # one reducer: the interpreter runs the programs one after the other, none may wait
        return 16, 32, 32, triton.next_power_of_2(h), 1, 0
    return 32, 128, 256, 64, 8, 3


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """Two int32 zeros per device (arrivals, finished reducers); every launch leaves them zero again."""
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the fused MLP's counters must be allocated before a CUDA-graph capture")
        c = _COUNTERS[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return c


def check_fused_mlp(x: torch.Tensor, norm_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    activation: str) -> None:
    h = x.shape[-1]
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"fused_mlp takes one row [1, H], got {tuple(x.shape)}")
    if gate_up.dim() != 2 or gate_up.shape[1] != h or gate_up.shape[0] % 2:
        raise ValueError(f"gate_up must be [2 I, {h}], got {tuple(gate_up.shape)}")
    if down.shape != (h, gate_up.shape[0] // 2):
        raise ValueError(f"down must be [{h}, {gate_up.shape[0] // 2}], got {tuple(down.shape)}")
    if norm_weight.shape != (h,):
        raise ValueError(f"norm_weight must be [{h}], got {tuple(norm_weight.shape)}")
    for t in (norm_weight, gate_up, down):
        if t.dtype != x.dtype or t.device != x.device or (t.stride(-1) != 1 and t is not down):
            raise ValueError(f"every tensor must be {x.dtype} on {x.device} with a contiguous last dimension")
    if 1 not in down.stride():
        raise ValueError(f"down needs contiguous rows or columns, got strides {down.stride()}")
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dimension")
    if activation not in ACTIVATIONS or ACTIVATIONS[activation] == 0:
        raise ValueError(f"activation must be silu or gelu_tanh, got {activation!r}")


def fused_mlp(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, unit_offset: bool, gate_up: torch.Tensor,
              down: torch.Tensor, activation: str = "silu", config: tuple[int, ...] | None = None) -> torch.Tensor:
    """``x + down(act(gate(n)) * up(n))`` with ``n = rms_norm(x) * norm_weight``, one token, one kernel.

    Args:
        x: ``[1, H]``, the residual stream (the MLP block's input); not modified.
        norm_weight: ``[H]``; eps, unit_offset: as :func:`infer.kernels.fused_triton.rms_norm`.
        gate_up: ``[2 I, H]``, the merged gate (first I rows) and up weights.
        down: ``[H, I]``.
        activation: ``"silu"`` or ``"gelu_tanh"``.
        config: ``(BI, BLOCK_K, BLOCK_H, BLOCK_C, num_warps, STAGES)``; None: :func:`default_config`.

    Returns:
        A new ``[1, H]`` tensor in ``x``'s dtype: the same values as :func:`fused_mlp_reference` up to the
        order of the float32 sums of the down projection.

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit.
    """
    check_fused_mlp(x, norm_weight, gate_up, down, activation)
    h, i = x.shape[1], down.shape[1]
    bi, block_k, block_h, block_c, warps, stages, *exp = config or default_config(h, i)
    num_p = triton.cdiv(i, bi)
    num_reducers = triton.cdiv(h, block_c)
    if num_reducers > num_p:
        raise ValueError(f"{num_reducers} column slices of {block_c} need at least as many programs, got {num_p}")
    part = torch.empty(num_p, h, dtype=torch.float32, device=x.device)
    y = torch.empty_like(x)
    _fused_mlp_kernel[(num_p,)](
        x, norm_weight, gate_up, down, part, _counters(x.device), y, h, i, gate_up.stride(0), down.stride(0), down.stride(1), eps,
        num_reducers,
        BI=bi, BLOCK_K=block_k, BLOCK_H=block_h, BLOCK_C=block_c, P_CHUNK=32, H_PAD=triton.next_power_of_2(h),
        UNIT_OFFSET=bool(unit_offset), ACT=ACTIVATIONS[activation], MANUAL_BF16=_manual_bf16(x), STAGES=stages, EXP=exp[0] if exp else 0,
        num_warps=warps, **launch_options(x),
    )
    return y


def fused_mlp_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, unit_offset: bool,
                        gate_up: torch.Tensor, down: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """:func:`fused_mlp` in plain PyTorch, as the two one-row kernels compute it: the norm + gate/up +
    activation (:func:`infer.kernels.skinny_gemm.skinny_norm_linear_reference`), then the down projection
    in float32, rounded, plus ``x``, rounded."""
    from infer.kernels.skinny_gemm import skinny_linear_reference, skinny_norm_linear_reference

    check_fused_mlp(x, norm_weight, gate_up, down, activation)
    act, _ = skinny_norm_linear_reference(x, None, norm_weight, eps, unit_offset, gate_up, activation=activation)
    return skinny_linear_reference(act, down, residual=x)

