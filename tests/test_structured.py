"""Phase 13: structured output (JSON schema, regex, choice) as a token mask in the batched sampler.

References: the ``jsonschema`` library validates every JSON output, Python's ``re.fullmatch``
checks regex outputs, a per-token Python loop is the reference of the packed-bitmask kernel, the
tokenizer's own ``decode`` is the reference of the byte vocabulary, and the engine without a
constraint is the reference for the rows next to a constrained one.
"""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

from infer.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.errors import InvalidRequestError
from infer.sampling import SamplingParams, SamplingTensors, sample, sample_reference
from infer.sampling.metadata import triton_usable
from infer.sampling.structured import (
    GuideMasks,
    IndexCache,
    StructuredOutputsParams,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    choice_regex,
    token_bytes,
)

pytest.importorskip("outlines_core")

# The schema suite: nested objects, arrays with min/max items, enums, bounded numbers, required vs
# optional fields, $ref/$defs, string patterns. Strings are bounded so sampled outputs end.
NAME = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": NAME, "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string",
                                                                                       "pattern": "[0-9]{5}"}},
                                  "required": ["city", "zip"]}}, "required": ["name", "address"]},
    "array-bounds": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3}}, "required": ["tags"]},
    "enum-and-bounds": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "score": {"type": "number"}, "level": {"type": "integer", "exclusiveMinimum": -3, "maximum": 3}},
        "required": ["color", "age", "level"]},
    "optional": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                  "note": NAME, "ok": {"type": "boolean"}},
                 "required": ["id"]},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                                       "maximum": 9},
                                                                 "y": {"type": "integer", "minimum": -9,
                                                                       "maximum": 9}},
                                 "required": ["x", "y"]}},
             "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
             "required": ["start", "end"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "[A-Z]{2}-[0-9]{3}"}},
                "required": ["code"]},
}
PROMPT = "Here is the data as JSON:"


@pytest.fixture(scope="module")
def engine(smollm2):
    return make_engine(smollm2)


def make_engine(loaded, **kw) -> LLMEngine:
    kw.setdefault("max_model_len", 512)
    return LLMEngine(EngineConfig(model=str(loaded.path), device="cpu", dtype="float32", **kw), loaded=loaded)


def run(engine: LLMEngine, items: list[tuple[str, SamplingParams]]):
    """Add every ``(prompt, params)`` at once and step until all finish; outputs in order."""
    reqs = [engine.add_request(p, sp) for p, sp in items]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step(stream=False):
            done[out.request_id] = out
    return [done[r.request_id] for r in reqs]


# ----------------------------------------------------------------------------- the mask


def test_token_bitmask_matches_the_per_token_reference_and_leaves_other_rows_alone():
    g = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32: the last word is partial
    logits = torch.randn(5, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 1])
    out = apply_token_bitmask(logits, bitmask, rows)
    ref = apply_token_bitmask_reference(logits, bitmask, rows)
    assert torch.equal(out, ref)
    for r in (0, 2, 4):
        assert torch.equal(out[r], logits[r])  # bit for bit
    assert not torch.equal(out, logits)
    # a mask shorter than the vocabulary (2 words for 77 tokens): the tokens past its 64 bits are disallowed
    short = bitmask[:, :2].contiguous()
    out = apply_token_bitmask(logits, short, rows)
    assert torch.equal(out, apply_token_bitmask_reference(logits, short, rows))
    assert torch.isneginf(out[rows, 64:]).all() and torch.equal(out[[0, 2, 4]], logits[[0, 2, 4]])


