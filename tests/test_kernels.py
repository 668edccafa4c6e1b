"""Phase 5 kernels: the Triton paged-cache operations against their plain-PyTorch references.

* On the CPU the kernels run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1)
  at small shapes, in float32 (tolerance ~1e-5) and float16 (~2e-3), with ragged batches, GQA,
  sliding windows, block sizes that are not powers of two, head_dim 40 (padded to 64) and explicit
  split counts. The references themselves are checked against a naive float64 loop.
* Every input is random (a seeded generator per case), outputs are filled with NaN before a kernel
  runs (an element it forgets to write fails), and cache slots no sequence owns hold NaN, as do the
  block-table entries past a sequence's need point at a NaN block: reading anything it should not
  makes the result NaN.
* ``gpu`` tests (skipped without CUDA) run real shapes in bf16 (head_dim 64/128/256, GQA 1/4/8,
  blocks 16/32, contexts up to 32k) against the reference in float32, and check that a new batch
  size, block-table width or split count compiles nothing new.
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from pathlib import Path

import pytest
import torch

from infer.kernels import attention_reference as ref  # the plain-PyTorch twins
from infer.kernels import decode_attention as dec  # paged decode (split-KV), its split plan
from infer.kernels import kv_cache_write as kvw  # reshape_and_cache
from infer.kernels import prefill_attention as pre  # variable-length extend attention
from infer.kernels.triton_common import INTERPRET

ROOT = Path(__file__).resolve().parent.parent
# The kernels run where the tensors are: the GPU when there is one (the tests then cover the GPU tile
# choices), else the CPU under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------------------- helpers


class PagedCase:
    """A paged cache holding random K/V for a batch of sequences, everything else NaN.

    Sequence ``b`` has ``seq_lens[b]`` tokens in blocks drawn at random from the pool (so they are
    scattered and out of order); the block table's entries past its need point at ``poison``, a
    block of NaN that no sequence owns; unused slots of the last block are NaN too.
    """

    def __init__(self, seq_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, seed: int, device: str = DEVICE, extra_width: int = 1,
                 spare_blocks: int = 3) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.seq_lens_list = seq_lens
        needs = [-(-n // block_size) for n in seq_lens]
        width = max(needs) + extra_width
        num_blocks = sum(needs) + spare_blocks + 1
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.v_cache = torch.full(shape, float("nan"), dtype=dtype)
        perm = torch.randperm(num_blocks, generator=g)
        self.poison = int(perm[-1])
        tables = torch.full((len(seq_lens), width), self.poison, dtype=torch.int32)
        used = 0
        for b, (n, need) in enumerate(zip(seq_lens, needs)):
            blocks = perm[used:used + need]
            used += need
            tables[b, :need] = blocks.to(torch.int32)
            for p in range(n):  # write the n valid positions
                blk, off = int(blocks[p // block_size]), p % block_size
                self.k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
                self.v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=g).to(dtype)
        self.block_tables = tables
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.g = g
        self.num_q_heads, self.head_dim, self.dtype = num_q_heads, head_dim, dtype
        self.scale = head_dim**-0.5
        if device != "cpu":
            self.to(device)

    def to(self, device):
        for name in ("k_cache", "v_cache", "block_tables", "seq_lens"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g).to(self.dtype).to(self.k_cache.device)

    def float_caches(self, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.to(dtype), self.v_cache.to(dtype)


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "the kernel left NaN (an unwritten element or a poisoned read)"
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def naive_attention(q, k, v, q_pos, scale, window):
    """float64 softmax(q k^T * scale) v of one sequence, one head at a time, with explicit masks.

    q: [Lq, Hq, D] at positions q_pos; k, v: [L, Hkv, D] for positions 0 .. L-1.
    """
    lq, hq, _ = q.shape
    hkv = k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(hq):
        kh = h // (hq // hkv)
        for i in range(lq):
            p = q_pos[i]
            keys = [j for j in range(k.shape[0]) if j <= p and (window is None or p - j < window)]
            s = torch.stack([(q[i, h].double() * k[j, kh].double()).sum() * scale for j in keys])
            w = torch.softmax(s, 0)
            out[i, h] = sum(w[n] * v[j, kh].double() for n, j in enumerate(keys))
    return out


def context_of(case: PagedCase, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's K/V [L, Hkv, D], read position by position through its block table."""
    bs = case.k_cache.shape[1]
    n = case.seq_lens_list[b]
    idx = [(int(case.block_tables[b, p // bs]), p % bs) for p in range(n)]
    k = torch.stack([case.k_cache[blk, off] for blk, off in idx])
    v = torch.stack([case.v_cache[blk, off] for blk, off in idx])
    return k, v


# ---------------------------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 5])
def test_reshape_and_cache_matches_reference(dtype, block_size):
    g = torch.Generator().manual_seed(1000 + block_size)
    hq, hkv, d, t, num_blocks = 4, 2, 24, 11, 6
    # key/value are strided slices of a fused qkv projection output, as in the model
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[[2, 7]] = -1  # padding tokens: skipped
    k0 = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v0 = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    qkv, slots, k0, v0 = (x.to(DEVICE) for x in (qkv, slots, k0, v0))
    key = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    value = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    assert not key.is_contiguous()
    k1, v1, k2, v2 = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    kvw.reshape_and_cache(key, value, k1, v1, slots)
    ref.reshape_and_cache(key, value, k2, v2, slots)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    flat = k1.view(-1, hkv, d)
    assert torch.equal(flat[slots[0]], key[0]) and torch.equal(v1.view(-1, hkv, d)[slots[5]], value[5])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(flat[untouched], k0.view(-1, hkv, d)[untouched])


# ---------------------------------------------------------------------------------- decode

# (seq_lens, Hq, Hkv, head_dim, block_size, window, num_splits)
DECODE_CASES = {
    "mha": ([7, 33, 1], 2, 2, 32, 16, None, 1),
    "gqa4-splits": ([50, 17, 64], 8, 2, 64, 16, None, 3),
    "gqa8-d40-bs5": ([23, 9], 8, 1, 40, 5, None, 2),
    "window": ([45, 6, 30], 4, 2, 32, 8, 12, 2),
    "one-block-per-seq": ([37, 60], 4, 2, 32, 64, None, None),
    "many-splits": ([40], 4, 1, 16, 16, None, 7),
    "more-splits-than-unrolled": ([150, 9], 4, 2, 16, 8, None, 12),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_matches_reference(name, dtype):
    seq_lens, hq, hkv, d, bs, window, splits = DECODE_CASES[name]
    case = PagedCase(seq_lens, hq, hkv, d, bs, dtype, seed=zlib.crc32(name.encode()) % 1000)
    q = case.randn(len(seq_lens), hq, d)
    out = poisoned(q)
    got = dec.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                                     window=window, out=out, num_splits=splits)
    assert got is out
    k32, v32 = case.float_caches()
    expected = ref.paged_decode_attention(q.float(), k32, v32, case.block_tables, case.seq_lens, case.scale,
                                          window=window)
    assert_close(out, expected, dtype)


def test_decode_bf16_under_the_interpreter():
    case = PagedCase([21, 40], 4, 2, 32, 16, torch.bfloat16, seed=7)
    q = case.randn(2, 4, 32)
    out = dec.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                                     num_splits=2)
    k32, v32 = case.float_caches()
    expected = ref.paged_decode_attention(q.float(), k32, v32, case.block_tables, case.seq_lens, case.scale)
    assert_close(out, expected, torch.bfloat16)


def test_decode_honours_views_of_q_and_out():
    case = PagedCase([19, 5, 28], 4, 2, 32, 8, torch.float32, seed=11)
    big_q = case.randn(7, 4, 32)
    q = big_q[2:5]  # decode rows of a bigger flattened batch
    big_out = torch.full((9, 4, 32), float("nan"), device=DEVICE)
    out = big_out[4:7]
    dec.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                               out=out, num_splits=2)
    expected = ref.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                          case.scale)
    assert_close(out, expected, torch.float32)
    assert torch.isnan(big_out[:4]).all() and torch.isnan(big_out[7:]).all()


def test_decode_splits_agree_with_each_other():
    case = PagedCase([70, 3], 4, 1, 32, 16, torch.float32, seed=12)
    q = case.randn(2, 4, 32)
    outs = [dec.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                       case.scale, num_splits=s) for s in (1, 2, 5, 12)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("min_keys", [0, 24, 40, 1000])
def test_decode_min_split_keys(min_keys):
    """A grid of 6 splits with a minimum slice: each sequence of L keys uses only ceil(L / slice)
    programs (slice = max(tile-rounded ceil(L / 6), min_keys)), the others exit, and the one-slice
    sequences write directly; the same attention as the reference either way. A padding row
    (context 0, as in a CUDA graph's bucket) gets zeros."""
    case = PagedCase([90, 5, 33, 17, 1], 4, 2, 32, 8, torch.float32, seed=21)
    q = case.randn(5, 4, 32)
    k32, v32 = case.float_caches()
    expected = ref.paged_decode_attention(q, k32, v32, case.block_tables, case.seq_lens, case.scale)
    case.seq_lens[-1] = 0  # now a padding row
    out = poisoned(q)
    dec.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                               out=out, num_splits=6, min_split_keys=min_keys)
    assert_close(out[:4], expected[:4], torch.float32)
    assert torch.equal(out[4], torch.zeros_like(out[4]))


