"""The batched sampler: mask sets, distributions (chi-square), penalties, reproducibility, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from infer.sampling import (
    SamplingParams,
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    random_uniform,
    sample,
    sample_from_probs,
    suppress_tokens,
)

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- helpers


def kept(masked: torch.Tensor) -> list[set[int]]:
    """The token ids of each row that were not set to -inf."""
    return [set(torch.nonzero(row > NEG_INF).flatten().tolist()) for row in masked]


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log().float()


def build(params, vocab_size, *, seeds=None, steps=None, prompts=None, outputs=None, suppress=None):
    return SamplingTensors.from_params(params, seeds, steps, prompts, outputs, suppress, vocab_size)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit: P(X >= stat) for X ~ chi2(#bins - 1)."""
    counts = counts.double()
    expected = probs.double() * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def draw_counts(logits_row: torch.Tensor, params: SamplingParams, n: int, *, vary: str) -> torch.Tensor:
    """Sample ``n`` times from one distribution: many rows with different seeds (or steps)."""
    vocab = logits_row.shape[0]
    if vary == "seed":
        t = build([params] * n, vocab, seeds=list(range(1000, 1000 + n)), steps=[0] * n)
    else:
        t = build([params] * n, vocab, seeds=[12345] * n, steps=list(range(n)))
    tokens = sample(logits_row.expand(n, vocab), t).next_tokens
    return torch.bincount(tokens, minlength=vocab)


# ----------------------------------------------------------------------------- the masks


def test_top_k_keeps_exact_sets():
    row = torch.tensor([3.0, 1.0, 2.0, 5.0, 4.0])
    logits = row.expand(4, 5)
    out = apply_top_k(logits, torch.tensor([2, 1, 5, 100]))  # mixed k per row, 100 clamps to V
    assert kept(out) == [{3, 4}, {3}, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}]
    assert torch.equal(out[2], row)  # disabled: bit-for-bit unchanged
    # kept logits keep their values
    assert out[0, 3] == 5.0 and out[0, 4] == 4.0


def test_top_k_clamps_k_to_one():
    # k below 1 is clamped (the docstring's contract): the argmax stays, whatever the row
    row = torch.tensor([3.0, 1.0, 2.0, 5.0, 4.0])
    assert kept(apply_top_k(row.expand(2, 5), torch.tensor([0, -3]))) == [{3}, {3}]


def test_top_k_ties_and_infs():
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [1.0, 2.0, 2.0, 0.0], [NEG_INF, 1.0, NEG_INF, 0.0]])
    out = apply_top_k(logits, torch.tensor([2, 1, 3]))
    # ties with the k-th largest are kept: the set does not depend on the sort order
    assert kept(out) == [{1, 2}, {1, 2}, {1, 3}]


def test_top_p_keeps_exact_sets():
    probs = [0.5, 0.25, 0.15, 0.1]
    row = logits_of(probs)
    top_p = torch.tensor([1e-6, 0.3, 0.7, 0.8, 0.95, 1.0])
    out = apply_top_p(row.expand(6, 4), top_p)
    assert kept(out) == [{0}, {0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3}]
    assert torch.equal(out[5], row)


def test_top_p_stops_where_the_mass_reaches_top_p_exactly():
    # top_p equal to the top token's own probability (the same float32 value): the top token
    # alone reaches it, so nothing else is kept (the mass *before* the second token is not < top_p)
    row = logits_of([0.5, 0.3, 0.2])[None]
    top = torch.softmax(row, dim=-1).max(dim=-1).values
    assert kept(apply_top_p(row, top)) == [{0}]


