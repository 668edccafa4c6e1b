"""Phase 16: LoRA adapters, several per batch, against PEFT (the library that wrote them) as the reference.

* the shrink / expand kernels (Triton under the interpreter, and the plain-PyTorch path) against a
  float64 per-row computation on fresh random inputs;
* tiny random Llama / Qwen3 checkpoints (transformers' own classes) with adapters made by PEFT at
  several ranks, targets, alphas and rsLoRA: one flattened batch that mixes base rows with three
  adapters gives, per row, the logits of PEFT's ``merge_and_unload()`` model for that adapter;
* the engine: greedy tokens of a batch mixing the base model and three adapters with fewer device slots
  than adapters (slots are reused while requests run) equal Hugging Face's greedy tokens of each
  merged model; the prefix cache never hands one adapter's KV to another;
* every unsupported adapter and flag combination is rejected with its reason.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from infer import LLM, EngineConfig, InvalidRequestError, LoRARequest, SamplingParams  # noqa: E402
from infer.kernels import lora_reference, lora_triton  # noqa: E402
from infer.kernels.triton_common import INTERPRET  # noqa: E402
from infer.loader import load_model  # noqa: E402
from infer.lora import LoRAModelManager, load_adapter  # noqa: E402
from infer.lora.adapter import LORA_PROJS  # noqa: E402
from tests.hf_reference import infer_logits  # noqa: E402

ALL = list(LORA_PROJS)
# (rank, alpha, targets, rsLoRA): different ranks and subsets; the rsLoRA one scales by alpha / sqrt(r)
ADAPTERS = [(4, 8, ["q_proj", "v_proj"], False),
            (8, 16, ALL, True),
            (2, 6, ["k_proj", "o_proj", "down_proj"], False)]
PROMPTS = [[11, 200, 37, 5, 90, 61, 7, 300, 42],
           [3, 9, 27, 81, 243, 17, 51],
           [400, 401, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [250, 8, 99]]


# ------------------------------------------------------------------------------------------ kernels


def _per_row(y, x, a, b, slots, off):
    """float64: y[t, off:off + out] += (x[t] A_s^T) B_s^T, one row at a time."""
    want = y.double().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            want[t, off:off + b.shape[1]] += (x[t].double() @ a[s].double().T) @ b[s].double().T
    return want


#: CPU tensors through the Triton kernels: only under the interpreter (tests/conftest.py sets it where there is no
#: GPU); on a GPU machine their twins at real shapes run in tests/test_gpu_phases.py
interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU tensors through Triton kernels need TRITON_INTERPRET=1")
TRITON_OPS = pytest.param(lora_triton, marks=interpreted, id="triton")


@pytest.mark.parametrize("num_tokens", [5, 70])  # decode-like (16-row tiles) and prefill-like (64-row tiles)
@pytest.mark.parametrize("ops", [pytest.param(lora_reference, id="torch"), TRITON_OPS])
def test_shrink_expand_match_per_row_reference(ops, num_tokens):
    g = torch.Generator().manual_seed(num_tokens)
    num_slots, rank, k, n, off = 3, 8, 72, 40, 6
    x = torch.randn(num_tokens, k, generator=g)
    a = torch.randn(num_slots, rank, k, generator=g)
    b = torch.randn(num_slots, n, rank, generator=g)
    a[1, 5:] = b[1, :, 5:] = 0  # slot 1 holds a rank-5 adapter, padded
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g).tolist()
    slots[0] = -1
    y0 = torch.randn(num_tokens, n + 10, generator=g)
    meta = lora_reference.make_lora_meta(slots, num_slots, "cpu")
    assert meta.num_lora_rows == sum(s >= 0 for s in slots)
    y = ops.add_lora(y0.clone(), x, a, b, meta, y_offset=off)
    want = _per_row(y0, x, a, b, slots, off)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(y[0], y0[0])  # a row without adapter is untouched
    # the two launches apart (what a row-parallel layer runs, its all-reduce in between)
    t = ops.lora_shrink(x, a, meta, torch.zeros(num_tokens, rank))
    y = ops.lora_expand(t, b, meta, y0.clone(), off)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize("split_k", [None, 1, 3, 4])
def test_split_k_shrink_matches_per_row_reference(split_k):
    """The Triton shrink with its K columns split among programs (a decode step's few rows): the partial
    sums of every split, the last one shorter (1,000 columns in 4 splits of 256), add up to x A^T for the
    rows with an adapter. ``None`` is the default choice for these 3 rows, a split of 3. The program that
    finishes a tile last adds its partial sums and resets the tile's arrival counter: a second launch over
    the same counters (as a CUDA graph replays) gives the same bits, and leaves them zero again."""
    assert lora_triton._split_k(3, 1000, 1) == 3 and lora_triton._split_k(70, 1000, 1) == 1
    g = torch.Generator().manual_seed(11)
    x, a = torch.randn(3, 1000, generator=g), torch.randn(2, 8, 1000, generator=g)
    slots = [1, -1, 0]
    meta = lora_reference.make_lora_meta(slots, 2, "cpu")
    meta.split_counters = lora_triton.split_counters(16, "cpu")
    t = lora_triton.lora_shrink(x, a, meta, torch.zeros(3, 8), split_k=split_k)
    for row, s in enumerate(slots):
        if s >= 0:
            torch.testing.assert_close(t[row].double(), x[row].double() @ a[s].double().T, rtol=1e-5, atol=1e-4)
    assert not meta.split_counters.any()
    again = lora_triton.lora_shrink(x, a, meta, torch.full((3, 8), 7.0), split_k=split_k)
    assert torch.equal(again[[0, 2]], t[[0, 2]]) and not meta.split_counters.any()


@interpreted
def test_prefill_sized_shrink_splits_k_when_its_row_blocks_are_few():
    """A prefill-sized shrink (130 rows: 3 row blocks of 64) over 2,100 columns has too few programs to fill a
    GPU, so it splits K in two (slices of >= 1,024 columns); the sums equal x A^T per row (rows of slot 0,
    slot 1 and no adapter interleaved), and the counters are left at zero."""
    assert lora_triton._split_k(130, 2100, 1) == 2 and lora_triton._split_k(130, 900, 1) == 1
    assert lora_triton._split_k(8192, 4096, 3) == 1  # enough row blocks: no split
    g = torch.Generator().manual_seed(5)
    x, a = torch.randn(130, 2100, generator=g), torch.randn(2, 16, 2100, generator=g)
    slots = [i % 3 - 1 for i in range(130)]
    meta = lora_reference.make_lora_meta(slots, 2, "cpu")
    meta.split_counters = lora_triton.split_counters(16, "cpu")
    t = lora_triton.lora_shrink(x, a, meta, torch.zeros(130, 16))
    rows = torch.tensor([i for i, s in enumerate(slots) if s >= 0])
    want = torch.stack([x[i].double() @ a[slots[i]].double().T for i in rows.tolist()])
    torch.testing.assert_close(t[rows].double(), want, rtol=1e-5, atol=1e-3)
    assert not meta.split_counters.any()


@pytest.mark.parametrize("k", [40, 1000])  # one program per row block; split-K (3 rows, 1,000 columns)
@pytest.mark.parametrize("ops", [pytest.param(lora_reference, id="torch"), TRITON_OPS])
def test_stacked_parts_match_per_row_reference(ops, k):
    """A merged projection's parts (q, k, v: 32, 16 and 16 columns) from stacked A and B: each part's delta
    lands in its own columns, from its own rank-R slice of the shrink, as three separate projections
    would give; the Triton version in one shrink (split-K at 1,000 columns) and one expand."""
    g = torch.Generator().manual_seed(k)
    num_slots, rank, outs = 3, 4, [32, 16, 16]
    starts = (0, 32, 48)
    x = torch.randn(3, k, generator=g)
    a_parts = [torch.randn(num_slots, rank, k, generator=g) for _ in outs]
    b_parts = [torch.randn(num_slots, n, rank, generator=g) for n in outs]
    slots = [2, -1, 0]
    y0 = torch.randn(3, sum(outs), generator=g)
    meta = lora_reference.make_lora_meta(slots, num_slots, "cpu")
    y = ops.add_lora_stacked(y0.clone(), x, torch.cat(a_parts, 1), torch.cat(b_parts, 1), starts, meta)
    want = y0.double()
    for a, b, off in zip(a_parts, b_parts, starts):
        want = _per_row(want, x, a, b, slots, off)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(y[1], y0[1])  # a row without adapter is untouched


@interpreted
@pytest.mark.parametrize("norm", [0, 1, 2], ids=["no-norm", "norm", "add-norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_shrink_and_epilogue_match_the_unfused_ops(norm, dtype):
    """Batch-1 decode's LoRA in two kernels, not four: ``lora_shrink_row`` (the norm before the projection and
    the shrink, a program per row of A) and the skinny GEMM summing the delta's terms with the product's
    before its one rounding, then the activation or the residual add. Against the unfused ops they replace: ``rms_norm`` (``x + residual``),
    the reference shrink, and the base product + ``add_lora_stacked`` (+ ``act_and_mul`` / + residual);
    float32 within 1e-4 relative, bfloat16 within a rounding or two (the unfused ops round twice). A row of
    slot 2 of 3, 1,000 columns; merged q/k/v of rank 4, gate/up with SiLU, o with its residual add, with the
    delta's 12 columns of ``t`` in one tile of the GEMM and in two slices (``BLOCK_K`` 8)."""
    from infer.kernels import fused_reference
    from infer.kernels import skinny_gemm as sk

    g = torch.Generator().manual_seed(norm)
    k, num_slots, rank, eps = 1000, 3, 4, 1e-6

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    x, res, nw = rnd(1, k), rnd(1, k), (1 + rnd(k, scale=0.1).float()).to(dtype)
    slot = torch.tensor([2], dtype=torch.int32)
    meta = lora_reference.make_lora_meta([2], num_slots, "cpu")

    def close(got, want):  # bfloat16: a rounding or two of the largest value (a gate's ulp times its up)
        atol = 1e-4 if dtype == torch.float32 else 2e-2 * want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-4 if dtype == torch.float32 else 2e-2, atol=atol)

    a = rnd(num_slots, 3 * rank, k, scale=0.05)
    t, h, s = lora_triton.lora_shrink_row(x, a, slot, res if norm == 2 else None, nw if norm else None, eps, False)
    s_want = x + res if norm == 2 else x
    h_want = fused_reference.rms_norm(s_want, nw, eps, False) if norm else x
    assert torch.equal(s, s_want)
    torch.testing.assert_close(h, h_want, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6 if dtype == torch.float32 else 0)
    assert t.shape == (1, 3 * rank)
    t_want = lora_reference.lora_shrink(h_want, a, meta, torch.zeros(1, 3 * rank))
    torch.testing.assert_close(t, t_want, rtol=1e-5, atol=1e-4)

    starts = (0, 32, 48)  # q, k, v
    w, b = rnd(64, k, scale=0.05), rnd(num_slots, 64, rank)
    y = sk.skinny_linear(h, w, lora=sk.LoRAEpilogue(t, b, slot, starts))
    want = lora_reference.add_lora_stacked(sk.skinny_linear_reference(h, w), h, a, b, starts, meta)
    close(y, want)
    for config in ((8, 8, 1, 0), (8, 8, 1, 0, 3)):  # t's 12 columns in two slices of 8; also a persistent grid
        close(sk.skinny_linear(h, w, config=config, lora=sk.LoRAEpilogue(t, b, slot, starts)), want)
    close(sk.skinny_linear_reference(h, w, lora=sk.LoRAEpilogue(t, b, slot, starts)), want)
    assert (want.float() - sk.skinny_linear_reference(h, w).float()).abs().max() > 0.1  # the delta counts

    gate_up_a, gate_up_b, w_gu = rnd(num_slots, 2 * rank, k, scale=0.05), rnd(num_slots, 64, rank), rnd(64, k, scale=0.05)
    t2 = lora_triton.lora_shrink_row(h, gate_up_a, slot)[0]
    y = sk.skinny_linear(h, w_gu, activation="silu", lora=sk.LoRAEpilogue(t2, gate_up_b, slot, (0, 32)))
    gu = lora_reference.add_lora_stacked(sk.skinny_linear_reference(h, w_gu), h, gate_up_a, gate_up_b, (0, 32), meta)
    close(y, fused_reference.act_and_mul(gu, "silu"))

    o_a, o_b, w_o, add = rnd(num_slots, rank, k, scale=0.05), rnd(num_slots, 48, rank), rnd(48, k, scale=0.05), rnd(1, 48)
    t3 = lora_triton.lora_shrink_row(h, o_a, slot)[0]
    o = lora_reference.add_lora(sk.skinny_linear_reference(h, w_o), h, o_a, o_b, meta)
    for config in (None, (8, 32, 1, 0, 3)):  # one program per row block; a persistent grid (3 programs, 6 blocks)
        close(sk.skinny_linear(h, w_o, config=config, residual=add, lora=sk.LoRAEpilogue(t3, o_b, slot)), o + add)
    # a row without adapter (slot -1): the epilogue adds nothing
    none = torch.tensor([-1], dtype=torch.int32)
    torch.testing.assert_close(sk.skinny_linear(h, w_o, lora=sk.LoRAEpilogue(t3, o_b, none)),
                               sk.skinny_linear(h, w_o), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one row"):
        sk.skinny_linear(torch.cat([h, h]), w_o, lora=sk.LoRAEpilogue(t3, o_b, slot))
    with pytest.raises(ValueError, match="residual goes with a norm"):
        lora_triton.lora_shrink_row(h, o_a, slot, residual=res)


@interpreted
@pytest.mark.parametrize("num_tokens", [5, 70])
def test_kernels_read_only_each_slots_own_rank(num_tokens):
    """Adapters of ranks 2, 8 and 4 in slots of R = 8 (``meta.active_ranks``, each step adapter's rank beside its
    slot: make_lora_meta's ``slot_ranks``): the Triton shrink and expand read
    only a slot's own rank of A's rows and B's columns. The padding here is garbage, not zeros, so a kernel
    that read it would be far off: the result is the per-row reference of the unpadded adapters, for one
    projection (split-K at 5 rows) and for merged q/k/v parts (each part's rows masked to the rank), and batch
    1's shrink and GEMM epilogue."""
    g = torch.Generator().manual_seed(num_tokens)
    num_slots, r, k = 3, 8, 300
    ranks = [2, 8, 4]
    slots = [i % 4 - 1 for i in range(num_tokens)]  # -1, 0, 1, 2, -1, ...
    meta = lora_reference.make_lora_meta(slots, num_slots, "cpu", ranks)
    assert meta.active_ranks.tolist() == ranks  # (every slot has rows here)

    def padded(shape, rank_dim, parts=1):
        """(the adapters as the reference sees them: zeros past each slot's rank, the same with garbage there)"""
        keep = torch.zeros(shape, dtype=torch.bool)
        for slot, rank in enumerate(ranks):
            for i in range(parts):
                index = [slot] + [slice(None)] * (len(shape) - 1)
                index[rank_dim] = slice(i * r, i * r + rank)
                keep[tuple(index)] = True
        values = torch.randn(*shape, generator=g)
        return values * keep, torch.where(keep, values, torch.randn(*shape, generator=g) * 100)

    x = torch.randn(num_tokens, k, generator=g)
    a_clean, a = padded((num_slots, r, k), 1)
    b_clean, b = padded((num_slots, 24, r), 2)
    y0 = torch.randn(num_tokens, 24, generator=g)
    y = lora_triton.add_lora(y0.clone(), x, a, b, meta)
    torch.testing.assert_close(y.double(), _per_row(y0, x, a_clean, b_clean, slots, 0), rtol=1e-5, atol=1e-4)
    # merged q / k / v: A stacks three parts of R rows, B three column ranges
    a3_clean, a3 = padded((num_slots, 3 * r, k), 1, parts=3)
    b3_clean, b3 = padded((num_slots, 48, r), 2)
    starts = (0, 16, 32)
    y = lora_triton.add_lora_stacked(y0.repeat(1, 2).clone(), x, a3, b3, starts, meta)
    want = y0.repeat(1, 2).double()
    for i, off in enumerate(starts):
        want = _per_row(want, x, a3_clean[:, i * r:(i + 1) * r], b3_clean[:, off:off + 16], slots, off)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-4)
    # batch 1's two kernels (one row of slot 2, rank 4): the shrink's rows and the GEMM's B columns masked too
    from infer.kernels import skinny_gemm as sk

    slot, rank = torch.tensor([2], dtype=torch.int32), torch.tensor([ranks[2]], dtype=torch.int32)
    t = lora_triton.lora_shrink_row(x[:1], a3, slot, rank=rank, part_rank=r)[0]
    t_clean = lora_triton.lora_shrink_row(x[:1], a3_clean, slot)[0]
    torch.testing.assert_close(t, t_clean, rtol=1e-5, atol=1e-4)
    w = torch.randn(48, k, generator=g)
    y1 = sk.skinny_linear(x[:1], w, lora=sk.LoRAEpilogue(t, b3, slot, starts, rank))
    torch.testing.assert_close(y1, sk.skinny_linear_reference(x[:1], w, lora=sk.LoRAEpilogue(t_clean, b3_clean, slot,
                                                                                              starts)),
                               rtol=1e-5, atol=1e-4)
    meta.active_ranks = None  # without ranks the kernels read the padding (what the test would catch)
    y = lora_triton.add_lora(y0.clone(), x, a, b, meta)
    assert (y.double() - _per_row(y0, x, a_clean, b_clean, slots, 0)).abs().max() > 1


def test_consecutive_segments_take_the_sliced_path_with_the_same_values():
    """A batch whose adapters' rows are consecutive (a prompt, one row per adapter) takes slices instead of
    gathered rows on the CPU: the same values as the per-row reference."""
    g = torch.Generator().manual_seed(7)
    x, a, b = torch.randn(6, 24, generator=g), torch.randn(3, 4, 24, generator=g), torch.randn(3, 20, 4, generator=g)
    y0 = torch.randn(6, 30, generator=g)
    for slots in ([-1, 2, 2, 2, 0, -1], [0, 1, 2, -1, -1, -1]):
        meta = lora_reference.make_lora_meta(slots, 3, "cpu")
        assert min(meta.first_rows) >= 0
        y = lora_reference.add_lora(y0.clone(), x, a, b, meta, y_offset=3)
        torch.testing.assert_close(y.double(), _per_row(y0, x, a, b, slots, 3), rtol=1e-5, atol=1e-4)
    assert lora_reference.make_lora_meta([0, 1, 0], 2, "cpu").first_rows == [-1, 1]


def test_lora_meta_rejects_slots_out_of_range():
    with pytest.raises(ValueError, match="token slots"):
        lora_reference.make_lora_meta([0, 3], 3, "cpu")
    assert lora_reference.make_lora_meta([-1, -1], 2, "cpu").segments == []


