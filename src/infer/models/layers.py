"""Layers shared by every architecture: RMSNorm, rotary embeddings, attention, gated MLP,
and the causal-LM skeleton (embeddings -> decoder layers -> final norm -> LM head).

Every forward works on *flattened* tokens: ``hidden[T, hidden_size]`` where ``T`` is the
number of new tokens of all sequences in the step (see :mod:`infer.attention.metadata`).
Architecture files (``llama.py``, ``qwen3.py``, ``gemma3.py``) hold only what differs.

Parameter names follow Hugging Face's (``model.layers.0.self_attn.q_proj.weight``), so a
Hugging Face state dict loads without renaming.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from infer.attention.metadata import AttentionMetadata
from infer.config import ModelConfig, RopeConfig
from infer.kernels.activations import ACTIVATIONS
from infer.models.quant import ConcatLinear, QuantizedLinear, merge_quantized
from infer.parallel.state import get_parallel, mark_shard, tp_rank, tp_size

# ----------------------------------------------------------------------------- RMSNorm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """Root-mean-square layer norm (Zhang & Sennrich, 2019, arXiv:1910.07467).

    ``y = x / sqrt(mean(x^2, last dim) + eps) * w``, the statistics taken in float32.
    Llama and Qwen cast the normalized value back to ``x.dtype`` before multiplying by ``w``;
    Gemma multiplies by ``(1 + w)`` in float32 and casts last (``unit_offset=True``). Both
    orders are kept exactly, because in bfloat16 they round differently.

    Args:
        x: ``[..., d]`` in any float dtype.
        weight: ``[d]``.
        eps: added to the mean square.
        unit_offset: Gemma's ``(1 + w)`` form.

    Returns:
        ``[..., d]`` in ``x.dtype``.
    """
    # >>> EXERCISE rms_norm
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.float())).to(dtype)
    return weight * h.to(dtype)
    # <<< EXERCISE rms_norm


class RMSNorm(nn.Module):
    """:func:`rms_norm` with a learned ``weight[d]``."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.unit_offset)


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32, CPU) of rotary embeddings.

    ``inv_freq[i] = theta ** (-2i / head_dim)`` (Su et al., RoFormer, arXiv:2104.09864), then
    scaled: ``linear`` divides every frequency by ``factor``; ``llama3`` (Meta, Llama 3.1)
    divides only the low frequencies, keeps the high ones and interpolates in between.

    Raises:
        ValueError: for a rope type infer does not implement.
    """
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = rope.rope_type
    if kind == "default":
        return inv_freq
    s = rope.scaling or {}
    if kind == "linear":
        return inv_freq / s["factor"]
    if kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {kind!r} (supported: default, linear, llama3)")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin tables for ``positions``.

    Args:
        positions: int ``[T]``.
        inv_freq: float32 ``[head_dim // 2]`` on the same device.
        dtype: dtype of the returned tables (the model's compute dtype).

    Returns:
        ``(cos, sin)``, each ``[T, head_dim]``: the angle ``positions * inv_freq`` computed in
        float32, duplicated over the two halves of the head (the "rotate half" layout).
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, head_dim]``) by the angles in ``cos``/``sin`` (``[T, head_dim]``).

    Uses the "rotate half" layout of GPT-NeoX and Hugging Face: dimension ``i`` of the first half
    is paired with dimension ``i + head_dim/2``, and each pair is rotated by its angle:
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``.
    """
    # >>> EXERCISE apply_rope
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
    # <<< EXERCISE apply_rope


# ----------------------------------------------------------------------------- attention


