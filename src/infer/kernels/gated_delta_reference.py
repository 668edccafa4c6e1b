"""Plain-PyTorch Gated DeltaNet: the short causal convolution and the gated delta rule.

Gated DeltaNet (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", ICLR 2025, arXiv:2412.06464) is
linear attention whose state is a matrix ``S [Dk, Dv]`` per head, updated once per token::

    S_t = g_t * S_{t-1}                         (decay: g_t = exp(log-decay) in (0, 1])
    u_t = beta_t * (v_t - S_t^T k_t)            (the delta rule: write only what S does not predict)
    S_t = S_t + k_t u_t^T
    o_t = S_t^T q_t                             (q scaled by Dk ** -0.5)

The *recurrent* form (:func:`gated_delta_step`, :func:`recurrent_gated_delta_rule`) runs it token by
token: what decode does, one token per sequence. The *chunked* form
(:func:`chunk_gated_delta_rule`) gives the same numbers for a whole prompt with matrix products:
inside a chunk of ``C`` tokens the ``C`` updates are solved at once (the UT transform / WY
representation of DeltaNet, Yang et al., arXiv:2406.06484), and only the chunks are sequential. The
:mod:`~infer.models.qwen3_5` layer calls these; the Triton kernel of the decode step
(:mod:`infer.kernels.gated_delta_triton`) is tested against :func:`gated_delta_step`.

Every function computes in float32 and keeps the state in float32 (as Hugging Face's torch
fallback and flash-linear-attention do): a bfloat16 state would round the same matrix thousands of
times over a long context.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # tokens per chunk of chunk_gated_delta_rule (flash-linear-attention's default too)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2, last dim) + eps)`` (flash-linear-attention's and Hugging Face's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- the short convolution


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of one sequence's new tokens, then SiLU (Mamba's short conv).

    Output channel ``c`` at token ``t`` is ``silu(sum_j weight[c, j] * x[t - K + 1 + j, c])``; the
    ``K - 1`` inputs before the first new token come from ``conv_state`` (zeros for a fresh sequence).

    Args:
        x: ``[T, C]`` the new tokens' inputs.
        weight: ``[C, K]``.
        conv_state: ``[C, K - 1]`` the sequence's last ``K - 1`` inputs (oldest first), or None.

    Returns:
        ``(y [T, C] in x.dtype, new conv_state [C, K - 1])``: the state after these tokens.
    """
    c, k = weight.shape
    if conv_state is None:
        conv_state = x.new_zeros(c, k - 1)
    full = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + T]
    y = F.conv1d(full[None].float(), weight.float()[:, None, :], groups=c)[0]  # [C, T]
    return F.silu(y).t().to(x.dtype), full[:, -(k - 1):]


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, seq_lens: list[int],
                         conv_states: list[torch.Tensor | None] | torch.Tensor) -> torch.Tensor:
    """:func:`causal_conv1d` over several sequences' tokens back to back (``seq_lens``, as
    :func:`chunk_gated_delta_rule_varlen` takes them), each after its own ``conv_states[i]`` (``[C, K - 1]``,
    None: zeros; or all of them stacked, ``[B, C, K - 1]``), in one convolution: each sequence's ``K - 1``
    previous inputs, then its tokens, laid side by side. (:func:`conv_state_after` gives the states after any
    token count.)

    Returns:
        ``y [T, C]`` in ``x.dtype``.
    """
    c, k = weight.shape
    zeros = x.new_zeros(c, k - 1)
    pieces, offsets, start, at = [], [], 0, 0
    for n, state in zip(seq_lens, conv_states):
        pieces += [zeros if state is None else state.to(x.dtype), x[at:at + n].t()]
        offsets.append(start)
        start, at = start + k - 1 + n, at + n
    inputs = torch.cat(pieces, dim=1)
    y = F.conv1d(inputs[None].float(), weight.float()[:, None, :], groups=c)[0]  # output j: inputs j .. j + K - 1
    keep = np.concatenate([np.arange(o, o + n) for o, n in zip(offsets, seq_lens)])
    return F.silu(y[:, torch.from_numpy(keep).to(x.device)]).t().to(x.dtype)


