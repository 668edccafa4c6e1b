"""Phase 6: chunked prefill.

The reference for every engine test is the same engine with chunking off (each prompt in one
step), which earlier phases test against HF transformers: greedy tokens, seeded samples and
prompt logprobs must be the same (fp32, 1e-4) whatever budget cuts the prompts, on both KV
caches and both attention backends. Cut points covered: every token (budget 1), mid-block
(7 with 16-token blocks), the block edge (16) and Gemma 3's sliding-window edge (32, the
tiny_gemma3 window).
"""

from __future__ import annotations

import random

import pytest
import torch

from infer.config import EngineConfig
from infer.engine.scheduler import PREFILL_TOKEN_BUCKETS
from infer.engine.step import chunk_extent
from infer.sampling import SamplingParams
from tests.test_batching import assert_pool_full, make_engine


def assert_blocks_consistent(engine) -> None:
    """Allocator invariants: each block's reference count is the number of running sequences
    whose block table holds it, and the free list is exactly the blocks nobody holds."""
    pool = engine.kv_manager.pool
    held = [0] * pool.num_blocks
    for seq in engine.scheduler.running:
        for b in seq.block_table:
            held[b] += 1
    for req in engine.scheduler.waiting:
        assert all(not s.block_table for s in req.seqs), "a waiting request holds blocks"
    assert pool.ref_counts == held
    assert sorted(pool.free_blocks) == [b for b in range(pool.num_blocks) if held[b] == 0]


def run(engine, arrivals, check=None, max_steps: int = 5000) -> dict[str, dict]:
    """Drive ``engine`` over ``(step, prompt, params)`` arrivals; per request: each sequence's
    tokens (``tokens``), the prompt logprobs as ``(token, logprob, [top ids])`` per position
    (``prompt_logprobs``), each sequence's sampled-token logprobs (``logprobs``) and the prompt
    tokens found in the prefix cache (``cached``). ``check(engine)`` runs after every step."""
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    done: dict[str, dict] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(prompt, params, request_id=f"r{i}")
        for out in engine.step(stream=False):
            plp = None
            if out.prompt_logprobs is not None:
                plp = [None if p is None else (p.token.token_id, p.token.logprob, [t.token_id for t in p.top])
                       for p in out.prompt_logprobs]
            done[out.request_id] = {
                "tokens": [o.token_ids for o in out.outputs], "prompt_logprobs": plp, "cached": out.num_cached_tokens,
                "logprobs": [[p.token.logprob for p in o.logprobs] if o.logprobs else None for o in out.outputs]}
        if check is not None:
            check(engine)
        step += 1
        assert step < max_steps, "no progress"
    return done


