"""Phases 11, 12, 16, 17 and the step trace on a CUDA GPU (every test here is marked ``gpu``: skipped elsewhere).

On the CPU these phases' Triton kernels run under the interpreter at tiny shapes (tests/test_quantization.py,
test_lora.py, test_hybrid.py). Here they run compiled, at the real models' shapes, against their plain-PyTorch
references in float64; and each flag runs end to end on the GPU with the phase 5-9 flags on, against a
reference that is independent of what it checks: the same run without CUDA graphs (a replayed graph must
compute what the eager step computes, bit for bit), without speculation (verification is lossless), or HF
transformers (the hybrid model).

    python -m pytest -q -m gpu tests/test_gpu_phases.py      # on a machine with a CUDA GPU
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from infer.sampling import SamplingParams

try:  # PEFT's adapters and their reference tokens (session fixtures), where peft is installed
    from tests.test_lora import lora_qwen3, reference_tokens  # noqa: F401
except pytest.skip.Exception:  # tests/test_lora.py skips itself without peft: so does the LoRA test here
    pass

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu


def _checkpoint(preset: str, tmp_path_factory, dtype: str) -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    return make_checkpoint(preset, tmp_path_factory.mktemp(preset), dtype=dtype, device="cuda")


@pytest.fixture(scope="module")
def qwen3_4b_2l(tmp_path_factory):
    """Qwen3-4B's shapes, 2 layers, bfloat16: every kernel at its real grid."""
    return _checkpoint("qwen3-4b-2l", tmp_path_factory, "bfloat16")


