"""Phase 5: the block pool, block tables, slot mapping, preemption and the paged engine.

The kernels themselves are tested against their references in tests/test_kernels.py; batch
invariance and the preemption stress test with real weights are in tests/test_batching.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer.attention import KVCache
from infer.config import EngineConfig
from infer.engine import LLMEngine
from infer.engine.block_pool import BlockPool
from infer.engine.kv_cache_manager import KVCacheManager
from infer.engine.sequence import Request, Sequence
from infer.errors import InvalidRequestError
from infer.sampling import SamplingParams
from tests.test_batching import assert_pool_full, drive, make_engine, mixed_workload

# ---------------------------------------------------------------------------- the block pool


def test_block_pool_hands_out_lowest_first_and_counts_holders():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 3
    pool.share(a[:2])
    assert pool.ref_counts[:3] == [2, 2, 1]
    pool.free(a)  # one holder of each leaves: only block 2 is free again
    assert pool.num_free == 4 and pool.ref_counts[:3] == [1, 1, 0]
    assert pool.allocate(1) == [2]  # the lowest free id
    pool.free([0, 1, 2])
    assert sorted(pool.free_blocks) == list(range(6)) and pool.ref_counts == [0] * 6


def test_block_pool_rejects_misuse():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="asked for 3"):
        pool.allocate(3)
    assert pool.num_free == 2  # nothing taken
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([1])
    with pytest.raises(RuntimeError, match="cannot be shared"):
        pool.share([0])
    with pytest.raises(ValueError):
        BlockPool(0)


def test_block_pool_random_walk_keeps_its_invariants():
    """Random allocate/share/free against a dictionary model of who holds what."""
    rng = random.Random(0)
    pool = BlockPool(32)
    holders: list[list[int]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            holders.append(pool.allocate(rng.randint(1, pool.num_free)))
        elif op < 0.6 and holders:
            blocks = rng.choice(holders)
            pool.share(blocks)
            holders.append(list(blocks))
        elif holders:
            pool.free(holders.pop(rng.randrange(len(holders))))
        expect = [0] * 32
        for h in holders:
            for b in h:
                expect[b] += 1
        assert pool.ref_counts == expect
        assert sorted(pool.free_blocks) == [b for b in range(32) if expect[b] == 0]


# ---------------------------------------------------------------------------- block tables


def _request(prompt_len: int, n: int = 1) -> Request:
    req = Request("r", None, list(range(prompt_len)), SamplingParams(n=n))
    for i in range(n):
        req.seqs.append(Sequence(i, req, i, list(range(prompt_len)), 0, None, num_prompt_tokens=prompt_len))
    return req


def test_forks_share_full_blocks_and_own_a_copy_of_the_last():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    req = _request(10, n=3)  # 2 full blocks + 2 tokens in a third
    assert kv.blocks_to_admit(req) == 3 + 2
    kv.admit(req)
    s0, s1, s2 = req.seqs
    assert s1.block_table[:2] == s0.block_table[:2] == s2.block_table[:2]
    assert len({s0.block_table[2], s1.block_table[2], s2.block_table[2]}) == 3
    assert [kv.pool.ref_counts[b] for b in s0.block_table] == [3, 3, 1]
    assert kv.num_free_blocks == 15
    for s in req.seqs:
        kv.free(s)
    assert kv.num_free_blocks == 20 and set(kv.pool.ref_counts) == {0}
    # a prompt that ends on a block boundary: the forks own nothing until they write
    req = _request(8, n=2)
    assert kv.blocks_to_admit(req) == 2
    kv.admit(req)
    assert req.seqs[0].block_table == req.seqs[1].block_table


def test_allocate_slots_grows_at_block_boundaries_and_refuses_when_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    req = _request(4)
    kv.admit(req)
    seq = req.seqs[0]
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    seq.token_ids.append(7)
    assert kv.allocate_slots(seq, 1) and len(seq.block_table) == 2  # position 4 opens block 2
    seq.num_computed_tokens = 5
    assert kv.allocate_slots(seq, 1) and len(seq.block_table) == 2  # position 5 fits
    assert not kv.allocate_slots(seq, 8) and len(seq.block_table) == 2  # 13 tokens > 3 blocks: nothing taken
    assert kv.allocate_slots(seq, 7) and len(seq.block_table) == 3


def test_slot_mapping_walks_the_block_table():
    cache = KVCache(1, 8, 4, 1, 2, torch.float32, "cpu")
    tables = [[5, 1, 7], [2]]
    # by hand: seq 0 positions 3..9 -> (5,3) (1,0..3) (7,0..1); seq 1 positions 0..2 -> (2,0..2)
    expect = [23, 4, 5, 6, 7, 28, 29, 8, 9, 10]
    assert cache.slot_mapping(tables, [3, 0], [7, 3]) == expect


def test_reading_a_paged_sequence_gathers_its_blocks():
    g = torch.Generator().manual_seed(0)
    cache = KVCache(2, 6, 3, 2, 4, torch.float32, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    k, v = cache.read(1, [4, 0, 2], 7)
    flat_k = cache.k[1].reshape(18, 2, 4)
    idx = [12, 13, 14, 0, 1, 2, 6]
    torch.testing.assert_close(k, flat_k[idx], rtol=0, atol=0)
    torch.testing.assert_close(v, cache.v[1].reshape(18, 2, 4)[idx], rtol=0, atol=0)


# ---------------------------------------------------------------------------- the engine


def paged_engine(loaded, **kw) -> LLMEngine:
    kw.setdefault("kv_cache", "paged")
    kw.setdefault("block_size", 4)
    return make_engine(loaded, **kw)


def test_paged_engine_matches_contiguous_with_forks_and_aborts(tiny_llama):
    """n > 1, aborts mid-run, block size 4 (many boundaries): the same tokens as the contiguous cache."""
    arrivals = mixed_workload(tiny_llama.config.vocab_size, 12, seed=5)
    arrivals.append((2, [11, 12, 13, 14, 15, 16, 17], SamplingParams(n=3, max_tokens=9, temperature=0.0)))
    arrivals.append((4, [21, 22, 23, 24, 25, 26, 27, 28], SamplingParams(n=2, max_tokens=6, temperature=0.8,
                                                                           seed=3)))
    ref = drive(make_engine(tiny_llama, batching="continuous", max_num_seqs=8), arrivals)
    eng = paged_engine(tiny_llama, batching="continuous", max_num_seqs=8)
    assert drive(eng, arrivals) == ref
    assert_pool_full(eng)
    # again, aborting the n=3 request (decoding, its prompt blocks shared by 3 sequences) and the
    # n=2 one (just admitted) after step 4: the others' tokens do not change, no block leaks
    steps = []

    def abort_two(e):
        steps.append(len(steps))
        if len(steps) == 5:
            assert e.abort_request("r12") and e.abort_request("r13")

    got = drive(eng, arrivals, abort_two)
    assert got.pop(12) is None and got.pop(13) is None
    assert got == {i: tokens for i, tokens in ref.items() if i not in (12, 13)}
    assert_pool_full(eng)


def test_preemption_frees_blocks_requeues_at_the_front_and_resumes(tiny_llama):
    cfg = tiny_llama.config
    eng = paged_engine(tiny_llama, batching="continuous", max_model_len=32, max_num_seqs=4,
                       kv_cache_memory_bytes=10 * 4 * cfg.kv_bytes_per_token(torch.float32))
    assert eng.kv_manager.num_blocks == 10
    p = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    alone = {}
    for rid, prompt in (("a", [5] * 10), ("b", [6] * 10)):
        solo = paged_engine(tiny_llama, max_model_len=32)
        alone[rid] = drive(solo, [(0, prompt, p)])[0]
    eng.add_request([5] * 10, p, request_id="a")
    eng.add_request([6] * 10, p, request_id="b")
    eng.step()  # both prefill: 3 + 3 blocks
    assert eng.kv_manager.num_free_blocks == 4
    preempted_at = None
    outputs = {}
    for step in range(60):
        for out in eng.step(stream=False):
            outputs[out.request_id] = [o.token_ids for o in out.outputs]
        if preempted_at is None and eng.num_preemptions:
            preempted_at = step
            # "b" (admitted last) gave its blocks back and waits at the front of the queue
            assert [r.request_id for r in eng.scheduler.waiting] == ["b"]
            assert all(not s.block_table and s.num_computed_tokens == 0 for s in eng.scheduler.waiting[0].seqs)
        if not eng.has_unfinished_requests():
            break
    assert preempted_at is not None
    assert outputs == alone
    assert_pool_full(eng)


def test_preemption_of_a_forked_request_after_its_first_sequence_was_scheduled(tiny_llama):
    """n = 2, and the pool runs dry between its two sequences: sequence 0 already got its block
    and sits in this step's batch when sequence 1 preempts their own request, so sequence 0 must
    leave the batch too (the caller's list, edited in place). Outputs equal each request alone."""
    cfg = tiny_llama.config
    # block size 4, 7 blocks. Step 1 prefills "a" (prompt 8: 2 blocks) and "b" (n=2, prompt 6: a
    # shared full block and a copy each of the last: 3 blocks); step 2 gives "a" its 3rd block; at
    # step 4 both of b's sequences reach position 8: sequence 0 takes the last free block and is
    # scheduled, sequence 1 finds none, and the newest request is b itself
    eng = paged_engine(tiny_llama, batching="continuous", max_model_len=24, max_num_seqs=4,
                       kv_cache_memory_bytes=7 * 4 * cfg.kv_bytes_per_token(torch.float32))
    pa = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    pb = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2)
    alone = [drive(paged_engine(tiny_llama, max_model_len=24), [(0, prompt, p)])[0]
             for prompt, p in (([5] * 8, pa), ([6] * 6, pb))]
    seen = []

    def check(engine):
        if engine.num_preemptions and not seen:
            seen.append([r.request_id for r in engine.scheduler.waiting])

    got = drive(eng, [(0, [5] * 8, pa), (0, [6] * 6, pb)], check=check)
    assert eng.num_preemptions >= 1 and seen == [["r1"]]
    assert [got[0], got[1]] == alone
    assert_pool_full(eng)


