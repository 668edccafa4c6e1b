"""Reading a Hugging Face ``config.json`` into a :class:`~infer.config.ModelConfig`.

Handles both spellings of rotary parameters: transformers 4.x (``rope_theta``,
``rope_scaling``, Gemma's ``rope_local_base_freq``) and 5.x (``rope_parameters``, flat or
keyed by layer type).
"""

from __future__ import annotations

from typing import Any

from infer.config import RopeConfig
from infer.errors import ModelLoadError


def require(cfg: dict[str, Any], key: str, source: str) -> Any:
    """``cfg[key]``, or a :class:`ModelLoadError` naming the file and the missing field."""
    if key not in cfg or cfg[key] is None:
        raise ModelLoadError(source, f"required field {key!r} is missing")
    return cfg[key]


def _rope_from_params(params: dict[str, Any], default_theta: float | None, source: str) -> RopeConfig:
    theta = params.get("rope_theta", default_theta)
    if theta is None:
        raise ModelLoadError(source, "required field 'rope_theta' is missing")
    kind = params.get("rope_type", params.get("type", "default"))
    scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return RopeConfig(theta=float(theta), scaling=scaling)


def parse_rope(cfg: dict[str, Any], source: str, layer_type: str = "full_attention",
               default_theta: float | None = 10000.0) -> RopeConfig:
    """The :class:`RopeConfig` of ``layer_type`` layers.

    Raises:
        ModelLoadError: when no base can be found.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        if layer_type in params and isinstance(params[layer_type], dict):
            return _rope_from_params(params[layer_type], default_theta, source)
        if "full_attention" in params or "sliding_attention" in params:
            # keyed by layer type, but not this one
            return RopeConfig(theta=float(default_theta))
        return _rope_from_params(params, cfg.get("rope_theta", default_theta), source)
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta", default_theta)
    if scaling:
        return _rope_from_params({**scaling, "rope_theta": theta}, default_theta, source)
    if theta is None:
        raise ModelLoadError(source, "required field 'rope_theta' is missing")
    return RopeConfig(theta=float(theta))


def eos_ids(value: Any) -> list[int]:
    """``eos_token_id`` (int, list or None) as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def common_fields(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """The fields every supported architecture shares, as ModelConfig keyword arguments."""
    hidden = int(require(cfg, "hidden_size", source))
    heads = int(require(cfg, "num_attention_heads", source))
    return dict(
        vocab_size=int(require(cfg, "vocab_size", source)),
        hidden_size=hidden,
        intermediate_size=int(require(cfg, "intermediate_size", source)),
        num_layers=int(require(cfg, "num_hidden_layers", source)),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids(cfg.get("eos_token_id")),
    )
