"""Phase 7: prefix caching.

The reference for every engine test is the same engine with ``prefix_caching`` off (which the
earlier phases test against HF transformers): greedy tokens, their logprobs, seeded samples and
prompt logprobs must be the same (fp32, 1e-4) whether a prefix hit or not. The pool tests check
the data structure against hand-computed keys and a hand-written eviction order, and the pool's
invariants (every block exactly one of in use / cached free / free; no block a running sequence
holds is ever free or evicted) after every step of every engine test.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import struct

import pytest
import torch

from infer.config import EngineConfig
from infer.engine.kv_cache_manager import KVCacheManager
from infer.engine.prefix_cache import NONE_HASH, PrefixCachingBlockPool, block_hashes, hash_block_tokens
from infer.engine.sequence import Request, Sequence
from infer.sampling import SamplingParams
from tests.test_batching import make_engine
from tests.test_chunked_prefill import assert_same, run

BS = 4  # tokens per block in the engine tests: prompts of a few blocks stay tiny
KW = dict(kv_cache="paged", block_size=BS, batching="continuous", max_model_len=96, max_num_seqs=6)
GREEDY = dict(temperature=0.0, ignore_eos=True, logprobs=2)


def sha(parent: bytes, tokens: list[int]) -> bytes:
    """The key by hand: SHA-256 of the parent key and the tokens as little-endian int64."""
    return hashlib.sha256(parent + b"".join(struct.pack("<q", t) for t in tokens)).digest()


# ---------------------------------------------------------------------------- the data structure


def test_block_keys_are_chained_sha256_of_full_blocks():
    toks = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    k0 = sha(bytes(32), [5, 6, 7, 8])
    k1 = sha(k0, [9, 10, 11, 12])
    assert NONE_HASH == bytes(32) and hash_block_tokens(NONE_HASH, [5, 6, 7, 8]) == k0
    assert block_hashes(toks, 4) == [k0, k1]  # the partly filled third block has no key
    assert block_hashes(toks[:3], 4) == []
    # the same block after a different first block has a different key: a key names its whole prefix
    other = block_hashes([1, 2, 3, 4, 9, 10, 11, 12], 4)
    assert other[1] != k1 and other[1] == sha(sha(bytes(32), [1, 2, 3, 4]), [9, 10, 11, 12])
    # extending a known chain gives the keys computed at once
    grown = toks + [14, 15, 16, 17]
    assert block_hashes(grown, 4, known=block_hashes(toks, 4)) == block_hashes(grown, 4)
    assert block_hashes(grown, 4, known=[k0]) == block_hashes(grown, 4)
    # the known keys are taken as given (not hashed again) and the chain goes on from the last of them
    mark = bytes(range(32))
    assert block_hashes(grown, 4, known=[mark]) == [mark, sha(mark, [9, 10, 11, 12]),
                                                     sha(sha(mark, [9, 10, 11, 12]), [13, 14, 15, 16])]
    # extra keys (an adapter, say) change every key
    assert block_hashes(toks, 4, extra_keys=("lora-a",))[0] != k0


def _manager(num_blocks=8, bs=4) -> KVCacheManager:
    return KVCacheManager(num_blocks, bs, prefix_caching=True)


def _seq(tokens: list[int], **params) -> Sequence:
    req = Request("r", None, list(tokens), SamplingParams(**params))
    seq = Sequence(0, req, 0, list(tokens), 0, None, num_prompt_tokens=len(tokens))
    req.seqs.append(seq)
    return seq


def _compute(kv: KVCacheManager, seq: Sequence) -> None:
    """Admit ``seq`` and mark all its tokens computed (what a prefill does to the pool)."""
    kv.admit(seq.request)
    seq.num_computed_tokens = len(seq.token_ids)


def test_lookup_walks_to_the_first_miss_and_keeps_the_last_token():
    kv = _manager()
    a = _seq(list(range(10, 22)))  # 3 full blocks
    _compute(kv, a)
    blocks = list(a.block_table)
    kv.free(a)
    pool = kv.pool
    assert pool.num_cached_free == 3 and pool.num_free == 8
    # the same prompt: the last token is recomputed, so only 2 of its 3 blocks are taken
    hit = kv.find_cached_prefix(_seq(list(range(10, 22))))
    assert hit == blocks[:2]
    # one more token: all 3 blocks
    assert kv.find_cached_prefix(_seq(list(range(10, 23)))) == blocks
    # diverging inside block 1 (a hit that ends mid-block): block 0 only, nothing after the miss
    assert kv.find_cached_prefix(_seq([10, 11, 12, 13, 14, 99, 16, 17, 18, 19, 20, 21, 22])) == hit[:1]
    # block 1 differs but block 2 has the cached tokens: its key differs, so no hit past the miss
    assert len(kv.find_cached_prefix(_seq([10, 11, 12, 13, 99, 99, 99, 99, 18, 19, 20, 21, 0]))) == 1
    assert kv.find_cached_prefix(_seq([1, 2, 3, 4, 5])) == []
    assert kv.find_cached_prefix(_seq(list(range(10, 23)), prompt_logprobs=1)) == []  # bypass
    pool.check_invariants()


def test_lookup_stops_at_a_miss_even_when_later_blocks_are_cached():
    """Block 1 of a cached prefix is evicted while block 2 stays: block 2's K/V was computed
    after block 1's tokens, but a sequence that misses block 1 recomputes it into another block,
    so only block 0 is a usable hit."""
    kv = _manager(num_blocks=8)
    a = _seq(list(range(10, 23)))
    _compute(kv, a)
    b0, b1, b2, _ = a.block_table
    kv.free(a)  # LRU order: b2, b1, b0 (tail first)
    kv.pool.touch([b2])
    kv.pool.free([b2])  # b2 used again: now b1, b0, b2
    taken = kv.pool.allocate(kv.pool.num_free - 2)  # every plain block, then evicts b1 only
    assert b1 in taken and kv.pool.cached_free.keys() == {b0, b2}
    assert kv.find_cached_prefix(_seq(list(range(10, 23)))) == [b0]
    kv.pool.free(taken)
    kv.pool.check_invariants()


def test_lookup_compares_each_blocks_tokens_not_only_its_key():
    """Block 1's key maps to a block holding other tokens (a hash collision, planted): the lookup
    stops there, taking block 0 only, although block 2's key and tokens are cached."""
    kv = _manager(num_blocks=8)
    tokens = list(range(10, 23))  # 3 full blocks and a last token
    keys = block_hashes(tokens, 4)
    blocks = kv.pool.allocate(3)
    for i, (b, k) in enumerate(zip(blocks, keys)):
        assert kv.pool.cache_block(b, k, [0, 0, 0, 0] if i == 1 else tokens[4 * i : 4 * i + 4])
    kv.pool.free(blocks)
    assert kv.find_cached_prefix(_seq(tokens)) == blocks[:1]
    kv.pool.check_invariants()