def test_prompt_logprobs_are_not_repeated_after_a_preemption(tiny_llama):
    cfg = tiny_llama.config
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    solo = paged_engine(tiny_llama, max_model_len=32)
    ref = solo.add_request([7] * 11, params, request_id="x")
    drive(solo, [])
    eng = paged_engine(tiny_llama, batching="continuous", max_model_len=32,
                       kv_cache_memory_bytes=10 * 4 * cfg.kv_bytes_per_token(torch.float32))
    eng.add_request([8] * 11, params, request_id="w")
    got = eng.add_request([7] * 11, params, request_id="x")
    drive(eng, [])
    assert eng.num_preemptions >= 1
    assert len(got.prompt_logprobs) == 11 and got.prompt_logprobs[0] is None
    for mine, theirs in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert mine.token.token_id == theirs.token.token_id
        assert mine.token.logprob == pytest.approx(theirs.token.logprob, abs=1e-5)


def test_requests_that_can_never_fit_the_cache_are_rejected(tiny_llama):
    cfg = tiny_llama.config
    eng = paged_engine(tiny_llama, max_model_len=32, max_num_seqs=4,
                       kv_cache_memory_bytes=12 * 4 * cfg.kv_bytes_per_token(torch.float32))
    eng.add_request([1] * 10, SamplingParams(n=2, max_tokens=14))  # 2 x 6 blocks: fits exactly
    with pytest.raises(InvalidRequestError, match="need 14 KV-cache blocks"):
        eng.add_request([1] * 10, SamplingParams(n=2, max_tokens=15))
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        paged_engine(tiny_llama, max_model_len=32, kv_cache_memory_bytes=7 * 4 * cfg.kv_bytes_per_token(torch.float32))


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"kv_cache": "virtual"}, "kv_cache must be one of"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"attention_backend": "cuda"}, "attention_backend must be one of"),
    ],
)
def test_invalid_paged_configs_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw).validate()