def test_decode_split_plan():
    cpu = torch.device("cpu")  # 2 "SMs": a batch fills the CPU from 4 programs
    assert dec.decode_split_plan(1, 1, 32768, cpu) == (4, 0)  # narrow: every sequence split, no minimum
    assert dec.decode_split_plan(64, 8, 1024, cpu) == (1, dec.LONG_SPLIT_KEYS)  # wide and short: one slice
    assert dec.decode_split_plan(64, 8, 16384, cpu) == (16384 // dec.LONG_SPLIT_KEYS, dec.LONG_SPLIT_KEYS)
    assert dec.decode_split_plan(64, 8, 10**7, cpu) == (64, dec.LONG_SPLIT_KEYS)  # at most 64 slices


# ---------------------------------------------------------------------------------- prefill

# (seq_lens, query_lens, Hq, Hkv, head_dim, block_size, window)
PREFILL_CASES = {
    "fresh": ([20, 9], [20, 9], 2, 2, 32, 16, None),
    "extend-gqa": ([30, 40, 18, 5], [7, 1, 18, 5], 4, 2, 32, 16, None),
    "window-d40-bs12": ([37, 26], [21, 3], 4, 1, 40, 12, 9),
    "one-block-per-seq": ([35, 12], [35, 4], 2, 1, 16, 64, 20),
}


def prefill_inputs(case: PagedCase, query_lens: list[int], offset: int, hq: int, d: int):
    starts = [offset]
    for n in query_lens:
        starts.append(starts[-1] + n)
    total = starts[-1] + 3  # rows before `offset` and after the last sequence belong to others
    q = case.randn(total, hq, d)
    qsl = torch.tensor(starts, dtype=torch.int32, device=case.k_cache.device)
    return q, qsl, starts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(PREFILL_CASES))
