"""Plain-PyTorch twins of the paged-cache kernels: the cache write, decode and prefill attention.

Same signatures, same semantics as :func:`infer.kernels.kv_cache_write.reshape_and_cache`,
:func:`infer.kernels.decode_attention.paged_decode_attention` and
:func:`infer.kernels.prefill_attention.paged_prefill_attention`: the tests compare each Triton kernel
against the function of the same name here, and the fused CPU forward writes its cache with
:func:`reshape_and_cache` (:mod:`infer.kernels.fused_reference`). The attention functions gather
each sequence's blocks through its block table with advanced indexing
(``k_cache[block_table]``), mask, and run one ``F.scaled_dot_product_attention``: the idea of
PagedAttention (Kwon et al., SOSP 2023, arXiv:2309.06180) without its kernel, paying one copy of the
context per call. (:mod:`infer.kernels.fused_reference` and :mod:`infer.kernels.moe_reference` are
the plain-PyTorch twins of the other kernels.)

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``; position ``p`` of a sequence is
in block ``block_table[p // block_size]`` at offset ``p % block_size``.

FP8 KV cache (phase 11, ``EngineConfig.kv_cache_dtype='fp8'``): a cache of dtype
``torch.float8_e4m3fn`` holds ``x / scale`` rounded to e4m3 (:func:`quantize_kv`), with one float32
scale per layer for K and one for V (``k_scale``, ``v_scale``: ``[1]`` tensors); readers multiply
back (:func:`dequantize_kv`). vLLM's ``fp8`` / ``fp8_e4m3`` KV cache, same format and scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FP8_E4M3_MAX", "FP8_KV_DTYPE", "dequantize_kv", "is_fp8", "paged_decode_attention",
           "paged_prefill_attention", "quantize_kv", "reshape_and_cache"]

#: the storage dtype of an FP8 KV cache: e4m3 "fn" (finite: no infinities, one NaN code), OCP's and NVIDIA's
FP8_KV_DTYPE = torch.float8_e4m3fn
#: the largest finite e4m3fn value; a quantized value is clamped to +-this (saturating, as vLLM does)
FP8_E4M3_MAX = 448.0


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an FP8 KV cache (stores e4m3 codes that need their scale)."""
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` clamped to +-448 and rounded to the nearest e4m3 value (ties to even): the codes an
    FP8 KV cache stores.

    Args:
        x: any shape, float32/float16/bfloat16 (divided in float32).
        scale: float32 ``[1]`` (or a Python float), > 0.

    Returns:
        ``torch.float8_e4m3fn``, x's shape. ``dequantize_kv(quantize_kv(x, s), s)`` is within
        ``max(|x| * 2**-4, s * 2**-10)`` of ``x`` when ``|x| <= 448 s`` (3 mantissa bits; the subnormal step
        below ``2**-6 s`` is ``2**-9 s``).
    """
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The values an FP8 cache's codes ``x`` stand for, ``x * scale`` in ``dtype`` (float32 product); ``x``
    itself when the cache is not FP8 (``x.dtype`` is already a compute dtype)."""
    if x.dtype != FP8_KV_DTYPE:
        return x
    return (x.float() * (scale if scale is not None else 1.0)).to(dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each new token's K/V into its cache slot (vLLM's ``reshape_and_cache``).

    Args:
        key, value: ``[T, num_kv_heads, head_dim]`` in the cache's dtype (views are fine); with an FP8
            cache, in any float dtype (quantized on the way in: :func:`quantize_kv`).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: int64 ``[T]``: flat slot ``block * block_size + offset`` of each token;
            negative slots are skipped (padding).
        k_scale, v_scale: FP8 cache: float32 ``[1]`` scales of this layer's K and V (None: 1.0).

    Raises:
        ValueError: mismatched shapes or dtypes, ``slot_mapping`` not int64 ``[T]``.
    """
    if key.dim() != 3 or value.shape != key.shape or tuple(key.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"key/value must be [T, {k_cache.shape[2]}, {k_cache.shape[3]}], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    fp8 = is_fp8(k_cache)
    if not fp8 and (key.dtype != k_cache.dtype or value.dtype != v_cache.dtype):
        raise ValueError(f"key/value dtype {key.dtype}/{value.dtype} differs from the cache's {k_cache.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be int64 [T={key.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    if fp8:
        key, value = quantize_kv(key, 1.0 if k_scale is None else k_scale), \
            quantize_kv(value, 1.0 if v_scale is None else v_scale)
    k_cache[block, offset] = key
    v_cache[block, offset] = value


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, length: int,
            scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``[B, length, Hkv, D]`` in ``dtype``: the first ``length`` positions of each sequence's context
    (dequantized with ``scale`` from an FP8 cache).

    Positions at or past a sequence's length read block 0 (table entries past a sequence's need are
    arbitrary) and are zeroed, so that a masked key adds exactly nothing (0 * NaN would be NaN).
    """
    block_size = cache.shape[1]
    n_blocks = -(-length // block_size)
    table = block_tables[:, :n_blocks].long()
    needed = (seq_lens.long()[:, None] + block_size - 1) // block_size
    table = torch.where(torch.arange(n_blocks, device=table.device)[None, :] < needed, table, 0)
    ctx = dequantize_kv(cache[table].flatten(1, 2)[:, :length], scale, dtype)  # [B, length, Hkv, D]
    valid = torch.arange(length, device=ctx.device)[None, :] < seq_lens.long()[:, None]
    return ctx.masked_fill(~valid[:, :, None, None], 0)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a paged cache: one new token per sequence, all sequences in one SDPA.

    Query ``b`` sits at position ``seq_lens[b] - 1`` and attends keys ``j < seq_lens[b]`` (only
    ``seq_lens[b] - 1 - j < window`` with a sliding window). Each sequence's blocks are gathered into
    ``[B, max_len, Hkv, D]``; GQA views q as ``[B, Hkv, G, D]`` (no repeated K/V).

    Args:
        q: ``[B, Hq, D]``; k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``.
        block_tables: int32 ``[B, W]``; seq_lens: int32 ``[B]`` (>= 1, the new token included).
        scale: multiplier of ``q . k``; window: sliding window in tokens, or None.
        out: optional ``[B, Hq, D]`` to write into. num_splits: ignored (the Triton kernel's knob).
        k_scale, v_scale: an FP8 cache's float32 ``[1]`` scales (None: 1.0); the gathered K/V are
            dequantized to q's dtype.

    Returns:
        ``out`` (allocated if None), ``[B, Hq, D]`` in q's dtype.

    Raises:
        ValueError: ``Hq`` not a multiple of ``Hkv``, mismatched batch sizes.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv != 0:
        raise ValueError(f"q has {hq} heads, not a multiple of the cache's {hkv} KV heads")
    if block_tables.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"do not match the batch of {b}")
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    length = int(seq_lens.max())
    k = _gather(k_cache, block_tables, seq_lens, length, k_scale, q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
    v = _gather(v_cache, block_tables, seq_lens, length, v_scale, q.dtype).transpose(1, 2)
    pos = torch.arange(length, device=q.device)[None, :]
    last = (seq_lens.long() - 1)[:, None]
    mask = pos <= last
    if window is not None:
        mask &= (last - pos) < window
    o = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), k, v, attn_mask=mask[:, None, None, :],
                                       scale=scale)
    out.copy_(o.reshape(b, hq, d))
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-length causal attention over a paged cache, one SDPA per sequence.

    Sequence ``b``'s queries are rows ``query_start_loc[b] .. query_start_loc[b+1] - 1`` of q, its
    last ``query_len_b`` positions: query ``i`` is at ``seq_lens[b] - query_len_b + i`` and attends keys
    ``j <=`` its position (bottom-right aligned), only ``position - j < window`` with a window. Its
    context (cached prefix and new tokens, all already in the cache) is gathered through its block table.

    Args:
        q: ``[T, Hq, D]``; k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``.
        block_tables: int32 ``[B, W]``; query_start_loc: int32 ``[B + 1]`` absolute row offsets;
        seq_lens: int32 ``[B]``. max_query_len: unused here (the kernel's grid size).
        scale: multiplier of ``q . k``; window: sliding window in tokens, or None.
        out: optional ``[T, Hq, D]``; only the sequences' rows are written.
        k_scale, v_scale: an FP8 cache's float32 ``[1]`` scales (None: 1.0).

    Returns:
        ``out`` (``torch.empty_like(q)`` if None).

    Raises:
        ValueError: ``Hq`` not a multiple of ``Hkv``, a query longer than its context.
    """
    hq = q.shape[1]
    hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    if hq % hkv != 0:
        raise ValueError(f"q has {hq} heads, not a multiple of the cache's {hkv} KV heads")
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        q_len = e - s
        if q_len < 1 or q_len > seq_len:
            raise ValueError(f"sequence {b}: query length {q_len} must be in [1, seq_len={seq_len}]")
        n_blocks = -(-seq_len // block_size)
        blocks = block_tables[b, :n_blocks].long()
        k = dequantize_kv(k_cache[blocks].flatten(0, 1)[:seq_len], k_scale, q.dtype).transpose(0, 1)  # [Hkv, L, D]
        v = dequantize_kv(v_cache[blocks].flatten(0, 1)[:seq_len], v_scale, q.dtype).transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= (q_pos - k_pos) < window
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=hq != hkv)
        out[s:e] = o.transpose(0, 1)
    return out
