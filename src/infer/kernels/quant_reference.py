"""Weight-only quantization in plain PyTorch: the formats, quantize / dequantize, and the reference
product that :mod:`infer.kernels.quant_triton` is tested against.

A quantized projection keeps two tensors instead of its ``[N, K]`` weight (``N`` outputs, ``K`` inputs):

* ``qweight``: the quantized values.

  - ``int8``: int8 ``[N, K]``, symmetric, in ``[-127, 127]``;
  - ``fp8``: ``torch.float8_e4m3fn`` ``[N, K]`` (4 exponent bits, 3 mantissa bits, largest value 448);
  - ``int4``: int32 ``[N, K / 8]``: eight 4-bit values per word along ``K``, value ``k`` of a row in bits
    ``4 (k % 8) .. 4 (k % 8) + 3`` of word ``k // 8``, each stored as ``q + 8`` in ``[0, 15]`` for
    ``q`` in ``[-8, 7]``. This is compressed-tensors' ``pack-quantized`` layout (vLLM's
    ``CompressedTensorsWNA16``), so its checkpoints load without repacking.

* ``weight_scale``: float32 ``[ceil(N / br), ceil(K / bc)]``, one scale per block of ``br`` rows and
  ``bc`` columns (the *block*, ``(br, bc)``): ``(1, K)`` is one scale per output channel (``[N, 1]``),
  ``(1, 128)`` one per group of 128 inputs of a row (int4), ``(128, 128)`` the block-wise scales of
  DeepSeek-V3's and Qwen3-FP8's checkpoints. The real weight is ``w[n, k] = q[n, k] *
  weight_scale[n // br, k // bc]``. A last partial block (``K`` not a multiple of ``bc``) is allowed.

* ``weight_zero_point`` (int4 only, *asymmetric*: AWQ, GPTQ with ``sym: false``, compressed-tensors'
  ``W4A16_ASYM``): int8 ``[ceil(N / br), ceil(K / bc)]`` in ``[-8, 7]``, one per scale, and then
  ``w[n, k] = (q[n, k] - zero_point[n // br, k // bc]) * weight_scale[...]``. A zero point may also be
  float32 (any value: GGUF's Q4_1 and Q4_K, whose groups store a minimum ``m`` instead, ``w = d u + m``,
  become ``z = -m / d - 8``; :mod:`infer.loader.gguf_quant`). A group whose weights all
  lie in ``[lo, hi]`` uses all 16 codes for that range instead of for ``[-max|w|, max|w|]``: the step is
  ``(hi - lo) / 15`` instead of ``2 max|w| / 15`` (the same for a symmetric range, up to twice finer for a
  one-sided one). The formats store the zero point as an unsigned nibble ``z + 8`` (GPTQ's original format
  as ``z + 7``); symmetric weights have none (``z = 0``).

Round-to-nearest quantization bounds the error of each weight: for the integer formats
``|w - dequantize(quantize(w))| <= scale / 2`` (the step is ``scale``); for e4m3 the step is relative,
``2^-3`` of the value's binade, so ``|error| <= max(|w| 2^-4, scale 2^-10)`` (the second term: e4m3's
subnormals, spaced ``2^-9``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["INT8_MAX", "FP8_MAX", "INT4_MIN", "INT4_MAX", "quantize", "quantize_asymmetric", "dequantize",
           "pack_int4", "unpack_int4", "quantize_per_token_fp8", "w8a8_linear_reference",
           "expand_scale", "quantized_linear_reference", "check_quantized", "qweight_shape", "scale_shape",
           "default_block", "QDTYPES", "ZERO_POINT_DTYPES"]

INT8_MAX = 127
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
INT4_MIN, INT4_MAX = -8, 7
QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.int32}
#: the dtypes of ``weight_zero_point``: int8 codes (AWQ, GPTQ, compressed-tensors), float32 (GGUF's minimums)
ZERO_POINT_DTYPES = (torch.int8, torch.float32)


def default_block(method: str, in_features: int, group_size: int = 128) -> tuple[int, int]:
    """The block ``(br, bc)`` of online quantization: per output channel for int8 and fp8, groups of
    ``group_size`` inputs for int4."""
    return (1, group_size) if method == "int4" else (1, in_features)


def qweight_shape(method: str, out_features: int, in_features: int) -> tuple[int, int]:
    """``qweight``'s shape for a ``[out_features, in_features]`` weight."""
    return (out_features, in_features // 8) if method == "int4" else (out_features, in_features)


def scale_shape(out_features: int, in_features: int, block: tuple[int, int]) -> tuple[int, int]:
    """``weight_scale``'s shape: ``[ceil(N / br), ceil(K / bc)]``."""
    return (-(-out_features // block[0]), -(-in_features // block[1]))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit values ``q`` (any integer dtype, ``[N, K]`` in ``[-8, 7]``, ``K % 8 == 0``) -> int32
    ``[N, K / 8]`` in the layout of the module docstring."""
    n, k = q.shape
    u = (q.to(torch.int32) + 8).view(n, k // 8, 8)
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int32)
    # bits 28..31 of the last value make the sum overflow int32's sign: the bit pattern is what counts
    return (u << shifts).sum(-1, dtype=torch.int64).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 ``[N, K / 8]`` -> int8 ``[N, K]`` in ``[-8, 7]``."""
    # >>> EXERCISE unpack_int4
    n, w = packed.shape
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    u = (packed[:, :, None] >> shifts) & 0xF  # >> is arithmetic on int32; the mask keeps the 4 bits
    return (u - 8).to(torch.int8).view(n, w * 8)
    # <<< EXERCISE unpack_int4


def expand_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """``weight_scale [ceil(N / br), ceil(K / bc)]`` -> the scale of every weight, float32 ``[N, K]``."""
    n, k = shape
    br, bc = block
    return scale.float().repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :k]


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``max |w|`` over each block, float32 ``[ceil(N / br), ceil(K / bc)]`` (a last partial block padded
    with zeros, which do not change a max of absolute values)."""
    n, k = w.shape
    br, bc = min(block[0], n), min(block[1], k)
    rows, cols = -(-n // br), -(-k // bc)
    a = F.pad(w.float().abs(), (0, cols * bc - k, 0, rows * br - n))
    return a.view(rows, br, cols, bc).amax(dim=(1, 3))


def quantize(w: torch.Tensor, method: str, block: tuple[int, int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric quantization of a ``[N, K]`` float weight.

    The scale of each block is ``max |w| / qmax`` (``qmax`` 127 for int8, 448 for fp8, 7 for int4, so
    the largest value of the block maps to the largest code and nothing overflows); a block of zeros
    gets scale 1. Then ``q = round(w / scale)`` (int8, int4: to the nearest integer; fp8: to the nearest
    e4m3 value, PyTorch's cast).

    Args:
        w: ``[N, K]`` float32/bfloat16/float16 (computed in float32).
        method: ``"int8"``, ``"fp8"`` or ``"int4"``.
        block: ``(br, bc)`` rows and columns per scale; default :func:`default_block`.

    Returns:
        ``(qweight, weight_scale)`` as the module docstring describes them.

    Raises:
        ValueError: an unknown method, a weight that is not 2-D float, int4 with ``K % 8 != 0``.
    """
    if method not in QDTYPES:
        raise ValueError(f"unknown quantization method {method!r} (int8, fp8 or int4)")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"the weight must be a 2-D float tensor, got {w.dtype} {tuple(w.shape)}")
    n, k = w.shape
    if method == "int4" and k % 8:
        raise ValueError(f"int4 packs 8 values per int32 along the inputs: in_features {k} is not a multiple of 8")
    block = block or default_block(method, k)
    qmax = {"int8": INT8_MAX, "fp8": FP8_MAX, "int4": INT4_MAX}[method]
    # >>> EXERCISE symmetric_quantize
    amax = _block_amax(w, block)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    x = w.float() / expand_scale(scale, (n, k), block)
    if method == "fp8":
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    q = x.round().clamp(-qmax, qmax)
    if method == "int8":
        return q.to(torch.int8), scale
    return pack_int4(q.to(torch.int8)), scale
    # <<< EXERCISE symmetric_quantize


def quantize_asymmetric(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest *asymmetric* int4 quantization of a ``[N, K]`` float weight (``K % 8 == 0``): each
    block's range ``[lo, hi]`` (widened to include 0) maps onto the 16 codes, ``scale = (hi - lo) / 15``
    (1 for a block of zeros), unsigned zero point ``u0 = round(-lo / scale)``, codes ``u = clamp(round(w /
    scale) + u0, 0, 15)`` (AWQ's and GPTQ's ``sym: false`` quantizer).

    Returns:
        ``(qweight, weight_scale, weight_zero_point)`` in the layout of the module docstring (codes and zero
        points shifted by -8 into the signed range).

    Raises:
        ValueError: a weight that is not 2-D float, or ``K % 8 != 0``.
    """
    if w.dim() != 2 or not w.is_floating_point() or w.shape[1] % 8:
        raise ValueError(f"int4 needs a 2-D float weight with in_features a multiple of 8, got {w.dtype} "
                         f"{tuple(w.shape)}")
    n, k = w.shape
    lo = -_block_amax((-w.float()).clamp_min(0), block)  # min(w, 0) per block: the max of the negative parts
    hi = _block_amax(w.float().clamp_min(0), block)
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi))
    u0 = (-lo / scale).round().clamp(0, 15)
    u = (w.float() / expand_scale(scale, (n, k), block) + expand_scale(u0, (n, k), block)).round().clamp(0, 15)
    return pack_int4((u - 8).to(torch.int8)), scale, (u0 - 8).to(torch.int8)


def dequantize(qweight: torch.Tensor, weight_scale: torch.Tensor, method: str, block: tuple[int, int],
               dtype: torch.dtype = torch.float32, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """The real weight ``[N, K]``: ``(q - zero_point) * scale`` (``q * scale`` without zero points) computed in
    float32, rounded once to ``dtype``."""
    q = (unpack_int4(qweight) if method == "int4" else qweight).float()
    (n, k), (br, bc) = q.shape, block
    if zero_point is not None:
        q.sub_(expand_scale(zero_point, (n, k), block))
    if br == 1 and weight_scale.shape[1] == 1:  # per output channel: a broadcast
        return q.mul_(weight_scale).to(dtype)
    if br == 1 and k % bc == 0:  # whole groups along each row
        return q.view(n, k // bc, bc).mul_(weight_scale[:, :, None]).view(n, k).to(dtype)
    return q.mul_(expand_scale(weight_scale, (n, k), block)).to(dtype)


def quantized_linear_reference(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, method: str,
                               block: tuple[int, int], bias: torch.Tensor | None = None,
                               zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(W).T + bias``: the weight dequantized to ``x.dtype`` (a transient copy, freed after
    the call), then one ``F.linear``. What the CPU runs, and exactly the unquantized layer with the
    dequantized weight: the reference of weight-only quantization.

    Args:
        x: ``[..., K]`` float; qweight, weight_scale, method, block, zero_point (int4 only, or None): as the
            module docstring; bias: ``[N]``.

    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    check_quantized(x, qweight, weight_scale, method, block, bias, zero_point)
    return F.linear(x, dequantize(qweight, weight_scale, method, block, x.dtype, zero_point), bias)


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token e4m3 quantization of activations (W8A8: vLLM's and llmcompressor's ``FP8_DYNAMIC``): each
    row's scale is ``max |x_row| / 448`` (1 for a row of zeros), so its largest value maps to e4m3's largest and
    nothing saturates, and ``q = e4m3(x / scale)`` (round to nearest).

    Args:
        x: ``[M, K]`` float (computed in float32).

    Returns:
        ``(q, scale)``: ``torch.float8_e4m3fn [M, K]`` and float32 ``[M, 1]``.
    """
    # >>> EXERCISE per_token_fp8
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    # <<< EXERCISE per_token_fp8


def w8a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None = None, weight_codes: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 product: ``x`` quantized per token (:func:`quantize_per_token_fp8`) times an fp8 weight with one
    scale per output channel, ``(q_x s_x) @ (q_w s_w)^T + bias``, in float32 (the products of two e4m3 values are
    exact in float32). What a tensor-core FP8 GEMM with row-wise scales computes (``torch._scaled_mm``), up to the
    order of its float32 sums.

    Args:
        x: ``[..., K]`` float; qweight: e4m3 ``[N, K]``; weight_scale: float32 ``[N, 1]``; bias: ``[N]`` or None.
        weight_codes: ``qweight`` as float32 (exact), when the caller keeps that copy (the CPU forward does, so
            that a call does not convert the whole weight again); None: converted here.

    Returns:
        ``[..., N]`` in ``x.dtype``.

    Raises:
        ValueError: a weight that is not e4m3 with one scale per row.
    """
    check_quantized(x, qweight, weight_scale, "fp8", (1, x.shape[-1]), bias)
    k = x.shape[-1]
    q, s = quantize_per_token_fp8(x.reshape(-1, k))
    codes = weight_codes if weight_codes is not None else qweight.float()
    y = (q.float() @ codes.T) * s * weight_scale.float().view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], qweight.shape[0])


def check_quantized(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor, method: str,
                    block: tuple[int, int], bias: torch.Tensor | None,
                    zero_point: torch.Tensor | None = None) -> None:
    """The arguments of a quantized product (shared with the Triton launcher, so both raise the same errors).

    Raises:
        ValueError: an unknown method, a wrong dtype or shape, tensors on different devices.
    """
    if method not in QDTYPES:
        raise ValueError(f"unknown quantization method {method!r} (int8, fp8 or int4)")
    if qweight.dtype != QDTYPES[method] or qweight.dim() != 2:
        raise ValueError(f"{method} qweight must be 2-D {QDTYPES[method]}, got {qweight.dtype} {tuple(qweight.shape)}")
    n = qweight.shape[0]
    k = qweight.shape[1] * (8 if method == "int4" else 1)
    if not x.is_floating_point() or x.shape[-1] != k:
        raise ValueError(f"x must be float [..., {k}], got {x.dtype} {tuple(x.shape)}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"block must be (rows, cols) >= 1, got {block!r}")
    want = scale_shape(n, k, block)
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != want:
        raise ValueError(f"weight_scale must be float32 {list(want)} for block {tuple(block)}, got "
                         f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{n}] in x's dtype {x.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    if zero_point is not None and (method != "int4" or zero_point.dtype not in ZERO_POINT_DTYPES
                                   or tuple(zero_point.shape) != want):
        raise ValueError(f"zero_point must be int8 or float32 {list(want)} (int4 only), got {zero_point.dtype} "
                         f"{tuple(zero_point.shape)} for {method}")
    for name, t in (("qweight", qweight), ("weight_scale", weight_scale), ("bias", bias), ("zero_point", zero_point)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
