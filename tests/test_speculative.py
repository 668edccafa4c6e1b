"""Phase 12: speculative decoding.

References: the same engine without speculation (which earlier phases test against HF transformers)
for the tokens, which must be identical (greedy, and seeded sampling too: a verifying row draws from its
sequence's random stream at the place decoding would); a brute-force definition of prompt lookup for the
n-gram proposer; the target distribution itself for the rejection rule (a chi-square test with enough
samples, its threshold from the chi-square quantile); a simulation of the proposer over the reference
output for the acceptance counters.
"""

from __future__ import annotations

import argparse
import json
import random

import pytest
import torch

from infer.config import EngineConfig, SpeculativeConfig, add_engine_args, engine_config_from_args
from infer.engine.llm_engine import LLMEngine
from infer.engine.spec_decode import ngram_propose, num_accepted
from infer.sampling import SamplingParams
from infer.sampling.rejection import rejection_sample
from tests.test_batching import assert_pool_full, make_engine
from tests.test_chunked_prefill import assert_blocks_consistent, run
from tests.test_prefix_caching import assert_drained, assert_prefix_pool_consistent

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ----------------------------------------------------------------------------- configuration


def test_speculative_config_parses_vllm_json_and_fills_lookup_defaults():
    s = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_max, s.prompt_lookup_min) == ("ngram", 4, 4, 4)
    s = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    assert (s.prompt_lookup_max, s.prompt_lookup_min) == (5, 5)  # vLLM's default
    s = SpeculativeConfig.parse({"model": "smollm2-135m", "num_speculative_tokens": 3})
    assert (s.method, s.model) == ("draft", "smollm2-135m")
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "m", "num_speculative_tokens": 1}).method == "draft"
    assert s.backoff and not SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                                      "backoff": False}).backoff


