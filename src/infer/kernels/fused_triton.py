"""Triton kernels of the fused operations (phase 8): each replaces a chain of small PyTorch ops.

Same names, signatures, in-place behaviour and input errors as :mod:`infer.kernels.fused_reference`
(the plain-PyTorch versions the tests compare against):

* :func:`rms_norm`: one pass per row (RMSNorm, Zhang & Sennrich, arXiv:1910.07467), Llama's or
  Gemma's ``(1 + w)`` rounding order.
* :func:`fused_add_rms_norm`: ``residual += x; x = rms_norm(residual)`` in one pass (vLLM's
  ``fused_add_rms_norm``): the residual add no longer writes a tensor that the norm reads again.
* :func:`qk_norm_rope`: per-head RMSNorm of q and k (Qwen3, Gemma 3) and the rotary embedding
  (RoFormer, arXiv:2104.09864, "rotate half" layout) read from a float32 cos/sin cache, in place in
  the merged QKV projection's output.
* :func:`act_and_mul`: ``act(gate) * up`` (SwiGLU / GeGLU with tanh GELU) of a merged gate/up output.

Design, the same for all four: every value is loaded once, converted to float32 right away, the math
is done in float32 and the result stored once (the intermediate roundings of the unfused code that
change the result, such as Llama's cast before the weight multiply, are reproduced explicitly). The
number of tokens ``T`` is a grid dimension only: a new batch size compiles nothing (what is compiled,
``tl.constexpr``, is what a model fixes: the row width, head counts, head_dim, the norm variant and
the dtype). No autotuning (it breaks the interpreter and CUDA-graph capture), no host
synchronization, no allocation besides the outputs: every launch can be captured in a CUDA graph.
``num_warps`` is chosen from the row width.

Importing this module works on any machine; launching needs CUDA tensors, or CPU tensors with
``TRITON_INTERPRET=1`` set before Triton is imported (the tests do that; each program instance then
costs milliseconds, so keep shapes tiny). The interpreter runs bf16 arithmetic on raw integers, which
the conversion to float32 right after every load avoids.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from infer.kernels.fused_reference import (
    add_norm_steps,
    build_cos_sin_cache,
    check_act_and_mul,
    check_add_rms_norm,
    check_cache_write,
    check_gated_qk_norm_rope,
    check_qk_norm_rope,
    check_rms_norm,
    check_sigmoid_gate_mul,
    norm_linear_steps,
    split_gated_qkv,
)
from infer.kernels.pdl import launch_next_then_wait, launch_options, wait_for_previous
from infer.kernels.triton_common import (
    check_kv_scales,
    check_launchable,
    manual_bf16,
    num_warps_for,
    round_to,
    silu_or_gelu_tanh,
    to_fp8_e4m3,
)

_MAX_ROW = 1 << 16  # widest row the single-pass norm kernels take (registers: 64k fp32 per program)

__all__ = ["rms_norm", "fused_add_rms_norm", "qk_norm_rope", "gated_qk_norm_rope", "sigmoid_gate_mul", "act_and_mul",
           "build_cos_sin_cache", "linear", "linear_residual", "add_rms_norm", "add_rms_norm_linear"]


# ============================================================================ RMSNorm (+ residual add)


@triton.jit
def _rms_norm_row(x, w, eps, N: tl.constexpr, UNIT_OFFSET: tl.constexpr, DTYPE: tl.constexpr,
                  MANUAL_BF16: tl.constexpr):
    """float32 row ``x`` and float32 norm weight ``w`` -> the normalized row rounded to DTYPE."""
    r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    h = x * r
    if UNIT_OFFSET:  # Gemma: (1 + w) in float32, one rounding
        y = h * (1.0 + w)
    else:  # Llama: round the normalized row first, then the product (exact in fp32) rounds again
        y = round_to(h, DTYPE, MANUAL_BF16).to(tl.float32) * w
    return round_to(y, DTYPE, MANUAL_BF16)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, stride_x, stride_o, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, UNIT_OFFSET: tl.constexpr, MANUAL_BF16: tl.constexpr,
    USE_PDL: tl.constexpr, LAUNCH_NEXT_EARLY: tl.constexpr = False,
):
    # One program per row: load it once, reduce, scale, store. The norm weight is no kernel's output: it
    # is loaded before the PDL wait (infer.kernels.pdl), while the kernel that writes x still runs, instead
    # of after the reduction, where its trip to memory was on every layer's critical path.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if LAUNCH_NEXT_EARLY:  # the next kernel launches before this one waits (add_rms_norm_linear says when)
        launch_next_then_wait(USE_PDL)
    else:
        wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    y = _rms_norm_row(x, w, eps, N, UNIT_OFFSET, out_ptr.dtype.element_ty, MANUAL_BF16)
    tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, stride_x, stride_r, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, UNIT_OFFSET: tl.constexpr, MANUAL_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # One program per row: s = x + residual rounded to the dtype (stored as the new residual), then the
    # norm of that rounded s (stored over x). Each program reads its row before writing it. The norm
    # weight w (float32 [BLOCK]) is no kernel's output: it is loaded before the PDL wait.
    w = tl.load(w_ptr + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < N, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)  # (infer.kernels.pdl: a no-op unless launched with PDL)
    # >>> EXERCISE fused_add_rms_norm_kernel
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    s = round_to(x + r, res_ptr.dtype.element_ty, MANUAL_BF16)
    tl.store(res_ptr + row * stride_r + offs, s, mask=mask)
    y = _rms_norm_row(s.to(tl.float32), w, eps, N, UNIT_OFFSET, x_ptr.dtype.element_ty, MANUAL_BF16)
    tl.store(x_ptr + row * stride_x + offs, y, mask=mask)
    # <<< EXERCISE fused_add_rms_norm_kernel


def _row_block(d: int) -> int:
    if d > _MAX_ROW:
        raise ValueError(f"rows wider than {_MAX_ROW} elements are not supported by the single-pass kernel, got {d}")
    return triton.next_power_of_2(d)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm of each row in one pass (see :func:`infer.kernels.fused_reference.rms_norm`).

    Args:
        x: ``[T, d]``, float32/float16/bfloat16, last dimension contiguous (rows may be strided).
        weight: ``[d]``, ``x``'s dtype.
        eps: added to the mean square.
        unit_offset: Gemma's ``(1 + w)`` form (float32 product, cast last); else Llama's order (cast the
            normalized row to ``x.dtype``, then multiply by ``w``).
        out: optional ``[T, d]`` in ``x``'s dtype; may be ``x`` itself (in place).

    Returns:
        ``out`` (a new tensor if None).

    Raises:
        ValueError: as the reference; rows wider than 65536.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    return _rms_norm(x, weight, eps, unit_offset, out)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, out: torch.Tensor | None,
              launch_next_early: bool = False) -> torch.Tensor:
    """:func:`rms_norm`; ``launch_next_early``: under PDL the next kernel may launch before this one's wait
    (:func:`infer.kernels.pdl.launch_next_then_wait`), not after it. The same values."""
    check_rms_norm(x, weight, out)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    t, d = x.shape
    if t == 0:
        return out
    block = _row_block(d)
    check_launchable(x)
    _rms_norm_kernel[(t,)](
        x, weight, out, x.stride(0), out.stride(0), eps,
        N=d, BLOCK=block, UNIT_OFFSET=bool(unit_offset), MANUAL_BF16=manual_bf16(x), num_warps=num_warps_for(block),
        LAUNCH_NEXT_EARLY=bool(launch_next_early), **launch_options(x),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual <- x + residual``; ``x <- rms_norm(residual)``, one pass, in place (vLLM's
    ``fused_add_rms_norm``; see :func:`infer.kernels.fused_reference.fused_add_rms_norm`).

    Args:
        x: ``[T, d]``, overwritten with the normalized rows.
        residual: ``[T, d]``, same dtype/device, not overlapping ``x``; overwritten with ``x + residual``
            rounded to the dtype.
        weight: ``[d]``; eps, unit_offset: as in :func:`rms_norm`.

    Returns:
        ``(x, residual)``: the same tensors, now ``(normed, new_residual)``.

    Raises:
        ValueError: as the reference; rows wider than 65536.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    check_add_rms_norm(x, residual, weight)
    t, d = x.shape
    if t == 0:
        return x, residual
    block = _row_block(d)
    check_launchable(x)
    _add_rms_norm_kernel[(t,)](
        x, residual, weight, x.stride(0), residual.stride(0), eps,
        N=d, BLOCK=block, UNIT_OFFSET=bool(unit_offset), MANUAL_BF16=manual_bf16(x), num_warps=num_warps_for(block),
        **launch_options(x),
    )
    return x, residual


# ============================================================================ QK-norm + RoPE


@triton.jit
def _cache_rows(k_cache_ptr, v_cache_ptr, slot, block_size, stride_cb, stride_ct, stride_ch, heads, offs, h_mask,
                d_mask, NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr):
    """The KV-cache addresses of a token's k and v heads among a program's ``heads`` (of q, k, v in one row):
    block ``slot // block_size``, offset ``slot % block_size``; ``(k_ptr, v_ptr, k_mask, v_mask)``, nothing
    written for a padding token (``slot < 0``)."""
    row = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct
    is_k = (heads >= NUM_Q_HEADS) & h_mask & (slot >= 0)
    is_v = (heads >= NUM_HEADS) & (heads < NUM_HEADS + NUM_KV_HEADS) & (slot >= 0)
    k_ptr = k_cache_ptr + row + (heads - NUM_Q_HEADS)[:, None] * stride_ch + offs[None, :]
    v_ptr = v_cache_ptr + row + (heads - NUM_HEADS)[:, None] * stride_ch + offs[None, :]
    return k_ptr, v_ptr, is_k[:, None] & d_mask[None, :], is_v[:, None] & d_mask[None, :]


@triton.jit(do_not_specialize=["max_positions"], do_not_specialize_on_alignment=["pos_ptr"])
def _qk_norm_rope_kernel(
    qkv_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr, stride_t, max_positions, eps,
    k_cache_ptr, v_cache_ptr, slot_ptr, stride_cb, stride_ct, stride_ch, block_size, k_scale_ptr, v_scale_ptr,
    NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, HAS_NORM: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    MANUAL_BF16: tl.constexpr, WRITE_CACHE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, USE_PDL: tl.constexpr,
    FP8: tl.constexpr,
):
    # Grid (T, cdiv(Hq + Hkv, BLOCK_H)): program (t, j) rewrites BLOCK_H of token t's q/k heads (q heads
    # first, then k heads, as they lie in qkv). Each head is loaded as its two halves [BLOCK_H, HALF],
    # the pairs that the rotation mixes, so no shuffle is needed. With WRITE_CACHE the grid also covers
    # the v heads (cdiv(Hq + 2 Hkv, BLOCK_H) programs), and each k and v head is stored into the KV
    # cache at the token's slot as well (reshape_and_cache fused in: one launch fewer per layer).
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, HALF_PAD)
    h_mask = heads < NUM_HEADS
    d_mask = offs < HALF
    mask = h_mask[:, None] & d_mask[None, :]
    # What no kernel of the step writes comes first, before the PDL wait (infer.kernels.pdl): the token's
    # position and cache slot (staged by the host), its row of the cos/sin table and the norm weights.
    # The cache row of this token's position is clamped: a bad position reads the nearest row rather than
    # memory outside the table (the reference raises instead).
    pos = tl.load(pos_ptr + t).to(tl.int64)
    pos = tl.minimum(tl.maximum(pos, 0), max_positions - 1)
    cos = tl.load(cs_ptr + pos * HEAD_DIM + offs, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * HEAD_DIM + HALF + offs, mask=d_mask, other=0.0)[None, :]
    if HAS_NORM:  # q heads take q_weight, k heads k_weight
        is_q = (heads < NUM_Q_HEADS)[:, None]
        w1 = tl.where(is_q, tl.load(qw_ptr + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :])
        w2 = tl.where(is_q, tl.load(qw_ptr + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                      tl.load(kw_ptr + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :])
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t)
    wait_for_previous(USE_PDL)

    ptr1 = qkv_ptr + t * stride_t + heads[:, None] * HEAD_DIM + offs[None, :]
    ptr2 = ptr1 + HALF
    load_mask = mask
    if WRITE_CACHE:  # the v heads are read too (to be copied into the cache)
        load_mask = (heads < NUM_HEADS + NUM_KV_HEADS)[:, None] & d_mask[None, :]
    x1 = tl.load(ptr1, mask=load_mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=load_mask, other=0.0).to(tl.float32)
    v1, v2 = x1, x2  # the v heads' values, as loaded
    dtype = qkv_ptr.dtype.element_ty
    if HAS_NORM:
        # per-head RMSNorm over both halves, with the rounding steps of rms_norm (the normalized head is
        # rounded before the rotation)
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        if UNIT_OFFSET:
            x1 = round_to(x1 * r * (1.0 + w1), dtype, MANUAL_BF16).to(tl.float32)
            x2 = round_to(x2 * r * (1.0 + w2), dtype, MANUAL_BF16).to(tl.float32)
        else:
            x1 = round_to(round_to(x1 * r, dtype, MANUAL_BF16).to(tl.float32) * w1, dtype, MANUAL_BF16).to(tl.float32)
            x2 = round_to(round_to(x2 * r, dtype, MANUAL_BF16).to(tl.float32) * w2, dtype, MANUAL_BF16).to(tl.float32)
    y1 = round_to(x1 * cos - x2 * sin, dtype, MANUAL_BF16)
    y2 = round_to(x2 * cos + x1 * sin, dtype, MANUAL_BF16)
    tl.store(ptr1, y1, mask=mask)
    tl.store(ptr2, y2, mask=mask)
    if WRITE_CACHE:
        # the token's cache rows: k heads get their rotated values, v heads their loaded ones
        k_ptr, v_ptr, k_mask, v_mask = _cache_rows(k_cache_ptr, v_cache_ptr, slot, block_size, stride_cb, stride_ct,
                                                   stride_ch, heads, offs, h_mask, d_mask, NUM_Q_HEADS, NUM_HEADS,
                                                   NUM_KV_HEADS)
        if FP8:  # an FP8 cache (phase 11): the rounded k and the loaded v, divided by the layer's scale, in e4m3
            cdt = k_cache_ptr.dtype.element_ty
            ks = tl.load(k_scale_ptr)
            vs = tl.load(v_scale_ptr)
            tl.store(k_ptr, to_fp8_e4m3(y1.to(tl.float32), ks, cdt), mask=k_mask)
            tl.store(k_ptr + HALF, to_fp8_e4m3(y2.to(tl.float32), ks, cdt), mask=k_mask)
            tl.store(v_ptr, to_fp8_e4m3(v1, vs, cdt), mask=v_mask)
            tl.store(v_ptr + HALF, to_fp8_e4m3(v2, vs, cdt), mask=v_mask)
        else:
            tl.store(k_ptr, y1, mask=k_mask)
            tl.store(k_ptr + HALF, y2, mask=k_mask)
            tl.store(v_ptr, v1.to(dtype), mask=v_mask)
            tl.store(v_ptr + HALF, v2.to(dtype), mask=v_mask)


def _qk_rope_config(num_heads: int, head_dim: int) -> tuple[int, int]:
    """(heads per program, warps): about 512 elements per program (4 heads of 128, 2 of 256), so that
    batch-1 decode still spreads over several SMs and a 2048-token prefill has no tiny programs."""
    half_pad = triton.next_power_of_2(head_dim // 2)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 256 // half_pad))
    return block_h, num_warps_for(2 * block_h * half_pad)


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    unit_offset: bool = False,
    kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    slot_mapping: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (optional) and RoPE, in place in the merged QKV output
    (see :func:`infer.kernels.fused_reference.qk_norm_rope` for the exact numerics), and with
    ``kv_cache`` the cache write of the new K/V in the same kernel.

    Args:
        qkv: ``[T, (num_heads + 2 * num_kv_heads) * head_dim]``, last dimension contiguous; its q and k
            columns are overwritten.
        positions: int64/int32 ``[T]``, each in ``[0, max_positions)`` (the kernel clamps bad ones).
        cos_sin_cache: float32 ``[max_positions, head_dim]``, cos then sin (:func:`build_cos_sin_cache`).
        num_heads, num_kv_heads, head_dim: the layout; head_dim even.
        q_weight, k_weight: ``[head_dim]`` in qkv's dtype, both or neither (QK-norm).
        eps, unit_offset: as in :func:`rms_norm`.
        kv_cache: ``(k_cache, v_cache)``, one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``
            in qkv's dtype (strided blocks allowed, last dimension contiguous): the rotated k and the v of
            token ``t`` are stored at slot ``slot_mapping[t]``, as
            :func:`infer.kernels.kv_cache_write.reshape_and_cache` would (vLLM and SGLang fuse the same
            write into their RoPE kernels). ``None``: the cache is not touched.
        slot_mapping: int64 ``[T]`` with ``kv_cache``; negative slots are skipped (padding).
        kv_scales: an FP8 cache (float8_e4m3fn, phase 11): the layer's float32 ``[1]`` ``(k_scale,
            v_scale)`` (None: 1.0); k and v are stored as ``x / scale`` rounded to e4m3.

    Returns:
        ``(q, k, v)`` views of ``qkv``: ``[T, Hq, D]``, ``[T, Hkv, D]``, ``[T, Hkv, D]``.

    Raises:
        ValueError: as the reference.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    check_qk_norm_rope(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, q_weight, k_weight)
    if kv_cache is not None:
        check_cache_write(qkv, kv_cache, slot_mapping, num_kv_heads, head_dim)
    t = qkv.shape[0]
    heads = num_heads + num_kv_heads
    if t > 0:
        check_launchable(qkv)
        block_h, warps = _qk_rope_config(heads, head_dim)
        has_norm = q_weight is not None
        write = kv_cache is not None
        k_cache, v_cache = kv_cache if write else (qkv, qkv)
        k_scale, v_scale = check_kv_scales(k_cache, *(kv_scales or (None, None)))
        _qk_norm_rope_kernel[(t, triton.cdiv(heads + (num_kv_heads if write else 0), block_h))](
            qkv, positions, cos_sin_cache, q_weight if has_norm else qkv, k_weight if has_norm else qkv,
            qkv.stride(0), cos_sin_cache.shape[0], eps,
            k_cache, v_cache, slot_mapping if write else positions,
            *(k_cache.stride()[:3] if write else (0, 0, 0)), k_cache.shape[1] if write else 1, k_scale, v_scale,
            NUM_Q_HEADS=num_heads, NUM_HEADS=heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
            HALF_PAD=triton.next_power_of_2(head_dim // 2), BLOCK_H=block_h, HAS_NORM=has_norm,
            UNIT_OFFSET=bool(unit_offset), MANUAL_BF16=manual_bf16(qkv), WRITE_CACHE=write,
            NUM_KV_HEADS=num_kv_heads, FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=warps,
            **launch_options(qkv),
        )
    q = qkv[:, : num_heads * head_dim].view(t, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : heads * head_dim].view(t, num_kv_heads, head_dim)
    v = qkv[:, heads * head_dim :].view(t, num_kv_heads, head_dim)
    return q, k, v


# ============================================================================ the gated attention (Qwen3.5)


@triton.jit
def _gated_qk_norm_rope_kernel(
    qkv_ptr, q_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, stride_t, stride_cs, eps,
    k_cache_ptr, v_cache_ptr, slot_ptr, stride_cb, stride_ct, stride_ch, block_size, k_scale_ptr, v_scale_ptr,
    NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, UNIT_OFFSET: tl.constexpr, MANUAL_BF16: tl.constexpr,
    WRITE_CACHE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr,
):
    # Grid (T, cdiv(Hq + Hkv, BLOCK_H)): program (t, j) normalizes and rotates BLOCK_H of token t's q / k heads.
    # A q head is read at h * 2D (its gate follows it) and written to q [T, Hq, D]; a k head is read and
    # written in place at Hq * 2D + (h - Hq) D. Each head is loaded twice: as is, and permuted to its rotation
    # partners (dimension i < HALF pairs with i + HALF, for i < 2 HALF = rotary_dim; the rest pair with
    # themselves and pass through), so that each output element needs no shuffle. With WRITE_CACHE the grid
    # covers the v heads too (they follow the k heads in qkv), and the rotated k and the v heads are stored into
    # the KV cache at the token's slot (reshape_and_cache fused in, as _qk_norm_rope_kernel does).
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, D_PAD)
    is_q = heads < NUM_Q_HEADS
    h_mask = heads < NUM_HEADS
    d_mask = offs < HEAD_DIM
    mask = h_mask[:, None] & d_mask[None, :]
    partner = tl.where(offs < HALF, offs + HALF, tl.where(offs < 2 * HALF, offs - HALF, offs))
    ang = tl.where(offs < HALF, offs, offs - HALF)  # the angle of each rotated dimension
    rot = offs < 2 * HALF
    # what no kernel of the step writes (the tables, the norm weights) before the PDL wait
    cos = tl.load(cos_ptr + t * stride_cs + ang, mask=rot, other=1.0)[None, :]
    sin = tl.load(sin_ptr + t * stride_cs + ang, mask=rot, other=0.0)[None, :]
    sign = tl.where(offs < HALF, -1.0, 1.0)[None, :]
    w = tl.where(is_q[:, None], tl.load(qw_ptr + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                 tl.load(kw_ptr + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :])
    wp = tl.where(is_q[:, None], tl.load(qw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                  tl.load(kw_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :])
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t)
    wait_for_previous(USE_PDL)

    # k heads, then (WRITE_CACHE) v heads, each D columns after the q / gate pairs
    col = tl.where(is_q, heads * 2 * HEAD_DIM, NUM_Q_HEADS * 2 * HEAD_DIM + (heads - NUM_Q_HEADS) * HEAD_DIM)
    src = qkv_ptr + t * stride_t + col.to(tl.int64)[:, None]
    load_mask = mask
    if WRITE_CACHE:
        load_mask = (heads < NUM_HEADS + NUM_KV_HEADS)[:, None] & d_mask[None, :]
    x = tl.load(src + offs[None, :], mask=load_mask, other=0.0).to(tl.float32)
    v = x  # the v heads' values, as loaded
    xp = tl.load(src + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    r = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
    if UNIT_OFFSET:  # rms_norm's rounding steps, the normalized head rounded before the rotation
        x = round_to(x * r * (1.0 + w), dtype, MANUAL_BF16).to(tl.float32)
        xp = round_to(xp * r * (1.0 + wp), dtype, MANUAL_BF16).to(tl.float32)
    else:
        x = round_to(round_to(x * r, dtype, MANUAL_BF16).to(tl.float32) * w, dtype, MANUAL_BF16).to(tl.float32)
        xp = round_to(round_to(xp * r, dtype, MANUAL_BF16).to(tl.float32) * wp, dtype, MANUAL_BF16).to(tl.float32)
    y = round_to(x * cos + sign * (xp * sin), dtype, MANUAL_BF16)
    q_dst = q_ptr + (t * NUM_Q_HEADS + heads).to(tl.int64)[:, None] * HEAD_DIM + offs[None, :]
    tl.store(q_dst, y, mask=mask & is_q[:, None])
    tl.store(src + offs[None, :], y, mask=mask & (heads >= NUM_Q_HEADS)[:, None])
    if WRITE_CACHE:  # the token's cache rows (slot < 0: padding, nothing written)
        k_ptr, v_ptr, k_mask, v_mask = _cache_rows(k_cache_ptr, v_cache_ptr, slot, block_size, stride_cb, stride_ct,
                                                   stride_ch, heads, offs, h_mask, d_mask, NUM_Q_HEADS, NUM_HEADS,
                                                   NUM_KV_HEADS)
        if FP8:  # an FP8 cache (phase 11): the rounded k and the loaded v, divided by the layer's scale, in e4m3
            cdt = k_cache_ptr.dtype.element_ty
            tl.store(k_ptr, to_fp8_e4m3(y.to(tl.float32), tl.load(k_scale_ptr), cdt), mask=k_mask)
            tl.store(v_ptr, to_fp8_e4m3(v, tl.load(v_scale_ptr), cdt), mask=v_mask)
        else:
            tl.store(k_ptr, y, mask=k_mask)
            tl.store(v_ptr, v.to(dtype), mask=v_mask)


def gated_qk_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int, rotary_dim: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       unit_offset: bool = True, kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                       slot_mapping: torch.Tensor | None = None,
                       kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`infer.kernels.fused_reference.gated_qk_norm_rope` (its arguments, values and returns) in one
    launch: replaces the gated attention's ~20 small PyTorch steps (two norms, the partial rotation, the
    concatenations and copies) per layer, and with ``kv_cache`` the KV-cache write of the new k and v."""
    check_gated_qk_norm_rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim, rotary_dim)
    if kv_cache is not None:
        check_cache_write(qkv, kv_cache, slot_mapping, num_kv_heads, head_dim)
    t, d = qkv.shape[0], head_dim
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    if t > 0:
        check_launchable(qkv)
        d_pad = triton.next_power_of_2(d)
        heads = num_heads + num_kv_heads
        block_h = max(1, min(triton.next_power_of_2(heads), 512 // d_pad))
        write = kv_cache is not None
        k_cache, v_cache = kv_cache if write else (qkv, qkv)
        k_scale, v_scale = check_kv_scales(k_cache, *(kv_scales or (None, None)))
        _gated_qk_norm_rope_kernel[(t, triton.cdiv(heads + (num_kv_heads if write else 0), block_h))](
            qkv, q, cos, sin, q_weight, k_weight, qkv.stride(0), cos.stride(0), eps,
            k_cache, v_cache, slot_mapping if write else cos, *(k_cache.stride()[:3] if write else (0, 0, 0)),
            k_cache.shape[1] if write else 1, k_scale, v_scale,
            NUM_Q_HEADS=num_heads, NUM_HEADS=heads, HEAD_DIM=d, D_PAD=d_pad, HALF=rotary_dim // 2,
            BLOCK_H=block_h, UNIT_OFFSET=bool(unit_offset), MANUAL_BF16=manual_bf16(qkv), WRITE_CACHE=write,
            NUM_KV_HEADS=num_kv_heads, FP8=k_cache.dtype == torch.float8_e4m3fn,
            num_warps=num_warps_for(block_h * d_pad), **launch_options(qkv))
    qg, k, v = split_gated_qkv(qkv, num_heads, num_kv_heads, head_dim)
    return q, k, v, qg[..., d:]


@triton.jit
def _sigmoid_gate_mul_kernel(o_ptr, g_ptr, out_ptr, stride_gt, stride_gh, HD: tl.constexpr, D: tl.constexpr,
                             BLOCK: tl.constexpr, MANUAL_BF16: tl.constexpr, USE_PDL: tl.constexpr):
    # Grid (T, cdiv(H D, BLOCK)): out[t, i] = o[t, i] * sigmoid(gate[t, i // D, i % D]), float32, rounded once.
    wait_for_previous(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < HD
    o = tl.load(o_ptr + t * HD + i, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * stride_gt + (i // D) * stride_gh + i % D, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * HD + i, round_to(o * tl.sigmoid(g), out_ptr.dtype.element_ty, MANUAL_BF16), mask=m)


def sigmoid_gate_mul(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """:func:`infer.kernels.fused_reference.sigmoid_gate_mul` in one launch (not three: the gate's copy out
    of the strided view, the sigmoid, the product)."""
    check_sigmoid_gate_mul(o, gate)
    t, h, d = gate.shape
    out = torch.empty(t, h * d, dtype=o.dtype, device=o.device)
    if t > 0:
        check_launchable(o)
        block = min(1024, triton.next_power_of_2(h * d))
        _sigmoid_gate_mul_kernel[(t, triton.cdiv(h * d, block))](
            o, gate, out, gate.stride(0), gate.stride(1), HD=h * d, D=d, BLOCK=block, MANUAL_BF16=manual_bf16(o),
            num_warps=num_warps_for(block), **launch_options(o))
    return out


# ============================================================================ act(gate) * up

@triton.jit
def _act_and_mul_kernel(
    gu_ptr, out_ptr, stride_gu, stride_o,
    I: tl.constexpr, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr, MANUAL_BF16: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Grid (T, cdiv(I, BLOCK)): program (t, j) computes BLOCK outputs of token t from the gate and up
    # values at the same columns of the two halves.
    wait_for_previous(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, round_to(silu_or_gelu_tanh(g, GELU_TANH) * u, out_ptr.dtype.element_ty, MANUAL_BF16),
             mask=mask)


def _act_block(i: int) -> int:
    return min(1024, triton.next_power_of_2(i))


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` in one pass: float32 math, one rounding (see
    :func:`infer.kernels.fused_reference.act_and_mul`, which rounds twice in 16-bit dtypes, as the
    unfused MLP does: the two differ by at most about one ulp of the dtype).

    Args:
        gate_up: ``[T, 2 * I]`` (gate columns, then up columns), float32/float16/bfloat16, last
            dimension contiguous.
        activation: ``"silu"``, ``"gelu_tanh"`` or ``"gelu_pytorch_tanh"``.

    Returns:
        A new ``[T, I]`` tensor in ``gate_up.dtype``.

    Raises:
        ValueError: as the reference.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    kind = check_act_and_mul(gate_up, activation)
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, i), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or i == 0:
        return out
    check_launchable(gate_up)
    block = _act_block(i)
    _act_and_mul_kernel[(t, triton.cdiv(i, block))](
        gate_up, out, gate_up.stride(0), out.stride(0),
        I=i, BLOCK=block, GELU_TANH=kind == "gelu_tanh", MANUAL_BF16=manual_bf16(gate_up),
        num_warps=num_warps_for(block), **launch_options(gate_up),
    )
    return out


# ============================================================================ projections


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """``layer(x)`` for ``x [T, in]``: one-row products go through the skinny GEMM where it beats
    cuBLAS (:func:`infer.kernels.skinny_gemm.linear`); a tensor-parallel row-parallel layer (its
    all-reduce) and everything else run as the layer does."""
    from infer.kernels import skinny_gemm

    parallel = getattr(layer, "parallel", None)
    if (parallel is not None and parallel.tp_size > 1) or not isinstance(layer, torch.nn.Linear):
        return layer(x)  # ... or a quantized projection (phase 11), which runs its own kernel
    return skinny_gemm.linear(x, layer)


def linear_residual(x: torch.Tensor, layer: torch.nn.Linear, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's last projection and its residual add (see
    :func:`infer.kernels.fused_reference.linear_residual`). One row through the skinny GEMM: the add in
    its epilogue, ``(layer(x) + residual, None)``, so that the next norm
    (:func:`~infer.kernels.skinny_gemm.skinny_norm_linear`) reads one row of the residual stream, not
    two, and stores none. Otherwise ``(linear(x, layer), residual)``: the add rides with the next norm,
    as in the reference (at more rows a separate add would cost a kernel)."""
    from infer.kernels import skinny_gemm

    if not isinstance(layer, torch.nn.Linear):  # a quantized projection (phase 11): the add rides with the norm
        return linear(x, layer), residual
    w, parallel = layer.weight, getattr(layer, "parallel", None)
    if (residual is not None and x.dim() == 2 and skinny_gemm.use_skinny(x.shape[0], w.shape[0])
            and (parallel is None or parallel.tp_size == 1) and skinny_gemm.fits(x, w) and residual.stride(-1) == 1):
        return skinny_gemm.skinny_linear(x, w, layer.bias, residual=residual), None
    return linear(x, layer), residual


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_add_rms_norm`, or :func:`rms_norm` without a residual (see
    :func:`infer.kernels.fused_reference.add_rms_norm`)."""
    return add_norm_steps(sys.modules[__name__], x, residual, weight, eps, unit_offset)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    layer: torch.nn.Linear,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm before a projection, the projection, and optionally the MLP's activation (see
    :func:`infer.kernels.fused_reference.add_rms_norm_linear`). One row (batch-1 decode): two kernels, the
    norm (:func:`add_rms_norm`) and :func:`infer.kernels.skinny_gemm.skinny_linear` with the activation in
    its epilogue, at the tile of a projection after a norm. Otherwise :func:`fused_add_rms_norm` (or
    :func:`rms_norm`), :func:`linear` and :func:`act_and_mul`, as the reference.

    Why not one kernel at one row: :func:`~infer.kernels.skinny_gemm.skinny_norm_linear` computes the
    norm in every program of the projection (thousands of times, each from the whole row), and at an
    H200's bandwidth that costs more than a small kernel's boundary under PDL. Measured in the engine,
    batch 1, every phase 8-9 flag and ``pdl`` (alternated in one call), ms per token: Qwen3-4B
    2.79 -> 2.69 on an H200 and 3.36-3.37 -> 3.35 on an H100, Qwen3-0.6B 0.975 -> 0.941-0.944 (H200).

    Returns ``(y, residual)``; ``x`` and ``residual`` may be overwritten (the unfused path works in place).
    """
    from infer.kernels import skinny_gemm

    if not isinstance(layer, torch.nn.Linear):  # a quantized projection (phase 11): the separate steps
        return norm_linear_steps(sys.modules[__name__], x, residual, weight, eps, unit_offset, layer, activation)
    w = layer.weight
    if (x.dim() == 2 and x.shape[0] == 1 and getattr(layer, "parallel", None) is None and skinny_gemm.fits(x, w)
            and (residual is None or residual.stride(-1) == 1)):
        if residual is None:
            # Before gate/up (an activation), gate/up launches before the norm's wait: its programs are
            # placed and load their first weight tiles while o still runs (H200, ms per token:
            # Qwen3-4B 2.625-2.627 -> 2.600, Qwen3-0.6B 0.863-0.864 -> 0.848-0.849). Before QKV it was slower
            # (2.70): QKV's one-warp programs are better placed after the down projection has finished.
            normed = _rms_norm(x, weight, eps, unit_offset, None, launch_next_early=activation is not None)
            residual = x
        else:
            normed, residual = add_rms_norm(x, residual, weight, eps, unit_offset)
        config = skinny_gemm.after_norm_config(w, activation)
        return skinny_gemm.skinny_linear(normed, w, layer.bias, config, activation=activation), residual
    return norm_linear_steps(sys.modules[__name__], x, residual, weight, eps, unit_offset, layer, activation)
