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

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 8  # the most rows skinny_linear takes


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK_N),): program j computes outputs [j * BLOCK_N, (j + 1) * BLOCK_N) of every row
    # of x, walking K in BLOCK_K slices: the [BLOCK_N, BLOCK_K] tile of W (contiguous along K) is read
    # once and multiplied by the same slice of each of the M rows of x (a broadcast, then a sum over K).
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def default_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` for ``m`` rows and a ``[n, k]`` weight.

    One row (what the engine uses, :func:`use_skinny`): long K slices (1,024 elements, 2 KB of each of
    BLOCK_N weight rows in flight per step) and few outputs per program, more of them for wide
    weights; the best tiles of ``benchmarks/skinny_gemm.py --tune`` on an H200 (run 19). More rows:
    the product tile ``[M_PAD, BLOCK_N, BLOCK_K]`` lives in registers, so BLOCK_K shrinks as they grow.
    """
    if INTERPRET:
        return 8, 32, 1
    if m <= 1:
        return (4 if n <= 4096 else 8 if n < 65536 else 16), 1024, 4
    m_pad = triton.next_power_of_2(m)
    return 8, max(128, 1024 // m_pad), 4


def use_skinny(m: int, n: int) -> bool:
    """Does :func:`skinny_linear` beat cuBLAS for ``m`` rows and ``n`` outputs?

    Measured on an H200 (``benchmarks/skinny_gemm.py --tune``, bf16, weights read from HBM): at one
    row it is 1.4-3.1x faster where ``n`` is small (Qwen3-0.6B's o and down projections, n = 1,024:
    cuBLAS splits K there and reaches 330-860 GB/s) and 1.1-1.2x on the LM head (n = 151,936); on
    the wide merged QKV and gate/up projections and at n = 2,560 the two are within 10%, either way.
    From two rows on this kernel (a broadcast and a sum, no tensor cores) falls behind.
    """
    return m == 1 and (n <= 2048 or n >= 65536)


def check_skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
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


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for ``M <= MAX_ROWS`` rows, accumulated in float32, rounded once.

    Args:
        x: ``[M, K]``, last dimension contiguous (rows may be strided).
        weight: ``[N, K]`` (an ``nn.Linear``'s), last dimension contiguous, ``x``'s dtype and device.
        bias: ``[N]`` or None.
        config: ``(BLOCK_N, BLOCK_K, num_warps)``; None: :func:`default_config`.

    Returns:
        A new ``[M, N]`` tensor in ``x``'s dtype.

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit, more than ``MAX_ROWS`` rows.
    """
    check_skinny_linear(x, weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n, block_k, warps = config or default_config(m, n, k)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        num_warps=warps,
    )
    return y


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same function in plain PyTorch: float32 products and sums, one rounding to ``x.dtype``."""
    check_skinny_linear(x, weight, bias)
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """``layer(x)`` (an ``nn.Linear`` of one process: no tensor-parallel all-reduce), through
    :func:`skinny_linear` where :func:`use_skinny` says it is faster, else ``F.linear`` (cuBLAS).
    ``x``: ``[M, K]``; returns ``[M, N]``."""
    w = layer.weight
    if use_skinny(x.shape[0], w.shape[0]) and (x.is_cuda or INTERPRET) and x.stride(-1) == 1 and w.stride(-1) == 1:
        return skinny_linear(x, layer.weight, layer.bias)
    return F.linear(x, layer.weight, layer.bias)