@pytest.mark.skipif(not (torch.cuda.is_available() or triton_usable("cpu")), reason="needs a GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("vocab, width", [(77, 3), (3000, 94), (3000, 80)])  # 80 words: tokens past 2,560 disallowed
def test_triton_token_bitmask_matches_the_reference(vocab, width):
    """The one-kernel mask of the Triton sampler against the plain-PyTorch function (and it
    against the per-token loop), on fresh random masks over several tiles of the vocabulary."""
    from infer.sampling.triton_sampler import apply_token_bitmask as apply_triton

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(vocab + width)
    logits = torch.randn(6, vocab, generator=g).to(dev)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, width), generator=g, dtype=torch.int64).to(torch.int32).to(dev)
    rows = torch.tensor([4, 0, 2], device=dev)
    out = apply_triton(logits, bitmask, rows)
    ref = apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(out, ref)
    assert torch.equal(ref.cpu(), apply_token_bitmask_reference(logits.cpu(), bitmask.cpu(), rows.cpu()))
    for r in (1, 3, 5):
        assert torch.equal(out[r], logits[r])
    assert torch.isinf(out[rows]).any() and not torch.isinf(logits).any()


def test_sampler_masks_only_constrained_rows_and_logprobs_are_of_the_masked_distribution():
    g = torch.Generator().manual_seed(1)
    vocab = 64
    logits = torch.randn(3, vocab, generator=g)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.9, seed=5, logprobs=3),
              SamplingParams(temperature=0.9, seed=6, logprobs=3)]
    t = SamplingTensors.from_params(params, [1, 2, 3], [0, 0, 0], None, None, None, vocab)
    base = sample(logits, t)
    allowed = [7, 40, 41]
    mask = torch.zeros(1, 2, dtype=torch.int32)
    for v in allowed:
        mask[0, v // 32] |= 1 << (v % 32)
    t.token_bitmask, t.token_bitmask_rows = mask, torch.tensor([1])
    for fn in (sample, sample_reference):
        out = fn(logits, t)
        assert int(out.next_tokens[1]) in allowed
        assert torch.equal(out.next_tokens[[0, 2]], base.next_tokens[[0, 2]])
        assert torch.equal(out.logprobs[[0, 2]], base.logprobs[[0, 2]])
        masked_lp = torch.log_softmax(logits[1, allowed], -1)
        assert set(out.top_logprob_ids[1].tolist()) == set(allowed)
        assert torch.allclose(out.top_logprobs[1].sort().values, masked_lp.sort().values)


def test_token_bytes_are_what_the_tokenizer_decodes(smollm2):
    tok = smollm2.tokenizer
    table = token_bytes(tok)
    text = 'Héllo {"a": [1, 2.5e-3]}\n\tüñí 日本 '
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(table[i] for i in ids) == text.encode()
    assert table[tok.encode(" {", add_special_tokens=False)[0]].startswith(b" ")  # "Ġ" mapped back to a space
    assert all(i not in table for i in tok.all_special_ids)


def test_choice_regex_matches_exactly_the_choices():
    choices = ["yes", "no", "a.b (c)", "x|y"]
    rx = choice_regex(choices)
    for c in choices:
        assert re.fullmatch(rx, c)
    for wrong in ["ye", "yesno", "aXb (c)", "x", "", "no "]:
        assert not re.fullmatch(rx, wrong)
    # it composes: inside a longer pattern it is still one unit
    assert re.fullmatch(rx + "!", "yes!") and not re.fullmatch(rx + "!", "yes")
    # anything but a non-empty list of non-empty strings is a ValueError (the server's 400), never a
    # regex that also accepts the empty output, nor a string read as a list of its characters
    for bad in ([], ["yes", ""], ["yes", 5], ["yes", None], "yes"):
        with pytest.raises(ValueError, match="non-empty"):
            choice_regex(bad)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("spec,match", [
    ({"json": {"type": "nope"}}, "invalid JSON schema"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"choice": []}, "non-empty"),
    ({"json": {"type": "number", "minimum": 0}}, "bounds are supported on integers only"),
    ({"json": {"type": "integer", "minimum": 0}}, "need both a minimum and a maximum"),
    ({"json": {"type": "array", "uniqueItems": True}}, "unsupported JSON schema feature 'uniqueItems'"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({}, "exactly one"),
])
def test_bad_constraints_raise_value_error(spec, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=spec)


def test_uncompilable_regex_is_an_invalid_request(engine):
    with pytest.raises(InvalidRequestError, match="cannot compile regex"):
        engine.add_request("x", SamplingParams(structured_outputs={"regex": "a(b"}))
    assert not engine.has_unfinished_requests()


# ----------------------------------------------------------------------------- the engine


def test_json_schema_suite_validates_greedy_and_sampled(engine):
    jsonschema = pytest.importorskip("jsonschema")
    items, schemas = [], []
    for name, schema in SCHEMAS.items():
        for seed in (None, 1):
            sp = SamplingParams(max_tokens=80, temperature=0.0 if seed is None else 1.0, seed=seed,
                                structured_outputs={"json": schema})
            items.append((f"{PROMPT} ({name})", sp))
            schemas.append(schema)
    outs = run(engine, items)
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, schema)
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_n_and_stop_strings(engine):
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    choices = ["yes", "no", "maybe so"]
    outs = run(engine, [
        ("Call me at", SamplingParams(max_tokens=30, temperature=1.0, seed=4, n=3,
                                      structured_outputs={"regex": phone})),
        ("Is it raining? Answer:", SamplingParams(max_tokens=10, temperature=1.5, seed=9, n=4,
                                                  structured_outputs={"choice": choices})),
        # a stop string inside the language ends the output early (the user's choice), like any other
        ("Digits:", SamplingParams(max_tokens=30, temperature=0.0, stop=["5"],
                                   structured_outputs={"regex": "[0-9]{20}"})),
    ])
    for c in outs[0].outputs:
        assert re.fullmatch(phone, c.text), c.text
    assert all(c.text in choices for c in outs[1].outputs)
    digits = outs[2].outputs[0]
    assert re.fullmatch("[0-9]*", digits.text)
    if digits.finish_reason == "stop" and len(digits.text) < 20:
        assert digits.stop_reason == "5"


