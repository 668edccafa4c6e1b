"""Flags together: each phase's flag is tested alone beside its phase; here several at once (chunked prefill,
prefix caching, async scheduling, KV offload, speculative decoding, preemption from a small pool, hybrid state
snapshots) serve a workload of requests that share prefixes, arrive over several steps and are sometimes
aborted. Every request that runs to its end must get the tokens it gets alone on the plain engine (batching
"none", contiguous cache): greedy, and sampled with its own seed (the sampler draws from each sequence's
``(seed, step)``, so batching may not change a draw).

The cases come from a differential fuzzer over random flag sets and workloads (some 600 runs on tiny
models, greedy and sampled: no disagreement); each case checks that its workload did what it is named for.
"""

from __future__ import annotations

import random

import pytest
import torch

from infer.config import EngineConfig
from infer.engine import LLMEngine
from infer.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    """A tiny random Qwen3.5 (3 Gated DeltaNet layers, 1 gated attention), loaded once."""
    import sys
    from pathlib import Path

    from infer.loader import load_model

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint("tiny-qwen3.5", tmp_path_factory.mktemp("tiny-qwen3.5"), dtype="float32", device="cpu")
    return load_model(path, device="cpu", dtype=torch.float32, progress=False)


def _pool_bytes(loaded, sequences: float, max_num_seqs: int) -> int:
    """A KV budget of ``sequences`` full-length (:data:`MAX_MODEL_LEN`) sequences (below 2, requests get
    preempted), and for
    a hybrid model the state slots of ``max_num_seqs`` sequences and the padding slot beside it."""
    cfg = loaded.config
    states = (max_num_seqs + 1) * cfg.state_bytes_per_seq(torch.float32) if cfg.is_hybrid else 0
    return int(sequences * MAX_MODEL_LEN * cfg.kv_bytes_per_token(torch.float32)) + states


MAX_MODEL_LEN = 256
CASES = {
    "chunked+prefix+async": ("llama", dict(chunked_prefill=True, max_num_batched_tokens=32, prefix_caching=True,
                                           async_scheduling=True, max_num_seqs=3, block_size=8)),
    "offload+preemption": ("llama", dict(prefix_caching=True, kv_offload="host", kv_offload_bytes=1 << 20,
                                         pool=1.02, max_num_seqs=7, async_scheduling=True)),
    "ngram+chunked+prefix": ("llama", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                               "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                                           chunked_prefill=True, max_num_batched_tokens=64, prefix_caching=True,
                                           max_num_seqs=5)),
    "hybrid snapshots+chunked": ("hybrid", dict(chunked_prefill=True, max_num_batched_tokens=64, prefix_caching=True,
                                                state_snapshot_stride=32, max_num_seqs=3, async_scheduling=True)),
    "hybrid preemption": ("hybrid", dict(pool=0.85, max_num_seqs=5, chunked_prefill=True, max_num_batched_tokens=96)),
}


def _workload(seed: int, vocab: int, sampled: bool):
    """``(prompt, params, arrival step, abort?)`` per request: three prefixes (8, 33 and 70 tokens), each shared
    by every third request, with own suffixes, repeats for the n-gram proposer, one arriving every step or so (later ones find earlier ones'
    prefixes cached), one in six aborted."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(n)] for n in (8, 33, 70)]
    out = []
    for i in range(7):
        prompt = prefixes[i % 3] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))]
        if i % 4 == 1:
            prompt += prompt[-6:] * 3
        max_tokens = rng.randint(4, 60)
        params = (SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=rng.randrange(1000), top_k=20,
                                 n=2 if i % 3 == 0 else 1, ignore_eos=True) if sampled
                  else SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        out.append((prompt, params, i + rng.randint(0, 2), i % 6 == 5))
    return out


def _run(eng: LLMEngine, work) -> dict[int, list[list[int]]]:
    """The workload through ``eng`` step by step; each finished request's sequences' tokens."""
    done, step, aborted = {}, 0, set()
    while step < 2000:
        for i, (prompt, params, at, _) in enumerate(work):
            if at == step:
                eng.add_request(prompt, params, request_id=str(i))
        if eng.has_unfinished_requests():
            for out in eng.step(stream=False):
                if out.finished:
                    done[int(out.request_id)] = [list(c.token_ids) for c in out.outputs]
        for i, (_, _, at, abort) in enumerate(work):
            if abort and step == at + 2 and str(i) in eng.requests:
                eng.abort_request(str(i))
                aborted.add(i)
        step += 1
        if step > 6 and not eng.has_unfinished_requests():
            break
    return {i: toks for i, toks in done.items() if i not in aborted}


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", list(CASES))
def test_flags_together_give_each_request_its_tokens_alone(case, sampled, tiny_llama, tiny_hybrid):
    model, flags = CASES[case]
    loaded = tiny_llama if model == "llama" else tiny_hybrid
    flags = dict(flags)
    if "pool" in flags:
        flags["kv_cache_memory_bytes"] = _pool_bytes(loaded, flags.pop("pool"), flags["max_num_seqs"])
    common = dict(model=str(loaded.path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    eng = LLMEngine(EngineConfig(**common, batching="continuous", kv_cache="paged", **flags), loaded=loaded,
                    progress=False)
    alone = LLMEngine(EngineConfig(**common, batching="none", kv_cache="contiguous"), loaded=loaded, progress=False)
    work = _workload(sorted(CASES).index(case), min(eng.vocab_size, 1000), sampled)
    got = _run(eng, work)
    assert len(got) >= 5, got.keys()
    kv = eng.scheduler.kv  # the workload did what the case is about
    assert kv.prefix_cache_hits > 0 or not flags.get("prefix_caching")
    assert eng.num_preemptions > 0 or "kv_cache_memory_bytes" not in flags
    assert "speculative_config" not in flags or eng.output_processor.spec_stats.num_drafts > 0
    assert not flags.get("state_snapshot_stride") or kv.snapshots.num_stored > 0
    for i, toks in got.items():
        prompt, params, _, _ = work[i]
        want = _run(alone, [(prompt, params, 0, False)])[0]
        assert toks == want, f"request {i} ({len(prompt)} prompt tokens)"
    if hasattr(eng, "shutdown"):
        eng.shutdown()
