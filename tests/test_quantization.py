"""Phase 11: weight-only quantization (int8, fp8, int4).

* The formats: quantize / dequantize round trips within the error each format's step allows, the int4
  packing against a hand-computed word, bad input.
* The Triton kernel (interpreter on the CPU) against the plain-PyTorch reference, on fresh random inputs:
  the one-row-to-8-row GEMV form and the tl.dot GEMM form, every method, per-channel, per-group and
  block-wise scales, partial last blocks, bias, bfloat16.
* The CPU path (PyTorch's weight-only kernels on a layout made once at load, bfloat16 activations) against
  the float32 dequantize-then-matmul reference, within the bound bfloat16 rounding allows: int8 per channel,
  int4 in torch's groups (a partial last group of ours included), the bfloat16 copy of every other layout,
  1 to 16 rows and a prefill.
* Merging quantized projections (the fused forward's QKV and gate/up) is exact.
* The engine on the shipped SmolLM2-135M with int8: the greedy tokens of the same model with each
  projection's weight replaced by its dequantized value, run unquantized (an exact reference for
  weight-only quantization, and what the CPU computed before it had kernels), with and without fused
  kernels, the quantized layers on the CPU kernels; and how many match the float model.
* Pre-quantized checkpoints loaded as stored: Hugging Face's block-wise FP8 (transformers' own reader,
  dequantizing, is the reference) and compressed-tensors W8A16 / W4A16 / FP8 written by the
  ``compressed-tensors`` library (the reference: a float model with the library's fake-quantized weights).
"""

from __future__ import annotations

import contextlib
import copy
import json
import zlib

import pytest
import torch
from torch import nn

from infer.config import EngineConfig
from infer.kernels import quant_reference as qref
from infer.kernels.quant_cpu import error_bound, pack_for_cpu, quantized_linear_cpu
from infer.kernels.triton_common import INTERPRET
from infer.loader import load_model
from infer.models.quant import QuantizedLinear, QuantScheme, merge_quantized
from infer.sampling import SamplingParams
from tests.hf_reference import hf_logits, infer_logits, tiny_hf_model
from tests.test_batching import drive, make_engine
from tests.test_parity import _prompts, assert_parity

#: CPU tensors through the Triton kernels: only under the interpreter (tests/conftest.py sets it where there is no
#: GPU); on a GPU machine their twins at real shapes run in tests/test_gpu_phases.py
interpreted = pytest.mark.skipif(not INTERPRET, reason="CPU tensors through Triton kernels need TRITON_INTERPRET=1")

METHODS = ("int8", "fp8", "int4")

# ---------------------------------------------------------------------------- formats


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("block", [None, (1, 32), (16, 32)])
def test_round_trip_error_is_within_the_formats_step(method, block):
    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.rand(40, 1) * 3  # rows of different ranges
    w[3] = 0.0  # a row of zeros: scale 1, exact zeros back
    q, s = qref.quantize(w, method, block)
    blk = block or qref.default_block(method, 96)
    back = qref.dequantize(q, s, method, blk)
    scale = qref.expand_scale(s, (40, 96), blk)
    err = (back - w).abs()
    slack = 1e-6 * w.abs()  # float32 rounding of w / scale and q * scale
    if method == "fp8":  # 3 mantissa bits: half a step is 2^-4 of the value; e4m3 subnormals: 2^-10 of the scale
        bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10)
    else:
        bound = scale / 2
    assert bool((err <= bound + slack).all()), (err - bound).max()
    assert bool((back[3] == 0).all())
    # a row's largest value is the largest of its one-row blocks: exact in the integer formats (the largest code)
    if method != "fp8" and blk[0] == 1:
        i = w.abs().argmax(1)
        assert torch.allclose(back[torch.arange(40), i], w[torch.arange(40), i], rtol=1e-6)


def test_int4_packing_against_a_hand_computed_word():
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.int8)
    packed = qref.pack_int4(q)
    # stored q + 8: nibbles 0..7 in the first word (lowest bits first), 8..15 in the second
    assert packed.tolist() == [[0x76543210, torch.tensor(0xFEDCBA98).to(torch.int32).item()]]
    assert torch.equal(qref.unpack_int4(packed), q)
    r = torch.randint(-8, 8, (5, 64), dtype=torch.int8)
    assert torch.equal(qref.unpack_int4(qref.pack_int4(r)), r)


def test_asymmetric_int4_by_hand_and_within_half_a_step():
    """A group of 8 one-sided values: its range [0, 0.7] onto the 16 codes (step 0.7 / 15, zero point code 0,
    i.e. -8 signed), each value to its nearest code; random rows: every weight within half its group's step,
    which is the range / 15 (a symmetric quantizer's step is 2 max|w| / 15: twice as coarse here)."""
    w = torch.arange(8, dtype=torch.float32)[None] / 10  # 0.0 .. 0.7
    q, s, z = qref.quantize_asymmetric(w, (1, 8))
    step = 0.7 / 15
    assert s.shape == z.shape == (1, 1) and abs(s.item() - step) < 1e-7 and z.item() == -8
    u = [round(v / step) for v in (i / 10 for i in range(8))]  # unsigned codes (zero point 0)
    assert (qref.unpack_int4(q)[0] + 8).tolist() == u == [0, 2, 4, 6, 9, 11, 13, 15]
    torch.testing.assert_close(qref.dequantize(q, s, "int4", (1, 8), zero_point=z), torch.tensor([u]) * step)
    torch.manual_seed(1)
    w = torch.randn(24, 64) * 0.1 + torch.rand(24, 1)  # rows shifted off zero
    w[5] = 0.0
    q, s, z = qref.quantize_asymmetric(w, (1, 32))
    back = qref.dequantize(q, s, "int4", (1, 32), zero_point=z)
    assert bool(((back - w).abs() <= qref.expand_scale(s, w.shape, (1, 32)) / 2 + 1e-6).all())
    assert bool((back[5] == 0).all())
    _, s_sym = qref.quantize(w, "int4", (1, 32))
    assert bool((s <= s_sym * (15 / 14) + 1e-9).all())  # never coarser than the symmetric step (range includes 0)