def _prompts(seed: int, lengths, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def _generate(path, prompts, params, routes: list | None = None, inspect=None, **kw):
    """Token ids and chosen-token logprobs of ``prompts`` through ``infer.LLM`` on CUDA, and the engine's stats
    (``routes``: gets each step's CUDA-graph route, None for an eager step; ``inspect``: called with the engine
    after the run)."""
    from infer.llm import LLM

    llm = LLM(str(path), progress=False, device="cuda", batching="continuous", kv_cache="paged", max_num_seqs=8,
              max_model_len=512, **kw)
    if routes is not None:
        llm.engine.runner.on_executed = lambda out: routes.append(out.graph)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if inspect is not None:
            inspect(llm.engine)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm.engine.stats()
    finally:
        llm.engine.shutdown()


# ------------------------------------------------------------------------ phase 11: the quantized GEMV/GEMM


@pytest.mark.parametrize("tile", [None, (1, 256, 1), (8, 512, 4), (4, 2048, 8)],
                         ids=["default", "1x256x1", "8x512x4", "4x2048x8"])
@pytest.mark.parametrize("method", ["int8", "fp8", "int4", "int4-asym"])
def test_quantized_linear_at_qwen3_4b_shapes(method, tile):
    """The dequantize-in-registers kernel (GEMV rows 1 and 16, the tl.dot GEMM at 128 rows) on Qwen3-4B's merged
    QKV and down projections, bf16 activations, against float64 over the dequantized weight: within bf16's
    output rounding (relative Frobenius error 4e-3; one rounding to bf16 alone is ~1e-3). The GEMV with its
    default tile and with other (BLOCK_N, BLOCK_K, warps) tiles of benchmarks/quantization.py's tune grid.
    ``int4-asym``: int4 with a zero point per group (AWQ's and asymmetric GPTQ's layout)."""
    from infer.kernels import quant_reference as qref
    from infer.kernels.quant_triton import quantized_linear_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    zp = None
    asym, method = method.endswith("-asym"), method.removesuffix("-asym")
    for n, k in ((6144, 2560), (2560, 9728)):
        block = qref.default_block(method, k)
        w = torch.randn(n, k, generator=g, device="cuda") * 0.02
        if asym:
            q, s, zp = qref.quantize_asymmetric(w + 0.01, block)
        else:
            q, s = qref.quantize(w, method, block)
        exact_w = qref.dequantize(q, s, method, block, zero_point=zp).double()
        for m in (1, 16, 128):
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            config = None if tile is None or m > 16 else (1 << (m - 1).bit_length(), *tile, False)
            ours = quantized_linear_triton(x, q, s, method, block, config=config, zero_point=zp)
            assert ours.dtype == torch.bfloat16 and ours.shape == (m, n)
            exact = x.double() @ exact_w.T
            err = ((ours.double() - exact).norm() / exact.norm()).item()
            assert err < 4e-3, (method, n, k, m, err)


@pytest.mark.parametrize("zero_points", [None, "int8", "float32"])
def test_tinygemm_int4_at_qwen3_4b_shapes(zero_points):
    """PyTorch's tensor-core int4 kernel on the layout infer.kernels.quant_tinygemm makes (symmetric int4, AWQ-style
    int8 zero points, GGUF-style float zero points), 1-16 rows, against float64 over the dequantized weight: within
    bf16's roundings of the output and of the scales (relative Frobenius error 5e-3). QuantizedLinear's CUDA forward
    takes it up to TINYGEMM_MAX_ROWS rows and the Triton GEMM above; a shape it does not take (N % 16) has no layout
    and keeps the Triton GEMV."""
    from infer.kernels import quant_reference as qref
    from infer.kernels.quant_tinygemm import TINYGEMM_MAX_ROWS, pack_tinygemm, tinygemm_linear
    from infer.models.quant import QuantizedLinear

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((6144, 2560), (2560, 9728)):
        block = (1, 128)
        w = torch.randn(n, k, generator=g, device="cuda") * 0.02 + (0.01 if zero_points else 0.0)
        zp = None
        if zero_points:
            q, s, zp = qref.quantize_asymmetric(w, block)
            zp = zp.float() + 0.25 if zero_points == "float32" else zp  # GGUF's minimums are not integers
        else:
            q, s = qref.quantize(w, "int4", block)
        exact_w = qref.dequantize(q, s, "int4", block, zero_point=zp).double()
        packed = pack_tinygemm(q, s, block, zp)
        layer = QuantizedLinear(k, n, False, "int4", block, zero_point=zp is not None,
                                zero_point_dtype=zp.dtype if zp is not None else torch.int8).cuda()
        layer.qweight.data, layer.weight_scale.data = q, s
        if zp is not None:
            layer.weight_zero_point.data = zp
        for m in (1, 4, 16, 40):
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            exact = x.double() @ exact_w.T
            outs = {"layer": layer(x)}
            if m <= TINYGEMM_MAX_ROWS:
                outs["tinygemm"] = tinygemm_linear(x, packed)
                assert torch.equal(outs["layer"], outs["tinygemm"])  # the forward took it
            for name, y in outs.items():
                err = ((y.double() - exact).norm() / exact.norm()).item()
                assert y.dtype == torch.bfloat16 and err < 5e-3, (name, n, k, m, err)
    q, s = qref.quantize(torch.randn(40, 256, device="cuda"), "int4", (1, 128))
    assert pack_tinygemm(q, s, (1, 128)) is None  # 40 outputs: not a multiple of 16


def test_w8a8_fp8_at_qwen3_4b_shapes():
    """W8A8: the per-token e4m3 quantization kernel equals its reference bit for bit (a row of zeros and a row with
    one outlier among them), and torch._scaled_mm on its codes equals the float32 reference within bf16's output
    rounding (relative Frobenius error 4e-3), 5 to 2,048 rows; QuantizedLinear takes it from W8A8_MIN_ROWS rows."""
    from infer.kernels import quant_reference as qref
    from infer.kernels.quant_w8a8 import W8A8_MIN_ROWS, per_token_fp8, w8a8_linear
    from infer.models.quant import QuantizedLinear

    g = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((6144, 2560), (2560, 9728)):
        w = torch.randn(n, k, generator=g, device="cuda") * 0.02
        q, s = qref.quantize(w, "fp8", (1, k))
        layer = QuantizedLinear(k, n, False, "fp8", (1, k), fp8_activations=True).cuda()
        layer.qweight.data, layer.weight_scale.data = q, s
        for m in (W8A8_MIN_ROWS, 16, 128, 2048):
            x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
            x[0] = 0
            x[-1, 7] = 300.0
            xq, xs = per_token_fp8(x)
            rq, rs = qref.quantize_per_token_fp8(x)
            assert torch.equal(xs, rs) and torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))
            ref = qref.w8a8_linear_reference(x.float(), q, s)
            y = w8a8_linear(x, q, s)
            err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
            assert y.dtype == torch.bfloat16 and err < 4e-3, (n, k, m, err)
            assert torch.equal(layer(x), y)