def test_top_p_edges():
    # top_p = 1 keeps everything, even a token whose probability is 0 in float32
    row = torch.tensor([[0.0, 1.0, -200.0, 0.5]])
    assert kept(apply_top_p(row, torch.tensor([1.0]))) == [{0, 1, 2, 3}]
    # a tiny top_p keeps the argmax only, wherever it is
    row = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    assert kept(apply_top_p(row, torch.tensor([1e-9]))) == [{1}]
    # ties with the last kept token are kept
    row = logits_of([0.4, 0.3, 0.3])[None]
    assert kept(apply_top_p(row, torch.tensor([0.5]))) == [{0, 1, 2}]
    # the nucleus is computed on the distribution renormalised after earlier masks
    row = torch.tensor([[NEG_INF, math.log(0.6), math.log(0.3), math.log(0.1)]])
    assert kept(apply_top_p(row, torch.tensor([0.85]))) == [{1, 2}]
    # uniform distribution: floor-free count
    row = torch.zeros(1, 10)
    assert kept(apply_top_p(row, torch.tensor([0.35]))) == [set(range(10))]  # all tied


def test_min_p_keeps_exact_sets():
    row = logits_of([0.5, 0.25, 0.15, 0.1])
    out = apply_min_p(row.expand(5, 4), torch.tensor([0.0, 0.25, 0.4, 0.9, 1.0]))
    # thresholds 0, 0.125, 0.2, 0.45, 0.5 (times p_max = 0.5)
    assert kept(out) == [{0, 1, 2, 3}, {0, 1, 2}, {0, 1}, {0}, {0}]
    assert torch.equal(out[0], row)
    # min_p is scale-free: it only looks at p / p_max
    shifted = apply_min_p(row[None] + 7.0, torch.tensor([0.4]))
    assert kept(shifted) == [{0, 1}]


def test_suppress_tokens():
    logits = torch.arange(12.0).reshape(2, 6)
    ids = torch.tensor([[5, 0, -1], [-1, -1, -1]])
    out = suppress_tokens(logits, ids)
    assert kept(out) == [{1, 2, 3, 4}, set(range(6))]
    assert torch.equal(out[1], logits[1])  # padding never touches token 0
    assert suppress_tokens(logits, torch.empty(2, 0, dtype=torch.int64)) is logits


# ----------------------------------------------------------------------------- penalties


def expected_penalized(logits, prompts, outputs, reps, pres, freqs):
    out = logits.clone()
    for b in range(logits.shape[0]):
        seen = set(prompts[b]) | set(outputs[b])
        for v in range(logits.shape[1]):
            x = float(logits[b, v])
            if v in seen:
                x = x / reps[b] if x > 0 else x * reps[b]
            c = outputs[b].count(v)
            x -= freqs[b] * c + pres[b] * (1.0 if c > 0 else 0.0)
            out[b, v] = x
    return out


def test_penalties_match_definitions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, generator=g) * 3
    prompts = [[1, 2, 2, 7], [], [0, 11], [3]]
    outputs = [[2, 3, 3, 3, 9], [4, 4, 5], [], [3, 3]]
    reps, pres, freqs = [1.3, 1.0, 0.7, 2.0], [0.5, -1.0, 2.0, 0.0], [0.25, 0.5, -0.3, 1.5]
    t = build(
        [
            SamplingParams(repetition_penalty=r, presence_penalty=p, frequency_penalty=f)
            for r, p, f in zip(reps, pres, freqs)
        ],
        12,
        prompts=prompts,
        outputs=outputs,
    )
    got = apply_penalties(
        logits, t.prompt_ids, t.output_ids, t.repetition_penalty, t.presence_penalty, t.frequency_penalty
    )
    want = expected_penalized(logits, prompts, outputs, reps, pres, freqs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # presence/frequency look at the output only: token 7 (prompt only) of row 0 is only
    # divided/multiplied by the repetition penalty
    x = float(logits[0, 7])
    assert math.isclose(float(got[0, 7]), x / 1.3 if x > 0 else x * 1.3, rel_tol=1e-6)


def test_neutral_penalties_are_identity():
    logits = torch.randn(2, 9)
    ids = torch.tensor([[1, 2, -1], [0, 0, 0]])
    got = apply_penalties(logits, ids, ids, torch.ones(2), torch.zeros(2), torch.zeros(2))
    assert torch.equal(got, logits)


def test_penalties_apply_to_greedy_rows():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    # repetition penalty 2 halves token 1's logit to 2.5 < 4: argmax moves to token 2
    t = build([SamplingParams(temperature=0, repetition_penalty=2.0)], 4, prompts=[[1]])
    assert sample(logits, t).next_tokens.tolist() == [2]
    # frequency penalty 1.0 on three occurrences of token 1: 5 - 3 = 2 < 4
    t = build([SamplingParams(temperature=0, frequency_penalty=1.0)], 4, outputs=[[1, 1, 1]])
    assert sample(logits, t).next_tokens.tolist() == [2]
    # presence penalty ignores the prompt
    t = build([SamplingParams(temperature=0, presence_penalty=2.0)], 4, prompts=[[1]])
    assert sample(logits, t).next_tokens.tolist() == [1]


# ----------------------------------------------------------------------------- distributions


LOGITS10 = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7, -0.2, 0.9])


