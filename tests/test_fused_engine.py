"""Phases 8-9 in the engine: the fused forward (``fused_kernels``) and CUDA graphs (``cuda_graphs``).

The fused ops themselves are tested against their references in tests/test_fused_kernels.py.
Here: the fused forward computes what the reference forward computes (HF parity, float32, CPU),
an engine with the flag gives the same greedy tokens as without it (torch backend, and the Triton
kernels under the interpreter), the graph buckets, the config checks, and on a GPU the graph
runner's replays against eager steps.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from infer.config import EngineConfig
from infer.engine import LLMEngine
from infer.engine.cuda_graphs import bucket_for, graph_batch_sizes, mixed_graph_sizes, prefill_graph_sizes
from infer.loader import load_model
from infer.sampling import SamplingParams
from tests.hf_reference import hf_logits, infer_logits, save_hf, tiny_hf_model
from tests.test_batching import assert_pool_full, drive, make_engine, mixed_workload
from tests.test_parity import _prompts, assert_parity
from tests.test_prefix_caching import assert_drained

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------- the fused forward


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_fused_forward_matches_hf(kind, tmp_path):
    """The fused forward (merged projections, residual riding with the norms, QK-norm + RoPE in one
    op) through the plain-PyTorch twins of the kernels: HF parity as the reference forward has it."""
    from infer.kernels import fused_reference

    ref = tiny_hf_model(kind)
    ours = load_model(save_hf(ref, tmp_path / kind), device="cpu", dtype=torch.float32, progress=False)
    prompts = _prompts(ref.config.vocab_size, [1, 5, 23, 90])
    unfused = infer_logits(ours.model, prompts)
    ours.model.set_fused_ops(fused_reference, max_positions=128)
    assert hasattr(ours.model.model.layers[0].self_attn, "qkv_proj")
    fused = infer_logits(ours.model, prompts)
    for seq, a, b in zip(prompts, fused, unfused):
        assert_parity(a, hf_logits(ref, seq))
        assert (a - b).abs().max().item() <= 1e-4
    # switching back gives the reference forward again (the separate projections are views)
    ours.model.set_fused_ops(None)
    for a, b in zip(infer_logits(ours.model, prompts), unfused):
        assert torch.equal(a, b)


def test_merged_projections_share_memory_with_the_separate_ones(tiny_llama):
    from infer.kernels import fused_reference

    tiny_llama.model.set_fused_ops(fused_reference, 64)
    try:
        attn = tiny_llama.model.model.layers[0].self_attn
        q_rows = attn.q_proj.weight.shape[0]
        assert attn.q_proj.weight.data_ptr() == attn.qkv_proj.weight.data_ptr()
        assert attn.k_proj.weight.data_ptr() == attn.qkv_proj.weight[q_rows:].data_ptr()
    finally:
        tiny_llama.model.set_fused_ops(None)


@pytest.mark.parametrize("fixture, backend", [("tiny_llama", "torch"), ("tiny_gemma3", "torch"),
                                              ("tiny_gemma3", "triton")])
def test_engine_greedy_tokens_are_the_same_with_fused_kernels(fixture, backend, request):
    """Continuous batching, paged KV, prefills mixed with decodes: identical greedy tokens with the
    flag on and off (the Triton kernels run under the interpreter on the CPU; Gemma 3's window 32)."""
    loaded = request.getfixturevalue(fixture)
    small = backend == "triton"
    arrivals = mixed_workload(loaded.config.vocab_size, 4 if small else 10, seed=5)
    if small:  # interpreted kernels cost ms per program: short prompts, few tokens
        arrivals = [(step, prompt[:20], SamplingParams(max_tokens=min(p.max_tokens, 4), temperature=0.0,
                                                       ignore_eos=True)) for step, prompt, p in arrivals]
    kw = dict(batching="continuous", max_model_len=96, max_num_seqs=4, kv_cache="paged", block_size=8,
              attention_backend=backend)
    try:
        ref = drive(make_engine(loaded, **kw), arrivals)
        eng = make_engine(loaded, fused_kernels=True, **kw)
        assert loaded.model.ops is not None
        assert drive(eng, arrivals) == ref
        assert_pool_full(eng)
    finally:
        loaded.model.set_fused_ops(None)


def test_one_row_decode_through_the_skinny_kernels_gives_the_unfused_tokens(tiny_llama, monkeypatch):
    """One sequence at a time: every decode step is one row, which the Triton ops send through the skinny
    GEMM (QKV, and gate/up with SiLU in its epilogue, each after its norm's kernel; o and down with the
    residual add in their epilogue, ``ops.linear_residual``; the LM head). On the CPU under the interpreter,
    with the weights kept row-major as on a GPU (the CPU layout is column-major, which those kernels do not
    take): the greedy tokens of the unfused engine, and the epilogue add and activation really ran."""
    from infer.kernels import skinny_gemm
    from infer.models.layers import CausalLM

    monkeypatch.setattr(CausalLM, "_set_cpu_weight_layout", lambda self, column_major: None)
    launches = {"add": 0, "act": 0}
    launch = skinny_gemm._launch

    def counted(*args, **kw):
        launches["add"] += kw.get("add") is not None
        launches["act"] += kw.get("act", 0) != 0
        return launch(*args, **kw)

    monkeypatch.setattr(skinny_gemm, "_launch", counted)
    # wider tiles than the interpreter's default (8, 32): a quarter of the programs (the LM head's dominate)
    monkeypatch.setattr(skinny_gemm, "default_config", lambda m, n, k, act=False, norm=False: (32, 64, 1))
    arrivals = [(0, list(range(100, 105)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))]
    kw = dict(batching="continuous", max_model_len=64, max_num_seqs=1, kv_cache="paged", block_size=8,
              attention_backend="triton")
    try:
        ref = drive(make_engine(tiny_llama, **kw), arrivals)
        assert drive(make_engine(tiny_llama, fused_kernels=True, **kw), arrivals) == ref
    finally:
        tiny_llama.model.set_fused_ops(None)
    layers = tiny_llama.config.num_layers
    assert launches == {"add": 2 * layers, "act": layers}  # one one-row decode step


def test_seeded_sampling_is_the_same_with_fused_kernels(tiny_llama):
    arrivals = mixed_workload(tiny_llama.config.vocab_size, 8, seed=6, sampled=True)
    kw = dict(batching="continuous", max_model_len=96, max_num_seqs=4)
    try:
        ref = drive(make_engine(tiny_llama, **kw), arrivals)
        assert drive(make_engine(tiny_llama, fused_kernels=True, **kw), arrivals) == ref
    finally:
        tiny_llama.model.set_fused_ops(None)


# ---------------------------------------------------------------------------- CUDA graphs: the host side


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(2) == [1, 2]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = graph_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 3 + 32
    assert all(b % 8 == 0 for b in sizes[3:])
    with pytest.raises(ValueError):
        graph_batch_sizes(0)


def test_bucket_for_picks_the_smallest_bucket_that_holds_the_batch():
    sizes = [1, 2, 4, 8, 16, 20]  # graph_batch_sizes(20)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [1, 2, 4, 4, 8, 8, 16, 16, 20, 20]
    assert bucket_for(21, sizes) is None
    # any ascending list, not the decode sizes' pattern: the prefill buckets of a 100-token maximum
    sizes = [16, 32, 64, 100]
    assert [bucket_for(t, sizes) for t in (2, 16, 17, 64, 65, 100, 101)] == [16, 16, 32, 64, 100, 100, None]
    assert bucket_for(1, []) is None  # no graph at all: every step is wider than all of them


@pytest.mark.parametrize("rows", [8, 64], ids=["rebuilds", "roomy"])
def test_block_table_rows_stage_what_every_step_reads(tiny_llama, rows):
    """The graphs' kept block-table rows (``BlockTableRows``) give, at every step of a paged engine
    with preemptions, forks and prefix caching, the tables ``block_table_array`` builds from the
    lists, wherever a kernel reads (up to each table's length); with 8 rows for up to 8 tables a step
    they are taken back and rebuilt often."""
    import numpy as np

    from infer.engine.step import BlockTableRows, block_table_array

    bytes_per_block = 4 * tiny_llama.config.kv_bytes_per_token(torch.float32)  # blocks of 4 tokens: long tables
    eng = make_engine(tiny_llama, batching="continuous", kv_cache="paged", block_size=4, prefix_caching=True,
                      max_num_seqs=8, max_model_len=96, kv_cache_memory_bytes=30 * bytes_per_block)
    kept = BlockTableRows(rows, 64)
    seen = {"steps": 0, "grew": 0}
    execute = eng.runner.execute

    def check(scheduled, eos_ids, prev=None):
        tables = [item.seq.block_table for item in scheduled]
        width = max(len(t) for t in tables)
        out = np.full((len(tables), width), -7, dtype=np.int64)
        kept.gather(tables, width, out)
        want = block_table_array(tables, width)
        read = np.arange(width) < np.array([len(t) for t in tables])[:, None]
        assert (out[read] == want[read]).all()
        seen["steps"] += 1
        return execute(scheduled, eos_ids, prev)

    eng.runner.execute = check
    arrivals = mixed_workload(tiny_llama.config.vocab_size, 40, seed=3)
    arrivals += [(5, arrivals[0][1], SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=1))]  # forks
    drive(eng, arrivals)
    assert seen["steps"] > 20 and eng.scheduler.num_preemptions > 0
    assert (kept.rebuilds > 0) == (rows == 8)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prompts", "chunked"])