@pytest.mark.parametrize("method", ["int8", "fp8", "int4", "fp8_w8a8"])
def test_quantized_engine_replays_what_it_runs_eagerly(qwen3_4b_2l, method, monkeypatch):
    """Quantized weights under the fused forward, CUDA graphs, async scheduling and PDL: the tokens and
    logprobs of the same engine without graphs, async steps and PDL, bit for bit (a graph that read a stale
    scale or a packed weight at a moved address, or a kernel that read its input before its PDL wait, would
    differ). Prefills take the tl.dot GEMM here: cuBLAS, behind the default dequantize-then-GEMM path, picks its
    kernel by the row count, and a graph pads a prefill's rows (int8 failed bit-equality that way on an H200; the
    kernel itself is checked against float64 in test_quantized_linear_at_qwen3_4b_shapes)."""
    from infer.kernels import quant_triton

    monkeypatch.setattr(quant_triton, "DEQUANT_THEN_CUBLAS", False)
    prompts = _prompts(1, (40, 7, 129), 150000)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    eager, _ = _generate(qwen3_4b_2l, prompts, params, dtype="bfloat16", quantization=method, fused_kernels=True)
    graphs, _ = _generate(qwen3_4b_2l, prompts, params, dtype="bfloat16", quantization=method, fused_kernels=True,
                          cuda_graphs=True, async_scheduling=True, pdl=torch.cuda.get_device_capability() >= (9, 0))
    assert graphs == eager


# ------------------------------------------------------------------------ phase 16: the LoRA kernels


@pytest.mark.parametrize("num_tokens", [1, 32, 512])
def test_lora_shrink_expand_at_qwen3_8b_shapes(num_tokens):
    """BGMV (1 and 32 rows) and SGMV (512 rows) over 8 rank-16 slots on Qwen3-8B's merged gate/up (4096 ->
    24576), bf16, rows spread over the slots and rows without adapter, against float64 slot by slot."""
    from infer.kernels import lora_reference, lora_triton

    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    num_slots, rank, k, n = 8, 16, 4096, 2 * 12288
    x = torch.randn(num_tokens, k, generator=g, device="cuda").bfloat16()
    a = (torch.randn(num_slots, rank, k, generator=g, device="cuda") * 0.02).bfloat16()
    b = (torch.randn(num_slots, n, rank, generator=g, device="cuda") * 0.02).bfloat16()
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g, device="cuda")
    if num_tokens > 1:
        slots[0] = -1
    y0 = torch.randn(num_tokens, n, generator=g, device="cuda").bfloat16()
    meta = lora_reference.make_lora_meta(slots.tolist(), num_slots, "cuda")
    y = lora_triton.add_lora(y0.clone(), x, a, b, meta)
    want = y0.double()
    for s in range(num_slots):
        rows = slots == s
        want[rows] += (x[rows].double() @ a[s].double().T) @ b[s].double().T
    torch.testing.assert_close(y.double(), want, rtol=8e-3, atol=2e-3)
    if num_tokens > 1:
        assert torch.equal(y[0], y0[0])  # a row without adapter is untouched