@pytest.mark.parametrize("vary", ["seed", "step"])
def test_sampled_frequencies_match_distribution(vary):
    params = SamplingParams(temperature=0.8)
    counts = draw_counts(LOGITS10, params, 20_000, vary=vary)
    probs = torch.softmax(LOGITS10.double() / 0.8, -1)
    assert chi2_pvalue(counts, probs) > 1e-3


def _truncated(probs: list[float], top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Independent reference: min-p, then top-k, then top-p on the renormalised rest."""
    n = len(probs)
    keep = [p >= min_p * max(probs) for p in probs]
    order = sorted(range(n), key=lambda i: -probs[i])
    for rank, i in enumerate(order):
        if rank >= top_k:
            keep[i] = False
    total = sum(p for p, k in zip(probs, keep) if k)
    mass, nucleus = 0.0, set()
    for i in order:
        if not keep[i]:
            continue
        if mass < top_p:
            nucleus.add(i)
        mass += probs[i] / total
    out = torch.tensor([probs[i] if i in nucleus else 0.0 for i in range(n)], dtype=torch.float64)
    return out / out.sum()


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(4, 1.0, 0.0), (-1, 0.7, 0.0), (6, 0.8, 0.0), (-1, 1.0, 0.2), (8, 0.9, 0.1)],
)
def test_truncated_frequencies_match_distribution(top_k, top_p, min_p):
    temperature = 1.3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    probs = torch.softmax(LOGITS10.double() / temperature, -1).tolist()
    want = _truncated(probs, top_k if top_k > 0 else 10, top_p, min_p)
    counts = draw_counts(LOGITS10, params, 20_000, vary="seed")
    excluded = want == 0
    assert excluded.any()
    assert counts[excluded].sum() == 0, "a truncated token was drawn"
    assert chi2_pvalue(counts[~excluded], want[~excluded]) > 1e-3


def test_random_uniform_properties():
    seeds = torch.tensor([0, 1, -5, 2**62], dtype=torch.int64)
    steps = torch.tensor([0, 0, 3, 10**12], dtype=torch.int64)
    u = random_uniform(seeds, steps, 50_000)
    assert u.dtype == torch.float32 and u.shape == (4, 50_000)
    assert (u > 0).all() and (u < 1).all()
    # deterministic, and a prefix of the vocabulary gets the same values
    assert torch.equal(u, random_uniform(seeds, steps, 50_000))
    assert torch.equal(u[:, :100], random_uniform(seeds, steps, 100))
    # each row is uniform (20 bins)
    for row in u:
        counts = torch.bincount((row * 20).long(), minlength=20)
        assert chi2_pvalue(counts, torch.full((20,), 0.05)) > 1e-3
    # rows differ
    assert len({tuple(r[:8].tolist()) for r in u}) == 4
    with pytest.raises(TypeError):
        random_uniform(seeds.int(), steps, 10)


def _splitmix_uniform(seed: int, step: int, v: int) -> float:
    """``random_uniform``'s definition in Python integers: the (v + 1)-th splitmix64 output of the
    row's key, its top 24 bits as ``float32(k + 0.5) / 2**24``, clamped below 1."""
    m, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    key = mix(mix((seed + golden) & m) ^ (step & m))
    k = mix((key + (v + 1) * golden) & m) >> 40
    return min(float(np.float32(k + 0.5)) / (1 << 24), 1.0 - 2.0**-24)


@pytest.mark.parametrize("slice_elements", [7, 1 << 19])
def test_random_uniform_matches_its_definition_across_row_slices(monkeypatch, slice_elements):
    """The CPU path hashes a few rows at a time in reused buffers (7 elements: rows one or two at a
    time); every value equals the definition computed with Python integers."""
    import infer.sampling.rng as rng_mod

    monkeypatch.setattr(rng_mod, "_CPU_SLICE_ELEMENTS", slice_elements)
    seeds = torch.tensor([0, 1, -5, 2**62, 12345], dtype=torch.int64)
    steps = torch.tensor([0, 7, 3, 10**12, 1], dtype=torch.int64)
    u = random_uniform(seeds, steps, 3)
    want = [[_splitmix_uniform(s, t, v) for v in range(3)] for s, t in zip(seeds.tolist(), steps.tolist())]
    assert u.tolist() == want


@pytest.mark.parametrize("kept", [1, 5, 50, 3000])
def test_sample_from_probs_truncated_rows_race_only_their_candidates(kept):
    """Rows truncated to a few tokens (the CPU races only those, up to V / 16 = 3,072 here) draw
    exactly what the race over the whole vocabulary draws, for many seeds; equal probabilities
    included (ties go to the lowest id either way)."""
    from infer.sampling.rng import _random_uniform_at

    torch.manual_seed(kept)
    b, v = 64, 49_152
    probs = torch.zeros(b, v)
    for r in range(b):
        ids = torch.randperm(v)[: max(1, kept - r % 3)]  # rows of different widths
        w = torch.rand(len(ids)) if r % 4 else torch.ones(len(ids))  # every 4th row: all tied
        probs[r, ids] = w / w.sum()
    seeds = torch.randint(-2**62, 2**62, (b,))
    steps = torch.randint(0, 10**6, (b,))
    want = (probs / -torch.log(random_uniform(seeds, steps, v))).argmax(dim=-1)
    assert torch.equal(sample_from_probs(probs, seeds, steps), want)
    idx = torch.randint(0, v, (b, 7))
    assert torch.equal(_random_uniform_at(seeds, steps, idx), random_uniform(seeds, steps, v).gather(1, idx))


# ----------------------------------------------------------------------------- reproducibility


def test_same_seed_and_step_same_token_different_steps_differ():
    vocab = 1000
    logits = torch.zeros(200, vocab)  # uniform: every draw is informative
    t = build([SamplingParams(seed=7)] * 200, vocab, steps=list(range(200)))
    a = sample(logits, t).next_tokens
    b = sample(logits, t).next_tokens
    assert torch.equal(a, b)
    assert len(set(a.tolist())) > 150  # ~181 distinct expected from 200 draws over 1000
    # a different seed gives a different sequence
    t2 = build([SamplingParams(seed=8)] * 200, vocab, steps=list(range(200)))
    assert (sample(logits, t2).next_tokens != a).sum() > 150
    # the explicit ``seeds`` argument overrides params.seed
    t3 = build([SamplingParams(seed=8)] * 200, vocab, seeds=[7] * 200, steps=list(range(200)))
    assert torch.equal(sample(logits, t3).next_tokens, a)


def _mixed_batch(vocab: int):
    params = [
        SamplingParams(seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5, seed=2),
        SamplingParams(temperature=1.2, top_p=0.6, seed=3),
        SamplingParams(min_p=0.1, seed=4, logprobs=3),
        SamplingParams(repetition_penalty=1.5, seed=5),
        SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, seed=6),
        SamplingParams(temperature=0, repetition_penalty=1.3, top_k=3),
        SamplingParams(top_k=8, top_p=0.9, min_p=0.05, temperature=0.9, seed=9, logprobs=5),
        SamplingParams(temperature=2.0, seed=10),
        SamplingParams(temperature=0.5, seed=11, min_tokens=3),
        SamplingParams(top_k=1, seed=12),
        SamplingParams(top_p=1e-4, seed=13),
        SamplingParams(frequency_penalty=-1.0, top_k=20, seed=14),
        SamplingParams(temperature=0.3, repetition_penalty=0.8, seed=15),
        SamplingParams(seed=16, top_p=0.95, logprobs=20),
    ]
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(0, 9, (16,), generator=g)
    ]
    return params, prompts