@pytest.mark.parametrize("value, match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min=3 > prompt_lookup_max=2"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "backoff": "yes"}, "backoff must be true or false"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "takes no model"),
    ({"method": "draft", "num_speculative_tokens": 2}, "needs model"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_speculative_config_rejects_bad_values(value, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(device="cpu", speculative_config=value).validate()


def test_speculative_config_rejects_lora_and_optimize_turns_async_scheduling_on():
    with pytest.raises(ValueError, match="enable_lora is not supported yet"):
        EngineConfig(device="cpu", enable_lora=True, speculative_config=NGRAM).validate()
    with pytest.raises(ValueError, match="enable_lora is not supported yet"):
        EngineConfig(device="cpu", optimize=True, enable_lora=True, speculative_config=NGRAM).validate()
    head = {"method": "eagle3", "model": "head-dir", "num_speculative_tokens": 2}
    for spec in (NGRAM, head):  # (steps that verify drafts run synchronously)
        c = EngineConfig(device="cpu", optimize=True, speculative_config=spec).validate()
        assert c.async_scheduling is True and c.speculative.method == spec["method"]
    assert EngineConfig(device="cpu").validate().speculative is None


def test_the_cli_takes_vllms_speculative_config_json():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--device", "cpu", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'])
    c = engine_config_from_args(args).validate()
    assert (c.speculative.num_speculative_tokens, c.speculative.prompt_lookup_min, c.speculative.prompt_lookup_max) \
        == (3, 2, 2)


# ----------------------------------------------------------------------------- the proposer and acceptance


def ngram_brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Prompt lookup by its definition: for n from max_n down to min_n, the first s with
    tokens[s:s+n] == tokens[-n:] and s + n < len(tokens); propose tokens[s+n : s+n+k]."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        for s in range(len(tokens) - n):
            if tokens[s:s + n] == tokens[len(tokens) - n:]:
                return tokens[s + n:s + n + k]
    return []


def test_ngram_lookup_by_hand_and_against_its_definition():
    assert ngram_propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]  # vLLM's docstring example
    # the 2-gram [5, 6] wins over the 1-gram [6], which occurs earlier
    assert ngram_propose([6, 9, 5, 6, 7, 8, 5, 6], 1, 2, 2) == [7, 8]
    assert ngram_propose([6, 9, 5, 6, 7, 8, 5, 6], 1, 1, 2) == [9, 5]  # the earliest occurrence of [6]
    assert ngram_propose([1, 2, 3], 1, 3, 4) == []
    assert ngram_propose([7, 7, 7], 1, 2, 5) == [7]  # the proposal runs into the suffix, then the sequence ends
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 5)
        k = rng.randrange(1, 6)
        assert ngram_propose(tokens, lo, hi, k) == ngram_brute_force(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_num_accepted_is_the_longest_agreeing_prefix():
    assert num_accepted([5, 6, 7, 8], [5, 6, 7]) == 3  # all accepted; 8 is the bonus token
    assert num_accepted([5, 9, 7, 8], [5, 6, 7]) == 1  # 9 replaces the rejected 6; 7 after it does not count
    assert num_accepted([4, 6, 7, 8], [5, 6, 7]) == 0
    assert num_accepted([4], []) == 0


# ----------------------------------------------------------------------------- the rejection rule


def chi2_quantile(q: float, df: int) -> float:
    """The q-quantile of the chi-square distribution with ``df`` degrees of freedom: its CDF is the regularized
    lower incomplete gamma function P(df / 2, x / 2) (``torch.special.gammainc``), inverted by bisection."""
    lo, hi = 0.0, 10.0 * df + 100.0
    k = torch.tensor(df / 2, dtype=torch.float64)
    for _ in range(200):
        mid = (lo + hi) / 2
        if float(torch.special.gammainc(k, torch.tensor(mid / 2, dtype=torch.float64))) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def test_chi2_quantile_against_known_values():
    # tables: chi2(1) 0.95 -> 3.841, chi2(5) 0.9999 -> 25.745
    assert chi2_quantile(0.95, 1) == pytest.approx(3.8415, abs=1e-3)
    assert chi2_quantile(1 - 1e-4, 5) == pytest.approx(25.745, abs=1e-2)


def chi_square_ok(samples: torch.Tensor, probs: torch.Tensor, alpha: float = 1e-4) -> tuple[bool, float, float]:
    """Pearson's chi-square of ``samples`` (token ids) against ``probs``, over the tokens with p > 0 (a
    sample outside them fails at once); passes below the (1 - alpha) quantile of chi2(df)."""
    v = probs.shape[0]
    counts = torch.bincount(samples, minlength=v).double()
    n = counts.sum()
    support = probs > 0
    if counts[~support].sum() > 0:
        return False, float("inf"), 0.0
    expected = probs[support].double() * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    limit = chi2_quantile(1 - alpha, int(support.sum()) - 1)
    return stat < limit, stat, limit


def random_dist(g: torch.Generator, shape, zeros: int = 1) -> torch.Tensor:
    """Random distributions over the last dim, with ``zeros`` tokens of probability 0 in each."""
    x = torch.rand(shape, generator=g, dtype=torch.float64) + 0.05
    x[..., :zeros] = 0
    x = x[..., torch.randperm(shape[-1], generator=g)]
    return x / x.sum(-1, keepdim=True)


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_emits_the_target_distribution(point_mass):
    """Whatever the draft distribution q: the first emitted token is distributed as p_1, given that the
    first draft was accepted the second as p_2, and given that both were the bonus token as p_3 (the
    distributions are the same for every row, so the N rows are N independent trials)."""
    g = torch.Generator().manual_seed(1)
    v, k, n = 6, 2, 200_000
    p = random_dist(g, (k + 1, v))
    q = random_dist(g, (k, v), zeros=2)
    if point_mass:  # a greedy proposer: always the same drafts (tokens the target can emit)
        drafts = (p[:k] > 0).double().argmax(-1).expand(n, k).contiguous()
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[i].float(), n, replacement=True, generator=g) for i in range(k)], 1)
        draft_probs = q.expand(n, k, v)
    out, acc = rejection_sample(p.expand(n, k + 1, v), drafts, draft_probs, generator=g)
    ok, stat, limit = chi_square_ok(out[:, 0], p[0])
    assert ok, f"first token: chi2 {stat:.1f} >= {limit:.1f}"
    second = out[acc >= 1, 1]
    ok, stat, limit = chi_square_ok(second, p[1])
    assert ok, f"second token: chi2 {stat:.1f} >= {limit:.1f}"
    bonus = out[acc == k, k]  # both drafts accepted: the bonus token, from p_3
    assert len(bonus) > 1000
    ok, stat, limit = chi_square_ok(bonus, p[k])
    assert ok, f"bonus token: chi2 {stat:.1f} >= {limit:.1f}"
    # the acceptance rate of the first draft is sum_v min(p, q) (1 - total variation); 5 sigma
    rate = torch.minimum(p[0], q[0] if not point_mass else torch.nn.functional.one_hot(drafts[0, 0], v)).sum()
    assert abs(float((acc >= 1).double().mean()) - float(rate)) < 5 * (float(rate) * (1 - float(rate)) / n) ** 0.5
    # what is emitted is the accepted drafts, then one token; -1 after it
    rows = torch.arange(n)
    assert torch.equal(out[:, :k][torch.arange(k)[None, :] < acc[:, None]], drafts[torch.arange(k)[None, :] < acc[:, None]])
    assert bool((out[rows, acc] >= 0).all())
    assert bool((out[:, 1:][torch.arange(1, k + 1)[None, :] > acc[:, None]] == -1).all())