# ------------------------------------------------------------------------------------------ fixtures


def _checkpoint(preset, tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    return make_checkpoint(preset, tmp_path_factory.mktemp(preset), dtype="float32", device="cpu")


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _make_adapters(base, out_dir: Path, seed: int) -> list[Path]:
    """PEFT adapters of ``base`` with non-zero B (``init_lora_weights=False``) at the ADAPTERS settings."""
    from peft import LoraConfig, get_peft_model

    paths = []
    for i, (r, alpha, targets, rs) in enumerate(ADAPTERS):
        torch.manual_seed(seed + i)
        model = get_peft_model(_hf(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                     use_rslora=rs, init_lora_weights=False))
        path = out_dir / f"adapter{i}"
        model.save_pretrained(path)
        paths.append(path)
    return paths


def _merged(base, adapter):
    """PEFT's model with ``adapter`` merged into the weights (the reference)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(_hf(base), str(adapter)).merge_and_unload().eval()


@pytest.fixture(scope="session")
def lora_qwen3(tmp_path_factory):
    base = _checkpoint("tiny-qwen3", tmp_path_factory)
    return base, _make_adapters(base, tmp_path_factory.mktemp("qwen3-adapters"), seed=100)


# ------------------------------------------------------------------------------------------ against PEFT


@pytest.mark.parametrize("preset,fused", [("tiny-llama", False), ("tiny-qwen3", False), ("tiny-qwen3", True)],
                         ids=["llama", "qwen3", "qwen3-fused"])
def test_one_batch_mixing_base_and_three_adapters_matches_peft_merged(preset, fused, lora_qwen3, tmp_path_factory):
    """``fused``: the fused forward (phase 8, the plain-PyTorch ops): merged q/k/v and gate/up projections,
    each adapter's q, k, v (gate, up) delta added to its own slice of the merged output."""
    if preset == "tiny-qwen3":
        base, adapters = lora_qwen3
    else:
        base = _checkpoint(preset, tmp_path_factory)
        adapters = _make_adapters(base, tmp_path_factory.mktemp("llama-adapters"), seed=200)
    loaded = load_model(str(base), device="cpu", dtype=torch.float32, progress=False)
    if fused:
        from infer.kernels import fused_reference

        loaded.model.set_fused_ops(fused_reference, 64)
    manager = LoRAModelManager(loaded.model, loaded.config, max_loras=3, max_lora_rank=8, max_cpu_loras=3,
                               ops=lora_reference)
    reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    manager.activate(reqs, in_use=set())
    # rows: base, adapter 0, adapter 1, adapter 2, base (the slots are not in adapter order: mapping matters)
    which = [None, 0, 1, 2, None]
    seqs = [PROMPTS[i % len(PROMPTS)] for i in range(len(which))]
    manager.set_mapping([-1 if w is None else manager.slot_of(w + 1) for w, s in zip(which, seqs) for _ in s])
    ours = infer_logits(loaded.model, seqs)
    hf_base = _hf(base)
    refs = [hf_base] + [_merged(base, p) for p in adapters]
    with torch.no_grad():
        for w, seq, got in zip(which, seqs, ours):
            want = refs[0 if w is None else w + 1](torch.tensor([seq])).logits[0].float()
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
            if w is not None:  # the adapter really changes the output (the test could not pass by ignoring it)
                assert (hf_base(torch.tensor([seq])).logits[0] - want).abs().max() > 0.05


@pytest.fixture(scope="session")
def reference_tokens(lora_qwen3):
    """Greedy continuations of PROMPTS by Hugging Face: row i under adapter i - 1 (row 0: the base model)."""
    base, adapters = lora_qwen3
    out = []
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            model = _hf(base) if i == 0 else _merged(base, adapters[i - 1])
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                 pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def _llm(base, **kw):
    kw = dict(device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8, batching="continuous",
              kv_cache="paged", block_size=4, max_num_seqs=8, progress=False) | kw
    return LLM(str(base), **kw)


GREEDY = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)