@pytest.mark.parametrize("part", ["qkv", "gate_up", "down"])
def test_lora_one_row_path_at_qwen3_8b_shapes(part):
    """Batch-1 decode's LoRA in two kernels (tests/test_lora.py's one-row test, compiled, bf16, rank 16 of 8
    slots): ``lora_shrink_row`` (with the norm before QKV / gate-up, the residual add before QKV) and the
    skinny GEMM with the expand in its epilogue, before the activation (gate/up) or the residual add (down),
    against the unfused reference ops: the values within a rounding or two of the largest."""
    from infer.kernels import fused_reference, lora_reference, lora_triton
    from infer.kernels import skinny_gemm as sk

    g = torch.Generator(device="cuda").manual_seed(len(part))
    num_slots, rank, hidden = 8, 16, 4096
    k, starts = {"qkv": (hidden, (0, 4096, 5120)), "gate_up": (hidden, (0, 12288)), "down": (12288, (0,))}[part]
    n = {"qkv": 6144, "gate_up": 24576, "down": hidden}[part]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

    x, res, nw = rnd(1, k), rnd(1, k), (1 + rnd(k, scale=0.1).float()).bfloat16()
    a, b, w = rnd(num_slots, len(starts) * rank, k, scale=0.02), rnd(num_slots, n, rank, scale=0.02), rnd(n, k, scale=0.02)
    slot = torch.tensor([5], dtype=torch.int32, device="cuda")
    meta = lora_reference.make_lora_meta([5], num_slots, "cuda")
    if part == "down":  # after the activation, before the residual add
        t, h, _ = lora_triton.lora_shrink_row(x, a, slot)
        got = sk.skinny_linear(h, w, residual=res[:, :n], lora=sk.LoRAEpilogue(t, b, slot, starts))
        want = lora_reference.add_lora(sk.skinny_linear_reference(x, w), x, a, b, meta) + res[:, :n]
    else:
        t, h, s = lora_triton.lora_shrink_row(x, a, slot, res if part == "qkv" else None, nw, 1e-6, False)
        s_want = x + res if part == "qkv" else x
        h_want = fused_reference.rms_norm(s_want, nw, 1e-6, False)
        assert torch.equal(s, s_want) and (h.float() - h_want.float()).abs().max() <= 2 ** -7 * h_want.float().abs().max()
        act = "silu" if part == "gate_up" else None
        got = sk.skinny_linear(h, w, config=sk.after_norm_config(w, act), activation=act,
                               lora=sk.LoRAEpilogue(t, b, slot, starts))
        want = lora_reference.add_lora_stacked(sk.skinny_linear_reference(h_want, w), h_want, a, b, starts, meta)
        if act:
            want = fused_reference.act_and_mul(want, act)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)


