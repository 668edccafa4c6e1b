"""Phase 15: Qwen3-MoE and the fused MoE kernel.

* The model against Hugging Face transformers' ``Qwen3MoeForCausalLM`` on tiny random checkpoints
  (fp32, max |Δlogit| <= 1e-3): renormalized top-2, and top-3 without renormalization with
  ``decoder_sparse_step`` / ``mlp_only_layers`` dense layers; per-expert checkpoint tensors are
  stacked while loading.
* Routing (:func:`select_experts`) against a hand computation; the sort by expert
  (:func:`moe_align_block_size`) against its definition; the Triton grouped-GEMM kernel against the
  loop over experts (under ``TRITON_INTERPRET=1`` on the CPU, tiny shapes; at Qwen3-30B-A3B's shapes
  on a GPU).
"""

from __future__ import annotations

import pytest
import torch

from infer.kernels import moe_reference as ref
from infer.loader import load_model
from tests.hf_reference import hf_logits, infer_logits, save_hf, tiny_hf_model
from tests.test_parity import _prompts, assert_parity


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_moe-sparse-step"])
def moe_pair(request, tmp_path_factory):
    """(HF model, infer's LoadedModel) on the same tiny random weights."""
    hf = tiny_hf_model(request.param)
    path = save_hf(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(path, device="cpu", dtype=torch.float32, progress=False)


def test_tiny_qwen3_moe_matches_hf(moe_pair):
    hf, ours = moe_pair
    cfg = ours.config
    assert cfg.architecture == "qwen3_moe" and cfg.num_experts == 8
    assert cfg.norm_topk_prob == hf.config.norm_topk_prob
    layers = [type(layer.mlp).__name__ for layer in ours.model.model.layers]
    assert layers == [type(layer.mlp).__name__.replace("Qwen3MoeSparseMoeBlock", "SparseMoeBlock")
                      .replace("Qwen3MoeMLP", "GatedMLP") for layer in hf.model.layers]
    assert cfg.num_params() == sum(p.numel() for p in hf.parameters())
    prompts = _prompts(hf.config.vocab_size, [1, 6, 37])
    for seq, logits in zip(prompts, infer_logits(ours.model, prompts)):
        assert_parity(logits, hf_logits(hf, seq))


# ---------------------------------------------------------------------------------- routing


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts_matches_hand_computation(renormalize):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 6, generator=g) * 2
    weights, ids = ref.select_experts(logits, 3, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (7, 3)
    for t in range(7):
        p = [float(v) for v in torch.exp(logits[t].double() - logits[t].double().max())]
        p = [v / sum(p) for v in p]
        best = sorted(range(6), key=lambda e: -p[e])[:3]
        assert ids[t].tolist() == best
        kept = [p[e] for e in best]
        want = [v / sum(kept) for v in kept] if renormalize else kept
        assert weights[t].tolist() == pytest.approx(want, rel=1e-6)


def test_select_experts_takes_the_softmax_in_float32():
    """bf16 and fp16 router logits: the weights are the float32 softmax of those values (a softmax taken
    in the logits' dtype and cast afterwards is off by ~1e-3, relatively)."""
    g = torch.Generator().manual_seed(5)
    # distinct multiples of 1/4 below 4, exact in both dtypes: no ties in the order
    values = torch.stack([torch.randperm(16, generator=g) for _ in range(4)]).double() / 4
    for dtype in (torch.bfloat16, torch.float16):
        weights, ids = ref.select_experts(values.to(dtype), 4, False)
        assert weights.dtype == torch.float32
        p = torch.softmax(values, dim=-1)  # float64, of the same values
        want = p.topk(4, dim=-1)
        assert torch.equal(ids.long(), want.indices)
        torch.testing.assert_close(weights.double(), want.values, rtol=1e-6, atol=0)


def test_renormalized_top_k_is_softmax_of_top_k_logits():
    """Qwen3-MoE's order (softmax, top-k, renormalize) equals Mixtral's (top-k, softmax)."""
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(4))
    weights, ids = ref.select_experts(logits, 2, True)
    top = logits.topk(2, dim=-1)
    assert torch.equal(ids.long(), top.indices)
    torch.testing.assert_close(weights, torch.softmax(top.values, -1))


def test_select_experts_rejects_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        ref.select_experts(torch.zeros(2, 4), 5, True)


# ---------------------------------------------------------------------------------- sort by expert


@pytest.mark.parametrize("t,k,e,block,start,local", [(1, 2, 8, 4, 0, 8), (9, 3, 5, 4, 0, 5), (33, 2, 4, 16, 0, 4),
                                                     (12, 2, 8, 4, 2, 3)])