def test_lookup_covers_the_generated_tokens_too():
    """A sequence readmitted after a preemption (5 prompt tokens, 8 generated) finds the blocks of its
    generated tokens too: the lookup walks all of its tokens (but the last), not only its prompt."""
    kv = _manager(num_blocks=8)
    a = _seq(list(range(10, 23)))
    _compute(kv, a)
    blocks = list(a.block_table)
    kv.free(a)
    req = Request("p", None, list(range(10, 15)), SamplingParams())
    back = Sequence(0, req, 0, list(range(10, 23)), 0, None, num_prompt_tokens=5)
    req.seqs.append(back)
    assert back.num_output_tokens == 8
    assert kv.find_cached_prefix(back) == blocks[:3]
    kv.pool.check_invariants()


def test_a_kept_lookup_is_redone_after_an_eviction_or_a_new_key():
    """Admission asks for a request's hits three times and the manager keeps the last answer;
    it must not outlive a change of the pool's keys: an eviction (a hit that vanished) or a
    newly cached block (a hit that appeared)."""
    kv = _manager(num_blocks=8)
    a = _seq(list(range(10, 23)))
    _compute(kv, a)
    blocks = list(a.block_table)
    kv.free(a)
    b = _seq(list(range(10, 23)))
    first = kv._prefix_hits(b.request)
    assert first == [blocks[:3]] and kv._prefix_hits(b.request) is first  # kept
    taken = kv.pool.allocate(kv.pool.num_free)  # evicts every cached block
    assert kv._prefix_hits(b.request) == [[]]
    assert kv.blocks_to_admit(b.request) == 4  # nothing hit: all 4 blocks are taken anew
    kv.pool.free(taken)
    c = _seq(list(range(10, 23)))
    _compute(kv, c)
    kv.cache_blocks(c)
    blocks = list(c.block_table)
    kv.free(c)
    assert kv._prefix_hits(b.request) == [blocks[:3]]  # the new keys are found
    kv.pool.check_invariants()


