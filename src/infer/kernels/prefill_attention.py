"""Paged prefill ("extend") attention (phase 5): every sequence's new tokens of a step in one launch.

A step's prompts, prompt chunks (phase 6) and extends after a cached prefix (phase 7) are all the
same operation: sequence ``b`` has ``q_len`` new tokens, its last ones, and each attends causally
(bottom-right aligned) to the cached prefix and to the new tokens up to itself, optionally within a
sliding window. All K/V are read from the paged cache (``[num_blocks, block_size, num_kv_heads,
head_dim]``, block ``block_table[p // block_size]``, offset ``p % block_size``: PagedAttention, Kwon
et al., SOSP 2023, arXiv:2309.06180), which :mod:`infer.kernels.kv_cache_write` filled first.

* :func:`paged_prefill_attention`: variable-length attention, every sequence of the step in one
  launch, with the online softmax of FlashAttention-2 (Dao, 2023, arXiv:2307.08691): a program
  computes one tile of queries of one head, skips the key tiles the mask hides entirely and masks
  only those on the diagonal or the window's edge (``_prefill_tiles``).
* Split-KV for extends (:func:`prefill_num_splits`): a few new tokens after a long prefix are too
  few programs to fill the GPU, so their keys are split too, as flash-decoding splits a decode's, and
  ``_prefill_combine_kernel`` merges the partial results with the merge of
  :mod:`infer.kernels.decode_attention`.

No recompilation when the batch changes: the batch is a grid dimension, and the block-table width,
the number of splits and the window are runtime integers. What is compiled per variant
(``tl.constexpr``) is what a model fixes: head_dim, the GQA group, the block size, the dtype.

Sibling modules: :mod:`infer.kernels.decode_attention` (one new token per sequence),
:mod:`infer.kernels.attention_reference` (the plain-PyTorch ``paged_prefill_attention``, same
signature, which the tests compare against and the CPU backend runs), :mod:`infer.kernels.triton_common`
(the input checks the launchers share). :mod:`infer.attention.triton_backend` calls these kernels for
a model.

Importing this module works on any machine; launching needs a CUDA tensor, or CPU tensors with
``TRITON_INTERPRET=1`` set before Triton is imported (the tests' conftest does it). Under the
interpreter every bf16 load is converted to float32 first (``UPCAST``) and tiles are small.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.decode_attention import _merge_splits
from infer.kernels.triton_common import (
    INTERPRET,
    LOG2E,
    NO_WINDOW,
    check_index,
    check_kv_scales,
    check_launchable,
    check_out,
    check_paged_cache,
    check_query,
    check_window,
    shared_memory_per_block,
    sm_count,
    unused_buffer,
)

__all__ = ["paged_prefill_attention", "prefill_num_splits"]


@triton.jit
def _prefill_tiles(
    acc, l_i, m_i, q, q_pos, k_head, v_head, bt_row, offs_n, offs_d, d_mask,
    lo, hi, kv_end, window, qk_scale, stride_cb, stride_ct,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, UPCAST: tl.constexpr,
    FP8: tl.constexpr,
):
    """Key tiles ``[lo, hi)`` (multiples of BLOCK_N) of one query tile; masks only when MASK is set."""
    for start_n in range(lo, hi, BLOCK_N):
        tok = start_n + offs_n  # key positions of this tile
        # Physical row of each key: block_table[tok // BLOCK_SIZE], offset tok % BLOCK_SIZE. Keys at
        # or past kv_end (the last query's position + 1) may be in blocks the sequence does not own.
        if MASK:
            in_range = tok < kv_end
            page = tl.load(bt_row + tok // BLOCK_SIZE, mask=in_range, other=0)
            kv_mask = in_range[:, None] & d_mask[None, :]
        else:
            page = tl.load(bt_row + tok // BLOCK_SIZE)
            kv_mask = d_mask[None, :]
        row = page.to(tl.int64) * stride_cb + (tok % BLOCK_SIZE) * stride_ct
        k = tl.load(k_head + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if FP8:  # an FP8 cache: e4m3 -> q's dtype (exact); the scales are applied by the caller
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASK:
            # causal (key at or before the query) and sliding window (fewer than `window` back)
            keep = (tok[None, :] <= q_pos[:, None]) & (q_pos[:, None] - tok[None, :] < window)
            s = tl.where(keep & in_range[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen no valid key yet keeps m = -inf; exponentiate against 0 instead, so
            # that 2^(-inf - -inf) = NaN never happens (its p and alpha are then exactly 0).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(
    do_not_specialize=["window", "stride_bt"],
    do_not_specialize_on_alignment=["q_ptr", "out_ptr", "block_tables_ptr", "query_start_loc_ptr",
                                    "seq_lens_ptr"],
)
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    part_out_ptr, part_lse_ptr, num_splits, k_scale_ptr, v_scale_ptr,
    qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
    FP8: tl.constexpr,
):
    # Grid (cdiv(max_query_len, BLOCK_M) * num_splits, B, Hq): program (i, b, h) computes BLOCK_M
    # queries of sequence b, query head h, over key split i % num_splits. The last query tiles (the
    # most keys) are started first. With SPLIT, each split writes its normalised partial output and
    # log2-sum-exp2 (the decode kernel's partial layout, rows = query tokens) instead of the result.
    split = tl.program_id(0) % num_splits
    m_block = tl.num_programs(0) // num_splits - 1 - tl.program_id(0) // num_splits
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if m_block * BLOCK_M >= q_len:  # this sequence has fewer query tiles
        return
    seq_len = tl.load(seq_lens_ptr + b)
    kvh = h // GROUP

    # The new tokens are the sequence's last q_len positions (bottom-right aligned causal mask).
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    row_mask = offs_m < q_len
    q_pos = seq_len - q_len + offs_m
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if FP8:  # an FP8 cache holds k / k_scale and v / v_scale: k_scale joins the score's multiplier
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    # Which key tiles matter: from the first query's window start to the last query's position.
    first_pos = seq_len - q_len + m_block * BLOCK_M
    last_pos = tl.minimum(first_pos + BLOCK_M - 1, seq_len - 1)
    kv_end = last_pos + 1
    lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.cdiv(kv_end, BLOCK_N) * BLOCK_N
    # Tiles in [full_lo, full_hi) are visible to every query of the tile (inside every window, before
    # every query), so they skip the mask; those around them (window edge, diagonal) are masked.
    full_lo = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
    full_hi = (first_pos + 1) // BLOCK_N * BLOCK_N
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), hi)
    # This split's share of the key tiles [lo, hi) (all of them when num_splits is 1), with the three
    # ranges (masked, unmasked, masked) clamped into it.
    chunk = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
    s_lo = tl.minimum(lo + split * chunk, hi)
    s_hi = tl.minimum(s_lo + chunk, hi)
    mid_lo = tl.minimum(tl.maximum(mid_lo, s_lo), s_hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), s_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh * stride_ch
    v_head = v_cache_ptr + kvh * stride_ch
    acc, l_i, m_i = _prefill_tiles(acc, l_i, m_i, q, q_pos, k_head, v_head, bt_row, offs_n, offs_d, d_mask,
                                   s_lo, mid_lo, kv_end, window, qk_scale, stride_cb, stride_ct,
                                   BLOCK_SIZE, BLOCK_N, True, UPCAST, FP8)
    acc, l_i, m_i = _prefill_tiles(acc, l_i, m_i, q, q_pos, k_head, v_head, bt_row, offs_n, offs_d, d_mask,
                                   mid_lo, mid_hi, kv_end, window, qk_scale, stride_cb, stride_ct,
                                   BLOCK_SIZE, BLOCK_N, False, UPCAST, FP8)
    acc, l_i, m_i = _prefill_tiles(acc, l_i, m_i, q, q_pos, k_head, v_head, bt_row, offs_n, offs_d, d_mask,
                                   mid_hi, s_hi, kv_end, window, qk_scale, stride_cb, stride_ct,
                                   BLOCK_SIZE, BLOCK_N, True, UPCAST, FP8)

    if FP8:  # and v_scale multiplies the output once
        acc = acc * tl.load(v_scale_ptr)
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # padding rows, and rows with no key in this split, have l = 0
    o = acc / l_safe[:, None]
    if SPLIT:
        hq = tl.num_programs(2)
        part = (q_rows * hq + h) * num_splits + split  # [BLOCK_M]
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=row_mask[:, None] & d_mask[None, :])
    else:
        tl.store(out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_splits", "num_seqs"], do_not_specialize_on_alignment=["out_ptr"])
def _prefill_combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, num_seqs, num_splits, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    # Grid (T, Hq): merge the splits of query row t, head h (as the decode kernel's last split does), only for the
    # rows of the prefill's sequences [query_start_loc[0], query_start_loc[B]) (read on the device, so
    # a CUDA graph can replay it); other rows belong to other work and are left alone.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    first_row = tl.load(query_start_loc_ptr)
    end_row = tl.load(query_start_loc_ptr + num_seqs)
    if t < first_row or t >= end_row:
        return
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    one = tl.arange(0, 1)  # one row: this (token, head)
    out = _merge_splits(part_out_ptr, part_lse_ptr, (t * NUM_Q_HEADS + h) * num_splits + one, one == 0, num_splits,
                        offs_d, d_mask, HEAD_DIM, D_PAD)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=d_mask[None, :])


# A prompt at least this long (tokens, one launch) takes the long-prompt tiles where they fit.
LONG_PROMPT_TOKENS = 4096
_LONG_PROMPT_SMEM = 200 * 1024  # bytes of shared memory per block the long-prompt tiles need (3 stages)


def _prefill_config(head_dim_pad: int, dtype: torch.dtype, max_query_len: int = 0,
                    device: torch.device | None = None) -> dict:
    """Query/key tiles and launch options of the prefill kernel (tiny under the interpreter).

    Chosen on an H100 (``benchmarks/paged_attention.py --tune prefill``, head_dim 128, bf16): for 8 x 2048
    tokens 64 x 64 tiles with 4 warps and 128 x 128 with 8 warps both reach ~37% of the matmul rate (128 x 64
    with 8 warps 32%, with 4 warps 20%), and the smaller query tile wastes less on short extends (a 512-token
    extend: 33.5% against 32%); for one 16,384-token prompt 128 x 128 with 8 warps and 3 stages reaches 54%
    against 47%, so prompts of at least ``LONG_PROMPT_TOKENS`` take it on GPUs with the shared memory
    for it (~200 KB a block: Hopper, not an A100 or a consumer card). head_dim 256 (and fp32 rows of 512
    bytes) take 32-key tiles to stay within shared memory.
    """
    if INTERPRET:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    wide = head_dim_pad * (4 if dtype == torch.float32 else 2)  # bytes of one row
    if wide <= 256:  # head_dim <= 128 in 16 bits, <= 64 in fp32
        if wide == 256 and max_query_len >= LONG_PROMPT_TOKENS and shared_memory_per_block(device) >= _LONG_PROMPT_SMEM:
            return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


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
    num_splits: int | None = None,
    max_context: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-length causal "extend" attention over a paged KV cache, every sequence in one launch.

    Sequence ``b`` has ``query_len_b = query_start_loc[b+1] - query_start_loc[b]`` new tokens, its last
    ones: query ``i`` sits at position ``seq_lens[b] - query_len_b + i`` and attends keys ``j <=`` its
    position (bottom-right aligned causal mask), only ``position - j < window`` with a sliding window.
    All K/V, the cached prefix and the new tokens, are read from the cache through the block table
    (PagedAttention, Kwon et al., SOSP 2023). Each program computes one tile of queries of one head
    with the online softmax of FlashAttention-2 (Dao, 2023), skipping key tiles the mask hides entirely
    and masking only the tiles on the diagonal or the window's edge.

    Args:
        q: ``[T, Hq, D]`` (last dimension contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, q's dtype, or float8_e4m3fn (an FP8
            cache, phase 11: tiles converted to q's dtype as loaded, ``k_scale`` joins the score's
            multiplier, ``v_scale`` multiplies the output).
        block_tables: int32 ``[B, W]``, ``W >= ceil(seq_lens[b] / block_size)``.
        query_start_loc: int32 ``[B + 1]``: absolute, non-decreasing row offsets into q and out
            (``query_start_loc[0]`` may be > 0).
        seq_lens: int32 ``[B]``, each >= its query length >= 1.
        max_query_len: host int, the largest query length (sets the grid).
        scale: multiplier of ``q . k``.
        window: sliding window in tokens (>= 1), or None.
        out: optional ``[T, Hq, D]`` in q's dtype; only rows ``query_start_loc[0] ..
            query_start_loc[B] - 1`` are written.
        num_splits: split each query tile's keys over this many programs (flash-decoding's split-KV
            for extends: a few new tokens after a long cached prefix are only
            ``cdiv(max_query_len, 64) x B x Hq`` programs, too few to fill the GPU, each walking the
            whole prefix), then merge the partial results in a second kernel. None: chosen from
            ``max_context`` (:func:`prefill_num_splits`); 1 without it.
        max_context: host upper bound of the sequences' context lengths, for the automatic choice.
        k_scale, v_scale: an FP8 cache's float32 ``[1]`` scales of this layer (None: 1.0); ignored otherwise.

    Returns:
        ``out`` (``torch.empty_like(q)`` if None).

    Raises:
        ValueError: wrong ranks or shapes, ``Hq`` not a multiple of ``Hkv``, mismatched dtypes or
            devices, index tensors not int32, a non-contiguous last dimension, ``window < 1``,
            ``max_query_len < 1`` with sequences to compute.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    check_paged_cache(k_cache, v_cache)
    _, hq, hkv, d = check_query(q, k_cache, "q")
    if query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1:
        raise ValueError(f"query_start_loc must be [B + 1], got shape {tuple(query_start_loc.shape)}")
    batch = query_start_loc.shape[0] - 1
    check_index(query_start_loc, "query_start_loc", k_cache)
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [B={batch}], got shape {tuple(seq_lens.shape)}")
    check_index(seq_lens, "seq_lens", k_cache)
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, W], got shape {tuple(block_tables.shape)}")
    check_index(block_tables, "block_tables", k_cache)
    check_window(window)
    out = check_out(out, q, tuple(q.shape))
    k_scale, v_scale = check_kv_scales(k_cache, k_scale, v_scale)
    if batch == 0:
        return out
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    check_launchable(q)
    d_pad = max(16, triton.next_power_of_2(d))
    cfg = _prefill_config(d_pad, q.dtype, max_query_len, q.device)
    m_tiles = triton.cdiv(max_query_len, cfg["BLOCK_M"])
    if num_splits is None:
        num_splits = prefill_num_splits(m_tiles * batch * hq, max_context or 0, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split = num_splits > 1
    if split:  # float32 partials, [T, Hq, splits, D] and [T, Hq, splits]
        part_out = torch.empty(q.shape[0], hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(q.shape[0], hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = unused_buffer(q.device)
    _paged_prefill_kernel[(m_tiles * num_splits, batch, hq)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, part_out, part_lse, num_splits,
        k_scale, v_scale, scale * LOG2E, window if window is not None else NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=hq // hkv, HEAD_DIM=d, D_PAD=d_pad, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], UPCAST=INTERPRET and q.dtype == torch.bfloat16,
        SPLIT=split, FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if split:
        _prefill_combine_kernel[(q.shape[0], hq)](
            part_out, part_lse, out, query_start_loc, batch, num_splits, out.stride(0), out.stride(1),
            NUM_Q_HEADS=hq, HEAD_DIM=d, D_PAD=d_pad,
        )
    return out


def prefill_num_splits(programs: int, max_context: int, device: torch.device) -> int:
    """Split-KV factor of an extend: 1 when its ``programs`` (query tiles x sequences x heads) fill
    twice the SMs; else enough splits to, but each of at least 512 keys of ``max_context`` and at
    most 16 (the partials and the merge cost memory traffic of their own)."""
    if programs < 1 or max_context <= 0:
        return 1
    sms = sm_count(device) if device.type == "cuda" else 2
    target = 2 * sms
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), max_context // 512, 16))