def test_bad_input_raises_value_errors():
    w = torch.randn(8, 12)
    with pytest.raises(ValueError, match="multiple of 8"):
        qref.quantize(w, "int4")
    with pytest.raises(ValueError, match="unknown quantization"):
        qref.quantize(w, "int3")
    q, s = qref.quantize(torch.randn(8, 16), "int8")
    with pytest.raises(ValueError, match="qweight must be"):
        qref.quantized_linear_reference(torch.randn(2, 16), q.float(), s, "int8", (1, 16))
    with pytest.raises(ValueError, match="x must be"):
        qref.quantized_linear_reference(torch.randn(2, 15), q, s, "int8", (1, 16))
    with pytest.raises(ValueError, match="weight_scale must be"):
        qref.quantized_linear_reference(torch.randn(2, 16), q, s[:4], "int8", (1, 16))
    with pytest.raises(ValueError, match="zero_point must be int8"):  # zero points are int4's
        qref.quantized_linear_reference(torch.randn(2, 16), q, s, "int8", (1, 16), zero_point=s.to(torch.int8))
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(device="cpu", quantization="int3").validate()
    with pytest.raises(ValueError, match="parallelism is not supported"):
        EngineConfig(device="cpu", quantization="int8", tensor_parallel_size=2).validate()



def test_the_cli_flag_parses_to_the_field():
    import argparse

    from infer.config import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--quantization", "int4"])).quantization == "int4"
    assert engine_config_from_args(parser.parse_args(["--quantization", "fp8_w8a8"])).quantization == "fp8_w8a8"
    assert engine_config_from_args(parser.parse_args([])).quantization == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


# ---------------------------------------------------------------------------- the Triton kernel


@interpreted
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m, n, k, block", [(1, 40, 96, None), (5, 33, 80, (1, 32)), (20, 24, 64, (16, 32))])
def test_triton_kernel_matches_the_reference(method, m, n, k, block):
    """Rows 1 and 5: the GEMV form; 20: the tl.dot GEMM. Partial blocks: n 33 / 40 rows of 16, k 80 of 32."""
    from infer.kernels.quant_triton import quantized_linear_triton

    g = torch.Generator().manual_seed(m * 1000 + n)
    blk = block or qref.default_block(method, k)
    q, s = qref.quantize(torch.randn(n, k, generator=g), method, blk)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g) if m != 5 else None
    ours = quantized_linear_triton(x, q, s, method, blk, bias)
    ref = qref.quantized_linear_reference(x.double(), q, s, method, blk, bias.double() if bias is not None else None)
    assert ours.dtype == x.dtype
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("m, n, k, block", [(1, 40, 96, (1, 32)), (5, 33, 80, (1, 16)), (3, 16, 64, (1, 64)),
                                           (20, 24, 64, (1, 32))])
def test_triton_kernel_with_zero_points_matches_the_reference(m, n, k, block):
    """Asymmetric int4: the GEMV (1, 5 and 3 rows; one group per row: the per-row scale path, which must
    subtract the zero point inside the loop) and the GEMM (20 rows) subtract each group's zero point."""
    from infer.kernels.quant_triton import quantized_linear_triton

    g = torch.Generator().manual_seed(m * 100 + n)
    q, s, z = qref.quantize_asymmetric(torch.randn(n, k, generator=g) + 0.5, block)
    assert bool(z.ne(0).any())
    x = torch.randn(m, k, generator=g)
    ours = quantized_linear_triton(x, q, s, "int4", block, zero_point=z)
    ref = qref.quantized_linear_reference(x.double(), q, s, "int4", block, zero_point=z)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("method", METHODS)
def test_gemv_tiles_wider_than_a_scale_group_and_a_partial_last_tile(method):
    """The GEMV form with a K tile of 64 over scale groups of 16 (each column's group scale read in the loop),
    K = 168 (the last tile mostly masked: int4's words past K are never read), 3 rows padded to 4, 2 outputs
    per program over 7 (a partial last program)."""
    from infer.kernels.quant_triton import quantized_linear_triton

    g = torch.Generator().manual_seed(11)
    q, s = qref.quantize(torch.randn(7, 168, generator=g), method, (1, 8 if method == "int4" else 16))
    blk = (1, 8 if method == "int4" else 16)
    x = torch.randn(3, 168, generator=g)
    ours = quantized_linear_triton(x, q, s, method, blk, config=(4, 2, 64, 1, False))
    ref = qref.quantized_linear_reference(x.double(), q, s, method, blk)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("path", ["row scale", "one group a step", "a group a word", "zero points, one group a step"])