def test_a_colliding_key_is_caught_by_the_token_check():
    pool = PrefixCachingBlockPool(4)
    [b] = pool.allocate(1)
    key = hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert pool.cache_block(b, key, [1, 2, 3, 4])
    assert pool.lookup(key, [1, 2, 3, 4]) == b
    assert pool.lookup(key, [1, 2, 3, 5]) is None  # same key, other tokens: a miss
    # a second block with the same key is not cached (the first stays)
    [c] = pool.allocate(1)
    assert not pool.cache_block(c, key, [1, 2, 3, 4]) and pool.block_hash[c] is None
    pool.free([b, c])
    assert pool.num_cached_free == 1 and c in pool.free_blocks
    pool.check_invariants()


def _cached_blocks(pool: PrefixCachingBlockPool, blocks: list[int], first_token: int) -> list[bytes]:
    keys = block_hashes([first_token + i for i in range(4 * len(blocks))], 4)
    for i, (b, k) in enumerate(zip(blocks, keys)):
        assert pool.cache_block(b, k, [first_token + 4 * i + j for j in range(4)])
    return keys


def test_eviction_is_lru_tail_first_and_reports_intact_blocks():
    pool = PrefixCachingBlockPool(8)
    a, b = pool.allocate(3), pool.allocate(3)  # blocks 0-2 and 3-5; 6 and 7 stay never-used
    ka, kb = _cached_blocks(pool, a, 100), _cached_blocks(pool, b, 200)
    seen = []

    def on_evict(key, block, tokens):  # called before the block is reused: key and tokens intact
        assert pool.cached[key] == block and pool.block_tokens[block] == tokens and pool.ref_counts[block] == 0
        seen.append((key, block, tokens))

    pool.on_evict = on_evict
    pool.free(a)  # a's blocks are least recently used: its tail first
    pool.free(b)
    pool.check_invariants()
    assert pool.allocate(2) == [6, 7] and seen == []  # never-cached blocks go first: nothing evicted
    got = pool.allocate(4)
    assert got == [a[2], a[1], a[0], b[2]]
    assert [s[1] for s in seen] == got and seen[0] == (ka[2], a[2], (108, 109, 110, 111))
    assert pool.lookup(ka[0], [100, 101, 102, 103]) is None  # an evicted key is gone
    assert pool.lookup(kb[1], [204, 205, 206, 207]) == b[1] and pool.num_evictions == 4
    # a hit takes a cached free block back: it is not evicted while held
    pool.touch([b[0], b[1]])
    assert pool.ref_counts[b[0]] == 1 and pool.num_free == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free([b[0], b[1]])  # last-first: b[1] is now the least recently freed
    pool.check_invariants()
    pool.on_evict = None  # no hook set: the eviction just happens
    assert pool.allocate(1) == [b[1]] and pool.num_evictions == 5
    assert pool.lookup(kb[1], [204, 205, 206, 207]) is None
    pool.free([b[1]])  # no key any more: a plain free block
    pool.check_invariants()
    assert pool.reset() == 1 and pool.cached == {} and pool.num_cached_free == 0
    pool.check_invariants()


