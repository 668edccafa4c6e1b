"""Llama (Llama 2/3.x, SmolLM2, Mistral-style dense models).

The pre-norm block of Touvron et al. (arXiv:2302.13971)::

    h = h + attn(input_layernorm(h))
    h = h + mlp(post_attention_layernorm(h))      # HF's name; it is the *pre*-MLP norm

with SwiGLU MLP, RoPE (optionally Llama 3.1 scaled) and grouped-query attention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from infer.attention.metadata import AttentionMetadata
from infer.config import ModelConfig
from infer.models.hf_config import common_fields, parse_rope
from infer.models.layers import Attention, CausalLM, GatedMLP, RMSNorm


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, meta: AttentionMetadata, ops):
        """:meth:`forward` with fused ops: takes and returns ``(h, residual)``, where the layer's
        input is ``h + residual`` (``residual`` is None for the first layer, or when the add is already
        done), so each add rides with the projection before it or the norm after it (see
        :meth:`CausalLM.forward_fused`)."""
        norm, post, attn, mlp = self.input_layernorm, self.post_attention_layernorm, self.self_attn, self.mlp
        # each norm goes with the projection after it (ops.add_rms_norm_linear; at batch 1 two kernels) ...
        qkv, residual = ops.add_rms_norm_linear(h, residual, norm.weight, norm.eps, False, attn.qkv_proj)
        # ... and each residual add with the projection before it (at batch 1: ops.linear_residual)
        h, residual = attn.forward_fused_qkv(qkv, positions, cos_sin_cache, meta, ops, residual)
        if not isinstance(mlp, GatedMLP):  # an MoE block (phase 15)
            x, residual = ops.add_rms_norm(h, residual, post.weight, post.eps)
            return mlp.forward_fused(x, ops), residual
        # ... and the MLP's activation with the gate/up projection
        act, residual = ops.add_rms_norm_linear(h, residual, post.weight, post.eps, False, mlp.gate_up_proj,
                                                mlp.act_name)
        return ops.linear_residual(act, mlp.down_proj, residual)


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer


def llama_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        **common_fields(cfg, source),
        rope=parse_rope(cfg, source),
        hidden_act=cfg.get("hidden_act", "silu"),
    )
