"""W8A8 FP8 projections (``quantization="fp8_w8a8"``): the activations quantized to e4m3 per token, on the fly,
and the product on the FP8 tensor cores (``torch._scaled_mm``, cuBLASLt / CUTLASS with row-wise scales).

Weight-only quantization (the rest of phase 11) makes decode faster because decode reads bytes; a prefill or a
large batch is bound by arithmetic instead, and there a bf16 weight dequantized in registers runs on the bf16
tensor cores at best as fast as bf16. Hopper's FP8 tensor cores do twice the multiply-adds a second of its bf16
ones, but both operands must be e4m3: so the activations are quantized too, each row (token) with its own
scale ``max |x_row| / 448`` computed when it arrives ("dynamic", vLLM's default for ``--quantization fp8`` and
llmcompressor's ``FP8_DYNAMIC``), and the GEMM multiplies the codes and applies ``s_x[m] * s_w[n]`` to each
output (its epilogue). Per-token scales follow outlier tokens, which a single per-tensor scale would let
crush every other row into e4m3's subnormals.

:func:`per_token_fp8` is one Triton program per row (its reference:
:func:`~infer.kernels.quant_reference.quantize_per_token_fp8`); :func:`w8a8_linear` the product (its reference:
:func:`~infer.kernels.quant_reference.w8a8_linear_reference`). Few rows (decode at batch <=
:data:`W8A8_MIN_ROWS` - 1) stay on the weight-only GEMV, which reads the same fp8 weight at the speed of memory and
keeps the activations in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.quant_reference import FP8_MAX, check_quantized, quantize_per_token_fp8

__all__ = ["per_token_fp8", "w8a8_linear", "W8A8_MIN_ROWS"]

#: rows from which :class:`~infer.models.quant.QuantizedLinear` runs the W8A8 product on CUDA (fewer: the GEMV)
W8A8_MIN_ROWS = 5


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr, FP8_MAX_C: tl.constexpr):
    # Grid (M,): program m reads row m twice (its max, then the codes; the row stays in L1/L2) and writes the
    # row's e4m3 codes and its scale max|x| / 448 (1.0 for a row of zeros).
    m = tl.program_id(0)
    row = x_ptr + m.to(tl.int64) * stride_xm
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(tl.load(row + k, mask=k < K, other=0.0).to(tl.float32)))
    a = tl.max(amax, 0)
    scale = tl.where(a > 0, a / FP8_MAX_C, 1.0)
    tl.store(s_ptr + m, scale)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(row + k, mask=k < K, other=0.0).to(tl.float32) / scale
        v = tl.minimum(tl.maximum(v, -FP8_MAX_C), FP8_MAX_C)
        tl.store(q_ptr + m.to(tl.int64) * K + k, v.to(tl.float8e4nv), mask=k < K)


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~infer.kernels.quant_reference.quantize_per_token_fp8` in one Triton kernel on CUDA, the reference
    elsewhere (Triton 3.6's interpreter rounds float32 -> e4m3 wrongly where the mantissa carries into the exponent:
    31.3 becomes 16, not 32; the GPU test compares the kernel with the reference bit for bit).

    Args:
        x: ``[M, K]`` float, the last dimension contiguous.

    Returns:
        ``(q, scale)``: e4m3 ``[M, K]`` (contiguous) and float32 ``[M, 1]``.
    """
    if not x.is_cuda:
        return quantize_per_token_fp8(x)
    m, k = x.shape
    q = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    s = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    if m:
        _per_token_fp8_kernel[(m,)](x, q, s, k, x.stride(0), BLOCK_K=min(4096, triton.next_power_of_2(k)),
                                    FP8_MAX_C=FP8_MAX, num_warps=4)
    return q, s


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T + bias`` with ``x`` quantized per token to e4m3 and ``W`` an e4m3 weight with one scale per output
    channel, on the FP8 tensor cores (``torch._scaled_mm``, float32 accumulation, row-wise scales in its epilogue).

    Args:
        x: ``[..., K]`` bfloat16 on CUDA (``K % 16 == 0``).
        qweight: e4m3 ``[N, K]`` (``N % 16 == 0``), row-major: ``qweight.t()`` is the column-major operand.
        weight_scale: float32 ``[N, 1]``.
        bias: ``[N]`` or None.

    Returns:
        ``[..., N]`` bfloat16.

    Raises:
        ValueError: as :func:`~infer.kernels.quant_reference.check_quantized` (an fp8 weight with one scale per row).
    """
    k = x.shape[-1]
    check_quantized(x, qweight, weight_scale, "fp8", (1, k), bias)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, s = per_token_fp8(x2)
    y = torch._scaled_mm(q, qweight.t(), scale_a=s, scale_b=weight_scale.reshape(1, -1), out_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], qweight.shape[0])