class Attention(nn.Module):
    """Multi-head attention with grouped K/V heads (GQA, Ainslie et al., arXiv:2305.13245).

    Optional per-head RMSNorm of q and k before RoPE (``qk_norm``: Qwen3, Gemma 3). The
    attention itself (cache write + softmax(q k^T) v) is delegated to the model's attention
    backend, so the cache layout and the kernel can change without touching this file.
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        # tensor parallelism (phase 14): this rank's query heads, and the KV heads they read
        # (whole KV heads split across ranks; each copied to several ranks when there are fewer)
        tp, r = tp_size(), tp_rank()
        kv_parts = min(tp, cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads = cfg.num_heads // tp, cfg.num_kv_heads // kv_parts
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = RowParallelLinear(self.num_heads * d, h, bias=cfg.attention_bias)
        mark_shard(self.q_proj, 0, r, tp)
        for proj in (self.k_proj, self.v_proj):
            mark_shard(proj, 0, r * kv_parts // tp, kv_parts)
        mark_shard(self.o_proj, 1, r, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None
        self.scale = cfg.attention_scale
        self.window = cfg.window_of(layer_idx)
        self.backend = None  # set by CausalLM.set_attention_backend

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """``x[T, hidden]`` -> ``[T, hidden]``."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # one rotation for the query and key heads together
        qk = apply_rope(torch.cat((q, k), dim=1), cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = self.backend.forward(self.layer_idx, q, k, v, meta, self.scale, self.window)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))

    # ------------------------------------------------------------------ fused_kernels (phase 8)

    def merge_qkv(self) -> None:
        """Give the module one ``qkv_proj`` whose output rows are q's, then k's, then v's.

        One GEMM reads ``x`` once and launches once instead of three times; its output
        ``[T, (Hq + 2 * Hkv) * D]`` is what :func:`~infer.kernels.fused_reference.qk_norm_rope`
        takes. ``q_proj``, ``k_proj`` and ``v_proj`` become views into the merged weight (no extra
        memory), so the unfused forward still works. The loaders keep Hugging Face's names; the
        merge happens after loading. Idempotent.
        """
        if not hasattr(self, "qkv_proj"):
            self.qkv_proj = merge_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward_fused(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      meta: AttentionMetadata, ops) -> torch.Tensor:
        """:meth:`forward` with the merged projection and one QK-norm + RoPE kernel."""
        return self.forward_fused_qkv(ops.linear(x, self.qkv_proj), positions, cos_sin_cache, meta, ops)

    def forward_fused_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                          meta: AttentionMetadata, ops, residual: torch.Tensor | None = None):
        """:meth:`forward_fused` from the merged projection's output ``qkv [T, (Hq + 2 Hkv) * D]`` on
        (a layer that computes it with its norm, ``ops.add_rms_norm_linear``, starts here). With a
        ``residual`` (the residual stream, ``[T, hidden]``) the output projection adds it
        (``ops.linear_residual``) and ``(h, residual)`` is returned, whose sum is the stream after attention."""
        t = qkv.shape[0]
        qn, kn = self.q_norm, self.k_norm
        # the Triton backend lets the RoPE kernel write the new K/V into the cache (one launch fewer)
        # (not while an FP8 cache calibrates this layer's scales: from the rotated k, before its first write)
        write = (meta.kv_cache is not None and getattr(self.backend, "cache_write_in_rope", False)
                 and not meta.kv_cache.needs_calibration(self.layer_idx))
        q, k, v = ops.qk_norm_rope(
            qkv, positions, cos_sin_cache, self.num_heads, self.num_kv_heads, self.head_dim,
            qn.weight if qn is not None else None, kn.weight if kn is not None else None,
            qn.eps if qn is not None else 1e-6, qn.unit_offset if qn is not None else False,
            kv_cache=meta.kv_cache.layer(self.layer_idx) if write else None,
            slot_mapping=meta.slot_mapping if write else None,
            kv_scales=meta.kv_cache.scales(self.layer_idx) if write else None,
        )
        o = self.backend.forward(self.layer_idx, q, k, v, meta, self.scale, self.window, kv_written=write)
        o = o.reshape(t, self.num_heads * self.head_dim)
        return ops.linear(o, self.o_proj) if residual is None else ops.linear_residual(o, self.o_proj, residual)