def test_row_alone_equals_row_in_batch():
    vocab = 64
    params, prompts = _mixed_batch(vocab)
    outputs: list[list[int]] = [[] for _ in params]
    g = torch.Generator().manual_seed(2)
    for _step in range(6):
        logits = torch.randn(16, vocab, generator=g) * 2
        suppress = [[0, 1] if len(outputs[i]) < params[i].min_tokens else [] for i in range(16)]
        t = build(params, vocab, prompts=prompts, outputs=outputs, suppress=suppress)
        batch = sample(logits, t)
        for i in range(16):
            alone_t = build(
                [params[i]], vocab, prompts=[prompts[i]], outputs=[outputs[i]], suppress=[suppress[i]]
            )
            alone = sample(logits[i : i + 1], alone_t)
            assert torch.equal(alone.next_tokens[0], batch.next_tokens[i]), f"row {i}"
            torch.testing.assert_close(alone.logprobs[0], batch.logprobs[i], rtol=0, atol=1e-6)
            k = alone_t.max_num_logprobs
            assert torch.equal(alone.top_logprob_ids[0], batch.top_logprob_ids[i, :k])
        for i, tok in enumerate(batch.next_tokens.tolist()):
            outputs[i].append(tok)
    # row 10 (min_tokens=3) never drew its banned ids 0 and 1 in its first 3 tokens
    assert not {0, 1} & set(outputs[10][:3])


