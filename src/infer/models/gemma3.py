"""Gemma 3 text models (Gemma Team, arXiv:2503.19786).

What differs from Llama:

* RMSNorm multiplies by ``(1 + w)`` in float32 (``norm_unit_offset``);
* embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the model dtype);
* "sandwich" norms: each sub-block has a norm before *and* after it::

      h = h + post_attention_layernorm(attn(input_layernorm(h)))
      h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))

* QK-norm, GeGLU (tanh GELU) MLP, attention scale ``query_pre_attn_scalar ** -0.5``;
* five sliding-window layers (local RoPE base 10k) for every global layer (base 1M).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from infer.attention.metadata import AttentionMetadata
from infer.config import ModelConfig, RopeConfig
from infer.errors import ModelLoadError
from infer.models.hf_config import common_fields, parse_rope
from infer.models.layers import Attention, CausalLM, GatedMLP, RMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(d, eps, unit_offset=True)

    def forward(self, h: torch.Tensor, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, meta: AttentionMetadata, ops):
        """:meth:`forward` with fused ops, ``(h, residual)`` in and out as in Llama's layer. The
        sandwich norms after attention and after the MLP stay plain RMSNorms; the adds ride with
        the norms before attention and before the MLP."""
        pre_attn, post_attn = self.input_layernorm, self.post_attention_layernorm
        pre_ff, post_ff = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        if residual is None:
            x, residual = ops.rms_norm(h, pre_attn.weight, pre_attn.eps, True), h
        else:
            x, residual = ops.fused_add_rms_norm(h, residual, pre_attn.weight, pre_attn.eps, True)
        a = self.self_attn.forward_fused(x, positions, cos_sin_cache, meta, ops)
        a = ops.rms_norm(a, post_attn.weight, post_attn.eps, True)
        x, residual = ops.fused_add_rms_norm(a, residual, pre_ff.weight, pre_ff.eps, True)
        m = self.mlp.forward_fused(x, ops)
        return ops.rms_norm(m, post_ff.weight, post_ff.eps, True), residual


class Gemma3ForCausalLM(CausalLM):
    layer_cls = Gemma3DecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        # HF keeps sqrt(hidden) as a float32 scalar and rounds it to the weight dtype first.
        return h * torch.tensor(self.config.embedding_scale, dtype=h.dtype)


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    """Every ``pattern``-th layer is global, the others slide (Gemma 3's 5:1 interleave)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def gemma3_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    if cfg.get("attn_logit_softcapping"):
        raise ModelLoadError(source, "attn_logit_softcapping is not supported (Gemma 2 style)")
    fields = common_fields(cfg, source)
    fields["head_dim"] = int(cfg.get("head_dim", 256))
    layer_types = cfg.get("layer_types") or gemma3_layer_types(
        fields["num_layers"], int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
    )
    if isinstance(cfg.get("rope_parameters"), dict) and "sliding_attention" in cfg["rope_parameters"]:
        # transformers 5: one rope dict per layer type
        rope_local = parse_rope(cfg, source, "sliding_attention", default_theta=10000.0)
    else:
        # transformers 4 (Hub configs): local layers use rope_local_base_freq and never the scaling
        rope_local = RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    return ModelConfig(
        architecture="gemma3",
        **{**fields, "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True))},
        rope=parse_rope(cfg, source, "full_attention", default_theta=1_000_000.0),
        rope_local=rope_local,
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        qk_norm=True,
        norm_unit_offset=True,
        embedding_scale=fields["hidden_size"] ** 0.5,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        layer_types=list(layer_types),
        sliding_window=int(cfg.get("sliding_window", 4096)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )
