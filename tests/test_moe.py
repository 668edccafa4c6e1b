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