def test_prefill_matches_reference(name, dtype):
    seq_lens, q_lens, hq, hkv, d, bs, window = PREFILL_CASES[name]
    case = PagedCase(seq_lens, hq, hkv, d, bs, dtype, seed=zlib.crc32(name.encode()) % 1000 + 1)
    q, qsl, starts = prefill_inputs(case, q_lens, 2, hq, d)
    out = poisoned(q)
    got = pre.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens,
                                      max(q_lens), case.scale, window=window, out=out)
    assert got is out
    k32, v32 = case.float_caches()
    expected = ref.paged_prefill_attention(q.float(), k32, v32, case.block_tables, qsl, case.seq_lens,
                                           max(q_lens), case.scale, window=window)
    s, e = starts[0], starts[-1]
    assert_close(out[s:e], expected[s:e], dtype)
    assert torch.isnan(out[:s]).all() and torch.isnan(out[e:]).all(), "rows of other sequences were written"


@pytest.mark.parametrize("name, num_splits", [("extend-gqa", 3), ("window-d40-bs12", 2), ("one-block-per-seq", 5),
                                              ("fresh", 4)])
def test_split_kv_prefill_matches_reference(name, num_splits):
    """Extends with their keys split over programs (partials merged by a second kernel) give the
    reference result, with a sliding window, with splits that get no key (short contexts, more
    splits than key tiles), and only the prefill's rows are written."""
    seq_lens, q_lens, hq, hkv, d, bs, window = PREFILL_CASES[name]
    case = PagedCase(seq_lens, hq, hkv, d, bs, torch.float32, seed=zlib.crc32(name.encode()) % 1000 + 7)
    q, qsl, starts = prefill_inputs(case, q_lens, 2, hq, d)
    out = poisoned(q)
    pre.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens,
                                max(q_lens), case.scale, window=window, out=out, num_splits=num_splits)
    k32, v32 = case.float_caches()
    expected = ref.paged_prefill_attention(q.float(), k32, v32, case.block_tables, qsl, case.seq_lens,
                                           max(q_lens), case.scale, window=window)
    s, e = starts[0], starts[-1]
    assert_close(out[s:e], expected[s:e], torch.float32)
    assert torch.isnan(out[:s]).all() and torch.isnan(out[e:]).all(), "rows of other sequences were written"