def test_stage_decodes_stages_what_the_general_path_computes(tiny_llama, chunked):
    """A decode-only step staged straight from its sequences (``stage_decodes``, the graphs' path)
    holds, at every such step of a paged engine with preemptions and prefix caching (and with chunked
    prefill under a 3-token budget, one-token prompt chunks among the decodes, which sample nothing),
    the ids, positions, slots, context lengths, block tables and sampled rows that the general path's
    ``flatten`` and ``slot_mapping`` compute, in ``replay``'s packed layout with its padding rows."""
    import numpy as np

    from infer.engine.cuda_graphs import bucket_for, graph_batch_sizes, stage_decodes
    from infer.engine.step import BlockTableRows, flatten

    bytes_per_block = 4 * tiny_llama.config.kv_bytes_per_token(torch.float32)
    extra = dict(chunked_prefill=True, max_num_batched_tokens=3) if chunked else {}
    eng = make_engine(tiny_llama, batching="continuous", kv_cache="paged", block_size=4, prefix_caching=True,
                      max_num_seqs=8, max_model_len=96, kv_cache_memory_bytes=30 * bytes_per_block, **extra)
    kept, sizes = BlockTableRows(18, 24), graph_batch_sizes(8)
    seen = {"steps": 0, "partial": 0}
    runner = eng.runner
    execute = runner.execute

    def check(scheduled, eos_ids, prev=None):
        if all(item.num_tokens == 1 for item in scheduled) and not any(item.forks for item in scheduled):
            b = len(scheduled)
            bs = bucket_for(b, sizes)
            ids, positions, _, seq_lens, tables, firsts, sample_at, sampled = flatten(scheduled)
            slots = runner.kv_cache.slot_mapping(tables, firsts, [1] * b)
            h = np.full(4 * bs + b * 24, -7, dtype=np.int64)
            width, rows = stage_decodes([item.seq for item in scheduled], kept, 4, h, bs)
            assert width == max(len(t) for t in tables)
            for k, (want, pad) in enumerate(((ids, 0), (positions, 0), (slots, -1), (seq_lens, 0))):
                assert h[k * bs: k * bs + b].tolist() == want
                assert (h[k * bs + b: (k + 1) * bs] == pad).all()
            staged = h[4 * bs: 4 * bs + b * width].reshape(b, width)
            for i, t in enumerate(tables):
                assert staged[i, : len(t)].tolist() == t
            assert (list(range(b)) if rows is None else rows.tolist()) == sample_at
            seen["steps"] += 1
            seen["partial"] += rows is not None
        return execute(scheduled, eos_ids, prev)

    runner.execute = check
    drive(eng, mixed_workload(tiny_llama.config.vocab_size, 40, seed=3))
    assert seen["steps"] > 10 and eng.scheduler.num_preemptions > 0
    assert (seen["partial"] > 0) == chunked, "no one-token prompt chunk among decodes" if chunked else seen


