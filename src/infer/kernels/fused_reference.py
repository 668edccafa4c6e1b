"""Plain-PyTorch versions of the fused operations of :mod:`infer.kernels.fused_triton`.

Same names, same signatures, same in-place behaviour: the tests compare each Triton kernel against
the function of the same name here, and a model with ``fused_kernels`` on calls these where Triton
cannot run (the CPU). Each is written with the fewest PyTorch operations that give

* in float32, *exactly* the values of the unfused code in :mod:`infer.models.layers` (bit for bit;
  the tests check it), and
* in bfloat16/float16, the same rounding steps as that code, except where a docstring says otherwise
  (the rotary embedding is computed in float32 and rounded once).

The operations (vLLM's names and semantics, Kwon et al., SOSP 2023):

* :func:`rms_norm`: RMSNorm, Llama's or Gemma's ``(1 + w)`` form, optionally into ``out``.
* :func:`fused_add_rms_norm`: ``residual += x`` then ``x = rms_norm(residual)``, both in place.
* :func:`qk_norm_rope`: split a merged QKV projection, per-head RMSNorm of q and k (Qwen3, Gemma 3),
  rotary embedding from a precomputed cos/sin cache (:func:`build_cos_sin_cache`), in place.
* :func:`act_and_mul`: ``act(gate) * up`` of a merged gate/up projection (SwiGLU, GeGLU).

One caveat on exactness, a property of PyTorch's CPU kernels and not of the fusion: an element-wise
``exp`` over a row whose length is not a multiple of 16 computes the last elements of each row with
the scalar libm function instead of the vectorized one (they may differ by 1 float32 ulp). The gate
of :func:`act_and_mul` is a strided view (one row segment per token) while the unfused code's gate is
a contiguous tensor, so for an intermediate size not a multiple of 16 a few elements can differ by 1
ulp in float32. Every real model's intermediate size is a multiple of 16.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from infer.kernels.activations import ACTIVATION_NAMES
from infer.kernels.attention_reference import reshape_and_cache

__all__ = ["rms_norm", "fused_add_rms_norm", "qk_norm_rope", "gated_qk_norm_rope", "sigmoid_gate_mul",
           "act_and_mul", "build_cos_sin_cache",
           "ACTIVATION_NAMES", "linear", "linear_residual", "add_rms_norm", "add_rms_norm_linear"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)



# ============================================================================ RMSNorm


def _normalize(h: torch.Tensor, eps: float) -> torch.Tensor:
    """``h * rsqrt(mean(h^2, -1) + eps)`` for float32 ``h``: layers.rms_norm's statistics, with the add
    and rsqrt in place on the small ``[..., 1]`` tensor (same values). ``F.rms_norm`` without a weight
    gives bit-identical values too, but measured ~2x slower than these five ops on a CPU row of 576."""
    return h * h.pow(2).mean(dim=-1, keepdim=True).add_(eps).rsqrt_()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Root-mean-square layer norm (Zhang & Sennrich, 2019, arXiv:1910.07467) of each row.

    ``y = x / sqrt(mean(x^2) + eps) * w`` with the statistics in float32, exactly as
    :func:`infer.models.layers.rms_norm`: Llama/Qwen cast the normalized row to ``x.dtype`` and then
    multiply by ``w`` in ``x.dtype``; Gemma (``unit_offset=True``) multiplies by ``(1 + w)`` in float32
    and casts last.

    Args:
        x: ``[T, d]``, float32, float16 or bfloat16; rows may be strided, the last dimension must be
            contiguous.
        weight: ``[d]``, ``x``'s dtype and device.
        eps: added to the mean square.
        unit_offset: Gemma's ``(1 + w)`` form.
        out: optional ``[T, d]`` in ``x``'s dtype (last dimension contiguous); may be ``x`` itself.

    Returns:
        ``out`` (a new tensor if None), ``[T, d]`` in ``x.dtype``.

    Raises:
        ValueError: wrong rank or shapes, unsupported or mismatched dtypes, different devices, a
            non-contiguous last dimension.
    """
    check_rms_norm(x, weight, out)
    return _rms_norm(x, weight, eps, unit_offset, out)