def test_rejection_sampling_with_the_target_as_draft_accepts_everything():
    g = torch.Generator().manual_seed(2)
    p = random_dist(g, (3, 5))
    drafts = torch.stack([torch.multinomial(p[i].float(), 1000, replacement=True, generator=g) for i in range(2)], 1)
    _, acc = rejection_sample(p.expand(1000, 3, 5), drafts, p[:2].expand(1000, 2, 5), generator=g)
    assert bool((acc == 2).all())
    with pytest.raises(ValueError, match="draft_token_ids"):
        rejection_sample(p[None], drafts[:1, :1], None)


# ----------------------------------------------------------------------------- the engine


KW = dict(batching="continuous", kv_cache="paged", max_model_len=160, max_num_seqs=4, block_size=8)


def repetitive(rng: random.Random, vocab: int, n: int) -> list[int]:
    """A prompt that repeats a short phrase (prompt lookup finds matches at once)."""
    phrase = [rng.randrange(10, vocab) for _ in range(rng.randrange(3, 7))]
    return (phrase * (n // len(phrase) + 1))[:n]


def workload(vocab: int, seed: int = 0):
    """Greedy and seeded requests, repetitive and random prompts, arriving while others decode, with EOS
    allowed (ignore_eos off) in two, logprobs in one, n = 2 in one, a repetition penalty and min_tokens."""
    rng = random.Random(seed)
    rand = [rng.randrange(10, vocab) for _ in range(23)]
    g = dict(temperature=0.0)
    return [
        (0, repetitive(rng, vocab, 40), SamplingParams(max_tokens=30, ignore_eos=True, **g)),
        (0, rand, SamplingParams(max_tokens=25, ignore_eos=True, logprobs=2, **g)),
        (1, repetitive(rng, vocab, 17), SamplingParams(max_tokens=21, seed=5, temperature=0.9, ignore_eos=True)),
        (3, repetitive(rng, vocab, 30), SamplingParams(max_tokens=28, **g)),
        (4, rand[:9], SamplingParams(n=2, max_tokens=12, seed=7, temperature=1.0, ignore_eos=True)),
        # sampler state per token (penalties, a min_tokens ban): these decode one token at a time, beside
        # sequences that verify drafts in the same step
        (2, repetitive(rng, vocab, 25), SamplingParams(max_tokens=14, repetition_penalty=1.3, ignore_eos=True, **g)),
        (2, repetitive(rng, vocab, 21), SamplingParams(max_tokens=14, min_tokens=8, seed=3, temperature=0.8)),
    ]


def assert_rolled_back(engine) -> None:
    """After every step: the allocator is consistent, no running sequence holds a block past its tokens
    (the blocks of rejected drafts were given back) or counts a rejected draft as computed, and (prefix
    caching) every block with a key holds the tokens the sequence really has there."""
    kv = engine.kv_manager
    if kv.prefix_caching:
        assert_prefix_pool_consistent(engine)
    else:
        assert_blocks_consistent(engine)
    bs = kv.block_size
    for seq in engine.scheduler.running:
        if seq.num_computed_tokens:
            # (a draft model's proposer reserves the blocks its drafts' K/V goes to: all but the last draft's)
            ahead = max(0, len(seq.spec_token_ids) - 1)
            assert len(seq.block_table) <= kv.blocks_for(max(len(seq.token_ids) + ahead, seq.num_computed_tokens + 1))
            assert seq.num_computed_tokens <= len(seq.token_ids)
        for i in range(seq.num_cached_blocks):
            assert kv.pool.block_tokens[seq.block_table[i]] == tuple(seq.token_ids[i * bs:(i + 1) * bs])


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return run(make_engine(tiny_llama, **KW), workload(tiny_llama.config.vocab_size))


def test_greedy_and_seeded_outputs_are_identical_with_ngram_speculation(tiny_llama, reference):
    engine = make_engine(tiny_llama, speculative_config=NGRAM, **KW)
    got = run(engine, workload(tiny_llama.config.vocab_size), check=assert_rolled_back)
    for rid in reference:
        assert got[rid]["tokens"] == reference[rid]["tokens"], rid
        lp, ref_lp = got[rid]["logprobs"], reference[rid]["logprobs"]
        if ref_lp[0] is not None:  # the logprobs of the emitted tokens, from the verify rows
            assert lp[0] == pytest.approx(ref_lp[0], abs=1e-4)
    stats = engine.stats()
    # speculation did happen, with both outcomes
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert_pool_full(engine)


def test_verify_steps_staged_as_decode_rows_give_the_extend_logits(tiny_llama):
    """The CUDA-graph route of a verify step (``stage_rows``: every token a decode row of context
    ``position + 1`` over its sequence's table, as the decode graphs read them) computes what the extend
    layout computes: at every step of an ngram-speculating engine where each sequence decodes or verifies,
    the model run eagerly on the staged rows as ``T`` decodes (the decode attention, one row per token)
    gives the logits of the flat step's sampled rows (the extend attention over the drafts), and the
    padding rows are inert (slot -1, context 0)."""
    import numpy as np

    from infer.engine.graph_staging import stage_rows
    from infer.engine.step import BlockTableRows, StepInputs

    engine = make_engine(tiny_llama, speculative_config=NGRAM, **KW)
    runner, kept, seen = engine.runner, BlockTableRows(16, 32), {"steps": 0, "drafts": 0}
    execute = runner.execute

    def check(scheduled, eos_ids, prev=None):
        step = StepInputs(scheduled, prev, runner)
        if step.has_spec and all(i.num_tokens == 1 + len(i.spec_token_ids) and not i.forks for i in scheduled):
            f = step.flat
            t, bs = len(f.ids), len(f.ids) + 3
            h = np.full(4 * bs + t * 32, -7, dtype=np.int64)
            row_seq = np.repeat(np.arange(len(f.scheduled)), [i.num_tokens for i in f.scheduled])
            width = stage_rows(f.ids, f.positions, f.slots, row_seq, f.tables, kept, h, bs)
            ids, pos, slots, ctx = (h[k * bs: (k + 1) * bs] for k in range(4))
            assert (ids[t:] == 0).all() and (pos[t:] == 0).all() and (slots[t:] == -1).all() and (ctx[t:] == 0).all()
            tables = h[4 * bs: 4 * bs + t * width].reshape(t, width)
            rows_tables = [tables[r, : -(-int(ctx[r]) // 8)].tolist() for r in range(t)]
            meta = runner._metadata(list(range(t + 1)), ctx[:t].tolist(), torch.tensor(slots[:t]), rows_tables, t)
            as_rows = runner._forward(torch.tensor(ids[:t]), torch.tensor(pos[:t]), meta)
            want = runner._logits(runner._forward(torch.tensor(f.ids), torch.tensor(f.positions), step.metadata),
                                  f.sample_at)
            got = runner._logits(as_rows, f.sample_at)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
            seen["steps"] += 1
            seen["drafts"] += t - len(f.scheduled)
        return execute(scheduled, eos_ids, prev)

    runner.execute = check
    run(engine, workload(tiny_llama.config.vocab_size))
    assert seen["steps"] > 10 and seen["drafts"] > 20


def test_decisive_random_weights_decode_a_fixed_walk_with_a_wide_margin(tmp_path):
    """``make_synthetic_checkpoint.py --random-weights --decisive`` (the GPU replay benchmark's weights, whose
    greedy tokens bf16 rounding must not flip): the greedy output is the walk ``t -> argmax(lm_head @ e_t)``
    computed from the loaded embedding and LM head alone, and the forward's chosen logit beats the runner-up
    by several logit units already at hidden size 128 (plain random weights: hundredths)."""
    import sys
    from pathlib import Path

    from infer.llm import LLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    with pytest.raises(ValueError, match="random_weights"):
        make_checkpoint("tiny-llama", tmp_path / "x", dtype="float32", device="cpu", decisive=True)
    margins = {}
    for decisive in (False, True):
        path = make_checkpoint("tiny-llama", tmp_path / str(decisive), dtype="float32", device="cpu",
                               random_weights=True, decisive=decisive)
        llm = LLM(str(path), device="cpu", dtype="float32", progress=False)
        model = llm.engine.runner.model
        prompt = [17, 301, 5, 999]
        out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
                           use_tqdm=False)[0].outputs[0]
        top2 = [sorted(lp.top, key=lambda x: -x.logprob)[:2] for lp in out.logprobs]
        margins[decisive] = min(a.logprob - b.logprob for a, b in top2)  # = the logit gap (same softmax)
        if decisive:
            emb, head = model.model.embed_tokens.weight, model.lm_head.weight
            walk = [prompt[-1]]
            for _ in range(12):
                walk.append(int((head @ emb[walk[-1]]).argmax()))
            assert out.token_ids == walk[1:]
    assert margins[True] > 5 > 1 > margins[False], margins  # (logit units; the gap grows as sqrt(hidden_size))


def test_backoff_pauses_double_after_three_missed_rounds_and_a_hit_resets(tiny_llama):
    """``record_round`` on a real sequence, round after round (each round happens after its pause ran out):
    no pause for two misses in a row, then 1, 2, 4, 8, 16 steps, 16 again (the cap); an accepted draft
    resets the count, so the next pause comes after three more misses. Derived by hand from the rule."""
    from infer.engine.spec_decode import record_round

    seq = make_engine(tiny_llama, **KW).add_request([5, 6, 7], SamplingParams(max_tokens=4)).seqs[0]
    pauses = []
    for accepted in (0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0):
        seq.spec_pause = 0
        record_round(seq, accepted)
        pauses.append(seq.spec_pause)
    assert pauses == [0, 0, 1, 2, 4, 8, 16, 16, 16, 0, 0, 0, 1]


@pytest.mark.parametrize("method", ["ngram", "draft", "ngram-every-step"])
def test_async_scheduling_with_speculation_keeps_the_outputs(tiny_llama, reference, method):
    """Async scheduling with speculation: steps that verify drafts run synchronously (the step in flight is
    waited for, its sequences propose), steps where no sequence speculates run ahead of the host. The mixed
    workload (seeded sampling, logprobs, n = 2, penalties, arrivals mid-decode) gives the tokens of the
    engine without either; with the backoff both kinds of step happen, and drafts are verified."""
    spec = {"ngram": NGRAM, "ngram-every-step": {**NGRAM, "backoff": False},
            "draft": {**draft(tiny_llama.path), "num_speculative_tokens": 2}}[method]
    engine = make_engine(tiny_llama, speculative_config=spec, async_scheduling=True, **KW)
    kinds = {"sync": 0, "async": 0}
    step_async, step_speculating = engine._step_async, engine._step_speculating

    def counted(kind, fn):
        def wrapped(stream):
            kinds[kind] += 1
            return fn(stream)
        return wrapped

    engine._step_async, engine._step_speculating = counted("async", step_async), counted("sync", step_speculating)
    got = run(engine, workload(tiny_llama.config.vocab_size), check=assert_rolled_back)
    for rid in reference:
        assert got[rid]["tokens"] == reference[rid]["tokens"], rid
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0 and kinds["sync"] > 0 and kinds["async"] > 0, kinds
    assert_pool_full(engine)


def test_stop_strings_max_tokens_and_eos_inside_an_accepted_run(tiny_llama):
    """A run of accepted drafts can cross a stop: the output ends exactly where decoding ends it."""
    tok = tiny_llama.tokenizer
    rng = random.Random(3)
    prompt = repetitive(rng, tiny_llama.config.vocab_size, 48)
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = run(make_engine(tiny_llama, **KW), [(0, prompt, base)])["r0"]["tokens"][0]
    text = tok.decode(ref)
    # a stop string from the middle of the output, a stop token id and an EOS id that occur late in it
    stop_str = text[len(text) * 2 // 3:][:3]
    late = ref[len(ref) * 3 // 4]
    arrivals = [(0, prompt, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_str], ignore_eos=True)),
                (0, prompt, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[late], ignore_eos=True)),
                (0, prompt, SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True))]
    want = run(make_engine(tiny_llama, **KW), arrivals)
    engine = make_engine(tiny_llama, speculative_config={**NGRAM, "num_speculative_tokens": 6}, **KW)
    got = run(engine, arrivals, check=assert_rolled_back)
    assert got == want
    assert len(got["r2"]["tokens"][0]) == 13 and len(got["r1"]["tokens"][0]) < 40
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_pool_full(engine)


@pytest.mark.parametrize("backoff", [False, True], ids=["every-step", "backoff"])
def test_acceptance_counters_match_a_simulation_over_the_reference_output(tiny_llama, backoff):
    """One sequence, greedy: replay the proposer over the non-speculative output. Each round proposes from
    the tokens so far, accepts the longest prefix that agrees with the reference's next tokens, and emits
    one more; the engine's counters must be these. With the backoff, after 3 rounds in a row that accepted
    nothing the sequence skips proposing for 1, 2, 4, ... (at most 16) steps, each emitting one token."""
    rng = random.Random(5)
    prompt = repetitive(rng, tiny_llama.config.vocab_size, 30)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    ref = run(make_engine(tiny_llama, **KW), [(0, prompt, params)])["r0"]["tokens"][0]
    k, lo, hi = 3, 1, 1
    drafts = draft_tokens = accepted = misses = pause = paused_steps = 0
    per_pos = [0] * k
    tokens = prompt + ref[:1]  # the prefill emits the first token
    while len(tokens) - len(prompt) < len(ref):
        left = len(ref) - (len(tokens) - len(prompt)) - 1
        if backoff and pause:
            pause, d, paused_steps = pause - 1, [], paused_steps + 1
        else:
            d = ngram_propose(tokens, lo, hi, min(k, left)) if left > 0 else []
        nxt = ref[len(tokens) - len(prompt):]
        a = num_accepted(nxt[:len(d) + 1], d)
        if d:
            drafts, draft_tokens, accepted = drafts + 1, draft_tokens + len(d), accepted + a
            for i in range(a):
                per_pos[i] += 1
            misses = 0 if a else misses + 1
            if misses >= 3:
                pause = min(2 ** (misses - 3), 16)
        tokens += nxt[:a + 1]
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi,
            "backoff": backoff}
    engine = make_engine(tiny_llama, speculative_config=spec, **KW)
    assert run(engine, [(0, prompt, params)])["r0"]["tokens"][0] == ref
    s = engine.stats()
    assert (s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]) \
        == (drafts, draft_tokens, accepted)
    assert engine.spec_stats.accepted_per_pos == per_pos
    assert s["spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    assert accepted > 0
    assert (paused_steps >= 3) == backoff, paused_steps  # the backoff did pause, more than once


def test_preemption_prefix_caching_and_chunked_prefill_keep_the_outputs(tiny_llama, reference):
    """A KV cache small enough to preempt, with prefix caching and chunked prefill on: the same tokens."""
    per_block = tiny_llama.config.kv_bytes_per_token(torch.float32) * KW["block_size"]
    engine = make_engine(tiny_llama, speculative_config=NGRAM, prefix_caching=True, chunked_prefill=True,
                         max_num_batched_tokens=24, kv_cache_memory_bytes=per_block * 12,
                         **{**KW, "max_model_len": 80})
    got = run(engine, workload(tiny_llama.config.vocab_size), check=assert_rolled_back)
    assert {rid: v["tokens"] for rid, v in got.items()} == {rid: v["tokens"] for rid, v in reference.items()}
    assert engine.num_preemptions > 0
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert_drained(engine)


def test_server_takes_speculative_config_and_exposes_vllms_counters(tiny_llama, tmp_path):
    """``python -m infer.server --speculative-config '{...}'`` (vLLM's command line): the completion's tokens
    are the in-process engine's without speculation, and ``/metrics`` counts what the same request drafted
    and accepted in an in-process engine with speculation."""
    import httpx

    from tests.server_fixture import ServerProcess, metric_value

    prompt = repetitive(random.Random(6), tiny_llama.config.vocab_size, 24)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = run(make_engine(tiny_llama, **KW), [(0, prompt, params)])["r0"]["tokens"][0]
    spec_engine = make_engine(tiny_llama, speculative_config=NGRAM, **KW)
    run(spec_engine, [(0, prompt, params)])
    stats = spec_engine.stats()
    srv = ServerProcess(tmp_path, ["--model", str(tiny_llama.path), "--device", "cpu", "--batching", "continuous",
                                   "--kv-cache", "paged", "--block-size", "8", "--max-model-len", "160",
                                   "--speculative-config", json.dumps(NGRAM), "--log-level", "warning"],
                        env={"OMP_NUM_THREADS": str(torch.get_num_threads())})
    try:
        srv.wait_ready()
        model = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == len(want)
        assert r.json()["choices"][0]["text"] == tiny_llama.tokenizer.decode(want)
        text = srv.metrics()
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert metric_value(text, f"infer:spec_decode_{name}_total") == stats[f"spec_decode_{name}"], name
        assert metric_value(text, "infer:spec_decode_num_accepted_tokens_per_pos_total", position="0") == \
            spec_engine.spec_stats.accepted_per_pos[0]
        assert stats["spec_decode_num_accepted_tokens"] > 0
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- a draft model


@pytest.fixture(scope="module")
def other_tiny_llama(tmp_path_factory):
    """A tiny Llama of the same shapes and tokenizer as ``tiny_llama`` but other random weights: a bad draft."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    return make_checkpoint("tiny-llama", tmp_path_factory.mktemp("other-llama"), dtype="float32", device="cpu", seed=1)


def draft(model, k: int = 3) -> dict:
    return {"method": "draft", "model": str(model), "num_speculative_tokens": k}


def test_a_draft_model_equal_to_the_target_is_always_accepted_when_greedy(tiny_llama):
    rng = random.Random(8)
    arrivals = [(0, [rng.randrange(10, 1000) for _ in range(n)], SamplingParams(temperature=0.0, max_tokens=m,
                                                                                ignore_eos=True))
                for n, m in ((11, 20), (30, 17), (5, 26))]
    want = run(make_engine(tiny_llama, **KW), arrivals)
    engine = make_engine(tiny_llama, speculative_config=draft(tiny_llama.path), **KW)
    got = run(engine, arrivals, check=assert_rolled_back)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in want.items()}
    s = engine.stats()
    assert s["spec_decode_num_draft_tokens"] > 0
    assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"]
    assert_pool_full(engine)


def test_a_draft_model_keeps_the_outputs_when_the_budget_drops_its_drafts(tiny_llama):
    """Chunked prefill under a 24-token budget beside a 90-token prompt: some steps have no budget left for a
    sequence's drafts, which then decodes one token (``Scheduler._add_drafts``); the draft model's cache must
    forget the drafts' K/V it wrote (it once ran ahead of the tokens and crashed the next proposal). The
    target as its own draft: the tokens of the engine without speculation, every verified draft accepted."""
    rng = random.Random(8)
    arrivals = [(0, [rng.randrange(10, 1000) for _ in range(n)], SamplingParams(temperature=0.0, max_tokens=m,
                                                                                ignore_eos=True))
                for n, m in ((11, 20), (30, 17), (5, 26), (90, 12))]
    kw = {**KW, "chunked_prefill": True, "max_num_batched_tokens": 24}
    want = run(make_engine(tiny_llama, **kw), arrivals)
    engine = make_engine(tiny_llama, speculative_config=draft(tiny_llama.path), **kw)
    dropped = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        dropped.extend(i for i in out if i.seq.spec_token_ids and not i.spec_token_ids and i.num_tokens == 1)
        return out

    engine.scheduler.schedule = spy
    got = run(engine, arrivals, check=assert_rolled_back)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in want.items()}
    s = engine.stats()
    assert dropped and s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"] > 0


def test_a_bad_draft_model_changes_no_token(tiny_llama, other_tiny_llama, reference):
    """Another model's greedy guesses: mostly rejected, and the greedy and seeded outputs are still the
    target's own (with preemptions, so the draft's KV cache is rebuilt too)."""
    per_block = tiny_llama.config.kv_bytes_per_token(torch.float32) * KW["block_size"]
    engine = make_engine(tiny_llama, speculative_config=draft(other_tiny_llama), kv_cache_memory_bytes=per_block * 12,
                         **{**KW, "max_model_len": 80})
    got = run(engine, workload(tiny_llama.config.vocab_size), check=assert_rolled_back)
    assert {rid: v["tokens"] for rid, v in got.items()} == {rid: v["tokens"] for rid, v in reference.items()}
    s = engine.stats()
    assert s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    assert engine.num_preemptions > 0
    assert_pool_full(engine)


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama, tiny_gemma3):
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the target 1024"):
        make_engine(tiny_llama, speculative_config=draft(tiny_gemma3.path), **KW)


def test_llm_takes_speculative_config(tiny_llama):
    from infer.llm import LLM

    prompts = [repetitive(random.Random(9), 1000, 20), [5, 6, 7, 8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", max_model_len=64, progress=False)
    want = [o.outputs[0].token_ids for o in LLM(str(tiny_llama.path), **kw).generate(prompts, params)]
    llm = LLM(str(tiny_llama.path), speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.config.speculative.num_speculative_tokens == 2


def test_the_benchmarks_replayed_drafts_are_accepted_at_the_rate_asked(tiny_llama, tmp_path):
    """benchmarks/speculative.py's replay part at tiny sizes: drafts that are always right give k + 1 tokens
    per round, always wrong ones 1, and the outputs stay the target's (the program checks that itself)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import speculative as bench

    args = bench.parse_args(["--model", str(tiny_llama.path), "--parts", "replay", "--batch-sizes", "2", "--ks", "3",
                             "--acceptance", "0", "1", "--input-len", "8", "--output-len", "9", "--rounds", "1",
                             "--max-model-len", "64", "--out", str(tmp_path / "s.json")])
    rows = {r["acceptance"]: r for r in bench.replay_part(args)}
    assert rows[0.0]["measured_acceptance_length"] == 1.0 and rows[0.0]["tokens_per_round"] == 1.0
    assert rows[1.0]["measured_acceptance_length"] == rows[1.0]["tokens_per_round"] == 4
    assert all(r["speedup_backoff"] > 0 for r in rows.values())
    # the acceptance part, with the target as its own draft: every greedy draft accepted
    args = bench.parse_args(["--model", str(tiny_llama.path), "--parts", "acceptance", "--methods", "ngram",
                             f"draft:{tiny_llama.path}", "--k", "2", "--output-len", "6", "--rounds", "1",
                             "--max-model-len", "256"])
    rows = bench.acceptance_part(args)
    assert {(r["kind"], r["batch"], r["method"]) for r in rows} == {
        (kind, b, m) for kind in bench.PROMPTS for b in ("1", "2") for m in ("none", "ngram", f"draft:{tiny_llama.path}")}
    assert all(r["acceptance_rate"] == 1.0 for r in rows if r["method"].startswith("draft"))