def test_pool_random_walk_keeps_its_invariants():
    """Random admissions of shared prefixes, growth, frees and resets over a small manager."""
    rng = random.Random(0)
    kv = _manager(num_blocks=12)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 10]))] for _ in range(4)]
    live: list[Sequence] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            seq = _seq(rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))])
            if kv.can_admit(seq.request):
                hit = kv.find_cached_prefix(seq)
                kv.admit(seq.request)
                assert seq.block_table[: len(hit)] == hit and seq.num_computed_tokens == 4 * len(hit)
                seq.num_computed_tokens = len(seq.token_ids)
                live.append(seq)
        elif op < 0.75 and live:
            seq = rng.choice(live)
            seq.token_ids.append(rng.randrange(50))
            if kv.allocate_slots(seq, 1):
                seq.num_computed_tokens += 1
            else:
                seq.token_ids.pop()
        elif op < 0.98 and live:
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            kv.reset_prefix_cache()
        kv.pool.check_invariants()
        held = [0] * 12
        for s in live:
            for b in s.block_table:
                held[b] += 1
        assert kv.pool.ref_counts == held
    assert kv.prefix_cache_hits > 0 and kv.pool.num_evictions > 0


# ---------------------------------------------------------------------------- the engine


def assert_prefix_pool_consistent(engine) -> None:
    """The caching pool's invariants, and: each block's count is the number of running block
    tables holding it, so no block a running sequence holds is free, cached free or evictable."""
    pool = engine.kv_manager.pool
    pool.check_invariants()
    held = [0] * pool.num_blocks
    for seq in engine.scheduler.running:
        for b in seq.block_table:
            held[b] += 1
    for req in engine.scheduler.waiting:
        assert all(not s.block_table for s in req.seqs), "a waiting request holds blocks"
    assert pool.ref_counts == held


def assert_drained(engine) -> None:
    pool = engine.kv_manager.pool
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert not any(pool.ref_counts) and pool.num_free == pool.num_blocks
    pool.check_invariants()


def run_logprobs(engine, arrivals, check=assert_prefix_pool_consistent) -> dict:
    """:func:`~tests.test_chunked_prefill.run` (tokens, logprobs, cached tokens), checking the
    prefix pool's invariants after every step by default."""
    return run(engine, arrivals, check=check, max_steps=3000)


