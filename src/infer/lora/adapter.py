"""Reading a LoRA adapter in the PEFT layout, and rejecting what the engine cannot serve.

A PEFT adapter directory (``peft`` library, ``PeftModel.save_pretrained``) holds:

* ``adapter_config.json``: ``peft_type: "LORA"``, the rank ``r``, ``lora_alpha``, ``use_rslora``,
  ``target_modules`` and options this engine does not implement (DoRA, trained biases, extra
  trained modules, per-module rank or alpha patterns);
* ``adapter_model.safetensors``: for each adapted projection
  ``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`` (``[r, in]``) and
  ``...lora_B.weight`` (``[out, r]``).

The delta of a projection is ``scale * B (A x)`` with ``scale = lora_alpha / r`` (Hu et al.,
arXiv:2106.09685), or ``lora_alpha / sqrt(r)`` with rsLoRA (Kalajdzievski, arXiv:2312.03732).
:func:`load_adapter` folds the scale into ``B`` once (vLLM does the same), so the kernels never see it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infer.config import ModelConfig

#: the projections an adapter may target, by module (attention, then the dense gated MLP)
ATTENTION_PROJS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJS = ("gate_proj", "up_proj", "down_proj")
LORA_PROJS = ATTENTION_PROJS + MLP_PROJS

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$")


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """``{projection: (in_features, out_features)}`` of the base model's adaptable projections
    (one rank: the engine rejects LoRA with tensor parallelism)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv, i = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LoRAAdapter:
    """An adapter read into host memory.

    Attributes:
        name, int_id, path: from the :class:`~infer.lora.request.LoRARequest`.
        rank: ``r``; scaling: ``lora_alpha / r`` (or ``/ sqrt(r)`` with rsLoRA), already folded into B.
        weights: ``{(layer, projection): (A [r, in], scaling * B [out, r])}``, float32 on the CPU, for the
            projections the adapter changes (the others have no delta).
    """

    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def lora_scaling(lora_alpha: float, r: int, use_rslora: bool = False) -> float:
    """The factor ``s`` of an adapter's delta ``s * B A x``.

    LoRA (Hu et al., arXiv:2106.09685) scales by ``lora_alpha / r``, so that changing the rank does not
    change the size of the update at initialization; rank-stabilized LoRA (rsLoRA, Kalajdzievski,
    arXiv:2312.03732; ``use_rslora`` in PEFT's config) by ``lora_alpha / sqrt(r)``, which keeps learning
    stable at large ranks.
    """
    # >>> EXERCISE lora_scaling
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r
    # <<< EXERCISE lora_scaling


def _reject(path: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {path}: {why}")


def read_adapter_config(path: str | Path) -> dict:
    """``adapter_config.json`` of an adapter directory, checked for what the engine supports.

    Raises:
        ValueError: a missing directory or file, not a LoRA adapter, or an unsupported option (named).
    """
    p = Path(path)
    if not (p / "adapter_config.json").is_file():
        raise _reject(str(path), "no adapter_config.json (expected a PEFT adapter directory)")
    try:
        cfg = json.loads((p / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise _reject(str(path), f"adapter_config.json is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _reject(str(path), "adapter_config.json is not a JSON object")
    s = str(path)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _reject(s, f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    if cfg.get("use_dora"):
        raise _reject(s, "DoRA (use_dora) is not supported: its magnitude vector rescales each column of "
                         "W + BA, which is not an added low-rank delta")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise _reject(s, "adapters that train biases (bias / lora_bias) are not supported")
    if cfg.get("modules_to_save"):
        raise _reject(s, f"modules_to_save {cfg['modules_to_save']} (fully trained extra modules) are not "
                         "supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise _reject(s, "per-module rank_pattern / alpha_pattern are not supported")
    if cfg.get("fan_in_fan_out"):
        raise _reject(s, "fan_in_fan_out (GPT-2's transposed Conv1D layout) is not supported")
    if cfg.get("trainable_token_indices"):
        raise _reject(s, "trainable_token_indices (trained embedding rows) are not supported")
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    for t in targets:
        if any(w in t for w in ("embed_tokens", "lm_head")):
            raise _reject(s, f"target module {t!r}: adapters of the embeddings or the LM head are not supported")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise _reject(s, f"r must be a positive integer, got {r!r}")
    return cfg


def load_adapter(path: str | Path, model: ModelConfig, max_lora_rank: int, name: str = "",
                 int_id: int = 0) -> LoRAAdapter:
    """Read a PEFT LoRA adapter for ``model`` and check it fits.

    Args:
        path: the adapter directory.
        model: the base model's config (the shapes every A and B must have).
        max_lora_rank: the largest rank the engine's slots hold.

    Returns:
        The :class:`LoRAAdapter`, B scaled.

    Raises:
        ValueError: with the reason: an unsupported option (DoRA, biases, extra modules), a target
            outside q/k/v/o/gate/up/down (the embeddings, the LM head, an MoE layer's experts), a rank
            above ``max_lora_rank``, shapes of another base model, a missing or malformed file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    s = str(path)
    cfg = read_adapter_config(path)
    rank = cfg["r"]
    if rank > max_lora_rank:
        raise _reject(s, f"rank {rank} exceeds max_lora_rank={max_lora_rank}; restart with a larger max_lora_rank")
    scaling = lora_scaling(cfg.get("lora_alpha", rank), rank, bool(cfg.get("use_rslora")))
    file = Path(path) / "adapter_model.safetensors"
    if not file.is_file():
        why = ("adapter_model.bin (a pickle) is not read; save the adapter with safetensors"
               if (Path(path) / "adapter_model.bin").is_file() else "no adapter_model.safetensors")
        raise _reject(s, why)
    try:
        tensors = load_file(str(file), device="cpu")
    except (SafetensorError, OSError) as e:
        raise _reject(s, f"adapter_model.safetensors is not readable ({e})") from None
    shapes = projection_shapes(model)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if any(w in key for w in ("embed_tokens", "lm_head", "lora_embedding")):
            raise _reject(s, f"{key}: adapters of the embeddings or the LM head are not supported")
        m = _KEY.search(key)
        if m is None:
            raise _reject(s, f"{key}: not a lora_A / lora_B weight of a decoder layer's projection")
        layer, module, proj, ab = int(m[1]), m[2], m[3], m[4]
        if proj not in (ATTENTION_PROJS if module == "self_attn" else MLP_PROJS):
            raise _reject(s, f"{key}: only q/k/v/o_proj and gate/up/down_proj can be adapted")
        if layer >= model.num_layers:
            raise _reject(s, f"{key}: layer {layer}, but the base model has {model.num_layers} layers "
                             "(an adapter of another base model)")
        if module == "mlp" and model.is_moe_layer(layer):
            raise _reject(s, f"{key}: layer {layer}'s MLP is a mixture of experts; adapting experts is not "
                             "supported")
        parts.setdefault((layer, proj), {})[ab] = t
    if not parts:
        raise _reject(s, "adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, proj), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise _reject(s, f"layers.{layer}.{proj} has lora_{'A' if 'A' in ab else 'B'} but no "
                             f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        fin, fout = shapes[proj]
        if tuple(a.shape) != (rank, fin) or tuple(b.shape) != (fout, rank):
            raise _reject(s, f"layers.{layer}.{proj}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit "
                             f"rank {rank} on the base's {fin} -> {fout} projection (an adapter of another base "
                             "model, or a different r than adapter_config.json says)")
        weights[(layer, proj)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return LoRAAdapter(name or Path(path).name, int_id, s, rank, scaling, weights)