@pytest.mark.parametrize("engine_kw", [
    dict(max_loras=2),  # three adapters over two slots: the third waits for a slot, then reuses one
    # one slot for three adapters; prompt chunks beside decodes; async steps; the fused forward
    dict(max_loras=1, chunked_prefill=True, max_num_batched_tokens=8, async_scheduling=True, fused_kernels=True),
], ids=["two-slots", "one-slot-chunked-async-fused"])
def test_engine_batch_of_base_and_adapters_matches_hf_greedy(lora_qwen3, reference_tokens, engine_kw):
    base, adapters = lora_qwen3
    llm = _llm(base, **engine_kw)
    loras = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens
    manager = llm.engine.lora_manager
    assert manager.num_slot_loads >= 3 and len(manager.slots) == engine_kw["max_loras"]
    assert llm.engine.scheduler.max_running <= 4
    for slot, rid in enumerate(manager.slots):  # each resident adapter's rank, for the kernels' rank masks
        assert rid is None or manager.mapping.slot_ranks[slot].item() == ADAPTERS[rid - 1][0]


def test_tensor_parallel_lora_equals_the_reference(lora_qwen3, reference_tokens):
    """Two gloo ranks: each holds its slice of every adapter (B's rows for q/k/v/gate/up, A's columns for
    o/down, whose shrink is all-reduced); slot loads and the rows' slots reach the worker as commands."""
    base, adapters = lora_qwen3
    llm = _llm(base, max_loras=2, tensor_parallel_size=2, max_model_len=64)
    try:
        loras = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
        outs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference_tokens
        assert llm.engine.remove_lora(3)  # mirrored on the worker: the next load reuses that slot there too
        outs = llm.generate(PROMPTS[3:], GREEDY, lora_request=loras[3:], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == reference_tokens[3]
    finally:
        llm.engine.shutdown()


def test_prefix_cache_never_shares_kv_between_adapters(lora_qwen3, reference_tokens):
    base, adapters = lora_qwen3
    llm = _llm(base, max_loras=2, prefix_caching=True)
    prompt = PROMPTS[2]  # 11 tokens: two full 4-token blocks can be cached
    a1, a2 = (LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters[:2]))
    first = llm.generate([prompt], GREEDY, lora_request=a2, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == reference_tokens[2]
    # the same prompt under another adapter, then the base model: no block of a2's may be hit
    other = llm.generate([prompt], GREEDY, lora_request=a1, use_tqdm=False)[0]
    plain = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    want_a1 = _merged(base, adapters[0]).generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                                  min_new_tokens=6, pad_token_id=0)[0, len(prompt):].tolist()
    assert other.outputs[0].token_ids == want_a1
    want_base = _hf(base).generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    assert plain.outputs[0].token_ids == want_base
    # ... while the same adapter again hits its own blocks
    again = llm.generate([prompt], GREEDY, lora_request=a2, use_tqdm=False)[0]
    assert again.num_cached_tokens == 8 and again.outputs[0].token_ids == reference_tokens[2]


