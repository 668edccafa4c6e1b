"""Phases 3-4: static and continuous batching.

The central property is *batch invariance*: in float32 on the CPU a request's greedy tokens
(and its seeded samples) are the same whether it runs alone in the phase-1 engine or among
many mixed-length requests arriving at random times, in every batching mode.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer.attention.torch_backend import decode_attention, sdpa_attention
from infer.config import EngineConfig
from infer.engine import LLMEngine
from infer.errors import InvalidRequestError
from infer.sampling import SamplingParams
from tests.hf_reference import infer_logits

MODES = ["none", "static", "continuous"]


def make_engine(loaded, **kw) -> LLMEngine:
    """A float32 engine over ``loaded``, on the device its weights are on."""
    kw.setdefault("max_model_len", 512)
    device = next(loaded.model.parameters()).device.type
    return LLMEngine(EngineConfig(model=str(loaded.path), device=device, dtype="float32", **kw), loaded=loaded)


def drive(engine: LLMEngine, arrivals: list[tuple[int, list[int], SamplingParams]], check=None) -> dict[str, list]:
    """Run until done, adding ``(step, prompt, params)`` when the engine reaches ``step``.

    Returns arrival index -> the finished output's token ids (one list per sequence), or None
    for a request that never finished (aborted by ``check``).
    ``check(engine)`` runs after every step (invariants).
    """
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    rid_of: dict[int, str] = {}
    done: dict[str, list] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            rid_of[i] = engine.add_request(prompt, params, request_id=f"r{i}").request_id
        for out in engine.step(stream=False):
            done[out.request_id] = [o.token_ids for o in out.outputs]
        if check is not None:
            check(engine)
        step += 1
        assert step < 10_000, "the engine made no progress"
    return {i: done.get(rid_of[i]) for i in rid_of}  # None: aborted


def mixed_workload(vocab_size: int, n: int, seed: int, sampled: bool = False):
    """``n`` requests with prompts of 3-60 tokens, 1-12 outputs, arriving over ~20 steps."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(n):
        prompt = [rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(3, 60))]
        if sampled:
            params = SamplingParams(
                max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.7, 1.2]), seed=1000 + i,
                top_k=rng.choice([-1, 20]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
                repetition_penalty=rng.choice([1.0, 1.3]), presence_penalty=rng.choice([0.0, 0.5]),
                logprobs=rng.choice([None, 2]), ignore_eos=True,
            )
        else:
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True)
        arrivals.append((rng.randint(0, 20), prompt, params))
    return arrivals


@pytest.fixture(scope="module")
def alone_results(smollm2):
    """Each request of the workloads, run alone in the phase-1 engine."""
    eng = make_engine(smollm2, batching="none")
    out = {}
    for name, wl in (("greedy", mixed_workload(smollm2.config.vocab_size, 18, seed=1)),
                     ("sampled", mixed_workload(smollm2.config.vocab_size, 18, seed=2, sampled=True))):
        out[name] = (wl, [drive(eng, [(0, p, sp)])[0] for _, p, sp in wl])
    return out


def assert_pool_full(engine: LLMEngine) -> None:
    s = engine.scheduler
    assert not s.running and not s.waiting
    pool = engine.kv_manager.pool
    assert sorted(pool.free_blocks) == list(range(pool.num_blocks)), "a KV-cache block leaked"
    assert all(c == 0 for c in pool.ref_counts)


@pytest.mark.slow
@pytest.mark.parametrize("mode, kv_cache", [(m, "contiguous") for m in MODES] + [("static", "paged"),
                                                                                ("continuous", "paged")])
@pytest.mark.parametrize("workload", ["greedy", "sampled"])
def test_batch_invariance(smollm2, alone_results, mode, kv_cache, workload):
    arrivals, alone = alone_results[workload]
    eng = make_engine(smollm2, batching=mode, kv_cache=kv_cache, max_num_seqs=8, max_num_batched_tokens=512)
    widths = []

    def check(e):
        widths.append(len(e.scheduler.running))
        assert len(e.scheduler.running) <= 8

    batched = drive(eng, arrivals, check)
    for i, tokens in enumerate(alone):
        assert batched[i] == tokens, f"request {i} differs in a {mode} batch"
    if mode != "none":
        assert max(widths) >= 4, "the workload never batched"
    assert_pool_full(eng)