def shared_prefix_workload(vocab: int, num_prefixes: int, min_prefix: int, num_requests: int, horizon: int,
                           seed: int = 11) -> tuple[list, dict[str, int]]:
    """``(arrivals, aborts)`` for the stress tests: prompts over ``num_prefixes`` random shared
    prefixes (``min_prefix``-19 tokens) plus 1-7 tokens of their own, arriving at random steps
    in ``[0, horizon)`` with random lengths, ``n`` and temperatures (seeded); 4 of them aborted at
    a random step."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(rng.randrange(min_prefix, 20))] for _ in range(num_prefixes)]
    arrivals = []
    for i in range(num_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(10, vocab) for _ in range(rng.randrange(1, 8))]
        params = SamplingParams(max_tokens=rng.randrange(2, 14), n=rng.choice([1, 1, 2]), seed=i,
                                temperature=rng.choice([0.0, 1.0]), ignore_eos=True)
        arrivals.append((rng.randrange(0, horizon), prompt, params))
    aborts = {f"r{i}": rng.randrange(0, horizon) for i in rng.sample(range(num_requests), 4)}
    return arrivals, aborts


def run_with_aborts(engine, arrivals, aborts: dict[str, int], invariant=None) -> dict:
    """:func:`run_logprobs`, aborting request ``rid`` after step ``aborts[rid]`` and checking
    ``invariant(engine)`` (when given) after every step."""
    step = 0

    def check(eng):
        nonlocal step
        step += 1
        for rid, at in aborts.items():
            if at == step:
                eng.abort_request(rid)
        if invariant is not None:
            invariant(eng)

    return run_logprobs(engine, arrivals, check=check)


def assert_same_logprobs(got: dict, ref: dict) -> None:
    assert_same(got, ref)
    for rid in ref:
        for g, r in zip(got[rid]["logprobs"], ref[rid]["logprobs"]):
            assert (g is None) == (r is None) and (r is None or g == pytest.approx(r, abs=1e-4)), rid


def scenario(vocab: int):
    """Arrivals, spaced so that each finds the blocks of the ones before it freed and kept."""
    rng = random.Random(7)
    sys_prompt = [rng.randrange(10, vocab) for _ in range(22)]  # 5 full blocks and 2 tokens
    tail = [rng.randrange(10, vocab) for _ in range(5)]
    seeded = dict(temperature=1.0, top_p=0.9, seed=123, ignore_eos=True, logprobs=1)
    return [
        (0, sys_prompt + tail, SamplingParams(max_tokens=5, **GREEDY)),                     # r0: cold
        (10, sys_prompt + tail, SamplingParams(max_tokens=5, **GREEDY)),                    # r1: full-prompt hit
        (20, sys_prompt[:20], SamplingParams(max_tokens=5, **GREEDY)),                      # r2: prompt = 5 blocks
        (30, sys_prompt + [3, 4, 5], SamplingParams(max_tokens=5, **GREEDY)),               # r3: hit ends mid-block
        (40, sys_prompt + tail, SamplingParams(max_tokens=6, n=2, **seeded)),               # r4: n = 2, seeded
        (50, sys_prompt + tail, SamplingParams(max_tokens=4, prompt_logprobs=2, **GREEDY)),  # r5: bypass
        (60, [rng.randrange(10, vocab) for _ in range(9)], SamplingParams(max_tokens=4, **GREEDY)),  # r6: miss
    ]


@pytest.fixture(scope="module")
def cache_off(tiny_llama):
    return run_logprobs(make_engine(tiny_llama, **KW), scenario(tiny_llama.config.vocab_size), check=None)


@pytest.mark.parametrize("variant", ["plain", "chunked", "async"])
def test_outputs_identical_with_the_cache(tiny_llama, cache_off, variant):
    extra = {"chunked": dict(chunked_prefill=True, max_num_batched_tokens=7),
             "async": dict(async_scheduling=True)}.get(variant, {})
    eng = make_engine(tiny_llama, prefix_caching=True, **KW, **extra)
    got = run_logprobs(eng, scenario(tiny_llama.config.vocab_size))
    assert_same_logprobs(got, cache_off)
    cached = {rid: got[rid]["cached"] for rid in got}
    # r0 cold; r1 the whole prompt but its last block (27 tokens: 6 blocks, the 7th holds the last token);
    # r2 (20 tokens) all blocks but the last; r3 the 5 shared blocks; r5 bypasses (prompt logprobs)
    assert cached == {"r0": 0, "r1": 24, "r2": 16, "r3": 20, "r4": 24, "r5": None, "r6": 0}
    st = eng.stats()
    assert st["prefix_cache_hits"] == 24 + 16 + 20 + 24 and st["prefix_cache_queries"] == 27 * 3 + 20 + 25 + 9
    assert st["num_prefill_tokens"] < 27 * 4 + 20 + 25 + 9
    assert_drained(eng)


def test_hits_with_the_triton_backend(tiny_llama, cache_off):
    """The Triton prefill/extend kernel (interpreted on the CPU) attends over hit blocks it did
    not write in this request: a full-prompt hit and a hit ending mid-block."""
    arrivals = [scenario(tiny_llama.config.vocab_size)[i] for i in (0, 1, 3)]
    eng = make_engine(tiny_llama, prefix_caching=True, attention_backend="triton", **KW)
    got = run_logprobs(eng, arrivals)
    assert got["r1"]["cached"] == 24 and got["r2"]["cached"] == 20
    assert_same_logprobs({"r0": got["r0"], "r1": got["r1"], "r3": got["r2"]},
                         {k: cache_off[k] for k in ("r0", "r1", "r3")})
    assert_drained(eng)


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [{}, {"cuda_graphs": True, "async_scheduling": True, "chunked_prefill": True,
                                        "max_num_batched_tokens": 16}])
def test_outputs_identical_with_the_cache_on_gpu(tiny_llama, extra):
    """float32 on the GPU (Triton attention; CUDA graphs, async scheduling and chunked prefill in the
    second case): the scenario's tokens and logprobs with the cache equal those without it."""
    from infer.engine import LLMEngine
    from infer.loader import load_model

    loaded = load_model(str(tiny_llama.path), device="cuda", dtype=torch.float32, progress=False)

    def engine(**kw):
        return LLMEngine(EngineConfig(model=str(loaded.path), device="cuda", dtype="float32", **KW, **extra, **kw),
                         loaded=loaded, progress=False)

    arrivals = scenario(loaded.config.vocab_size)
    ref = run_logprobs(engine(), arrivals, check=None)
    eng = engine(prefix_caching=True)
    got = run_logprobs(eng, arrivals)
    assert_same_logprobs(got, ref)
    assert got["r1"]["cached"] == 24 and got["r3"]["cached"] == 20
    assert_drained(eng)


