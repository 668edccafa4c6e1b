"""Qwen3 dense models (Qwen Team, arXiv:2505.09388).

A Llama block with one difference: q and k are RMS-normalized per head before RoPE
(QK-norm), which keeps attention logits bounded. So the layer is Llama's and only the
config differs.
"""

from __future__ import annotations

from typing import Any

from infer.config import ModelConfig
from infer.models.hf_config import common_fields, parse_rope
from infer.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


def qwen3_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    fields = common_fields(cfg, source)
    layer_types = cfg.get("layer_types")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if window is None:
        layer_types = None
    return ModelConfig(
        architecture="qwen3",
        **fields,
        rope=parse_rope(cfg, source),
        hidden_act=cfg.get("hidden_act", "silu"),
        qk_norm=True,
        layer_types=list(layer_types or []),
        sliding_window=window,
    )