# ----------------------------------------------------------------------------- logprobs, greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_are_raw(dtype):
    vocab = 64
    params, prompts = _mixed_batch(vocab)
    logits = (torch.randn(16, vocab, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    t = build(params, vocab, prompts=prompts, outputs=prompts)
    assert t.max_num_logprobs == 20
    out = sample(logits, t)
    raw = torch.log_softmax(logits.float(), -1)
    assert out.next_tokens.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.next_tokens[:, None])[:, 0], rtol=0, atol=1e-5)
    top = raw.topk(20, -1)
    assert out.top_logprob_ids.shape == (16, 20) and out.top_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.top_logprobs, top.values, rtol=0, atol=1e-5)
    if dtype == torch.float32:  # no ties: the ids are determined
        assert torch.equal(out.top_logprob_ids, top.indices)


def test_no_logprobs_requested_gives_empty_top():
    t = build([SamplingParams(), SamplingParams(logprobs=0)], 10)
    out = sample(torch.randn(2, 10), t)
    assert t.max_num_logprobs == 0
    assert out.top_logprob_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    assert out.logprobs.shape == (2,)


def test_greedy_rows_take_argmax_and_ignore_truncation():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 30, generator=g)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, top_k=2, top_p=0.01, min_p=0.99),
        SamplingParams(temperature=0, seed=3),
        SamplingParams(temperature=1.0, seed=4),  # a random row in the same batch
        SamplingParams(temperature=0, top_k=1),
        SamplingParams(temperature=0, top_p=0.5),
    ]
    out = sample(logits, build(params, 30))
    greedy = [0, 1, 2, 4, 5]
    assert torch.equal(out.next_tokens[greedy], logits.argmax(-1)[greedy])
    # an all-greedy batch
    out = sample(logits, build([SamplingParams(temperature=0)] * 6, 30))
    assert torch.equal(out.next_tokens, logits.argmax(-1))
    # ties: the first index
    tie = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert sample(tie, build([SamplingParams(temperature=0)], 4)).next_tokens.tolist() == [1]