def test_lora_engine_matches_peft_merged_on_cuda(lora_qwen3, reference_tokens):  # noqa: F811
    pytest.importorskip("peft")
    """A batch mixing the base model and three PEFT adapters (tests/test_lora.py's), float32 on CUDA with the
    Triton kernels, two slots for three adapters, paged KV, chunked prefill and the fused forward: the greedy
    tokens of PEFT's merge_and_unload() models run by HF transformers."""
    from infer.llm import LLM
    from infer.lora import LoRARequest
    from tests.test_lora import GREEDY, PROMPTS

    base, adapters = lora_qwen3
    llm = LLM(str(base), progress=False, device="cuda", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=8, batching="continuous", kv_cache="paged", block_size=16, chunked_prefill=True,
              max_num_batched_tokens=16, fused_kernels=True, max_model_len=128)
    try:
        loras = [None] + [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
        outs = llm.generate(PROMPTS, GREEDY, lora_request=loras, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference_tokens
    finally:
        llm.engine.shutdown()


# ------------------------------------------------------------------------ phase 17: Gated DeltaNet


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32-state", "bf16-state"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_delta_decode_step_at_qwen35_4b_shapes(dtype, state_dtype):
    """The Triton conv1d update and gated delta step at Qwen3.5-4B's linear-attention shapes (16 key heads,
    32 value heads, 128 x 128 state, kernel 4), 8 sequences in 64 slots, against the plain-PyTorch step;
    with bfloat16 state slots (``ssm_state_dtype``) too, both rounding the float32 update once."""
    from infer.kernels import gated_delta_reference as gdr
    from infer.kernels import gated_delta_triton as tri

    gen = torch.Generator(device="cuda").manual_seed(3)
    nk, hv, dk, dv, kernel, num_slots, batch = 16, 32, 128, 128, 4, 64, 8
    c = 2 * nk * dk + hv * dv
    dev = "cuda"
    merged = torch.randn(batch, c + 2 * hv, generator=gen, device=dev).to(dtype)  # the fused forward's slices
    mixed, b, a = merged[:, :c], merged[:, c:c + hv], merged[:, c + hv:]
    a_log, dt_bias = torch.randn(hv, generator=gen, device=dev), torch.randn(hv, generator=gen, device=dev)
    weight = torch.randn(c, kernel, generator=gen, device=dev).to(dtype)
    conv = torch.randn(num_slots, c, kernel - 1, generator=gen, device=dev).to(dtype)
    ssm = torch.randn(num_slots, hv, dk, dv, generator=gen, device=dev).to(state_dtype)
    slots = torch.randperm(num_slots, generator=gen, device=dev)[:batch]
    has = torch.ones(batch, dtype=torch.bool, device=dev)
    has[1] = False  # a sequence starting from a zero state
    conv_ref, ssm_ref = conv.clone(), ssm.clone()
    ref = gdr.decode_step(mixed, a, b, a_log, dt_bias, conv_ref, ssm_ref, slots, has, weight, nk)
    out = tri.decode_step(mixed, a, b, a_log, dt_bias, conv, ssm, slots, has, weight, nk)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=3e-2)
    torch.testing.assert_close(out, ref, **tol)
    if state_dtype == torch.bfloat16:  # one rounding of nearly the same float32 value: at most one bf16 step apart
        tol = dict(atol=tol["atol"], rtol=max(tol["rtol"], 2.0 ** -7))
    torch.testing.assert_close(ssm.float(), ssm_ref.float(), **tol)
    assert ssm.dtype == state_dtype
    torch.testing.assert_close(conv, conv_ref, atol=0, rtol=0)


@pytest.mark.gpu
def test_prefill_convolution_at_qwen35_4b_shapes():
    """The prefills' convolution kernel in bfloat16 at Qwen3.5-4B's width (8,192 channels, 4 taps): three
    prefills of 1, 300 and 1,500 tokens (two after a state), ``x`` a column slice of the merged
    in-projection, against the plain-PyTorch form: nearly every value bit for bit."""
    from infer.kernels import gated_delta_reference as gdr
    from infer.kernels import gated_delta_triton as tri

    gen = torch.Generator(device="cuda").manual_seed(9)
    lens, c = [1, 300, 1500], 8192
    wide = torch.randn(sum(lens), c + 4096, generator=gen, device="cuda").bfloat16()
    x, weight = wide[:, :c], (torch.randn(c, 4, generator=gen, device="cuda") * 0.5).bfloat16()
    convs = [torch.randn(c, 3, generator=gen, device="cuda").bfloat16(), None,
             torch.randn(c, 3, generator=gen, device="cuda").bfloat16()]
    got, want = tri.causal_conv1d_varlen(x, weight, lens, convs), gdr.causal_conv1d_varlen(x, weight, lens, convs)
    assert (got == want).float().mean() >= 0.99
    torch.testing.assert_close(got, want, atol=2.0 ** -7, rtol=2.0 ** -7)


def test_gated_rms_norm_at_qwen35_4b_shapes():
    """The one-kernel gated norm in bfloat16 at Qwen3.5-4B's shapes (32 value heads of 128), its gate a slice of
    the merged in-projection: the reference's roundings to nearest, so nearly every value bit for bit."""
    from infer.kernels import gated_delta_reference as gdr
    from infer.kernels import gated_delta_triton as tri

    gen = torch.Generator(device="cuda").manual_seed(4)
    t, h, dv, dev = 8, 32, 128, "cuda"
    x = torch.randn(t, h, dv, generator=gen, device=dev) * 3
    merged = torch.randn(t, 9 + h * dv, generator=gen, device=dev).to(torch.bfloat16)
    gate = merged[:, 9:].view(t, h, dv)
    weight = (torch.rand(dv, generator=gen, device=dev) + 0.5).to(torch.bfloat16)
    out = tri.gated_rms_norm(x, gate, weight, 1e-6)
    ref = gdr.gated_rms_norm(x, gate, weight, 1e-6)
    assert (out == ref).float().mean() >= 0.97
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=1e-2)