def test_triton_backend_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        EngineConfig(device="cpu", attention_backend="triton").validate()


@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_triton_backend_engine_matches_the_torch_backend(tiny_gemma3, kv_cache):
    """The Triton kernels (interpreted on the CPU) inside the engine: Gemma 3's sliding window (32)
    and a mixed prefill/decode batch give the same greedy tokens as the plain-PyTorch backend."""
    rng = random.Random(7)
    arrivals = [(rng.randint(0, 6), [rng.randrange(10, 500) for _ in range(rng.randint(5, 45))],
                 SamplingParams(max_tokens=rng.randint(3, 8), temperature=0.0, ignore_eos=True)) for _ in range(5)]
    kw = dict(batching="continuous", max_model_len=64, max_num_seqs=4, kv_cache=kv_cache, block_size=8)
    ref = drive(make_engine(tiny_gemma3, attention_backend="torch", **kw), arrivals)
    eng = make_engine(tiny_gemma3, attention_backend="triton", **kw)
    assert eng.runner.attention_backend.name == "triton"
    assert drive(eng, arrivals) == ref
    assert_pool_full(eng)


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache", ["paged", "contiguous"])
def test_triton_engine_on_gpu_matches_the_torch_backend(tiny_llama, kv_cache):
    """float32 on the GPU (the kernels' dots in IEEE fp32): the Triton backend's greedy tokens equal
    the plain-PyTorch backend's, request by request, in a continuous batch with preemptions."""
    from infer.loader import load_model

    loaded = load_model(str(tiny_llama.path), device="cuda", dtype=torch.float32, progress=False)
    arrivals = mixed_workload(loaded.config.vocab_size, 24, seed=3)

    def run(backend, **kw):
        eng = LLMEngine(EngineConfig(model=str(loaded.path), device="cuda", dtype="float32", max_model_len=128,
                                     batching="continuous", max_num_seqs=16, attention_backend=backend, **kw),
                        loaded=loaded)
        out = drive(eng, arrivals)
        assert_pool_full(eng)
        return out, eng

    ref, _ = run("torch")
    paged = dict(block_size=4, kv_cache_memory_bytes=36 * 4 * loaded.config.kv_bytes_per_token(torch.float32))
    got, eng = run("triton", kv_cache=kv_cache, **(paged if kv_cache == "paged" else {}))
    assert got == ref
    if kv_cache == "paged":
        assert eng.num_preemptions > 0


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_torch_backend_groups_decodes_of_very_different_lengths(tiny_llama, kv_cache, monkeypatch):
    """One 1,300-token context decoding beside 8-token ones: the torch backend attends to them in
    separate length groups (no padding of the short ones to 1,300 keys) and every sequence gets
    the tokens and logprobs of the single-group attention it replaces."""
    from infer.attention import torch_backend

    rng = random.Random(3)
    vocab = tiny_llama.config.vocab_size
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in (1300, 8, 9, 7)]

    def run(spread):
        monkeypatch.setattr(torch_backend, "DECODE_GROUP_SPREAD", spread)
        seen = []
        groups = torch_backend.decode_groups
        monkeypatch.setattr(torch_backend, "decode_groups", lambda meta: seen.append(len(groups(meta))) or groups(meta))
        eng = make_engine(tiny_llama, batching="continuous", kv_cache=kv_cache, max_model_len=1400, max_num_seqs=4,
                          attention_backend="torch")
        reqs = [eng.add_request(p, params) for p in prompts]
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step(stream=False):
                done[out.request_id] = out.outputs[0]
        monkeypatch.setattr(torch_backend, "decode_groups", groups)
        return [done[r.request_id] for r in reqs], max(seen)

    grouped, most = run(4)
    single, one = run(10**9)
    assert most == 2 and one == 1
    for g, s in zip(grouped, single):
        assert g.token_ids == s.token_ids
        assert [p.token.logprob for p in g.logprobs] == pytest.approx([p.token.logprob for p in s.logprobs], abs=1e-5)