def _rms_norm(x, weight, eps, unit_offset, out):
    h = _normalize(x.float(), eps)
    if unit_offset:
        # float32 product, rounded once when stored into x.dtype
        if out is None:
            return h.mul_(1.0 + weight.float()).to(x.dtype)
        return torch.mul(h, 1.0 + weight.float(), out=out)
    y = h.to(x.dtype)  # the rounding step of Llama's order (a no-op in float32)
    if out is None:
        return y.mul_(weight)
    return torch.mul(y, weight, out=out)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with the next RMSNorm, in place (vLLM's ``fused_add_rms_norm``).

    ``residual <- x + residual`` rounded to ``x.dtype`` (exactly what ``h = h + attn_out`` gives), then
    ``x <- rms_norm(residual, weight, eps, unit_offset)`` (:func:`rms_norm`'s numerics). Both
    buffers are overwritten: after the call ``x`` holds the normalized rows and ``residual`` the new
    residual stream.

    Args:
        x: ``[T, d]`` (e.g. the attention or MLP output), float32/float16/bfloat16, last dimension
            contiguous. Overwritten with the normalized rows.
        residual: ``[T, d]``, ``x``'s dtype and device, not overlapping ``x``. Overwritten with
            ``x + residual``.
        weight: ``[d]``, ``x``'s dtype.
        eps, unit_offset: as in :func:`rms_norm`.

    Returns:
        ``(x, residual)``: the same tensor objects, now ``(normed, new_residual)``.

    Raises:
        ValueError: as :func:`rms_norm`, plus a residual of another shape, dtype or device, or one
            that shares memory with ``x``.
    """
    check_add_rms_norm(x, residual, weight)
    residual.add_(x)
    _rms_norm(residual, weight, eps, unit_offset, x)
    return x, residual


# ============================================================================ QK-norm + RoPE


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, device: torch.device | str) -> torch.Tensor:
    """The rotary table of :func:`qk_norm_rope`: float32 ``[max_positions, head_dim]``.

    Row ``p`` holds ``cos(p * inv_freq)`` in its first ``head_dim / 2`` columns and ``sin(p * inv_freq)``
    in the last ``head_dim / 2``, the angle computed in float32 exactly as
    :func:`infer.models.layers.rope_cos_sin` computes it (so that the values are bit-identical to its
    tables on the same device). Gemma 3 needs one table per RoPE base (local and global layers).

    Args:
        inv_freq: float32 ``[head_dim / 2]`` (:func:`infer.models.layers.rope_inv_freq`).
        max_positions: number of rows (positions ``0 .. max_positions - 1``), >= 1.
        device: where the table is built and lives.

    Raises:
        ValueError: ``inv_freq`` not 1-D float32, ``max_positions < 1``.
    """
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be float32 [head_dim / 2], got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions must be a positive int, got {max_positions!r}")
    positions = torch.arange(max_positions, device=device, dtype=torch.int64)
    freqs = positions.float()[:, None] * inv_freq.to(device)[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


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
    """Split a merged QKV projection, RMS-normalize q and k per head, rotate them (RoPE), in place;
    with ``kv_cache``, also store the new K/V into the KV cache.

    ``qkv[t] = [q heads | k heads | v heads]`` (``num_heads``, ``num_kv_heads``, ``num_kv_heads`` heads of
    ``head_dim``). With ``q_weight``/``k_weight`` (Qwen3's and Gemma 3's QK-norm), each q and k head is
    normalized as :func:`rms_norm` does (same rounding steps to ``qkv.dtype``). Then both are rotated
    in the "rotate half" layout of GPT-NeoX and Hugging Face (Su et al., RoFormer, arXiv:2104.09864):
    for ``i < head_dim / 2`` and ``c, s = cos, sin(position * inv_freq[i])``::

        x'[i]        = x[i] * c - x[i + D/2] * s
        x'[i + D/2]  = x[i + D/2] * c + x[i] * s

    computed in float32 and rounded once to ``qkv.dtype``. In float32 this is bit-identical to
    :func:`infer.models.layers.apply_rope`. In bfloat16/float16 that function rounds cos/sin to the
    dtype and then each product and the sum (four roundings): where the two products cancel it is off
    by up to ~100 ulps *of the result*, while this form is correctly rounded (within half an ulp of a
    float64 evaluation). The two differ by at most 2 ulps of ``|x[i]| + |x[i + D/2]|`` (measured and
    tested; it is also the analytic bound of the four roundings).

    The q and k columns of ``qkv`` are overwritten with the result; v is not touched.

    Args:
        qkv: ``[T, (num_heads + 2 * num_kv_heads) * head_dim]``, float32/float16/bfloat16, last
            dimension contiguous (rows may be strided).
        positions: int64 or int32 ``[T]``, each in ``[0, max_positions)``. Out of range is a caller
            error: here it raises IndexError (on the CPU; an asynchronous device assert on a GPU); the
            Triton kernel reads the nearest valid row instead (it cannot check without a host sync).
        cos_sin_cache: float32 ``[max_positions, head_dim]`` from :func:`build_cos_sin_cache`, contiguous.
        num_heads, num_kv_heads, head_dim: the layout of ``qkv``; ``head_dim`` even.
        q_weight, k_weight: ``[head_dim]`` in ``qkv``'s dtype, both or neither.
        eps, unit_offset: as in :func:`rms_norm`.
        kv_cache: ``(k_cache, v_cache)``, one layer's ``[num_blocks, block_size, num_kv_heads,
            head_dim]`` in ``qkv``'s dtype: the rotated k and the v of token ``t`` are stored at flat
            slot ``slot_mapping[t]`` (:func:`infer.kernels.attention_reference.reshape_and_cache`; the
            Triton kernel does it in the same launch, as vLLM's and SGLang's fused RoPE kernels do).
        slot_mapping: int64 ``[T]`` with ``kv_cache``; negative slots are skipped (padding).
        kv_scales: an FP8 cache (float8_e4m3fn, phase 11): the layer's float32 ``[1]`` ``(k_scale,
            v_scale)`` (None: 1.0); k and v are stored as ``x / scale`` rounded to e4m3.

    Returns:
        ``(q, k, v)``: views of ``qkv``, ``[T, num_heads, head_dim]``, ``[T, num_kv_heads, head_dim]``,
        ``[T, num_kv_heads, head_dim]`` (strided: row stride ``qkv.stride(0)``).

    Raises:
        ValueError: shapes that do not match the head counts, an odd ``head_dim``, unsupported or
            mismatched dtypes or devices, a non-contiguous last dimension or cache, one norm weight
            without the other.
    """
    check_qk_norm_rope(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, q_weight, k_weight)
    t, hq, h, d = qkv.shape[0], num_heads, num_heads + num_kv_heads, head_dim
    half = d // 2
    heads = qkv.view(t, h + num_kv_heads, d)
    qk = heads[:, :h]
    x = qk.float()  # float32 input: x *is* qk, but every product below is taken before any write
    if q_weight is not None:
        y = _normalize(x, eps)
        w = torch.cat((q_weight.expand(hq, d), k_weight.expand(num_kv_heads, d)))  # [Hq + Hkv, D], fresh
        if unit_offset:
            x = y.mul_(w.float().add_(1.0)).to(qkv.dtype).float()
        else:
            x = y.to(qkv.dtype).mul_(w).float()
    cs = cos_sin_cache[positions]  # [T, D] float32
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    a, b = x1 * cos, x2 * sin
    c, e = x2 * cos, x1 * sin
    torch.sub(a, b, out=qk[..., :half])  # float32 results, rounded once into qkv's dtype
    torch.add(c, e, out=qk[..., half:])
    q, k, v = heads[:, :hq], heads[:, hq:h], heads[:, h:]
    if kv_cache is not None:
        check_cache_write(qkv, kv_cache, slot_mapping, num_kv_heads, head_dim)
        reshape_and_cache(k, v, *kv_cache, slot_mapping, *(kv_scales or (None, None)))
    return q, k, v


def gated_qk_norm_rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int, rotary_dim: int, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       unit_offset: bool = True, kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                       slot_mapping: torch.Tensor | None = None,
                       kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated attention of Qwen3.5 / Qwen3-Next (phase 17) before its attention: split the merged
    projection, RMS-normalize q and k per head, rotate their first ``rotary_dim`` dimensions (partial RoPE).

    ``qkv[t] = [q_0 | gate_0 | q_1 | gate_1 | ... | k heads | v heads]``: each query head is followed by its
    output gate (``2 D`` columns a head), then ``num_kv_heads`` k and v heads of ``D``. Each q and k head
    is normalized as :func:`rms_norm` does (its rounding steps to ``qkv.dtype``); then dimensions ``i <
    rotary_dim / 2`` and ``i + rotary_dim / 2`` are rotated as in :func:`qk_norm_rope` (float32, rounded
    once), the dimensions from ``rotary_dim`` on pass through. In float32 these are the values of the
    unfused steps (``rms_norm``, :func:`infer.models.layers.apply_rope` on the first ``rotary_dim``).

    Args:
        qkv: ``[T, (2 num_heads + 2 num_kv_heads) D]``, last dimension contiguous; its k columns are
            overwritten.
        cos, sin: float32 ``[T, rotary_dim]`` (:func:`infer.models.layers.rope_cos_sin`: the halves equal).
        q_weight, k_weight: ``[D]``; eps, unit_offset: as in :func:`rms_norm` (Qwen3.5: ``1 + w``).
        kv_cache, slot_mapping, kv_scales: as in :func:`qk_norm_rope`: the rotated k and v also stored into
            the KV cache.

    Returns:
        ``(q, k, v, gate)``: ``q`` a new contiguous ``[T, Hq, D]``; ``k`` (rotated), ``v`` and ``gate`` views of
        ``qkv``, ``[T, Hkv, D]``, ``[T, Hkv, D]`` and ``[T, Hq, D]``.

    Raises:
        ValueError: a ``qkv`` whose width is not the heads', an odd ``rotary_dim`` or one past ``D``, cos /
            sin tables of another shape or dtype.
    """
    check_gated_qk_norm_rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim, rotary_dim)
    d, half = head_dim, rotary_dim // 2
    qg, k, v = split_gated_qkv(qkv, num_heads, num_kv_heads, head_dim)
    c, s = cos[:, None, :half], sin[:, None, :half]

    def norm_rope(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # float32 [T, H, D]
        y = _normalize(x.float(), eps)
        x = (y * (1.0 + w.float())).to(qkv.dtype).float() if unit_offset else y.to(qkv.dtype).mul(w).float()
        # >>> EXERCISE partial_rope
        x1, x2 = x[..., :half], x[..., half:2 * half]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]), dim=-1)
        # <<< EXERCISE partial_rope

    q = norm_rope(qg[..., :d], q_weight).to(qkv.dtype)
    k.copy_(norm_rope(k, k_weight))
    if kv_cache is not None:
        check_cache_write(qkv, kv_cache, slot_mapping, num_kv_heads, head_dim)
        reshape_and_cache(k, v, *kv_cache, slot_mapping, *(kv_scales or (None, None)))
    return q, k, v, qg[..., d:]


