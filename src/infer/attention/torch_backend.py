"""Reference attention in plain PyTorch (``F.scaled_dot_product_attention``).

It is the backend on the CPU and the reference every Triton kernel is tested against.
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


class TorchAttentionBackend:
    """Plain-PyTorch attention over a contiguous KV cache (or no cache)."""

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
    ) -> torch.Tensor:
        """Write this step's K/V to the cache, then attend.

        Args:
            q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]``.
        Returns:
            ``[T, num_heads, head_dim]``.
        """
        cache = meta.kv_cache
        if cache is not None:
            cache.write(layer_idx, k, v, meta.slot_mapping)
        starts = meta.query_start_loc_cpu
        single = len(meta.seq_lens_cpu) == 1
        out = None if single else torch.empty_like(q)
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            s, e = starts[i], starts[i + 1]
            if cache is None:
                if e - s != seq_len:
                    raise ValueError("a cache-less forward needs whole sequences (query len == seq len)")
                k_i, v_i = k[s:e], v[s:e]
            else:
                k_i, v_i = cache.read(layer_idx, meta.cache_rows_cpu[i], seq_len)
            o = sdpa_attention(q[s:e], k_i, v_i, scale, window)
            if single:
                return o
            out[s:e] = o
        return out