# ------------------------------------------------------------------------------------------ rejections


def _edit_adapter(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_adapters_are_rejected_with_the_reason(lora_qwen3, tmp_path):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    base, adapters = lora_qwen3
    loaded_cfg = load_model(str(base), device="cpu", dtype=torch.float32, progress=False).config
    cases = {
        "DoRA": _edit_adapter(adapters[0], tmp_path / "dora", use_dora=True),
        "biases": _edit_adapter(adapters[0], tmp_path / "bias", bias="all"),
        "modules_to_save": _edit_adapter(adapters[0], tmp_path / "mts", modules_to_save=["lm_head"]),
        "embeddings or the LM head": _edit_adapter(adapters[0], tmp_path / "emb",
                                                   target_modules=["q_proj", "embed_tokens"]),
        "exceeds max_lora_rank=4": adapters[1],  # rank 8
        "no adapter_config.json": tmp_path,
    }
    # an adapter of another base model: a wider hidden size
    other = _hf(base).config
    other.hidden_size, other.head_dim = 128, 32
    from transformers import AutoModelForCausalLM

    peft_other = get_peft_model(AutoModelForCausalLM.from_config(other), LoraConfig(r=2, target_modules=["q_proj"]))
    peft_other.save_pretrained(tmp_path / "other")
    cases["another base model"] = tmp_path / "other"
    # an LM-head adapter's weights (PEFT names them lm_head.lora_A / lora_B)
    lm = _edit_adapter(adapters[0], tmp_path / "lmhead")
    w = load_file(lm / "adapter_model.safetensors")
    w["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, loaded_cfg.hidden_size)
    save_file(w, lm / "adapter_model.safetensors")
    cases["lm_head.lora_A.weight: adapters of the embeddings"] = lm
    for why, path in cases.items():
        with pytest.raises(ValueError, match=why.replace("(", r"\(")):
            load_adapter(path, loaded_cfg, max_lora_rank=4)


def test_engine_rejects_bad_lora_requests_and_flags(lora_qwen3, tmp_path):
    base, adapters = lora_qwen3
    llm = _llm(base, max_loras=2, max_lora_rank=4)
    with pytest.raises(InvalidRequestError, match="exceeds max_lora_rank") as e:
        llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("big", 7, str(adapters[1])), use_tqdm=False)
    assert e.value.param == "lora_request" and not llm.engine.has_unfinished_requests()
    llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("a", 1, str(adapters[0])), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="needs an id of its own"):
        llm.engine.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("b", 1, str(adapters[2])))
    plain = LLM(str(base), device="cpu", dtype="float32", progress=False)
    with pytest.raises(InvalidRequestError, match="enable_lora=True"):
        plain.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("a", 1, str(adapters[0])), use_tqdm=False)
    for kw, why in [(dict(enable_lora=True, max_loras=0), "max_loras must be >= 1"),
                    (dict(enable_lora=True, max_lora_rank=0), "max_lora_rank must be >= 1"),
                    (dict(enable_lora=True, max_loras=4, max_cpu_loras=2), "max_cpu_loras=2 < max_loras=4"),
                    (dict(max_loras=4), "need enable_lora"),
                    (dict(enable_lora=True, expert_parallel_size=2), "expert parallelism is not supported"),
                    (dict(enable_lora=True, quantization="int8"), "quantization='int8' is not supported yet")]:
        with pytest.raises(ValueError, match=why):
            EngineConfig(device="cpu", **kw).validate()
    cfg = EngineConfig(device="cpu", enable_lora=True, optimize=True).validate()
    # LoRA no longer keeps CUDA graphs off: on the CPU only the device does
    assert cfg.fused_kernels and cfg.optimization_notes["cuda_graphs"] == "needs a CUDA device"
    for bad in [dict(lora_name="", lora_int_id=1, lora_path="x"), dict(lora_name="a", lora_int_id=0, lora_path="x"),
                dict(lora_name="a", lora_int_id=1)]:
        with pytest.raises(ValueError, match="LoRARequest"):
            LoRARequest(**bad)


def test_a_slot_in_use_is_never_reused(lora_qwen3):
    base, adapters = lora_qwen3
    loaded = load_model(str(base), device="cpu", dtype=torch.float32, progress=False)
    m = LoRAModelManager(loaded.model, loaded.config, max_loras=2, max_lora_rank=8, max_cpu_loras=2,
                         ops=lora_reference)
    a, b, c = (LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters))
    addresses = [(x.lora_a.data_ptr(), x.lora_b.data_ptr()) for x in m.layers.values()]
    m.activate([a], in_use=set())
    m.activate([b], in_use={1})
    with pytest.raises(RuntimeError, match="max_loras"):
        m.activate([c], in_use={1, 2})
    m.activate([a], in_use={1, 2})  # a used again: b is now the least recently used ...
    m.activate([c], in_use={2})  # ... but b is in use, so a's slot is taken
    assert sorted(x for x in m.slots if x is not None) == [2, 3] and m.slot_of(2) == 1
    # the slot holds exactly c's weights (q_proj untouched by c: zeros), padded past c's rank
    q, o = m.layers[(0, "q_proj")], m.layers[(0, "o_proj")]
    a_c, b_c = m.get_adapter(c).weights[(0, "o_proj")]
    assert not q.lora_a[0].any() and not q.lora_b[0].any()
    assert torch.equal(o.lora_a[0, :2], a_c) and torch.equal(o.lora_b[0, :, :2], b_c) and not o.lora_a[0, 2:].any()
    assert not m.is_cached(1)  # the host cache holds max_cpu_loras = 2 adapters: a, the oldest, went
    # slots are filled in place: every buffer keeps the address it had at start-up (what a CUDA graph captured)
    assert [(x.lora_a.data_ptr(), x.lora_b.data_ptr()) for x in m.layers.values()] == addresses


def test_an_adapter_in_use_is_not_unloaded(lora_qwen3):
    base, adapters = lora_qwen3
    llm = _llm(base, max_loras=1)
    a = LoRARequest("a", 1, str(adapters[0]))
    req = llm.engine.add_request(PROMPTS[0], GREEDY, lora_request=a)
    with pytest.raises(InvalidRequestError, match="used by requests in flight"):
        llm.engine.remove_lora(1)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert req.is_finished and llm.engine.remove_lora(1) and not llm.engine.remove_lora(1)


# ------------------------------------------------------------------------------------------ CUDA graphs