def test_stateless_sampling_tensors_are_the_general_ones(tiny_llama):
    """The sampling tensors built the stateless way (no history, suppression or bitmask gathered:
    every row free of penalties, a ``min_tokens`` ban and a guide) equal, field by field, the ones
    the general way builds for the same rows, at every rebuild of an engine whose requests vary in
    temperature, top-k/p, min-p, logprobs and ``min_tokens`` (whose rows are stateful until it is met)."""
    import dataclasses
    import random

    rng = random.Random(7)
    arrivals = [(rng.randint(0, 12), [rng.randrange(100, 900) for _ in range(rng.randint(3, 20))],
                 SamplingParams(max_tokens=rng.randint(3, 10), temperature=rng.choice([0.0, 0.7, 1.2]),
                                top_k=rng.choice([-1, 20]), top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
                                logprobs=rng.choice([None, 0, 2]), min_tokens=rng.choice([0, 0, 3]), seed=i,
                                ignore_eos=rng.random() < 0.5))
                for i in range(24)]
    eng = make_engine(tiny_llama, batching="continuous", kv_cache="paged", block_size=4, max_num_seqs=6, max_model_len=96)
    runner = eng.runner
    build = runner._build_sampling_tensors
    seen = {"stateless": 0, "general": 0}

    def check(seqs, eos_ids, stateless=False):
        tensors = build(seqs, eos_ids, stateless)
        if stateless:
            want = build(seqs, eos_ids)
            for f in dataclasses.fields(tensors):
                a, b = getattr(tensors, f.name), getattr(want, f.name)
                assert (a.shape == b.shape and torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b, f.name
        seen["stateless" if stateless else "general"] += 1
        return tensors

    runner._build_sampling_tensors = check
    drive(eng, arrivals)
    assert seen["stateless"] > 5 and seen["general"] > 5, seen


def test_prefill_graph_sizes_are_powers_of_two_up_to_the_maximum():
    assert prefill_graph_sizes(0) == [] and prefill_graph_sizes(1) == []  # a one-token step is a decode
    assert prefill_graph_sizes(2) == [2]
    assert prefill_graph_sizes(16) == [16]
    assert prefill_graph_sizes(48) == [16, 32, 48]
    assert prefill_graph_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_graph_sizes(100) == [16, 32, 64, 100]


def test_mixed_graph_sizes_are_powers_of_two_from_64_up_to_the_maximum():
    assert mixed_graph_sizes(0) == [] and mixed_graph_sizes(1) == []
    assert mixed_graph_sizes(48) == [48]
    assert mixed_graph_sizes(64) == [64]
    assert mixed_graph_sizes(100) == [64, 100]
    assert mixed_graph_sizes(2048) == [64, 128, 256, 512, 1024, 2048]


@pytest.mark.parametrize("kw, match", [
    (dict(cuda_graphs=True), "CUDA device"),
    (dict(cuda_graph_max_batch_size=0), "cuda_graph_max_batch_size"),
    (dict(cuda_graph_prefill_max_tokens=64), "needs cuda_graphs"),
    (dict(cuda_graph_prefill_max_tokens=-1), "cuda_graph_prefill_max_tokens must be >= 0"),
    (dict(cuda_graph_mixed_max_tokens=64), "needs cuda_graphs"),
    (dict(cuda_graph_mixed_max_tokens=-1), "cuda_graph_mixed_max_tokens must be >= 0"),
    (dict(pdl=True), "pdl needs a CUDA device"),
])
def test_invalid_graph_configs_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(device="cpu", **kw).validate()


# ---------------------------------------------------------------------------- GPU


def _count_calls(obj, name: str) -> list[int]:
    """Replace ``obj.name`` by a wrapper that notes each call's token count (its first argument's length)."""
    calls: list[int] = []
    real = getattr(obj, name)

    def counting(ids, *a, **k):
        calls.append(len(ids))
        return real(ids, *a, **k)

    setattr(obj, name, counting)
    return calls


def _slots_written(cache) -> list[int]:
    """Per layer, the cache slots whose K is not NaN (the test filled the cache with NaN first)."""
    return (~torch.isnan(cache.k)).flatten(3).any(dim=3).flatten(1).sum(dim=1).tolist()


def _mixed_engine(loaded) -> LLMEngine:
    """Chunked prefill under a 64-token budget with mixed-step graphs of up to 64 tokens (no prefill
    graphs: a prompt alone runs as a mixed step too), its cache NaN."""
    eng = _gpu_engine(loaded, kv_cache="paged", block_size=4, cuda_graphs=True, cuda_graph_max_batch_size=4,
                      cuda_graph_mixed_max_tokens=64, cuda_graph_prefill_max_tokens=0, max_num_batched_tokens=64, chunked_prefill=True,
                      fused_kernels=True)
    eng.runner.kv_cache.k.fill_(float("nan"))
    return eng


def _gpu_engine(loaded, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(loaded.path), device="cuda", dtype="float32", max_model_len=128,
                                  batching="continuous", max_num_seqs=16, **kw), loaded=loaded)


