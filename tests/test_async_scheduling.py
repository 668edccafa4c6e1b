"""Phase 9: async scheduling (``EngineConfig.async_scheduling``) gives exactly the outputs of the
synchronous loop: tokens, texts, finish reasons, logprobs, stop strings, n > 1, aborts,
preemption, chunked prefill and penalties (which wait for their step), and every KV block back.

On the CPU nothing overlaps (CPU tensors are computed as they are issued), but every path of the
loop runs: placeholders, the device-side gather of the previous step's tokens, sequences that
finished while their next step ran, requests preempted or aborted with a step in flight.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer.engine.sequence import PLACEHOLDER
from infer.sampling import SamplingParams
from tests.test_batching import assert_pool_full, drive, make_engine, mixed_workload


def _full(engine, arrivals, abort_at: dict[int, str] | None = None) -> dict[str, tuple]:
    """Run ``arrivals`` (``(step, prompt, params)``); returns request id -> every output field that
    matters, and the streamed deltas joined (they must add up to the final text)."""
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    done, streamed = {}, {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(prompt, params, request_id=f"r{i}")
        if abort_at and step in abort_at:
            engine.abort_request(abort_at[step])
        for out in engine.step(stream=True):
            for c in out.outputs:
                streamed[(out.request_id, c.index)] = streamed.get((out.request_id, c.index), "") + c.delta_text
            if out.finished:
                done[out.request_id] = tuple(
                    (c.text, tuple(c.token_ids), c.finish_reason, c.stop_reason,
                     None if c.logprobs is None else tuple(e.token.logprob for e in c.logprobs))
                    for c in out.outputs)
        step += 1
        assert step < 5000
    for (rid, idx), text in streamed.items():
        if rid in done:
            assert text == done[rid][idx][0], "the streamed deltas do not add up to the final text"
    return done


def assert_same_outputs(got: dict[str, tuple], ref: dict[str, tuple]) -> None:
    """``_full``'s outputs equal: texts, token ids and finish reasons exactly, logprobs within 1e-4. (A
    preempted sequence's recompute runs its tokens as a prefill, not as decode steps: the same tokens,
    logprobs a few 1e-6 apart, which rounding to a fixed number of digits can still tell apart.)"""
    assert got.keys() == ref.keys()
    for rid in ref:
        assert len(got[rid]) == len(ref[rid]), rid
        for g, r in zip(got[rid], ref[rid]):
            assert g[:4] == r[:4], rid
            assert (g[4] is None) == (r[4] is None), rid
            if r[4] is not None:
                assert g[4] == pytest.approx(r[4], abs=1e-4), rid


def _workload(vocab: int, n: int, seed: int):
    rng = random.Random(seed)
    arrivals = []
    for i in range(n):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(3, 40))]
        kind = i % 5
        if kind == 0:
            params = SamplingParams(max_tokens=rng.randint(1, 14), temperature=0.0, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(max_tokens=12, temperature=0.8, seed=i, top_k=30, logprobs=2, ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(max_tokens=10, temperature=0.7, seed=i, n=2, ignore_eos=True)
        elif kind == 3:  # a penalty: the engine waits for this request's steps
            params = SamplingParams(max_tokens=9, temperature=0.9, seed=i, repetition_penalty=1.3,
                                    presence_penalty=0.4, ignore_eos=True)
        else:  # ends on a stop token id sampled with some luck, else on max_tokens
            params = SamplingParams(max_tokens=11, temperature=1.0, seed=i, stop_token_ids=[rng.randrange(100, 400)])
        arrivals.append((rng.randint(0, 12), prompt, params))
    return arrivals


@pytest.mark.parametrize("kw", [
    dict(kv_cache="contiguous"),
    dict(kv_cache="paged", block_size=4),
    dict(kv_cache="paged", block_size=4, chunked_prefill=True, max_num_batched_tokens=24),
], ids=["contiguous", "paged", "chunked"])
def test_async_scheduling_gives_the_synchronous_outputs(tiny_llama, kw):
    arrivals = _workload(tiny_llama.config.vocab_size, 15, seed=1)
    base = dict(batching="continuous", max_model_len=64, max_num_seqs=6, **kw)
    ref = _full(make_engine(tiny_llama, **base), arrivals)
    eng = make_engine(tiny_llama, async_scheduling=True, **base)
    assert_same_outputs(_full(eng, arrivals), ref)
    assert_pool_full(eng)
    assert eng._in_flight is None


def test_async_scheduling_under_preemption_and_aborts(tiny_llama):
    """A cache so small that sequences are preempted while their step is in flight, and requests
    aborted mid-run: the same outputs as the synchronous loop, and no block leaks."""
    arrivals = mixed_workload(tiny_llama.config.vocab_size, 20, seed=9) + \
        mixed_workload(tiny_llama.config.vocab_size, 6, seed=10, sampled=True)
    kw = dict(batching="continuous", max_model_len=96, max_num_seqs=8, kv_cache="paged", block_size=4,
              kv_cache_memory_bytes=30 * 4 * tiny_llama.config.kv_bytes_per_token(torch.float32))
    aborts = {6: "r3", 9: "r11", 14: "r0"}
    ref_eng = make_engine(tiny_llama, **kw)
    ref = _full(ref_eng, arrivals, aborts)
    eng = make_engine(tiny_llama, async_scheduling=True, **kw)
    assert_same_outputs(_full(eng, arrivals, aborts), ref)
    assert eng.num_preemptions > 0
    assert_pool_full(eng)


@pytest.mark.parametrize("mode", ["none", "static"])
def test_async_scheduling_with_other_batching_policies(tiny_llama, mode):
    arrivals = mixed_workload(tiny_llama.config.vocab_size, 8, seed=3)
    kw = dict(batching=mode, max_model_len=96, max_num_seqs=4, batch_wait_timeout_ms=0)
    ref = drive(make_engine(tiny_llama, **kw), arrivals)
    eng = make_engine(tiny_llama, async_scheduling=True, **kw)
    assert drive(eng, arrivals) == ref
    assert_pool_full(eng)


def test_a_sequence_holds_one_placeholder_while_its_step_runs(tiny_llama):
    eng = make_engine(tiny_llama, batching="continuous", max_model_len=64, async_scheduling=True)
    eng.add_request([11, 12, 13], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), request_id="a")
    assert eng.step() == []  # the prefill is in flight: nothing to report yet
    seq = eng.requests["a"].seqs[0]
    assert seq.token_ids == [11, 12, 13, PLACEHOLDER]
    outs = eng.step()  # launches the first decode, then applies the prefill's token
    assert [o.outputs[0].token_ids for o in outs] == [seq.token_ids[3:4]]
    assert seq.token_ids[-1] == PLACEHOLDER and PLACEHOLDER not in seq.token_ids[:-1]
    while eng.has_unfinished_requests():
        eng.step()
    assert PLACEHOLDER not in seq.token_ids and len(seq.token_ids) == 8


def test_placeholders_go_to_the_sampled_sequences_and_their_tokens_count_as_computed(tiny_llama):
    """Chunked prefill, budget 8: an n = 2 request's 5-token prompt and the first 3 tokens of a 20-token
    prompt run in step 1. Both sequences of the first sample (the fork from the shared prompt), so
    each holds a placeholder; the second is mid-prompt and holds none. Each step's tokens count as
    computed once it is launched: the placeholder is the one token left."""
    eng = make_engine(tiny_llama, batching="continuous", max_model_len=64, async_scheduling=True,
                      chunked_prefill=True, max_num_batched_tokens=8)
    a = eng.add_request([11, 12, 13, 14, 15], SamplingParams(n=2, max_tokens=4, temperature=0.0, ignore_eos=True))
    b = eng.add_request(list(range(30, 50)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    eng.step()
    assert [s.token_ids[-1] for s in a.seqs] == [PLACEHOLDER, PLACEHOLDER] and PLACEHOLDER not in b.seqs[0].token_ids
    assert [s.num_computed_tokens for s in (*a.seqs, b.seqs[0])] == [5, 5, 3]
    eng.step()  # a's two decodes, then 6 more of b's prompt
    assert [s.num_computed_tokens for s in (*a.seqs, b.seqs[0])] == [6, 6, 9]
    assert [s.token_ids.count(PLACEHOLDER) for s in a.seqs] == [1, 1] and PLACEHOLDER not in b.seqs[0].token_ids
    while eng.has_unfinished_requests():
        eng.step()
    assert all(PLACEHOLDER not in s.token_ids and s.num_output_tokens == 4 for s in a.seqs)
    assert b.seqs[0].num_output_tokens == 3
    assert_pool_full(eng)


def _record_order(eng) -> list[str]:
    """Wrap the runner's forward and sampling-tensor build and the output processor's apply (the
    real functions, called through) to record the order in which a step's parts run."""
    events: list[str] = []
    runner, proc = eng.runner, eng.output_processor
    forward, tensors, apply = runner._forward, runner._sampling_tensors, proc.apply

    def rec(name, fn):
        def wrapped(*a, **k):
            events.append(name)
            return fn(*a, **k)
        return wrapped

    runner._forward = rec("forward", forward)
    runner._sampling_tensors = rec("sampling_tensors", tensors)
    proc.apply = rec("apply", apply)
    return events


