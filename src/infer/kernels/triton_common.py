"""Helpers shared by infer's Triton kernels (the fused ops, the skinny GEMM, attention, MoE, sampler).

* :data:`INTERPRET`: whether the kernels run under the Triton interpreter (CPU tensors, tests).
* :func:`round_to`: float32 to a 16-bit dtype with round-to-nearest-even, also in the interpreter.
* :func:`to_fp8_e4m3`, :func:`check_kv_scales`: an FP8 KV cache's write (``x / scale`` to e4m3) and
  the scale arguments of the kernels that read or write one (phase 11).
* :func:`first_argmax`: the max of a block and the first index attaining it, ``torch.argmax``'s rule.
* :func:`silu_or_gelu_tanh`: SiLU or tanh-GELU in float32 (the gated MLP's activation).
* :func:`manual_bf16`, :func:`num_warps_for`, :func:`check_launchable`, :func:`sm_count`,
  :func:`shared_memory_per_block`: host-side choices every launcher makes the same way.
* :func:`check_paged_cache`, :func:`check_query`, :func:`check_index`, :func:`check_window`,
  :func:`check_out`, :func:`unused_buffer`, :data:`LOG2E`, :data:`NO_WINDOW`: what the paged-cache
  kernels (:mod:`infer.kernels.kv_cache_write`, :mod:`infer.kernels.decode_attention`,
  :mod:`infer.kernels.prefill_attention`) check and share.

Importing this module works on any machine (it launches nothing).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once, like @triton.jit does at import

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # a constexpr: jitted code reads no plain globals


@triton.jit
def round_to(x, DTYPE: tl.constexpr, MANUAL_BF16: tl.constexpr):
    """float32 ``x`` rounded to ``DTYPE`` (to nearest, ties to even), as a ``DTYPE`` tensor.

    On a GPU this is ``x.to(DTYPE)`` (``cvt.rn``). The interpreter truncates float32 -> bfloat16
    instead, so under it (``MANUAL_BF16``) the rounding is done on the bits: add ``0x7FFF`` plus the
    lowest kept bit, keep the upper 16 bits (NaN payloads aside, which these kernels never produce).
    """
    if MANUAL_BF16:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def to_fp8_e4m3(x, scale, DTYPE: tl.constexpr):
    """float32 ``x / scale`` clamped to +-448 and rounded to the nearest e4m3 value (ties to even), as a
    ``DTYPE`` (``tl.float8e4nv``, a ``torch.float8_e4m3fn`` tensor's element) tensor: the code an FP8 KV
    cache stores (:func:`infer.kernels.attention_reference.quantize_kv`, bit for bit).

    The rounding is done here in float32, so that the final conversion is exact: the GPU's ``cvt.rn``
    would round the same way, but the interpreter's conversion neither carries a rounded-up mantissa
    into the exponent (127.4 became 64, not 128) nor rounds ties to even. Normal e4m3 values (``|y| >=
    2**-6``) keep 3 of float32's 23 mantissa bits (add ``0x7FFFF`` plus the lowest kept bit, clear the
    20 below: the carry runs into the exponent); subnormal ones are multiples of ``2**-9``, which adding
    and subtracting ``1.5 * 2**14`` (whose float32 ulp is ``2**-9``) rounds to. A few integer operations
    in a kernel bound by memory."""
    y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
    b = y.to(tl.int32, bitcast=True)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    a = tl.abs(y)
    sub = (a + 24576.0) - 24576.0
    sub = tl.where(y < 0, -sub, sub)
    return tl.where(a < 0.015625, sub, normal).to(DTYPE)


@triton.jit
def rank_in_sectors(rank):
    """A LoRA slot's rank rounded up to 16: the columns of B (``[N, R]``, R contiguous) a kernel reads. A mask
    of contiguous columns at a multiple of 16 keeps the loads 16-byte vectors; at the rank itself the
    compiler cannot prove that and loads element by element (measured on an H200: a 32-row decode step over
    8 adapters 6% slower). The columns between the rank and this multiply entries of the shrink output that
    are zeros (the shrink masks A's rows at the rank itself)."""
    return (rank + 15) // 16 * 16


@triton.jit
def first_argmax(best, best_i, n):
    """The max of a 1-D block and the smallest index ``best_i`` that attains it, ``torch.argmax``'s
    rule: a NaN counts as larger than any number, so the first NaN wins and the max is NaN. ``n``:
    an index past every real one (padding lanes hold it or a value no real one loses to).

    Used wherever a kernel turns values into an index (the sampler's argmax and exponential race,
    MoE routing). The NaNs are taken out before the max on purpose: the GPU's max returns the other
    operand of a NaN (the interpreter's NumPy max returns the NaN), so no lane would equal the max and
    the index would come out as ``n``, past the row. Fed to the next gather or embedding lookup, that
    index is a device-side assert, which ends the CUDA context for every request; the logits of a
    model that overflowed in float16 are enough."""
    nan = best != best
    first_nan = tl.min(tl.where(nan, best_i, n), axis=0)
    top = tl.max(tl.where(nan, float("-inf"), best), axis=0)
    first = tl.min(tl.where(best == top, best_i, n), axis=0)
    has_nan = first_nan < n
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, first_nan, first)