@pytest.fixture(scope="module")
def tiny_llama_cuda(tiny_llama):
    return load_model(str(tiny_llama.path), device="cuda", dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def tiny_gemma3_cuda(tiny_gemma3):
    return load_model(str(tiny_gemma3.path), device="cuda", dtype=torch.float32, progress=False)


@pytest.mark.gpu
def test_torch_backend_with_cuda_graphs_is_rejected():
    with pytest.raises(ValueError, match="triton"):
        EngineConfig(device="cuda", cuda_graphs=True, attention_backend="torch").validate()


@pytest.mark.gpu
@pytest.mark.parametrize("fused, overlap, pdl", [(False, False, False), (True, False, False), (True, True, False),
                                                 (True, True, True)])
def test_cuda_graphs_give_the_eager_tokens(tiny_llama_cuda, fused, overlap, pdl):
    """Greedy and seeded-sampled requests arriving over time (batch widths cross buckets 1..16,
    prefills mixed in run eagerly, a small paged cache preempts): the same tokens with graphs
    on and off (and with async scheduling: the previous step's tokens gathered on the device into
    the graph's input), and every block back in the pool (padding rows wrote nothing)."""
    loaded = tiny_llama_cuda
    arrivals = mixed_workload(loaded.config.vocab_size, 24, seed=3) + \
        mixed_workload(loaded.config.vocab_size, 8, seed=4, sampled=True)
    paged = dict(kv_cache="paged", block_size=4,
                 kv_cache_memory_bytes=40 * 4 * loaded.config.kv_bytes_per_token(torch.float32))
    try:
        ref = drive(_gpu_engine(loaded, fused_kernels=fused, **paged), arrivals)
        eng = _gpu_engine(loaded, fused_kernels=fused, cuda_graphs=True, cuda_graph_max_batch_size=12,
                          async_scheduling=overlap, pdl=pdl, **paged)
        assert sorted(eng.runner.graphs.graphs) == [1, 2, 4, 8, 12]
        replays = _count_calls(eng.runner.graphs, "replay")
        assert drive(eng, arrivals) == ref
        assert len(replays) > 10, "no decode step went through a graph"
        assert_pool_full(eng)
    finally:
        loaded.model.set_fused_ops(None)


@pytest.mark.gpu
def test_pdl_gives_bit_identical_logprobs_at_qwen3_4b_shapes(tmp_path):
    """Programmatic dependent launch changes when a kernel starts, not what it computes: a Qwen3-4B-shaped
    model (2 layers, bf16, every kernel at its real grid) decodes the same tokens with bit-identical
    logprobs with it on and off, eagerly and through CUDA graphs, at batch 1 and 3. A kernel that read
    its predecessor's output (or wrote what that one still reads) before waiting for it would race here."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    from infer.llm import LLM

    ckpt = make_checkpoint("qwen3-4b-2l", tmp_path / "qwen3-4b-2l", dtype="bfloat16", device="cuda")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 150000, (n,), generator=g).tolist() for n in (40, 7, 129)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    results = {}
    for graphs in (False, True):
        for pdl in (False, True):
            llm = LLM(str(ckpt), progress=False, device="cuda", dtype="bfloat16", batching="continuous",
                      kv_cache="paged", max_num_seqs=4, max_model_len=256, fused_kernels=True, cuda_graphs=graphs,
                      pdl=pdl)
            try:
                outs = llm.generate(prompts[:1], params) + llm.generate(prompts, params)
                results[graphs, pdl] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
            finally:
                llm.engine.shutdown()
    assert results[False, True] == results[False, False]
    assert results[True, True] == results[True, False]


@pytest.mark.gpu
def test_batch1_decode_logprobs_match_hf_at_qwen3_4b_shapes(tmp_path):
    """Batch-1 decode runs kernels no prefill runs: the one-row ones (norm + QKV and norm + gate/up + SiLU in
    one kernel each, o, down and the LM head in the skinny GEMM), launched with PDL inside CUDA graphs. The
    chosen tokens' logprobs of greedy generations with every phase 8-9 flag and pdl, at Qwen3-4B shapes
    (2 layers, bf16), against HF transformers teacher-forced on the same tokens: within the bf16 parity
    gate (scripts/gpu_parity.py: mean <= 0.06, p99 <= 0.2 nats), as the unfused engine's are."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint
    from transformers import AutoModelForCausalLM

    from infer.llm import LLM

    ckpt = make_checkpoint("qwen3-4b-2l", tmp_path / "qwen3-4b-2l", dtype="bfloat16", device="cuda")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(100, 150000, (n,), generator=g).tolist() for n in (33, 5, 200)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=0)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    deltas = {}
    for name, flags in (("unfused", {}), ("all", dict(fused_kernels=True, cuda_graphs=True, async_scheduling=True,
                                                       pdl=True))):
        llm = LLM(str(ckpt), progress=False, device="cuda", dtype="bfloat16", batching="continuous", kv_cache="paged",
                  max_num_seqs=1, max_model_len=512, **flags)
        try:
            outs = llm.generate(prompts, params)
        finally:
            llm.engine.shutdown()
        d = []
        for prompt, out in zip(prompts, outs):
            gen = out.outputs[0].token_ids
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + gen], device="cuda")).logits[0].float()
            ref = logits[len(prompt) - 1:-1].log_softmax(-1).gather(1, torch.tensor(gen, device="cuda")[:, None])[:, 0]
            ours = torch.tensor([lp.token.logprob for lp in out.outputs[0].logprobs], device="cuda")
            d.append((ours - ref).abs())
        deltas[name] = torch.cat(d)
    for name, d in deltas.items():
        assert d.mean() <= 0.06 and d.quantile(0.99) <= 0.2, (name, d.mean().item(), d.quantile(0.99).item())