def test_unconstrained_row_is_unchanged_by_a_constrained_neighbour(engine):
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = run(engine, [("The capital of France is", free), ("Colors:", SamplingParams(max_tokens=24,
                                                                                         temperature=0.0))])
    mixed = run(engine, [("The capital of France is", free),
                         ("Colors:", SamplingParams(max_tokens=24, temperature=0.0,
                                                    structured_outputs={"json": SCHEMAS["enum-and-bounds"]}))])
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids != alone[1].outputs[0].token_ids


def test_logprobs_list_only_allowed_tokens(engine):
    choices = ["yes", "no"]
    out = run(engine, [("Answer:", SamplingParams(max_tokens=5, temperature=0.0, logprobs=5,
                                                  structured_outputs={"choice": choices}))])[0].outputs[0]
    first = out.logprobs[0]
    for t in first.top:
        if t.logprob > float("-inf"):
            assert any(c.startswith(t.decoded) for c in choices), t.decoded
    assert sum(torch.tensor([t.logprob for t in first.top]).exp()) <= 1 + 1e-5
    assert first.token.logprob > -1e-3 or len(first.top) > 1


def test_async_scheduling_chunked_prefill_and_a_small_paged_cache_give_the_same_outputs(smollm2, engine):
    items = [(f"{PROMPT} ({n})", SamplingParams(max_tokens=30, temperature=1.0, seed=7, n=2,
                                                structured_outputs={"json": s}))
             for n, s in (("nested", SCHEMAS["nested"]), ("refs", SCHEMAS["refs"]))]
    ref = [[c.token_ids for c in o.outputs] for o in run(engine, items)]
    # smollm2 holds ~46 KB of K/V per token: 5.5 MiB is 7 blocks of 16 tokens, fewer than 4 sequences of
    # ~40 need: sequences wait for blocks
    for kw in ({"async_scheduling": True},
               {"kv_cache": "paged", "kv_cache_memory_bytes": 11 * 2**19, "block_size": 16, "max_model_len": 96,
                "chunked_prefill": True, "max_num_batched_tokens": 8}):
        eng = make_engine(smollm2, **kw)
        eng.index_cache = engine.index_cache  # same tokenizer: share the compiled indexes
        got = [[c.token_ids for c in o.outputs] for o in run(eng, items)]
        assert got == ref, kw