def test_prefill_num_splits_fills_the_gpu_only_when_needed():
    cpu = torch.device("cpu")  # 2 "SMs" there: a target of 4 programs
    assert pre.prefill_num_splits(64, 4096, cpu) == 1  # enough programs
    assert pre.prefill_num_splits(1, 4096, cpu) == 4
    assert pre.prefill_num_splits(1, 1000, cpu) == 1  # keys too few to split (512 per split at least)
    assert pre.prefill_num_splits(1, 0, cpu) == 1  # no context bound given


def test_prefill_bf16_under_the_interpreter_and_default_out():
    case = PagedCase([24, 18], 4, 2, 32, 16, torch.bfloat16, seed=21)
    q, qsl, starts = prefill_inputs(case, [10, 18], 0, 4, 32)
    out = pre.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, 18,
                                      case.scale, window=13)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    k32, v32 = case.float_caches()
    expected = ref.paged_prefill_attention(q.float(), k32, v32, case.block_tables, qsl, case.seq_lens, 18,
                                           case.scale, window=13)
    assert_close(out[:starts[-1]], expected[:starts[-1]], torch.bfloat16)


def test_write_then_attend_round_trip():
    """reshape_and_cache fills the cache, then prefill reads it: same as attention over the raw K/V."""
    g = torch.Generator().manual_seed(31)
    hq, hkv, d, bs, n = 4, 2, 32, 16, 21
    k = torch.randn(n, hkv, d, generator=g)
    v = torch.randn(n, hkv, d, generator=g)
    q = torch.randn(n, hq, d, generator=g)
    k_cache = torch.full((4, bs, hkv, d), float("nan"), device=DEVICE)
    v_cache = torch.full((4, bs, hkv, d), float("nan"), device=DEVICE)
    table = torch.tensor([[3, 1, 0]], dtype=torch.int32)
    pos = torch.arange(n)
    slots = table[0, pos // bs].long() * bs + pos % bs
    kvw.reshape_and_cache(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    i32 = {"dtype": torch.int32, "device": DEVICE}
    out = pre.paged_prefill_attention(q.to(DEVICE), k_cache, v_cache, table.to(DEVICE), torch.tensor([0, n], **i32),
                                      torch.tensor([n], **i32), n, d**-0.5)
    expected = naive_attention(q, k, v, list(range(n)), d**-0.5, None)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- the references in float64


@pytest.mark.parametrize("window", [None, 5])
def test_decode_reference_is_exact_attention(window):
    case = PagedCase([13, 1, 22], 6, 2, 8, 4, torch.float64, seed=41, device="cpu")
    q = case.randn(3, 6, 8)
    out = ref.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                                     window=window)
    for b, n in enumerate(case.seq_lens_list):
        k, v = context_of(case, b)
        expected = naive_attention(q[b:b + 1], k, v, [n - 1], case.scale, window)
        torch.testing.assert_close(out[b:b + 1], expected, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("window", [None, 4])
def test_prefill_reference_is_exact_attention(window):
    case = PagedCase([11, 9], 4, 2, 8, 4, torch.float64, seed=42, device="cpu")
    q_lens = [6, 9]
    q, qsl, starts = prefill_inputs(case, q_lens, 1, 4, 8)
    out = ref.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, 9,
                                      case.scale, window=window)
    for b, n in enumerate(case.seq_lens_list):
        k, v = context_of(case, b)
        s, e = starts[b], starts[b + 1]
        expected = naive_attention(q[s:e], k, v, list(range(n - (e - s), n)), case.scale, window)
        torch.testing.assert_close(out[s:e], expected, atol=1e-12, rtol=1e-10)


# ---------------------------------------------------------------------------------- input checks


def test_bad_inputs_raise_value_errors():
    case = PagedCase([5, 9], 4, 2, 16, 4, torch.float32, seed=51)
    q = case.randn(2, 4, 16)
    kc, vc, bt, sl = case.k_cache, case.v_cache, case.block_tables, case.seq_lens
    decode = dec.paged_decode_attention
    cases = [
        (lambda: decode(q[0], kc, vc, bt, sl, 1.0), "q must be"),
        (lambda: decode(case.randn(2, 3, 16), kc, vc, bt, sl, 1.0), "multiple"),
        (lambda: decode(q.half(), kc, vc, bt, sl, 1.0), "dtype"),
        (lambda: decode(q, kc, vc, bt.long(), sl, 1.0), "block_tables must be int32"),
        (lambda: decode(q, kc, vc, bt, sl.long(), 1.0), "seq_lens must be int32"),
        (lambda: decode(q, kc, vc, bt[:1], sl, 1.0), "block_tables must be"),
        (lambda: decode(q, kc, vc[..., :8], bt, sl, 1.0), "v_cache shape"),
        (lambda: decode(q, kc, vc, bt, sl, 1.0, window=0), "window"),
        (lambda: decode(q, kc, vc, bt, sl, 1.0, num_splits=0), "num_splits"),
        (lambda: decode(q, kc, vc, bt, sl, 1.0, out=torch.empty(2, 4, 8)), "out must have shape"),
        (lambda: decode(q.transpose(1, 2).contiguous().transpose(1, 2), kc, vc, bt, sl, 1.0), "contiguous"),
        (lambda: pre.paged_prefill_attention(q, kc, vc, bt, torch.tensor([0, 1], dtype=torch.int32), sl, 1, 1.0),
         "seq_lens must be"),
        (lambda: pre.paged_prefill_attention(q, kc, vc, bt, torch.tensor([0, 1, 2]), sl, 1, 1.0),
         "query_start_loc must be int32"),
        (lambda: kvw.reshape_and_cache(q[:, :2], q[:, :2], kc, vc, torch.tensor([0, 1], dtype=torch.int32)),
         "slot_mapping must be int64"),
        (lambda: kvw.reshape_and_cache(q, q, kc, vc, torch.tensor([0, 1])), "key heads"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()


def test_empty_batches_are_no_ops():
    case = PagedCase([5], 2, 2, 16, 4, torch.float32, seed=52)
    q = case.randn(0, 2, 16)
    empty_i32 = torch.zeros(0, dtype=torch.int32)
    out = dec.paged_decode_attention(q, case.k_cache, case.v_cache, torch.zeros(0, 3, dtype=torch.int32), empty_i32,
                                     1.0)
    assert out.shape == (0, 2, 16)
    kvw.reshape_and_cache(q[:, :2], q[:, :2], case.k_cache, case.v_cache, torch.zeros(0, dtype=torch.int64))


def test_runtime_ints_are_not_specialized():
    """Batch size is a grid dimension; W, num_splits and window must not be compile-time values."""
    def names(kernel):  # JITFunction and the interpreter's InterpretedFunction keep them differently
        return set(getattr(kernel, "do_not_specialize", None) or kernel.kwargs["do_not_specialize"])

    assert {"stride_bt", "num_splits", "min_split_keys", "window"} <= names(dec._paged_decode_kernel)
    assert {"stride_bt", "window"} <= names(pre._paged_prefill_kernel)


def test_auto_num_splits():
    cpu = torch.device("cpu")
    assert dec.decode_num_splits(64, 8, 4096, cpu) == 1  # enough programs already
    assert dec.decode_num_splits(1, 1, 32768, cpu) == 4  # 2 x "2 SMs" on the CPU
    assert dec.decode_num_splits(1, 1, 100, cpu) == 2  # no more slices than max_context holds of 64 keys
    assert dec.decode_num_splits(1, 1, 129, cpu) == 3 and dec.decode_num_splits(1, 1, 64, cpu) == 1


@pytest.mark.skipif(not INTERPRET, reason="the CPU smoke run needs the Triton interpreter")
def test_benchmark_smoke(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import paged_attention

    assert paged_attention.main(["--device", "cpu", "--batches", "1", "--contexts", "20", "--prefill", "1", "16",
                                 "--kv-cache-dtype", "fp8", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "paged_attention.json").read_text())
    fp8 = report["decode"][1]  # the same shape over an FP8 cache: the same kernel result as over its values
    assert fp8["kv_cache_dtype"] == "fp8" and fp8["max_abs_diff_vs_dequantized"] < 1e-5 and fp8["kv_mb"] * 4 == \
        pytest.approx(report["decode"][0]["kv_mb"])
    assert report["decode"][0]["triton_us"] > 0 and report["decode"][0]["max_abs_diff_vs_sdpa"] < 1e-4 and report["prefill"][0]["triton_ms"] > 0
    assert (tmp_path / "paged_attention.md").exists()
    if (tmp_path / "paged_attention.png").exists():
        assert (tmp_path / "paged_attention.png").stat().st_size > 0


# ---------------------------------------------------------------------------------- GPU, real shapes


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


def gpu_case(seq_lens, hq, hkv, d, bs, seed, dtype=torch.bfloat16) -> PagedCase:
    """A PagedCase built directly on the GPU (fast for long contexts): random K/V in every block, the
    unowned blocks, and the table entries past each sequence's need (a NaN block), poisoned."""
    case = PagedCase.__new__(PagedCase)
    g = torch.Generator(device="cuda").manual_seed(seed)
    needs = [-(-n // bs) for n in seq_lens]
    width = max(needs) + 2
    num_blocks = sum(needs) + 8
    shape = (num_blocks, bs, hkv, d)
    case.k_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    case.v_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    perm = torch.randperm(num_blocks, generator=g, device="cuda")
    case.poison = int(perm[-1])
    case.k_cache[case.poison] = float("nan")
    case.v_cache[case.poison] = float("nan")
    tables = torch.full((len(seq_lens), width), case.poison, dtype=torch.int32, device="cuda")
    used = 0
    for b, (n, need) in enumerate(zip(seq_lens, needs)):
        tables[b, :need] = perm[used:used + need].to(torch.int32)
        last = int(perm[used + need - 1])
        used += need
        tail = n - (need - 1) * bs  # slots past the sequence in its last block: NaN
        case.k_cache[last, tail:] = float("nan")
        case.v_cache[last, tail:] = float("nan")
    case.block_tables = tables
    case.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    case.seq_lens_list = seq_lens
    case.g = g
    case.num_q_heads, case.head_dim, case.dtype = hq, d, dtype
    case.scale = d**-0.5
    return case


def gpu_randn(case, *shape):
    return torch.randn(*shape, generator=case.g, device="cuda").to(case.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_decode_real_shapes(head_dim, group, block_size):
    hkv = 8 if head_dim < 256 else 4
    seq_lens = [1, 17, 4096, 1000, 8191, 300]  # ragged
    case = gpu_case(seq_lens, hkv * group, hkv, head_dim, block_size, seed=head_dim * 10 + group + block_size)
    q = gpu_randn(case, len(seq_lens), hkv * group, head_dim)
    k32, v32 = case.float_caches()
    for window, splits in ((None, None), (None, 4), (512, None)):
        out = poisoned(q)
        dec.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                                   window=window, out=out, num_splits=splits)
        expected = ref.paged_decode_attention(q.float(), k32, v32, case.block_tables, case.seq_lens, case.scale,
                                              window=window)
        assert not torch.isnan(out).any()
        assert rel_err(out, expected) < 1e-2, (window, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group,window", [(128, 4, None), (256, 2, 1024), (64, 8, None)])
def test_gpu_decode_long_contexts(head_dim, group, window):
    seq_lens = [32768, 1, 20000, 32000]
    hkv = 8 if head_dim == 128 else 4
    case = gpu_case(seq_lens, hkv * group, hkv, head_dim, 16, seed=head_dim + group)
    q = gpu_randn(case, len(seq_lens), hkv * group, head_dim)
    k32, v32 = case.float_caches()
    out = poisoned(q)
    dec.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                               window=window, out=out)
    expected = ref.paged_decode_attention(q.float(), k32, v32, case.block_tables, case.seq_lens, case.scale,
                                          window=window)
    assert not torch.isnan(out).any()
    assert rel_err(out, expected) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_gpu_prefill_real_shapes(head_dim, group, block_size):
    hkv = 8 if head_dim < 256 else 4
    seq_lens = [2048, 700, 3000, 129, 1]  # with cached prefixes of 0, 200, 2000, 0, 0 tokens
    q_lens = [2048, 500, 1000, 129, 1]
    case = gpu_case(seq_lens, hkv * group, hkv, head_dim, block_size, seed=head_dim + 7 * group + block_size)
    starts = [5]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = gpu_randn(case, starts[-1] + 4, hkv * group, head_dim)
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    k32, v32 = case.float_caches()
    for window in (None, 256):
        out = poisoned(q)
        pre.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens,
                                    max(q_lens), case.scale, window=window, out=out)
        expected = ref.paged_prefill_attention(q.float(), k32, v32, case.block_tables, qsl, case.seq_lens,
                                               max(q_lens), case.scale, window=window)
        s, e = starts[0], starts[-1]
        assert not torch.isnan(out[s:e]).any()
        assert torch.isnan(out[:s]).all() and torch.isnan(out[e:]).all()
        assert rel_err(out[s:e], expected[s:e]) < 1e-2, window


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 1000])
def test_gpu_prefill_long_prompt_tiles(window):
    """Prompts of LONG_PROMPT_TOKENS or more take the 128 x 128 tiles on a Hopper GPU: a 6,000-token prompt
    (not a multiple of 128) beside a 4,100-token extend after a 900-token prefix, against the reference."""
    seq_lens, q_lens = [6000, 5000], [6000, 4100]
    case = gpu_case(seq_lens, 32, 8, 128, 16, seed=5)
    starts = [3]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = gpu_randn(case, starts[-1] + 2, 32, 128)
    qsl = torch.tensor(starts, dtype=torch.int32, device="cuda")
    out = poisoned(q)
    pre.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, max(q_lens),
                                case.scale, window=window, out=out)
    k32, v32 = case.float_caches()
    expected = ref.paged_prefill_attention(q.float(), k32, v32, case.block_tables, qsl, case.seq_lens, max(q_lens),
                                           case.scale, window=window)
    s, e = starts[0], starts[-1]
    assert torch.isnan(out[:s]).all() and torch.isnan(out[e:]).all()
    assert rel_err(out[s:e], expected[s:e]) < 1e-2


def test_prefill_with_the_long_prompt_tiles_matches_reference(monkeypatch):
    """The long-prompt tiles (128 queries x 128 keys) under the interpreter: the masks and tile ranges at that
    size (a prompt not a multiple of 128, an extend after a prefix, a window) give the reference's output."""
    monkeypatch.setattr(pre, "_prefill_config", lambda *_a: {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8,
                                                               "num_stages": 3})
    case = PagedCase([300, 270], 2, 1, 16, 16, torch.float32, seed=13)
    q, qsl, starts = prefill_inputs(case, [300, 140], 1, 2, 16)
    k32, v32 = case.float_caches()
    for window in (None, 150):
        out = pre.paged_prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, 300,
                                          case.scale, window=window, num_splits=1)
        expected = ref.paged_prefill_attention(q, k32, v32, case.block_tables, qsl, case.seq_lens, 300, case.scale,
                                               window=window)
        assert_close(out[starts[0]:starts[-1]], expected[starts[0]:starts[-1]], torch.float32)


def test_long_prompts_take_the_large_tiles_only_where_shared_memory_holds_them(monkeypatch):
    assert pre.shared_memory_per_block(torch.device("cpu")) == 0 and pre.shared_memory_per_block(None) == 0
    monkeypatch.setattr(pre, "INTERPRET", False)
    cuda = torch.device("cuda", 0)
    long, short = pre.LONG_PROMPT_TOKENS, pre.LONG_PROMPT_TOKENS - 1
    monkeypatch.setattr(pre, "shared_memory_per_block", lambda device: 227 * 1024)  # an H100
    assert pre._prefill_config(128, torch.bfloat16, long, cuda)["BLOCK_M"] == 128
    assert pre._prefill_config(128, torch.bfloat16, short, cuda)["BLOCK_M"] == 64
    assert pre._prefill_config(256, torch.bfloat16, long, cuda)["BLOCK_N"] == 32  # head_dim 256
    assert pre._prefill_config(64, torch.bfloat16, long, cuda)["BLOCK_M"] == 64  # only head_dim 128 was measured
    monkeypatch.setattr(pre, "shared_memory_per_block", lambda device: 163 * 1024)  # an A100
    assert pre._prefill_config(128, torch.bfloat16, long, cuda)["BLOCK_M"] == 64


@pytest.mark.gpu
def test_gpu_float32_is_ieee_not_tf32():
    """fp32 inputs must use full-precision dots (TF32 would give ~1e-3 relative errors)."""
    case = gpu_case([3000, 517], 8, 2, 128, 16, seed=99, dtype=torch.float32)
    q = gpu_randn(case, 2, 8, 128)
    k64, v64 = case.float_caches(torch.float64)
    out = dec.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                                     num_splits=3)
    expected = ref.paged_decode_attention(q.double(), k64, v64, case.block_tables, case.seq_lens, case.scale)
    assert rel_err(out, expected) < 1e-5
    qsl = torch.tensor([0, 600, 917], dtype=torch.int32, device="cuda")
    qp = gpu_randn(case, 917, 8, 128)
    out = pre.paged_prefill_attention(qp, case.k_cache, case.v_cache, case.block_tables, qsl, case.seq_lens, 600,
                                      case.scale)
    expected = ref.paged_prefill_attention(qp.double(), k64, v64, case.block_tables, qsl, case.seq_lens, 600,
                                           case.scale)
    assert rel_err(out, expected) < 1e-5