def test_suppressed_ids_are_never_drawn():
    logits = torch.tensor([5.0, 4.0, 0.0, -1.0]).expand(2000, 4)
    t = build(
        [SamplingParams(temperature=1.5)] * 1999 + [SamplingParams(temperature=0)],
        4,
        seeds=list(range(2000)),
        suppress=[[0, 3]] * 2000,
    )
    tokens = sample(logits, t).next_tokens
    assert set(tokens.tolist()) <= {1, 2} and tokens[-1] == 1
    assert set(tokens.tolist()) == {1, 2}


# ----------------------------------------------------------------------------- construction


def test_from_params_encoding_and_flags():
    params = [SamplingParams(top_k=5, temperature=0.5, seed=3), SamplingParams(temperature=0)]
    t = build(params, 100, outputs=[[1, 2], []])
    assert t.top_k.tolist() == [5, 100] and t.top_k.dtype == torch.int64
    assert t.steps.tolist() == [2, 0]  # default: len(output)
    assert t.seeds[0] == 3
    assert t.prompt_ids.shape == (2, 0) and t.output_ids.shape == (2, 0)  # no penalties: no history
    assert t.do_top_k and not (t.do_top_p or t.do_min_p or t.do_penalties or t.all_greedy)
    t = build([SamplingParams(top_k=500, seed=2**64 + 3)], 100)
    assert t.top_k.tolist() == [100] and t.seeds.tolist() == [3] and not t.do_top_k


def test_from_params_errors():
    p = [SamplingParams(), SamplingParams()]
    with pytest.raises(ValueError, match="seeds has 1 entries"):
        build(p, 10, seeds=[1])
    with pytest.raises(ValueError, match=r"output_ids_list\[1\] has token ids outside \[0, 10\)"):
        build(p, 10, outputs=[[1], [10]])
    with pytest.raises(ValueError, match="suppress_list"):
        build(p, 10, suppress=[[-1], []])


def test_shape_checks():
    t = build([SamplingParams()] * 2, 10)
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.randn(3, 10), t)
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(2, 10, dtype=torch.int64), t)
    with pytest.raises(ValueError, match="SamplingTensors.top_p"):
        SamplingTensors(**{**t.__dict__, "top_p": torch.ones(2, dtype=torch.float64)})
    with pytest.raises(ValueError, match="SamplingTensors.output_ids"):
        SamplingTensors(**{**t.__dict__, "output_ids": torch.zeros(3, 1, dtype=torch.int64)})


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_matches_cpu_without_host_sync():
    vocab = 64
    params, prompts = _mixed_batch(vocab)
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(5)) * 2
    t_cpu = build(params, vocab, prompts=prompts, outputs=prompts, suppress=[[3]] * 16)
    t_gpu = SamplingTensors.from_params(params, None, None, prompts, prompts, [[3]] * 16, vocab, "cuda")
    t_gpu.seeds.copy_(t_cpu.seeds)  # unseeded rows drew random seeds on the host
    cpu = sample(logits, t_cpu)
    gpu_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = sample(gpu_logits, t_gpu)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(
        random_uniform(t_gpu.seeds, t_gpu.steps, vocab).cpu(), random_uniform(t_cpu.seeds, t_cpu.steps, vocab)
    )
    assert torch.equal(gpu.next_tokens.cpu(), cpu.next_tokens)
    torch.testing.assert_close(gpu.logprobs.cpu(), cpu.logprobs, rtol=0, atol=1e-5)