def long_output_workload(vocab_size: int, n: int, seed: int):
    """``n`` requests with short prompts (4-24 tokens) and long outputs (16-32), half of them
    seeded samples: sequences that keep growing into new blocks, so a small cache must preempt."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(n):
        prompt = [rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(4, 24))]
        temp = 0.0 if i % 2 else 0.9
        params = SamplingParams(max_tokens=rng.randint(16, 32), temperature=temp, seed=77 + i, top_k=40,
                                ignore_eos=True)
        arrivals.append((rng.randint(0, 6), prompt, params))
    return arrivals


@pytest.fixture(scope="module")
def long_output_alone(smollm2):
    arrivals = long_output_workload(smollm2.config.vocab_size, 12, seed=4)
    eng = make_engine(smollm2, batching="none", max_model_len=64)
    return arrivals, [drive(eng, [(0, p, sp)])[0] for _, p, sp in arrivals]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_preemption_stress_gives_every_request_its_tokens_alone(smollm2, long_output_alone, mode):
    """A paged cache of 24 blocks of 4 tokens for 12 requests that grow to 20-56 tokens each: many
    preemptions (recompute), and still every request's greedy tokens and seeded samples are its
    tokens alone, and every block comes back."""
    arrivals, alone = long_output_alone
    eng = make_engine(smollm2, batching=mode, kv_cache="paged", block_size=4, max_model_len=64,
                      max_num_seqs=8, max_num_batched_tokens=512,
                      kv_cache_memory_bytes=24 * 4 * smollm2.config.kv_bytes_per_token(torch.float32))
    assert eng.kv_manager.num_blocks == 24

    def check(e):
        held = {b for s in e.scheduler.running for b in s.block_table}
        assert len(held) + e.kv_manager.num_free_blocks == e.kv_manager.num_blocks  # nothing lost or leaked

    batched = drive(eng, arrivals, check)
    for i, tokens in enumerate(alone):
        assert batched[i] == tokens, f"request {i} differs after preemptions ({mode})"
    assert eng.num_preemptions >= 5, eng.num_preemptions
    assert_pool_full(eng)


def test_decode_attention_matches_per_sequence_reference():
    """The batched decode path against :func:`sdpa_attention` run one sequence at a time."""
    g = torch.Generator().manual_seed(0)
    for num_rows, rows, window in [(6, [4, 0, 2, 5], None), (3, [2, 0, 1], None), (8, [7, 1], None), (5, [3, 0, 4], 7)]:
        h, hkv, d, length = 8, 2, 16, 40
        kc = torch.randn(num_rows, length, hkv, d, generator=g, dtype=torch.float64)
        vc = torch.randn(num_rows, length, hkv, d, generator=g, dtype=torch.float64)
        lens = [int(x) for x in torch.randint(1, length + 1, (len(rows),), generator=g)]
        q = torch.randn(len(rows), h, d, generator=g, dtype=torch.float64)
        out = decode_attention(q, kc, vc, torch.tensor(rows), torch.tensor(lens), 0.25, window)
        for b, (r, n) in enumerate(zip(rows, lens)):
            ref = sdpa_attention(q[b : b + 1], kc[r, :n], vc[r, :n], 0.25, window)
            torch.testing.assert_close(out[b], ref[0], rtol=1e-10, atol=1e-10)


def test_continuous_admits_at_every_step_and_static_waits_for_the_batch(tiny_llama):
    long = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for mode, admitted_midway in (("continuous", True), ("static", False)):
        eng = make_engine(tiny_llama, batching=mode, max_num_seqs=4, batch_wait_timeout_ms=0)
        eng.add_request([5, 6, 7], long, request_id="a")
        eng.step()
        eng.step()
        eng.add_request([8, 9], long, request_id="b")
        eng.step()
        running = {s.request.request_id for s in eng.scheduler.running}
        assert ("b" in running) is admitted_midway, mode
        while eng.has_unfinished_requests():
            eng.step()
        assert_pool_full(eng)


def test_none_admits_one_request_and_static_a_whole_batch_past_the_budget(tiny_llama):
    """Admission per policy, by hand: three 10-token prompts.

    ``none`` runs one request at a time, even with budget for all three; with a 16-token budget
    per step, ``continuous`` admits the first (10 <= 16) and stops at the second (10 > 6 left);
    ``static`` admits the whole batch at once even so (the second and third prefill in later
    steps), since a static batch admits nobody once it runs."""
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for mode, budget, admitted in (("none", 64, [1, 1, 1]), ("continuous", 16, [1, 2, 3]), ("static", 16, [3, 3, 3])):
        eng = make_engine(tiny_llama, batching=mode, max_num_seqs=4, max_model_len=16, max_num_batched_tokens=budget,
                          batch_wait_timeout_ms=0)
        for i in range(3):
            eng.add_request([10 + i] * 10, p, request_id=f"r{i}")
        widths = []
        for _ in range(3):
            eng.step()
            widths.append(len(eng.scheduler.running))
        assert widths == admitted, mode
        while eng.has_unfinished_requests():
            eng.step()
        assert_pool_full(eng)


def test_scheduler_stats_count_steps_and_batch_width(tiny_llama):
    # by hand: a (2 tokens) and b (4 tokens) prefill together in step 1 and sample their first
    # tokens; step 2 decodes both (a is done), steps 3-4 decode b alone: widths 2, 2, 1, 1
    eng = make_engine(tiny_llama, batching="static", max_num_seqs=2, batch_wait_timeout_ms=0)
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    eng.add_request([8, 9, 10], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    stats = eng.stats()
    assert stats["num_steps"] == 4 and stats["max_running_seqs"] == 2
    assert stats["mean_running_seqs"] == pytest.approx(6 / 4)
    assert stats["num_preemptions"] == 0
    eng.scheduler.reset_stats()
    assert eng.stats()["num_steps"] == 0 and eng.stats()["mean_running_seqs"] == 0.0


def test_batched_greedy_tokens_are_the_argmax_of_a_cache_free_forward(tiny_llama):
    """Requests of different lengths arriving at different steps (prefills next to decodes),
    greedy: every generated token is the argmax of the logits of one plain forward over the
    prompt and the tokens before it (no cache, no scheduler): the independent reference."""
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    arrivals = [(0, [11, 12, 13, 14, 15, 16, 17], p), (0, [21, 22], p), (2, [31, 32, 33, 34], p)]
    eng = make_engine(tiny_llama, batching="continuous", max_num_seqs=4)
    got = drive(eng, arrivals)
    seqs = [prompt + got[i][0] for i, (_, prompt, _) in enumerate(arrivals)]
    for (_, prompt, _), seq, logits in zip(arrivals, seqs, infer_logits(tiny_llama.model, seqs)):
        for pos in range(len(prompt), len(seq)):
            row = logits[pos - 1]
            assert row[seq[pos]] >= row.max() - 1e-4, (prompt, pos)  # the argmax, up to float ties


def test_static_batch_counts_sequences_not_requests(tiny_llama):
    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, n=2)
    eng = make_engine(tiny_llama, batching="static", max_num_seqs=4, batch_wait_timeout_ms=60_000)
    eng.add_request([5, 6], p)
    assert eng.step() == [] and not eng.scheduler.running  # 2 of 4 sequences: keep waiting
    eng.add_request([7, 8], p)
    eng.step()
    assert len(eng.scheduler.running) == 4  # two requests, four sequences: a full batch


def test_static_batch_waits_for_timeout_or_a_full_batch(tiny_llama):
    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    eng = make_engine(tiny_llama, batching="static", max_num_seqs=3, batch_wait_timeout_ms=60_000)
    eng.add_request([5, 6], p)
    eng.add_request([7, 8], p)
    assert eng.step() == [] and not eng.scheduler.running  # 2 of 3: keep waiting
    eng.add_request([9, 10], p)
    eng.step()
    assert len(eng.scheduler.running) == 3  # full: the batch starts at once


def test_token_budget_is_respected(tiny_llama):
    eng = make_engine(tiny_llama, batching="continuous", max_num_seqs=8, max_model_len=64,
                      max_num_batched_tokens=64)
    rng = random.Random(0)
    for _ in range(10):
        eng.add_request([rng.randrange(10, 200) for _ in range(rng.randint(20, 60))],
                        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        scheduled = eng.scheduler.schedule()
        assert sum(s.num_tokens for s in scheduled) <= 64
        result = eng.runner.execute(scheduled, eng.eos_token_ids)
        for seq in eng.output_processor.apply(result, scheduled):
            eng.scheduler.free(seq)
    assert_pool_full(eng)


def test_n_sequences_share_one_prefill(smollm2):
    eng = make_engine(smollm2, batching="continuous")
    prompt = smollm2.tokenizer.encode("The three primary colors are")
    prefill_tokens = []
    orig = eng.runner.execute

    def spy(scheduled, eos):
        prefill_tokens.extend(s.num_tokens for s in scheduled if s.num_tokens > 1)
        return orig(scheduled, eos)

    eng.runner.execute = spy
    out = drive(eng, [(0, prompt, SamplingParams(n=3, max_tokens=8, temperature=0.0))])[0]
    assert prefill_tokens == [len(prompt)]  # one prefill for the three sequences
    single = drive(eng, [(0, prompt, SamplingParams(max_tokens=8, temperature=0.0))])[0][0]
    assert out == [single] * 3  # the copied K/V gives each fork the same greedy continuation
    # seeded sampling: sequence 0 of n=3 is the n=1 request with the same seed
    sampled = drive(eng, [(0, prompt, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7))])[0]
    alone = drive(eng, [(0, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=7))])[0][0]
    assert sampled[0] == alone and len({tuple(t) for t in sampled}) > 1
    assert_pool_full(eng)


@pytest.mark.parametrize("mode", ["static", "continuous"])
def test_abort_mid_batch_frees_its_row_and_disturbs_nobody(tiny_llama, mode):
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {f"r{i}": [10 + i, 20 + i, 30 + i] for i in range(4)}
    ref = make_engine(tiny_llama, batching=mode, max_num_seqs=4, batch_wait_timeout_ms=0)
    expected = {k: drive(ref, [(0, v, p)])[0] for k, v in prompts.items()}

    eng = make_engine(tiny_llama, batching=mode, max_num_seqs=4, batch_wait_timeout_ms=0)
    for rid, prompt in prompts.items():
        eng.add_request(prompt, p, request_id=rid)
    got = {}
    for _ in range(4):
        eng.step()
    free_before = eng.kv_manager.num_free_blocks
    assert eng.abort_request("r1")
    assert eng.kv_manager.num_free_blocks == free_before + 1  # freed at once, not at the batch's end
    while eng.has_unfinished_requests():
        for out in eng.step(stream=False):
            got[out.request_id] = [o.token_ids for o in out.outputs]
    assert set(got) == {"r0", "r2", "r3"}
    for rid in got:
        assert got[rid] == expected[rid]
    assert_pool_full(eng)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nan_logits_end_their_request_with_an_error_not_token_0(tiny_llama, device, async_scheduling):
    """A model whose logits turn NaN (a float16 overflow, a corrupt checkpoint) for one request: that
    request ends with ``finish_reason="error"`` and no token (no rule can sample from NaN: argmax would
    silently say token 0, or the first NaN); the requests beside it in the same steps get exactly their
    tokens, and the engine goes on. The sampled ids stay in the vocabulary on the device (with async
    scheduling the next step reads them there; on a GPU an id past the vocabulary is a device-side assert
    that would end every request of the server)."""
    from infer.loader import load_model

    loaded = load_model(str(tiny_llama.path), device=device, dtype=torch.float32, progress=False)  # a copy
    poison = 7
    embed = loaded.model.model.embed_tokens
    forward = embed.forward

    def poisoned(ids):  # token 7's embedding is NaN: its sequence's attention and logits turn NaN
        h = forward(ids)
        return torch.where((ids == poison)[:, None], float("nan"), h)

    embed.forward = poisoned
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=5, temperature=0.8, top_k=20, seed=1, ignore_eos=True)
    sound = {"a": [11, 12, 13], "b": [21, 22, 23, 24]}
    bad = {"x": [31, poison, 32], "y": [poison]}
    eng = make_engine(loaded, max_num_seqs=4, batching="continuous", async_scheduling=async_scheduling)
    for rid, prompt in {**sound, **bad}.items():
        eng.add_request(prompt, greedy if rid in ("a", "x") else sampled, request_id=rid)
    outs = {}
    while eng.has_unfinished_requests():
        for out in eng.step(stream=False):
            outs[out.request_id] = out.outputs[0]
    for rid in bad:
        assert outs[rid].finish_reason == "error" and outs[rid].token_ids == [], (rid, outs[rid])
        assert "NaN" in outs[rid].stop_reason
    assert_pool_full(eng)
    ref = make_engine(load_model(str(tiny_llama.path), device=device, dtype=torch.float32, progress=False),
                      max_num_seqs=4, batching="continuous")
    for rid, prompt in sound.items():
        ref.add_request(prompt, greedy if rid == "a" else sampled, request_id=rid)
    want = {}
    while ref.has_unfinished_requests():
        for out in ref.step(stream=False):
            want[out.request_id] = out.outputs[0].token_ids
    assert {rid: outs[rid].token_ids for rid in sound} == want
    assert all(outs[rid].finish_reason == "length" for rid in sound)


def test_the_cpu_kv_pool_takes_at_most_half_the_available_memory(tiny_llama, monkeypatch):
    """Without kv_cache_memory_bytes, a CPU pool holds max_num_seqs full-length sequences, unless that is
    more than half of what the host has available (its pages are all touched in time: a server's memory
    grows to the pool's size); too little memory for one sequence is an error at start-up, not an OOM."""
    from infer.engine import memory

    row = tiny_llama.config.kv_bytes_per_token(torch.float32) * 128  # one 128-token sequence
    assert make_engine(tiny_llama, max_model_len=128, max_num_seqs=8).kv_manager.num_blocks == 8
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2 * 3 * row + 7)
    assert make_engine(tiny_llama, max_model_len=128, max_num_seqs=8).kv_manager.num_blocks == 3
    monkeypatch.setattr(memory, "host_available_bytes", lambda: row)
    with pytest.raises(ValueError, match="available memory.*cannot hold one sequence"):
        make_engine(tiny_llama, max_model_len=128, max_num_seqs=8)