def test_a_seed_gives_the_same_tokens_hit_or_miss(tiny_llama):
    vocab = tiny_llama.config.vocab_size
    prompt = [(13 * i + 5) % vocab for i in range(30)]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=99, n=3, ignore_eos=True)
    eng = make_engine(tiny_llama, prefix_caching=True, **KW)
    got = run_logprobs(eng, [(0, prompt, params), (10, prompt, params), (20, prompt[:13], params)])
    assert got["r0"]["cached"] == 0 and got["r1"]["cached"] == 28 and got["r2"]["cached"] == 12
    assert got["r1"]["tokens"] == got["r0"]["tokens"]
    short = run_logprobs(make_engine(tiny_llama, **KW), [(0, prompt[:13], params)], check=None)
    assert got["r2"]["tokens"] == short["r0"]["tokens"]
    assert_drained(eng)


def eviction_arrivals(vocab: int, short_len: int = 0) -> tuple[list[int], list]:
    """``(first, arrivals)``: a 17-token prompt twice, then two 33-token prompts that (in a
    12-block cache of 48-token sequences) evict its blocks, then the first prompt again; with
    ``short_len``, an unrelated ``short_len``-token request (8 tokens) arrives just before it."""
    rng = random.Random(1)
    first = [rng.randrange(10, vocab) for _ in range(17)]
    others = [[rng.randrange(10, vocab) for _ in range(33)] for _ in range(2)]
    g = SamplingParams(max_tokens=3, **GREEDY)
    arrivals = [(0, first, g), (10, first, g), (20, others[0], g), (30, others[1], g)]
    if short_len:
        short = [rng.randrange(10, vocab) for _ in range(short_len)]
        arrivals.append((38, short, SamplingParams(max_tokens=8, **GREEDY)))
    return first, arrivals + [(40, first, g)]