def test_moe_align_block_size_groups_pairs_by_expert(t, k, e, block, start, local):
    """Every block holds one expert's pairs; each held pair appears once, in token order; padding is
    the sentinel; pairs of experts held elsewhere are left out; the buffer size depends on shapes only."""
    g = torch.Generator().manual_seed(t * 100 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    sorted_ids, expert_ids, num_post = ref.moe_align_block_size(ids, block, local, start)
    n = t * k
    assert sorted_ids.numel() == ref.max_padded_tokens(n, local, block) and sorted_ids.numel() % block == 0
    used = int(num_post)
    flat = ids.flatten().tolist()
    expected_used = 0
    for x in range(local):
        pairs = [j for j in range(n) if flat[j] == x + start]
        expected_used += -(-len(pairs) // block) * block
    assert used == expected_used
    seen = []
    for b in range(sorted_ids.numel() // block):
        rows = sorted_ids[b * block:(b + 1) * block].tolist()
        if b * block >= used:
            assert expert_ids[b] == -1 and all(r == n for r in rows)
            continue
        real = [r for r in rows if r != n]
        assert real, "a block inside the used length holds no pair"
        assert all(flat[r] - start == int(expert_ids[b]) for r in real)
        assert rows[:len(real)] == real  # padding only at the end of a group
        seen += real
    held = [j for j in range(n) if 0 <= flat[j] - start < local]
    assert sorted(seen) == held and len(seen) == len(set(seen))
    # within an expert, token order
    for x in range(local):
        mine = [j for j in seen if flat[j] - start == x]
        assert mine == sorted(mine)


# ---------------------------------------------------------------------------------- the Triton kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


def moe_inputs(t, h, i, e, k, dtype, seed=0, renormalize=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(dtype).to(DEVICE)
    logits = torch.randn(t, e, generator=g).to(DEVICE)
    weights, ids = ref.select_experts(logits, k, renormalize)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,h,i,e,k", [(1, 32, 16, 4, 2), (7, 48, 24, 5, 3), (20, 32, 16, 4, 2)])
def test_triton_fused_experts_matches_loop(dtype, t, h, i, e, k):
    """Odd widths (48, 24: partial column and K blocks), T=1 (decode), more pairs than a block."""
    from infer.kernels import moe_triton

    x, w13, w2, weights, ids = moe_inputs(t, h, i, e, k, dtype, seed=t + h)
    expected = ref.fused_experts(x, w13, w2, weights, ids)
    out = moe_triton.fused_experts(x, w13, w2, weights, ids, num_experts=e)
    assert out.dtype == dtype and not torch.isnan(out).any()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("one_program_sort", [True, False])
def test_triton_fused_experts_over_a_subset_of_experts(one_program_sort, monkeypatch):
    """An expert-parallel rank holds experts 2..4 of 6: both versions compute only their pairs,
    and the ranks' outputs sum to the whole layer's. With the one-program sort and with the
    reference's (what large steps use)."""
    from infer.kernels import moe_triton

    if not one_program_sort:
        monkeypatch.setattr(moe_triton, "ALIGN_ONE_PROGRAM_MAX_PAIRS", 0)

    x, w13, w2, weights, ids = moe_inputs(9, 32, 16, 6, 2, torch.float32, seed=5)
    whole = ref.fused_experts(x, w13, w2, weights, ids)
    parts = []
    for start, stop in [(0, 2), (2, 5), (5, 6)]:
        mine = ref.fused_experts(x, w13[start:stop], w2[start:stop], weights, ids, expert_start=start)
        kern = moe_triton.fused_experts(x, w13[start:stop], w2[start:stop], weights, ids, expert_start=start,
                                        num_experts=6)
        torch.testing.assert_close(kern, mine, atol=1e-5, rtol=1e-5)
        parts.append(kern)
    torch.testing.assert_close(sum(parts), whole, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """scripts/make_synthetic_checkpoint.py's tiny-qwen3-moe (layer 1 dense), in infer and in HF."""
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint("tiny-qwen3-moe", tmp_path_factory.mktemp("tiny-qwen3-moe"), dtype="float32", device="cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_model(path, device="cpu", dtype=torch.float32, progress=False), hf


ENGINE_FLAGS = {
    "phase1": dict(),
    "paged-continuous-chunked-fused": dict(batching="continuous", kv_cache="paged", block_size=8,
                                           chunked_prefill=True, max_num_batched_tokens=16, fused_kernels=True),
    # the Triton MoE kernel (interpreted here: few, short prompts)
    "triton": dict(batching="continuous", kv_cache="paged", block_size=8, moe_backend="triton"),
}


@pytest.mark.parametrize("flags", list(ENGINE_FLAGS))
def test_engine_greedy_tokens_equal_hf_generate(tiny_moe, flags):
    from infer.kernels import moe_reference, moe_triton
    from infer.sampling import SamplingParams
    from tests.test_batching import assert_pool_full, drive, make_engine
    from tests.test_generation import hf_greedy

    loaded, hf = tiny_moe
    small = flags == "triton"
    n = 4 if small else 10
    prompts = [[5, 6, 7], list(range(100, 108 if small else 140)), [300] * (5 if small else 17), [42]]
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    engine = make_engine(loaded, max_model_len=96, max_num_seqs=4, **ENGINE_FLAGS[flags])
    got = drive(engine, [(i % 3, p, params) for i, p in enumerate(prompts)])
    experts = loaded.model.model.layers[0].mlp.experts
    assert experts.ops is (moe_triton if small else moe_reference)
    for i, p in enumerate(prompts):
        assert got[i][0] == hf_greedy(hf, p, n), f"prompt {i}"
    assert_pool_full(engine)


# ---------------------------------------------------------------------------------- GPU, real shapes

# Qwen3-30B-A3B: hidden 2048, 128 experts of width 768, top-8 renormalized
A3B = dict(h=2048, i=768, e=128, k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 64, 512, 4096])
def test_triton_fused_experts_at_qwen3_30b_a3b_shapes(t):
    """bf16 kernel vs the loop in float32 on the same bf16 weights (the loop in bf16 rounds more)."""
    from infer.kernels import moe_triton

    x, w13, w2, weights, ids = moe_inputs(t, A3B["h"], A3B["i"], A3B["e"], A3B["k"], torch.bfloat16, seed=t)
    out = moe_triton.fused_experts(x, w13, w2, weights, ids, num_experts=A3B["e"])
    expected = ref.fused_experts(x.float(), w13.float(), w2.float(), weights, ids)
    err = (out.float() - expected).abs().max().item()
    assert err <= 2e-2 * expected.abs().max().item(), err
    # float32 weights: IEEE dot products, tight agreement
    out32 = moe_triton.fused_experts(x.float(), w13.float(), w2.float(), weights, ids, num_experts=A3B["e"])
    torch.testing.assert_close(out32, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_triton_fused_experts_replays_in_a_cuda_graph():
    """Captured once with one routing, replayed with others: the sort buffer's size depends only on T and
    nothing syncs with the host, so the replay computes the new routing (a data-dependent kernel would
    fail to capture or replay the old one)."""
    from infer.kernels import moe_triton

    t = 8
    x, w13, w2, weights, ids = moe_inputs(t, A3B["h"], A3B["i"], A3B["e"], A3B["k"], torch.bfloat16, seed=1)
    static = [x.clone(), weights.clone(), ids.clone()]
    moe_triton.fused_experts(*static[:1], w13, w2, static[1], static[2], num_experts=A3B["e"])  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_triton.fused_experts(static[0], w13, w2, static[1], static[2], num_experts=A3B["e"])
    for seed in (2, 3):
        x2, _, _, w_new, ids_new = moe_inputs(t, A3B["h"], A3B["i"], A3B["e"], A3B["k"], torch.bfloat16, seed=seed)
        if seed == 3:  # every token to the same 8 experts: 8 pairs per expert instead of ~1
            ids_new = torch.arange(A3B["k"], dtype=torch.int32, device=DEVICE).repeat(t, 1)
        for buf, new in zip(static, (x2, w_new, ids_new)):
            buf.copy_(new)
        graph.replay()
        eager = moe_triton.fused_experts(x2, w13, w2, w_new, ids_new, num_experts=A3B["e"])
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


def test_random_weights_directory_loads_the_same_weights_twice(tmp_path):
    """``--random-weights`` (for 30B-A3B, too big to write): no weight files; the loader generates
    them, seeded, with the written checkpoints' statistics."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_synthetic_checkpoint import PRESETS, make_checkpoint

    path = make_checkpoint("tiny-qwen3-moe", tmp_path / "rw", dtype="float32", device="cpu", random_weights=True)
    assert not list(path.glob("*.safetensors"))
    a, b = (load_model(path, device="cpu", dtype=torch.float32, progress=False) for _ in range(2))
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name
    experts = a.model.model.layers[0].mlp.experts.gate_up_proj
    assert abs(experts.std().item() - PRESETS["tiny-qwen3-moe"].init_std) < 0.01
    assert abs(a.model.model.norm.weight.mean().item() - 1.0) < 0.03
    logits = infer_logits(a.model, [[1, 2, 3]])[0]
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_moe_backend_config_checks(monkeypatch):
    from infer.config import EngineConfig

    assert EngineConfig(device="cpu").resolved_moe_backend() == "torch"
    with pytest.raises(ValueError, match="moe_backend must be one of"):
        EngineConfig(device="cpu", moe_backend="cuda").validate()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        EngineConfig(device="cpu", moe_backend="triton").validate()


@pytest.mark.gpu
def test_cuda_graphs_is_rejected_with_the_torch_moe_loop():
    from infer.config import EngineConfig

    with pytest.raises(ValueError, match="moe_backend='triton'"):
        EngineConfig(device="cuda", cuda_graphs=True, moe_backend="torch").validate()


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_engine_on_gpu_cuda_graphs_give_the_eager_tokens(tmp_path, fused):
    """tiny-qwen3-moe in bf16 on the GPU: the Triton experts under CUDA-graph replay give the tokens of
    the eager Triton run, and the eager Triton run those of the torch loop (float32, where rounding does
    not flip argmaxes; the Triton attention backend in both)."""
    import sys
    from pathlib import Path

    from infer.config import EngineConfig
    from infer.engine import LLMEngine
    from infer.sampling import SamplingParams
    from tests.test_batching import drive

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint("tiny-qwen3-moe", tmp_path / "m", dtype="float32", device="cuda")
    arrivals = [(i, [7 + i] * (3 + 5 * i), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
                for i in range(6)]

    def run(dtype, **kw):
        cfg = EngineConfig(model=str(path), device="cuda", dtype=dtype, max_model_len=128, max_num_seqs=8,
                           batching="continuous", kv_cache="paged", fused_kernels=fused, **kw)
        return drive(LLMEngine(cfg), arrivals)

    assert run("float32", moe_backend="triton") == run("float32", moe_backend="torch")
    assert run("bfloat16", cuda_graphs=True) == run("bfloat16")


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (5, 6, 3), (3, 128, 8)])
def test_triton_select_experts_matches_reference(renormalize, t, e, k):
    from infer.kernels import moe_triton

    logits = (torch.randn(t, e, generator=torch.Generator().manual_seed(e + k)) * 3).to(DEVICE)
    w, ids = moe_triton.select_experts(logits, k, renormalize)
    w_ref, ids_ref = ref.select_experts(logits, k, renormalize)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("e", [6, 8])  # padded to 8 lanes, and not padded
@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_triton_select_experts_routes_nan_logits_to_real_experts(gpu, e):
    """Router logits that overflowed (NaN) route to k distinct experts in [0, E), never to id E or past
    it: the grouped GEMM would read that expert's weights outside the tensor (an illegal access on a
    GPU, which ends the CUDA context). A NaN makes the whole softmax NaN, and a NaN counts as the
    largest value with the lowest id first (torch.argmax's rule): experts 0, 1, 2. A finite row keeps
    the reference's routing."""
    if not gpu and torch.cuda.is_available():
        pytest.skip("the interpreter's case; the GPU twin runs here")
    from infer.kernels import moe_triton

    device = "cuda" if gpu else "cpu"
    logits = torch.randn(4, e, generator=torch.Generator().manual_seed(e)) * 3
    logits[0] = float("nan")
    logits[1, 4] = float("nan")
    logits[3, 1], logits[3, 2] = float("inf"), float("nan")
    w, ids = moe_triton.select_experts(logits.to(device), 3, True)
    for r in (0, 1, 3):
        assert ids[r].tolist() == [0, 1, 2] and bool(w[r].isnan().all())
    w_ref, ids_ref = ref.select_experts(logits[2:3], 3, True)
    assert torch.equal(ids[2].cpu(), ids_ref[0])
    torch.testing.assert_close(w[2].cpu(), w_ref[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("t,k,e,block,start,local", [(1, 8, 128, 16, 0, 128), (9, 3, 5, 4, 0, 5),
                                                     (70, 2, 4, 16, 0, 4), (12, 2, 8, 4, 2, 3)])
def test_triton_moe_align_block_size_equals_reference(t, k, e, block, start, local):
    """The one-launch sort gives the reference's three tensors exactly (token order kept within an
    expert); 70 x 2 pairs span several chunks of the kernel's loop."""
    from infer.kernels import moe_triton

    g = torch.Generator().manual_seed(t + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32).to(DEVICE)
    for got, want in zip(moe_triton.moe_align_block_size(ids, block, local, start),
                         ref.moe_align_block_size(ids, block, local, start)):
        assert torch.equal(got, want)