def test_gated_qk_norm_rope_at_qwen35_4b_shapes():
    """The gated attention's fused steps in bfloat16 at Qwen3.5-4B's shapes (16 query heads with their gates,
    4 KV heads of 256, 64 rotated dimensions), 8 tokens at positions up to 30,000, against the plain-PyTorch
    reference: nearly every value bit for bit (the device's fused multiply-adds may flip a rounding); with the
    KV-cache write, the cache as ``reshape_and_cache`` writes the same k and v."""
    from infer.kernels import fused_reference, fused_triton
    from infer.kernels.attention_reference import reshape_and_cache
    from infer.models.layers import rope_cos_sin

    gen = torch.Generator(device="cuda").manual_seed(5)
    t, hq, hkv, d, r = 8, 16, 4, 256, 64
    qkv = (torch.randn(t, (2 * hq + 2 * hkv) * d, generator=gen, device="cuda") * 2).bfloat16()
    pos = torch.randint(0, 30000, (t,), generator=gen, device="cuda")
    cos, sin = rope_cos_sin(pos, 1.0 / (10000000 ** (torch.arange(0, r, 2, device="cuda").float() / r)), torch.float32)
    qw, kw = (torch.randn(2, d, generator=gen, device="cuda") * 0.1).bfloat16()
    a, b = qkv.clone(), qkv.clone()
    q, k, _, gate = fused_triton.gated_qk_norm_rope(a, cos, sin, hq, hkv, d, r, qw, kw, 1e-6)
    q_ref, k_ref, _, gate_ref = fused_reference.gated_qk_norm_rope(b, cos, sin, hq, hkv, d, r, qw, kw, 1e-6)
    for got, want in ((q, q_ref), (k, k_ref)):
        assert (got == want).float().mean() >= 0.99
        torch.testing.assert_close(got, want, atol=2 * 2.0 ** -8 * want.float().abs().max().item(), rtol=0)
    o = torch.randn(t, hq, d, generator=gen, device="cuda").bfloat16()
    out, ref = fused_triton.sigmoid_gate_mul(o, gate), fused_reference.sigmoid_gate_mul(o, gate_ref)
    assert (out == ref).float().mean() >= 0.99
    torch.testing.assert_close(out, ref, atol=2.0 ** -7, rtol=2.0 ** -7)
    # with the KV-cache write (a 16-token block size, two tokens on padding slots): the cache holds the
    # kernel's own rotated k and the v heads at each slot, bit for bit
    cache = [torch.zeros(4, 16, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    slots = torch.tensor([3, -1, 17, 40, 41, -1, 63, 0], device="cuda")
    c = qkv.clone()
    _, k_w, v_w, _ = fused_triton.gated_qk_norm_rope(c, cos, sin, hq, hkv, d, r, qw, kw, 1e-6, kv_cache=cache,
                                                     slot_mapping=slots)
    assert torch.equal(k_w, k)
    want = [torch.zeros_like(x) for x in cache]
    reshape_and_cache(k, v_w, *want, slots)
    assert torch.equal(cache[0], want[0]) and torch.equal(cache[1], want[1])


@pytest.mark.parametrize("linear_attention_backend", ["torch", "triton", "fla"])
def test_hybrid_engine_equals_hf_generate_on_cuda(tmp_path_factory, linear_attention_backend):
    """The tiny Qwen3.5 (3 Gated DeltaNet layers, 1 gated attention), float32 on CUDA with the Triton
    attention and decode-step kernels, paged KV and chunked prefill: HF transformers' greedy tokens (its
    plain-PyTorch rule on the CPU: with flash-linear-attention importable, transformers would call fla's
    Triton kernels on CPU tensors); the prefills' chunked rule in plain PyTorch, infer's Triton kernels or fla's."""
    if linear_attention_backend == "fla":
        pytest.importorskip("fla")
    from transformers import AutoModelForCausalLM

    from tests.hf_reference import hf_qwen35_plain_pytorch
    from tests.test_generation import hf_greedy

    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint("tiny-qwen3.5", tmp_path_factory.mktemp("q35"), dtype="float32", device="cpu")
    prompts = [[5, 6, 7], list(range(100, 164)), [300] * 17, list(range(200, 240))]
    with hf_qwen35_plain_pytorch():
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()  # the reference, on the CPU
        want = [hf_greedy(hf, p, 8) for p in prompts]
    got, _ = _generate(path, prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       dtype="float32", block_size=16, chunked_prefill=True, max_num_batched_tokens=32,
                       attention_backend="triton", linear_attention_backend=linear_attention_backend)
    assert [t for t, _ in got] == want


@pytest.mark.parametrize("backend,dtype", [("fla", torch.float32), ("triton", torch.bfloat16),
                                           ("triton", torch.float32)])
def test_chunked_rule_kernels_match_the_reference_at_qwen35_4b_shapes(backend, dtype):
    """The prefills' chunked gated delta rule in flash-linear-attention's kernels
    (:mod:`infer.kernels.gated_delta_fla`) or infer's three Triton kernels (bf16 inputs as the engine gives
    them, and float32) against the plain-PyTorch form on the same inputs, at Qwen3.5-4B's linear-attention
    shapes (32 value heads, 128 x 128 state): three sequences side by side (1, 100 and 300 tokens), two from
    a state (a later prompt chunk), the outputs and the final states (and, for infer's kernels, a state
    inside a prefill)."""
    if backend == "fla":
        pytest.importorskip("fla")
    from infer.kernels import gated_delta_reference as gdr
    from infer.kernels import linear_attention_ops

    fla = linear_attention_ops(backend)

    gen = torch.Generator(device="cuda").manual_seed(17)
    lens, h, d = [1, 100, 300], 32, 128
    t = sum(lens)
    q = gdr.l2norm(torch.randn(t, h, d, generator=gen, device="cuda"))
    k = gdr.l2norm(torch.randn(t, h, d, generator=gen, device="cuda"))
    v = torch.randn(t, h, d, generator=gen, device="cuda")
    g = -torch.rand(t, h, generator=gen, device="cuda") * 0.3
    beta = torch.rand(t, h, generator=gen, device="cuda")
    inits = [torch.randn(h, d, d, generator=gen, device="cuda") * 0.1, None,
             torch.randn(h, d, d, generator=gen, device="cuda") * 0.1]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    asked = [{}, {}, {256: None}] if backend == "triton" else None
    want_states = [dict(a) for a in asked] if asked else None
    want_o, want_s = gdr.chunk_gated_delta_rule_varlen(q, k, v, g, beta, lens, inits, states_out=want_states)
    got_o, got_s = fla.chunk_gated_delta_rule_varlen(q, k, v, g, beta, lens, inits, states_out=asked)
    pairs = [(got_o, want_o), (got_s, want_s)] + ([(asked[2][256], want_states[2][256])] if asked else [])
    for got, want in pairs:
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2 * scale)


def test_triton_prefill_rule_at_qwen35_4b_shapes():
    """infer's three kernels fed what the layer has (:func:`infer.kernels.gated_delta_triton.prefill_rule`: the
    convolution's bf16 output, 16 key heads for 32 value heads of 128, the raw ``a`` and ``b``; norms and
    gating inside) against the reference's ``prefill_rule`` on the same inputs: two prefills of 100 and 300
    tokens, one from a state, a state at 256 tokens, outputs and final states."""
    from infer.kernels import gated_delta_reference as gdr
    from infer.kernels import gated_delta_triton as tri

    gen = torch.Generator(device="cuda").manual_seed(23)
    lens, hk, hv, d = [100, 300], 16, 32, 128
    t = sum(lens)
    y = torch.randn(t, (2 * hk + hv) * d, generator=gen, device="cuda").bfloat16()
    a, b = (torch.randn(t, hv, generator=gen, device="cuda") * 2).bfloat16(), torch.randn(
        t, hv, generator=gen, device="cuda").bfloat16()
    a_log, dt_bias = torch.rand(hv, generator=gen, device="cuda"), torch.rand(hv, generator=gen, device="cuda")
    inits = [torch.randn(hv, d, d, generator=gen, device="cuda") * 0.1, None]
    args = (y, a, b, a_log, dt_bias, hk, d, hv, d, lens, inits)
    want_states, got_states = [{}, {256: None}], [{}, {256: None}]
    want, got = gdr.prefill_rule(*args, states_out=want_states), tri.prefill_rule(*args, states_out=got_states)
    for x, ref in [*zip(got, want), (got_states[1][256], want_states[1][256])]:
        torch.testing.assert_close(x, ref, rtol=2e-2, atol=1e-2 * ref.abs().max().item())


# ------------------------------------------------------------------------ phase 12: speculation on the GPU


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_draft_speculation_is_lossless_with_the_gpu_flags(tmp_path_factory, graphs):
    """The draft method with the target itself as the draft (every draft is the target's own greedy choice,
    so verification accepts nearly all of them: the verify rows' k + 1 tokens per sequence carry the
    output), float32 on CUDA with the fused forward and CUDA graphs for the decode steps: the greedy tokens
    of the same engine without speculation. (Prompt lookup proposes nothing on random weights, whose
    outputs do not repeat their prompts; float32 keeps verify-vs-decode rounding far below the logit gaps.)
    With graphs, the verify steps replay the decode graphs with their tokens as decode rows (route
    ``"verify"``), a 300-token prompt chunked beside them puts drafts beside a prompt chunk
    (``"mixed-pieces"``), and the draft's forwards replay its own decode graphs (all but the catch-ups over
    whole prompts, which run eagerly)."""
    path = _checkpoint("tiny-qwen3", tmp_path_factory, "float32")
    prompts = _prompts(2, (12, 30, 50, 9, 300), 700)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    flags = dict(dtype="float32", fused_kernels=True, cuda_graphs=graphs, kv_cache_memory_bytes=64 << 20,
                 chunked_prefill=True, max_num_batched_tokens=64)
    ref, _ = _generate(path, prompts, params, **flags)
    spec = {"method": "draft", "model": str(path), "num_speculative_tokens": 3}
    routes: list = []
    draft_graph_steps = []
    got, stats = _generate(path, prompts, params, routes=routes, speculative_config=spec,
                           inspect=lambda engine: draft_graph_steps.append(engine.proposer.graph_steps), **flags)
    assert [t for t, _ in got] == [t for t, _ in ref]
    assert stats["spec_decode_num_accepted_tokens"] > 0.9 * stats["spec_decode_num_draft_tokens"] > 0
    if graphs:
        assert routes.count("verify") > 5 and "mixed-pieces" in routes, routes
        assert draft_graph_steps[0] > 20, draft_graph_steps
    else:
        assert draft_graph_steps == [0]


# ------------------------------------------------------------------------ the step trace with CUDA graphs


def test_trace_records_graph_replays(qwen3_4b_2l, tmp_path):
    """trace=PATH with CUDA graphs: every step records whether it replayed a graph and which bucket, and a
    step replays a bucket no smaller than its tokens; decode-only steps replay the decode graph; the file is
    Trace Event Format JSON."""
    from tests.test_step_trace import check_trace_format

    path = tmp_path / "trace.json"
    prompts = _prompts(4, (20, 300), 150000)
    _generate(qwen3_4b_2l, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              dtype="bfloat16", fused_kernels=True, cuda_graphs=True, trace=str(path))
    events = check_trace_format(json.loads(path.read_text()))
    steps = [e["args"] for e in events if e.get("ph") == "X" and "decode_tokens" in e.get("args", {})]
    assert any(a["prefill_tokens"] for a in steps) and any(a["decode_tokens"] for a in steps)
    for a in steps:
        if a["graph"] != "eager":
            assert a["graph_size"] >= a["prefill_tokens"] + a["decode_tokens"], a
        if not a["prefill_tokens"]:
            assert a["graph"] == "decode", a


@pytest.mark.parametrize("backend,stride", [("torch", 32), ("triton", 64), ("fla", 64)])
def test_hybrid_prefix_hits_with_cuda_graphs_equal_cold_runs(tmp_path_factory, backend, stride):
    """Hybrid prefix caching (state snapshots every 32 tokens, off the 64-token chunks: each prefill split at
    them; or every 64 with infer's Triton chunked rule, whose recurrence leaves them in its chunk states, or with
    flash-linear-attention's, the pieces between them in rounds of its kernel) with decode graphs: prompts sharing prefixes of several lengths, one request at a time so each
    hits the previous ones' blocks, including a hit that leaves one token to compute (a decode-shaped step
    that must restore its snapshot, so it runs eagerly) and decodes that end on a stride (a snapshot
    taken); the greedy tokens of an engine without prefix caching, float32 on CUDA."""
    if backend == "fla":
        pytest.importorskip("fla")
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_synthetic_checkpoint import make_checkpoint

    path = make_checkpoint("tiny-qwen3.5", tmp_path_factory.mktemp("q35-prefix"), dtype="float32", device="cpu")
    base = list(range(100, 164))
    prompts = [base + [7, 8, 9], base[:32] + [5] * 10, base + [7, 8, 9, 10], base[:48] + [300], base + [7]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    flags = dict(dtype="float32", block_size=16, cuda_graphs=True, state_snapshot_stride=stride,
                 linear_attention_backend=backend)
    cold = [_generate(path, [p], params, **flags)[0][0][0] for p in prompts]
    from infer.llm import LLM

    llm = LLM(str(path), progress=False, device="cuda", batching="continuous", kv_cache="paged", max_num_seqs=4,
              max_model_len=512, prefix_caching=True, **flags)
    try:
        warm = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        assert [o.outputs[0].token_ids for o in warm] == cold
        assert sum(o.num_cached_tokens for o in warm) > 0, "no prefix hit"
    finally:
        llm.engine.shutdown()