@triton.jit
def silu_or_gelu_tanh(g, GELU_TANH: tl.constexpr):
    """SiLU or tanh-GELU of float32 ``g``, in float32 (the plain-PyTorch table is
    :data:`infer.kernels.activations.ACTIVATIONS`)."""
    if GELU_TANH:
        # 0.5 g (1 + tanh(y)) = g * sigmoid(2y), y = sqrt(2/pi) (g + 0.044715 g^3): tanh through exp
        # (libdevice's tanh does not run in the interpreter). The exponent is capped at 80 so that exp
        # never overflows: for g that negative the result is ~g * 1e-35 either way.
        y = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        return g / (1.0 + tl.exp(tl.minimum(-2.0 * y, 80.0)))
    else:
        return g / (1.0 + tl.exp(tl.minimum(-g, 80.0)))  # silu(g) = g * sigmoid(g)


def manual_bf16(x: torch.Tensor) -> bool:
    """Whether a kernel must round to bfloat16 by hand (:func:`round_to`'s ``MANUAL_BF16``): bf16 data
    under the interpreter."""
    return INTERPRET and x.dtype == torch.bfloat16


def num_warps_for(elements: int) -> int:
    """Warps for a program over ``elements`` values: about 256 per warp (8 per thread), 1 to 8 warps."""
    return max(1, min(8, elements // 256))


def check_launchable(x: torch.Tensor) -> None:
    """Raise ``RuntimeError`` unless a Triton kernel can run on ``x``: a CUDA tensor, or any tensor under
    the interpreter (``TRITON_INTERPRET=1`` set before Triton is imported)."""
    if x.device.type != "cuda" and not INTERPRET:
        raise RuntimeError("the Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
                           f"imported to run them on the CPU (got a {x.device} tensor)")


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (the current device when it has no index), cached: what
    the decode attention's split plan and the skinny GEMM's persistent grid size their grids by."""
    return _device_properties(device).multi_processor_count


def shared_memory_per_block(device: torch.device | None) -> int:
    """Bytes of shared memory a block may opt in to on a CUDA ``device`` (0 for None, another device type or
    a torch that does not report it), cached: what the prefill attention's long-prompt tiles need."""
    if device is None or device.type != "cuda":
        return 0
    return getattr(_device_properties(device), "shared_memory_per_block_optin", 0)


def _device_properties(device: torch.device):
    return _properties_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _properties_of(device_index: int):
    return torch.cuda.get_device_properties(device_index)


# ============================================================================ the paged-cache kernels

# What the launchers of the paged-cache kernels (infer.kernels.kv_cache_write, .decode_attention and
# .prefill_attention) share: their input checks, two constants and a placeholder buffer.

LOG2E = 1.4426950408889634  # the kernels' softmax runs in base 2: qk_scale = scale * log2(e), exp2 for exp
NO_WINDOW = 1 << 30  # "no sliding window": farther back than any context


@functools.cache
def unused_buffer(device: torch.device) -> torch.Tensor:
    """A float32 scratch tensor for a pointer argument a launch does not use (the split partials of an
    unsplit launch): float32 like the real ones, so that it compiles no new variant."""
    return torch.empty(16, dtype=torch.float32, device=device)


def check_paged_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Check a layer's paged cache: ``k_cache`` and ``v_cache`` of shape ``[num_blocks, block_size,
    num_kv_heads, head_dim]``, the same shape, dtype (float32, float16, bfloat16 or, an FP8 cache,
    float8_e4m3fn), device and strides, the last dimension contiguous.

    Raises:
        ValueError: any of these does not hold.
    """
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} differs from k_cache {tuple(k_cache.shape)}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}")
    if v_cache.device != k_cache.device:
        raise ValueError(f"v_cache is on {v_cache.device}, k_cache on {k_cache.device}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must have the same strides ({k_cache.stride()} vs "
                         f"{v_cache.stride()})")
    if k_cache.shape[3] > 1 and k_cache.stride(3) != 1:
        raise ValueError(f"k_cache/v_cache must have a contiguous last dimension (strides {k_cache.stride()})")
    if k_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn):
        raise ValueError(f"cache dtype must be float32, float16, bfloat16 or float8_e4m3fn, got {k_cache.dtype}")


def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(k_scale, v_scale)`` pointers a paged-cache kernel is given: an FP8 cache's float32 ``[1]``
    scales (None: a tensor of 1.0), or for any other cache two placeholders the kernel never reads.

    Raises:
        ValueError: a scale that is not a float32 tensor of one element on the cache's device.
    """
    if k_cache.dtype != torch.float8_e4m3fn:
        return k_cache, k_cache
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            s = _ones(k_cache.device)
        elif s.dtype != torch.float32 or s.numel() != 1 or s.device != k_cache.device:
            raise ValueError(f"{name} must be a float32 tensor of one element on {k_cache.device}, got "
                             f"{s.dtype} {tuple(s.shape)} on {s.device}")
        out.append(s)
    return out[0], out[1]


@functools.cache
def _ones(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


def check_query(q: torch.Tensor, k_cache: torch.Tensor, name: str) -> tuple[int, int, int, int]:
    """Check ``q`` (called ``name`` in the messages) against the cache: ``[tokens, num_heads, head_dim]``,
    the cache's head_dim, dtype and device, ``num_heads`` a multiple of its KV heads, the last dimension
    contiguous. Returns ``(tokens, num_heads, num_kv_heads, head_dim)``.

    Raises:
        ValueError: any of these does not hold.
    """
    if q.dim() != 3:
        raise ValueError(f"{name} must be [tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    n, hq, d = q.shape
    hkv = k_cache.shape[2]
    if d != k_cache.shape[3]:
        raise ValueError(f"{name} head_dim {d} differs from the cache's {k_cache.shape[3]}")
    if hq % hkv != 0:
        raise ValueError(f"{name} has {hq} heads, not a multiple of the cache's {hkv} KV heads")
    if q.dtype != k_cache.dtype and k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name} dtype must be float32, float16 or bfloat16, got {q.dtype}")
    if q.device != k_cache.device:
        raise ValueError(f"{name} is on {q.device}, the cache on {k_cache.device}")
    if d > 1 and q.stride(2) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (strides {q.stride()})")
    return n, hq, hkv, d


def check_index(x: torch.Tensor, name: str, k_cache: torch.Tensor) -> None:
    """Check an index tensor (block tables, sequence lengths, query offsets): int32, on the cache's
    device, its rows contiguous.

    Raises:
        ValueError: any of these does not hold.
    """
    if x.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")
    if x.device != k_cache.device:
        raise ValueError(f"{name} is on {x.device}, the cache on {k_cache.device}")
    if x.dim() == 2 and x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} rows must be contiguous (strides {x.stride()})")
    if x.dim() == 1 and x.shape[0] > 1 and x.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous (stride {x.stride()})")


def check_window(window: int | None) -> None:
    """Check a sliding window: a positive int (tokens), or None for none.

    Raises:
        ValueError: anything else.
    """
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")


def check_out(out: torch.Tensor | None, q: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``out``, checked to be ``shape`` in q's dtype on q's device with a contiguous last dimension, or
    a new ``torch.empty`` of that shape if None.

    Raises:
        ValueError: a given ``out`` that does not fit.
    """
    if out is None:
        return torch.empty(shape, dtype=q.dtype, device=q.device)
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
    if out.dtype != q.dtype:
        raise ValueError(f"out dtype {out.dtype} differs from q's {q.dtype}")
    if out.device != q.device:
        raise ValueError(f"out is on {out.device}, q on {q.device}")
    if shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"out must have a contiguous last dimension (strides {out.stride()})")
    return out
