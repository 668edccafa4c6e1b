"""Triton kernels of the Gated DeltaNet layer (phase 17): the decode step's conv1d update and recurrent
gated delta rule, each reading and writing the sequences' state slots in place; the prefills'
convolution; the gated output norm.

A decode step of a linear-attention layer is memory-bound: per sequence and value head it reads and
writes a ``[Dk, Dv]`` float32 state (64 KiB at Qwen3.5's 128 x 128) to do ``~4 * Dk * Dv`` flops. The
plain-PyTorch twin (:func:`infer.kernels.gated_delta_reference.decode_step`) gathers the slots into
copies, runs half a dozen elementwise kernels over them and scatters them back: the state crosses
memory about ten times. Here each state tile is loaded once, decayed, corrected by the delta rule,
read by the query and stored back, in registers (flash-linear-attention's
``fused_recurrent_gated_delta_rule`` and vLLM's ``fused_sigmoid_gating_delta_rule_update`` do the same).

* :func:`causal_conv1d_update`: one program per (sequence, channel block): the ``K``-tap dot product,
  SiLU, and the state shifted by one token.
* :func:`causal_conv1d_varlen`: the same convolution over a step's prefills back to back, one program
  per block of rows and channels, the taps before a sequence's first token read from its state.
* :func:`gated_delta_step`: one program per (sequence, value head, ``BV`` columns of the state): the
  gating (decay and beta from the projections' ``a`` and ``b``), the L2 norms of q and k, the decay,
  the delta-rule write and the output, with the state tile in registers.
* :func:`decode_step`: both, with :func:`~infer.kernels.gated_delta_reference.decode_step`'s signature.
* :func:`gated_rms_norm`: the output norm gated by ``silu(z)``, one program per token and head.

With PDL (``EngineConfig.pdl``, :mod:`infer.kernels.pdl`) each loads what no kernel of the step writes
(the slots, the weights) before it waits for the kernel before it.

Tested against the reference under ``TRITON_INTERPRET=1`` (tests/test_hybrid.py).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from infer.kernels import gated_delta_reference as reference
from infer.kernels.pdl import launch_options, wait_for_previous


@triton.jit
def _conv_update_kernel(x_ptr, x_stride, state_ptr, st_slot, st_c, w_ptr, slots_ptr, has_ptr, out_ptr, out_stride, C,
                        K: tl.constexpr, BC: tl.constexpr, USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = offs < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    has = tl.load(has_ptr + b) != 0
    w_last = tl.load(w_ptr + offs * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)  # (infer.kernels.pdl) x is the projection's, just before
    x = tl.load(x_ptr + b * x_stride + offs, mask=mask, other=0.0)
    acc = x.to(tl.float32) * w_last
    row = state_ptr + slot * st_slot + offs * st_c
    for j in tl.static_range(K - 1):  # state column j (oldest first) meets tap j
        s = tl.load(row + j, mask=mask & has, other=0.0)
        acc += s.to(tl.float32) * tl.load(w_ptr + offs * K + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:  # shift left by one token (a fresh sequence's zeros included)
            tl.store(row + (j - 1), s, mask=mask)
    tl.store(row + (K - 2), x.to(state_ptr.dtype.element_ty), mask=mask)
    y = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(out_ptr + b * out_stride + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                         has_state: torch.Tensor) -> torch.Tensor:
    """``silu(conv)`` of one new token per sequence, shifting each sequence's slot in place.

    Args:
        x: ``[B, C]`` (rows may be strided: a column slice of the merged in-projection); conv_state:
        ``[S, C, K - 1]`` (last dim contiguous); weight: contiguous ``[C, K]``;
        slots: int64 ``[B]``; has_state: bool ``[B]`` (False: the slot is read as zeros).

    Returns:
        ``[B, C]`` in ``x.dtype``.
    """
    b, c = x.shape
    k = weight.shape[1]
    if k < 2 or conv_state.stride(2) != 1 or x.stride(1) != 1:
        raise ValueError(f"need a kernel of 2+ taps, a conv state with contiguous taps and x with contiguous rows, "
                         f"got K={k}, strides {conv_state.stride()} and {x.stride()}")
    out = torch.empty(b, c, dtype=x.dtype, device=x.device)
    bc = min(256, triton.next_power_of_2(c))
    _conv_update_kernel[(b, triton.cdiv(c, bc))](x, x.stride(0), conv_state, conv_state.stride(0),
                                                  conv_state.stride(1), weight.contiguous(), slots, has_state, out,
                                                  out.stride(0), c, K=k, BC=bc, **launch_options(x))
    return out


@triton.jit
def _conv_varlen_kernel(x_ptr, x_stride, state_ptr, st_seq, st_c, w_ptr, start_ptr, seq_ptr, out_ptr, out_stride, T, C,
                        K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, USE_PDL: tl.constexpr):
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    mt, mc = offs_t < T, offs_c < C
    start = tl.load(start_ptr + offs_t, mask=mt, other=0)  # the row's sequence's first row
    seq = tl.load(seq_ptr + offs_t, mask=mt, other=-1).to(tl.int64)  # its conv state's row, -1: zeros
    wait_for_previous(USE_PDL)  # (infer.kernels.pdl) x is the projection's, just before
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(K):  # tap j reads the input K - 1 - j tokens back
        src = offs_t - (K - 1) + j
        inside = src >= start  # else one of the K - 1 inputs before the sequence's first new token
        xv = tl.load(x_ptr + src[:, None] * x_stride + offs_c[None, :], mask=(mt & inside)[:, None] & mc[None, :],
                     other=0.0).to(tl.float32)
        col = src - start + (K - 1)  # that input's column of the state (oldest first)
        sv = tl.load(state_ptr + seq[:, None] * st_seq + offs_c[None, :] * st_c + col[:, None],
                     mask=(mt & ~inside & (seq >= 0))[:, None] & mc[None, :], other=0.0)
        w = tl.load(w_ptr + offs_c * K + j, mask=mc, other=0.0).to(tl.float32)
        acc += (xv + sv.to(out_ptr.dtype.element_ty).to(tl.float32)) * w[None, :]
    y = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(out_ptr + offs_t[:, None] * out_stride + offs_c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@functools.lru_cache(maxsize=8)
def _varlen_rows(seq_lens: tuple[int, ...], has_state: tuple[bool, ...], device: torch.device) -> torch.Tensor:
    """int32 ``[2, T]``: each row's sequence's first row, and its conv state's index (-1: zeros); one host
    copy per step's shape, shared by its layers (read only)."""
    lens = np.array(seq_lens)
    firsts = np.repeat(np.cumsum(lens) - lens, lens)
    states = np.where(has_state, np.cumsum(has_state) - 1, -1)
    return torch.from_numpy(np.stack([firsts, np.repeat(states, lens)]).astype(np.int32)).to(device)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, seq_lens: list[int],
                         conv_states: list[torch.Tensor | None] | torch.Tensor) -> torch.Tensor:
    """:func:`infer.kernels.gated_delta_reference.causal_conv1d_varlen` in one kernel: a step's prefills
    back to back, each after its own conv state (None: zeros), ``silu`` of the ``K``-tap causal
    convolution. One program per ``BT`` rows and ``BC`` channels; a tap that reaches before its row's
    sequence reads the sequence's state instead of ``x`` (the reference lays states and tokens side by side
    in a copy, convolves in float32 and gathers the rows back: five passes over the step's activations).

    Args:
        x: ``[T, C]`` (rows may be strided: a column slice of the merged in-projection), ``T = sum(seq_lens)``;
        weight: ``[C, K]``; conv_states: per sequence ``[C, K - 1]`` or None, or all of them stacked
        (``[B, C, K - 1]``, zeros for a fresh sequence).

    Returns:
        ``y [T, C]`` in ``x.dtype``.

    Raises:
        ValueError: lengths that do not add up to ``T``, or ``x`` without contiguous rows.
    """
    t, c = x.shape
    k = weight.shape[1]
    if sum(seq_lens) != t or x.stride(1) != 1:
        raise ValueError(f"seq_lens must add up to the {t} rows of an x with contiguous rows, got {seq_lens} "
                         f"and strides {x.stride()}")
    if isinstance(conv_states, torch.Tensor):  # stacked, zeros for a fresh sequence: every row reads its own
        states, has = conv_states, (True,) * len(seq_lens)
    else:
        given = [s for s in conv_states if s is not None]
        states = torch.stack(given) if given else x.new_zeros(1, c, k - 1)
        has = tuple(s is not None for s in conv_states)
    rows = _varlen_rows(tuple(seq_lens), has, x.device)
    out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    bt, bc = 32, min(128, triton.next_power_of_2(c))
    _conv_varlen_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc))](
        x, x.stride(0), states, states.stride(0), states.stride(1), weight.contiguous(), rows[0], rows[1], out,
        out.stride(0), t, c, K=k, BT=bt, BC=bc, **launch_options(x))
    return out