def merge_linears(*parts: nn.Linear) -> nn.Linear:
    """One ``nn.Linear`` whose output rows are ``parts``' rows, in order (all take the same input).

    Each part's weight (and bias) is re-pointed at its rows of the merged tensor, so the parts
    keep working and the merge costs no memory beyond the copy it replaces. Quantized parts (phase 11)
    go to :func:`~infer.models.quant.merge_quantized`; parts of different layouts (a GGUF's projections
    of different types, some dequantized) become a :class:`~infer.models.quant.ConcatLinear` of each
    run of consecutive parts of one layout, merged.
    """
    runs = [list(run) for _, run in itertools.groupby(parts, key=_layout)]
    if len(runs) > 1:  # phase 11: a GGUF's parts in different layouts: each run merged, the runs side by side
        return ConcatLinear(*[merge_linears(*run) if len(run) > 1 else run[0] for run in runs])
    if isinstance(parts[0], QuantizedLinear):  # phase 11: the quantized values and scales, concatenated
        return merge_quantized(*parts)
    weight = torch.cat([p.weight for p in parts], dim=0)
    bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
    merged = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        merged.bias = nn.Parameter(bias, requires_grad=False)
    merged.part_rows = []  # (part, first row, rows): for set_weight_layout to re-point the views
    start = 0
    for p in parts:
        n = p.weight.shape[0]
        p.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        merged.part_rows.append((p, start, n))
        start += n
    return merged


def _layout(p: nn.Module) -> tuple:
    """What parts merged into one tensor must share (:meth:`QuantizedLinear.layout`, or a float layer's input)."""
    return p.layout() if isinstance(p, QuantizedLinear) else ("float", p.in_features, p.bias is not None)


def set_weight_layout(linear: nn.Linear, column_major: bool) -> None:
    """Store ``linear``'s ``[out, in]`` weight row-major (PyTorch's default) or column-major
    (the same values, each *input* feature's column contiguous: a ``[in, out]`` tensor seen
    transposed), re-pointing the views of a merged projection's parts.

    ``F.linear`` then computes ``x @ W.T`` over contiguous ``[in, out]`` memory. On the CPU a
    one-row product (batch-1 decode) streams that layout faster: measured on a 2-core x86 machine,
    SmolLM2's per-layer weights 15.6 -> 18.0 GB/s and its 113 MB LM head 14.6 -> 25.5 GB/s.
    """
    for part in getattr(linear, "parts", ()):  # a ConcatLinear (phase 11): its float parts
        set_weight_layout(part, column_major)
    if not isinstance(linear, nn.Linear):  # a QuantizedLinear (phase 11) keeps its packed layout
        return
    w = linear.weight
    is_column_major = w.dim() == 2 and w.stride(0) == 1 and w.shape[1] > 1
    if is_column_major == column_major:
        return
    new = w.t().contiguous().t() if column_major else w.contiguous()
    linear.weight = nn.Parameter(new, requires_grad=False)
    for part, start, n in getattr(linear, "part_rows", ()):
        part.weight = nn.Parameter(new[start:start + n], requires_grad=False)


