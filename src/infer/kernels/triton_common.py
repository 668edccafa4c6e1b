"""Helpers shared by infer's Triton kernels (the fused ops, the skinny GEMM, attention, MoE, sampler).

* :data:`INTERPRET`: whether the kernels run under the Triton interpreter (CPU tensors, tests).
* :func:`round_to`: float32 to a 16-bit dtype with round-to-nearest-even, also in the interpreter.
* :func:`first_argmax`: the max of a block and the first index attaining it, ``torch.argmax``'s rule.
* :func:`silu_or_gelu_tanh`: SiLU or tanh-GELU in float32 (the gated MLP's activation).
* :func:`manual_bf16`, :func:`num_warps_for`, :func:`check_launchable`, :func:`sm_count`: host-side
  choices every launcher makes the same way.

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
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
