"""Phase 1: generation end to end on real weights.

Greedy tokens equal HF ``generate(do_sample=False)`` token for token; stop handling, streaming,
seeds, logprobs and bad input behave as documented.
"""

from __future__ import annotations

import pytest
import torch

from infer.config import EngineConfig
from infer.engine import LLMEngine
from infer.errors import InvalidRequestError
from infer.sampling import RequestOutputKind, SamplingParams
from tests.hf_reference import infer_logits


def make_engine(loaded, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(loaded.path), device="cpu", dtype="float32", **kw), loaded=loaded)


def run(engine: LLMEngine, prompt, params: SamplingParams):
    req = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == req.request_id]
    return outs


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """HF ``generate(do_sample=False)``: up to ``n`` tokens, stopping after EOS like infer."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


@pytest.mark.slow
def test_greedy_matches_hf_smollm2(smollm2, hf_smollm2):
    eng = make_engine(smollm2)
    tok = smollm2.tokenizer
    for text in ["The capital of France is", "def quicksort(arr):", "List three colors:"]:
        ids = tok.encode(text)
        ours = run(eng, ids, GREEDY)[-1].outputs[0].token_ids
        assert ours == hf_greedy(hf_smollm2, ids, 32), text


@pytest.mark.slow
def test_greedy_matches_hf_gemma3_across_sliding_window(gemma3, hf_gemma3):
    eng = make_engine(gemma3, max_model_len=1024)
    tok = gemma3.tokenizer
    long_ids = tok.encode("The history of the lighthouse keeper's family. " * 60)[:500]
    assert len(long_ids) == 500  # 500 + 32 generated crosses the 512-token window during decode
    for ids in [tok.encode("The quick brown fox"), long_ids]:
        ours = run(eng, ids, GREEDY)[-1].outputs[0].token_ids
        assert ours == hf_greedy(hf_gemma3, ids, 32)


def test_streaming_deltas_concatenate_to_final_text(smollm2):
    eng = make_engine(smollm2)
    outs = run(eng, "Once upon a time", SamplingParams(max_tokens=24, temperature=0.8, seed=7))
    final = outs[-1].outputs[0]
    assert outs[-1].finished and final.finish_reason in ("stop", "length")
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text
    assert sum(len(o.outputs[0].delta_token_ids) for o in outs) == len(final.token_ids)
    assert final.text == smollm2.tokenizer.decode(final.token_ids)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_unstreamed_text_is_made_once_at_the_end_and_equals_the_streamed_text(smollm2, async_scheduling):
    # Not streamed and without stop strings, a request's text is made when it finishes (the
    # tokenizer is not called while it runs); with streaming, or with stop strings, at every step.
    # Either way: the same text, the same as decoding the tokens, for every request of a batch.
    prompts = ["Once upon a time", "The capital of France is", "def fib(n):", "日本語のテキスト"]
    kinds = [SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
             SamplingParams(max_tokens=14, temperature=0.0, skip_special_tokens=False),
             SamplingParams(max_tokens=20, temperature=0.8, seed=4, stop=["the", "\n"])]
    texts = {}
    for stream in (True, False):
        eng = make_engine(smollm2, batching="continuous", async_scheduling=async_scheduling)
        decode, calls = eng.tokenizer.decode, []
        # count the tokenizer's decode calls in each step (an instance attribute, undone below)
        eng.tokenizer.decode = lambda *a, _d=decode, _c=calls, **kw: _c.append(1) or _d(*a, **kw)
        try:
            reqs = [eng.add_request(p, k) for p in prompts for k in kinds]
            finals, step_calls, deltas = {}, [], {r.request_id: [] for r in reqs}
            while eng.has_unfinished_requests():
                calls.clear()
                outs = eng.step(stream=stream)
                finals.update({o.request_id: o for o in outs if o.finished})
                for o in outs:
                    deltas[o.request_id].append(o.outputs[0].delta_text)
                step_calls.append((len(calls), any(o.finished for o in outs)))
        finally:
            del eng.tokenizer.decode
        texts[stream] = [finals[r.request_id].outputs[0].text for r in reqs]
        for r, text in zip(reqs, texts[stream]):
            ids = finals[r.request_id].outputs[0].token_ids
            if not r.params.stop:
                assert text == smollm2.tokenizer.decode(ids, skip_special_tokens=r.params.skip_special_tokens)
        if not stream:  # only the stop-string requests decode text in a step where nothing finished
            quiet = [n for n, finished in step_calls if not finished]
            assert quiet and max(quiet) <= len(prompts) * 2, step_calls
        else:  # the text streams as it is made, a piece at (nearly) every step
            for r, text in zip(reqs, texts[stream]):
                assert "".join(deltas[r.request_id]) == text
                if len(finals[r.request_id].outputs[0].token_ids) >= 8:
                    assert sum(map(bool, deltas[r.request_id])) >= 4, deltas[r.request_id]
    assert texts[True] == texts[False]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_output_kinds_carry_the_same_request(smollm2, async_scheduling):
    # The same requests (seeded, n = 2 with a stop string, logprobs) in one batch under each output
    # kind: DELTA's outputs are the deltas (nothing cumulative), and folding them gives CUMULATIVE's
    # final output; FINAL_ONLY says nothing until the end, then exactly CUMULATIVE's final output.
    prompts = ["Once upon a time", "The capital of France is", "def fib(n):"]
    params = [dict(max_tokens=18, temperature=0.8, seed=3, n=2, stop=["the"], logprobs=2),
              dict(max_tokens=12, temperature=0.0, logprobs=0),
              dict(max_tokens=15, temperature=1.0, seed=9, ignore_eos=True)]
    eng = make_engine(smollm2, batching="continuous", async_scheduling=async_scheduling, max_num_seqs=64)
    reqs = {(kind, i, j): eng.add_request(p, SamplingParams(**kw, output_kind=kind))
            for kind in RequestOutputKind for i, p in enumerate(prompts) for j, kw in enumerate(params)}
    streams = {r.request_id: [] for r in reqs.values()}
    while eng.has_unfinished_requests():
        for o in eng.step(stream=True):
            streams[o.request_id].append(o)
    for (kind, i, j), r in reqs.items():
        if kind is not RequestOutputKind.CUMULATIVE:
            continue
        cum = streams[r.request_id]
        final = cum[-1]
        assert final.finished and [o.finished for o in cum].count(True) == 1
        delta = streams[reqs[RequestOutputKind.DELTA, i, j].request_id]
        only = streams[reqs[RequestOutputKind.FINAL_ONLY, i, j].request_id]
        assert len(only) == 1 and only[0].finished and len(delta) == len(cum)
        for k, c in enumerate(final.outputs):
            # FINAL_ONLY's one output is CUMULATIVE's last
            f = only[0].outputs[k]
            assert (f.text, f.token_ids, f.finish_reason, f.num_generated_tokens) == \
                (c.text, c.token_ids, c.finish_reason, len(c.token_ids))
            assert_same_logprobs(f.logprobs, c.logprobs)
            # DELTA: each output carries only what is new; folded, the whole
            parts = [o.outputs[k] for o in delta]
            assert all(d.text == d.delta_text and d.token_ids == d.delta_token_ids for d in parts)
            assert "".join(d.text for d in parts) == c.text and c.text
            assert sum((d.token_ids for d in parts), []) == c.token_ids
            assert [d.num_generated_tokens for d in parts] == [len(o.outputs[k].token_ids) for o in cum]
            if c.logprobs is not None:
                assert_same_logprobs(sum((d.logprobs for d in parts), []), c.logprobs)
            else:
                assert all(d.logprobs is None for d in parts)
            assert parts[-1].finish_reason == c.finish_reason
            assert max(len(d.token_ids) for d in parts) < len(c.token_ids)  # never the whole output


def assert_same_logprobs(a, b) -> None:
    """The same tokens and ranks with the same logprobs (within 1e-4: the three requests sit in
    different rows of the batch, whose fp32 GEMM rounds a row's sums by its position)."""
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b)
    for pa, pb in zip(a, b):
        for ta, tb in zip((pa.token, *pa.top), (pb.token, *pb.top), strict=True):
            assert (ta.token_id, ta.rank, ta.decoded) == (tb.token_id, tb.rank, tb.decoded)
            assert abs(ta.logprob - tb.logprob) < 1e-4


