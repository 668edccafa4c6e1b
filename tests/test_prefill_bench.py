"""benchmarks/prefill.py: its FLOP count (by hand and against a loaded model's weights), its kernel
categories, and one tiny run of the whole program on the CPU.

These check what the program counts and writes, never how fast anything is.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

import prefill  # noqa: E402

from infer.model_config import ModelConfig, RopeConfig  # noqa: E402


def _tiny_config(**kw) -> ModelConfig:
    """hidden 8, MLP 16, 2 layers (the second a 3-token sliding window), 2 query heads, 1 KV head of
    dim 4, vocabulary 10."""
    base = {"architecture": "gemma3", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_layers": 2,
            "num_heads": 2, "num_kv_heads": 1, "head_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
            "rope": RopeConfig(10000.0), "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 3}
    return ModelConfig(**{**base, **kw})


def test_visible_pairs_match_an_enumeration_of_the_causal_mask():
    for n, prefix, window in [(1, 0, None), (7, 0, None), (5, 4, None), (9, 0, 3), (4, 6, 3), (3, 1, 8), (0, 5, 2)]:
        brute = sum(1 for q in range(prefix, prefix + n) for k in range(q + 1)
                    if window is None or q - k < window)
        assert prefill.visible_pairs(n, prefix, window) == brute, (n, prefix, window)
    with pytest.raises(ValueError):
        prefill.visible_pairs(4, window=0)


def test_prefill_flops_by_hand_on_a_tiny_config():
    cfg = _tiny_config()
    # per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 + gate, up 8x16 + down 16x8 = 64+32+32+64+3*128 = 576
    # weights; 2 layers, 5 tokens, 2 FLOPs per multiply-add: 2 * 5 * 2 * 576 = 11520
    # attention, 5 tokens: full layer 1+2+3+4+5 = 15 pairs; window 3: 1+2+3+3+3 = 12 pairs;
    # QK^T and PV, 2 FLOPs per multiply-add, 2 heads of dim 4: 2 * 2 * 2 * 4 = 32 FLOPs per pair -> 32 * 27 = 864
    # LM head on one row: 2 * 8 * 10 = 160
    f = prefill.prefill_flops(cfg, 5)
    assert f == {"linear": 11520, "attention": 864, "lm_head": 160, "total": 11520 + 864 + 160}
    # 2 new tokens after 3 cached: full layer sees 4 + 5 keys, the window 3 + 3: 32 * 15 = 480
    f = prefill.prefill_flops(cfg, 2, prefix=3)
    assert f["attention"] == 480 and f["linear"] == 2 * 2 * 2 * 576
    # a gated attention output doubles q's width: 64 more weights per layer
    assert prefill.prefill_flops(_tiny_config(attn_output_gate=True), 5)["linear"] == 2 * 5 * 2 * (576 + 64)
    with pytest.raises(ValueError, match="MoE"):
        prefill.prefill_flops(_tiny_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8), 5)


def test_prefill_flops_count_the_loaded_models_linear_weights(tiny_gemma3):
    """The projections the FLOP count assumes are the nn.Linear weights the model holds (Gemma 3: its
    sliding layers included), and the LM head is one hidden x vocab product."""
    model, cfg = tiny_gemma3.model, tiny_gemma3.config
    linears = prefill.model_linears(model)
    names = {name.split(".")[-1] for name, _ in linears}
    # the session's model may have had its projections merged by a fused-kernels test (set_fused_ops)
    if "qkv_proj" in names:
        assert names == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
        assert len(linears) == 4 * cfg.num_layers
    else:
        assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        assert len(linears) == 7 * cfg.num_layers
    weights = sum(m.weight.numel() for _, m in linears)
    f = prefill.prefill_flops(cfg, 37)
    assert f["linear"] == 2 * 37 * weights
    assert f["lm_head"] == 2 * model.lm_head.weight.numel()
    assert any(cfg.window_of(i) for i in range(cfg.num_layers))  # the windows are exercised
    full = 4 * cfg.num_heads * cfg.head_dim * 37 * 38 // 2 * cfg.num_layers
    assert f["attention"] < full  # some layers see fewer keys than a full causal mask


def test_kernel_categories_of_real_kernel_names():
    from infer.kernels import decode_attention, fused_triton, kv_cache_write, prefill_attention

    def name(kernel):  # the name the profiler shows for a Triton kernel: its Python function's
        return kernel.fn.__name__

    assert prefill.kernel_category(name(prefill_attention._paged_prefill_kernel)) == "attention"
    assert prefill.kernel_category(name(prefill_attention._prefill_combine_kernel)) == "attention"
    assert prefill.kernel_category(name(decode_attention._paged_decode_kernel)) == "attention"
    for k in (fused_triton._rms_norm_kernel, fused_triton._add_rms_norm_kernel, fused_triton._qk_norm_rope_kernel,
              fused_triton._act_and_mul_kernel):
        assert prefill.kernel_category(name(k)) == "norm/rope/act", name(k)
    assert prefill.kernel_category(name(kv_cache_write._reshape_and_cache_kernel)) == "other triton"
    # cuBLAS / cuBLASLt (Hopper), FlashAttention-2 (its template names CUTLASS types), PyTorch elementwise
    assert prefill.kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_"
                                   "execute_segment_k_off_kernel__5x_cublas") == "gemm"
    assert prefill.kernel_category("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN") == "gemm"
    assert prefill.kernel_category("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, "
                                   "false, false, cutlass::bfloat16_t>>(pytorch_flash::Flash_fwd_params)") == "attention"
    assert prefill.kernel_category("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
                                   "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, "
                                   "std::array<char*, 1ul>)") == "other"
    # the CPU ops a CPU prefill runs
    assert prefill.kernel_category("aten::mm") == "gemm"
    assert prefill.kernel_category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert prefill.kernel_category("aten::index_copy_") == "other"


@pytest.mark.slow
def test_prefill_benchmark_end_to_end_on_cpu(tmp_path):
    """The whole program on a tiny random Llama: two lengths, one prefill step each, every table."""
    from make_synthetic_checkpoint import make_checkpoint

    model = make_checkpoint("tiny-llama", tmp_path / "tiny", dtype="float32", device="cpu")
    out, png = tmp_path / "prefill.json", tmp_path / "prefill.png"
    assert prefill.main(["--model", str(model), "--device", "cpu", "--prompt-lens", "24", "40", "--repeats", "1",
                         "--extend-tokens", "16", "--out", str(out), "--plot", str(png)]) == 0
    rep = json.loads(out.read_text())
    assert rep["prompt_lens"] == [24, 40] and rep["engine_config"]["optimize"] is True
    # the engine fused q/k/v and gate/up: the GEMM ceiling times the merged products, the same weights
    assert rep["linear_params"]["model"] == rep["linear_params"]["config"]
    names = {s["name"] for s in rep["gemm_shapes"]}
    assert {"qkv_proj", "gate_up_proj"} <= names and not names & {"q_proj", "gate_proj"}
    assert sum(s["count"] for s in rep["gemm_shapes"] if s["prompt_tokens"] == 24) == 4 * 3  # 3 layers
    for row, parts in zip(rep["rows"], rep["breakdown"]):
        assert row["prefill_steps"] == 1 and row["host_ms"] > 0 and row["launch_ms"] > 0
        assert 0 < row["ttft_minus_device_ms"] < row["ttft_ms"]  # on a CPU the device span is the forward
        flops = rep["flops"][str(row["prompt_tokens"])]
        assert row["model_tflop"] == pytest.approx(flops["total"] / 1e12)
        assert row["ttft_tflops"] == pytest.approx(flops["total"] / row["ttft_ms"] / 1e9)
        for key in ("ttft_mfu", "device_mfu", "gemm_ceiling_frac_peak"):
            assert math.isfinite(row[key]) and 0 < row[key] <= 5, (key, row[key])
        assert sum(parts[f"{c}_share"] for c in prefill.CATEGORIES) == pytest.approx(1.0)
        assert parts["gemm_ms"] > 0 and parts["attention_ms"] > 0
        for key in ("gemm_frac_peak", "attention_frac_peak"):
            assert math.isfinite(parts[key]) and 0 < parts[key] <= 5, (key, parts[key])
    # the real CPU ops were classified: the projections are aten::mm/addmm, among the top kernels (which one
    # ranks first at 40 tokens of a tiny model depends on the machine's load: a norm has been seen first)
    top = rep["top_kernels"]["40"]
    gemms = [k["name"] for k in top if k["category"] == "gemm"]
    assert "aten::mm" in gemms or "aten::addmm" in gemms, top
    cases = [(a["prompt_tokens"], a["case"], a["prefix"]) for a in rep["attention"]]
    assert cases == [(24, "prefill", 0), (24, "extend", 8), (40, "prefill", 0), (40, "extend", 24)]
    for a in rep["attention"]:
        assert a["triton_ms"] > 0 and a["sdpa_ms"] > 0 and a["triton_over_sdpa"] == pytest.approx(
            a["triton_ms"] / a["sdpa_ms"])
        if a["case"] == "prefill":
            assert a["max_abs_diff_vs_sdpa"] < 1e-4  # the kernel attends as SDPA does
    md = out.with_suffix(".md").read_text()
    for heading in ("Prefill, one prompt alone", "Kernels of one prefill step", "GEMM ceiling", "Attention alone"):
        assert heading in md
    assert png.stat().st_size > 0
