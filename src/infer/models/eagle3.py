"""The EAGLE-3 draft head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test", arXiv:2503.01840), as the published checkpoints lay it out.

One decoder layer that reads the *target's* hidden states instead of its own stack::

    g      = fc(concat(a_2, a_mid, a_last))          # [3 * H_target] -> [H]: three target layers' inputs
                                                      # (first draft step; later steps: the head's own h)
    x      = concat(input_layernorm(embed(t)), hidden_norm(g))          # [2 * H]: token and feature
    h      = g + o_proj(attention(q/k/v_proj(x)))     # q/k/v read 2 * H; the residual is g
                                                      # (norm_before_residual: hidden_norm(g))
    h      = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                         # over a reduced draft vocabulary
    token  = argmax + d2t[argmax]                     # the target's id of the draft token

``h`` (before ``norm``) is the feature the next draft step feeds back in place of ``g``. Row ``p`` of
a sequence pairs the feature of position ``p`` with the token at ``p + 1`` and predicts the token at
``p + 2`` (vLLM's and EAGLE's alignment); its K/V go to position ``p`` of the head's own one-layer cache.

Two checkpoint layouts are read (:func:`parse_eagle3_config`):

* ``speculators`` (``RedHatAI/*speculator.eagle3``): ``config.json`` has ``speculators_model_type:
  "eagle3"``, the layer's hyper-parameters in ``transformer_layer_config``, ``draft_vocab_size``,
  ``target_hidden_size``, ``norm_before_residual`` (vLLM's default when left out: true) and
  ``eagle_aux_hidden_state_layer_ids``; weights ``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``,
  ``t2d`` and optionally ``embed_tokens``;
* EAGLE / SGLang (``LlamaForCausalLMEagle3``): a Llama ``config.json`` with ``draft_vocab_size`` (and
  maybe ``target_hidden_size``, ``eagle_config.eagle_aux_hidden_state_layer_ids``); the layer's weights
  are ``midlayer.*``.

A head without ``embed_tokens`` shares the target's embedding table (as vLLM and EAGLE do).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from infer.attention.metadata import AttentionMetadata
from infer.config import ModelConfig
from infer.models.layers import Attention, GatedMLP, RMSNorm, rope_cos_sin, rope_inv_freq
from infer.models.llama import llama_config

__all__ = ["Eagle3Config", "Eagle3Head", "default_aux_layers", "parse_eagle3_config"]

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default target layers: 2, L // 2 and L - 3 (a low, a middle and a high one; the hidden
    state taken is each layer's input), in increasing order (the order they are concatenated)."""
    return tuple(sorted({2, num_layers // 2, num_layers - 3}))


@dataclass
class Eagle3Config:
    """An EAGLE-3 head's configuration (:func:`parse_eagle3_config`).

    Attributes:
        layer: the decoder layer's hyper-parameters (a Llama layer; ``vocab_size`` is the target's).
        draft_vocab_size: rows of ``lm_head`` (the reduced vocabulary the head predicts over).
        target_hidden_size: the hidden size of the target model the head was trained on.
        aux_layer_ids: the target layers whose inputs ``fc`` reads, or None for the default.
        norm_before_residual: the residual of the attention block is ``hidden_norm(g)``, not ``g``.
        norm_before_fc: an RMSNorm (``input_norm``) over the concatenated target states before ``fc``.
        layout: ``"speculators"`` or ``"eagle"`` (EAGLE / SGLang, ``midlayer.*``).
    """

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int] | None
    norm_before_residual: bool
    norm_before_fc: bool
    layout: str


def parse_eagle3_config(raw: dict[str, Any], source: str) -> Eagle3Config:
    """Read an EAGLE-3 head's ``config.json`` (either layout, module docstring).

    Raises:
        ValueError: not an EAGLE-3 head, or one this engine does not run (more than one layer, no
            auxiliary hidden states); the message names ``source``.
    """
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise ValueError(f"{source}: speculators_model_type {raw['speculators_model_type']!r} is not 'eagle3'")
        layer_raw = raw.get("transformer_layer_config")
        if not isinstance(layer_raw, dict):
            raise ValueError(f"{source}: a speculators EAGLE-3 config needs transformer_layer_config (an object)")
        layout, aux = "speculators", raw.get("eagle_aux_hidden_state_layer_ids")
        before_residual = raw.get("norm_before_residual", True)  # vLLM's default for this layout
    elif set(raw.get("architectures") or ()) & set(EAGLE3_ARCHITECTURES):
        layer_raw, layout = raw, "eagle"
        eagle = raw.get("eagle_config") or {}
        if not eagle.get("use_aux_hidden_state", True):
            raise ValueError(f"{source}: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 style head); "
                             "only EAGLE-3 heads, which read three target layers, are supported")
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        before_residual = raw.get("norm_before_residual", False)
    else:
        raise ValueError(f"{source}: not an EAGLE-3 head: config.json has neither speculators_model_type 'eagle3' "
                         f"nor architectures {' or '.join(EAGLE3_ARCHITECTURES)}")
    layer_raw = {"num_hidden_layers": 1, **layer_raw}
    if int(layer_raw["num_hidden_layers"]) != 1:
        raise ValueError(f"{source}: the head has {layer_raw['num_hidden_layers']} decoder layers; only one-layer "
                         "EAGLE-3 heads (the published ones) are supported")
    layer = llama_config(layer_raw, source)
    return Eagle3Config(
        layer=layer,
        draft_vocab_size=int(raw.get("draft_vocab_size") or layer.vocab_size),
        target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
        aux_layer_ids=[int(i) for i in aux] if aux else None,
        norm_before_residual=bool(before_residual),
        norm_before_fc=bool(raw.get("norm_before_fc", False)),
        layout=layout,
    )


class Eagle3DecoderLayer(nn.Module):
    """The head's one layer: a Llama layer whose q/k/v projections read ``2 * hidden`` (the normalized
    token embedding and the normalized feature, concatenated), plus ``hidden_norm`` for the feature."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.self_attn = Attention(cfg, 0)
        attn = self.self_attn
        attn.q_proj = nn.Linear(2 * h, attn.num_heads * d, bias=cfg.attention_bias)
        attn.k_proj = nn.Linear(2 * h, attn.num_kv_heads * d, bias=cfg.attention_bias)
        attn.v_proj = nn.Linear(2 * h, attn.num_kv_heads * d, bias=cfg.attention_bias)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)


class Eagle3Head(nn.Module):
    """The EAGLE-3 draft head (module docstring). Parameter names are the ``speculators`` layout's.

    Args:
        cfg: the parsed config.
        num_aux: how many target layers ``fc`` reads (3 for EAGLE-3).
    """

    def __init__(self, cfg: Eagle3Config, num_aux: int = 3, fc_bias: bool = False) -> None:
        super().__init__()
        lc = cfg.layer
        self.config = cfg
        h, in_fc = lc.hidden_size, num_aux * cfg.target_hidden_size
        self.input_norm = RMSNorm(in_fc, lc.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc = nn.Linear(in_fc, h, bias=fc_bias)
        self.embed_tokens = nn.Embedding(lc.vocab_size, h)
        self.layers = nn.ModuleList([Eagle3DecoderLayer(lc)])
        self.norm = RMSNorm(h, lc.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.inv_freq: torch.Tensor | None = None  # set by set_rope (after loading: not a meta tensor)
        self.ops = None  # the fused ops module (set_fused_ops), or None: the reference forward
        self.cos_sin_cache: torch.Tensor | None = None

    def set_rope(self, device: torch.device) -> None:
        """Build the rotary table (``1 / theta^(2i / d)``) on ``device``."""
        lc = self.config.layer
        self.inv_freq = rope_inv_freq(lc.rotary_dim, lc.rope).to(device)

    def set_attention_backend(self, backend) -> None:
        self.layers[0].self_attn.backend = backend

    def set_fused_ops(self, ops, max_positions: int) -> None:
        """The fused forward (phase 8's ops, as :meth:`~infer.models.layers.CausalLM.set_fused_ops`; after
        :meth:`set_rope`): merges q/k/v and gate/up (the parts become views) and builds the cos/sin table
        of ``max_positions`` rows; ``ops=None``: the reference forward."""
        self.ops = ops
        if ops is None:
            return
        from infer.kernels.fused_reference import build_cos_sin_cache

        layer = self.layers[0]
        layer.self_attn.merge_qkv()
        layer.mlp.merge_gate_up()
        self.cos_sin_cache = build_cos_sin_cache(self.inv_freq, max_positions, self.inv_freq.device)

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's kept hidden states ``[T, num_aux * H_target]`` -> the head's feature ``[T, H]``."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft forward over a flattened batch.

        Args:
            input_ids: int64 ``[T]``: the token after each row's position (target ids).
            hidden: ``[T, H]``: each row's feature (``combine_hidden_states`` of the target's states, or
                the head's own output ``h`` of the previous draft step).
            positions: int64 ``[T]``; meta: over the head's one-layer KV cache.

        Returns:
            ``(norm(h), h)``, each ``[T, H]``: the first for :meth:`draft_token_ids`, the second the
            feature of the next draft step.
        """
        if self.ops is not None:
            return self.forward_fused(input_ids, hidden, positions, meta)
        layer = self.layers[0]
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        if self.config.norm_before_residual:
            hidden = layer.hidden_norm(hidden)
            residual = hidden
        else:
            residual, hidden = hidden, layer.hidden_norm(hidden)
        x = torch.cat((layer.input_layernorm(emb), hidden), dim=-1)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        h = residual + layer.self_attn(x, cos, sin, meta)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h), h

    def forward_fused(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` through the fused ops, as a target layer's ``forward_fused``: the two norms write
        the halves of the q/k/v input in place of a concatenation, one merged q/k/v projection, one RoPE
        kernel (which writes K/V with the Triton backend), each residual add with a norm or a projection's
        epilogue. The same values; ``hidden`` is not modified."""
        ops, layer, h = self.ops, self.layers[0], self.config.layer.hidden_size
        attn, mlp, post = layer.self_attn, layer.mlp, layer.post_attention_layernorm
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        x = torch.empty(hidden.shape[0], 2 * h, dtype=hidden.dtype, device=hidden.device)
        ops.rms_norm(emb, layer.input_layernorm.weight, layer.input_layernorm.eps, out=x[:, :h])
        ops.rms_norm(hidden, layer.hidden_norm.weight, layer.hidden_norm.eps, out=x[:, h:])
        # the stream the attention adds to: the normed feature, or the feature (copied: the adds run in place)
        residual = x[:, h:].clone() if self.config.norm_before_residual else hidden.clone()
        o, residual = attn.forward_fused_qkv(ops.linear(x, attn.qkv_proj), positions, self.cos_sin_cache, meta, ops,
                                             residual)
        act, residual = ops.add_rms_norm_linear(o, residual, post.weight, post.eps, False, mlp.gate_up_proj,
                                                mlp.act_name)
        out, residual = ops.linear_residual(act, mlp.down_proj, residual)
        return ops.add_rms_norm(out, residual, self.norm.weight, self.norm.eps)

    def draft_token_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens as target ids: ``argmax(lm_head(normed)) + d2t[argmax]`` (int64 ``[N]``)."""
        best = self.lm_head(normed).argmax(dim=-1)
        return best + self.d2t[best]