def test_output_kind_is_checked():
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    with pytest.raises(ValueError, match="output_kind must be one of 0 \\(CUMULATIVE\\)"):
        SamplingParams(output_kind=3)
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="DELTA")


def test_seeded_sampling_is_reproducible(smollm2):
    eng = make_engine(smollm2)
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    a = run(eng, "Tell me a story", p)[-1].outputs[0].token_ids
    b = run(eng, "Tell me a story", p)[-1].outputs[0].token_ids
    c = run(eng, "Tell me a story", SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99))
    assert a == b
    assert c[-1].outputs[0].token_ids != a


def test_n_sequences_differ_and_share_prompt(smollm2):
    eng = make_engine(smollm2)
    outs = run(eng, "My favourite animal is", SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=5))
    final = outs[-1]
    assert [o.index for o in final.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1
    assert not eng.scheduler.running and eng.kv_manager.num_free_blocks == eng.config.max_num_seqs


def test_stop_conditions(smollm2):
    eng = make_engine(smollm2)
    tok = smollm2.tokenizer
    greedy = run(eng, "Count: one, two, three,", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    text = greedy[-1].outputs[0].text
    ids = greedy[-1].outputs[0].token_ids
    # a stop string taken from the greedy continuation: the text is cut right before it
    stop = text[5:9]
    assert stop and stop in text
    out = run(eng, "Count: one, two, three,", SamplingParams(max_tokens=20, temperature=0, stop=[stop]))[-1]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]
    # stop token ids: stops on the 4th generated token, which is kept in token_ids
    out = run(eng, "Count: one, two, three,", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[ids[3]]))
    c = out[-1].outputs[0]
    first = ids.index(ids[3])
    assert c.finish_reason == "stop" and c.stop_reason == ids[3] and c.token_ids == ids[: first + 1]
    # length
    c = run(eng, "Hi", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[-1].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    # EOS ends with "stop" and is not in the text; min_tokens postpones it
    chat = tok.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    c = run(eng, chat, SamplingParams(max_tokens=64, temperature=0))[-1].outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] in eng.eos_token_ids
    assert "<|im_end|>" not in c.text
    n_eos = len(c.token_ids)
    c2 = run(eng, chat, SamplingParams(max_tokens=64, temperature=0, min_tokens=n_eos + 2))[-1].outputs[0]
    assert len(c2.token_ids) >= n_eos + 2
    assert all(t not in eng.eos_token_ids for t in c2.token_ids[: n_eos + 1])
    # ignore_eos: the same greedy answer runs through its EOS to max_tokens
    c3 = run(eng, chat, SamplingParams(max_tokens=n_eos + 2, temperature=0, ignore_eos=True))[-1].outputs[0]
    assert c3.finish_reason == "length" and c3.token_ids[:n_eos] == c.token_ids and len(c3.token_ids) == n_eos + 2