class RowParallelLinear(nn.Linear):
    """The second half of Megatron-LM's column/row pair (Shoeybi et al., arXiv:1909.08053).

    Each of the ``tp`` ranks holds ``weight[:, r * in / tp : (r + 1) * in / tp]`` (a slice of the
    *input* features) and receives exactly those features of ``x``: the output of the
    column-parallel layer before it (its heads, its MLP columns), never gathered. Its product is a
    partial sum of the full ``x @ W.T``; one all-reduce adds the ``tp`` partial sums, then the bias
    is added once. With one rank it is ``nn.Linear``.

    Shapes: ``x [T, in / tp]`` -> ``[T, out]`` (the same on every rank after the all-reduce).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.parallel = get_parallel()  # the ranks this layer was built for

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return super().forward(x)
        # >>> EXERCISE row_parallel_linear
        y = self.parallel.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
        # <<< EXERCISE row_parallel_linear


class VocabParallelEmbedding(nn.Embedding):
    """An embedding table split by rows (token ids) across the tensor-parallel ranks.

    Rank ``r`` holds ids ``[r * V / tp, (r + 1) * V / tp)``: it looks up the ids it holds, writes
    zeros for the others, and one all-reduce sums the ``tp`` partial results (each row is nonzero on
    exactly one rank, so the sum is exact). Megatron-LM's ``VocabParallelEmbedding``.

    Shapes: int64 ``ids [T]`` -> ``[T, hidden]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        tp = tp_size()
        super().__init__(num_embeddings // tp, embedding_dim)
        self.vocab_start = tp_rank() * (num_embeddings // tp)
        mark_shard(self, 0, tp_rank(), tp)
        self.parallel = get_parallel()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return super().forward(ids)
        # >>> EXERCISE vocab_parallel_embedding
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_embeddings)
        h = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return self.parallel.all_reduce(h * mine[:, None].to(h.dtype))
        # <<< EXERCISE vocab_parallel_embedding


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``: SwiGLU for Llama/Qwen (Shazeer, arXiv:2002.05202),
    GeGLU with tanh-approximated GELU for Gemma."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        tp, r = tp_size(), tp_rank()
        h, i = cfg.hidden_size, cfg.intermediate_size // tp  # tensor parallelism: this rank's columns
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = RowParallelLinear(i, h, bias=cfg.mlp_bias)
        for proj, dim in ((self.gate_proj, 0), (self.up_proj, 0), (self.down_proj, 1)):
            mark_shard(proj, dim, r, tp)
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.act_name = "silu" if cfg.hidden_act == "silu" else "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def merge_gate_up(self) -> None:
        """Give the module one ``gate_up_proj`` (gate rows first); the parts become views of it."""
        if not hasattr(self, "gate_up_proj"):
            self.gate_up_proj = merge_linears(self.gate_proj, self.up_proj)

    def forward_fused(self, x: torch.Tensor, ops) -> torch.Tensor:
        """One GEMM for gate and up, one kernel for ``act(gate) * up``, then ``down_proj``."""
        return ops.linear(ops.act_and_mul(ops.linear(x, self.gate_up_proj), self.act_name), self.down_proj)


# ----------------------------------------------------------------------------- the model


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (Hugging Face's ``model.*``)."""

    def __init__(self, cfg: ModelConfig, layer_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([layer_cls(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)


class CausalLM(nn.Module):
    """A decoder-only language model over flattened tokens.

    Subclasses set ``layer_cls`` (the decoder layer of their architecture) and may override
    :meth:`embed`. Build it under ``torch.device("meta")`` and load weights with
    :func:`infer.loader.load_model`, which puts every tensor straight on its device.
    """

    layer_cls: type[nn.Module]
    #: EAGLE-3 (phase 12, :mod:`infer.engine.eagle3`): the layers whose *input* (the residual stream
    #: after the layers before them) every forward keeps, in increasing order; empty: none are kept
    #: (:meth:`keep_aux_hidden_states`)
    aux_hidden_state_layers: tuple[int, ...] = ()
    #: where every forward writes them: rows ``[0, T)`` of ``[max_tokens, len(layers) * hidden_size]``
    #: (concatenated in layer order), one fixed buffer, so a CUDA graph's replay writes them too
    aux_hidden_states: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, self.layer_cls)
        # tensor parallelism: each rank holds vocab_size / tp rows of the LM head (compute_logits gathers)
        self.parallel = get_parallel()  # the ranks this model was built for (infer.parallel.state)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // tp_size(), bias=False)
        mark_shard(self.lm_head, 0, tp_rank(), tp_size())
        # Rotary tables per layer type (Gemma 3: a local base for sliding layers). Built on the
        # CPU explicitly so that meta-device construction still gets real values.
        ropes = {"full_attention": cfg.rope, "sliding_attention": cfg.rope_local or cfg.rope}
        for kind in sorted(set(cfg.layer_types) & set(ropes)):  # (a linear-attention layer has no RoPE)
            inv = rope_inv_freq(cfg.rotary_dim, ropes[kind]).to("cpu")
            self.register_buffer(f"inv_freq_{kind}", inv, persistent=False)
        self.ops = None  # the fused ops module (set_fused_ops), or None: the reference forward
        self.cos_sin_caches: dict[str, torch.Tensor] = {}

    def set_fused_ops(self, ops, max_positions: int = 0) -> None:
        """Choose the fused forward (``EngineConfig.fused_kernels``, phase 8) or the reference one.

        Args:
            ops: the module of fused operations, :mod:`infer.kernels.fused_triton` or its
                plain-PyTorch twin :mod:`infer.kernels.fused_reference` (the same functions), or
                None for the unfused forward.
            max_positions: the longest sequence the forward will see (tokens): the float32
                cos/sin table ``[max_positions, head_dim]`` of each rotary base is precomputed.

        The first call merges every layer's Q/K/V and gate/up projections (the separate ones
        become views, so both forwards stay available: an engine chooses per model, as with
        :meth:`set_attention_backend`). On the CPU the fused forward also stores the projections
        column-major (:meth:`_set_cpu_weight_layout`); ``ops=None`` restores PyTorch's layout.
        """
        self.ops = ops
        on_cpu = self.model.embed_tokens.weight.device.type == "cpu"
        if ops is None:
            if on_cpu and getattr(self, "_column_major", False):
                self._set_cpu_weight_layout(False)
            return
        from infer.kernels.fused_reference import build_cos_sin_cache

        for layer in self.model.layers:
            layer.self_attn.merge_qkv()
            layer.mlp.merge_gate_up()
        if on_cpu:
            self._set_cpu_weight_layout(True)
        have = next(iter(self.cos_sin_caches.values())).shape[0] if self.cos_sin_caches else 0
        if have < max_positions:
            device = self.model.embed_tokens.weight.device
            self.cos_sin_caches = {
                kind: build_cos_sin_cache(getattr(self, f"inv_freq_{kind}"), max_positions, device)
                for kind in set(self.config.layer_types)
            }

    def _set_cpu_weight_layout(self, column_major: bool) -> None:
        """On the CPU the fused forward keeps every projection and the LM head column-major
        (:func:`set_weight_layout`): the one-row products of decode read it faster. A tied
        embedding table follows the LM head (a lookup reads one strided row per token)."""
        owners = [self.lm_head]
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            owners += [attn.qkv_proj, attn.o_proj]
            if isinstance(mlp, GatedMLP):  # not an MoE block (phase 15): its experts keep their layout
                owners += [mlp.gate_up_proj, mlp.down_proj]
        for linear in owners:
            set_weight_layout(linear, column_major)
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):  # not a quantized copy
            self.model.embed_tokens.weight = self.lm_head.weight
        self._column_major = column_major

    def keep_aux_hidden_states(self, layers: tuple[int, ...], max_tokens: int = 0) -> None:
        """EAGLE-3 (phase 12): from now on every forward writes the inputs of ``layers`` (increasing
        layer ids) into rows ``[0, T)`` of :attr:`aux_hidden_states`, a buffer of ``max_tokens`` rows
        allocated here (model dtype, ``max_tokens * len(layers) * hidden_size`` elements); no layers: keep
        none (and free the buffer). Capture CUDA graphs after this call: a graph replays the writes to the
        buffer's address.

        Raises:
            ValueError: a layer id out of range, or ``max_tokens < 1`` with layers to keep.
        """
        n = self.config.num_layers
        self.aux_hidden_state_layers, self.aux_hidden_states = (), None
        if not layers:
            return
        if max_tokens < 1 or any(not 0 <= i < n for i in layers):
            raise ValueError(f"keep_aux_hidden_states: layers {list(layers)} of {n}, max_tokens {max_tokens}")
        w = self.model.embed_tokens.weight
        self.aux_hidden_state_layers = tuple(layers)
        self.aux_hidden_states = torch.empty(max_tokens, len(layers) * self.config.hidden_size, dtype=w.dtype,
                                             device=w.device)

    def _aux_out(self, t: int):
        """The column block of each kept layer in the buffer's first ``t`` rows, by layer id (empty:
        none kept)."""
        aux = self.aux_hidden_state_layers
        if not aux:
            return {}
        buf = self.aux_hidden_states
        if t > buf.shape[0]:
            raise RuntimeError(f"a forward of {t} tokens, but the EAGLE-3 hidden-state buffer holds {buf.shape[0]}")
        h = self.config.hidden_size
        return {layer: buf[:t, j * h: (j + 1) * h] for j, layer in enumerate(aux)}

    def set_attention_backend(self, backend) -> None:
        """Choose the attention implementation once, for every layer."""
        self.attn_backend = backend
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Run the decoder over one flattened batch.

        Args:
            input_ids: int64 ``[T]``: new tokens of every sequence, back to back.
            positions: int64 ``[T]``: each token's position in its sequence.
            meta: where the sequences start, their context lengths, the KV cache.

        Returns:
            ``[T, hidden_size]`` final hidden states (after the final norm) in the model dtype.
        """
        if self.ops is not None:
            return self.forward_fused(input_ids, positions, meta)
        h = self.embed(input_ids)
        rope = {}
        for kind in set(self.config.layer_types):
            rope[kind] = rope_cos_sin(positions, getattr(self, f"inv_freq_{kind}"), h.dtype)
        aux = self._aux_out(len(input_ids))
        for i, (layer, kind) in enumerate(zip(self.model.layers, self.config.layer_types)):
            if i in aux:
                aux[i].copy_(h)
            cos, sin = rope[kind]
            h = layer(h, cos, sin, meta)
        return self.model.norm(h)

    def forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """:meth:`forward` through the fused ops (see :meth:`set_fused_ops`); the same values.

        The residual stream travels beside the hidden state (vLLM's layout): each layer returns
        ``(h, residual)`` and the next one starts with ``fused_add_rms_norm(h, residual)``, which
        adds them and normalizes the sum in one pass; the final norm closes the last sum. At one row
        (batch-1 decode, the Triton ops) a block's last projection adds the residual in its epilogue
        instead (``ops.linear_residual``) and passes ``residual=None``: the next norm then reads one
        row of the stream, not two (``ops.add_rms_norm``).
        """
        ops = self.ops
        h, residual = self.embed(input_ids), None
        aux = self._aux_out(len(input_ids))
        for i, (layer, kind) in enumerate(zip(self.model.layers, self.config.layer_types)):
            if i in aux and residual is None:
                aux[i].copy_(h)
            elif i in aux:  # the layer's input, h + residual (written before the fused norm adds in place)
                torch.add(h, residual, out=aux[i])
            h, residual = layer.forward_fused(h, residual, positions, self.cos_sin_caches[kind], meta, ops)
        norm = self.model.norm
        return ops.add_rms_norm(h, residual, norm.weight, norm.eps, norm.unit_offset)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden[N, hidden_size]`` -> logits ``[N, vocab_size]`` in the model dtype.

        With tensor parallelism every rank computes its vocabulary slice's logits and they are
        gathered (every rank must call this with the same ``N``)."""
        logits = self.lm_head(hidden) if self.ops is None else self.ops.linear(hidden, self.lm_head)
        if self.parallel.tp_size > 1:
            logits = self.parallel.all_gather_last_dim(logits)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
