"""Weight-only quantized projections on the CPU: PyTorch's own CPU kernels, fed a layout prepared once at load.

The plain-PyTorch reference (:func:`~infer.kernels.quant_reference.quantized_linear_reference`)
dequantizes the whole weight to float32 on every call and then multiplies: it reads the small weight,
writes a float32 copy and reads it again, so it is *slower* than float32. A CPU decode step, like a GPU
one, is bound by the bytes it reads; the fix is the same as on the GPU: a kernel that reads the quantized
weight and dequantizes it in registers. PyTorch ships such kernels for the CPU (the ones gpt-fast and
torchao call), vectorized (AVX2 / AVX-512 / NEON) for **bfloat16 activations only** (a float32 or
float16 input takes a scalar loop that is 5-10x slower):

* ``int8``, one scale per output channel: ``torch.ops.aten._weight_int8pack_mm(x, w, scales)`` with
  ``x`` bfloat16 ``[M, K]`` (``K % 8 == 0``), ``w`` our int8 ``[N, K]`` as it is (no repacking), ``scales``
  bfloat16 ``[N]``. Each output is a float32 sum of ``x[k] * float(w[n, k]) * scale[n]``, rounded once to
  bfloat16. We pass scales of 1 and multiply the float32 result by our float32 scales, so the scales are
  not rounded to bfloat16 (a per-row error that would not average out).
* ``int4``, one scale per group along ``K``: ``_weight_int4pack_mm_for_cpu(x, packed, group, sz)``, with
  ``packed = _convert_weight_to_int4pack_for_cpu(u, 1)`` made once from the unsigned nibbles ``u = q + 8``
  ``[N, K]`` (int32), and ``sz`` bfloat16 ``[K / group, N, 2]`` (scale, zero) per group and output. The
  kernel computes ``w = (u - 8) * scale + zero``: our symmetric ``q * scale`` exactly, with ``zero = 0``;
  with zero points (AWQ, asymmetric GPTQ, ``int4_asym``, GGUF's Q4_1 / Q4_K) ``(q - z) * scale`` with
  ``zero = -z * scale``, rounded to bfloat16 like the scale (:func:`error_bound`'s ``offset`` term).
  The packed layout (AVX2): for each block of 32 output channels and each input ``k``, 16 bytes, byte
  ``d`` holding channel ``d`` in its low nibble and channel ``d + 16`` in its high one, so one 16-byte load
  gives 32 channels' weights for one input (AVX-512: blocks of 64 channels, 32 bytes). The group must
  be 32, 64, 128 or 256 and divide ``K``: our group of 128 over SmolLM2's ``K = 576`` (4.5 groups)
  becomes torch groups of 64, each scale repeated over its two halves (exact).
* everything else (``fp8``: no CPU kernel reads e4m3; int8 with group or block scales; int4 whose
  shape the kernel does not take): the weight is dequantized **once, at load**, into a bfloat16 copy
  (``bf16(q * scale)``, an error of at most ``2^-9`` of each weight, far below the format's own), and
  each call is one bfloat16 ``F.linear``. Faster than float32 (half the bytes), but the memory held is
  that copy's, beside the quantized weight.

Every path rounds ``x`` to bfloat16 and the output (before the float32 scale) to bfloat16: an error of
at most ``2^-8 (|x| @ |W|^T)`` plus the output's rounding, which :func:`error_bound` states and the
tests check against the float32 reference.

Above :data:`GEMM_MIN_ROWS` rows (a prefill), the int8 and int4 kernels (4 rows per tile, no cache
blocking) and a bfloat16 GEMM (no bfloat16 arithmetic on most x86 CPUs) lose to a float32 GEMM, so the
weight is widened to float32 for the call (the reference's dequantization, or the bfloat16 copy's
conversion) and one float32 ``F.linear`` runs: the conversion is shared by every row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from infer.kernels import quant_reference as qref

__all__ = ["CpuPackedWeight", "pack_for_cpu", "quantized_linear_cpu", "error_bound", "GEMM_MIN_ROWS",
           "INT4_GROUP_SIZES", "int4_group", "int4_scales_and_zeros"]

#: rows from which :func:`quantized_linear_cpu` uses the reference (dequantize, then a float32 GEMM)
GEMM_MIN_ROWS = 32
#: the groups ``_weight_int4pack_mm_for_cpu`` takes
INT4_GROUP_SIZES = (256, 128, 64, 32)


@dataclass
class CpuPackedWeight:
    """A quantized weight in the layout of a CPU kernel (made once by :func:`pack_for_cpu`).

    Attributes:
        kind: ``"int8"`` (``_weight_int8pack_mm``), ``"int4"`` (``_weight_int4pack_mm_for_cpu``) or
            ``"bf16"`` (a dequantized bfloat16 copy, ``F.linear``).
        weight: int8 ``[N, K]`` (the qweight itself, not a copy), uint8 packed int4 (torch's layout), or
            bfloat16 ``[N, K]``.
        scale: int8: float32 ``[N]``, multiplied into the output; else None.
        ones: int8: bfloat16 ``[N]`` of 1.0 (the kernel's own scales); else None.
        scales_and_zeros: int4: bfloat16 ``[K / group_size, N, 2]``; else None.
        group_size: int4: the kernel's group (32, 64, 128 or 256); else 0.
    """

    kind: str
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    ones: torch.Tensor | None = None
    scales_and_zeros: torch.Tensor | None = None
    group_size: int = 0

    def nbytes(self) -> int:
        """Bytes a call reads for the weight (what a decode step streams)."""
        ts = (self.weight, self.scale, self.scales_and_zeros)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def int4_group(n: int, k: int, block: tuple[int, int]) -> int:
    """The largest group of PyTorch's int4 kernels (:data:`INT4_GROUP_SIZES`) that lies inside one of our
    scale groups and divides ``K``; 0 if none, or if the kernels do not take this shape (``N`` a multiple
    of 16). The CUDA kernel (:mod:`infer.kernels.quant_tinygemm`) takes the same groups."""
    br, bc = block
    if br != 1 or n % 16:
        return 0
    for g in INT4_GROUP_SIZES:
        if k % g == 0 and (bc % g == 0 or bc >= k):
            return g
    return 0


def int4_scales_and_zeros(weight_scale: torch.Tensor, zero_point: torch.Tensor | None, k: int, g: int,
                          bc: int) -> torch.Tensor:
    """PyTorch's int4 kernels' ``scales_and_zeros``, bfloat16 ``[K / g, N, 2]``: for each kernel group of ``g``
    inputs and output ``n``, ``(scale, zero)`` with ``w = (u - 8) * scale + zero`` for the unsigned nibble
    ``u = q + 8``: ``zero = 0`` for our symmetric ``q * scale``, ``-z * scale`` with zero points
    (``(q - z) * scale``). ``weight_scale`` / ``zero_point``: ours, ``[N, ceil(K / bc)]``."""
    cols = torch.arange(0, k, g, device=weight_scale.device) // bc  # our scale column of each kernel group
    s = weight_scale[:, cols].t().float()  # [K / g, N]
    zero = -zero_point[:, cols].t().float() * s if zero_point is not None else torch.zeros_like(s)
    return torch.stack([s, zero], dim=-1).to(torch.bfloat16).contiguous()


@torch.no_grad()
def pack_for_cpu(qweight: torch.Tensor, weight_scale: torch.Tensor, method: str,
                 block: tuple[int, int], zero_point: torch.Tensor | None = None) -> CpuPackedWeight:
    """The CPU layout of one quantized weight (call once, at load).

    Args:
        qweight, weight_scale, method, block, zero_point: as :mod:`infer.kernels.quant_reference` describes
            them (CPU tensors).

    Returns:
        A :class:`CpuPackedWeight`: ``int8`` for int8 with one scale per output channel and
        ``K % 8 == 0``; ``int4`` for int4 with row groups whose shape the kernel takes; ``bf16`` otherwise.
    """
    n = qweight.shape[0]
    k = qweight.shape[1] * (8 if method == "int4" else 1)
    br, bc = block
    if method == "int8" and br == 1 and weight_scale.shape[1] == 1 and k % 8 == 0:
        return CpuPackedWeight("int8", qweight.contiguous(), scale=weight_scale.reshape(n).float().contiguous(),
                               ones=torch.ones(n, dtype=torch.bfloat16))
    g = int4_group(n, k, block) if method == "int4" else 0
    if g:
        u = qref.unpack_int4(qweight).to(torch.int32) + 8  # [N, K] in [0, 15]: the kernel's unsigned nibbles
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1)
        sz = int4_scales_and_zeros(weight_scale, zero_point, k, g, bc)
        return CpuPackedWeight("int4", packed, scales_and_zeros=sz, group_size=g)
    return CpuPackedWeight("bf16", qref.dequantize(qweight, weight_scale, method, block, torch.bfloat16,
                                                   zero_point).contiguous())


def quantized_linear_cpu(x: torch.Tensor, packed: CpuPackedWeight, qweight: torch.Tensor, weight_scale: torch.Tensor,
                         method: str, block: tuple[int, int], bias: torch.Tensor | None = None,
                         zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(W)^T + bias`` on the CPU by the kernel of ``packed`` (bfloat16 activations,
    float32 accumulation); at least :data:`GEMM_MIN_ROWS` rows go through the float32 reference.

    Args:
        x: ``[..., K]`` float32 (or bfloat16/float16).
        packed: :func:`pack_for_cpu` of the same weight.
        qweight, weight_scale, method, block, zero_point: the stored weight (for the reference at many rows).
        bias: ``[N]`` in ``x.dtype`` or None.

    Returns:
        ``[..., N]`` in ``x.dtype``.
    """
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] >= GEMM_MIN_ROWS:  # a float32 GEMM on a transient float32 weight
        if packed.kind == "bf16":
            return F.linear(x, packed.weight.to(x.dtype), bias)
        return qref.quantized_linear_reference(x, qweight, weight_scale, method, block, bias, zero_point)
    xb = x2.to(torch.bfloat16).contiguous()  # a fresh, aligned copy (the int8 kernel's aligned loads)
    if packed.kind == "int8":
        y = torch.ops.aten._weight_int8pack_mm(xb, packed.weight, packed.ones)
        y = torch.mul(y, packed.scale) if x.dtype == torch.float32 else (y * packed.scale).to(x.dtype)  # one op
    elif packed.kind == "int4":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed.weight, packed.group_size,
                                                       packed.scales_and_zeros).to(x.dtype)
    else:
        y = F.linear(xb, packed.weight).to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])


def error_bound(x: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """How far :func:`quantized_linear_cpu` may be from the float32 product ``x @ weight^T`` (``weight`` the
    dequantized float32 ``[N, K]``): ``x`` rounded to bfloat16 (``2^-9`` of each term), the bfloat16 copy
    of the weight (another ``2^-9``), the output rounded to bfloat16 (``2^-9`` of it), and float32
    summation: ``2^-7 (|x| @ |W|^T) + 1e-6``, elementwise ``[..., N]``.

    ``offset``: with zero points, the float32 ``[N, K]`` term ``z * scale`` of each weight (``w = q * scale -
    offset``). The int4 kernel rounds ``scale`` and ``-z * scale`` to bfloat16 apart, an error of ``2^-9 (|q
    scale| + |z scale|) <= 2^-9 (|w| + 2 |offset|)`` per weight, so the bound takes ``|W| + 2 |offset|``."""
    w = weight.abs().float() + (2 * offset.abs().float() if offset is not None else 0)
    return 2.0 ** -7 * (x.abs().float() @ w.t()) + 1e-6