def test_logprobs_equal_log_softmax_of_model_logits(smollm2):
    eng = make_engine(smollm2)
    prompt = smollm2.tokenizer.encode("The sky is")
    out = run(eng, prompt, SamplingParams(max_tokens=6, temperature=0.7, seed=3, logprobs=3, prompt_logprobs=2))
    final = out[-1]
    c = final.outputs[0]
    seq = prompt + c.token_ids
    ref = torch.log_softmax(infer_logits(smollm2.model, [seq])[0], dim=-1)
    for j, entry in enumerate(c.logprobs):
        pos = len(prompt) - 1 + j
        assert entry.token.token_id == c.token_ids[j]
        assert entry.token.logprob == pytest.approx(ref[pos, c.token_ids[j]].item(), abs=1e-4)
        top_v, top_i = ref[pos].topk(3)
        assert [t.token_id for t in entry.top] == top_i.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(top_v.tolist(), abs=1e-4)
    assert final.prompt_logprobs[0] is None and len(final.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        e = final.prompt_logprobs[p]
        assert e.token.token_id == prompt[p]
        assert e.token.logprob == pytest.approx(ref[p - 1, prompt[p]].item(), abs=1e-4)
        assert len(e.top) == 2 and e.top[0].token_id == ref[p - 1].argmax().item()


def test_bad_input_is_rejected_clearly(smollm2):
    eng = make_engine(smollm2, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request("", SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(InvalidRequestError, match="context"):
        eng.add_request([1] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        eng.add_request([1] * 10, SamplingParams(max_tokens=60))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        eng.add_request([1, 10**6], SamplingParams())
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        eng.add_request("hi", SamplingParams(n=100))
    with pytest.raises(ValueError, match="unknown SamplingParams field"):
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 2})
    with pytest.raises(TypeError, match="unknown EngineConfig field"):
        EngineConfig.from_kwargs(model="smollm2-135m", batch_size=4)
    assert not eng.has_unfinished_requests()
    # the engine still works after all of that
    assert run(eng, "Hello", SamplingParams(max_tokens=2, temperature=0))[-1].finished


def test_abort_frees_the_row(smollm2):
    eng = make_engine(smollm2)
    req = eng.add_request("Hello there", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.scheduler.running
    assert eng.abort_request(req.request_id)
    assert not eng.scheduler.running and eng.kv_manager.num_free_blocks == eng.config.max_num_seqs
    assert not eng.has_unfinished_requests()