@pytest.mark.parametrize("penalty", [False, True], ids=["plain", "penalty"])
def test_tokens_the_next_sampling_needs_are_applied_between_its_forward_and_its_sampling(tiny_llama, penalty):
    """A request with penalties needs step N - 1's token on the host before step N's sampling
    tensors (the counts). The engine applies it *inside* step N: after N's forward is launched (so
    the device works meanwhile), before N's sampling tensors are built; a request without penalties
    applies it after N is launched whole. Both give the synchronous loop's tokens."""
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True,
                            repetition_penalty=1.5 if penalty else 1.0, presence_penalty=0.7 if penalty else 0.0)
    ref = make_engine(tiny_llama, batching="continuous", max_model_len=64)
    ref.add_request([21, 22, 23, 24], params, request_id="a")
    want = [o for _ in range(20) for o in ref.step() if o.finished][0].outputs[0].token_ids

    eng = make_engine(tiny_llama, batching="continuous", max_model_len=64, async_scheduling=True)
    eng.add_request([21, 22, 23, 24], params, request_id="a")
    eng.step()  # the prefill, in flight
    events = _record_order(eng)
    eng.step()  # the first decode, with the prefill's token applied during it
    if penalty:
        assert events == ["forward", "apply", "sampling_tensors"], events
    else:
        assert events == ["forward", "sampling_tensors", "apply"], events
    got = []
    while eng.has_unfinished_requests():
        got += [o for o in eng.step() if o.finished]
    got += [o for o in eng.step() if o.finished]
    assert got[0].outputs[0].token_ids == want


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_reused_sampling_tensors_give_the_tokens_of_tensors_built_every_step(tiny_llama, async_scheduling):
    """ModelRunner._sampling_tensors reuses the last step's tensors while the same sequences sample
    (only the stream positions are copied). Seeded random rows, greedy rows, a ``min_tokens`` ban
    that ends mid-run, n = 2 and requests arriving and finishing (the batch changes) must give the
    tokens and logprobs of a runner that builds the tensors at every step."""
    rng = random.Random(7)
    vocab = tiny_llama.config.vocab_size
    arrivals = []
    for i in range(8):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(3, 20))]
        kind = i % 4
        if kind == 0:
            params = SamplingParams(max_tokens=rng.randint(8, 20), temperature=0.0, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(max_tokens=20, temperature=0.9, seed=i, top_p=0.9, logprobs=1, ignore_eos=True)
        elif kind == 2:
            # a third of the vocabulary stops it, once the ban is over (the stop lands soon after)
            params = SamplingParams(max_tokens=16, temperature=0.8, seed=i, min_tokens=6,
                                    stop_token_ids=list(range(vocab // 3)))
        else:
            params = SamplingParams(max_tokens=12, temperature=1.0, seed=i, n=2, ignore_eos=True)
        arrivals.append((rng.choice([0, 0, 0, 5, 9]), prompt, params))
    base = dict(batching="continuous", max_model_len=64, max_num_seqs=8, kv_cache="paged", block_size=4,
                async_scheduling=async_scheduling)
    fresh = make_engine(tiny_llama, **base)
    fresh.runner._sampling_tensors = fresh.runner._build_sampling_tensors  # no reuse: built every step
    ref = _full(fresh, arrivals)
    eng = make_engine(tiny_llama, **base)
    built, calls = [], []
    build, get = eng.runner._build_sampling_tensors, eng.runner._sampling_tensors
    eng.runner._build_sampling_tensors = lambda *a: built.append(1) or build(*a)
    eng.runner._sampling_tensors = lambda *a: calls.append(1) or get(*a)
    assert_same_outputs(_full(eng, arrivals), ref)
    assert len(calls) - len(built) >= 10, (len(built), len(calls))  # the steady stretches reused them
    assert_pool_full(eng)