def test_a_miss_after_eviction(tiny_llama):
    """A cache of 12 blocks: other prompts evict the first prompt's blocks, which then misses."""
    first, arrivals = eviction_arrivals(tiny_llama.config.vocab_size)
    cfg = tiny_llama.config
    mem = 12 * BS * cfg.kv_bytes_per_token(torch.float32)
    eng = make_engine(tiny_llama, prefix_caching=True, kv_cache_memory_bytes=mem, **{**KW, "max_model_len": 48})
    evicted = []
    eng.kv_manager.pool.on_evict = lambda key, block, tokens: evicted.append(tokens)
    got = run_logprobs(eng, arrivals)
    ref = run_logprobs(make_engine(tiny_llama, kv_cache_memory_bytes=mem, **{**KW, "max_model_len": 48}), arrivals,
                       check=None)
    assert_same_logprobs(got, ref)
    assert got["r1"]["cached"] == 16 and got["r4"]["cached"] == 0
    assert tuple(first[:4]) in evicted
    assert_drained(eng)


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_preempted_requests_hit_their_own_blocks(tiny_llama, policy):
    """A pool too small for every sequence at its longest: requests are preempted and, readmitted,
    find the blocks they had computed (and, after generating, their prompt and output blocks)."""
    rng = random.Random(3)
    vocab = tiny_llama.config.vocab_size
    shared = [rng.randrange(10, vocab) for _ in range(8)]
    arrivals = [(0, shared + [rng.randrange(10, vocab) for _ in range(rng.randrange(1, 6))],
                 SamplingParams(max_tokens=24, n=1 + i % 2, seed=i, temperature=0.0 if i % 2 else 0.8,
                                ignore_eos=True)) for i in range(4)]
    mem = 22 * BS * tiny_llama.config.kv_bytes_per_token(torch.float32)
    kw = {**KW, "max_model_len": 40, "batching": policy, "kv_cache_memory_bytes": mem}
    ref = run_logprobs(make_engine(tiny_llama, **kw), arrivals, check=None)
    eng = make_engine(tiny_llama, prefix_caching=True, **kw)
    readmitted_hits = []
    real_admit = eng.kv_manager.admit

    def admit(request):
        real_admit(request)
        if any(s.num_output_tokens for s in request.seqs):  # back after a preemption
            readmitted_hits.append(sum(s.num_computed_tokens for s in request.unfinished_seqs))

    eng.kv_manager.admit = admit
    got = run_logprobs(eng, arrivals)
    assert_same_logprobs(got, ref)
    assert eng.num_preemptions > 0 and readmitted_hits and max(readmitted_hits) > 0, readmitted_hits
    assert_drained(eng)


def test_stress_shared_prefixes_aborts_and_preemptions(tiny_llama):
    """Random prompts over a few shared prefixes, random aborts, a pool that forces preemptions and
    evictions, chunked prefill: the invariants hold after every step, every request that was not
    aborted gets the tokens of the engine without the cache, and nothing leaks."""
    arrivals, aborts = shared_prefix_workload(tiny_llama.config.vocab_size, 3, 4, 14, 40)
    mem = 20 * BS * tiny_llama.config.kv_bytes_per_token(torch.float32)
    kw = {**KW, "max_model_len": 40, "kv_cache_memory_bytes": mem, "chunked_prefill": True,
          "max_num_batched_tokens": 12}
    results = {}
    for pc in (False, True):
        eng = make_engine(tiny_llama, prefix_caching=pc, **kw)
        results[pc] = run_with_aborts(eng, arrivals, aborts, assert_prefix_pool_consistent if pc else None)
        if pc:
            assert_drained(eng)
            assert eng.stats()["prefix_cache_hits"] > 0 and eng.num_preemptions > 0
            assert eng.kv_manager.pool.num_evictions > 0
    done = results[False].keys() & results[True].keys() - set(aborts)
    assert len(done) >= 8
    for rid in done:
        assert results[True][rid]["tokens"] == results[False][rid]["tokens"], rid


def test_config_and_reset(tiny_llama):
    with pytest.raises(ValueError, match="prefix_caching needs kv_cache='paged'"):
        EngineConfig(prefix_caching=True).validate()
    EngineConfig(prefix_caching=True, kv_cache="paged").validate()
    assert EngineConfig.ablation_values()["prefix_caching"] == (False, True)
    eng = make_engine(tiny_llama, prefix_caching=True, **KW)
    prompt = list(range(10, 30))
    g = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run_logprobs(eng, [(0, prompt, g)])
    assert eng.reset_prefix_cache() == 5 and eng.kv_manager.pool.cached == {}
    got = run_logprobs(eng, [(0, prompt, g)])
    assert got["r0"]["cached"] == 0  # nothing left to hit
    off = make_engine(tiny_llama, **KW)
    assert off.reset_prefix_cache() == 0 and "prefix_cache_hits" not in off.stats()