def test_async_scheduling_advances_the_guide_while_the_next_forward_runs(smollm2, engine):
    """With async scheduling a constrained row does not stall the loop: step N's forward is launched
    before step N - 1's token advances the guide, and the bitmask is written after that (the
    runner's sampling tensors carry it), so it always sees the automaton's current state: every
    output validates and equals the synchronous engine's."""
    import jsonschema

    from tests.test_async_scheduling import _record_order

    items = [(f"{PROMPT} ({i})", SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                                structured_outputs={"json": SCHEMAS["nested"]}))
             for i in range(2)]
    ref = [o.outputs[0] for o in run(engine, items)]
    eng = make_engine(smollm2, async_scheduling=True)
    eng.index_cache = engine.index_cache  # same tokenizer: share the compiled indexes
    events = _record_order(eng)
    got = [o.outputs[0] for o in run(eng, items)]
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for c in got:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMAS["nested"])
    # the prefill, then every decode step: its forward, the previous step's tokens, its bitmask;
    # the last step's tokens once nothing is left to schedule
    trace = " ".join(events)
    assert re.fullmatch(r"forward sampling_tensors( forward apply sampling_tensors)+( apply)+", trace), trace


def test_preempted_constrained_requests_resume_where_their_guide_was(smollm2, engine):
    """A constrained sequence preempted by recompute keeps its guide's state: after readmission
    its output still matches the regex and equals the output of an engine that never preempted."""
    import re

    regex = "[a-z ]+"
    items = [(f"{PROMPT} ({i})", SamplingParams(max_tokens=40, temperature=0.0, structured_outputs={"regex": regex}))
             for i in range(3)]
    ref = [o.outputs[0] for o in run(engine, items)]
    # 7 blocks of 16 tokens for 3 sequences of ~50 tokens: admitted together, they outgrow the pool
    eng = make_engine(smollm2, kv_cache="paged", kv_cache_memory_bytes=11 * 2**19, block_size=16,
                      max_model_len=96, batching="continuous")
    eng.index_cache = engine.index_cache
    got = [o.outputs[0] for o in run(eng, items)]
    assert eng.num_preemptions > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in ref]
    for c in got:
        assert re.fullmatch(regex, c.text), c.text