@triton.jit
def _delta_step_kernel(y_ptr, y_stride, a_ptr, a_stride, b_ptr, b_stride, alog_ptr, dtb_ptr, s_ptr, s_slot, s_head,
                       s_k, slots_ptr, has_ptr, o_ptr, o_stride, scale, eps, KEY_DIM: tl.constexpr, REP: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_PDL: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    has = tl.load(has_ptr + seq) != 0
    decay_rate = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    ptrs = s_ptr + slot * s_slot + h * s_head + offs_k[:, None] * s_k + offs_v[None, :]
    m2 = mk[:, None] & mv[None, :]
    # [BK, BV]: this program's columns of S, in float32 whatever the slots store (ssm_state_dtype), loaded
    # before the PDL wait: no kernel of the step before this one writes the slot (the layer's previous
    # step did, and the prefills of this step write other sequences' slots), only y, a and b are new
    s = tl.load(ptrs, mask=m2 & has, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)  # (infer.kernels.pdl) y is the convolution's, a and b the projection's
    row = y_ptr + seq * y_stride
    kh = h // REP  # the key head this value head reads
    q = tl.load(row + kh * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(row + KEY_DIM + kh * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(row + 2 * KEY_DIM + h * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + eps) * scale  # L2 norm, then Dk ** -0.5
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    # the gating (gated_delta_reference.gating): g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
    # rounded to b's dtype as the reference's; vLLM's fused_sigmoid_gating_delta_rule_update does the same
    a = tl.load(a_ptr + seq * a_stride + h).to(tl.float32) + dt_bias
    g = -decay_rate * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # softplus, linear past 20 (PyTorch's)
    braw = tl.load(b_ptr + seq * b_stride + h)
    beta = tl.sigmoid(braw.to(tl.float32)).to(braw.dtype).to(tl.float32)
    s = s * tl.exp(g)
    u = (v - tl.sum(s * k[:, None], axis=0)) * beta  # the delta: what S^T k misses of v
    s = s + k[:, None] * u[None, :]
    tl.store(ptrs, s.to(s_ptr.dtype.element_ty), mask=m2)  # (rounded once a step in a bfloat16 slot)
    tl.store(o_ptr + seq * o_stride + h * DV + offs_v, tl.sum(s * q[:, None], axis=0), mask=mv)


def gated_delta_step(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     ssm_state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor, num_k_heads: int,
                     scale: float | None = None, eps: float = 1e-6) -> torch.Tensor:
    """One token of the gated delta rule per sequence, each state updated in place in its slot, the gating
    (:func:`~infer.kernels.gated_delta_reference.gating`) computed in the kernel.

    Args:
        y: ``[B, C]`` the convolution's output: ``Hk * Dk`` q channels, as many k, then ``Hv * Dv`` v.
        a, b: ``[B, Hv]`` (contiguous columns; rows may be strided); A_log, dt_bias: ``[Hv]``;
        ssm_state: float32 or bfloat16 ``[S, Hv, Dk, Dv]`` (contiguous Dv; ``EngineConfig.ssm_state_dtype``):
            updated in float32, stored back in its dtype.
        slots: int64 ``[B]``; has_state: bool ``[B]``.
        scale: multiplies q after its L2 norm (default ``Dk ** -0.5``).

    Returns:
        float32 ``[B, Hv, Dv]``.
    """
    n = y.shape[0]
    _, hv, dk, dv = ssm_state.shape
    if ssm_state.dtype not in (torch.float32, torch.bfloat16) or ssm_state.stride(3) != 1 or a.stride(1) != 1 \
            or b.stride(1) != 1:
        raise ValueError("need a float32 or bfloat16 state with contiguous Dv and [B, Hv] a / b with contiguous "
                         "columns")
    out = torch.empty(n, hv, dv, dtype=torch.float32, device=y.device)
    bk, bv = triton.next_power_of_2(dk), min(32, triton.next_power_of_2(dv))
    scale = dk ** -0.5 if scale is None else scale
    _delta_step_kernel[(n, hv, triton.cdiv(dv, bv))](
        y, y.stride(0), a, a.stride(0), b, b.stride(0), A_log, dt_bias, ssm_state, ssm_state.stride(0),
        ssm_state.stride(1), ssm_state.stride(2), slots, has_state, out, out.stride(0), scale, eps,
        KEY_DIM=num_k_heads * dk, REP=hv // num_k_heads, DK=dk, DV=dv, BK=bk, BV=bv, **launch_options(y))
    return out


def decode_step(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                weight: torch.Tensor, num_k_heads: int, scale: float | None = None) -> torch.Tensor:
    """:func:`infer.kernels.gated_delta_reference.decode_step` in two kernels (same arguments, same result)."""
    y = causal_conv1d_update(mixed, conv_state, weight, slots, has_state)
    return gated_delta_step(y, a, b, A_log, dt_bias, ssm_state, slots, has_state, num_k_heads, scale)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, x_stride, z_ptr, z_stride, w_ptr, o_ptr, H, eps, DV: tl.constexpr,
                           BD: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0)  # one (token, head)
    t, h = row // H, row % H
    offs = tl.arange(0, BD)
    m = offs < DV
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    wait_for_previous(USE_PDL)
    dt = o_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * x_stride + h * DV + offs, mask=m, other=0.0).to(dt).to(tl.float32)
    z = tl.load(z_ptr + t * z_stride + h * DV + offs, mask=m, other=0.0).to(tl.float32)
    hn = (x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / DV + eps))).to(dt).to(tl.float32)
    hw = (w * hn).to(dt).to(tl.float32)  # the reference's roundings: to the model's dtype, times w in it
    tl.store(o_ptr + row * DV + offs, (hw * (z / (1.0 + tl.exp(-z)))).to(dt), mask=m)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`infer.kernels.gated_delta_reference.gated_rms_norm` in one kernel (one program per token and
    head) instead of the reference's eight or so elementwise ones.

    Args:
        x: ``[T, H, Dv]`` (the mixer's float32 output, contiguous heads); gate: ``[T, H, Dv]`` (rows may
            be strided: a slice of the merged in-projection); weight: ``[Dv]``.

    Returns:
        contiguous ``[T, H, Dv]`` in ``gate``'s dtype.
    """
    t, h, dv = gate.shape
    if x.shape != gate.shape or x.stride(2) != 1 or x.stride(1) != dv or gate.stride(2) != 1 or gate.stride(1) != dv:
        raise ValueError(f"need x and gate of one shape [T, H, Dv] with contiguous heads, got {tuple(x.shape)} "
                         f"strides {x.stride()} and {tuple(gate.shape)} strides {gate.stride()}")
    out = torch.empty(t, h, dv, dtype=gate.dtype, device=gate.device)
    _gated_rms_norm_kernel[(t * h,)](x, x.stride(0), gate, gate.stride(0), weight, out, h, eps, DV=dv,
                                     BD=triton.next_power_of_2(dv), **launch_options(gate))
    return out


# ------------------------------------------------------------------ the prefills' chunked gated delta rule


@triton.jit
def _load_qk(ptr, stride, tok, mr, kh, DK, BK: tl.constexpr, RAW: tl.constexpr):
    """Rows ``tok`` of key head ``kh`` of q or k as float32 ``[rows, BK]``; ``RAW``: the convolution's output,
    L2-normalized here and rounded to its dtype (:func:`~infer.kernels.gated_delta_reference.split_qkv`)."""
    offs = tl.arange(0, BK)
    x = tl.load(ptr + tok[:, None] * stride + kh * DK + offs[None, :], mask=mr[:, None] & (offs < DK)[None, :],
                other=0.0).to(tl.float32)
    if RAW:
        x = (x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]).to(ptr.dtype.element_ty).to(tl.float32)
    return x


@triton.jit
def _load_gates(g_ptr, g_stride, beta_ptr, beta_stride, tok, mr, h, alog_ptr, dtb_ptr, RAW: tl.constexpr):
    """Rows ``tok`` of head ``h``'s log-decay ``g`` and write strength ``beta`` (float32, zeros past the
    chunk: no effect on the state); ``RAW``: computed from the projections' ``a`` and ``b`` as
    :func:`~infer.kernels.gated_delta_reference.gating` does (and :func:`gated_delta_step`)."""
    g = tl.load(g_ptr + tok * g_stride + h, mask=mr, other=0.0).to(tl.float32)
    braw = tl.load(beta_ptr + tok * beta_stride + h, mask=mr, other=0.0)
    beta = braw.to(tl.float32)
    if RAW:  # g = -exp(A_log) softplus(a + dt_bias) (linear past 20, PyTorch's), beta = sigmoid(b) in b's dtype
        a = g + tl.load(dtb_ptr + h).to(tl.float32)
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        beta = tl.sigmoid(beta).to(braw.dtype).to(tl.float32)
    return tl.where(mr, g, 0.0), tl.where(mr, beta, 0.0)


@triton.jit
def _chunk_block(k_ptr, k_stride, v_ptr, v_stride, g_ptr, g_stride, beta_ptr, beta_stride, alog_ptr, dtb_ptr, t0, n,
                 b, h, kh, DK, DV, g_before, BK: tl.constexpr, BV: tl.constexpr, RAW: tl.constexpr):
    """Rows ``16 b .. 16 b + 15`` of a chunk: ``k``, ``beta k``, ``beta v``, the log-decay from the chunk's
    start at each row (``g_before``: the block's start), and the log-decay at the block's end. Rows past the
    chunk's ``n`` tokens read as zeros (``g = 0``, ``beta = 0``: no effect)."""
    rows = b * 16 + tl.arange(0, 16)
    mr = rows < n
    offs_v = tl.arange(0, BV)
    tok = (t0 + rows).to(tl.int64)
    k = _load_qk(k_ptr, k_stride, tok, mr, kh, DK, BK, RAW)
    v = tl.load(v_ptr + tok[:, None] * v_stride + h * DV + offs_v[None, :], mask=mr[:, None] & (offs_v < DV)[None, :],
                other=0.0).to(tl.float32)
    g, beta = _load_gates(g_ptr, g_stride, beta_ptr, beta_stride, tok, mr, h, alog_ptr, dtb_ptr, RAW)
    gc = tl.cumsum(g, 0) + g_before
    return k, k * beta[:, None], v * beta[:, None], gc, g_before + tl.sum(g, 0)


@triton.jit
def _l_block(kb_i, k_j, gc_i, gc_j, DIAG: tl.constexpr, PRECISION: tl.constexpr):
    """Block ``(i, j)`` (16 x 16) of ``L = (beta k) k^T`` under the decay mask: strictly lower on the diagonal."""
    d = gc_i[:, None] - gc_j[None, :]
    if DIAG:
        r = tl.arange(0, 16)
        d = tl.where(r[:, None] > r[None, :], d, float("-inf"))
    return tl.dot(kb_i, tl.trans(k_j), input_precision=PRECISION) * tl.exp(d)


@triton.jit
def _inv_unit_lower16(lower):
    """``(I + lower)^-1`` for a strictly lower 16 x 16 block, by forward substitution one row at a time:
    row ``i`` is ``e_i - lower[i, :i] @ (the rows before it)``."""
    r = tl.arange(0, 16)
    inv = tl.zeros((16, 16), dtype=tl.float32)
    for i in range(16):
        l_i = tl.sum(tl.where(r[:, None] == i, lower, 0.0), axis=0)
        x_i = tl.where(r == i, 1.0, 0.0) - tl.sum(l_i[:, None] * inv, axis=0)
        inv = tl.where(r[:, None] == i, x_i[None, :], inv)
    return inv


@triton.jit
def _store_block(w_ptr, u_ptr, w, u, c, b, h, H, DK, DV, BK: tl.constexpr, BV: tl.constexpr):
    """Rows ``16 b ..`` of chunk ``c``'s ``W`` and ``U`` into ``[chunks * 64, H, D]`` buffers (float32, or the
    inputs' dtype for 16-bit inputs)."""
    out = (c * 64 + b * 16 + tl.arange(0, 16)).to(tl.int64)
    offs_k, offs_v = tl.arange(0, BK), tl.arange(0, BV)
    tl.store(w_ptr + (out[:, None] * H + h) * DK + offs_k[None, :], w.to(w_ptr.dtype.element_ty),
             mask=(offs_k < DK)[None, :])
    tl.store(u_ptr + (out[:, None] * H + h) * DV + offs_v[None, :], u.to(u_ptr.dtype.element_ty),
             mask=(offs_v < DV)[None, :])


@triton.jit
def _chunk_prepare_kernel(k_ptr, k_stride, v_ptr, v_stride, g_ptr, g_stride, beta_ptr, beta_stride, alog_ptr, dtb_ptr,
                          chunks_ptr, num_chunks, w_ptr, u_ptr, H, DK, DV, REP: tl.constexpr, BK: tl.constexpr,
                          BV: tl.constexpr, PRECISION: tl.constexpr, RAW: tl.constexpr):
    # one chunk (64 tokens) of one head, in four blocks of 16 rows: M = I + L is block lower triangular, so
    # X = M^-1 has X_ii = (I + L_ii)^-1 (forward substitution) and, below the diagonal,
    # X_ij = -X_ii @ sum_{j <= m < i} L_im @ X_mj (matrix products); then W = X (beta k e^gc), U = X (beta v)
    # (flash-linear-attention's solve_tril merges its 16-row blocks the same way)
    c, h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(chunks_ptr + c)
    n = tl.load(chunks_ptr + num_chunks + c)  # the chunk's tokens (64, or fewer for a sequence's last)
    a = (k_ptr, k_stride, v_ptr, v_stride, g_ptr, g_stride, beta_ptr, beta_stride, alog_ptr, dtb_ptr, t0, n)
    kh = h // REP  # the key head this value head reads
    k0, kb0, vb0, gc0, e0 = _chunk_block(*a, 0, h, kh, DK, DV, 0.0, BK, BV, RAW)
    k1, kb1, vb1, gc1, e1 = _chunk_block(*a, 1, h, kh, DK, DV, e0, BK, BV, RAW)
    k2, kb2, vb2, gc2, e2 = _chunk_block(*a, 2, h, kh, DK, DV, e1, BK, BV, RAW)
    k3, kb3, vb3, gc3, _ = _chunk_block(*a, 3, h, kh, DK, DV, e2, BK, BV, RAW)
    P: tl.constexpr = PRECISION
    x00 = _inv_unit_lower16(_l_block(kb0, k0, gc0, gc0, True, P))
    x11 = _inv_unit_lower16(_l_block(kb1, k1, gc1, gc1, True, P))
    x22 = _inv_unit_lower16(_l_block(kb2, k2, gc2, gc2, True, P))
    x33 = _inv_unit_lower16(_l_block(kb3, k3, gc3, gc3, True, P))
    l10, l20, l30 = _l_block(kb1, k0, gc1, gc0, False, P), _l_block(kb2, k0, gc2, gc0, False, P), \
        _l_block(kb3, k0, gc3, gc0, False, P)
    l21, l31, l32 = _l_block(kb2, k1, gc2, gc1, False, P), _l_block(kb3, k1, gc3, gc1, False, P), \
        _l_block(kb3, k2, gc3, gc2, False, P)
    x10 = -tl.dot(x11, tl.dot(l10, x00, input_precision=P), input_precision=P)
    x21 = -tl.dot(x22, tl.dot(l21, x11, input_precision=P), input_precision=P)
    x32 = -tl.dot(x33, tl.dot(l32, x22, input_precision=P), input_precision=P)
    x20 = -tl.dot(x22, tl.dot(l20, x00, input_precision=P) + tl.dot(l21, x10, input_precision=P), input_precision=P)
    x31 = -tl.dot(x33, tl.dot(l31, x11, input_precision=P) + tl.dot(l32, x21, input_precision=P), input_precision=P)
    x30 = -tl.dot(x33, tl.dot(l30, x00, input_precision=P) + tl.dot(l31, x10, input_precision=P)
                  + tl.dot(l32, x20, input_precision=P), input_precision=P)
    kg0, kg1, kg2, kg3 = (kb0 * tl.exp(gc0)[:, None], kb1 * tl.exp(gc1)[:, None], kb2 * tl.exp(gc2)[:, None],
                          kb3 * tl.exp(gc3)[:, None])
    _store_block(w_ptr, u_ptr, tl.dot(x00, kg0, input_precision=P), tl.dot(x00, vb0, input_precision=P), c, 0, h, H,
                 DK, DV, BK, BV)
    _store_block(w_ptr, u_ptr, tl.dot(x10, kg0, input_precision=P) + tl.dot(x11, kg1, input_precision=P),
                 tl.dot(x10, vb0, input_precision=P) + tl.dot(x11, vb1, input_precision=P), c, 1, h, H, DK, DV, BK, BV)
    _store_block(w_ptr, u_ptr, tl.dot(x20, kg0, input_precision=P) + tl.dot(x21, kg1, input_precision=P)
                 + tl.dot(x22, kg2, input_precision=P),
                 tl.dot(x20, vb0, input_precision=P) + tl.dot(x21, vb1, input_precision=P)
                 + tl.dot(x22, vb2, input_precision=P), c, 2, h, H, DK, DV, BK, BV)
    _store_block(w_ptr, u_ptr, tl.dot(x30, kg0, input_precision=P) + tl.dot(x31, kg1, input_precision=P)
                 + tl.dot(x32, kg2, input_precision=P) + tl.dot(x33, kg3, input_precision=P),
                 tl.dot(x30, vb0, input_precision=P) + tl.dot(x31, vb1, input_precision=P)
                 + tl.dot(x32, vb2, input_precision=P) + tl.dot(x33, vb3, input_precision=P), c, 3, h, H, DK, DV,
                 BK, BV)


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, DT: tl.constexpr):
    """``a @ b`` accumulated in float32: for ``"16-bit"`` in ``DT`` operands (the walk and the outputs on bf16
    or fp16 inputs, as flash-linear-attention's chunk_fwd_h and chunk_fwd_o take them), else float32 tiles
    multiplied in ``PRECISION`` (``"tf32"`` or ``"ieee"``)."""
    if PRECISION == "16-bit":
        return tl.dot(a.to(DT), b.to(DT))
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _chunk_recurrence_kernel(k_ptr, k_stride, g_ptr, g_stride, alog_ptr, dtb_ptr, w_ptr, u_ptr, seqs_ptr, num_seqs,
                             s0_ptr, h_ptr, final_ptr, H, DK, DV, REP: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                             BV: tl.constexpr, PRECISION: tl.constexpr, RAW: tl.constexpr):
    # The sequential part, as short as it can be: per chunk the state before it (stored for the outputs and
    # the snapshots), the chunk's new values (over U, in place) and the state after it. Two products a chunk;
    # the outputs, three more, are _chunk_output_kernel's, every chunk at once (flash-linear-attention's
    # chunk_fwd_h). Every address is arithmetic in the loop's index, no table lookups and no branches (as
    # fast as a version with them on an H200: the loop does not wait on its loads; this one is simpler).
    s, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, C)
    offs_k, offs_v = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    m2 = mk[:, None] & mv[None, :]
    state_off = h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]  # [Dk, BV] of one [H, Dk, Dv] state
    S = tl.load(s0_ptr + s.to(tl.int64) * H * DK * DV + state_off, mask=m2, other=0.0)
    first = tl.load(seqs_ptr + s).to(tl.int64)
    count = tl.load(seqs_ptr + num_seqs + s)
    start = tl.load(seqs_ptr + 2 * num_seqs + s)
    length = tl.load(seqs_ptr + 3 * num_seqs + s)
    for i in range(0, count):  # this sequence's chunks, in order: the state carries across
        c = first + i
        mr = rows < length - i * C
        tok = (start + i * C + rows).to(tl.int64)
        k = _load_qk(k_ptr, k_stride, tok, mr, h // REP, DK, BK, RAW)
        g, _ = _load_gates(g_ptr, g_stride, g_ptr, g_stride, tok, mr, h, alog_ptr, dtb_ptr, RAW)
        row = c * C + rows
        w = tl.load(w_ptr + (row[:, None] * H + h) * DK + offs_k[None, :], mask=mk[None, :], other=0.0)
        u_ptrs = u_ptr + (row[:, None] * H + h) * DV + offs_v[None, :]
        u = tl.load(u_ptrs, mask=mv[None, :], other=0.0).to(tl.float32)
        tl.store(h_ptr + c * H * DK * DV + state_off, S, mask=m2)
        v_new = u - _mm(w, S, PRECISION, w_ptr.dtype.element_ty)  # what each token writes, given the state before the chunk
        tl.store(u_ptrs, v_new.to(u_ptr.dtype.element_ty), mask=mv[None, :])
        gc = tl.cumsum(g, 0)
        g_last = tl.sum(g, 0)  # padded rows add nothing
        k_to_end = k * tl.exp(g_last - gc)[:, None]
        S = S * tl.exp(g_last) + _mm(tl.trans(k_to_end), v_new, PRECISION, w_ptr.dtype.element_ty)
    tl.store(final_ptr + s.to(tl.int64) * H * DK * DV + state_off, S, mask=m2)


@triton.jit
def _chunk_output_kernel(q_ptr, q_stride, k_ptr, k_stride, g_ptr, g_stride, alog_ptr, dtb_ptr, vn_ptr, chunks_ptr,
                         num_chunks, h_ptr, o_ptr, scale, H, DK, DV, REP: tl.constexpr, C: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr, RAW: tl.constexpr):
    # One chunk's outputs (flash-linear-attention's chunk_fwd_o): from the state before the chunk, and within
    # the chunk from its new values under the causal decay mask. No chunk waits for another.
    c, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, C)
    offs_k, offs_v = tl.arange(0, BK), vb * BV + tl.arange(0, BV)
    mk, mv = offs_k < DK, offs_v < DV
    t0 = tl.load(chunks_ptr + c)
    n = tl.load(chunks_ptr + num_chunks + c)
    mr = rows < n
    tok = (t0 + rows).to(tl.int64)
    q = _load_qk(q_ptr, q_stride, tok, mr, h // REP, DK, BK, RAW) * scale
    k = _load_qk(k_ptr, k_stride, tok, mr, h // REP, DK, BK, RAW)
    g, _ = _load_gates(g_ptr, g_stride, g_ptr, g_stride, tok, mr, h, alog_ptr, dtb_ptr, RAW)
    gc = tl.cumsum(g, 0)
    S = tl.load(h_ptr + c.to(tl.int64) * H * DK * DV + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :],
                mask=mk[:, None] & mv[None, :], other=0.0)
    row = (c * C + rows).to(tl.int64)
    v_new = tl.load(vn_ptr + (row[:, None] * H + h) * DV + offs_v[None, :], mask=mv[None, :], other=0.0)
    causal = rows[:, None] >= rows[None, :]
    dt: tl.constexpr = vn_ptr.dtype.element_ty
    attn = _mm(q, tl.trans(k), PRECISION, dt) * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    o = _mm(q * tl.exp(gc)[:, None], S, PRECISION, dt) + _mm(attn, v_new, PRECISION, dt)
    tl.store(o_ptr + (tok[:, None] * H + h) * DV + offs_v[None, :], o, mask=mr[:, None] & mv[None, :])


@functools.lru_cache(maxsize=8)
def _chunk_table(seq_lens: tuple[int, ...], counts: tuple[tuple[int, ...], ...], c: int, device: torch.device
                 ) -> tuple[torch.Tensor, int, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """The chunked rule's int32 table, one host copy per step's shape, shared by its layers (read only):
    per chunk its first row and its tokens; per sequence its first chunk, its number of chunks, its first
    row and its tokens; then the chunks whose starting state is a state asked for. Also the chunk count,
    ``(sequence, token count)`` of those states in table order, and of the states asked at a sequence's end
    (its final state)."""
    lens = np.array(seq_lens)
    n_chunks = -(-lens // c)
    firsts = np.concatenate(([0], np.cumsum(n_chunks)[:-1]))
    seq_starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    j = np.arange(int(n_chunks.sum())) - np.repeat(firsts, n_chunks)  # each chunk's place in its sequence
    starts = np.repeat(seq_starts, n_chunks) + j * c
    sizes = np.minimum(c, np.repeat(lens, n_chunks) - j * c)
    gather, kept, at_end = [], [], []
    for i, wanted in enumerate(counts):
        for n in wanted:
            if n // c < n_chunks[i]:  # the state after n tokens is the one before chunk n / c
                gather.append(firsts[i] + n // c)
                kept.append((i, n))
            else:
                at_end.append((i, n))
    table = np.concatenate([starts, sizes, firsts, n_chunks, seq_starts, lens, gather]).astype(np.int32)
    return torch.from_numpy(table).to(device), len(starts), tuple(kept), tuple(at_end)


def chunk_gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, seq_lens: list[int],
                                  initial_states: list[torch.Tensor | None] | None = None, scale: float | None = None,
                                  chunk_size: int = 64, states_out: list[dict[int, torch.Tensor]] | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`infer.kernels.gated_delta_reference.chunk_gated_delta_rule_varlen` in three kernels (same
    arguments, same values; read the reference's docstring for the UT transform and the chunk-to-chunk
    recurrence):

    * ``_chunk_prepare_kernel``, one program per (chunk, head), every chunk of every sequence at once: the
      chunk's ``L = (beta k) k^T`` under the decay mask, ``(I + L)^-1`` in blocks of 16 rows (each diagonal
      block by forward substitution, one row at a time in registers; the blocks below by matrix products),
      and the WY form's ``W`` and ``U``;
    * ``_chunk_recurrence_kernel``, one program per (sequence, head, ``BV`` state columns), walking the
      sequence's chunks in order with its state tile in registers: the state before each chunk (stored),
      the chunk's new values (over ``U``) and the state carried to the next chunk;
    * ``_chunk_output_kernel``, one program per (chunk, head, 64 value columns), every chunk at once: the
      outputs from the state before the chunk and, within it, from its new values under the causal decay
      mask. The walk is the only sequential part, so it keeps two products a chunk and the outputs' three
      run in parallel (flash-linear-attention splits ``chunk_fwd_h`` and ``chunk_fwd_o`` the same way), at
      the price of a float32 state a chunk and head in memory (``T / 64 * H * Dk * Dv * 4`` bytes: 512 MiB
      for 16,384 tokens of Qwen3.5-4B, freed on return; H200, 16,384 tokens: 3.3 -> 2.7 ms, 2.0 with the 16-bit
      products below).

    The states ``states_out`` asks for (prefix caching's snapshots, float32) are rows of that buffer, the
    state before the chunk that follows (or the final state), gathered in one copy.

    Three launches a layer for the step's prefills, against the reference's ~100 small ones. The inputs may
    be float32 (IEEE products: the reference's values) or bf16 / fp16: the UT transform in float32 tiles
    with TF32 products, then ``W``, ``U`` and the new values stored in the inputs' dtype and the walk's and
    the outputs' products taken with 16-bit operands, accumulated in float32 (flash-linear-attention's
    choice; the chunk states and the snapshots stay float32).

    Args:
        q, k: ``[T, H, Dk]`` (L2-normalized, one key head per value head); v: ``[T, H, Dv]``;
        g, beta: ``[T, H]``; ``T = sum(seq_lens)``; initial_states: per sequence float32 ``[H, Dk, Dv]`` or
        None; states_out: per sequence, token counts (multiples of ``chunk_size``) to fill in.

    Returns:
        ``(o [T, H, Dv] float32, final states [B, H, Dk, Dv] float32)``.

    Raises:
        ValueError: lengths that do not add up to ``T``, a ``states_out`` count off the chunks, or a chunk
            size other than 64.
    """
    t, h, dk = k.shape
    reference.check_seq_lens(seq_lens, t)
    q, k, v = (x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous() for x in (q, k, v))
    return _chunk_rule(q, k, v, g.float(), beta.float(), None, None, 1, False, h, dk, v.shape[-1], seq_lens,
                       initial_states, scale, chunk_size, states_out)


def prefill_rule(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int, seq_lens: list[int],
                 initial_states: list[torch.Tensor | None] | None = None,
                 states_out: list[dict[int, torch.Tensor]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`infer.kernels.gated_delta_reference.prefill_rule` in the same three kernels: they read q, k and v
    from the convolution's output and L2-normalize q and k themselves (each value head reading its key
    head), and compute the gating from ``a`` and ``b``, as the decode step's kernel does: no copies of q, k
    and v and no gating kernels before them.

    Args:
        y: ``[T, C]`` the convolution's output (q, k, v channels; rows may be strided); a, b: ``[T, Hv]``
        the projections'; A_log, dt_bias: ``[Hv]``; the rest as :func:`chunk_gated_delta_rule_varlen`'s.

    Returns:
        ``(o [T, Hv, Dv] float32, final states [B, Hv, Dk, Dv] float32)``.

    Raises:
        ValueError: as :func:`chunk_gated_delta_rule_varlen`.
    """
    reference.check_seq_lens(seq_lens, y.shape[0])
    y, a, b = (x if x.stride(1) == 1 else x.contiguous() for x in (y, a, b))  # (the reference convolution's y)
    key_dim = num_k_heads * head_k_dim
    q, k, v = y[:, :key_dim], y[:, key_dim:2 * key_dim], y[:, 2 * key_dim:]
    return _chunk_rule(q, k, v, a, b, A_log, dt_bias, num_v_heads // num_k_heads, True, num_v_heads, head_k_dim,
                       head_v_dim, seq_lens, initial_states, None, reference.CHUNK_SIZE, states_out)


def _chunk_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                A_log: torch.Tensor | None, dt_bias: torch.Tensor | None, rep: int, raw: bool, h: int, dk: int, dv: int,
                seq_lens: list[int], initial_states: list[torch.Tensor | None] | None, scale: float | None,
                chunk_size: int, states_out: list[dict[int, torch.Tensor]] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both kernels over rows whose head ``i`` starts at column ``i * D`` (q, k: key heads, ``rep`` value
    heads each; ``raw``: q and k not yet normalized, ``g`` / ``beta`` the projections' ``a`` / ``b``)."""
    t = q.shape[0]
    if chunk_size != reference.CHUNK_SIZE:
        raise ValueError(f"the Triton chunked rule works in chunks of {reference.CHUNK_SIZE}, got {chunk_size}")
    reference.check_states_out(seq_lens, states_out, chunk_size)
    wanted = states_out or [{} for _ in seq_lens]
    c = chunk_size
    table, total, kept, at_end = _chunk_table(
        tuple(int(n) for n in seq_lens), tuple(tuple(sorted(int(n) for n in counts if n)) for counts in wanted), c,
        q.device)
    n_seqs = len(seq_lens)
    chunks, seqs, gather = table[:2 * total], table[2 * total:2 * total + 4 * n_seqs], table[2 * total + 4 * n_seqs:]
    s0 = reference.stacked_initial_states(initial_states, len(seq_lens), h, dk, dv, q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # the walk's and the outputs' products: 16-bit operands on 16-bit inputs (W, U and the new values kept so)
    walk_precision = "16-bit" if q.dtype in (torch.bfloat16, torch.float16) else precision
    wu_dtype = q.dtype if walk_precision == "16-bit" else torch.float32
    w = torch.empty(total * c, h, dk, dtype=wu_dtype, device=q.device)
    u = torch.empty(total * c, h, dv, dtype=wu_dtype, device=q.device)
    o = torch.empty(t, h, dv, dtype=torch.float32, device=q.device)
    finals = torch.empty_like(s0)
    alog, dtb = (A_log, dt_bias) if raw else (g, g)  # (unread without raw)
    bk, bv_prep, bv = triton.next_power_of_2(dk), triton.next_power_of_2(dv), min(32, triton.next_power_of_2(dv))
    _chunk_prepare_kernel[(total, h)](k, k.stride(0), v, v.stride(0), g, g.stride(0), beta, beta.stride(0), alog, dtb,
                                      chunks, total, w, u, h, dk, dv, REP=rep, BK=bk, BV=bv_prep, PRECISION=precision,
                                      RAW=raw, num_warps=4)
    hs = torch.empty(total, h, dk, dv, dtype=torch.float32, device=q.device)  # the state before each chunk
    _chunk_recurrence_kernel[(n_seqs, h, triton.cdiv(dv, bv))](
        k, k.stride(0), g, g.stride(0), alog, dtb, w, u, seqs, n_seqs, s0, hs, finals, h, dk, dv, REP=rep, C=c, BK=bk,
        BV=bv, PRECISION=walk_precision, RAW=raw, num_warps=4, num_stages=2)
    bv_out = min(64, triton.next_power_of_2(dv))
    _chunk_output_kernel[(total, h, triton.cdiv(dv, bv_out))](
        q, q.stride(0), k, k.stride(0), g, g.stride(0), alog, dtb, u, chunks, total, hs, o,
        dk ** -0.5 if scale is None else scale, h, dk, dv, REP=rep, C=c, BK=bk, BV=bv_out, PRECISION=walk_precision,
        RAW=raw, num_warps=4)
    for i, counts in enumerate(wanted):
        if 0 in counts:
            counts[0] = s0[i].clone()
    snapshots = hs.index_select(0, gather) if kept else None  # (one copy: hs itself is freed on return)
    for r, (i, n) in enumerate(kept):
        wanted[i][n] = snapshots[r]
    for i, n in at_end:
        wanted[i][n] = finals[i].clone()
    return o, finals