#: the two tests below run where the Triton kernels can: on the GPU if there is one, else the interpreter
_DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_graph_inputs_are_the_eager_groups_at_fixed_addresses():
    """The LoRA variant of a CUDA graph reads the step's row groups from one fixed buffer
    (:class:`~infer.lora.graphs.LoRAGraphInputs`). Kernels launched once with its static meta (as a graph
    captures them, for a bucket of 16 rows) give, for each newly staged step, the per-row reference's
    values: the meta's tensors never move, only their contents change. Padding rows get nothing. (On a
    GPU machine it runs there: the staging copy from pinned memory, the kernels on the device.)"""
    import numpy as np

    from infer.lora.graphs import LoRAGraphInputs
    from infer.lora.layers import LoRAMapping

    g = torch.Generator().manual_seed(3)
    num_slots, rank, k, n, bucket = 3, 8, 40, 24, 16
    mapping = LoRAMapping(lora_triton, num_slots, _DEV)
    mapping.slot_ranks[:] = rank  # (as the manager writes them): staged beside the slots
    inputs = LoRAGraphInputs(mapping, max_rows=bucket, device=torch.device(_DEV))
    static = inputs.meta(bucket)  # what the graph captures: views of the buffer
    address = inputs.buffer.data_ptr()
    a, b = torch.randn(num_slots, rank, k, generator=g).to(_DEV), torch.randn(num_slots, n, rank, generator=g).to(_DEV)
    x = torch.randn(bucket, k, generator=g).to(_DEV)
    for slots in ([2, -1, 0, 2, 0, 1, -1, 2, 1, 0, 2, -1], [1, 1, -1, 1, 2, 0, 0], [-1, 2, -1, 2]):
        mapping.set(slots, _DEV)
        assert inputs.stage() == 2 * num_slots + 2 * min(num_slots, bucket) + len(slots)
        rows, starts, counts = lora_reference.group_rows_by_slot(np.array(slots), num_slots)
        assert torch.equal(static.slot_starts.cpu(), torch.from_numpy(starts))
        assert torch.equal(static.slot_counts.cpu(), torch.from_numpy(counts))
        used = int(counts.sum())
        assert torch.equal(static.sorted_rows[:used].cpu(), torch.from_numpy(rows[:used]))
        active = sorted(set(slots) - {-1})  # the slots with rows, then -1s up to min(L, rows) entries
        assert static.active_slots.tolist() == active + [-1] * (num_slots - len(active))
        y0 = torch.randn(bucket, n, generator=g).to(_DEV)
        y = lora_triton.add_lora(y0.clone(), x, a, b, static)
        padded = slots + [-1] * (bucket - len(slots))  # the graph's padding rows: no adapter
        torch.testing.assert_close(y.double(), _per_row(y0, x, a, b, padded, 0), rtol=1e-5, atol=1e-4)
        assert torch.equal(y[len(slots):], y0[len(slots):])
        assert static.active_ranks.tolist() == [rank] * len(active) + [0] * (num_slots - len(active))
        assert inputs.buffer.data_ptr() == address and static.sorted_rows.data_ptr() == address + 4 * 4 * num_slots
    mapping.set([-1, -1, -1], _DEV)
    assert inputs.stage() == 0 and mapping.meta is None  # no adapter: the base variant replays, nothing staged
    with pytest.raises(ValueError, match="does not fit"):
        inputs.stage([0] * (bucket + 1))
    for bad in ([0, 3], [-2, 1]):
        with pytest.raises(ValueError, match="token slots must be in"):
            inputs.stage(bad)
    with pytest.raises(ValueError, match="on the device only"):  # the host-grouped ops cannot take a graph's meta
        lora_reference.add_lora(y0.clone(), x, a, b, static)


@interpreted
def test_captured_forward_reads_adapters_loaded_after_capture(lora_qwen3):
    """The whole model as its LoRA graph variant runs it (the Triton kernels under the interpreter): the
    layers read the row groups of a static meta built once, as at capture, while the host's own mapping
    says "no adapter", so nothing but the staged buffer tells the forward which row uses which slot. It
    gives the eager forward's logits (the plain-PyTorch ops, itself equal to PEFT's merged models above);
    then an adapter is unloaded and another loaded into the same slot, a new mix staged, and the same
    static meta gives the new adapter's logits. (On a GPU machine: the kernels on the device.)"""
    from infer.lora.graphs import LoRAGraphInputs

    base, adapters = lora_qwen3
    from infer.kernels import fused_reference

    loaded = load_model(str(base), device=_DEV, dtype=torch.float32, progress=False)
    # the fused forward: q/k/v and gate/up merged, their parts' A stacked (one shrink each), o and down alone
    loaded.model.set_fused_ops(fused_reference, 64)
    manager = LoRAModelManager(loaded.model, loaded.config, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
                               ops=lora_reference)
    assert all(getattr(layer.self_attn.qkv_proj, "lora_a_stacked", None) is not None
               for layer in loaded.model.model.layers)
    reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    seqs = [p[:4] for p in PROMPTS]  # 15 rows: one 16-row tile per slot (the interpreter is slow)
    rows = sum(map(len, seqs))
    inputs = LoRAGraphInputs(manager.mapping, max_rows=rows, device=torch.device(_DEV))
    static = inputs.meta(rows)
    addresses = [(m.lora_a.data_ptr(), m.lora_b.data_ptr()) for m in manager.layers.values()]
    results = []
    for which in ([None, 0, 1, 1], [2, None, 1, 2]):  # the second mix: adapter 2 where adapter 0 was
        manager.activate([reqs[w] for w in which if w is not None], in_use={w + 1 for w in which if w is not None})
        slots = [-1 if w is None else manager.slot_of(w + 1) for w, s in zip(which, seqs) for _ in s]
        manager.mapping.ops = lora_reference
        manager.set_mapping(slots)
        want = infer_logits(loaded.model, seqs)  # eager: the groups built on the host
        manager.mapping.ops = lora_triton
        manager.set_mapping([-1] * rows)  # the host knows of no adapter: only the buffer does
        inputs.stage(slots)
        with manager.mapping.capturing(static):
            got = infer_logits(loaded.model, seqs)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, atol=2e-4, rtol=1e-4)
        results.append(got)
        if which[1] == 0:
            manager.remove(1)  # unloaded: its slot is free for adapter 2
    assert manager.slot_of(3) == 0 and manager.num_slot_loads == 3
    assert (results[1][0] - results[0][0]).abs().max() > 0.05  # row 0: base, then adapter 2 (slot 0 reloaded)
    assert [(m.lora_a.data_ptr(), m.lora_b.data_ptr()) for m in manager.layers.values()] == addresses


