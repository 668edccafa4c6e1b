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
        input is ``h + residual`` (``residual`` is None for the first layer), so each add rides
        with the norm that follows it (see :meth:`CausalLM.forward_fused`)."""
        norm, post = self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            x, residual = ops.rms_norm(h, norm.weight, norm.eps), h
        else:
            x, residual = ops.fused_add_rms_norm(h, residual, norm.weight, norm.eps)
        h = self.self_attn.forward_fused(x, positions, cos_sin_cache, meta, ops)
        x, residual = ops.fused_add_rms_norm(h, residual, post.weight, post.eps)
        return self.mlp.forward_fused(x, ops), residual


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer


def llama_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    return ModelConfig(
        architecture="llama",
        **common_fields(cfg, source),
        rope=parse_rope(cfg, source),
        hidden_act=cfg.get("hidden_act", "silu"),
    )
