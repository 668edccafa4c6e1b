"""Phases 8-9 in the engine: the fused forward (``fused_kernels``) and CUDA graphs (``cuda_graphs``).

The fused ops themselves are tested against their references in tests/test_fused_kernels.py.
Here: the fused forward computes what the reference forward computes (HF parity, float32, CPU),
an engine with the flag gives the same greedy tokens as without it (torch backend, and the Triton
kernels under the interpreter), the graph buckets, the config checks, and on a GPU the graph
runner's replays against eager steps.
"""

from __future__ import annotations

import pytest
import torch

from infer.config import EngineConfig
from infer.engine import LLMEngine
from infer.engine.cuda_graphs import bucket_for, graph_batch_sizes
from infer.loader import load_model
from infer.sampling import SamplingParams
from tests.hf_reference import hf_logits, infer_logits, save_hf, tiny_hf_model
from tests.test_batching import assert_pool_full, drive, make_engine, mixed_workload
from tests.test_parity import _prompts, assert_parity

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
    sizes = graph_batch_sizes(20)
    assert [bucket_for(b, sizes) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [1, 2, 4, 4, 8, 8, 16, 16, 20, 20]
    assert bucket_for(21, sizes) is None


@pytest.mark.parametrize("kw, match", [
    (dict(cuda_graphs=True), "CUDA device"),
    (dict(cuda_graph_max_batch_size=0), "cuda_graph_max_batch_size"),
])
def test_invalid_graph_configs_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(device="cpu", **kw).validate()


# ---------------------------------------------------------------------------- GPU


def _gpu_engine(loaded, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(loaded.path), device="cuda", dtype="float32", max_model_len=128,
                                  batching="continuous", max_num_seqs=16, **kw), loaded=loaded)


@pytest.fixture(scope="module")
def tiny_llama_cuda(tiny_llama):
    return load_model(str(tiny_llama.path), device="cuda", dtype=torch.float32, progress=False)


@pytest.mark.gpu
def test_torch_backend_with_cuda_graphs_is_rejected():
    with pytest.raises(ValueError, match="triton"):
        EngineConfig(device="cuda", cuda_graphs=True, attention_backend="torch").validate()


@pytest.mark.gpu
@pytest.mark.parametrize("fused, overlap", [(False, False), (True, False), (True, True)])
def test_cuda_graphs_give_the_eager_tokens(tiny_llama_cuda, fused, overlap):
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
                          async_scheduling=overlap, **paged)
        assert sorted(eng.runner.graphs.graphs) == [1, 2, 4, 8, 12]
        replays = 0
        real_replay = eng.runner.graphs.replay

        def counting_replay(*a):
            nonlocal replays
            replays += 1
            return real_replay(*a)

        eng.runner.graphs.replay = counting_replay
        assert drive(eng, arrivals) == ref
        assert replays > 10, "no decode step went through a graph"
        assert_pool_full(eng)
    finally:
        loaded.model.set_fused_ops(None)


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