@pytest.mark.gpu
def test_pdl_needs_the_triton_backend():
    with pytest.raises(ValueError, match="triton"):
        EngineConfig(device="cuda", pdl=True, attention_backend="torch").validate()


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_forks_of_a_one_token_prefill_get_their_block_with_graphs(tiny_llama_cuda, overlap):
    """``n > 1`` whose shared prefill is one token (a one-token prompt, or a prompt cached but for its
    last token) is a step of one-token rows, like a decode step: the forks must still get their copy of
    the prompt's last block after it (the decode graphs' path once skipped the copy, and the forks then
    attended to a slot nobody wrote), so the tokens are the eager ones."""
    loaded = tiny_llama_cuda
    prompt = list(range(20, 29))  # 9 tokens: two full blocks of 4, cached by the first request
    arrivals = [(0, prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)),
                (1, [11], SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)),
                (4, prompt, SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=6, ignore_eos=True))]
    paged = dict(kv_cache="paged", block_size=4, prefix_caching=True)
    ref = drive(_gpu_engine(loaded, **paged), arrivals)
    eng = _gpu_engine(loaded, cuda_graphs=True, cuda_graph_max_batch_size=8, async_scheduling=overlap, **paged)
    assert drive(eng, arrivals) == ref
    assert eng.stats()["prefix_cache_hits"] >= 8  # the third request's two blocks


