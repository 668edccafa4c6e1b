"""What a checkpoint *is*: :class:`ModelConfig` (layer count, head counts, rope bases, the layer kinds of a
hybrid model, ...), read from a Hugging Face ``config.json`` or from GGUF metadata by the loaders and never
set by a user; and the device / dtype defaults every layer below the engine shares.

:class:`~infer.config.EngineConfig` (how the engine *runs* a model) lives in :mod:`infer.config`, which
re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

LayerType = Literal["full_attention", "sliding_attention"]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters for one kind of layer.

    ``theta`` is the base; ``scaling`` is ``None`` or a dict in Hugging Face's
    ``rope_scaling`` format. Supported ``rope_type`` values: ``default``, ``linear``
    and ``llama3`` (Meta's Llama 3.1 frequency-dependent scaling).
    """

    theta: float
    scaling: dict[str, Any] | None = None

    @property
    def rope_type(self) -> str:
        if not self.scaling:
            return "default"
        return self.scaling.get("rope_type", self.scaling.get("type", "default"))


@dataclass
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer.

    Attributes mirror Hugging Face's names where one exists. ``layer_types[i]`` is
    ``"full_attention"`` or ``"sliding_attention"`` (Gemma 3 interleaves them); sliding
    layers attend to the last ``sliding_window`` positions (the query's own included) and use
    ``rope_local`` instead of ``rope``.
    """

    architecture: str  # "llama" | "qwen3" | "gemma3" | "qwen3_moe" | "qwen3_5"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_scale: float | None = None  # default head_dim ** -0.5
    norm_unit_offset: bool = False  # Gemma: RMSNorm multiplies by (1 + w) in float32
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    final_logit_softcapping: float | None = None
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    rope_local: RopeConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # ---- mixture of experts (phase 15, Qwen3-MoE); num_experts == 0: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's gated-MLP width
    norm_topk_prob: bool = False  # renormalize the top-k routing probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here
    # ---- hybrid linear attention (phase 17, Qwen3.5): layer_types "linear_attention" are Gated DeltaNet
    # layers, with a fixed-size recurrent state per sequence instead of a KV cache
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims of each head
    attn_output_gate: bool = False  # q_proj also yields a per-head sigmoid gate on the attention output
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_layers
        if self.attention_scale is None:
            self.attention_scale = self.head_dim**-0.5
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has a sparse MoE block (else a dense gated MLP of
        ``intermediate_size``): Hugging Face's rule for Qwen3-MoE (``decoder_sparse_step``,
        ``mlp_only_layers``)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates (all of them unless ``partial_rotary_factor`` < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are linear attention (phase 17): they keep a recurrent state, not K/V."""
        return "linear_attention" in self.layer_types

    @property
    def num_kv_layers(self) -> int:
        """Layers that cache K/V (every layer but the linear-attention ones)."""
        return sum(t != "linear_attention" for t in self.layer_types)

    def state_bytes_per_seq(self, dtype: torch.dtype, ssm_dtype: torch.dtype = torch.float32) -> int:
        """Bytes of recurrent state one sequence holds across the linear-attention layers (0 for a
        model without any): the conv state (``K - 1`` inputs of the q/k/v channels, in ``dtype``) and
        the delta-rule state (``[Hv, Dk, Dv]``, in ``ssm_dtype``) of each."""
        n = len(self.layer_types) - self.num_kv_layers
        conv_dim = 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim
        ssm = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * ssm_dtype.itemsize
        return n * (conv_dim * (self.linear_conv_kernel_dim - 1) * dtype.itemsize + ssm)

    def window_of(self, layer_idx: int) -> int | None:
        """Sliding window (tokens) of a layer, or None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embeddings counted once when tied).

        ``active=True`` counts, for an MoE model, only the ``num_experts_per_tok`` experts one
        token uses in each MoE layer (plus the router): the weights a batch-1 decode step reads.
        """
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * (3 if self.attn_output_gate else 2) + self.num_kv_heads * 2)
        norms = (4 if self.norm_unit_offset and not self.is_hybrid else 2) * h + (2 * d if self.qk_norm else 0)
        hk, hv = self.linear_num_key_heads * self.linear_key_head_dim, self.linear_num_value_heads * self.linear_value_head_dim
        conv = 2 * hk + hv  # Gated DeltaNet (phase 17): in_proj_qkv/z/b/a, conv1d, A_log, dt_bias, norm, out_proj
        linear = h * (conv + 2 * hv + 2 * self.linear_num_value_heads) + conv * self.linear_conv_kernel_dim + \
            2 * self.linear_num_value_heads + self.linear_value_head_dim
        total = 0
        for layer in range(self.num_layers):
            if self.layer_types[layer] == "linear_attention":
                total -= attn + (2 * d if self.qk_norm else 0) - linear
            if self.is_moe_layer(layer):
                experts = self.num_experts_per_tok if active else self.num_experts
                mlp = experts * 3 * h * self.moe_intermediate_size + self.num_experts * h  # + router
            else:
                mlp = 3 * h * i
            total += attn + mlp + norms
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return total + emb + h

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V cached for one token across all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim * itemsize


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> torch.dtype:
    """float32 on CPU (bf16 matmuls are hundreds of times slower there), bfloat16 on CUDA."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, device: str | torch.device) -> torch.dtype:
    """Turn ``"auto"``/``None``/a name/a torch dtype into a torch dtype.

    Raises:
        ValueError: for a name that is not a floating-point dtype infer supports.
    """
    if value is None or value == "auto":
        return default_dtype(device)
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {value}; use one of float32, bfloat16, float16")
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {value!r}; use one of auto, float32, bfloat16, float16"
        ) from None