def test_server_metrics_usage_and_reset(tiny_llama):
    """In-process server: ``usage.prompt_tokens_details.cached_tokens``, the ``/metrics`` counters and
    ``POST /reset_prefix_cache``."""
    import httpx

    from infer.engine import LLMEngine
    from infer.server.app import build_app
    from infer.server.async_engine import AsyncEngine
    from tests.server_fixture import metric_value

    cfg = EngineConfig(model=str(tiny_llama.path), device="cpu", dtype="float32", prefix_caching=True, **KW)
    eng = AsyncEngine(lambda: LLMEngine(cfg, loaded=tiny_llama, progress=False))
    app = build_app(eng, "tiny")
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks, 20 tokens can hit

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            u1 = (await c.post("/v1/completions", json=body)).json()["usage"]
            u2 = (await c.post("/v1/completions", json=body)).json()["usage"]
            text = (await c.get("/metrics")).text
            reset = await c.post("/reset_prefix_cache")
            u3 = (await c.post("/v1/completions", json=body)).json()["usage"]
            return u1, u2, text, reset, u3

    try:
        u1, u2, text, reset, u3 = asyncio.run(go())
    finally:
        eng.shutdown()
    assert u1["prompt_tokens_details"] == {"cached_tokens": 0} and u1["prompt_tokens"] == 21
    assert u2["prompt_tokens_details"] == {"cached_tokens": 20}
    assert metric_value(text, "infer:prefix_cache_queries_total") == 42
    assert metric_value(text, "infer:prefix_cache_hits_total") == 20
    assert reset.status_code == 200 and reset.json() == {"prefix_caching": True, "num_blocks_dropped": 5}
    assert u3["prompt_tokens_details"] == {"cached_tokens": 0}


# ---------------------------------------------------------------------------------- the benchmarks


def test_prefix_caching_benchmark_end_to_end(tiny_llama, tmp_path):
    """benchmarks/prefix_caching.py at tiny sizes: the warm request hits, multi-turn turns hit
    their history, nothing leaks between workloads, the report and the plot are written."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import prefix_caching as bench

    out = tmp_path / "pc.json"
    rc = bench.main(["--model", str(tiny_llama.path), "--device", "cpu", "--max-model-len", "128", "--prefix-lens",
                     "32", "--repeats", "1", "--workload-prefix-len", "24", "--num-requests", "4", "--turns", "2",
                     "--output-len", "3", "--suffix-len", "5", "--out", str(out), "--plot", str(tmp_path / "pc.png")])
    assert rc == 0 and (tmp_path / "pc.png").exists()
    rep = json.loads(out.read_text())
    assert rep["ttft"][0]["prefix_len"] == 32 and rep["ttft"][0]["ttft_warm_ms"] > 0
    rows = {(r["workload"], r["prefix_caching"]): r for r in rep["serving"]}
    assert rows["multi-turn", True]["prefix_hit_rate"] > 0 and rows["multi-turn", False]["prefix_hit_rate"] == 0
    assert rows["multi-turn", True]["prefill_tokens_run"] < rows["multi-turn", False]["prefill_tokens_run"]
    assert rows["random", True]["prefix_hit_rate"] == 0


def test_serve_bench_multi_turn_requests():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from serve_bench import build_parser, request_body
    from workloads import build_requests

    reqs = build_requests("multi-turn", 2, 5, 3, seed=0, prefix_len=4, turns=3)
    assert [(r.extra["conversation"], r.extra["turn"]) for r in reqs] == [(c, t) for c in range(2) for t in range(3)]
    system = reqs[0].prompt.split()[:4]
    assert reqs[3].prompt.split()[:4] == system and len(reqs[1].prompt.split()) == 5  # later turns: new words only

    args = build_parser().parse_args(["--endpoint", "chat"])  # the program's own defaults

    _, body = request_body(reqs[2], args, "m", [(reqs[0].prompt, "a0"), (reqs[1].prompt, "a1")])
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert body["messages"][3]["content"] == "a1" and body["messages"][4]["content"] == reqs[2].prompt
    args.endpoint = "completions"
    _, body = request_body(reqs[1], args, "m", [(reqs[0].prompt, "a0")])
    assert body["prompt"] == reqs[0].prompt + "a0 " + reqs[1].prompt
    with pytest.raises(ValueError, match="text prompts"):
        build_requests("multi-turn", 1, 5, 3, seed=0, token_prompts=True)