@pytest.mark.gpu
def test_graph_padding_rows_do_not_touch_the_cache(tiny_llama_cuda):
    """A batch of 3 replays the bucket of 4: the padding row writes no K/V (slot -1) anywhere."""
    eng = _gpu_engine(tiny_llama_cuda, kv_cache="paged", block_size=4, cuda_graphs=True, cuda_graph_max_batch_size=4)
    for i in range(3):
        eng.add_request([5 + i, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    eng.step()  # the prefills (eager)
    cache = eng.runner.kv_cache
    used = {b for s in eng.scheduler.running for b in s.block_table}
    free = torch.tensor(sorted(set(range(cache.num_blocks)) - used), device=cache.k.device)
    cache.k[:, free] = float("nan")
    eng.step()  # one decode step of 3 through the bucket of 4
    assert torch.isnan(cache.k[:, free]).all(), "a padding row wrote into a free block"


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_graphs_give_the_eager_tokens(tiny_llama_cuda, overlap):
    """Steps that prefill one sequence alone replay a prefill graph: lone prompts of 2-60 tokens
    (every bucket, padded), the chunks of longer ones (chunked prefill, a 48-token budget), the suffix
    after a prefix-cache hit, n = 2 forks, greedy and seeded sampling; then a burst of requests
    whose mixed steps run eagerly. The same tokens as the eager engine (and with async scheduling:
    the previous step's token patched into the graph's input), every block back in the pool."""
    loaded = tiny_llama_cuda
    rng = random.Random(5)
    vocab = loaded.config.vocab_size
    shared = [rng.randrange(100, vocab - 100) for _ in range(40)]
    arrivals = []
    for i in range(12):  # one every 8 steps: each runs alone (a prefill of <= 3 chunks, then 3 decodes)
        prompt = (shared if i % 2 else []) + [rng.randrange(100, vocab - 100) for _ in range(rng.choice([2, 5, 17, 33, 60]))]
        params = SamplingParams(max_tokens=4, temperature=rng.choice([0.0, 0.8]), seed=i, n=2 if i % 3 == 0 else 1,
                                ignore_eos=True)
        arrivals.append((8 * i, prompt, params))
    arrivals += [(100 + step, p, sp) for step, p, sp in mixed_workload(vocab, 12, seed=6)]
    kw = dict(kv_cache="paged", block_size=4, prefix_caching=True, chunked_prefill=True, max_num_batched_tokens=48,
              fused_kernels=True)
    try:
        ref = drive(_gpu_engine(loaded, **kw), arrivals)
        eng = _gpu_engine(loaded, cuda_graphs=True, cuda_graph_max_batch_size=8, cuda_graph_prefill_max_tokens=64,
                          async_scheduling=overlap, **kw)
        graphs = eng.runner.graphs
        assert sorted(graphs.prefill_graphs) == [16, 32, 48]  # capped by the 48-token budget
        replays = _count_calls(graphs, "replay_prefill")
        assert drive(eng, arrivals) == ref
        assert len(replays) >= 12 and max(replays) == 48 and min(replays) < 16, replays
        assert eng.kv_manager.prefix_cache_hits >= 5 * len(shared)  # five requests found the shared prefix
        assert_drained(eng)  # (freed blocks with a hash stay cached: free, but not in the plain free list)
    finally:
        loaded.model.set_fused_ops(None)


@pytest.mark.gpu
def test_prefill_graph_padding_rows_do_not_touch_the_cache(tiny_llama_cuda):
    """A 5-token prompt replays the 16-token bucket: the 11 padding rows write no K/V anywhere."""
    eng = _gpu_engine(tiny_llama_cuda, kv_cache="paged", block_size=4, cuda_graphs=True, cuda_graph_max_batch_size=4,
                      cuda_graph_prefill_max_tokens=32)
    cache = eng.runner.kv_cache
    cache.k.fill_(float("nan"))
    eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    out = eng.step(stream=False)
    assert out and out[0].outputs[0].token_ids, "the request did not finish in one step"
    # exactly the prompt's 5 slots hold K in every layer; everything else is still NaN
    assert _slots_written(cache) == [5] * cache.k.shape[0], _slots_written(cache)


@pytest.mark.gpu
@pytest.mark.parametrize("fixture, fused, overlap", [("tiny_llama_cuda", False, False), ("tiny_llama_cuda", True, False),
                                                     ("tiny_llama_cuda", True, True), ("tiny_gemma3_cuda", True, True)])
def test_mixed_step_graphs_give_the_eager_tokens(fixture, fused, overlap, request):
    """Mixed steps (decodes beside prompt chunks under a 100-token budget, several prefills at once,
    n = 2 forks, prefix-cache hits, greedy and seeded sampling, preemptions in a small paged cache)
    replay graphs: decodes beside one chunk the bucket's whole-step graph (attention inside), the
    others its pieces (attention eager between them). The same tokens as the eager engine, every
    block back in the pool. Without fused kernels the attention writes the K/V; with them the RoPE
    kernel does. Gemma 3: sliding-window layers (32 tokens) beside global ones."""
    loaded = request.getfixturevalue(fixture)
    vocab = loaded.config.vocab_size
    rng = random.Random(11)
    shared = [rng.randrange(100, vocab - 100) for _ in range(24)]
    arrivals = mixed_workload(vocab, 24, seed=12) + mixed_workload(vocab, 8, seed=13, sampled=True)
    arrivals += [(5 * i, shared + [rng.randrange(100, vocab - 100) for _ in range(rng.randint(1, 40))],
                  SamplingParams(max_tokens=6, temperature=0.0, n=2 if i % 2 else 1, ignore_eos=True))
                 for i in range(6)]
    kw = dict(kv_cache="paged", block_size=4, prefix_caching=True, chunked_prefill=True, max_num_batched_tokens=100,
              fused_kernels=fused, kv_cache_memory_bytes=60 * 4 * loaded.config.kv_bytes_per_token(torch.float32))
    try:
        ref = drive(_gpu_engine(loaded, **kw), arrivals)
        eng = _gpu_engine(loaded, cuda_graphs=True, cuda_graph_max_batch_size=8, cuda_graph_mixed_max_tokens=100,
                          async_scheduling=overlap, **kw)
        graphs = eng.runner.graphs
        assert sorted(graphs.mixed) == sorted(graphs.mixed_full) == [64, 100]
        assert all(len(g) == loaded.config.num_layers + 1 for g, _, _ in graphs.mixed.values())
        pieces, whole = _count_calls(graphs, "replay_mixed"), _count_calls(graphs, "replay_mixed_full")
        assert drive(eng, arrivals) == ref
        assert len(whole) >= 5 and min(whole) <= 64, whole
        assert len(pieces) >= 3 and max(whole + pieces) > 64, (whole, pieces)  # both buckets replayed
        assert eng.scheduler.stats()["num_chunked_prefill_steps"] > 0, "no prompt was chunked"
        assert_drained(eng)
    finally:
        loaded.model.set_fused_ops(None)


@pytest.mark.gpu
def test_whole_mixed_step_writes_only_its_own_slots(tiny_llama_cuda):
    """A 5-token prompt alone, then its first decode beside a 7-token prompt: both steps replay the
    64-token bucket's whole-step graph (4 decode rows, 1 then 0 of them real; 59 and 56 padding token
    rows). Only the 5, then 1 + 7, real slots get K/V."""
    eng = _mixed_engine(tiny_llama_cuda)
    try:
        cache = eng.runner.kv_cache
        whole = _count_calls(eng.runner.graphs, "replay_mixed_full")
        eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        eng.step(stream=False)
        assert whole == [5] and _slots_written(cache) == [5] * cache.k.shape[0]
        eng.add_request([9, 8, 7, 6, 5, 4, 3], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        eng.step(stream=False)
        assert whole == [5, 8] and _slots_written(cache) == [13] * cache.k.shape[0]
    finally:
        tiny_llama_cuda.model.set_fused_ops(None)


@pytest.mark.gpu
def test_mixed_step_padding_rows_do_not_touch_the_cache(tiny_llama_cuda):
    """Two prompts of 5 and 7 tokens prefill together in the 64-token bucket: only their 12 slots
    get K/V, the 52 padding rows write nothing."""
    eng = _mixed_engine(tiny_llama_cuda)
    try:
        cache = eng.runner.kv_cache
        eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        eng.add_request([9, 8, 7, 6, 5, 4, 3], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        replays = _count_calls(eng.runner.graphs, "replay_mixed")
        out = eng.step(stream=False)
        assert replays == [12] and len(out) == 2
        assert _slots_written(cache) == [12] * cache.k.shape[0], _slots_written(cache)
    finally:
        tiny_llama_cuda.model.set_fused_ops(None)


@pytest.mark.gpu
def test_warm_up_compiles_the_split_extend_before_any_request(tiny_llama_cuda):
    """A long prompt chunked next to a decoding stream: its extends split their keys (``SPLIT=True``
    and the merge kernel). The engine's warm-up compiled both at start-up, so serving compiles no
    attention kernel (Triton's compile hook sees none); the warm-up itself writes no K/V."""
    from triton import knobs

    from infer.kernels import prefill_attention

    loaded = tiny_llama_cuda
    for kernel in (prefill_attention._paged_prefill_kernel, prefill_attention._prefill_combine_kernel):
        kernel.device_caches.clear()  # as in a fresh process (other tests compiled them already)
    compiled: list[str] = []

    def hook(**kw):
        compiled.append(kw["fn"].name)
        return False  # compile as usual

    splits: list[int] = []
    real_splits = prefill_attention.prefill_num_splits

    def counting_splits(*a):
        splits.append(real_splits(*a))
        return splits[-1]

    old_hook, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, hook
    prefill_attention.prefill_num_splits = counting_splits
    try:
        eng = LLMEngine(EngineConfig(model=str(loaded.path), device="cuda", dtype="float32", max_model_len=4096,
                                     batching="continuous", max_num_seqs=4, kv_cache="paged", chunked_prefill=True,
                                     max_num_batched_tokens=64, fused_kernels=True), loaded=loaded)
        at_start, compiled[:] = list(compiled), []
        cache = eng.runner.kv_cache
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
        eng.runner.warm_up()
        assert torch.isnan(cache.k).all() and torch.isnan(cache.v).all(), "the warm-up wrote into the cache"
        cache.k.zero_()
        cache.v.zero_()
        compiled.clear()
        splits.clear()
        rng = random.Random(7)
        vocab = loaded.config.vocab_size
        eng.add_request([rng.randrange(100, vocab - 100) for _ in range(8)],
                        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            eng.step()
        eng.add_request([rng.randrange(100, vocab - 100) for _ in range(1500)],
                        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
    finally:
        knobs.runtime.jit_cache_hook = old_hook
        prefill_attention.prefill_num_splits = real_splits
        loaded.model.set_fused_ops(None)
    assert {"_paged_prefill_kernel", "_prefill_combine_kernel"} <= set(at_start)
    assert max(splits) > 1, "no extend split its keys: the test proves nothing"
    assert not {"_paged_prefill_kernel", "_prefill_combine_kernel"} & set(compiled), compiled