def test_tensor_parallel_ranks_verify_the_drafts_too(tiny_llama):
    """Two gloo ranks: rank 0 proposes and accepts, every rank runs the verify forward (its flat inputs and
    the sampled rows' logits are what a step sends): the tokens of one rank without speculation."""
    rng = random.Random(10)
    arrivals = [(0, repetitive(rng, 1000, 26), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
                (0, [rng.randrange(10, 1000) for _ in range(9)], SamplingParams(seed=2, max_tokens=15,
                                                                                  temperature=0.9, ignore_eos=True))]
    want = run(make_engine(tiny_llama, **KW), arrivals)
    engine = LLMEngine(EngineConfig(model=str(tiny_llama.path), device="cpu", dtype="float32", tensor_parallel_size=2,
                                    speculative_config=NGRAM, **KW), progress=False)
    try:
        got = run(engine, arrivals)
        assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in want.items()}
        assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="draft' with tensor/expert parallelism"):
        EngineConfig(device="cpu", tensor_parallel_size=2, speculative_config=draft("x")).validate()


@pytest.mark.parametrize("flags", [dict(batching="static", kv_cache="contiguous", batch_wait_timeout_ms=0.0),
                                   dict(batching="none"),
                                   dict(prefix_caching=True, kv_offload="host", kv_offload_bytes=1 << 22)],
                         ids=["static-contiguous", "none", "kv-offload"])
def test_other_batching_modes_caches_and_kv_offload_keep_the_outputs(tiny_llama, reference, flags):
    arrivals = workload(tiny_llama.config.vocab_size)[:3]
    engine = make_engine(tiny_llama, speculative_config=NGRAM, **{**KW, **flags})
    try:
        got = run(engine, arrivals)
    finally:
        engine.shutdown()
    assert {rid: v["tokens"] for rid, v in got.items()} == {f"r{i}": reference[f"r{i}"]["tokens"] for i in range(3)}
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