def test_a_slow_compile_does_not_stall_other_requests(engine):
    gate = threading.Event()
    cache = engine.index_cache
    compile_ = cache._compile

    def slow(regex):
        gate.wait(30)
        return compile_(regex)

    cache._compile = slow
    try:
        slow_req = engine.add_request("x", SamplingParams(max_tokens=5, structured_outputs={"regex": "z{1,3}q"}))
        free = engine.add_request("y", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        finished = set()
        for _ in range(20):
            finished |= {o.request_id for o in engine.step(stream=False)}
            if free.request_id in finished:
                break
        assert free.request_id in finished and slow_req.request_id not in finished
        gate.set()
        while engine.has_unfinished_requests():
            for o in engine.step(stream=False):
                if o.request_id == slow_req.request_id:
                    assert re.fullmatch("z{1,3}q", o.outputs[0].text)
    finally:
        cache._compile = compile_
        gate.set()


def test_a_dead_end_ends_the_sequence_with_an_error_not_a_hang(engine):
    """A guide whose only allowed token lies past the logits' width (the model's vocabulary): the
    mask would remove every token. The sequence ends with finish_reason "error"; a neighbour is fine."""
    from outlines_core import Guide, Index, Vocabulary

    eos = engine.eos_token_ids[0]
    beyond = engine.vocab_size + 5
    req = engine.add_request("x", SamplingParams(max_tokens=5, structured_outputs={"regex": "q+"}))
    free = engine.add_request("y", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while req.request_id in engine._compiling:
        engine._admit_compiled(wait=True)
    req.seqs[0].guide = Guide(Index("q+", Vocabulary(eos, {b"q": [beyond]})))
    done = {}
    for _ in range(20):
        done.update({o.request_id: o for o in engine.step(stream=False)})
        if not engine.has_unfinished_requests():
            break
    assert done[req.request_id].outputs[0].finish_reason == "error"
    assert done[free.request_id].outputs[0].finish_reason == "length"


def test_index_cache_is_a_bounded_lru(smollm2):
    cache = IndexCache(smollm2.tokenizer, smollm2.tokenizer.eos_token_ids[0], max_size=2)
    a = cache.get("a+")
    cache.get("b+")
    assert cache.get("a+") is a and cache.hits == 1
    cache.get("c+")  # evicts b+ (least recently used)
    assert len(cache) == 2
    assert cache.get("a+") is a
    misses = cache.misses
    cache.get("b+")
    assert cache.misses == misses + 1
    assert StructuredOutputsParams(choice=["a"]).to_regex() == "(a)"
    cache.close()


def test_guide_masks_agree_with_the_guides_own_answers(smollm2):
    """The per-state masks the engine keeps (and its completion check) against their references,
    ``write_mask_into`` straight from the guide and ``get_tokens()`` (the allowed ids as a list):
    equal on every state of random walks through constraints that end (a choice, a bounded schema)
    and one that never closes (an open string: finished at every step yet never EOS-only), with
    an LRU of 2 states so that masks are evicted and rebuilt along the way."""
    import numpy as np
    from outlines_core import Guide

    tok = smollm2.tokenizer
    eos = tok.eos_token_ids
    cache = IndexCache(tok, eos[0])
    rng = torch.Generator().manual_seed(0)
    seen = set()
    for regex in [StructuredOutputsParams(choice=["yes", "no", "maybe"]).to_regex(),
                  StructuredOutputsParams(json=SCHEMAS["enum-and-bounds"]).to_regex(), "[a-z ]+", "ab?"]:
        index = cache.get(regex).result()
        masks = GuideMasks(eos, tok.vocab_size, max_states=2)  # one per index: state ids are the index's
        for _ in range(4):
            guide = Guide(index)
            for _ in range(60):
                allowed = guide.get_tokens()
                expected = all(t in eos for t in allowed)
                assert masks.eos_only(guide) == expected
                seen.add(expected)
                direct = np.zeros(masks.words, dtype=np.uint32)
                guide.write_mask_into(direct.ctypes.data, masks.words, 4)
                assert np.array_equal(masks.mask(guide), direct)
                options = [t for t in allowed if t not in eos]
                if not options:
                    break
                guide.advance(options[int(torch.randint(len(options), (1,), generator=rng))], return_tokens=False)
            assert len(masks._masks) <= 2
    assert seen == {True, False}  # both answers were exercised
    cache.close()


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_mask_matches_cpu_and_constraints_hold_with_graphs_and_async(tiny_llama):
    """On CUDA: the bitmask kernel gives the CPU result; regex/choice constraints hold, and give the
    same tokens, with CUDA graphs + async scheduling on and off (random weights: the constraint does
    all the work)."""
    from infer.loader import load_model

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 1000, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 32), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([0, 4, 5])
    assert torch.equal(apply_token_bitmask(logits.cuda(), bitmask.cuda(), rows.cuda()).cpu(),
                       apply_token_bitmask(logits, bitmask, rows))
    loaded = load_model(str(tiny_llama.path), device="cuda", dtype=torch.float32, progress=False)
    items = [("a", SamplingParams(max_tokens=20, temperature=1.0, seed=i, n=2,
                                  structured_outputs={"regex": "[0-9]{3}-[a-z]{2,4}"})) for i in range(6)]
    items += [("b", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    outs = {}
    for kw in ({}, {"cuda_graphs": True, "async_scheduling": True, "attention_backend": "triton"}):
        eng = LLMEngine(EngineConfig(model=str(loaded.path), device="cuda", dtype="float32", max_model_len=128,
                                     kv_cache="paged", max_num_seqs=16, **kw), loaded=loaded)
        got = run(eng, items)
        for o in got[:-1]:
            assert all(re.fullmatch("[0-9]{3}-[a-z]{2,4}", c.text) for c in o.outputs)
        outs[bool(kw)] = [[c.token_ids for c in o.outputs] for o in got]
    assert outs[True] == outs[False]