def conv_state_after(x: torch.Tensor, conv_state: torch.Tensor | None, n: int, width: int) -> torch.Tensor:
    """A sequence's conv state after ``n`` of its new tokens ``x [T, C]`` (``0 <= n <= T``) from
    ``conv_state [C, width]`` (None: zeros; ``width = K - 1``): the ``K - 1`` inputs before token ``n``,
    oldest first, ``[C, K - 1]`` in ``x.dtype`` (the state a prefill leaves, and prefix caching's snapshots
    inside one)."""
    if n >= width:
        return x[n - width:n].t()
    before = x.new_zeros(x.shape[1], width) if conv_state is None else conv_state.to(x.dtype)
    return torch.cat([before[:, n:], x[:n].t()], dim=1)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of ``B`` sequences (decode): :func:`causal_conv1d` at ``T = 1``, batched.

    Args:
        x: ``[B, C]``; conv_state: ``[B, C, K - 1]``; weight: ``[C, K]``.

    Returns:
        ``(y [B, C], new conv_state [B, C, K - 1])``: the state shifted left by one, ``x`` appended.
    """
    # >>> EXERCISE conv1d_update
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    y = (window.float() * weight.float()).sum(-1)
    return F.silu(y).to(x.dtype), window[:, :, 1:]
    # <<< EXERCISE conv1d_update


# ----------------------------------------------------------------------------- the gated delta rule


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch of rows (sequences and heads).

    Args:
        state: float32 ``[..., Dk, Dv]``.
        q, k: ``[..., Dk]`` (already L2-normalized); v: ``[..., Dv]``.
        g: ``[...]`` the log of the decay (<= 0); beta: ``[...]`` the write strength in (0, 1).
        scale: multiplies q (default ``Dk ** -0.5``).

    Returns:
        ``(o [..., Dv] float32, new state [..., Dk, Dv] float32)``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = q.float() * scale, k.float(), v.float()
    # >>> EXERCISE gated_delta_step
    state = state * g.float().exp()[..., None, None]
    predicted = (state * k[..., :, None]).sum(-2)  # S^T k: [..., Dv]
    u = (v - predicted) * beta.float()[..., None]
    state = state + k[..., :, None] * u[..., None, :]
    o = (state * q[..., :, None]).sum(-2)
    # <<< EXERCISE gated_delta_step
    return o, state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, token by token (:func:`gated_delta_step` in a loop).

    Args:
        q, k: ``[T, H, Dk]`` (L2-normalized); v: ``[T, H, Dv]``; g, beta: ``[T, H]``.
        initial_state: float32 ``[H, Dk, Dv]``, or None (zeros).

    Returns:
        ``(o [T, H, Dv] float32, final state [H, Dk, Dv] float32)``.
    """
    t, h, dk = k.shape
    state = q.new_zeros(h, dk, v.shape[-1], dtype=torch.float32) if initial_state is None else initial_state.float()
    out = []
    for i in range(t):
        o, state = gated_delta_step(state, q[i], k[i], v[i], g[i], beta[i], scale)
        out.append(o)
    return torch.stack(out), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, scale: float | None = None,
                           chunk_size: int = CHUNK_SIZE, states_out: dict[int, torch.Tensor] | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, ``chunk_size`` tokens at a time (the prefill form).

    Inside a chunk, with ``G_t = exp(g_1 + ... + g_t)`` (decay since the chunk's start) and ``S0`` the
    state before it, unrolling the recurrence gives for the written values ``u``::

        (I + L) u = beta * v - beta * G * (K S0),   L[t, j] = beta_t (G_t / G_j) k_t . k_j  (j < t)

    a unit lower-triangular system (the UT transform): ``u = U0 - W S0`` with ``U0 = (I + L)^-1 (beta v)``
    and ``W = (I + L)^-1 (beta G k)``. Then the chunk's outputs and the next state are matrix products::

        O  = (G q) S0 + ((q K^T) * D) u,  D[t, j] = G_t / G_j (j <= t)
        S' = G_C S0 + (K * G_C / G)^T u

    So a prompt of ``T`` tokens costs ``T / C`` small sequential steps instead of ``T``, and each is a
    handful of ``C x C`` and ``C x D`` matmuls (Yang et al., arXiv:2406.06484 and arXiv:2412.06464).

    Args and returns as :func:`recurrent_gated_delta_rule`; ``states_out``, if given, maps token counts
    (multiples of ``chunk_size``, at most ``T``) to None and gets the state after that many tokens
    filled in (prefix caching's snapshots from one pass, instead of one call per segment).

    Raises:
        ValueError: a ``states_out`` count that is not a multiple of ``chunk_size`` or is past ``T``.
    """
    o, states = chunk_gated_delta_rule_varlen(q, k, v, g, beta, [k.shape[0]], [initial_state], scale, chunk_size,
                                              None if states_out is None else [states_out])
    return o, states[0]


def check_seq_lens(seq_lens: list[int], num_tokens: int) -> None:
    """Raise ``ValueError`` unless ``seq_lens`` (a step's prefills, back to back) are positive and add up to
    ``num_tokens``."""
    if sum(seq_lens) != num_tokens or min(seq_lens) < 1:
        raise ValueError(f"seq_lens {seq_lens} must be positive and add up to the {num_tokens} tokens")


def check_states_out(seq_lens: list[int], states_out: list[dict[int, torch.Tensor]] | None, chunk_size: int) -> None:
    """Raise ``ValueError`` unless every token count ``states_out`` asks a state at is a chunk end within its
    sequence (a multiple of ``chunk_size`` in ``[0, seq_lens[i]]``)."""
    for n_tokens, wanted in zip(seq_lens, states_out or ()):
        if any(n % chunk_size or not 0 <= n <= n_tokens for n in wanted):
            raise ValueError(f"states_out: token counts must be multiples of {chunk_size} in [0, {n_tokens}], got "
                             f"{sorted(wanted)}")


def initial_state_list(initial_states: list[torch.Tensor | None] | torch.Tensor | None, n: int
                       ) -> list[torch.Tensor | None]:
    """The chunked rules' ``initial_states`` as a list of ``n``: None (every sequence fresh), a list (None for a
    fresh one), or one stacked float32 ``[n, H, Dk, Dv]`` tensor (its rows; zeros for a fresh one: what a
    step's prefills gather from their state slots in one read)."""
    if initial_states is None:
        return [None] * n
    return list(initial_states.unbind(0)) if isinstance(initial_states, torch.Tensor) else list(initial_states)


def stacked_initial_states(initial_states: list[torch.Tensor | None] | torch.Tensor | None, n: int, h: int, dk: int,
                           dv: int, device: torch.device) -> torch.Tensor:
    """``initial_states`` (as :func:`initial_state_list` takes them) as one float32 ``[n, H, Dk, Dv]`` tensor:
    a stacked tensor as it is (no copy), else the states stacked, zeros for the fresh sequences."""
    if isinstance(initial_states, torch.Tensor):
        return initial_states.float().contiguous()
    zeros = torch.zeros(h, dk, dv, device=device)  # one for every fresh sequence (stack copies it)
    return torch.stack([zeros if s is None else s.float() for s in initial_state_list(initial_states, n)])


def chunk_gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, seq_lens: list[int],
                                  initial_states: list[torch.Tensor | None] | None = None, scale: float | None = None,
                                  chunk_size: int = CHUNK_SIZE, states_out: list[dict[int, torch.Tensor]] | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_gated_delta_rule` over several sequences at once (a step's prefills), their tokens back to
    back (``seq_lens[i]`` tokens of sequence ``i`` after the ones before; flash-linear-attention's
    ``cu_seqlens`` layout). Each sequence is cut into its own chunks (the last one zero-padded); the
    work inside the chunks runs for all of them together, and the chunk-to-chunk recurrence steps every
    sequence's ``j``-th chunk together: ``max(chunks)`` sequential steps for the batch, instead of the sum
    over sequences, and a fixed cost paid once instead of once per sequence.

    Args:
        q, k: ``[T, H, Dk]``; v: ``[T, H, Dv]``; g, beta: ``[T, H]`` with ``T = sum(seq_lens)``.
        seq_lens: each sequence's tokens (>= 1).
        initial_states: per sequence a float32 ``[H, Dk, Dv]`` state or None (zeros), or all of them stacked
            (``[B, H, Dk, Dv]``, :func:`initial_state_list`); default all zeros.
        states_out: per sequence, as :func:`chunk_gated_delta_rule`'s (token counts of that sequence).

    Returns:
        ``(o [T, H, Dv] float32, final states [B, H, Dk, Dv] float32)``.

    Raises:
        ValueError: lengths that do not add up to ``T``, or a ``states_out`` count off the chunks.
    """
    t, h, dk = k.shape
    dv = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    c, dev, nseq = chunk_size, q.device, len(seq_lens)
    check_seq_lens(seq_lens, t)
    check_states_out(seq_lens, states_out, c)
    # The chunks' layout: the sequences sorted by their number of chunks (most first), then every sequence's
    # chunk 0, every one's chunk 1 that has one, ...: the j-th step below reads and writes a contiguous range
    # of chunks and a prefix of the states (views, no gathers). One sequence: its chunks in order.
    n_chunks = [-(-n // c) for n in seq_lens]
    order = sorted(range(nseq), key=lambda i: -n_chunks[i])
    live = (np.array(n_chunks)[:, None] > np.arange(n_chunks[order[0]])).sum(0).tolist()  # sequences with a chunk j
    base = np.concatenate(([0], np.cumsum(live)))  # where each step's chunks start
    if nseq > 1:
        rank = np.empty(nseq, dtype=np.int64)
        rank[order] = np.arange(nseq)
        pos = np.concatenate([np.arange(n) for n in seq_lens])
        owner = np.repeat(rank, seq_lens)
        slots = torch.from_numpy((base[pos // c] + owner) * c + pos % c).to(dev)  # each token's padded place

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [H, chunks, C, ...] float32, zero-padded (a padded
        x = x.float().transpose(0, 1)               # token has g = 0, beta = 0: no effect on the state)
        if nseq == 1:
            return F.pad(x, (0, 0, 0, -t % c) if x.dim() == 3 else (0, -t % c)).reshape(h, -1, c, *x.shape[2:])
        padded = x.new_zeros(h, int(base[-1]) * c, *x.shape[2:])
        padded[:, slots] = x
        return padded.reshape(h, -1, c, *x.shape[2:])

    q, k, v, g, beta = chunks(q) * scale, chunks(k), chunks(v), chunks(g), chunks(beta)
    gc = g.cumsum(-1)  # [H, N, C]: log G_t
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # D, 0 above
    kb = k * beta[..., None]
    strict = (kb @ k.transpose(-1, -2)) * decay  # L plus its diagonal (ignored: unitriangular)
    u0 = torch.linalg.solve_triangular(strict, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(strict, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    # [H, B, Dk, Dv], the sorted order
    state = stacked_initial_states(initial_states, nseq, h, dk, dv, q.device)[order].transpose(0, 1)
    wanted = [(r, states_out[i]) for r, i in enumerate(order) if states_out[i]] if states_out else []
    for r, counts in wanted:
        if 0 in counts:
            counts[0] = state[:, r].clone()
    out = torch.empty_like(v)
    for j, n_live in enumerate(live):  # chunk j of every sequence that has one, together
        at, s0 = slice(base[j], base[j + 1]), state[:, :n_live]
        u = u0[:, at] - w[:, at] @ s0
        out[:, at] = q_decayed[:, at] @ s0 + attn[:, at] @ u
        state[:, :n_live] = s0 * chunk_decay[:, at] + k_to_end[:, at].transpose(-1, -2) @ u
        for r, counts in wanted:
            if r < n_live and (j + 1) * c in counts:
                counts[(j + 1) * c] = state[:, r].clone()
    out = out.reshape(h, -1, dv)
    o = out[:, :t] if nseq == 1 else out[:, slots]
    finals = torch.empty_like(state)
    finals[:, order] = state  # back to the callers' order
    return o.transpose(0, 1), finals.transpose(0, 1)


def chunk_rule_in_rounds(rule, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, seq_lens: list[int], initial_states: list[torch.Tensor | None] | None,
                         scale: float | None, chunk_size: int, states_out: list[dict[int, torch.Tensor]]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`chunk_gated_delta_rule_varlen`'s ``states_out`` for a varlen ``rule`` that returns final
    states only (flash-linear-attention's kernels): each sequence is cut at the token counts it wants a
    state at, and round ``r`` runs every sequence's ``r``-th piece side by side through ``rule``, each from
    the final state round ``r - 1`` left it. The counts are chunk ends, so the cut changes no chunk: a
    piece's outputs are the ones an uncut run computes, and a later run that starts from a stored state
    (a prefix-cache hit) repeats the pieces after it exactly. ``max(pieces)`` calls instead of one.

    Args:
        rule: ``rule(q, k, v, g, beta, seq_lens, initial_states, scale, chunk_size) -> (o, finals)``, the
            contract of :func:`chunk_gated_delta_rule_varlen` without ``states_out``.
        the others: as :func:`chunk_gated_delta_rule_varlen`'s (``states_out`` filled in place).

    Returns:
        ``(o [T, H, Dv] float32, final states [B, H, Dk, Dv] float32)``.

    Raises:
        ValueError: lengths that do not add up to ``T``, or a ``states_out`` count off the chunks.
    """
    t, h, dk = k.shape
    check_seq_lens(seq_lens, t)
    check_states_out(seq_lens, states_out, chunk_size)
    starts = np.concatenate(([0], np.cumsum(seq_lens)))
    cuts = [sorted({n for n in wanted if 0 < n < total} | {total}) for total, wanted in zip(seq_lens, states_out)]
    states = [None if s is None else s.float() for s in initial_state_list(initial_states, len(seq_lens))]
    for i, wanted in enumerate(states_out):
        if 0 in wanted:
            wanted[0] = q.new_zeros(h, dk, v.shape[-1], dtype=torch.float32) if states[i] is None else states[i].clone()
    out = torch.empty(t, h, v.shape[-1], dtype=torch.float32, device=v.device)
    for r in range(max(len(c) for c in cuts)):  # round r: every sequence's r-th piece
        seqs = [i for i, c in enumerate(cuts) if r < len(c)]
        spans = [(starts[i] + (cuts[i][r - 1] if r else 0), starts[i] + cuts[i][r]) for i in seqs]
        rows = torch.from_numpy(np.concatenate([np.arange(lo, hi) for lo, hi in spans])).to(v.device)
        o, finals = rule(q[rows], k[rows], v[rows], g[rows], beta[rows], [hi - lo for lo, hi in spans],
                         [states[i] for i in seqs], scale, chunk_size)
        out[rows] = o
        for j, i in enumerate(seqs):
            states[i] = finals[j]
            if cuts[i][r] in states_out[i]:
                states_out[i][cuts[i][r]] = finals[j].clone()
    return out, torch.stack(states)


def prefill_rule(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int, seq_lens: list[int],
                 initial_states: list[torch.Tensor | None] | None = None,
                 states_out: list[dict[int, torch.Tensor]] | None = None, rule=None,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's prefills through a Gated DeltaNet layer after the convolution: :func:`split_qkv`,
    :func:`gating`, then the chunked rule over the sequences side by side (``rule``: a
    ``chunk_gated_delta_rule_varlen``, this module's by default, fed q, k, v in ``dtype``).
    :func:`infer.kernels.gated_delta_triton.prefill_rule` does all of it in its three kernels.

    Args:
        y: ``[T, C]`` the convolution's output; a, b: ``[T, Hv]`` the ``in_proj_a`` / ``in_proj_b`` outputs;
        A_log, dt_bias: ``[Hv]``; seq_lens, initial_states, states_out: as :func:`chunk_gated_delta_rule_varlen`.

    Returns:
        ``(o [T, Hv, Dv] float32, final states [B, Hv, Dk, Dv] float32)``.
    """
    q, k, v = split_qkv(y, num_k_heads, head_k_dim, num_v_heads, head_v_dim, dtype)
    g, beta = gating(a, b, A_log, dt_bias)
    return (rule or chunk_gated_delta_rule_varlen)(q, k, v, g, beta, seq_lens, initial_states, states_out=states_out)


def split_qkv(y: torch.Tensor, num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution's output ``[T, C]`` (q, then k, then v channels) as ``q, k [T, Hv, Dk]``
    (L2-normalized in float32; each key head repeated for the ``Hv / Hk`` consecutive value heads it serves)
    and ``v [T, Hv, Dv]``, all three in ``dtype`` (float32 for this module's chunked rule; the model's dtype
    for flash-linear-attention's kernels, which read bf16 and accumulate in float32)."""
    t, key_dim = y.shape[0], num_k_heads * head_k_dim
    q, k, v = torch.split(y.float(), [key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    rep = num_v_heads // num_k_heads
    q = l2norm(q.reshape(t, num_k_heads, head_k_dim)).to(dtype).repeat_interleave(rep, dim=1)
    k = l2norm(k.reshape(t, num_k_heads, head_k_dim)).to(dtype).repeat_interleave(rep, dim=1)
    return q, k, v.reshape(t, num_v_heads, head_v_dim).to(dtype)


def gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's per-head decay and write strength from the ``in_proj_a`` / ``in_proj_b`` outputs
    (Hugging Face's Qwen3.5, Mamba-2's discretization): ``g = -exp(A_log) * softplus(a + dt_bias)``
    (float32: the log of the decay, ``<= 0``) and ``beta = sigmoid(b)`` (``b``'s dtype).

    Args:
        a, b: ``[T, Hv]``; A_log, dt_bias: ``[Hv]`` (the layer's parameters).

    Returns:
        ``(g, beta)``, each ``[T, Hv]``.
    """
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float()), b.sigmoid()


def decode_step(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                weight: torch.Tensor, num_k_heads: int, scale: float | None = None) -> torch.Tensor:
    """One decode token for each of ``B`` sequences through a Gated DeltaNet layer's mixer, from and back
    to the sequences' state slots: :func:`gating`, :func:`causal_conv1d_update`, :func:`split_qkv`, then
    :func:`gated_delta_step` (the plain-PyTorch twin of
    :func:`infer.kernels.gated_delta_triton.decode_step`, which fuses it into two kernels).

    Args:
        mixed: ``[B, C]`` the ``in_proj_qkv`` output (before the convolution); may be a column slice of a
            wider tensor (rows strided).
        a, b: ``[B, Hv]`` the ``in_proj_a`` / ``in_proj_b`` outputs; A_log, dt_bias: ``[Hv]``.
        conv_state: ``[S, C, K - 1]`` one layer's conv states (all slots); updated in place.
        ssm_state: float32 (or bfloat16: ``EngineConfig.ssm_state_dtype``) ``[S, Hv, Dk, Dv]`` one layer's
            delta-rule states; updated in place, in float32 and stored back in their dtype.
        slots: int64 ``[B]`` each sequence's slot; has_state: bool ``[B]``, False for a sequence that
            starts here (its slot is read as zeros).
        weight: ``[C, K]`` the convolution's weights.

    Returns:
        float32 ``[B, Hv, Dv]``.
    """
    num_v_heads, dk, dv = ssm_state.shape[1:]
    g, beta = gating(a, b, A_log, dt_bias)
    keep = has_state[:, None, None]
    conv = torch.where(keep, conv_state[slots], 0)
    ssm = torch.where(keep[..., None], ssm_state[slots].float(), 0)
    y, conv = causal_conv1d_update(mixed, conv, weight)
    q, k, v = split_qkv(y, num_k_heads, dk, num_v_heads, dv)
    o, ssm = gated_delta_step(ssm, q, k, v, g, beta, scale)
    conv_state.index_copy_(0, slots, conv.to(conv_state.dtype))
    ssm_state.index_copy_(0, slots, ssm.to(ssm_state.dtype))
    return o


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Gated DeltaNet output norm: ``rms_norm(x) * w * silu(gate)`` per head.

    ``x``, ``gate``: ``[..., Dv]``, ``x`` rounded to ``gate``'s dtype (the model's) first (the mixer's
    float32 output, as Hugging Face's layer casts it); the statistics in float32, cast back before ``w``
    (Hugging Face's ``Qwen3_5RMSNormGated``); returns ``[..., Dv]`` in ``gate``'s dtype.
    """
    dtype = gate.dtype
    h = x.to(dtype).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)
