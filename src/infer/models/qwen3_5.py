"""Qwen3.5 (text): a hybrid of Gated DeltaNet linear attention and gated full attention (phase 17).

Three of every four layers (``layer_types[i] == "linear_attention"``) replace softmax attention by
Gated DeltaNet (Yang et al., arXiv:2412.06464): a fixed-size state per sequence, updated by the
gated delta rule (:mod:`infer.kernels.gated_delta_reference`). The fourth is full attention with
three twists over Qwen3's: ``q_proj`` also yields a per-head *output gate* (``o * sigmoid(gate)``,
Qiu et al., "Gated Attention for LLMs", arXiv:2505.06708), RoPE rotates only the first quarter of
each head (``partial_rotary_factor``), and every RMSNorm but the DeltaNet's output norm multiplies
by ``(1 + w)`` (Gemma's form, ``norm_unit_offset``)::

    h = h + mixer(input_layernorm(h))          mixer: GatedDeltaNet or GatedAttention
    h = h + mlp(post_attention_layernorm(h))

A Gated DeltaNet layer, per token (``x`` the normed hidden state)::

    q, k, v = split(silu(causal_conv1d(in_proj_qkv(x))))     short conv over the last K inputs
    z = in_proj_z(x); beta = sigmoid(in_proj_b(x))
    g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)        log of the decay, per value head
    o = gated_delta_rule(l2norm(q), l2norm(k), v, g, beta)    the state S [Hv, Dk, Dv]
    out_proj(rms_norm(o) * w * silu(z))

Only the full-attention layers write the paged KV cache (their K/V at ``kv_idx``, the index among
attention layers); the DeltaNet layers read and write their sequence's slot of the
:class:`~infer.attention.state_cache.RecurrentStateCache`. Hugging Face's ``qwen3_5`` modeling is
the reference (tests/test_hybrid.py); Qwen3-Next (the same layers with MoE MLPs and a fused
``in_proj_qkvz``) is not implemented.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from infer.attention.metadata import AttentionMetadata
from infer.config import ModelConfig
from infer.kernels import gated_delta_reference as gdr
from infer.models.hf_config import common_fields, eos_ids, parse_rope
from infer.models.layers import CausalLM, GatedMLP, RMSNorm, apply_rope, merge_linears, rope_cos_sin


class GatedAttention(nn.Module):
    """Full attention with QK-norm, partial RoPE and a sigmoid output gate (Qwen3.5 / Qwen3-Next).

    ``q_proj`` gives ``[T, Hq, 2 * D]``: per head the query, then the gate. The K/V go to the KV
    cache at index ``kv_idx`` (attention layers only are cached)."""

    def __init__(self, cfg: ModelConfig, kv_idx: int) -> None:
        super().__init__()
        self.layer_idx = kv_idx  # what the attention backend indexes the KV cache with
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d * 2, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, unit_offset=True)
        self.rotary_dim = cfg.rotary_dim
        self.scale = cfg.attention_scale
        self.backend = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; ``cos``/``sin`` ``[T, rotary_dim]``."""
        return self.o_proj(self._attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin, meta))

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                      ops) -> torch.Tensor:
        """:meth:`forward` with q (and gate), k and v from one merged projection (:meth:`merge_qkv`), both
        products through ``ops.linear`` (phase 8: on a GPU the skinny GEMM for a decode step's rows), and the
        steps around the attention fused: the QK-norm and partial RoPE in ``ops.gated_qk_norm_rope``, the
        output gate in ``ops.sigmoid_gate_mul`` (two launches for ~25 small PyTorch ones). ``cos`` and ``sin``
        are float32 here (the fused ops round once)."""
        qkv = ops.linear(x, self.qkv_proj)
        # the Triton backend lets the norm + RoPE kernel write the new K/V into the cache (one launch fewer), as
        # the dense attention does (not while an FP8 cache calibrates this layer's scales)
        write = (meta.kv_cache is not None and getattr(self.backend, "cache_write_in_rope", False)
                 and not meta.kv_cache.needs_calibration(self.layer_idx))
        q, k, v, gate = ops.gated_qk_norm_rope(
            qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim, self.rotary_dim, self.q_norm.weight,
            self.k_norm.weight, self.q_norm.eps, self.q_norm.unit_offset,
            kv_cache=meta.kv_cache.layer(self.layer_idx) if write else None,
            slot_mapping=meta.slot_mapping if write else None,
            kv_scales=meta.kv_cache.scales(self.layer_idx) if write else None)
        o = self.backend.forward(self.layer_idx, q, k, v, meta, self.scale, None, kv_written=write)
        return ops.linear(ops.sigmoid_gate_mul(o, gate), self.o_proj)

    def merge_qkv(self) -> None:
        """One ``qkv_proj`` (rows: q and its gate, k, v); the parts become views of it. Idempotent."""
        if not hasattr(self, "qkv_proj"):
            self.qkv_proj = merge_linears(self.q_proj, self.k_proj, self.v_proj)

    def _attend(self, qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """The projections' outputs (``[T, Hq * 2D]``, ``[T, Hkv * D]`` twice; rows may be strided) to the
        gated attention output ``[T, Hq * D]``, before ``o_proj``."""
        t, d, r = qg.shape[0], self.head_dim, self.rotary_dim
        qg = qg.view(t, self.num_heads, 2 * d)
        q, gate = self.q_norm(qg[..., :d]), qg[..., d:].reshape(t, self.num_heads * d)
        k = self.k_norm(k.view(t, self.num_kv_heads, d))
        v = v.view(t, self.num_kv_heads, d)
        qk = torch.cat((q, k), dim=1)
        qk = torch.cat((apply_rope(qk[..., :r], cos, sin), qk[..., r:]), dim=-1)  # partial RoPE
        q, k = qk[:, : self.num_heads].contiguous(), qk[:, self.num_heads :].contiguous()
        o = self.backend.forward(self.layer_idx, q, k, v, meta, self.scale, None)
        return o.reshape(t, self.num_heads * d) * torch.sigmoid(gate)


class GatedDeltaNet(nn.Module):
    """The linear-attention layer (module docstring). Parameter names are Hugging Face's.

    Its state lives at index ``state_idx`` (among linear-attention layers) of the step's
    :class:`~infer.attention.state_cache.RecurrentStateCache`, one slot per sequence."""

    def __init__(self, cfg: ModelConfig, state_idx: int) -> None:
        super().__init__()
        self.state_idx = state_idx
        h = cfg.hidden_size
        self.nk, self.nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if self.nv % self.nk:
            raise ValueError(f"linear_num_value_heads ({self.nv}) must be a multiple of linear_num_key_heads ({self.nk})")
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(h, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.nv, bias=False)
        self.in_proj_a = nn.Linear(h, self.nv, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = RMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.decode_ops = gdr  # the decode step, prefill convolution and norm (Qwen3_5ForCausalLM.set_attention_backend)
        self.prefill_ops = gdr  # the prefills' chunked rule (Qwen3_5ForCausalLM.set_prefill_rule)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``x [T, hidden]`` (every sequence's new tokens) -> ``[T, hidden]``."""
        t = x.shape[0]
        core = self.mix(self.in_proj_qkv(x), self.in_proj_a(x), self.in_proj_b(x), meta)
        o = self.decode_ops.gated_rms_norm(core, self.in_proj_z(x).view(t, self.nv, self.dv), self.norm.weight,
                                           self.norm.eps)
        return self.out_proj(o.reshape(t, self.value_dim))

    def forward_fused(self, x: torch.Tensor, meta: AttentionMetadata, ops) -> torch.Tensor:
        """:meth:`forward` with the four in-projections as one (:meth:`merge_in_proj`) and both products
        through ``ops.linear`` (phase 8: on a GPU the skinny GEMM for a decode step's rows): a decode step
        of this layer is then four launches, the projection, the convolution, the delta rule (its gating
        inside) and the gated norm, before ``out_proj``."""
        t, c, vd, nv = x.shape[0], self.conv_dim, self.value_dim, self.nv
        p = ops.linear(x, self.in_proj)  # [T, C | Hv Dv | Hv | Hv]: qkv, z, b, a
        core = self.mix(p[:, :c], p[:, c + vd + nv:], p[:, c + vd:c + vd + nv], meta)
        o = self.decode_ops.gated_rms_norm(core, p[:, c:c + vd].view(t, nv, self.dv), self.norm.weight, self.norm.eps)
        return ops.linear(o.reshape(t, vd), self.out_proj)

    def merge_in_proj(self) -> None:
        """One ``in_proj`` whose output columns are ``in_proj_qkv``'s, ``in_proj_z``'s, ``in_proj_b``'s and
        ``in_proj_a``'s (all read the same ``x``); the parts become views of it. Idempotent."""
        if not hasattr(self, "in_proj"):
            self.in_proj = merge_linears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def mix(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The short convolution and the gated delta rule over every sequence of the step, each from its
        slot's state (zeros for a sequence whose first new position is 0), writing the state back.

        The decode rows (the first ``num_decodes`` sequences, one token each) go together through
        the recurrent step (``self.decode_ops.decode_step``: the Triton kernels with the Triton attention
        backend, else their plain-PyTorch twins); each prefill (or prefill chunk) through the chunked form.
        The decode rows' slots (``meta.state_slots``) and whether each holds a state yet (a bool device
        tensor in ``meta.scratch["decode_has_state"]``) are device tensors: an eager step builds the
        flags once from the host's positions, a CUDA graph's decode step provides them from its static
        buffers (:class:`~infer.engine.cuda_graphs.CUDAGraphRunner`), so the decode path reads nothing
        on the host and can be captured.

        ``a`` and ``b`` are the ``in_proj_a`` / ``in_proj_b`` outputs: the decode step computes each
        token's decay and beta from them itself (:func:`~infer.kernels.gated_delta_reference.gating`),
        the prefills from :func:`~infer.kernels.gated_delta_reference.gating`'s output.

        Prefix caching (:mod:`infer.engine.state_snapshots`): a sequence that starts from a snapshot
        (``meta.state_restores``) has it copied into its slot first; the state at each offset of
        ``meta.state_snapshots`` is copied into its snapshot slot (a decode's one token: the state after
        it), taken in one pass of the chunked rule when the offsets end its chunks (:meth:`_prefills`),
        else by splitting the prefill at them.

        Returns:
            float32 ``[T, Hv, Dv]``.
        """
        cache, idx = meta.state_cache, self.state_idx
        weight = self.conv1d.weight[:, 0]
        first = meta.first_positions()
        nd = meta.num_decodes if cache is not None else 0
        out = None if nd == mixed.shape[0] else torch.empty(mixed.shape[0], self.nv, self.dv, dtype=torch.float32,
                                                            device=mixed.device)
        snapshots = meta.state_snapshots if cache is not None else None
        for i, src in enumerate(meta.state_restores or ()):  # a prefix hit: the state at its end
            if src >= 0:
                self._copy_state(cache, src, meta.state_slots_cpu[i])
        if nd:
            has_state = meta.scratch.get("decode_has_state")
            if has_state is None:  # once per step: False for a one-token prompt (its slot holds leftovers)
                has_state = meta.scratch["decode_has_state"] = torch.tensor(
                    [p > 0 for p in first[:nd]], device=mixed.device)
            decoded = self.decode_ops.decode_step(mixed[:nd], a[:nd], b[:nd], self.A_log, self.dt_bias, cache.conv[idx],
                                                  cache.ssm[idx], meta.state_slots[:nd], has_state, weight, self.nk)
            if out is None:  # a decode step: its rows are the whole output (no copy)
                out = decoded
            else:
                out[:nd] = decoded
            for i in range(nd) if snapshots else ():  # a decode that ends a stride: a copy of its slot
                for _, snap in snapshots[i]:
                    if snap >= 0:
                        self._copy_state(cache, meta.state_slots_cpu[i], snap)
        if nd < meta.num_seqs:  # the prefills (and prefill chunks)
            self._prefills(mixed, a, b, meta, out, nd)
        return out

    def _prefills(self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: AttentionMetadata,
                  out: torch.Tensor, nd: int) -> None:
        """Sequences ``nd ..`` of the step (prefills or prefill chunks, their rows after the decodes'): the
        convolution and the chunked rule from each one's slot (zeros for a first chunk), the output into
        ``out``, the states back into the slots and into the snapshot slots the step asked for.

        All of them in one pass (``causal_conv1d_varlen`` of :attr:`decode_ops`: the reference's or the
        Triton kernel of :mod:`infer.kernels.gated_delta_triton`, then
        ``prefill_rule`` of :attr:`prefill_ops`: the norms, the gating and the chunked rule, in the reference's
        PyTorch, infer's three Triton kernels or flash-linear-attention's), the snapshots taken at
        chunk ends on the way, when every snapshot offset ends a chunk (the default stride's do for prefills
        that start on one); otherwise each sequence alone, split at its snapshot offsets."""
        cache, idx = meta.state_cache, self.state_idx
        weight = self.conv1d.weight[:, 0]
        first, starts = meta.first_positions(), meta.query_start_loc_cpu
        seqs = range(nd, meta.num_seqs)
        snaps = {i: [(end, snap) for end, snap in (meta.state_snapshots[i] if cache is not None and
                                                   meta.state_snapshots else ()) if snap >= 0] for i in seqs}
        lo, hi = starts[nd], starts[meta.num_seqs]
        if all(end % gdr.CHUNK_SIZE == 0 for i in seqs for end, _ in snaps[i]):
            lens = [starts[i + 1] - starts[i] for i in seqs]
            x = mixed[lo:hi]
            if cache is None:  # no state slots (a forward without an engine): fresh states, nothing kept
                y = self.decode_ops.causal_conv1d_varlen(x, weight, lens, [None] * len(lens))
                out[lo:hi], _ = self.prefill_ops.prefill_rule(y, a[lo:hi], b[lo:hi], self.A_log, self.dt_bias,
                                                              self.nk, self.dk, self.nv, self.dv, lens)
                return
            io = meta.scratch.get("prefill_states")
            if io is None:  # once per step, shared by the layers
                io = meta.scratch["prefill_states"] = PrefillStates.of(meta, nd, weight.shape[1] - 1, x.device)
            conv0 = io.gather(cache.conv[idx])  # [N, C, K - 1], zeros for a first chunk (None: all first chunks)
            y = self.decode_ops.causal_conv1d_varlen(x, weight, lens, [None] * len(lens) if conv0 is None else conv0)
            states = [{} for _ in seqs]
            for j, end in io.snaps:
                states[j][end] = None
            ssm0 = io.gather(cache.ssm[idx])  # float32 for the rule, whatever the slots store (ssm_state_dtype)
            out[lo:hi], ssm = self.prefill_ops.prefill_rule(
                y, a[lo:hi], b[lo:hi], self.A_log, self.dt_bias, self.nk, self.dk, self.nv, self.dv, lens,
                None if ssm0 is None else ssm0.float(), states_out=states)
            cache.conv[idx].index_copy_(0, io.slots, io.conv_states_after(x, conv0, io.ends).to(cache.conv.dtype))
            cache.ssm[idx].index_copy_(0, io.slots, ssm.to(cache.ssm.dtype))
            if io.snaps:  # prefix caching's snapshots inside the prefills: their slots, the same way
                cache.conv[idx].index_copy_(0, io.snap_slots,
                                            io.conv_states_after(x, conv0, io.snap_ends).to(cache.conv.dtype))
                cache.ssm[idx].index_copy_(0, io.snap_slots, torch.stack([states[j][end] for j, end in io.snaps])
                                           .to(cache.ssm.dtype))
            return
        g, beta = gdr.gating(a, b, self.A_log, self.dt_bias)
        slots = {i: meta.state_slots_cpu[i] if cache is not None else None for i in seqs}
        resume = {i: cache is not None and first[i] > 0 for i in seqs}  # a later chunk (a decode came above)
        for i in seqs:
            lo, hi = starts[i], starts[i + 1]
            conv = cache.conv[idx, slots[i]] if resume[i] else None
            ssm = cache.ssm[idx, slots[i]].float() if resume[i] else None
            done = 0
            for end, snap in [*snaps[i], (hi - lo, -1)]:  # segments between snapshots
                if end > done:
                    y, conv = gdr.causal_conv1d(mixed[lo + done : lo + end], weight, conv)
                    q, k, v = gdr.split_qkv(y, self.nk, self.dk, self.nv, self.dv)
                    out[lo + done : lo + end], ssm = gdr.chunk_gated_delta_rule(
                        q, k, v, g[lo + done : lo + end], beta[lo + done : lo + end], ssm)
                    done = end
                if snap >= 0:
                    cache.conv[idx, snap] = conv
                    cache.ssm[idx, snap] = ssm
            if cache is not None:
                cache.conv[idx, slots[i]] = conv
                cache.ssm[idx, slots[i]] = ssm

    def _copy_state(self, cache, src: int, dst: int) -> None:
        """This layer's conv and SSM state of slot ``src`` into slot ``dst``."""
        cache.conv[self.state_idx, dst] = cache.conv[self.state_idx, src]
        cache.ssm[self.state_idx, dst] = cache.ssm[self.state_idx, src]


class PrefillStates:
    """Where a step's prefills (sequences ``nd ..``) read and write their states, built once per step on
    the host and shared by its Gated DeltaNet layers: each layer then gathers every prefill's conv and SSM
    state in one read (:meth:`gather`) and writes them back, and the snapshots prefix caching asks for, in
    one ``index_copy_`` each, instead of a few small copies per sequence per layer (a step admitting 128
    prompts did ~15,000 of them over 24 layers).

    Args:
        slots: each prefill's state slot; resume: whether it continues a sequence (a later chunk) or starts one
            (its slot is read as zeros); starts, lens: its first row among the step's prefill rows, its tokens;
        snaps: ``(prefill j, token count, snapshot slot)`` per snapshot to take; width: the conv state's
            ``K - 1`` columns.

    Attributes:
        slots: int64 ``[N]`` on the device.
        ends: where the conv state after each prefill's last token comes from (index tensors for
            :meth:`conv_states_after`, built by ``_tails``).
        snaps, snap_slots, snap_ends: ``(j, end)`` per snapshot, their slots, and ``ends`` for them.
    """

    def __init__(self, slots: list[int], resume: list[bool], starts: list[int], lens: list[int],
                 snaps: list[tuple[int, int, int]], width: int, device: torch.device) -> None:
        self.width = width
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)
        self.any_resume, self.all_resume = any(resume), all(resume)
        self.resume = torch.tensor(resume, dtype=torch.bool, device=device)
        self.ends = self._tails([(j, starts[j], n) for j, n in enumerate(lens)], device)
        self.snaps = [(j, end) for j, end, _ in snaps]
        self.snap_slots = torch.tensor([slot for _, _, slot in snaps], dtype=torch.int64, device=device)
        self.snap_ends = self._tails([(j, starts[j], end) for j, end, _ in snaps], device) if snaps else None

    @classmethod
    def of(cls, meta: AttentionMetadata, nd: int, width: int, device: torch.device) -> PrefillStates:
        first, starts = meta.first_positions(), meta.query_start_loc_cpu
        seqs = range(nd, meta.num_seqs)
        snaps = [(j, end, snap) for j, i in enumerate(seqs)
                 for end, snap in (meta.state_snapshots[i] if meta.state_snapshots else ()) if snap >= 0]
        return cls([meta.state_slots_cpu[i] for i in seqs], [first[i] > 0 for i in seqs],
                   [starts[i] - starts[nd] for i in seqs], [starts[i + 1] - starts[i] for i in seqs], snaps, width,
                   device)

    def _tails(self, wanted: list[tuple[int, int, int]], device: torch.device):
        """For each ``(j, first row, n)``: the ``K - 1`` inputs before prefill ``j``'s token ``n``, oldest first,
        as ``(rows of x, from x?, rows of the stacked initial states, all from x?)``."""
        w = self.width
        tap = np.arange(w)
        at = np.array([[n - w + tap] for _, _, n in wanted]).reshape(len(wanted), w)  # position in the sequence
        first = np.array([r for _, r, _ in wanted])[:, None]
        seq = np.array([j for j, _, _ in wanted])[:, None]
        inside = at >= 0
        rows = np.where(inside, first + at, 0).astype(np.int64)
        state_rows = np.where(inside, 0, seq * w + w + at).astype(np.int64)  # column w + at of its initial state
        return (torch.from_numpy(rows).to(device), torch.from_numpy(inside).to(device),
                torch.from_numpy(state_rows).to(device), bool(inside.all()))

    def gather(self, pool: torch.Tensor) -> torch.Tensor | None:
        """Every prefill's state from ``pool`` (one layer's ``[slots, ...]``), zeros for a first chunk (its slot
        holds another sequence's leftovers); None when every prefill starts fresh."""
        if not self.any_resume:
            return None
        got = pool.index_select(0, self.slots)
        if self.all_resume:
            return got
        return torch.where(self.resume.view(-1, *[1] * (got.dim() - 1)), got, 0)

    def conv_states_after(self, x: torch.Tensor, conv0: torch.Tensor | None, tails) -> torch.Tensor:
        """The conv states after the token counts of ``tails`` (``ends`` or ``snap_ends``): ``[M, C, K - 1]``,
        the inputs from the step's prefill rows ``x [T, C]``, or, before a sequence's first new token, from its
        stacked initial state ``conv0 [N, C, K - 1]`` (None: zeros). As
        :func:`~infer.kernels.gated_delta_reference.conv_state_after`, for all of them at once."""
        rows, inside, state_rows, all_inside = tails
        m, w = rows.shape
        got = x[rows.view(-1)].view(m, w, -1)
        if not all_inside:
            before = (conv0.transpose(1, 2).reshape(-1, x.shape[1])[state_rows.view(-1)].view(m, w, -1)
                      if conv0 is not None else 0)
            got = torch.where(inside[..., None], got, before)
        return got.transpose(1, 2)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        kinds = cfg.layer_types[:layer_idx]
        self.is_linear = cfg.layer_types[layer_idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, kinds.count("linear_attention"))
        else:
            self.self_attn = GatedAttention(cfg, layer_idx - kinds.count("linear_attention"))
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)

    def forward(self, h: torch.Tensor, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        x = self.input_layernorm(h)
        h = h + (self.linear_attn(x, meta) if self.is_linear else self.self_attn(x, cos, sin, meta))
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor | None, cos, sin, meta: AttentionMetadata,
                      ops) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` with each norm fused with the residual add (``ops.add_rms_norm``: the stream
        travels beside ``h``, as in :meth:`CausalLM.forward_fused`), the fused MLP and the mixer's merged
        projections (its ``forward_fused``). Returns ``(h, residual)``, whose sum is the layer's output."""
        norm = self.input_layernorm
        x, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps, norm.unit_offset)
        h = (self.linear_attn.forward_fused(x, meta, ops) if self.is_linear
             else self.self_attn.forward_fused(x, cos, sin, meta, ops))
        # the MLP as the dense models run it (models/llama.py): the norm with gate/up, the activation in
        # that projection's epilogue and the residual add in down's (at batch 1 on a GPU: no kernel of their own)
        post, mlp = self.post_attention_layernorm, self.mlp
        act, residual = ops.add_rms_norm_linear(h, residual, post.weight, post.eps, post.unit_offset, mlp.gate_up_proj,
                                                mlp.act_name)
        return ops.linear_residual(act, mlp.down_proj, residual)


class Qwen3_5ForCausalLM(CausalLM):
    """The hybrid model. No tensor parallelism, and the fused forward (``fused_kernels``) covers the
    norms, the MLPs and the LM head only: the engine rejects the flags it does not support for it
    (:meth:`EngineConfig.validate_model`)."""

    layer_cls = Qwen3_5DecoderLayer
    #: prefill chunks that start on a multiple of this many tokens have their state snapshots (prefix caching)
    #: at the chunked rule's chunk ends, taken in the one pass over the step's prefills (``_prefills``); the
    #: engine has the scheduler cut chunks there (``Scheduler.prefill_chunk_alignment``)
    prefill_chunk_alignment = gdr.CHUNK_SIZE

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A Hugging Face tensor name as this model's (None: not loaded). The multimodal checkpoints
        (``Qwen3_5ForConditionalGeneration``, the released Qwen3.5 models) keep the text model under
        ``model.language_model.`` beside a vision tower and a multi-token-prediction head, which a
        text-only engine skips."""
        if name.startswith(("model.visual.", "mtp.", "model.mtp.")):
            return None
        return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name

    def set_fused_ops(self, ops, max_positions: int = 0) -> None:
        """``fused_kernels`` (phase 8) for the hybrid: every RMSNorm fused with its residual add, each MLP's
        gate and up in one GEMM after its norm (``ops.add_rms_norm_linear``: ``silu(gate) * up`` in its epilogue at
        one row) and down adding the residual (``ops.linear_residual``), each mixer's input projections
        merged into one (the gated attention's q / gate, k, v; the Gated DeltaNet's qkv, z, b, a), and
        every projection and the LM head through ``ops.linear`` (one-row products in the skinny GEMM on a
        GPU), and the gated attention's QK-norm, partial RoPE and output gate in two kernels of their own
        (:meth:`GatedAttention.forward_fused`). (No column-major CPU layout here: the plain-PyTorch products
        take the weights as they are.)"""
        self.ops = ops
        if ops is not None:
            for layer in self.model.layers:
                layer.mlp.merge_gate_up()
                if layer.is_linear:
                    layer.linear_attn.merge_in_proj()
                else:
                    layer.self_attn.merge_qkv()

    def set_prefill_rule(self, ops) -> None:
        """The module whose ``prefill_rule`` runs the Gated DeltaNet layers' prefills
        (:func:`infer.kernels.linear_attention_ops`: the plain-PyTorch reference, the default, infer's Triton
        kernels or flash-linear-attention's); the engine calls it once (``EngineConfig.linear_attention_backend``)."""
        for layer in self.model.layers:
            if layer.is_linear:
                layer.linear_attn.prefill_ops = ops

    def set_attention_backend(self, backend) -> None:
        """The attention layers' backend; the Gated DeltaNet layers' decode step follows it (the Triton
        kernels of :mod:`infer.kernels.gated_delta_triton` with the Triton backend)."""
        from infer.attention import TorchAttentionBackend

        self.attn_backend = backend
        if isinstance(backend, TorchAttentionBackend):
            ops = gdr
        else:
            from infer.kernels import gated_delta_triton as ops
        for layer in self.model.layers:
            if layer.is_linear:
                layer.linear_attn.decode_ops = ops
            else:
                layer.self_attn.backend = backend

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """As :meth:`CausalLM.forward`; the rotary tables ``[T, rotary_dim]`` serve the attention layers."""
        h = self.embed(input_ids)
        # the fused ops take float32 tables (rounding once); the PyTorch steps the model's dtype, as HF's
        dtype = torch.float32 if self.ops is not None else h.dtype
        cos, sin = rope_cos_sin(positions, self.inv_freq_full_attention, dtype)
        if self.ops is not None:  # fused_kernels (set_fused_ops)
            residual = None
            for layer in self.model.layers:
                h, residual = layer.forward_fused(h, residual, cos, sin, meta, self.ops)
            norm = self.model.norm
            return self.ops.add_rms_norm(h, residual, norm.weight, norm.eps, norm.unit_offset)[0]
        for layer in self.model.layers:
            h = layer(h, cos, sin, meta)
        return self.model.norm(h)


def qwen3_5_config(cfg: dict[str, Any], source: str) -> ModelConfig:
    """``config.json`` of ``Qwen3_5ForCausalLM`` (``model_type`` ``qwen3_5_text``) or of the multimodal
    ``Qwen3_5ForConditionalGeneration`` (``qwen3_5``: the text model's fields under ``text_config``)."""
    text = cfg.get("text_config") or cfg
    fields = common_fields(text, source)
    fields["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    fields["eos_token_ids"] = fields["eos_token_ids"] or eos_ids(cfg.get("eos_token_id"))
    params = text.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    n = fields["num_layers"]
    interval = int(text.get("full_attention_interval", 4))
    layer_types = text.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    return ModelConfig(
        architecture="qwen3_5",
        **fields,
        rope=parse_rope(text, source),
        hidden_act=text.get("hidden_act", "silu"),
        qk_norm=True,
        norm_unit_offset=True,
        layer_types=list(layer_types),
        partial_rotary_factor=float(factor),
        attn_output_gate=True,
        linear_num_key_heads=int(text.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(text.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(text.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(text.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
    )