@pytest.mark.parametrize("inputs", ["centred", "positive"])
def test_one_row_gemv_scale_paths(method, path, inputs):
    """The one-row GEMV (batch-1 decode: codes taken out of int32 words with bit tricks, no int->float
    conversion) through each way it applies scales: one per row after the reduction; a group per K step
    (64 columns inside groups of 128, and 128-row scale blocks); a group per word (steps of 128 columns
    over groups of 16); zero points (asymmetric int4 and, as GGUF's Q4_1/Q4_K layouts give, float ones).
    K = 328 ends in a partial step; 37 outputs over programs of 4 end in a partial program. ``positive``
    inputs (an MLP's after its activation, say) make the largest cancellation: the kernel sums the unsigned
    codes (q + 128, q + 8) times x and takes 128 (8) sum x off once per step."""
    from infer.kernels.quant_triton import quantized_linear_triton

    if path.startswith("zero") and method != "int4":
        pytest.skip("zero points are int4's")
    g = torch.Generator().manual_seed(zlib.crc32(f"{method} {path}".encode()) % 1000)  # (hash() of a str varies by run)
    k = 384 if "one group" in path else 328
    w = torch.randn(37, k, generator=g) + 0.3
    blk, config = {"row scale": ((1, k), (1, 4, 64, 2, False)),
                   "one group a step": ((128, 128), (1, 4, 64, 2, False)),
                   "a group a word": ((1, 8 if method == "int4" else 16), (1, 4, 128, 2, False)),
                   "zero points, one group a step": ((1, 128), (1, 4, 64, 2, False))}[path]
    z = None
    if path.startswith("zero"):
        q, s, z = qref.quantize_asymmetric(w, blk)
        z = z.float() + torch.rand(z.shape, generator=g) - 0.5  # float zero points
    else:
        q, s = qref.quantize(w, method, blk)
    x = torch.randn(1, k, generator=g)
    if inputs == "positive":
        x = x.abs() + 0.5
    bias = torch.randn(37, generator=g)
    ours = quantized_linear_triton(x, q, s, method, blk, bias, config=config, zero_point=z)
    ref = qref.quantized_linear_reference(x.double(), q, s, method, blk, bias.double(), zero_point=z)
    if inputs == "centred":
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-4 if method == "int4" else 1e-5)
    # float32 sums of the unsigned codes' products, of up to 255 |x| s each: within 2^-22 of sum 255 |x| s
    # (the GPU rounds the output to bfloat16's 8 bits)
    scale = qref.expand_scale(s, (37, k), blk).double()
    bound = 2.0**-22 * (x.double().abs() @ (255 * scale).T) + 1e-6
    assert bool(((ours.double() - ref).abs() <= bound).all()), ((ours.double() - ref).abs() / bound).max()


@interpreted
@pytest.mark.parametrize("method, block", [("int8", (1, 200)), ("fp8", (16, 32)), ("int4", (1, 32)),
                                           ("int4", (1, 200)), ("int4-asym", (1, 64))])
def test_triton_dequantize_equals_the_reference(method, block):
    """The dequantizing kernel that feeds cuBLAS for prefills on CUDA (37 rows: a partial tile; per-channel, group and
    128-row block scales; zero points): bit for bit the reference's weight, in float32 and rounded to bfloat16."""
    from infer.kernels.quant_triton import dequantize_triton

    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 256 if method == "int4-asym" else 200, generator=g) + 0.2
    z = None
    if method == "int4-asym":
        method = "int4"
        q, s, z = qref.quantize_asymmetric(w, block)
    else:
        q, s = qref.quantize(w, method, block)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_triton(q, s, method, block, dtype, z), qref.dequantize(q, s, method, block, dtype, z))


