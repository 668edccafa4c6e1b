"""Attention in plain PyTorch (``F.scaled_dot_product_attention``): the CPU backend.

The same code serves the contiguous and the paged cache: decodes are one batched SDPA over
rows (the cache's own rows, or each sequence's blocks gathered into one), prefills one SDPA
each. (:mod:`infer.kernels.attention_reference` holds the plain-PyTorch twins of the Triton
kernels, for their tests; :func:`paged_attention` dispatches a step to such a pair.)
For each sequence of the flattened batch it reads the sequence's context (from the KV cache,
or the step's own K/V when there is no cache) and attends with an explicit
*bottom-right-aligned* causal mask: query ``i`` of a sequence with ``Lq`` new tokens and
``Lk`` context tokens sits at position ``Lk - Lq + i`` and sees keys ``j <= Lk - Lq + i``
(and, in a sliding-window layer, only keys with ``(Lk - Lq + i) - j < window``). SDPA's own
``is_causal`` aligns top-left, which is wrong as soon as ``Lq != Lk``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.attention.metadata import AttentionMetadata


def causal_mask(q_len: int, kv_len: int, window: int | None, device) -> torch.Tensor | None:
    """bool ``[q_len, kv_len]``: True where a query may attend, or None when all may.

    Raises:
        ValueError: when ``q_len > kv_len`` (a query cannot lack its own key).
    """
    if q_len > kv_len:
        raise ValueError(f"q_len {q_len} > kv_len {kv_len}")
    if q_len == 1 and (window is None or kv_len <= window):
        return None
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return mask


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """Attention of one sequence.

    Args:
        q: ``[Lq, num_heads, head_dim]``; k, v: ``[Lk, num_kv_heads, head_dim]`` (GQA when
            ``num_heads > num_kv_heads``).
        scale: multiplier of ``q @ k^T`` (usually ``head_dim ** -0.5``).
        window: sliding window in tokens, or None.

    Returns:
        ``[Lq, num_heads, head_dim]`` in q's dtype.
    """
    q_len, kv_len = q.shape[0], k.shape[0]
    # A whole sequence with no effective window is plain causal attention, where SDPA's own
    # (top-left) is_causal is right and lets it pick its fused kernels without building a mask.
    plain_causal = q_len == kv_len and q_len > 1 and (window is None or kv_len <= window)
    mask = None if plain_causal else causal_mask(q_len, kv_len, window, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=plain_causal,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def decode_mask(seq_lens: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """bool ``[B, length]``: which of ``length`` cached keys each decode token may attend to."""
    key_pos = torch.arange(length, device=seq_lens.device)
    last = (seq_lens - 1)[:, None]
    mask = key_pos[None, :] <= last
    if window is not None:
        mask &= (last - key_pos[None, :]) < window
    return mask


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per sequence, attending over its row of a contiguous cache; all in one SDPA.

    Args:
        q: ``[B, num_heads, head_dim]``, the new token of each sequence.
        k_cache, v_cache: ``[R, L, num_kv_heads, head_dim]`` (a view of the cache's first R rows
            and L positions): sequence ``b`` reads row ``rows[b]``, keys ``0 .. seq_lens[b] - 1``.
            Positions past a sequence's length must hold finite values (the cache is zeroed).
        rows: int64 ``[B]``, distinct, each ``< R``.
        seq_lens: int64 ``[B]``, context lengths (``<= L``), the new token included.
        window: sliding window in tokens, or None.
        mask: :func:`decode_mask` of ``seq_lens`` if already built (all layers of a step share it).

    Returns:
        ``[B, num_heads, head_dim]``.

    GQA without repeating K/V: the ``G = num_heads / num_kv_heads`` query heads that share a KV
    head become ``G`` query rows of that head (``q -> [B, num_kv_heads, G, head_dim]``). Keys past
    a sequence's length are masked: they cost compute but add exactly zero weight. When the rows
    in use fill at least half of ``R`` (the scheduler hands out the lowest free row, so they are
    packed), every row of the view is attended in place and the unused rows' results dropped,
    which avoids copying K/V; otherwise the used rows are gathered first.
    """
    # >>> EXERCISE decode_attention
    b, h, d = q.shape
    r, length, hkv = k_cache.shape[0], k_cache.shape[1], k_cache.shape[2]
    in_place = 2 * b >= r
    if in_place:
        q = q.new_zeros(r, h, d).index_copy_(0, rows, q)
        k, v = k_cache, v_cache
    else:
        k, v = k_cache.index_select(0, rows), v_cache.index_select(0, rows)
    if mask is None:
        mask = decode_mask(seq_lens, length, window)
    if in_place:  # unused rows attend to their first key only (any finite result, dropped)
        full = torch.zeros(r, length, dtype=torch.bool, device=q.device)
        full[:, 0] = True
        mask = full.index_copy_(0, rows, mask)
    n = q.shape[0]
    out = F.scaled_dot_product_attention(
        q.view(n, hkv, h // hkv, d), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None, None, :],
        scale=scale,
    ).reshape(n, h, d)
    return out.index_select(0, rows) if in_place else out
    # <<< EXERCISE decode_attention


def cacheless_attention(q, k, v, meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
    """Attention of whole sequences with no cache (the parity gate, scoring, memory profiling).

    Every sequence attends causally to its own new tokens only; one :func:`sdpa_attention` each.

    Raises:
        ValueError: when a sequence's query length differs from its length (a cached prefix).
    """
    starts = meta.query_start_loc_cpu
    out = torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        s, e = starts[i], starts[i + 1]
        if e - s != seq_len:
            raise ValueError("a cache-less forward needs whole sequences (query len == seq len)")
        out[s:e] = sdpa_attention(q[s:e], k[s:e], v[s:e], scale, window)
    return out


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None,
                    decode_fn, prefill_fn) -> torch.Tensor:
    """Attention of one step over one layer's paged cache: decodes, then prefills.

    The model runner puts the ``meta.num_decodes`` decode sequences first, so their queries are
    ``q[:num_decodes]`` and go to ``decode_fn`` (:func:`~infer.kernels.attention_reference.
    paged_decode_attention` or its Triton twin) in one call; the remaining sequences (prefills,
    with or without a cached prefix) go to ``prefill_fn`` in one call.

    Args:
        q: ``[T, num_heads, head_dim]``; k_cache, v_cache: ``[num_blocks, block_size,
            num_kv_heads, head_dim]``, with this step's K/V already written.
        decode_fn, prefill_fn: the kernels, with any options of their own bound (split plans).

    Returns:
        ``[T, num_heads, head_dim]``.
    """
    nd, b = meta.num_decodes, meta.num_seqs
    if nd == b:  # a decode-only step: one query per sequence, in order
        return decode_fn(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, window)
    out = torch.empty_like(q)
    if nd:
        decode_fn(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale, window,
                  out=out[:nd])
    prefill_fn(q, k_cache, v_cache, meta.block_tables[nd:], meta.query_start_loc[nd:], meta.seq_lens[nd:],
               meta.max_query_len, scale, window, out=out)
    return out


def _paged_decode_slots(meta: AttentionMetadata, block_size: int, length: int,
                        which: list[int] | None = None, key: object = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step, shared by the layers: int64 ``[B * length]`` cache slots of the decode sequences'
    first ``length`` positions (through their block tables; past a sequence's end, whatever slot its
    table's padding names: finite, and masked) and their rows ``0 .. B - 1`` in the gathered K/V.

    ``which``: the sequences (indices into the batch) to gather, default every decode sequence;
    ``key`` tells the per-step caches of different groups apart."""
    name = ("paged_decode_slots", key)
    cached = meta.scratch.get(name)
    if cached is None:
        if which is None:
            q = meta.query_start_loc_cpu
            which = [i for i in range(meta.num_seqs) if q[i + 1] - q[i] == 1]  # the decode sequences
        tables = meta.block_tables.index_select(0, torch.tensor(which, device=meta.block_tables.device))
        n_blocks = -(-length // block_size)
        offsets = torch.arange(block_size, device=tables.device)
        slots = (tables[:, :n_blocks].long()[:, :, None] * block_size + offsets).flatten(1)[:, :length]
        cached = (slots.reshape(-1), torch.arange(len(which), device=tables.device))
        meta.scratch[name] = cached
    return cached


#: decode sequences whose context lengths differ by more than this factor are attended in
#: separate groups, so that one long context does not pad every short one to its length
DECODE_GROUP_SPREAD = 4


def decode_groups(meta: AttentionMetadata):
    """The step's decode sequences split into groups of similar context length (per step, shared
    by the layers): a list of ``(key, which, token_idx, rows, seq_lens, max_len, num_rows)``.

    The batched decode attention pads every sequence of a call to the longest context of the
    call, so a 16k-token sequence decoding beside 256-token ones would make each of them cost 16k
    keys. Sorted by length, a new group starts where a length exceeds ``DECODE_GROUP_SPREAD``
    times the group's shortest (and 256). When all lengths are close, there is one group: the
    whole batch in one call, as :meth:`AttentionMetadata.decode_batch` gives it.
    """
    groups = meta.scratch.get("decode_groups")
    if groups is None:
        decode = meta.decode_batch()
        q = meta.query_start_loc_cpu
        which = [i for i in range(meta.num_seqs) if q[i + 1] - q[i] == 1]
        lens = [meta.seq_lens_cpu[i] for i in which]
        order = sorted(range(len(which)), key=lambda j: lens[j])
        parts, first = [], None
        for j in order:
            if first is None or lens[j] > DECODE_GROUP_SPREAD * max(first, 256):
                parts.append([])
                first = lens[j]
            parts[-1].append(j)
        if len(parts) <= 1:
            groups = [(None, None, *decode)]
        else:
            groups = []
            dev = meta.query_start_loc.device
            for g, part in enumerate(parts):
                part.sort()  # batch order within the group
                sel = torch.tensor(part, dtype=torch.int64, device=dev)
                rows = [meta.block_tables_cpu[which[j]][0] for j in part]
                groups.append((g, [which[j] for j in part], decode[0].index_select(0, sel),
                               decode[1].index_select(0, sel), decode[2].index_select(0, sel),
                               max(lens[j] for j in part), max(rows) + 1))
        meta.scratch["decode_groups"] = groups
    return groups


class TorchAttentionBackend:
    """Plain-PyTorch attention over the KV cache (or no cache); the CPU default.

    * Contiguous cache (one block per sequence): the decode sequences of a step are batched
      into one :func:`decode_attention` call per layer over the rows; prefills run one
      :func:`sdpa_attention` each over their row.
    * Paged cache: the same, after gathering each decode sequence's blocks into a row (the slots
      are computed once per step from the block tables and shared by the layers); prefills read
      their context through :meth:`KVCache.read`.
    * An FP8 cache (phase 11): :meth:`KVCache.write` quantizes, and what is read (the rows, the
      gathered blocks, :meth:`KVCache.read`) is dequantized to the model's dtype before the SDPA. :mod:`infer.kernels.attention_reference` holds
      the plain-PyTorch twins of the Triton kernels, same signatures, for the kernel tests.
    """

    name = "torch"

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        kv_written: bool = False,
    ) -> torch.Tensor:
        """Write this step's K/V to the cache (unless ``kv_written``: the caller stored them), then attend.

        Args:
            q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]``.
        Returns:
            ``[T, num_heads, head_dim]``.
        """
        cache = meta.kv_cache
        if cache is None:
            return cacheless_attention(q, k, v, meta, scale, window)
        if not kv_written:
            cache.write(layer_idx, k, v, meta.slot_mapping)
        starts = meta.query_start_loc_cpu
        decode = meta.decode_batch()
        prefills = meta.prefill_indices()
        if decode is not None and len(decode[1]) == 1 and not prefills:
            # batch 1 (a single stream): read the context directly, no padding, no mask
            k_i, v_i = cache.read(layer_idx, meta.block_tables_cpu[0], meta.seq_lens_cpu[0])
            return sdpa_attention(q, k_i, v_i, scale, window)
        out = torch.empty_like(q)
        groups = decode_groups(meta) if decode is not None else []
        for key, which, token_idx, rows, lens, max_len, num_rows in groups:
            masks = meta.scratch.setdefault(("decode_masks", key), {})
            if window not in masks:  # built once per step, shared by the layers
                masks[window] = decode_mask(lens, max_len, window)
            if cache.contiguous:  # attend over the rows of the cache itself
                k_rows, v_rows = cache.k[layer_idx, :num_rows, :max_len], cache.v[layer_idx, :num_rows, :max_len]
            else:  # gather each sequence's blocks into a row first, then the same attention
                slots, rows = _paged_decode_slots(meta, cache.block_size, max_len, which, key)
                kl, vl = cache.layer(layer_idx)
                shape = (len(lens), max_len, *kl.shape[2:])
                k_rows = kl.flatten(0, 1).index_select(0, slots).view(shape)
                v_rows = vl.flatten(0, 1).index_select(0, slots).view(shape)
            k_rows, v_rows = cache.dequantize(layer_idx, k_rows, v_rows)  # an FP8 cache: codes x scale
            one_call = not prefills and len(groups) == 1
            o = decode_attention(q if one_call else q[token_idx], k_rows, v_rows, rows, lens, scale, window,
                                 masks[window])
            if one_call:  # a decode-only step: the tokens are the sequences, in order
                return o
            out[token_idx] = o
        for i in prefills:
            s, e = starts[i], starts[i + 1]
            k_i, v_i = cache.read(layer_idx, meta.block_tables_cpu[i], meta.seq_lens_cpu[i])
            out[s:e] = sdpa_attention(q[s:e], k_i, v_i, scale, window)
        return out
