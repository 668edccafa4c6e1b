"""int4 projections on CUDA by PyTorch's tensor-core int4 kernel ("tinygemm", the kernel gpt-fast and
torchao's ``int4_weight_only`` call), fed a layout prepared once at load.

Why not only our Triton GEMV (:mod:`infer.kernels.quant_triton`)? An int4 code costs our kernel a shift, a
mask and a float multiply-add on the CUDA cores, and the integer units (half the rate of the float ones on
Hopper) bound it below the memory's speed: on an H200 it reads its weights at 0.6-1.2 TB/s, *slower* than
cuBLAS reads bf16 (2-4 TB/s), so int4 decode was no faster than bf16. tinygemm does the products on the
tensor cores: each thread's registers hold, after one 16-byte load, the nibbles of the tensor-core fragment
it feeds (the weight is permuted for that at load, the same idea as Marlin's layout), so a code costs only
its unpacking into a bf16 pair (a few bit operations for two codes) and the multiply-adds are free. It
reads the same bytes at 1.0-1.7 TB/s (1.5-1.9x bf16 per projection; ``benchmarks/quantization.py
--parts tune``).

The layout: ``torch.ops.aten._convert_weight_to_int4pack(u8, inner_k_tiles)`` from ``u8 [N, K / 2]`` (two
unsigned nibbles ``u = q + 8`` a byte, the even input in the high nibble), and ``scales_and_zeros``
bfloat16 ``[K / g, N, 2]`` (:func:`~infer.kernels.quant_cpu.int4_scales_and_zeros`: ``w = (u - 8) * scale +
zero``, the scale rounded to bfloat16, our float32 scale's ``2^-9`` error). The kernel takes bfloat16
activations only, ``N % 16 == 0`` (:func:`~infer.kernels.quant_cpu.int4_group`), ``K`` a multiple of
``16 * inner_k_tiles`` and groups of 32-256 inside ours; other int4 layers keep the Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.kernels import quant_reference as qref
from infer.kernels.quant_cpu import int4_group, int4_scales_and_zeros

__all__ = ["TinygemmWeight", "pack_tinygemm", "tinygemm_linear", "TINYGEMM_MAX_ROWS", "INNER_K_TILES"]

#: rows up to which :class:`~infer.models.quant.QuantizedLinear` calls tinygemm on CUDA (decode); more rows
#: (prefill) dequantize the weight once for cuBLAS (:func:`~infer.kernels.quant_triton.dequantize_triton`): tinygemm's
#: time grows with the rows (2x at 8, 7x at 32 on an H200)
TINYGEMM_MAX_ROWS = 16
#: ``innerKTiles`` of the packed layout: 16-input tiles a thread's 16-byte load covers (8: the fastest at
#: every Qwen3-4B/8B projection on an H200, 1.1-1.4x over 2)
INNER_K_TILES = 8


@dataclass
class TinygemmWeight:
    """An int4 weight in tinygemm's layout.

    Attributes:
        weight: int32, the packed layout ``[N / 8, K / (16 inner_k_tiles), 32, inner_k_tiles / 2]``.
        scales_and_zeros: bfloat16 ``[K / group_size, N, 2]``.
        group_size: 32, 64, 128 or 256.
    """

    weight: torch.Tensor
    scales_and_zeros: torch.Tensor
    group_size: int

    def nbytes(self) -> int:
        """Bytes a call reads for the weight (what a decode step streams)."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales_and_zeros))


@torch.no_grad()
def pack_tinygemm(qweight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                  zero_point: torch.Tensor | None = None) -> TinygemmWeight | None:
    """tinygemm's layout of one int4 weight (CUDA tensors; call once, at load), or None where the kernel does not
    take it (its shape or groups, or a GPU before compute capability 8.0).

    Args:
        qweight, weight_scale, block, zero_point: an int4 weight as :mod:`infer.kernels.quant_reference`
            describes it.
    """
    n, k = qweight.shape[0], qweight.shape[1] * 8
    g = int4_group(n, k, block)
    if not g or k % (16 * INNER_K_TILES) or not qweight.is_cuda or torch.cuda.get_device_capability(qweight.device)[0] < 8:
        return None
    u = qref.unpack_int4(qweight).to(torch.int32) + 8  # [N, K] unsigned nibbles
    u8 = (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack(u8, INNER_K_TILES)
    return TinygemmWeight(packed, int4_scales_and_zeros(weight_scale, zero_point, k, g, block[1]), g)


def tinygemm_linear(x: torch.Tensor, packed: TinygemmWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(W)^T + bias`` by ``torch.ops.aten._weight_int4pack_mm``.

    Args:
        x: ``[..., K]`` bfloat16 (CUDA).
        packed: :func:`pack_tinygemm` of the weight.
        bias: ``[N]`` bfloat16 or None.

    Returns:
        ``[..., N]`` bfloat16: float32 accumulation on the tensor cores, one rounding.
    """
    k = x.shape[-1]
    y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, k).contiguous(), packed.weight, packed.group_size, packed.scales_and_zeros)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])