@interpreted
@pytest.mark.parametrize("method", METHODS)
def test_triton_kernel_in_bfloat16_rounds_once(method):
    from infer.kernels.quant_triton import quantized_linear_triton

    g = torch.Generator().manual_seed(7)
    q, s = qref.quantize(torch.randn(24, 64, generator=g), method, (1, 32))
    x = torch.randn(3, 64, generator=g).bfloat16()
    ours = quantized_linear_triton(x, q, s, method, (1, 32))
    exact = x.double() @ qref.dequantize(q, s, method, (1, 32)).double().T
    assert ours.dtype == torch.bfloat16
    # float32 accumulation, one rounding to bfloat16: within half a bf16 ulp (2^-8 relative) and a float32 sum
    assert bool(((ours.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all())


def test_merged_quantized_projections_compute_the_parts():
    """Block-wise fp8 with 16-row blocks over parts of 24 and 8 rows (not whole blocks): the scales are
    repeated per row first; the merged output is the parts' outputs side by side, and the parts are views."""
    torch.manual_seed(3)
    parts = []
    for n in (24, 8, 8):
        layer = QuantizedLinear(64, n, True, "fp8", (16, 32))
        q, s = layer.quantize_weight(torch.randn(n, 64))
        layer.qweight.data, layer.weight_scale.data, layer.bias.data = q, s, torch.randn(n)
        parts.append(layer)
    x = torch.randn(4, 64)
    want_w = torch.cat([p.dequantized_weight() for p in parts])
    want = torch.cat([p(x) for p in parts], dim=1)
    merged = merge_quantized(*parts)
    assert merged.block == (1, 32) and merged.weight_scale.shape == (40, 2)
    assert torch.equal(merged.dequantized_weight(), want_w)  # the same weights, bit for bit
    torch.testing.assert_close(merged(x), want, rtol=1e-6, atol=1e-6)  # (one GEMM's sums may be ordered otherwise)
    assert parts[1].qweight.data_ptr() == merged.qweight[24:].data_ptr()
    assert torch.equal(torch.cat([p.dequantized_weight() for p in parts]), want_w)


def test_merged_asymmetric_int4_projections_keep_their_zero_points():
    torch.manual_seed(4)
    parts = []
    for n in (16, 8):
        layer = QuantizedLinear(64, n, False, "int4", (1, 32), zero_point=True)
        q, s, z = qref.quantize_asymmetric(torch.randn(n, 64) + 1.0, (1, 32))
        layer.qweight.data, layer.weight_scale.data, layer.weight_zero_point.data = q, s, z
        parts.append(layer)
    want_w = torch.cat([p.dequantized_weight() for p in parts])
    merged = merge_quantized(*parts)
    assert merged.weight_zero_point.shape == (24, 2) and torch.equal(merged.dequantized_weight(), want_w)
    assert parts[1].weight_zero_point.data_ptr() == merged.weight_zero_point[16:].data_ptr()
    plain = QuantizedLinear(64, 8, False, "int4", (1, 32))
    with pytest.raises(ValueError, match="can be merged"):
        merge_quantized(parts[0], plain)


# ---------------------------------------------------------------------------- the CPU kernels


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("m, n, k, block, kinds", [
    (1, 48, 576, (1, 128), {"int8": "bf16", "int4": "int4", "fp8": "bf16"}),  # 4.5 groups: int4 in torch's 64s
    (5, 64, 96, None, {"int8": "int8", "int4": "int4", "fp8": "bf16"}),  # one partial group of 96 (int4: 32s)
    (16, 40, 80, (1, 32), {"int8": "bf16", "int4": "bf16", "fp8": "bf16"}),  # N % 16, K % 32: no int4 kernel
    (40, 32, 64, None, {"int8": "int8", "int4": "int4", "fp8": "bf16"}),  # a prefill: the float32 GEMM
])
def test_cpu_kernels_match_the_reference(method, m, n, k, block, kinds):
    """PyTorch's CPU weight-only kernels on the layout made at load, against dequantize-then-matmul in float32,
    on fresh random inputs: within the bound of bfloat16 activations and outputs (quant_cpu.error_bound)."""
    torch.manual_seed(m * 1000 + k)
    block = block or qref.default_block(method, k)
    q, s = qref.quantize(torch.randn(n, k) * 0.05, method, block)
    packed = pack_for_cpu(q, s, method, block)
    assert packed.kind == kinds[method]
    bias = torch.randn(n)
    x = torch.randn(3, m, k) if m == 40 else torch.randn(m, k)
    got = quantized_linear_cpu(x, packed, q, s, method, block, bias)
    want = qref.quantized_linear_reference(x, q, s, method, block, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    excess = (got - want).abs() - error_bound(x, qref.dequantize(q, s, method, block))
    assert excess.max() <= 0, f"{packed.kind}: beyond the bound by {excess.max():.2e}"


@pytest.mark.parametrize("zero_points", ["int8", "float32"])
def test_cpu_path_of_asymmetric_int4_is_within_the_bfloat16_bound(zero_points):
    """Zero points (int8: AWQ, asymmetric GPTQ, int4_asym; float32: GGUF's Q4_1 / Q4_K) on torch's int4 CPU
    kernel, ``-z * scale`` as its bfloat16 zero: 1 row and a prefill against the float32 reference, within
    the bound that counts the zero term's rounding (error_bound's ``offset``); the zero points are applied
    (the same codes without them give another product)."""
    torch.manual_seed(5)
    q, s, z = qref.quantize_asymmetric(torch.randn(48, 128) * 0.05 + 0.02, (1, 64))
    if zero_points == "float32":
        z = z.float() + torch.rand(z.shape) - 0.5
    packed = pack_for_cpu(q, s, "int4", (1, 64), z)
    assert packed.kind == "int4"
    w = qref.dequantize(q, s, "int4", (1, 64), zero_point=z)
    offset = qref.expand_scale(z.float() * s, w.shape, (1, 64))
    for x in (torch.randn(1, 128), torch.randn(40, 128)):
        got = quantized_linear_cpu(x, packed, q, s, "int4", (1, 64), zero_point=z)
        want = qref.quantized_linear_reference(x, q, s, "int4", (1, 64), zero_point=z)
        assert ((got - want).abs() <= error_bound(x, w, offset)).all()
    x = torch.randn(1, 128)
    got = quantized_linear_cpu(x, packed, q, s, "int4", (1, 64), zero_point=z)
    assert not torch.equal(got, quantized_linear_cpu(x, pack_for_cpu(q, s, "int4", (1, 64)), q, s, "int4", (1, 64)))


def test_cpu_layout_is_made_once_and_follows_the_weight():
    layer = QuantizedLinear(64, 32, False, "int4", (1, 32))
    layer.qweight.data, layer.weight_scale.data = layer.quantize_weight(torch.randn(32, 64))
    first = layer.cpu_packed()
    assert layer.cpu_packed() is first and first.kind == "int4"  # made once
    assert set(layer.state_dict()) == {"qweight", "weight_scale"}  # not saved with the model
    x = torch.randn(2, 64)
    layer.qweight.data, layer.weight_scale.data = layer.quantize_weight(torch.randn(32, 64))  # a new weight
    assert layer.cpu_packed() is not first
    want = qref.quantized_linear_reference(x, layer.qweight, layer.weight_scale, "int4", (1, 32))
    assert ((layer(x) - want).abs() <= error_bound(x, layer.dequantized_weight())).all()


# ---------------------------------------------------------------------------- the engine on SmolLM2


@pytest.fixture(scope="module")
def smollm2_int8():
    return load_model("smollm2-135m", device="cpu", dtype=torch.float32, progress=False, quantization="int8")


@contextlib.contextmanager
def dequantized(model: nn.Module):
    """Every :class:`QuantizedLinear` of ``model`` replaced by an ``nn.Linear`` holding its dequantized weight
    (float32), restored on exit: the same model, unquantized."""
    swapped = []
    for owner in list(model.modules()):
        for attr, child in list(owner.named_children()):
            if isinstance(child, QuantizedLinear):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                lin.weight = nn.Parameter(child.dequantized_weight(torch.float32), requires_grad=False)
                if child.bias is not None:
                    lin.bias = nn.Parameter(child.bias.detach().clone(), requires_grad=False)
                setattr(owner, attr, lin)
                swapped.append((owner, attr, child))
    try:
        yield
    finally:
        for owner, attr, child in swapped:
            setattr(owner, attr, child)


def _greedy(loaded, prompts, **kw):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eng = make_engine(loaded, batching="continuous", kv_cache="paged", block_size=16, max_model_len=128, **kw)
    return drive(eng, [(0, p, params) for p in prompts])


def test_int8_engine_gives_the_tokens_of_the_dequantized_model(smollm2_int8, smollm2):
    tok = smollm2.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode("def fibonacci(n):\n    ")]
    attn = smollm2_int8.model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, QuantizedLinear) and attn.q_proj.qweight.dtype == torch.int8
    ours = _greedy(smollm2_int8, prompts)
    with dequantized(smollm2_int8.model):
        assert isinstance(smollm2_int8.model.model.layers[0].self_attn.q_proj, nn.Linear)
        ref = _greedy(smollm2_int8, prompts)
    assert ours == ref
    try:  # the fused forward: quantized QKV and gate/up merged, the norm/RoPE/activation kernels around them
        assert _greedy(smollm2_int8, prompts, fused_kernels=True) == ref
        assert isinstance(smollm2_int8.model.model.layers[0].self_attn.qkv_proj, QuantizedLinear)
    finally:
        smollm2_int8.model.set_fused_ops(None)
    # against the float model: top-1 agreement, teacher-forced on the int8 model's greedy continuations
    seqs = [prompts[i] + ours[i][0] for i in sorted(ours)]
    same = total = 0
    for p, seq, a, b in zip(prompts, seqs, infer_logits(smollm2_int8.model, seqs), infer_logits(smollm2.model, seqs)):
        gen = slice(len(p) - 1, len(seq) - 1)  # the positions that predicted a generated token
        same += int((a[gen].argmax(-1) == b[gen].argmax(-1)).sum())
        total += a[gen].shape[0]
    print(f"int8 vs float32 SmolLM2-135M: top-1 agreement {same}/{total}")
    assert same >= 0.75 * total


# ---------------------------------------------------------------------------- pre-quantized checkpoints


def _tiny_qwen3():
    return tiny_hf_model("qwen3", hidden_size=128, intermediate_size=256, head_dim=32)


def _check_against(path, ref, method: str, fused: bool = True):
    ours = load_model(path, device="cpu", dtype=torch.float32, progress=False)
    proj = ours.model.model.layers[0].mlp.down_proj
    assert isinstance(proj, QuantizedLinear) and proj.method == method
    _check_logits(ours, ref, fused)
    return ours


@pytest.mark.parametrize("kind, method", [("llama", "int4"), ("gemma3", "fp8"), ("qwen3_moe", "int8"),
                                          ("qwen3", "int4_asym")])
def test_online_quantization_is_the_model_with_dequantized_weights(kind, method, tmp_path, cpu_reference_forward):
    """Every architecture's projections quantized at load (Gemma 3's GeGLU and sandwich norms, Qwen3-MoE's
    attention beside its unquantized experts, int4 with zero points): HF transformers with each projection's
    weight replaced by our dequantized one is the reference, unfused and fused."""
    from tests.hf_reference import save_hf

    ref = tiny_hf_model(kind)
    ours = load_model(save_hf(ref, tmp_path / kind), device="cpu", dtype=torch.float32, progress=False,
                      quantization=method)
    names = dict(ours.model.named_modules())
    quantized = [n for n, m in names.items() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == ref.config.num_hidden_layers * (7 if kind != "qwen3_moe" else 4)
    assert all((names[n].weight_zero_point is not None) == (method == "int4_asym") for n in quantized)
    with torch.no_grad():
        for n in quantized:
            ref.get_submodule(n).weight.copy_(names[n].dequantized_weight())
    _check_logits(ours, ref)


@pytest.fixture
def cpu_reference_forward(monkeypatch):
    """The CPU forward of quantized layers in float32 (dequantize per call): exactly the float32 model with the
    dequantized weights, so a checkpoint format is checked at the float32 parity tolerance (the CPU kernels,
    in bfloat16, are checked against it below)."""
    monkeypatch.setattr(QuantizedLinear, "cpu_kernels", False)


def test_quantized_lm_head_is_the_model_with_its_dequantized_head(tmp_path, cpu_reference_forward):
    """quantize_lm_head on a tied model: the LM head gets its own int8 copy, the input embedding keeps the float
    table; HF transformers with every projection and the (untied) LM head replaced by our dequantized weights
    is the reference, unfused and fused (the fused forward's CPU layout leaves the quantized head alone)."""
    from infer.errors import ModelLoadError
    from tests.hf_reference import save_hf

    ref = tiny_hf_model("qwen3")
    path = save_hf(ref, tmp_path / "qwen3")
    ours = load_model(path, device="cpu", dtype=torch.float32, progress=False, quantization="int8",
                      quantize_lm_head=True)
    head = ours.model.lm_head
    assert isinstance(head, QuantizedLinear) and head.qweight.shape == (ref.config.vocab_size, ref.config.hidden_size)
    assert torch.equal(ours.model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    with torch.no_grad():
        for n, m in ours.model.named_modules():
            if isinstance(m, QuantizedLinear) and n != "lm_head":
                ref.get_submodule(n).weight.copy_(m.dequantized_weight())
        ref.lm_head.weight = nn.Parameter(head.dequantized_weight())  # untied: the embedding keeps its table
    _check_logits(ours, ref)
    with pytest.raises(ModelLoadError, match="needs a quantization"):
        load_model(path, device="cpu", dtype=torch.float32, progress=False, quantize_lm_head=True)


def _check_logits(ours, ref, fused: bool = True):
    prompts = _prompts(ref.config.vocab_size, [1, 9, 40])
    for seq, logits in zip(prompts, infer_logits(ours.model, prompts)):
        assert_parity(logits, hf_logits(ref, seq))
    if fused:
        from infer.kernels import fused_reference

        ours.model.set_fused_ops(fused_reference, max_positions=64)
        for seq, logits in zip(prompts, infer_logits(ours.model, prompts)):
            assert_parity(logits, hf_logits(ref, seq))


# ---------------------------------------------------------------------------- W8A8: fp8 activations


def test_per_token_fp8_quantization_by_hand():
    """Each row's scale is max|x| / 448 (1 for a row of zeros): the largest value becomes +-448 exactly, the others
    round to the nearest e4m3 value (13.44 -> 13 in steps of 1, 6.72 -> 6.5 in steps of 0.5, -3.36 -> -3.25)."""
    x = torch.tensor([[448.0, -224.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 100.0]])
    q, s = qref.quantize_per_token_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 1)
    assert s.flatten().tolist() == [1.0, 1.0, pytest.approx(100 / 448)]
    assert q.float().tolist() == [[448.0, -224.0, 1.0, 0.0], [0.0] * 4, [13.0, 6.5, -3.25, 448.0]]


def test_w8a8_reference_by_hand():
    """(q_x s_x) @ (q_w s_w)^T: x's row scale is 1 (its max is 448); weight rows with scales 0.5 and 2."""
    x = torch.tensor([[448.0, -224.0, 1.0, 0.0]])
    qw = torch.tensor([[1.0, 2.0, 4.0, 8.0], [0.5, 0.0, -1.0, 448.0]]).to(torch.float8_e4m3fn)
    sw = torch.tensor([[0.5], [2.0]])
    y = qref.w8a8_linear_reference(x, qw, sw, bias=torch.tensor([0.0, 1.0]))
    assert y.tolist() == [[(448 - 448 + 4) * 0.5, (224 - 1) * 2.0 + 1.0]]
    with pytest.raises(ValueError):  # block scales: W8A8 needs one per row
        qref.w8a8_linear_reference(x, qw, torch.ones(2, 2))


def _per_token_fake_quant(module, args):
    """A forward pre-hook: the layer's input quantized to e4m3 per token (scale max|x| / 448) and back."""
    x = args[0]
    s = (x.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-30)
    return ((x / s).to(torch.float8_e4m3fn).float() * s,)


def test_fp8_w8a8_is_the_model_with_quantized_activations(tmp_path):
    """quantization='fp8_w8a8' on the CPU, unfused and fused (merged QKV and gate/up keep their fp8 activations):
    HF transformers with each projection's weight replaced by our dequantized fp8 one and its input quantized per
    token to e4m3 and back (a forward pre-hook written here) is the reference. The activations' quantization is
    real: the model differs from weight-only fp8."""
    from tests.hf_reference import save_hf

    ref = tiny_hf_model("qwen3")
    path = save_hf(ref, tmp_path / "qwen3")
    ours = load_model(path, device="cpu", dtype=torch.float32, progress=False, quantization="fp8_w8a8")
    names = dict(ours.model.named_modules())
    quantized = [n for n, m in names.items() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 7 * ref.config.num_hidden_layers and all(names[n].fp8_activations for n in quantized)

    with torch.no_grad():
        for n in quantized:
            ref.get_submodule(n).weight.copy_(names[n].dequantized_weight())
            ref.get_submodule(n).register_forward_pre_hook(_per_token_fake_quant)
    _check_logits(ours, ref)
    merged = [m for m in ours.model.modules() if isinstance(m, QuantizedLinear) and m.out_features > 64]
    assert merged and all(m.fp8_activations for m in merged)  # the fused forward's merged projections
    weight_only = load_model(path, device="cpu", dtype=torch.float32, progress=False, quantization="fp8")
    seq = _prompts(ref.config.vocab_size, [40])[0]
    a, b = infer_logits(ours.model, [seq])[0], infer_logits(weight_only.model, [seq])[0]
    assert (a - b).abs().max() > 1e-3


def test_hf_block_fp8_checkpoint_loads_as_stored(tmp_path, cpu_reference_forward):
    """Written in the layout of the Qwen3-FP8 releases (fp8 ``weight``, ``weight_scale_inv`` per 128 x 128
    block); transformers' own reader, dequantizing, is the reference. k and v have 64 rows: half a block."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = _tiny_qwen3()
    state = {}
    for name, w in model.state_dict().items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            n, k, b = *w.shape, 128
            rows, cols = -(-n // b), -(-k // b)
            amax = torch.nn.functional.pad(w.abs(), (0, cols * b - k, 0, rows * b - n)).view(rows, b, cols, b).amax((1, 3))
            scale = amax / 448.0
            full = scale.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
            state[name] = (w / full).to(torch.float8_e4m3fn)
            state[name.removesuffix("weight") + "weight_scale_inv"] = scale
        elif name != "lm_head.weight":  # tied
            state[name] = w.contiguous()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                        "activation_scheme": "dynamic"}
    model.config.save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                               quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    ours = _check_against(tmp_path, ref, "fp8")
    assert ours.model.model.layers[0].mlp.down_proj.weight_scale.shape == (1, 2)
    with pytest.raises(Exception, match="already quantized"):
        load_model(tmp_path, device="cpu", dtype=torch.float32, progress=False, quantization="int8")


@pytest.mark.parametrize("preset, fmt, method", [("W4A16", "pack-quantized", "int4"), ("W8A16", None, "int8"),
                                                 ("FP8_DYNAMIC", None, "fp8"), ("W4A16_ASYM", "pack-quantized", "int4")])
def test_compressed_tensors_checkpoint_loads_as_stored(preset, fmt, method, tmp_path, cpu_reference_forward):
    """Quantized and saved by the ``compressed-tensors`` library (llmcompressor's format). Scales as its own
    observers would set them (min/max per group or channel); the reference: the float model with each
    weight replaced by the library's fake-quantized value. FP8_DYNAMIC's activations are dynamic per token: it
    loads as W8A8 (``fp8_activations``), and the reference quantizes each projection's input per token too."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    model = _tiny_qwen3()
    ref = copy.deepcopy(model)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    ref_modules = dict(ref.named_modules())
    for name, module in model.named_modules():
        if not hasattr(module, "weight_scale"):
            continue
        args, w = module.quantization_scheme.weights, module.weight.data
        if args.strategy == "group":
            v = w.view(w.shape[0], -1, args.group_size)
            lo, hi = v.amin(-1), v.amax(-1)
        else:  # channel
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))
        ref_modules[name].weight.data.copy_(fake_quantize(w, module.weight_scale, module.weight_zero_point, args))
        if preset == "FP8_DYNAMIC":
            ref_modules[name].register_forward_pre_hook(_per_token_fake_quant)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(tmp_path)
    compressor.update_config(str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "compressed-tensors"
    ours = _check_against(tmp_path, ref.eval(), method, fused=preset.startswith("W4A16"))
    assert (ours.model.model.layers[0].mlp.down_proj.weight_zero_point is not None) == preset.endswith("ASYM")
    assert ours.model.model.layers[0].mlp.down_proj.fp8_activations == (preset == "FP8_DYNAMIC")


def _packed_checkpoint(path, pack, quantization_config: dict) -> nn.Module:
    """The tiny Qwen3 saved to ``path`` with each decoder projection's weight replaced by ``pack(w)``'s tensors
    (``pack``: float ``[N, K]`` -> ``({leaf name: tensor}, the dequantized weight)``) and ``quantization_config``
    in its config; returns the float reference: the same model holding the dequantized weights."""
    from safetensors.torch import save_file

    model = _tiny_qwen3()
    ref = copy.deepcopy(model)
    state, ref_modules = {}, dict(ref.named_modules())
    for name, w in model.state_dict().items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            prefix = name.removesuffix(".weight")
            tensors, deq = pack(w.float())
            state.update({f"{prefix}.{leaf}": t for leaf, t in tensors.items()})
            ref_modules[prefix].weight.data.copy_(deq)
        elif name != "lm_head.weight":  # tied
            state[name] = w.contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = quantization_config
    model.config.save_pretrained(path)
    return ref.eval()


def _autogptq_pack(w: torch.Tensor, group: int, zero_stored: int, sym: bool = True):
    """A projection quantized and packed the way AutoGPTQ's ``QuantLinear.pack`` writes it (its loops,
    ported: the packers of AutoGPTQ and GPTQModel need CUDA builds that do not install here). Per group of
    ``group`` inputs, symmetric: ``scale = 2 max|w| / 15``, zero point 8; asymmetric (``sym=False``): ``scale =
    (max - min) / 15`` over the range widened to 0, zero point ``round(-min / scale)``; ``q = round(w / scale) +
    zero`` in [0, 15]. The zero point is stored as ``zero - 8 + zero_stored`` (format gptq: ``zero_stored`` 7,
    i.e. minus one; gptq_v2: 8). Returns ``(qweight [K/8, N], qzeros [K/G, N/8], scales fp16 [K/G, N], g_idx
    [K], the dequantized weight [N, K])``."""
    import numpy as np

    n, k = w.shape
    v = w.view(n, k // group, group)
    if sym:
        scales = (2 * v.abs().amax(-1).clamp_min(1e-8) / 15).t().contiguous().half()  # [G, N], stored in float16
        zero = torch.full((k // group, n), 8.0)
    else:
        lo, hi = v.amin(-1).clamp_max(0), v.amax(-1).clamp_min(0)
        scales = ((hi - lo).clamp_min(1e-8) / 15).t().contiguous().half()
        zero = torch.round(-lo.t() / scales.float()).clamp(0, 15)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    s = scales.float()[g_idx.long()].t()  # [N, K]
    zk = zero[g_idx.long()].t()  # [N, K]
    intweight = torch.clamp(torch.round(w / s) + zk, 0, 15).to(torch.int64)
    deq = s * (intweight - zk)
    iw = intweight.t().contiguous().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((k // 8, n), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= iw[j] << (4 * (j - i))
        i += 8
        row += 1
    zeros = ((zero.long() - 8 + zero_stored) % 16).numpy().astype(np.uint32)
    qzeros = np.zeros((k // group, n // 8), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= zeros[:, j] << (4 * (j - i))
        i += 8
        col += 1
    return (torch.from_numpy(qweight.astype(np.int32)), torch.from_numpy(qzeros.astype(np.int32)), scales, g_idx,
            deq)


@pytest.mark.parametrize("checkpoint_format, zero_stored, sym", [("gptq", 7, True), ("gptq_v2", 8, True),
                                                                  ("gptq", 7, False), ("gptq_v2", 8, False)])
def test_gptq_checkpoint_loads_as_stored(checkpoint_format, zero_stored, sym, tmp_path, cpu_reference_forward):
    """A 4-bit GPTQ checkpoint (AutoGPTQ's tensors and config, groups of 32 inputs), symmetric or not, loads
    as infer's int4 without a round trip through floats; the reference is the float model with each weight
    replaced by its dequantized GPTQ value. AutoGPTQ's original format stores the zero point minus one
    (modulo 16), ``gptq_v2`` stores it as is."""
    def pack(w):
        w = w + (0.02 if not sym else 0.0)  # shifted off zero: zero points away from 8
        qweight, qzeros, scales, g_idx, deq = _autogptq_pack(w, 32, zero_stored, sym)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}, deq

    ref = _packed_checkpoint(tmp_path, pack, {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                              "sym": sym, "checkpoint_format": checkpoint_format})
    ours = _check_against(tmp_path, ref, "int4")
    down = ours.model.model.layers[0].mlp.down_proj
    assert down.weight_scale.shape == (down.out_features, down.in_features // 32)
    assert (down.weight_zero_point is None) == sym
    if not sym:
        assert bool(down.weight_zero_point.ne(0).any())


def _autoawq_pack(w: torch.Tensor, group: int):
    """A projection quantized and packed the way AutoAWQ's ``WQLinear_GEMM.from_linear`` writes it (its
    loops, ported; ``version: "gemm"``): per group, ``scale = (max - min) / 15``, zero point ``round(-min /
    scale)`` (AutoAWQ's zero-point quantizer, ``q = round(w / scale) + zero`` in [0, 15]); ``qweight [K, N/8]``
    and ``qzeros [K/G, N/8]`` packed along N in the order ``[0, 2, 4, 6, 1, 3, 5, 7]``, ``scales`` fp16
    ``[K/G, N]``. Returns ``(qweight, qzeros, scales, the dequantized weight [N, K])``."""
    import numpy as np

    n, k = w.shape
    v = w.view(n, k // group, group)
    lo, hi = v.amin(-1), v.amax(-1)
    scales = ((hi - lo).clamp_min(1e-5) / 15).half()  # [N, G]
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)  # [N, G]
    s, z = scales.float().repeat_interleave(group, 1), zeros.repeat_interleave(group, 1)  # [N, K]
    intweight = torch.clamp(torch.round(w / s) + z, 0, 15)
    deq = (intweight - z) * s
    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack(t):  # [R, C] unsigned -> [R, C / 8] int32, AWQ's order along C
        t = t.numpy().astype(np.uint32)
        out = np.zeros((t.shape[0], t.shape[1] // 8), dtype=np.uint32)
        for col in range(out.shape[1]):
            for i in range(8):
                out[:, col] |= t[:, col * 8 + order[i]] << (4 * i)
        return torch.from_numpy(out.astype(np.int32))

    return pack(intweight.t().contiguous()), pack(zeros.t().contiguous()), scales.t().contiguous(), deq


def test_awq_checkpoint_loads_as_stored(tmp_path, cpu_reference_forward):
    """A 4-bit AWQ checkpoint (AutoAWQ's GEMM tensors and config, groups of 32) loads as infer's asymmetric
    int4 (repacked once along K); the reference is the float model with each weight replaced by its
    dequantized AWQ value."""
    def pack(w):
        qweight, qzeros, scales, deq = _autoawq_pack(w, 32)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales}, deq

    ref = _packed_checkpoint(tmp_path, pack, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                              "version": "gemm"})
    ours = _check_against(tmp_path, ref, "int4")
    down = ours.model.model.layers[0].mlp.down_proj
    assert down.weight_zero_point.shape == down.weight_scale.shape == (down.out_features, down.in_features // 32)


def test_gptq_and_awq_checkpoints_infer_cannot_serve_are_rejected(tmp_path):
    """Act-order groups (a permuted ``g_idx``) and, under ``sym: true``, zero points other than 8 are refused
    with the reason, tensor by tensor; 8-bit GPTQ and AWQ, and AWQ's GEMV packing, at once."""
    from infer.errors import ModelLoadError
    from infer.loader.quantized import QuantizedParams, scheme_from_hf_config
    from infer.models.quant import quantize_modules

    for q, match in [({"quant_method": "gptq", "bits": 8, "sym": True}, "4-bit only"),
                     ({"quant_method": "awq", "bits": 8}, "4-bit only"),
                     ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'")]:
        with pytest.raises(ModelLoadError, match=match):
            scheme_from_hf_config({"quantization_config": q}, tmp_path)
    scheme = scheme_from_hf_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                            "sym": True}}, tmp_path)
    layer = torch.nn.Module()
    layer.q_proj = torch.nn.Linear(64, 16, bias=False)
    quantize_modules(layer, scheme)
    params = QuantizedParams(layer, scheme, torch.device("cpu"), torch.float32, tmp_path)
    _, qzeros, _, g_idx, _ = _autogptq_pack(torch.randn(16, 64), 32, 7)
    assert params.take("q_proj.qzeros", qzeros) and params.take("q_proj.g_idx", g_idx)
    with pytest.raises(ModelLoadError, match="act-order"):
        params.take("q_proj.g_idx", g_idx.flip(0))
    with pytest.raises(ModelLoadError, match="zero points"):
        params.take("q_proj.qzeros", _autogptq_pack(torch.randn(16, 64), 32, 5)[1])
    assert scheme.symmetric
    asym = scheme_from_hf_config({"quantization_config": {"quant_method": "gptq", "bits": 4, "sym": False}}, tmp_path)
    assert (asym.method, asym.symmetric) == ("int4", False)


def test_unsupported_quantization_configs_are_rejected(tmp_path):
    from infer.errors import ModelLoadError
    from infer.loader.quantized import scheme_from_hf_config

    for q, match in [({"quant_method": "exl2"}, "not supported"), ({"quant_method": "fp8"}, "weight_block_size"),
                     ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
                         "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": False,
                                                                  "strategy": "channel"}}}},
                      "asymmetric")]:
        with pytest.raises(ModelLoadError, match=match):
            scheme_from_hf_config({"quantization_config": q}, tmp_path)
    assert scheme_from_hf_config({}, tmp_path) is None
    assert QuantScheme.online("int4").block_for(256) == (1, 128)
    assert QuantScheme.online("int8").block_for(256) == (1, 256)


# ---------------------------------------------------------------------------- the benchmark


def test_benchmark_runs_at_tiny_size(tiny_llama, tmp_path):
    """benchmarks/quantization.py: its kernel and quality parts on the tiny checkpoint (what it counts and
    writes, not how fast anything is)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import quantization as bench

    path = str(tiny_llama.path)
    assert bench.main(["--device", "cpu", "--model", path, "--quality-model", path, "--parts", "kernels", "quality",
                       "--batch-sizes", "1", "--repeats", "1", "--quality-tokens", "48", "--window", "16",
                       "--methods", "none", "int8", "int4", "int4_asym", "--kv-cache-dtypes", "fp8", "fp8-calibrated",
                       "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "quantization.json").read_text())
    assert {(r["projection"], r["method"]) for r in rep["kernels"]} == {
        (p, m) for p in ("qkv", "o", "gate_up", "down") for m in ("none", "int8", "int4", "int4_asym")}
    none, *rest = rep["quality"]
    assert none["method"] == "none" and none["top1_agreement"] == 1.0 and none["tokens"] == 47
    assert all(0 < r["perplexity"] < float("inf") and 0 <= r["top1_agreement"] <= 1 for r in rest)
    kv1, kvc = rest[-2:]  # the FP8 KV cache rows: scales 1.0, then calibrated on the first window
    assert kv1["method"] == bench.KV_LABELS["fp8"] and kv1["k_scale_range"] == [1.0, 1.0]
    assert kvc["method"] == bench.KV_LABELS["fp8-calibrated"] and kvc["k_scale_range"] != [1.0, 1.0]
    assert (tmp_path / "quantization.png").is_file() and (tmp_path / "quantization.md").is_file()
