"""Every kernel of the engine, each beside its plain-PyTorch reference (the tests compare the two).

* Paged attention (phase 5): :mod:`.kv_cache_write` (the cache write, ``reshape_and_cache``),
  :mod:`.decode_attention` (PagedAttention + flash-decoding: split-KV, its merge and split plan),
  :mod:`.prefill_attention` (variable-length extend attention), and :mod:`.attention_reference`, their
  plain-PyTorch twins. The interface a model calls (``AttentionMetadata``, ``KVCache``, the backends)
  stays in :mod:`infer.attention`, which imports these modules (never the reverse).
* Fused decoder-layer operations (phase 8, ``EngineConfig.fused_kernels``): :mod:`.fused_triton`
  (Triton) and :mod:`.fused_reference` (plain PyTorch, what runs on the CPU), the same functions with
  the same signatures; :mod:`.skinny_gemm`, the one-row projections of batch-1 decode.
* Mixture of experts (phase 15, ``EngineConfig.moe_backend``): :mod:`.moe_triton` (tokens sorted by
  expert, a grouped GEMM) and :mod:`.moe_reference` (a loop over experts).
* Multi-LoRA (phase 16, ``EngineConfig.enable_lora``): :mod:`.lora_triton` (shrink / expand over rows
  grouped by adapter, Punica's SGMV) and :mod:`.lora_reference` (a pair of matmuls per adapter).
* :mod:`.pdl` (programmatic dependent launch), :mod:`.triton_common` (helpers every Triton kernel
  shares), :mod:`.activations` (the MLP activations by name).

Triton modules import on any machine; launching needs CUDA tensors, or CPU tensors with
``TRITON_INTERPRET=1`` set before Triton is imported (the tests do that). :func:`fused_ops`,
:func:`moe_ops` and :func:`lora_ops` pick the implementation once, from the engine's backend choice.
"""

from __future__ import annotations

from types import ModuleType


def fused_ops(backend: str) -> ModuleType:
    """The module of fused operations (phase 8) that goes with an attention backend: the Triton kernels
    (:mod:`infer.kernels.fused_triton`) with ``"triton"``, their plain-PyTorch twins, the same functions
    (:mod:`infer.kernels.fused_reference`), with ``"torch"``.

    Raises:
        ValueError: another name.
    """
    if backend == "triton":
        from infer.kernels import fused_triton

        return fused_triton
    if backend == "torch":
        from infer.kernels import fused_reference

        return fused_reference
    raise ValueError(f"unknown backend {backend!r}; expected 'torch' or 'triton'")


def linear_attention_ops(backend: str) -> ModuleType:
    """The module whose ``prefill_rule`` runs a hybrid model's Gated DeltaNet prefills (phase
    17, ``EngineConfig.linear_attention_backend``): :mod:`infer.kernels.gated_delta_fla` for ``"fla"``,
    :mod:`infer.kernels.gated_delta_triton` for ``"triton"``, :mod:`infer.kernels.gated_delta_reference`
    (plain PyTorch) for ``"torch"``."""
    if backend == "fla":
        from infer.kernels import gated_delta_fla

        return gated_delta_fla
    if backend == "triton":
        from infer.kernels import gated_delta_triton

        return gated_delta_triton
    from infer.kernels import gated_delta_reference

    return gated_delta_reference


def moe_ops(backend: str) -> ModuleType:
    """The module whose ``fused_experts`` runs an MoE layer's experts (phase 15,
    ``EngineConfig.moe_backend``): :mod:`infer.kernels.moe_triton` for ``"triton"``,
    :mod:`infer.kernels.moe_reference` (the loop over experts) for ``"torch"``."""
    if backend == "triton":
        from infer.kernels import moe_triton

        return moe_triton
    from infer.kernels import moe_reference

    return moe_reference


def lora_ops(backend: str) -> ModuleType:
    """The module whose ``add_lora`` applies a batch's LoRA adapters (phase 16): :mod:`infer.kernels.lora_triton`
    for ``"triton"``, :mod:`infer.kernels.lora_reference` (a pair of matmuls per adapter) for ``"torch"``."""
    if backend == "triton":
        from infer.kernels import lora_triton

        return lora_triton
    from infer.kernels import lora_reference

    return lora_reference