def assert_same(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for rid in ref:
        assert got[rid]["tokens"] == ref[rid]["tokens"], rid
        g, r = got[rid]["prompt_logprobs"], ref[rid]["prompt_logprobs"]
        assert (g is None) == (r is None), rid
        if r is None:
            continue
        assert len(g) == len(r), rid  # one entry per prompt token: none repeated, none missing
        for a, b in zip(g, r):
            if b is None:
                assert a is None
                continue
            assert a[0] == b[0] and a[1] == pytest.approx(b[1], abs=1e-4) and a[2] == b[2], rid


def workload(vocab: int, stop: int | None = None, seed: int = 0):
    """Decoding requests with long prompts arriving while they decode; prompt logprobs, n = 2
    (seeded samples) and a request stopped by ``stop`` (a token id) among them."""
    rng = random.Random(seed)

    def prompt(n):
        return [rng.randrange(10, vocab) for _ in range(n)]

    greedy = dict(temperature=0.0, ignore_eos=True)
    return [
        (0, prompt(9), SamplingParams(max_tokens=12, **greedy)),
        (0, prompt(45), SamplingParams(max_tokens=6, prompt_logprobs=2, **greedy)),
        (2, prompt(70), SamplingParams(max_tokens=5, prompt_logprobs=0, **greedy)),
        (3, prompt(33), SamplingParams(n=2, max_tokens=5, seed=11, temperature=1.0, ignore_eos=True)),
        (5, prompt(20), SamplingParams(max_tokens=8, stop_token_ids=[] if stop is None else [stop], **greedy)),
    ]


KW = dict(batching="continuous", max_model_len=128, max_num_seqs=6)


@pytest.fixture(scope="module")
def refs(tiny_llama, tiny_gemma3):
    """Chunking off (one step per prompt) on each model and KV cache."""
    out = {}
    for name, loaded in (("llama", tiny_llama), ("gemma3", tiny_gemma3)):
        # the stop token: the 4th token the last request generates without one
        alone = run(make_engine(loaded, **KW), workload(loaded.config.vocab_size)[-1:])
        out["stop", name] = stop = alone["r0"]["tokens"][0][3]
        for kv in ("contiguous", "paged"):
            eng = make_engine(loaded, kv_cache=kv, **KW)
            out[name, kv] = run(eng, workload(loaded.config.vocab_size, stop))
            assert len(out[name, kv]["r4"]["tokens"][0]) <= 4  # the stop token ended it
            assert_pool_full(eng)
            assert eng.stats()["num_chunked_prefill_steps"] == 0
    return out


@pytest.mark.parametrize("budget", [1, 7, 16, 32])
@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_chunked_matches_unchunked(request, refs, model, kv_cache, budget):
    loaded = request.getfixturevalue("tiny_llama" if model == "llama" else "tiny_gemma3")
    eng = make_engine(loaded, kv_cache=kv_cache, chunked_prefill=True, max_num_batched_tokens=budget, **KW)
    widths = []
    real_schedule = eng.scheduler.schedule

    def schedule():
        items = real_schedule()
        widths.append(sum(s.num_tokens for s in items))
        return items

    eng.scheduler.schedule = schedule
    got = run(eng, workload(loaded.config.vocab_size, refs["stop", model]), check=assert_blocks_consistent)
    assert_same(got, refs[model, kv_cache])
    assert max(widths) <= budget
    assert eng.stats()["num_chunked_prefill_steps"] > 0
    assert_pool_full(eng)


@pytest.mark.parametrize("policy", ["none", "static"])
def test_chunked_under_the_other_batching_policies(tiny_llama, refs, policy):
    """One request at a time, and static batches (admitted whole, prefilled in chunks over several
    steps): each request's tokens and prompt logprobs are still chunking off's (batch invariance)."""
    eng = make_engine(tiny_llama, kv_cache="paged", chunked_prefill=True, max_num_batched_tokens=7,
                      **{**KW, "batching": policy, "batch_wait_timeout_ms": 0})
    got = run(eng, workload(tiny_llama.config.vocab_size, refs["stop", "llama"]), check=assert_blocks_consistent)
    assert_same(got, refs["llama", "paged"])
    assert_pool_full(eng)


@pytest.mark.parametrize("kv_cache", ["contiguous", "paged"])
def test_chunked_with_the_triton_backend(tiny_gemma3, refs, kv_cache):
    """The Triton prefill/extend kernel (interpreted) reads the cached part of the prompt; the cut at
    the window edge (32) and mid-block (7) give the chunking-off tokens and prompt logprobs."""
    arrivals = workload(tiny_gemma3.config.vocab_size)[1:3]  # the two long prompts, logprobs on
    ref = refs["gemma3", kv_cache]
    for budget in (7, 32):
        eng = make_engine(tiny_gemma3, kv_cache=kv_cache, attention_backend="triton", chunked_prefill=True,
                          max_num_batched_tokens=budget, **KW)
        got = run(eng, arrivals)
        assert_same({"r1": got["r0"], "r2": got["r1"]}, {k: ref[k] for k in ("r1", "r2")})
        assert_pool_full(eng)


def test_a_chunk_attends_to_the_cached_prefix_plus_itself(tiny_llama):
    """The trap: a chunk's key length is the cached prefix + the chunk, not the whole prompt.
    A 40-token prompt alone under a budget of 16: chunks 16, 16, 8 see 16, 32, 40 keys, and the
    sequence samples once, after the last chunk."""
    eng = make_engine(tiny_llama, kv_cache="paged", chunked_prefill=True, max_num_batched_tokens=16, **KW)
    seen, sampled = [], []
    backend = eng.runner.attention_backend
    real_forward, real_execute = backend.forward, eng.runner.execute

    def forward(layer_idx, q, k, v, meta, scale, window):
        if layer_idx == 0:
            qs = meta.query_start_loc_cpu
            seen.append([(qs[i + 1] - qs[i], meta.seq_lens_cpu[i]) for i in range(meta.num_seqs)])
        return real_forward(layer_idx, q, k, v, meta, scale, window)

    def execute(scheduled, eos):
        result = real_execute(scheduled, eos)
        sampled.append(len(result.sampled))
        return result

    backend.forward, eng.runner.execute = forward, execute
    eng.add_request(list(range(10, 50)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert seen == [[(16, 16)], [(16, 32)], [(8, 40)], [(1, 41)], [(1, 42)]]
    assert sampled == [0, 0, 1, 1, 1]


def test_chunk_extent_by_hand(tiny_llama):
    eng = make_engine(tiny_llama, **KW)
    req = eng.add_request(list(range(10, 30)), SamplingParams(max_tokens=4))
    seq = req.seqs[0]
    assert chunk_extent(seq, 8) == (0, 8, False)
    seq.num_computed_tokens = 8
    assert chunk_extent(seq, 12) == (8, 20, True)
    seq.token_ids += [1, 2, 3]  # a preempted sequence recomputing its prompt and 3 generated tokens
    seq.num_computed_tokens = 16
    assert chunk_extent(seq, 5) == (16, 21, False)  # past the prompt, not at the end: no sample
    assert chunk_extent(seq, 6) == (16, 22, False)  # one token short of the end: no sample yet
    assert chunk_extent(seq, 7) == (16, 23, True)


def test_partial_chunks_end_on_the_alignment(tiny_llama):
    """``prefill_chunk_alignment``: a chunk that leaves part of its prefill ends at a multiple of the alignment
    of its sequence's tokens; when the budget left reaches none it waits (0), unless even a step's whole budget
    less its decodes might not reach one (then it runs where the budget ends: progress before alignment); a
    chunk that finishes the prefill ends where the prompt does; alignment 1 is the plain rule."""
    eng = make_engine(tiny_llama, **KW, chunked_prefill=True, max_num_batched_tokens=100)
    sched = eng.scheduler
    assert sched._chunk(300, 100, 0) == 100  # alignment 1 (a dense model): the budget
    sched.prefill_chunk_alignment = 64
    assert sched._chunk(300, 100, 0) == 64
    assert sched._chunk(300, 100, 10) == 54 and sched._chunk(300, 200, 10) == 182  # to token 64, to 192
    assert sched._chunk(300, 40, 10) == 0  # token 50 is no boundary: the next step's budget reaches 64
    assert sched._chunk(90, 100, 10) == 90  # the rest of the prefill: all of it, wherever it ends
    sched.max_num_batched_tokens = 60  # 60 - 6 decodes < 64: waiting might never end
    assert sched._chunk(300, 40, 10) == 40 and sched._chunk(300, 16, 0) == 16
    with pytest.raises(ValueError, match="prefill_chunk_alignment must be >= 1"):
        type(sched)(sched.kv, prefill_chunk_alignment=0)


def test_decodes_go_first_and_prefill_chunks_fill_the_rest(tiny_llama):
    """Decode-maximal batching: every running decode is in every step; a long prompt takes the rest."""
    budget = 10
    eng = make_engine(tiny_llama, chunked_prefill=True, max_num_batched_tokens=budget, **KW)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(4):
        eng.add_request([20 + i, 30 + i], greedy, request_id=f"d{i}")
    eng.step()  # the four 2-token prompts
    eng.add_request(list(range(100, 160)), SamplingParams(max_tokens=2, temperature=0.0), request_id="long")
    chunks = []
    while any(r.request_id == "long" for r in eng.scheduler.waiting) or any(
            s.request.request_id == "long" and s.in_prefill for s in eng.scheduler.running):
        items = eng.scheduler.schedule()
        decodes = [s for s in items if s.seq.request.request_id != "long"]
        assert len(decodes) == 4 and all(s.num_tokens == 1 for s in decodes)
        chunks += [s.num_tokens for s in items if s.seq.request.request_id == "long"]
        result = eng.runner.execute(items, eng.eos_token_ids)
        eng.output_processor.apply(result, items)
    assert chunks == [6] * 10  # 60 prompt tokens, 6 a step beside the 4 decodes
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_full(eng)


def test_decodes_go_first_even_behind_an_older_prefill(tiny_llama):
    """The long prompt is admitted first (running[0]); the 4 sequences of a request admitted after it
    still get their decode token in every step before the long prompt's next chunk takes the rest."""
    eng = make_engine(tiny_llama, chunked_prefill=True, max_num_batched_tokens=10, long_prefill_token_threshold=8,
                      **KW)
    eng.add_request(list(range(100, 200)), SamplingParams(max_tokens=2, temperature=0.0), request_id="long")
    # admitted in the 2 tokens the long prompt's first chunk leaves; then 4 sequences decode
    eng.add_request([20, 30], SamplingParams(n=4, seed=1, max_tokens=20, temperature=1.0, ignore_eos=True))
    steps = 0
    while eng.has_unfinished_requests():
        decoding = {s for s in eng.scheduler.running if not s.in_prefill}
        items = eng.scheduler.schedule()
        assert decoding <= {s.seq for s in items}  # no decode skipped
        assert sum(s.num_tokens for s in items) <= 10
        result = eng.runner.execute(items, eng.eos_token_ids)
        for seq in eng.output_processor.apply(result, items):
            eng.scheduler.free(seq)
        steps += 1
    assert_pool_full(eng)


def test_forks_share_one_chunked_prefill(tiny_llama, refs):
    """n = 3 under a budget of 16: the prompt runs once (40 prefill tokens in all), the forks get
    their copy of the prompt's K/V after its last chunk, and sample what chunking off samples."""
    params = SamplingParams(n=3, max_tokens=4, seed=5, temperature=1.0, ignore_eos=True)
    arrivals = [(0, list(range(10, 50)), params)]
    ref = run(make_engine(tiny_llama, kv_cache="paged", **KW), arrivals)
    for kv in ("contiguous", "paged"):
        eng = make_engine(tiny_llama, kv_cache=kv, chunked_prefill=True, max_num_batched_tokens=16, **KW)
        assert_same(run(eng, arrivals, check=assert_blocks_consistent), ref)
        assert eng.stats()["num_prefill_tokens"] == 40
        assert_pool_full(eng)


def test_long_prefill_token_threshold_shares_the_budget(tiny_llama):
    eng = make_engine(tiny_llama, chunked_prefill=True, max_num_batched_tokens=64, long_prefill_token_threshold=8,
                      **KW)
    for i in range(3):
        eng.add_request(list(range(10 + i, 50 + i)), SamplingParams(max_tokens=2, temperature=0.0))
    items = eng.scheduler.schedule()
    assert [s.num_tokens for s in items] == [8, 8, 8]
    for r in ("req-0", "req-1", "req-2"):
        assert eng.abort_request(r)
    assert_pool_full(eng)


def schedule_trace(engine, steps: int) -> list[list[tuple[str, int]]]:
    """Run up to ``steps`` steps by hand; each step's batch as ``(request id, tokens)`` in order."""
    trace = []
    for _ in range(steps):
        if not engine.has_unfinished_requests():
            break
        items = engine.scheduler.schedule()
        trace.append([(s.seq.request.request_id, s.num_tokens) for s in items])
        result = engine.runner.execute(items, engine.eos_token_ids)
        for seq in engine.output_processor.apply(result, items):
            engine.scheduler.free(seq)
    return trace


def test_prefill_chunks_share_the_budget_in_admission_order(tiny_llama):
    """Prompts of 40, 30 and 20 tokens under a budget of 20 and a cap of 8: after the first step's
    admissions, the running prompts take their chunks in admission order (the oldest first, not the
    shortest), each at most the cap; decodes go first once a prompt completes."""
    eng = make_engine(tiny_llama, chunked_prefill=True, max_num_batched_tokens=20, long_prefill_token_threshold=8,
                      **KW)
    for i, n in enumerate((40, 30, 20)):
        eng.add_request(list(range(10 + i, 10 + i + n)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                        request_id=f"r{i}")
    assert schedule_trace(eng, 5) == [
        [("r0", 8), ("r1", 8), ("r2", 4)],  # admitted: the cap, the cap, what is left
        [("r0", 8), ("r1", 8), ("r2", 4)],  # running: the same order, the same cap
        [("r0", 8), ("r1", 8), ("r2", 4)],
        [("r0", 8), ("r1", 6), ("r2", 6)],  # r1's last chunk leaves r2 more
        [("r1", 1), ("r0", 8), ("r2", 2)],  # r1 decodes first
    ]
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_full(eng)


def test_a_preemption_gives_its_tokens_back_to_the_budget(tiny_llama):
    """n = 3 decoding beside an older prompt's chunks (budget 8, cap 7), in a pool that runs dry between
    the forks: two of them got their blocks and sit in the batch when the third preempts their own
    request. Their tokens leave the batch, and the budget: the prompt's chunk takes what the batch
    really leaves (its cap, 7), not 8 - 2."""
    cfg = tiny_llama.config
    eng = make_engine(tiny_llama, chunked_prefill=True, max_num_batched_tokens=8, long_prefill_token_threshold=7,
                      kv_cache="paged", block_size=4, kv_cache_memory_bytes=26 * 4 * cfg.kv_bytes_per_token(torch.float32),
                      **{**KW, "max_model_len": 96})
    eng.add_request(list(range(100, 180)), SamplingParams(max_tokens=2, temperature=0.0), request_id="x")
    eng.add_request([20, 21, 22, 23, 24, 25], SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True),
                    request_id="r")
    trace = schedule_trace(eng, 9)
    # x's chunks and r's one-token prefill, then r's three decodes beside x until position 8 needs a
    # block in each fork: only two are left
    assert trace[:8] == [[("x", 7), ("r", 1)]] * 5 + [[("r", 1), ("x", 7)]] + [[("r", 1)] * 3 + [("x", 5)]] * 2
    assert eng.num_preemptions == 1 and trace[8] == [("x", 7)]
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_full(eng)


def test_without_chunking_a_prompt_that_does_not_fit_waits_whole(tiny_llama):
    """Static batching, chunking off, budget 16: the whole batch is admitted at once, but the 15-token
    prompt does not fit beside the 7 + 8 + 1 of the others. It is not cut into a chunk, and it does not
    stop the step: the decodes behind it run, and it runs alone once they are done."""
    eng = make_engine(tiny_llama, batching="static", max_model_len=16, max_num_seqs=4, max_num_batched_tokens=16,
                      batch_wait_timeout_ms=0)
    for i, n in enumerate((7, 8, 15, 1)):
        eng.add_request([10 + i] * n, SamplingParams(max_tokens=1 if n == 15 else 4, temperature=0.0, ignore_eos=True),
                        request_id=f"r{i}")
    assert schedule_trace(eng, 6) == [[("r0", 7), ("r1", 8), ("r3", 1)]] + [[("r0", 1), ("r1", 1), ("r3", 1)]] * 3 \
        + [[("r2", 15)]]
    assert_pool_full(eng)


def test_abort_mid_prefill_frees_every_block(tiny_llama):
    """A half-prefilled request (n = 2: the forks hold their blocks, waiting for the shared prefill)
    is aborted; its blocks return and the request decoding beside it is not disturbed."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = make_engine(tiny_llama, kv_cache="paged", **KW)
    ref = run(alone, [(0, [7, 8, 9], greedy)])
    eng = make_engine(tiny_llama, kv_cache="paged", block_size=4, chunked_prefill=True, max_num_batched_tokens=6,
                      **KW)
    eng.add_request([7, 8, 9], greedy, request_id="r0")
    eng.step()
    eng.add_request(list(range(10, 60)), SamplingParams(n=2, max_tokens=4, temperature=1.0), request_id="big")
    for _ in range(3):
        eng.step()
        assert_blocks_consistent(eng)
    big = eng.requests["big"]
    assert 0 < big.seqs[0].num_computed_tokens < big.prompt_len and big.seqs[1].block_table
    assert eng.abort_request("big")
    assert_blocks_consistent(eng)
    out = run(eng, [])
    assert out["r0"]["tokens"] == ref["r0"]["tokens"]
    assert_pool_full(eng)


def test_preempted_half_prefilled_and_recomputed_sequences(tiny_llama):
    """A small pool and a small budget: a decoding request growing into new blocks preempts the newest
    request while it is half-prefilled, and requests that already generated tokens are preempted and
    recompute prompt + output in chunks. Every request still gets its chunking-off tokens and
    prompt logprobs (reported once), and no block leaks."""
    cfg = tiny_llama.config
    rng = random.Random(3)
    greedy = dict(temperature=0.0, ignore_eos=True)
    arrivals = [(0, [rng.randrange(10, 900) for _ in range(8)], SamplingParams(max_tokens=20, **greedy)),
                (1, [rng.randrange(10, 900) for _ in range(30)], SamplingParams(max_tokens=4, prompt_logprobs=1,
                                                                                **greedy))]
    decoders = [(0, [rng.randrange(10, 900) for _ in range(6)], SamplingParams(max_tokens=30, **greedy))
                for i in range(3)]  # 3 x 9 blocks at their longest: the newest are preempted mid-decode
    victims = []
    for work, budget in ((arrivals, 3), (decoders, 4)):
        ref = run(make_engine(tiny_llama, kv_cache="paged", **KW), work)
        eng = make_engine(tiny_llama, kv_cache="paged", block_size=4, chunked_prefill=True,
                          max_num_batched_tokens=budget, kv_cache_memory_bytes=12 * 4 * cfg.kv_bytes_per_token(torch.float32),
                          **{**KW, "max_model_len": 48})
        real_preempt = eng.scheduler.preempt

        def preempt(request, real_preempt=real_preempt):
            s = request.seqs[0]
            victims.append((s.num_computed_tokens, s.num_prompt_tokens, s.num_output_tokens))
            real_preempt(request)

        eng.scheduler.preempt = preempt
        got = run(eng, work, check=assert_blocks_consistent)
        assert_same(got, ref)
        assert_pool_full(eng)
    assert any(0 < c < p for c, p, _ in victims), victims  # preempted mid-prefill
    assert any(o > 0 for _, _, o in victims), victims  # preempted after generating: chunked recompute


def test_stats_and_metrics_show_chunked_steps(tiny_llama):
    from infer.server.metrics import Metrics

    eng = make_engine(tiny_llama, chunked_prefill=True, max_num_batched_tokens=16, **KW)
    eng.add_request(list(range(10, 50)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.stats()
    # chunks of 16, 16, 8 (the first two leave tokens for later), then one decode step
    assert st["num_prefill_tokens"] == 40 and st["num_chunked_prefill_steps"] == 2
    assert st["mean_prefill_tokens_per_step"] == pytest.approx(40 / 3)
    text = Metrics("m").render(0, 0, 0.0, scheduler=eng.scheduler).decode()
    assert 'infer:iteration_prefill_tokens_count{model_name="m"} 3.0' in text
    assert 'infer:iteration_prefill_tokens_bucket{le="8.0",model_name="m"} 1.0' in text
    assert 'infer:iteration_prefill_tokens_bucket{le="16.0",model_name="m"} 3.0' in text
    assert 'infer:iteration_prefill_tokens_sum{model_name="m"} 40.0' in text
    assert 'infer:num_chunked_prefill_steps_total{model_name="m"} 2.0' in text
    assert PREFILL_TOKEN_BUCKETS[0] == 1


def test_chunked_prefill_config(tiny_llama):
    EngineConfig(max_model_len=4096, max_num_batched_tokens=256, chunked_prefill=True).validate()
    with pytest.raises(ValueError, match="chunked_prefill"):
        EngineConfig(max_model_len=4096, max_num_batched_tokens=256).validate()
    with pytest.raises(ValueError, match="needs chunked_prefill"):
        EngineConfig(long_prefill_token_threshold=64).validate()
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 1"):
        EngineConfig(long_prefill_token_threshold=0, chunked_prefill=True).validate()
    assert EngineConfig(chunked_prefill=True).resolved_max_num_batched_tokens(4096) == 2048
    assert EngineConfig().resolved_max_num_batched_tokens(4096) == 4096
    assert EngineConfig.ablation_values()["chunked_prefill"] == (False, True)
    # a prompt longer than the budget runs, in chunks
    eng = make_engine(tiny_llama, chunked_prefill=True, max_num_batched_tokens=16, **KW)
    assert eng.scheduler.max_num_batched_tokens == 16


def test_server_echo_logprobs_and_metrics_with_chunking(tiny_llama, tmp_path):
    """Through ``python -m infer.server --chunked-prefill`` with a budget of 8: an ``echo`` request with
    logprobs (lm-eval's loglikelihood shape) gets the prompt logprobs and tokens of the in-process
    engine with chunking off, and ``/metrics`` shows the chunked steps."""
    import httpx

    from tests.server_fixture import ServerProcess, metric_value

    ids = [(7 * i + 11) % 1000 for i in range(40)]
    ref_eng = make_engine(tiny_llama, **KW)
    ref = ref_eng.add_request(ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1))
    while ref_eng.has_unfinished_requests():
        ref_eng.step()
    srv = ServerProcess(tmp_path, ["--model", str(tiny_llama.path), "--device", "cpu", "--batching", "continuous",
                                   "--chunked-prefill", "--max-num-batched-tokens", "8", "--max-model-len", "128",
                                   "--log-level", "warning"],
                        env={"OMP_NUM_THREADS": str(torch.get_num_threads())})
    try:
        srv.wait_ready()
        model = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 3 and lp["token_logprobs"][0] is None
        want = [p.token.logprob for p in ref.prompt_logprobs[1:]]
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
        assert r.json()["usage"]["completion_tokens"] == 3
        text = srv.metrics()
        assert metric_value(text, "infer:num_chunked_prefill_steps_total") >= 4  # 40 tokens in chunks of 8
        assert metric_value(text, "infer:iteration_prefill_tokens_sum") == 40
    finally:
        srv.stop()
