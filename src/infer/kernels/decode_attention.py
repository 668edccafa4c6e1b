"""Paged decode attention (phase 5): one new token per sequence attends over its whole paged context.

The cache of one layer is ``k_cache``, ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads,
head_dim]``; token ``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size`` (written there by :mod:`infer.kernels.kv_cache_write`). This module is one Triton
kernel and what plans and merges its work:

* :func:`paged_decode_attention`: PagedAttention (Kwon et al., SOSP 2023, arXiv:2309.06180) walks
  the block table key tile by key tile, with the online softmax of FlashAttention-2 (Dao, 2023,
  arXiv:2307.08691). Flash-decoding (Dao, Haziza, Massa, Sizov, 2023) splits a long context across
  several programs and combines their partial results with their log-sum-exp, so that a small batch
  still fills the GPU. GQA-aware: one program serves the ``G`` query heads that share a KV head, so
  each K/V tile is read from memory once, not ``G`` times.
* The merge (``_merge_splits``): the last of a sequence's programs to finish combines the partial
  results in the same launch (arrival counters, ``_split_counters``);
  :mod:`infer.kernels.prefill_attention`'s combine kernel merges its own splits with it.
* The split plan (:func:`decode_split_plan`, :func:`decode_num_splits`): how many key slices per
  sequence, from host numbers only, so that a CUDA graph chooses once.

No recompilation when the batch changes: the batch is a grid dimension, and the block-table width,
the number of splits and the window are runtime integers listed in ``do_not_specialize``. What is
compiled per variant (``tl.constexpr``) is what a model fixes: head_dim, the GQA group, the block
size, the dtype.

Sibling modules: :mod:`infer.kernels.prefill_attention` (the prompts' and extends' attention over
the same cache), :mod:`infer.kernels.attention_reference` (the plain-PyTorch
``paged_decode_attention``, same signature, which the tests compare against and the CPU backend
runs), :mod:`infer.kernels.triton_common` (the input checks the launchers share).
:mod:`infer.attention.triton_backend` calls these kernels for a model.

Importing this module works on any machine; launching needs a CUDA tensor, or CPU tensors with
``TRITON_INTERPRET=1`` set before Triton is imported (the tests' conftest does it). The interpreter
runs bf16 arithmetic on raw integers, so under it every bf16 load is converted to float32 first
(``UPCAST``); tiles are small there (each program instance costs milliseconds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.pdl import launch_options, wait_for_previous
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
    sm_count,
    unused_buffer,
)

__all__ = ["LONG_SPLIT_KEYS", "MIN_SPLIT_KEYS", "decode_num_splits", "decode_split_plan",
           "paged_decode_attention"]


@triton.jit(
    do_not_specialize=["window", "num_splits", "min_split_keys", "stride_bt"],
    do_not_specialize_on_alignment=["q_ptr", "out_ptr", "block_tables_ptr", "seq_lens_ptr", "part_lse_ptr"],
)
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    counter_ptr, k_scale_ptr, v_scale_ptr, qk_scale, window, num_splits, min_split_keys,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, USE_PDL: tl.constexpr, MERGE_UNROLL: tl.constexpr, FP8: tl.constexpr,
):
    # Grid (B, num_kv_heads, num_splits). Program (b, kvh, split) computes, for the GROUP query heads
    # that share KV head kvh, attention over one contiguous slice of sequence b's keys.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    # The new token sits at position seq_len - 1 and sees keys [lo, seq_len): all of them, or the last
    # `window` (window = 2**30 when the layer has none).
    lo = tl.maximum(seq_len - window, 0)
    # Flash-decoding: cut [lo, seq_len) into at most num_splits slices of a whole number of key tiles,
    # each of at least min_split_keys keys. A short sequence uses fewer slices than the grid has: the
    # programs past them (`active`) exit at once, and one slice alone writes its result directly.
    keys_per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N), tl.cdiv(min_split_keys, BLOCK_N))
    keys_per_split = keys_per_split * BLOCK_N
    active = tl.maximum(tl.cdiv(seq_len - lo, keys_per_split), 1)  # a padding row (no key): one, writing zeros
    if split >= active:
        return
    start = lo + split * keys_per_split
    end = tl.minimum(start + keys_per_split, seq_len)
    # With PDL (infer.kernels.pdl) everything above runs while the previous kernel (the QK norm + RoPE that
    # writes q and this step's K and V) finishes: the sequence's length is written by the host only, and the
    # programs past the used slices are gone before the wait. Measured on an H200 at batch 1:
    # Qwen3-4B 3.04 -> 2.99 ms per token against waiting first. Everything below reads what that kernel wrote.
    wait_for_previous(USE_PDL)

    # The query tile: GROUP real rows (the query heads of this KV head) padded to GROUP_PAD >= 16 rows
    # of zeros so that tl.dot has a legal shape; head_dim padded to D_PAD (a power of two) the same way.
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if FP8:  # an FP8 cache holds k / k_scale: the scale joins the score's multiplier (v's: see below)
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    # Online softmax state per query row (FlashAttention-2), in the log2 domain (qk_scale holds
    # scale * log2(e), so exp2 replaces exp): running max m_i, running sum l_i, unnormalized output acc.
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + b64 * stride_bt  # this sequence's block table
    k_head = k_cache_ptr + kvh * stride_ch  # this KV head's column of the cache
    v_head = v_cache_ptr + kvh * stride_ch

    for start_n in range(start, end, BLOCK_N):
        # >>> EXERCISE paged_decode_inner_loop
        # 1. Where the BLOCK_N keys of this tile live: key at position `tok` is in physical block
        #    block_table[tok // BLOCK_SIZE], row tok % BLOCK_SIZE of it. Looking the block up per key
        #    works for any block size (16, 32, or one block per sequence). Keys past `end` are masked:
        #    their table entries may be garbage and are never read.
        tok = start_n + offs_n
        valid = tok < end
        page = tl.load(bt_row + tok // BLOCK_SIZE, mask=valid, other=0)
        row = page.to(tl.int64) * stride_cb + (tok % BLOCK_SIZE) * stride_ct  # [BLOCK_N] element offsets
        kv_mask = valid[:, None] & d_mask[None, :]
        # 2. The K tile [BLOCK_N, D_PAD]: each key's head_dim elements are contiguous (coalesced loads).
        k = tl.load(k_head + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if FP8:  # e4m3 -> q's dtype is exact (more mantissa and exponent bits)
            k = k.to(q.dtype)
        # 3. Scores of all GROUP query heads against the tile at once: [GROUP_PAD, BLOCK_N], log2 units.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        # 4. Online softmax: raise the running max, rescale what was accumulated under the old max by
        #    alpha = 2^(m_old - m_new). Every tile holds >= 1 valid key, so m_new is finite here.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # 5. The V tile (same rows as K) and the weighted sum, P cast to the cache dtype for the MMA.
        v = tl.load(v_head + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
        # <<< EXERCISE paged_decode_inner_loop
    if FP8:  # sum_j p_j (v_j / v_scale) * v_scale: one multiply per output, not per key
        acc = acc * tl.load(v_scale_ptr)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if active == 1:  # the whole context in one program: write the normalized output directly
        # (a padding row of a CUDA graph, seq_len 0, read no key: it writes zeros, not 0 / 0)
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # a partial result: normalized output and log2-sum-exp of this slice (-inf when empty)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        part = (b64 * NUM_Q_HEADS + heads) * num_splits + split  # [GROUP_PAD] rows of [B, Hq, S]
        tl.store(part_lse_ptr + part, lse, mask=g_mask)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
                 mask=out_mask)
        # The last of the `active` programs of (b, kvh) to finish merges them all (no second kernel:
        # one launch fewer per layer, the "semaphore" split-K of stream-K GEMMs). The barrier puts every
        # thread's partial stores before the counter's acq_rel increment, which publishes them to the
        # program that sees the final count; that one reads them from L2 (.cg), then re-arms the counter.
        tl.debug_barrier()
        count = tl.atomic_add(counter_ptr + b64 * tl.num_programs(1) + kvh, 1, sem="acq_rel", scope="gpu")
        if count == active - 1:
            o = _merge_splits(part_out_ptr, part_lse_ptr, (b64 * NUM_Q_HEADS + heads) * num_splits, g_mask,
                              active, offs_d, d_mask, HEAD_DIM, D_PAD, MERGE_UNROLL)
            tl.store(out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + b64 * tl.num_programs(1) + kvh, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_step(o, lse, acc, total, m):
    """One split into the running merge: ``(acc, total, m)`` after split ``(o [R, D_PAD], lse [R])``."""
    m_new = tl.maximum(m, lse)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no non-empty split yet
    alpha = tl.exp2(m - m_safe)
    w = tl.exp2(lse - m_safe)  # 0 for an empty split
    return acc * alpha[:, None] + w[:, None] * o, total * alpha + w, m_new


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, first, row_mask, num_splits, offs_d, d_mask,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, UNROLL: tl.constexpr = 0):
    """Merge the ``num_splits`` partial results of each of ``R`` rows (query heads): row ``r``'s start at
    partial ``first[r]`` (``[R]`` int64; ``row_mask`` ``[R]`` says which rows are real). Each partial is a
    normalised output ``o_s`` and its log2-sum-exp2 ``lse_s``; the merge is ``sum_s 2^lse_s o_s / sum_s
    2^lse_s``, with a running max (the online softmax, one split at a time). Every split empty (a padding
    row): zeros. Returns ``[R, D_PAD]`` float32.

    The rows (a KV head's query heads) are merged side by side (a batch-1 decode over 6 splits of 4 heads
    once waited on 24 round trips to L2 one after the other). The loads go to L2 (.cg), never to a stale
    L1 line: the decode kernel merges what other programs have just written.

    ``UNROLL`` > 0 (at least ``num_splits``): the loop is unrolled over ``UNROLL`` splits, those past
    ``num_splits`` masked off, so that every split's loads are in flight at once: one trip to L2 before
    the arithmetic, not one per split. Measured in the engine on an H200 (batch 1, every phase
    8-9 flag and ``pdl``, alternated), ms per token: Qwen3-4B 2.69 -> 2.67 (3 slices of its 5-split grid
    in use), Qwen3-0.6B 0.935 -> 0.932, unrolled over the grid's splits; unrolled over 8, what the decode
    kernel does (one compiled variant for every grid of 2-8 splits), Qwen3-4B 2.69 -> 2.67 again.
    ``UNROLL`` 0: a loop that loads the next split's partials before the current ones are used, a chain
    of ``num_splits`` dependent steps (for wide grids, whose unrolled code would be long). (Loading 16
    splits in one tensor and reducing across them was slower on an H200: the cross-warp reductions
    cost more than the dependent loads they save.)"""
    m = tl.full(first.shape, float("-inf"), dtype=tl.float32)
    total = tl.zeros(first.shape, dtype=tl.float32)
    acc = tl.zeros([first.shape[0], D_PAD], dtype=tl.float32)
    o_mask = row_mask[:, None] & d_mask[None, :]
    if UNROLL:
        for s in tl.static_range(UNROLL):
            used = s < num_splits
            lse = tl.load(part_lse_ptr + first + s, mask=row_mask & used, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(part_out_ptr + (first + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=o_mask & used,
                        other=0.0, cache_modifier=".cg")
            acc, total, m = _merge_step(o, lse, acc, total, m)
    else:
        lse = tl.load(part_lse_ptr + first, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_out_ptr + first[:, None] * HEAD_DIM + offs_d[None, :], mask=o_mask, other=0.0,
                    cache_modifier=".cg")
        for s in range(num_splits):
            more = s + 1 < num_splits  # the next split's partials, in flight while this one is merged
            lse_next = tl.load(part_lse_ptr + first + s + 1, mask=row_mask & more, other=float("-inf"),
                               cache_modifier=".cg")
            o_next = tl.load(part_out_ptr + (first + s + 1)[:, None] * HEAD_DIM + offs_d[None, :],
                             mask=o_mask & more, other=0.0, cache_modifier=".cg")
            acc, total, m = _merge_step(o, lse, acc, total, m)
            lse, o = lse_next, o_next
    return acc / tl.where(total > 0, total, 1.0)[:, None]


#: the decode kernel's merge is unrolled (every split's partials loaded at once) for grids of at most this
#: many splits (see _merge_splits)
UNROLLED_MERGE_MAX_SPLITS = 8

#: the shortest key slice the grid plans for (one key tile of the GPU kernel): a narrow batch's grid gets
#: at most ``ceil(max_context / MIN_SPLIT_KEYS)`` slices per sequence
MIN_SPLIT_KEYS = 64


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """The automatic flash-decoding split count: enough programs to fill the GPU.

    ``B * num_kv_heads`` programs run without splitting; when that is under ``2 x SM count``, each
    sequence is cut into ``ceil(2 x SMs / programs)`` slices, though never into more than 64, nor into
    more than ``max_context`` holds of :data:`MIN_SPLIT_KEYS` keys (a grid whose programs would all
    exit). A sequence then uses ``ceil(context / slice)`` of them (the kernel rounds a slice up to whole
    key tiles), so the slices a context gets do not depend on how wide ``max_context`` is. Measured on
    an H100 (benchmarks/paged_attention.py --tune, Qwen3-4B shapes): batch 64 x 4k runs best unsplit
    (99% of the copy bandwidth; 2 splits 97%), batch 8 x 32k best with 4-8 splits (96-98%; unsplit 45%),
    batch 1 x 32k with 24-64 (74-80%; unsplit 6%). At batch-1 decode one-tile slices beat longer ones
    (H100, ms per token, alternated): Qwen3-4B over 129-256 keys 3.43-3.44 -> 3.39-3.41 against two
    slices of up to 128 keys, what a 256-key minimum gave a 264-token ``max_model_len`` (one unsplit slice:
    3.45), over 1,025-1,152 keys 3.61 -> 3.58 against five of ~256; Qwen3-0.6B 1.06-1.07 -> 1.03-1.04. The
    merge costs less than the chain of dependent tile loads a longer slice waits on.

    Args:
        max_context: an upper bound of the context lengths, known on the host (block-table width x
            block size, or the window), so that choosing never reads the device.
    """
    sms = sm_count(device) if device.type == "cuda" else 2
    programs = batch * num_kv_heads
    target = 2 * sms
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(max_context, MIN_SPLIT_KEYS), 64))


#: In a batch that fills the GPU unsplit, a context longer than this many keys is still cut into
#: slices of (at least) this many: one long sequence among short ones would otherwise be the whole
#: step's critical path, a single program per KV head walking all its keys while the GPU idles
#: (measured: 32 streams of ~1k tokens beside one of 8k, Qwen3-4B, 4.7 -> ~11 ms per step). Shorter
#: contexts stay in one slice; uniform 4k batches pay ~2% (2 splits, --tune).
LONG_SPLIT_KEYS = 2048


def decode_split_plan(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> tuple[int, int]:
    """``(num_splits, min_split_keys)`` for :func:`paged_decode_attention`: the grid's key slices per
    sequence and the fewest keys a slice holds (a sequence uses ``ceil(context / slice)`` of them).

    A batch too narrow to fill the GPU splits every sequence :func:`decode_num_splits` ways (no minimum
    beyond one key tile); a wide one splits only the contexts longer than :data:`LONG_SPLIT_KEYS`,
    into slices of that many, up to ``max_context``'s (at most 64). Host numbers only, so a CUDA graph
    chooses once for the longest context it may see.
    """
    # >>> EXERCISE decode_split_plan
    fill = decode_num_splits(batch, num_kv_heads, max_context, device)
    if fill > 1:
        return fill, 0
    return max(1, min(triton.cdiv(max_context, LONG_SPLIT_KEYS), 64)), LONG_SPLIT_KEYS
    # <<< EXERCISE decode_split_plan


def _decode_config(head_dim_pad: int, dtype: torch.dtype) -> dict:
    """Key tile and launch options of the decode kernel (tiny under the interpreter).

    Chosen on an H100 at Qwen3-4B shapes (--tune): 64 keys x 4 warps x 3 stages reads at 97-99% of the
    copy bandwidth; 32 keys with 4 warps or 128 keys with 2 warps lose up to 20% at some shapes.
    """
    if INTERPRET:
        return {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1}
    wide = head_dim_pad * (4 if dtype == torch.float32 else 2)  # bytes of one key row
    block_n = 64 if wide <= 256 else 32
    return {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 3 if wide <= 256 else 2}


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
    min_split_keys: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache: one new token per sequence (PagedAttention + flash-decoding).

    Sequence ``b``'s query sits at position ``seq_lens[b] - 1`` and attends keys ``j`` in ``[0,
    seq_lens[b])`` (only ``(seq_lens[b] - 1) - j < window`` with a sliding window), whose K/V, the new
    token's included, are already in the cache. The kernel walks the block table one key tile at a
    time (Kwon et al., SOSP 2023, arXiv:2309.06180), keeps a FlashAttention-2 online softmax per query
    head, serves all ``G = Hq / Hkv`` query heads of a KV head in one program (GQA: each K/V tile is
    read once), and splits long contexts over several programs whose partial results the last of them to
    finish merges by their log-sum-exp, in the same launch (flash-decoding, Dao et al. 2023).

    Args:
        q: ``[B, Hq, D]`` (may be a row-slice view of a bigger tensor; last dimension contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, q's dtype (fp32, fp16 or bf16), or
            float8_e4m3fn (an FP8 cache, phase 11: each tile is converted to q's dtype as it is loaded,
            ``k_scale`` joins the score's multiplier and ``v_scale`` multiplies the output).
        block_tables: int32 ``[B, W]`` with ``W >= ceil(seq_lens[b] / block_size)``; entries past a
            sequence's need are never read.
        seq_lens: int32 ``[B]``: context lengths including the new token; a row with 0 (padding of a
            CUDA-graph bucket) reads no key and gets zeros.
        scale: multiplier of ``q . k`` (usually ``D ** -0.5``).
        window: sliding window in tokens (>= 1), or None.
        out: optional ``[B, Hq, D]`` in q's dtype to write into (may be a view).
        num_splits: key slices per sequence (the grid's); None chooses them and ``min_split_keys``
            with :func:`decode_split_plan`.
        min_split_keys: the fewest keys of a slice: a sequence of ``L`` keys uses
            ``max(1, ceil(L / max(ceil(L / num_splits), min_split_keys)))`` slices (tile-rounded) and
            the grid's other programs for it exit at once.
        k_scale, v_scale: an FP8 cache's float32 ``[1]`` scales of this layer (None: 1.0); ignored otherwise.

    Returns:
        ``out`` (allocated like q if None): ``[B, Hq, D]``.

    Raises:
        ValueError: wrong ranks or shapes, ``Hq`` not a multiple of ``Hkv``, mismatched dtypes or
            devices, index tensors not int32, a non-contiguous last dimension, ``window < 1``,
            ``num_splits < 1``, ``min_split_keys < 0``.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    check_paged_cache(k_cache, v_cache)
    batch, hq, hkv, d = check_query(q, k_cache, "q")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [B={batch}, W], got shape {tuple(block_tables.shape)}")
    check_index(block_tables, "block_tables", k_cache)
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must be [B={batch}], got shape {tuple(seq_lens.shape)}")
    check_index(seq_lens, "seq_lens", k_cache)
    check_window(window)
    out = check_out(out, q, (batch, hq, d))
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if min_split_keys < 0:
        raise ValueError(f"min_split_keys must be >= 0, got {min_split_keys}")
    k_scale, v_scale = check_kv_scales(k_cache, k_scale, v_scale)
    if batch == 0:
        return out
    check_launchable(q)
    block_size = k_cache.shape[1]
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        if window is not None:
            max_context = min(max_context, window)
        num_splits, min_split_keys = decode_split_plan(batch, hkv, max_context, q.device)
    group = hq // hkv
    d_pad = max(16, triton.next_power_of_2(d))
    cfg = _decode_config(d_pad, q.dtype)
    if num_splits > 1:  # one allocation: [B, Hq, S, D] partial outputs, then [B, Hq, S] log-sum-exps
        rows = batch * hq * num_splits
        scratch = torch.empty(rows * (d + 1), dtype=torch.float32, device=q.device)
        part_out, part_lse = scratch[:rows * d], scratch[rows * d:]
        counters = _split_counters(q.device, batch * hkv)
    else:  # unused by the kernel, which writes `out` directly (fp32 like the real ones: no new variant)
        part_out = part_lse = unused_buffer(q.device)
        counters = _split_counters(q.device, 1)
    _paged_decode_kernel[(batch, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, counters, k_scale, v_scale,
        scale * LOG2E, window if window is not None else NO_WINDOW, num_splits, min_split_keys,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_Q_HEADS=hq, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_N=cfg["BLOCK_N"],
        UPCAST=INTERPRET and q.dtype == torch.bfloat16,
        # one compiled variant for every grid of 2-8 splits, one for the rest (no recompilation per split count)
        MERGE_UNROLL=UNROLLED_MERGE_MAX_SPLITS if 1 < num_splits <= UNROLLED_MERGE_MAX_SPLITS else 0,
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch_options(q),
    )
    return out


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros, at least ``n``: the decode kernel's per-(sequence, KV head) arrival counters. Each
    launch leaves them zero again (the merging program re-arms its counter), so one buffer per device
    serves every layer and step, CUDA-graph replays included. A bigger one is made only outside a
    capture (the graphs' warm-up runs each bucket eagerly first, largest first), and a smaller one is
    never freed: a captured graph may hold its address."""
    bufs = _COUNTERS.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the decode split counters must be allocated before a CUDA-graph capture")
        bufs.append(torch.zeros(max(n, 1 << 14), dtype=torch.int32, device=device))
    return bufs[-1]