@pytest.mark.gpu
def test_gpu_reshape_and_cache():
    g = torch.Generator(device="cuda").manual_seed(5)
    t, hq, hkv, d, bs, nb = 300, 32, 8, 128, 16, 40
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g, device="cuda").to(torch.bfloat16)
    key, value = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d), qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    slots = torch.randperm(nb * bs, generator=g, device="cuda")[:t]
    slots[::7] = -1
    k1 = torch.randn(nb, bs, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    v1 = torch.randn(nb, bs, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    k2, v2 = k1.clone(), v1.clone()
    kvw.reshape_and_cache(key, value, k1, v1, slots)
    ref.reshape_and_cache(key, value, k2, v2, slots)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


def compiled_variants(kernel) -> int:
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.gpu
def test_gpu_no_recompilation_across_batches_widths_and_splits():
    hq, hkv, d, bs = 32, 8, 128, 16
    case = gpu_case([100] * 8, hq, hkv, d, bs, seed=3)
    big = case.block_tables

    def decode(b, w, splits, window=None):
        q = gpu_randn(case, b, hq, d)
        table = torch.zeros(b, w, dtype=torch.int32, device="cuda")
        table[:, :min(w, big.shape[1])] = big[:b, :w]
        dec.paged_decode_attention(q, case.k_cache, case.v_cache, table, case.seq_lens[:b], case.scale,
                                   window=window, num_splits=splits)

    def prefill(b, w, q_len, window=None):
        qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda") * q_len + 3
        q = gpu_randn(case, b * q_len + 3, hq, d)
        table = torch.zeros(b, w, dtype=torch.int32, device="cuda")
        table[:, :min(w, big.shape[1])] = big[:b, :w]
        pre.paged_prefill_attention(q, case.k_cache, case.v_cache, table, qsl, case.seq_lens[:b], q_len,
                                    case.scale, window=window)

    decode(2, 10, 1)
    decode(2, 10, 2)  # both store paths of the decode kernel (the split one merges in the kernel)
    prefill(2, 10, 30)
    kernels = (dec._paged_decode_kernel, pre._paged_prefill_kernel)
    before = [compiled_variants(k) for k in kernels]
    for b, w, splits, window in ((1, 7, 1, None), (8, 16, 3, 50), (5, 33, 1, 1), (3, 64, 16, 17), (7, 9, None, None)):
        decode(b, w, splits, window)
    for b, w, q_len, window in ((1, 7, 100, None), (8, 16, 64, 16), (5, 33, 1, 1), (3, 11, 77, None)):
        prefill(b, w, q_len, window)
    torch.cuda.synchronize()
    assert [compiled_variants(k) for k in kernels] == before


@pytest.mark.gpu
def test_gpu_benchmark_runs(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import paged_attention

    assert paged_attention.main(["--batches", "4", "--contexts", "2048", "--prefill", "2", "256",
                                 "--out", str(tmp_path)]) == 0
    assert math.isfinite(json.loads((tmp_path / "paged_attention.json").read_text())["decode"][0]
                         ["triton_frac"])


@pytest.mark.gpu
def test_gpu_split_decode_merges_the_same_result_every_launch():
    """The last of a sequence's split programs merges the partials (an acq_rel counter publishes
    them): whichever program that is, the merge reads every split in the same order, so 200 launches
    give bit-identical outputs. A merge that read a partial before it was written would not."""
    seq_lens = [3000, 1, 700, 4096]
    case = gpu_case(seq_lens, 32, 8, 128, 16, seed=91)
    q = gpu_randn(case, len(seq_lens), 32, 128)
    k32, v32 = case.float_caches()
    first = dec.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                                       num_splits=48)
    expected = ref.paged_decode_attention(q.float(), k32, v32, case.block_tables, case.seq_lens, case.scale)
    assert rel_err(first, expected) < 1e-2
    for _ in range(200):
        out = dec.paged_decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                         case.scale, num_splits=48)
        assert torch.equal(out, first)
