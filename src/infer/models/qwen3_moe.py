"""Qwen3-MoE (Qwen Team, arXiv:2505.09388): Qwen3's attention block with a sparse MoE block in
place of the dense MLP.

Each MoE layer routes every token to ``num_experts_per_tok`` of ``num_experts`` small SwiGLU
experts (``moe_intermediate_size`` wide; Qwen3-30B-A3B: 8 of 128, width 768) and sums their
outputs weighted by the router's softmax probabilities, renormalized over the chosen ones when
``norm_topk_prob`` (:class:`~infer.models.moe.SparseMoeBlock`). No shared expert. As in Hugging
Face, layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in
``mlp_only_layers``; the others keep a dense gated MLP of ``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from infer.config import ModelConfig
from infer.errors import ModelLoadError
from infer.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from infer.models.moe import SparseMoeBlock
from infer.models.qwen3 import qwen3_config


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """Llama/Qwen3's pre-norm block; ``mlp`` is a :class:`SparseMoeBlock` on MoE layers."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(cfg, cfg.hidden_act)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def set_moe_impl(self, ops) -> None:
        """Run every MoE layer's experts with ``ops`` (:mod:`infer.kernels.moe_reference`, the
        default, or :mod:`infer.kernels.moe_triton`); the engine calls it once
        (``EngineConfig.moe_backend``), before its memory profile."""
        for block in self.moe_blocks():
            block.experts.set_impl(ops)


def qwen3_moe_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    """Qwen3's fields plus the MoE ones (``num_experts``, spelled ``num_local_experts`` by
    transformers 5's ``save_pretrained``).

    Raises:
        ModelLoadError: a missing MoE field, or ``num_experts_per_tok`` > ``num_experts``.
    """
    base = qwen3_config(cfg, source)
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise ModelLoadError(source, "required field 'num_experts' is missing")
    top_k = cfg.get("num_experts_per_tok")
    inter = cfg.get("moe_intermediate_size")
    if top_k is None or inter is None:
        raise ModelLoadError(source, "required fields 'num_experts_per_tok' and 'moe_intermediate_size'")
    if not 1 <= int(top_k) <= int(experts):
        raise ModelLoadError(source, f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    step = int(cfg.get("decoder_sparse_step") or 1)
    base.architecture = "qwen3_moe"
    base.num_experts, base.num_experts_per_tok = int(experts), int(top_k)
    base.moe_intermediate_size = int(inter)
    base.norm_topk_prob = bool(cfg.get("norm_topk_prob", False))
    base.decoder_sparse_step = step
    base.mlp_only_layers = [int(i) for i in cfg.get("mlp_only_layers") or []]
    return base


__all__ = ["Qwen3MoeDecoderLayer", "Qwen3MoeForCausalLM", "qwen3_moe_config"]