@interpreted
def test_one_row_step_launches_two_lora_kernels_a_projection_and_matches_peft(lora_qwen3, monkeypatch):
    """A one-row step of the fused forward with the Triton kernels (batch-1 decode) takes the one-row path
    (:meth:`~infer.lora.layers.LoRAOps._row_lora`): per layer four ``lora_shrink_row`` launches (two with the
    norm in them) and no expand, activation or norm kernel of its own (only the model's final norm); its logits are PEFT's merged model's
    for the adapter on all seven projections, and the base model's for a row without adapter."""
    from infer.kernels import fused_triton

    base, adapters = lora_qwen3
    loaded = load_model(str(base), device="cpu", dtype=torch.float32, progress=False)
    loaded.model.set_fused_ops(fused_triton, 64)
    loaded.model._set_cpu_weight_layout(False)  # row-major, as on a GPU (the skinny GEMM's layout)
    manager = LoRAModelManager(loaded.model, loaded.config, max_loras=2, max_lora_rank=8, max_cpu_loras=2,
                               ops=lora_triton)
    manager.activate([LoRARequest("a1", 2, str(adapters[1]))], in_use=set())  # rank 8, every projection
    calls = {"shrink_row": 0, "expand": 0, "act_and_mul": 0, "norm": 0}

    def spy(module, name, key):
        real = getattr(module, name)

        def wrapped(*args, **kw):
            calls[key] += 1
            return real(*args, **kw)
        monkeypatch.setattr(module, name, wrapped)
    spy(lora_triton, "lora_shrink_row", "shrink_row")
    spy(lora_triton, "_expand", "expand")
    spy(fused_triton, "act_and_mul", "act_and_mul")
    spy(fused_triton, "add_rms_norm", "norm")
    token = PROMPTS[0][:1]
    manager.set_mapping([manager.slot_of(2)])
    got = infer_logits(loaded.model, [token])[0]
    layers = loaded.config.num_layers
    assert calls == {"shrink_row": 4 * layers, "expand": 0, "act_and_mul": 0, "norm": 1}  # the final norm
    with torch.no_grad():
        want = _merged(base, adapters[1])(torch.tensor([token])).logits[0].float()
        hf_base = _hf(base)(torch.tensor([token])).logits[0].float()
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    assert (want - hf_base).abs().max() > 0.05
    manager.set_mapping([-1])
    torch.testing.assert_close(infer_logits(loaded.model, [token])[0], hf_base, atol=1e-3, rtol=1e-3)


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """float32 logprobs of ``tokens`` after ``prompt``, teacher-forced (Hugging Face on the CPU)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = logits[len(prompt) - 1:-1].log_softmax(-1)
    return lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def _gpu_llm(base, **kw):
    """A float32 CUDA engine (small KV budget: several engines live in one test)."""
    return _llm(base, device="cuda", max_model_len=128, kv_cache_memory_bytes=32 << 20, **kw)


def _watch_lora_replays(llm) -> list[bool]:
    """Record, for each graph replay of ``llm``, whether it ran the LoRA variant."""
    graphs = llm.engine.runner.graphs
    seen: list[bool] = []
    real = graphs._stage_lora

    def stage() -> bool:
        seen.append(real())
        return seen[-1]

    graphs._stage_lora = stage
    return seen


GPU_LOGPROBS = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0, logprobs=0)


@pytest.mark.gpu
@pytest.mark.parametrize("engine_kw", [
    dict(),
    dict(fused_kernels=True, async_scheduling=True),
    # decodes beside one prompt chunk: the whole mixed-step graphs' LoRA variants
    dict(fused_kernels=True, chunked_prefill=True, max_num_batched_tokens=16),
    # the shrink and expand launched early (PDL, Hopper): each waits for the kernel before it
    dict(fused_kernels=True, async_scheduling=True, pdl=True),
], ids=["graphs", "graphs-fused-async", "graphs-fused-chunked", "graphs-fused-async-pdl"])
def test_cuda_graphs_with_lora_give_the_eager_tokens_and_peft(lora_qwen3, engine_kw):
    """A batch of base rows and three adapters (float32, CUDA): with cuda_graphs the same tokens as the eager
    engine, its steps replaying the LoRA variants (the six prompts at once: a mixed bucket's pieces; with
    chunked prefill, decodes beside a chunk: the whole mixed-step graph; then the decodes) and base-only
    steps the base ones, and every chosen token's logprob that of PEFT's merged model for the row's
    adapter (teacher-forced, within 2e-3)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    base, adapters = lora_qwen3
    loras = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    prompts, row_loras = PROMPTS + PROMPTS[1:3], loras + [None, loras[1]]  # rows: base, a0, a1, a2, base, a0
    outs, base_only = {}, None
    for graphs in (False, True):
        llm = _gpu_llm(base, max_loras=3, cuda_graphs=graphs, cuda_graph_max_batch_size=8, **engine_kw)
        try:
            seen = _watch_lora_replays(llm) if graphs else None
            got = llm.generate(prompts, GPU_LOGPROBS, lora_request=row_loras, use_tqdm=False)
            outs[graphs] = [(o.outputs[0].token_ids, [lp.token.logprob for lp in o.outputs[0].logprobs]) for o in got]
            if graphs:
                assert sum(seen) >= 4, f"too few LoRA graph replays: {seen}"
                n = len(seen)
                base_only = llm.generate(PROMPTS[:2], GPU_LOGPROBS, use_tqdm=False)  # no adapter: base variants
                assert len(seen) > n and not any(seen[n:]), seen[n:]
        finally:
            llm.engine.shutdown()
    assert [t for t, _ in outs[True]] == [t for t, _ in outs[False]]
    refs = {None: _hf(base)} | {lora.lora_int_id: _merged(base, adapters[lora.lora_int_id - 1]) for lora in loras[1:]}
    base_rows = [(o.outputs[0].token_ids, [lp.token.logprob for lp in o.outputs[0].logprobs]) for o in base_only]
    for prompt, lora, (tokens, logprobs) in zip(prompts + PROMPTS[:2], row_loras + [None, None],
                                                outs[True] + base_rows):
        want = _hf_logprobs(refs[None if lora is None else lora.lora_int_id], prompt, tokens)
        torch.testing.assert_close(torch.tensor(logprobs), want, atol=2e-3, rtol=0)