def sigmoid_gate_mul(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gated attention's output gate: ``o * sigmoid(gate)`` in float32, rounded once to ``o.dtype``.

    Args:
        o: ``[T, H, D]`` or ``[T, H D]``, contiguous (the attention's output).
        gate: ``[T, H, D]`` (:func:`gated_qk_norm_rope`'s view; rows and heads may be strided).

    Returns:
        A new ``[T, H D]`` tensor, the input of ``o_proj``.
    """
    check_sigmoid_gate_mul(o, gate)
    t, h, d = gate.shape
    return (o.float().view(t, h, d) * torch.sigmoid(gate.float())).to(o.dtype).view(t, h * d)


def split_gated_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated attention's merged projection output as views: ``qg [T, Hq, 2 D]`` (each query head, then its
    gate), ``k`` and ``v`` ``[T, Hkv, D]``."""
    t, nq = qkv.shape[0], num_heads * 2 * head_dim
    return (qkv[:, :nq].view(t, num_heads, 2 * head_dim),
            qkv[:, nq:nq + num_kv_heads * head_dim].view(t, num_kv_heads, head_dim),
            qkv[:, nq + num_kv_heads * head_dim:].view(t, num_kv_heads, head_dim))


def check_sigmoid_gate_mul(o: torch.Tensor, gate: torch.Tensor) -> None:
    t, h, d = gate.shape
    if o.numel() != t * h * d or not o.is_contiguous() or gate.stride(-1) != 1:
        raise ValueError(f"sigmoid_gate_mul: o {tuple(o.shape)} (contiguous) and gate {tuple(gate.shape)} (last "
                         f"dimension contiguous) must hold the same T x H x D values")


def check_gated_qk_norm_rope(qkv, cos, sin, num_heads, num_kv_heads, head_dim, rotary_dim) -> None:
    _check_float(qkv, "qkv")
    if qkv.dim() != 2 or qkv.shape[1] != (2 * num_heads + 2 * num_kv_heads) * head_dim or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be [T, {(2 * num_heads + 2 * num_kv_heads) * head_dim}] (q and gate, k, v heads "
                         f"of {head_dim}) with a contiguous last dimension, got {tuple(qkv.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (qkv.shape[0], rotary_dim) or table.dtype != torch.float32 or table.device != qkv.device:
            raise ValueError(f"{name} must be float32 [{qkv.shape[0]}, {rotary_dim}] on {qkv.device}, got "
                             f"{table.dtype} {tuple(table.shape)}")


def check_cache_write(qkv: torch.Tensor, kv_cache, slot_mapping, num_kv_heads: int, head_dim: int) -> None:
    """The ``kv_cache`` and ``slot_mapping`` arguments of :func:`qk_norm_rope`.

    Raises:
        ValueError: not a pair of equal ``[num_blocks, block_size, num_kv_heads, head_dim]`` caches in
            ``qkv``'s dtype and device with a contiguous last dimension, or ``slot_mapping`` not int64
            ``[T]`` on that device.
    """
    if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
        raise ValueError("kv_cache must be a (k_cache, v_cache) pair")
    k_cache, v_cache = kv_cache
    want = (num_kv_heads, head_dim)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[2:]) != want:
            raise ValueError(f"{name} must be [num_blocks, block_size, {num_kv_heads}, {head_dim}], "
                             f"got shape {tuple(c.shape)}")
        if (c.dtype != qkv.dtype and c.dtype != torch.float8_e4m3fn) or c.device != qkv.device:
            raise ValueError(f"{name} is {c.dtype} on {c.device}; qkv is {qkv.dtype} on {qkv.device}")
        if c.stride(3) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (strides {c.stride()})")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must have the same shape and strides "
                         f"({tuple(k_cache.shape)} {k_cache.stride()} vs {tuple(v_cache.shape)} {v_cache.stride()})")
    if (not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64
            or slot_mapping.shape != (qkv.shape[0],) or slot_mapping.device != qkv.device):
        raise ValueError(f"slot_mapping must be an int64 [T={qkv.shape[0]}] tensor on {qkv.device}")


# ============================================================================ act(gate) * up


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of a merged gate/up projection: SwiGLU (Shazeer, arXiv:2002.05202) with
    ``activation="silu"``, GeGLU with tanh-approximated GELU (``"gelu_tanh"``, also
    ``"gelu_pytorch_tanh"``) for Gemma.

    Here exactly ``F.silu(gate) * up`` / ``F.gelu(gate, approximate="tanh") * up`` in ``gate_up.dtype``
    (two roundings in 16-bit dtypes, as in the unfused MLP). The Triton kernel rounds once.

    Args:
        gate_up: ``[T, 2 * I]``, gate in the first ``I`` columns, up in the last ``I``;
            float32/float16/bfloat16, last dimension contiguous.
        activation: ``"silu"``, ``"gelu_tanh"`` or ``"gelu_pytorch_tanh"``.

    Returns:
        A new ``[T, I]`` tensor in ``gate_up.dtype``.

    Raises:
        ValueError: an unknown activation, a rank other than 2, an odd last dimension, an unsupported
            dtype, a non-contiguous last dimension.
    """
    kind = check_act_and_mul(gate_up, activation)
    i = gate_up.shape[1] // 2
    gate, up = gate_up[:, :i], gate_up[:, i:]
    act = F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh")
    return act.mul_(up)


# ============================================================================ input checks (shared
# with fused_triton, so that both raise the same errors)


def _check_float(x: torch.Tensor, name: str) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [T, d], got shape {tuple(x.shape)}")
    _check_float(x, name)
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (strides {x.stride()})")


def _check_like(y: torch.Tensor, x: torch.Tensor, name: str, xname: str, shape=None) -> None:
    shape = tuple(x.shape) if shape is None else shape
    if tuple(y.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(y.shape)}")
    if y.dtype != x.dtype:
        raise ValueError(f"{name} dtype {y.dtype} differs from {xname}'s {x.dtype}")
    if y.device != x.device:
        raise ValueError(f"{name} is on {y.device}, {xname} on {x.device}")


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    _check_rows(x, "x")
    _check_like(weight, x, "weight", "x", (x.shape[1],))
    if out is not None:
        _check_like(out, x, "out", "x")
        if out.shape[1] > 1 and out.stride(1) != 1:
            raise ValueError(f"out must have a contiguous last dimension (strides {out.stride()})")


def check_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    check_rms_norm(x, weight, None)
    _check_like(residual, x, "residual", "x")
    if residual.shape[1] > 1 and residual.stride(1) != 1:
        raise ValueError(f"residual must have a contiguous last dimension (strides {residual.stride()})")
    t, d = x.shape
    if t:  # byte ranges [first, last element] of the two (rows may be strided)
        lo_x, lo_r, item = x.data_ptr(), residual.data_ptr(), x.element_size()
        if lo_x < lo_r + ((t - 1) * residual.stride(0) + d) * item and lo_r < lo_x + ((t - 1) * x.stride(0) + d) * item:
            raise ValueError("x and residual must not overlap (both are written)")


def check_qk_norm_rope(qkv, positions, cos_sin_cache, num_heads, num_kv_heads, head_dim, q_weight, k_weight):
    _check_rows(qkv, "qkv")
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for the rotary embedding, got {head_dim}")
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[1] != width:
        raise ValueError(f"qkv must be [T, (num_heads + 2 * num_kv_heads) * head_dim = {width}], got shape "
                         f"{tuple(qkv.shape)}")
    if positions.dim() != 1 or positions.shape[0] != qkv.shape[0]:
        raise ValueError(f"positions must be [T={qkv.shape[0]}], got shape {tuple(positions.shape)}")
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be int64 or int32, got {positions.dtype}")
    if positions.device != qkv.device:
        raise ValueError(f"positions is on {positions.device}, qkv on {qkv.device}")
    if positions.shape[0] > 1 and positions.stride(0) != 1:
        raise ValueError(f"positions must be contiguous (stride {positions.stride()})")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.shape[0] < 1:
        raise ValueError(f"cos_sin_cache must be [max_positions, head_dim={head_dim}], got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be float32, got {cos_sin_cache.dtype}")
    if cos_sin_cache.device != qkv.device:
        raise ValueError(f"cos_sin_cache is on {cos_sin_cache.device}, qkv on {qkv.device}")
    if not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight go together: pass both (QK-norm) or neither")
    if q_weight is not None:
        _check_like(q_weight, qkv, "q_weight", "qkv", (head_dim,))
        _check_like(k_weight, qkv, "k_weight", "qkv", (head_dim,))


def check_act_and_mul(gate_up: torch.Tensor, activation: str) -> str:
    if activation not in ACTIVATION_NAMES:
        raise ValueError(f"unsupported activation {activation!r} (supported: {', '.join(ACTIVATION_NAMES)})")
    _check_rows(gate_up, "gate_up")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2 * I] (gate, then up), got an odd width {gate_up.shape[1]}")
    return ACTIVATION_NAMES[activation]


# ============================================================================ projections


#: the most rows (tokens) for which :func:`linear` splits a CPU product's inner dimension over the threads;
#: measured on 2 cores (SmolLM2 shapes): faster at every row count up to 64, by 1.3-2x up to 8
SPLIT_K_MAX_ROWS = 16


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """``layer(x)`` for ``x [T, in]``. (The Triton twin sends one-row products through a skinny GEMM.)

    On a CPU with ``S > 1`` threads, a float32 product of at most :data:`SPLIT_K_MAX_ROWS` rows over a
    column-major weight (the fused forward's CPU layout, :func:`~infer.models.layers.set_weight_layout`:
    ``W.T`` is a contiguous ``[in, out]`` block) is split over its inner dimension instead: one
    ``bmm`` of ``[S, T, in / S] @ [S, in / S, out]``, each thread streaming its own contiguous share
    of the weight, then the ``S`` partial sums added (split-K, as GEMM libraries do for skinny
    products). MKL runs a one-row product on one thread; its memory stream reached 13-25 GB/s on a
    2-core x86 machine, the split one 20-36 GB/s (SmolLM2-135M's per-token products: 29 -> 19 ms),
    provided OpenMP's threads spin briefly between operations (``GOMP_SPINCOUNT``, set by
    :mod:`infer`) instead of sleeping. The sum's order differs from ``layer(x)``'s: equal within
    float32 rounding, not bit for bit. A tensor-parallel layer (its collective) runs as the layer does.
    """
    if not isinstance(layer, torch.nn.Linear):  # a quantized projection (phase 11) runs its own kernel
        return layer(x)
    w, parallel = layer.weight, getattr(layer, "parallel", None)
    t, k = x.shape if x.dim() == 2 else (0, 0)
    s = torch.get_num_threads()
    if (x.device.type != "cpu" or x.dtype != torch.float32 or not 0 < t <= SPLIT_K_MAX_ROWS or s < 2 or k % s
            or w.stride(0) != 1 or not x.is_contiguous() or (parallel is not None and parallel.tp_size > 1)):
        return layer(x)
    n = w.shape[0]
    parts = torch.bmm(x.view(t, s, k // s).transpose(0, 1), w.t().view(s, k // s, n))
    out = parts.sum(0)
    return out if layer.bias is None else out.add_(layer.bias)


def linear_residual(x: torch.Tensor, layer: torch.nn.Linear, residual: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A block's last projection (attention's ``o_proj``, the MLP's ``down_proj``) and the residual stream
    it is added to: ``(h, residual)`` whose sum ``h + residual`` (``h`` when ``residual`` is None) is the
    block's output, ``layer(x) + residual``.

    Here ``(linear(x, layer), residual)``: the add is left to the next norm (:func:`add_rms_norm`), which
    does it in the same pass. The Triton twin does it in the projection's epilogue at one row (batch-1
    decode), returns ``(layer(x) + residual, None)`` and the next norm reads one row instead of two; the
    values are the same (the product rounded, then the sum rounded).

    Args:
        x: ``[T, in]``; layer: the projection (``[d, in]`` weight); residual: ``[T, d]`` or None.

    Returns:
        ``(h [T, d], residual)`` as above.
    """
    return linear(x, layer), residual


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_add_rms_norm` of ``(x, residual)``, or :func:`rms_norm` of ``x`` when ``residual`` is
    None (the first layer, or a residual already added by :func:`linear_residual`). Returns ``(normed,
    new residual stream)``; ``x`` and ``residual`` may be overwritten."""
    return add_norm_steps(sys.modules[__name__], x, residual, weight, eps, unit_offset)


def add_norm_steps(ops, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                   unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` with ``ops``' ``rms_norm`` and ``fused_add_rms_norm`` (this module, or
    :mod:`infer.kernels.fused_triton`)."""
    if residual is None:
        return ops.rms_norm(x, weight, eps, unit_offset), x
    return ops.fused_add_rms_norm(x, residual, weight, eps, unit_offset)


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    layer: torch.nn.Linear,
    activation: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block's "norm, then project" step: :func:`fused_add_rms_norm` (:func:`rms_norm` for
    the first layer, ``residual`` None), then :func:`linear`, then, with an ``activation``,
    :func:`act_and_mul` (``layer`` a merged gate/up projection).

    Here exactly those calls (so the values of the unfused code); at one row (batch-1 decode) the Triton twin
    runs two kernels, the norm, then the projection with the activation in its epilogue.

    Args:
        x: ``[T, d]``: the layer's input (the previous block's output); may be overwritten.
        residual: ``[T, d]`` or None (the first layer: ``x`` is the residual stream); may be overwritten.
        weight, eps, unit_offset: the norm's, as in :func:`rms_norm`.
        layer: the projection (``[N, d]`` weight).
        activation: None, or as in :func:`act_and_mul`.

    Returns:
        ``(y, residual)``: ``y [T, N]`` (``[T, N / 2]`` with an activation) and the new residual stream
        ``x + residual`` (``x`` when ``residual`` was None).

    Raises:
        ValueError: as the functions it calls.
    """
    return norm_linear_steps(sys.modules[__name__], x, residual, weight, eps, unit_offset, layer, activation)


def norm_linear_steps(ops, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      unit_offset: bool, layer: torch.nn.Linear, activation: str | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm_linear` as its separate steps, each taken from ``ops`` (this module, or
    :mod:`infer.kernels.fused_triton`, whose functions have the same names)."""
    x, residual = ops.add_rms_norm(x, residual, weight, eps, unit_offset)
    y = ops.linear(x, layer)
    return (ops.act_and_mul(y, activation) if activation is not None else y), residual
