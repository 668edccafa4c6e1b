"""Fused operations of the decoder layers (phase 8, the ``fused_kernels`` flag).

Two modules with the same functions, signatures and in-place behaviour:

* :mod:`infer.kernels.fused_triton`: Triton kernels (CUDA tensors; CPU tensors under
  ``TRITON_INTERPRET=1``, for tests).
* :mod:`infer.kernels.fused_reference`: plain PyTorch, the fewest ops that give exactly the values of
  the unfused code in :mod:`infer.models.layers` in float32 (what runs on the CPU).

The operations: ``rms_norm``, ``fused_add_rms_norm``, ``qk_norm_rope`` (with ``build_cos_sin_cache``)
and ``act_and_mul``. :func:`fused_ops` picks the module for a device.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (the current device when it has no index), cached: what
    the decode attention's split plan and the skinny GEMM's persistent grid size their grids by."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def fused_ops(device: torch.device | str) -> ModuleType:
    """The module implementing the fused operations on ``device``: the Triton kernels on a CUDA device,
    the plain-PyTorch references elsewhere (on the CPU, the interpreter would be far slower)."""
    if torch.device(device).type == "cuda":
        from infer.kernels import fused_triton

        return fused_triton
    from infer.kernels import fused_reference

    return fused_reference


def moe_ops(backend: str) -> ModuleType:
    """The module whose ``fused_experts`` runs an MoE layer's experts (phase 15,
    ``EngineConfig.moe_backend``): :mod:`infer.kernels.moe_triton` for ``"triton"``,
    :mod:`infer.kernels.moe_reference` (the loop over experts) for ``"torch"``."""
    if backend == "triton":
        from infer.kernels import moe_triton

        return moe_triton
    from infer.kernels import moe_reference

    return moe_reference