@pytest.mark.gpu
def test_an_adapter_loaded_after_capture_is_seen_by_the_graphs(lora_qwen3):
    """One slot, the graphs captured before any adapter exists: a request of adapter 0 replays the LoRA
    variants with adapter 0's logprobs (PEFT's merged model); adapter 0 unloaded, adapter 2 goes into the
    same slot, in place (every slot buffer keeps its address), and the same graphs give adapter 2's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    base, adapters = lora_qwen3
    llm = _gpu_llm(base, max_loras=1, cuda_graphs=True, cuda_graph_max_batch_size=4)
    try:
        manager = llm.engine.lora_manager
        addresses = [(m.lora_a.data_ptr(), m.lora_b.data_ptr()) for m in manager.layers.values()]
        seen = _watch_lora_replays(llm)
        for i in (0, 2):
            lora = LoRARequest(f"a{i}", i + 1, str(adapters[i]))
            n = len(seen)
            out = llm.generate([PROMPTS[i]], GPU_LOGPROBS, lora_request=lora, use_tqdm=False)[0].outputs[0]
            assert manager.slot_of(i + 1) == 0 and len(seen) > n and all(seen[n:]), seen[n:]
            want = _hf_logprobs(_merged(base, adapters[i]), PROMPTS[i], out.token_ids)
            torch.testing.assert_close(torch.tensor([lp.token.logprob for lp in out.logprobs]), want, atol=2e-3, rtol=0)
            base_lp = _hf_logprobs(_hf(base), PROMPTS[i], out.token_ids)
            assert (want - base_lp).abs().max() > 0.01  # the adapter shows in the logprobs
            if i == 0:
                assert llm.engine.remove_lora(1)
        assert [(m.lora_a.data_ptr(), m.lora_b.data_ptr()) for m in manager.layers.values()] == addresses
    finally:
        llm.engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_replay_the_lora_graphs_with_rank_0s_row_groups(lora_qwen3):
    """Tensor parallelism over NCCL with CUDA graphs: rank 0 stages the row groups and sends them with the
    packed decode inputs; both ranks replay the LoRA variants (their slices of every adapter). Greedy tokens
    equal one GPU's eager run, also after an adapter is unloaded and another loaded into its slot."""
    base, adapters = lora_qwen3
    loras = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    runs = {}
    for name, kw in (("one", dict()), ("two", dict(tensor_parallel_size=2, cuda_graphs=True, fused_kernels=True,
                                                     cuda_graph_max_batch_size=4))):
        llm = _gpu_llm(base, max_loras=2, **kw)
        try:
            seen = _watch_lora_replays(llm) if name == "two" else [True]
            outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)]
            assert llm.engine.remove_lora(2)
            outs += [o.outputs[0].token_ids for o in llm.generate(PROMPTS[3:], GREEDY, lora_request=loras[3:],
                                                                  use_tqdm=False)]
            assert any(seen), "no LoRA graph replay"
            runs[name] = outs
        finally:
            llm.engine.shutdown()
    assert runs["two"] == runs["one"]


# ------------------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def lora_server(lora_qwen3, tmp_path_factory):
    from tests.server_fixture import ServerProcess

    base, adapters = lora_qwen3
    server = ServerProcess(tmp_path_factory.mktemp("lora-server"), [
        "--model", str(base), "--served-model-name", "base", "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "128", "--batching", "continuous", "--kv-cache", "paged", "--enable-lora",
        "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a0={adapters[0]}", f"a1={adapters[1]}"])
    yield server.wait_ready()
    server.stop()


def test_server_selects_adapters_by_model_and_loads_them_at_runtime(lora_server, lora_qwen3):
    import httpx
    import openai

    base, adapters = lora_qwen3
    # what the offline engine generates for each adapter (itself checked against PEFT above)
    offline = _llm(base, max_loras=3).generate(
        [PROMPTS[0]] * 4, GREEDY, use_tqdm=False,
        lora_request=[None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)])
    want = [o.outputs[0].text for o in offline]
    assert len(set(want)) == 4  # four different continuations: the adapter chosen shows in the text
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="none")

    def complete(model: str) -> str:
        r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                      extra_body={"min_tokens": 6})
        assert r.model == model
        return r.choices[0].text

    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "a0", "a1"}
    assert cards["a0"].parent == "base" and cards["a0"].root == str(adapters[0])
    assert [complete(m) for m in ("base", "a0", "a1")] == want[:3]
    post = lambda path, **body: httpx.post(f"{lora_server.url}/v1/{path}", json=body, timeout=60)  # noqa: E731
    r = post("load_lora_adapter", lora_name="a2", lora_path=str(adapters[2]))
    assert r.status_code == 200, r.text
    assert complete("a2") == want[3] and "a2" in {m.id for m in client.models.list().data}
    for body, status, why in [(dict(lora_name="a2", lora_path=str(adapters[2])), 400, "already been loaded"),
                              (dict(lora_name="bad", lora_path=str(base)), 400, "no adapter_config.json"),
                              (dict(lora_name="x"), 400, "lora_path")]:
        r = post("load_lora_adapter", **body)
        assert r.status_code == status and why in r.text, r.text
    assert post("unload_lora_adapter", lora_name="a2").status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete("a2")
    assert post("unload_lora_adapter", lora_name="a2").status_code == 404
    chat = client.chat.completions.create(model="a1", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "a1" and chat.choices[0].message.content is not None


# ------------------------------------------------------------------------------------------ exercises


def test_lora_scaling():
    from infer.lora.adapter import lora_scaling

    assert lora_scaling(16, 8) == 2.0 and lora_scaling(8, 32) == 0.25
    assert lora_scaling(16, 4, use_rslora=True) == 8.0  # 16 / sqrt(4)
    assert lora_scaling(8, 8, use_rslora=False) == 1.0 and lora_scaling(6, 9, use_rslora=True) == 2.0


def test_rows_are_grouped_by_slot():
    import numpy as np

    from infer.kernels.lora_reference import group_rows_by_slot

    slots = np.array([2, -1, 0, 2, 0, -1, 1, 2], dtype=np.int64)
    rows, starts, counts = group_rows_by_slot(slots, 5)  # slots 3 and 4 hold no row
    assert rows.tolist() == [2, 4, 6, 0, 3, 7, 0, 0]
    assert counts.tolist() == [2, 1, 3, 0, 0] and starts.tolist() == [0, 2, 3, 6, 6]
    assert rows.dtype == starts.dtype == counts.dtype == np.int32
    rows, starts, counts = group_rows_by_slot(np.array([-1, -1], dtype=np.int64), 2)
    assert rows.tolist() == [0, 0] and starts.tolist() == [0, 0] and counts.tolist() == [0, 0]