def test_kv_memory_budget_sizes_the_cache(tiny_llama):
    cfg = tiny_llama.config
    row = cfg.kv_bytes_per_token(torch.float32) * 128
    eng = make_engine(tiny_llama, max_model_len=128, max_num_seqs=8, kv_cache_memory_bytes=3 * row + 5)
    assert eng.kv_manager.num_blocks == 3 and eng.runner.kv_cache.nbytes == 3 * row
    with pytest.raises(InvalidRequestError, match="n=4"):
        eng.add_request([1, 2, 3], SamplingParams(n=4))
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        make_engine(tiny_llama, max_model_len=128, kv_cache_memory_bytes=row - 1)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"batching": "dynamic"}, "batching must be one of"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
        ({"max_num_batched_tokens": 100, "max_model_len": 200}, "without chunked prefill"),
        ({"batch_wait_timeout_ms": -1.0}, "batch_wait_timeout_ms"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    ],
)
def test_invalid_batching_configs_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw).validate()


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_decode_attention_on_gpu_real_shapes():
    """bf16 on the GPU at Qwen3 shapes (head_dim 128, GQA 2:1), ragged contexts up to 2048, both the
    in-place and the gathered path, against the per-sequence float64 reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h, hkv, d, length = 16, 8, 128, 2048
    for num_rows, batch in [(64, 64), (64, 48), (64, 8)]:
        kc = torch.randn(num_rows, length, hkv, d, generator=g, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(num_rows, length, hkv, d, generator=g, device="cuda", dtype=torch.bfloat16)
        rows = torch.randperm(num_rows, generator=g, device="cuda")[:batch]
        lens = torch.randint(1, length + 1, (batch,), generator=g, device="cuda")
        q = torch.randn(batch, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
        out = decode_attention(q, kc, vc, rows, lens, d**-0.5, None)
        for b in range(0, batch, 7):
            r, n = int(rows[b]), int(lens[b])
            ref = sdpa_attention(q[b : b + 1].double(), kc[r, :n].double(), vc[r, :n].double(), d**-0.5, None)
            torch.testing.assert_close(out[b].double(), ref[0], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_continuous_batching_on_gpu_matches_alone(tiny_llama):
    """float32 on the GPU: each request's greedy tokens alone and in a continuous batch."""
    from infer.loader import load_model

    loaded = load_model(str(tiny_llama.path), device="cuda", dtype=torch.float32, progress=False)
    arrivals = mixed_workload(loaded.config.vocab_size, 24, seed=3)
    single = make_engine(loaded)
    alone = [drive(single, [(0, p, sp)])[0] for _, p, sp in arrivals]
    eng = make_engine(loaded, batching="continuous", max_num_seqs=16)
    batched = drive(eng, arrivals)
    assert [batched[i] for i in range(len(arrivals))] == alone
    assert_pool_full(eng)
