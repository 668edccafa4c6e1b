"""Phase 11: a GGUF's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K projections served as stored (``gguf_weights``).

* The repacking (:mod:`infer.loader.gguf_quant`): each type's blocks (written by gguf-py's ``quantize`` where it
  has one, random bytes with finite scales otherwise), repacked and dequantized by infer's reference, are
  gguf-py's ``dequantize`` of the same bytes: bit for bit for Q8_0, Q4_0 and Q6_K, within a few float32 ulp of
  the block's range for the float zero points of Q4_1 and Q4_K; zero scales (a constant block) included; one
  Q4_1 block by hand.
* The Triton kernels (interpreter on the CPU) on the repacked tensors, float zero points included, against
  ``F.linear`` on gguf-py's dequantized weights: the GEMV (1 row) and the ``tl.dot`` GEMM (20 rows).
* A tiny two-layer Llama GGUF written with ``gguf.GGUFWriter``, one type per projection (a layer whose q/k/v
  and gate/up mix types, one projection in Q5_0): loaded quantized, the modules are ``QuantizedLinear`` of the
  expected layouts and the logits are the dequantized model's (the float32 reference forward, unfused and fused:
  the fused forward's merged projections of mixed types are ``ConcatLinear``), and within bfloat16's bound on
  the CPU kernels; the LM head from its own Q8_0 blocks; the flag's resolution and its rejected combinations.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from infer.config import EngineConfig
from infer.errors import ModelLoadError
from infer.kernels import quant_reference as qref
from infer.kernels.triton_common import INTERPRET
from infer.loader import load_model
from infer.loader.gguf_quant import SERVED_TYPES, repack
from infer.models.quant import ConcatLinear, QuantizedLinear
from tests.hf_reference import infer_logits
from tests.test_loader_errors import FFN, HIDDEN, TOKENS, llama_meta, write_gguf

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8)


def gguf_blocks(qtype: str, n: int, k: int, seed: int, scale: float = 1.0) -> np.ndarray:
    """A ``[n, k]`` tensor's GGUF bytes (uint8 ``[n, row bytes]``). Q8_0, Q4_0, Q4_1: gguf-py's ``quantize`` of
    random weights of std ``scale``, whose first block is a constant (Q4_1: ``d = 0``, the minimum alone) and
    second zero. Q4_K, Q6_K (no quantizer in gguf-py): random bytes with float16 ``d`` (and ``dmin``) of about
    ``scale / 100``; Q4_K's first sub-block has scale 0 (its values are ``-dmin m`` alone)."""
    rng = np.random.default_rng(seed)
    if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0"):
        w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
        w[0, :32], w[0, 32:64] = 0.75 * scale, 0.0
        return gguf.quants.quantize(w, T[qtype])
    block, nbytes = gguf.GGML_QUANT_SIZES[T[qtype]]
    b = rng.integers(0, 256, (n, k // block, nbytes), dtype=np.uint8)
    d = rng.standard_normal((n, k // block, 1)) * scale / 100
    if qtype == "Q4_K":
        b[..., 0:2], b[..., 2:4] = _f16_bytes(d), _f16_bytes(d * 0.7)
        b[0, 0, 4] &= 0xC0  # sub-block 0 of the first block: scale 0 (the top bits belong to sub-block 4)
    else:
        b[..., 208:210] = _f16_bytes(d / 10)
    return b.reshape(n, -1)


def _dequantized(parts: dict, qtype: str) -> torch.Tensor:
    s = SERVED_TYPES[qtype]
    return qref.dequantize(parts["qweight"], parts["weight_scale"], s.method, s.block, torch.float32,
                           parts.get("weight_zero_point"))


# ---------------------------------------------------------------------------- the repacking


@pytest.mark.parametrize("qtype", list(SERVED_TYPES))
def test_repacked_blocks_dequantize_to_gguf_values(qtype):
    n, k = 6, 512
    data = gguf_blocks(qtype, n, k, seed=len(qtype) + ord(qtype[1]))
    want = torch.from_numpy(gguf.quants.dequantize(data, T[qtype]))
    parts = repack(data, qtype)
    s = SERVED_TYPES[qtype]
    assert parts["qweight"].dtype == qref.QDTYPES[s.method]
    assert parts["qweight"].shape == qref.qweight_shape(s.method, n, k)
    assert parts["weight_scale"].shape == (n, k // s.block[1])
    got = _dequantized(parts, qtype)
    if s.symmetric:  # one product, rounded once, on both sides
        assert "weight_zero_point" not in parts
        assert torch.equal(got, want)
        return
    z = parts["weight_zero_point"]
    assert z.dtype == torch.float32 and z.shape == parts["weight_scale"].shape
    # d u + m against (q - z) d: within a few ulp of the group's range |m| + 15 |d| (|s| (|z| + 8) >= |m|)
    rng = qref.expand_scale(parts["weight_scale"].abs() * (z.abs() + 8 + 15), (n, k), s.block)
    assert bool(((got - want).abs() <= rng * 2.0**-22).all()), ((got - want).abs() / rng).max() * 2**24
    if qtype == "Q4_1":  # the constant first block (d == 0): codes 0, zero point -1, scale m: m exactly
        assert float(parts["weight_scale"][0, 0]) == float(want[0, 0]) != 0
        assert torch.equal(got[0, :32], want[0, :32]) and float(z[0, 0]) == -1.0


def test_one_q4_1_block_by_hand():
    """d = 0.5, m = -1, codes 0..15 then 15..0: values 0.5 u - 1. Value i < 16 sits in the low nibble of byte
    i, value 16 + i in its high nibble; infer stores q = u - 8 with zero point -m / d - 8 = -6."""
    u = np.array(list(range(16)) + list(range(15, -1, -1)), np.uint8)
    block = np.concatenate([_f16_bytes(np.array([0.5])), _f16_bytes(np.array([-1.0])), u[:16] | (u[16:] << 4)])
    data = block.reshape(1, 20)
    want = 0.5 * u.astype(np.float32) - 1.0
    assert np.array_equal(gguf.quants.dequantize(data, T.Q4_1).reshape(-1), want)
    parts = repack(data, "Q4_1")
    assert qref.unpack_int4(parts["qweight"]).tolist() == [(u.astype(np.int64) - 8).tolist()]
    assert parts["weight_scale"].tolist() == [[0.5]] and parts["weight_zero_point"].tolist() == [[-6.0]]
    assert torch.equal(_dequantized(parts, "Q4_1"), torch.from_numpy(want).view(1, 32))


def test_unserved_types_are_refused():
    with pytest.raises(ValueError, match="no quantized layout"):
        repack(gguf_blocks("Q5_0", 2, 64, 0), "Q5_0")
    with pytest.raises(ValueError, match="whole 34-byte blocks"):
        repack(np.zeros((2, 35), np.uint8), "Q8_0")


# ---------------------------------------------------------------------------- the Triton kernels


@pytest.mark.skipif(not INTERPRET, reason="CPU tensors through Triton kernels need TRITON_INTERPRET=1")
@pytest.mark.parametrize("qtype, m", [("Q4_K", 1), ("Q4_K", 20), ("Q6_K", 1), ("Q6_K", 20), ("Q4_1", 1)])
def test_triton_kernels_on_repacked_weights_match_gguf_dequantized(qtype, m):
    """The GEMV (1 row) and tl.dot GEMM (20 rows) read the codes, subtract the float zero points (Q4_1, Q4_K)
    and multiply the group-32 / group-16 scales in registers: ``F.linear`` on gguf-py's weights, float64."""
    from infer.kernels.quant_triton import quantized_linear_triton

    n, k = 16, 256
    data = gguf_blocks(qtype, n, k, seed=m)
    w = torch.from_numpy(gguf.quants.dequantize(data, T[qtype])).double()
    parts = repack(data, qtype)
    s = SERVED_TYPES[qtype]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    ours = quantized_linear_triton(x, parts["qweight"], parts["weight_scale"], s.method, s.block,
                                   zero_point=parts.get("weight_zero_point"))
    want = F.linear(x.double(), w)
    torch.testing.assert_close(ours.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


# ---------------------------------------------------------------------------- a GGUF model, end to end

#: one GGUF type per projection of each layer: layer 0 mixes Q4_K and Q6_K in q/k/v, layer 1 has a Q5_0 (float)
#: k among quantized q and v, and every served type appears
LAYER_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q8_0", "ffn_gate": "Q4_1",
     "ffn_up": "Q4_1", "ffn_down": "Q6_K"},
    {"attn_q": "Q4_0", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
     "ffn_up": "Q8_0", "ffn_down": "Q4_0"},
]
HEAD_DIM = 64
SHAPES = {"attn_q": (4 * HEAD_DIM, HIDDEN), "attn_k": (2 * HEAD_DIM, HIDDEN), "attn_v": (2 * HEAD_DIM, HIDDEN),
          "attn_output": (HIDDEN, 4 * HEAD_DIM), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
          "ffn_down": (HIDDEN, FFN)}
PROJ = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj"}


def write_tiny_gguf(folder):
    """A two-layer Llama GGUF (hidden 256, 4 heads of 64, 2 KV heads) with the projections of
    :data:`LAYER_TYPES`, a Q8_0 embedding (tied LM head) and float32 norms, written to ``folder / "tiny.gguf"``."""
    tensors = [("token_embd.weight", gguf_blocks("Q8_0", len(TOKENS), HIDDEN, 99, 0.5), T.Q8_0),
               ("output_norm.weight", np.ones(HIDDEN, np.float32), None)]
    for i, types in enumerate(LAYER_TYPES):
        for part, qtype in types.items():
            tensors.append((f"blk.{i}.{part}.weight", gguf_blocks(qtype, *SHAPES[part], seed=10 * i + len(part),
                                                                  scale=0.05), T[qtype]))
        rng = np.random.default_rng(i)
        for norm in ("attn_norm", "ffn_norm"):
            tensors.append((f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
                            None))
    return write_gguf(folder / "tiny.gguf", "llama", llama_meta(block_count=len(LAYER_TYPES)), tensors)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """:func:`write_tiny_gguf`, the tokenizer cache in a temporary directory."""
    folder = tmp_path_factory.mktemp("gguf_quantized")
    mp = pytest.MonkeyPatch()
    mp.setenv("INFER_CACHE_DIR", str(folder / "cache"))
    yield write_tiny_gguf(folder)
    mp.undo()


def _load(path, mode: str, **kw):
    return load_model(path, device="cpu", dtype=torch.float32, progress=False, gguf_weights=mode, **kw)


PROMPTS = [[0, 1, 2, 3, 4, 5, 6, 5, 4, 3, 2, 1], [6, 3]]


def _logits(loaded, fused: bool = False) -> torch.Tensor:
    if fused:
        from infer.kernels import fused_reference

        loaded.model.set_fused_ops(fused_reference, max_positions=64)
    return torch.cat(infer_logits(loaded.model, PROMPTS))


def test_tiny_gguf_loads_quantized_and_computes_the_dequantized_model(tiny_gguf, monkeypatch, caplog):
    """Served quantized (the float32 reference forward: exactly the float model with the repacked weights
    dequantized, so the only difference is the float zero points' few ulp), unfused and fused; the modules are
    the expected layouts, the Q5_0 projection stays float, and the load log counts both."""
    monkeypatch.setattr(QuantizedLinear, "cpu_kernels", False)
    ref = _load(tiny_gguf, "dequantize")
    assert not any(isinstance(m, QuantizedLinear) for m in ref.model.modules())
    want = _logits(ref)
    with caplog.at_level("INFO", logger="infer"):
        ours = _load(tiny_gguf, "quantized")
    served, _, dequantized = caplog.text.partition("dequantized to float: ")
    assert "4 Q4_K (int4 groups of 32 with float zero points)" in served and "2 Q6_K (int8 groups of 16)" in served
    assert "1 Q5_0" in dequantized and "1 Q8_0" in dequantized  # the k projection, and the embedding table
    for i, types in enumerate(LAYER_TYPES):
        layer = ours.model.model.layers[i]
        for part, qtype in types.items():
            mod = layer.get_submodule(PROJ[part])
            if qtype not in SERVED_TYPES:
                assert type(mod) is nn.Linear
                continue
            s = SERVED_TYPES[qtype]
            assert isinstance(mod, QuantizedLinear), (i, part)
            assert (mod.method, mod.block) == (s.method, s.block), (i, part)
            zp = mod.weight_zero_point
            assert (zp.dtype if zp is not None else None) == (None if s.symmetric else torch.float32)
    assert type(ours.model.lm_head) is nn.Linear  # no quantize_lm_head: the float table
    scale = float(want.abs().max())
    torch.testing.assert_close(_logits(ours), want, rtol=0, atol=1e-5 * scale)
    fused = _logits(ours, fused=True)
    qkv0, qkv1 = (layer.self_attn.qkv_proj for layer in ours.model.model.layers)
    assert isinstance(qkv0, ConcatLinear) and [type(p) for p in qkv0.parts] == [QuantizedLinear, QuantizedLinear]
    assert qkv0.parts[0].out_features == 6 * HEAD_DIM  # q and k (both Q4_K) merged into one
    assert [type(p) for p in qkv1.parts] == [QuantizedLinear, nn.Linear, QuantizedLinear]
    assert isinstance(ours.model.model.layers[0].mlp.gate_up_proj, QuantizedLinear)  # Q4_1 and Q4_1: one tensor
    torch.testing.assert_close(fused, want, rtol=0, atol=1e-5 * scale)


def test_tiny_gguf_on_the_cpu_kernels_and_a_quantized_lm_head(tiny_gguf, monkeypatch):
    """The CPU forward as served (torch's int4 kernel for Q4_0, and for Q4_1 / Q4_K with their float zero points;
    a bfloat16 copy for the int8 groups of Q8_0 / Q6_K): within bfloat16's rounding of the float32 model, 2^-7 of the logits' range per layer
    (quant_cpu.error_bound's relative term). quantize_lm_head: the LM head from its Q8_0 blocks, the input
    embedding keeps the float table; Q8_0 dequantizes exactly, so the float32 reference forward matches tightly."""
    ref = _load(tiny_gguf, "dequantize")
    want = _logits(ref)
    scale = float(want.abs().max())
    cpu = _load(tiny_gguf, "quantized")
    assert cpu.model.model.layers[1].self_attn.q_proj.cpu_packed().kind == "int4"  # Q4_0: the int4 kernel
    assert cpu.model.model.layers[1].self_attn.o_proj.cpu_packed().kind == "int4"  # Q4_K: float zero points too
    got = _logits(cpu)
    assert float((got - want).abs().max()) <= 2.0**-7 * len(LAYER_TYPES) * scale
    head = _load(tiny_gguf, "quantized", quantize_lm_head=True)
    lm = head.model.lm_head
    assert isinstance(lm, QuantizedLinear) and (lm.method, lm.block) == ("int8", (1, 32))
    assert torch.equal(lm.dequantized_weight(), ref.model.lm_head.weight)
    assert torch.equal(head.model.model.embed_tokens.weight, ref.model.model.embed_tokens.weight)
    monkeypatch.setattr(QuantizedLinear, "cpu_kernels", False)
    torch.testing.assert_close(_logits(head), want, rtol=0, atol=1e-5 * scale)


def test_gguf_weights_resolution_and_rejected_combinations(tiny_gguf):
    """dequantize is the default; online quantization of a GGUF still works through the float weights;
    quantized beside it, with parallelism or LoRA, or unknown, is refused."""
    assert EngineConfig(device="cpu").validate().gguf_weights == "dequantize"
    assert EngineConfig(device="cpu", gguf_weights="quantized").validate().gguf_weights == "quantized"
    plain = _load(tiny_gguf, "dequantize")
    assert not any(isinstance(m, QuantizedLinear) for m in plain.model.modules())
    online = _load(tiny_gguf, "dequantize", quantization="int4")
    q = online.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.block == (1, 128) and q.weight_zero_point is None
    with pytest.raises(ModelLoadError, match="quantize its dequantized weights again"):
        _load(tiny_gguf, "quantized", quantization="int8")
    with pytest.raises(ValueError, match="gguf_weights must be one of"):
        _load(tiny_gguf, "float")
    for kw, match in [({"quantization": "int8"}, "again"), ({"tensor_parallel_size": 2}, "parallelism"),
                      ({"enable_lora": True}, "enable_lora"), ({"gguf_weights": "float"}, "must be one of")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(device="cpu", **{"gguf_weights": "quantized", **kw}).validate()


def test_the_cli_flag_parses_to_the_field():
    import argparse

    from infer.config import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--gguf-weights", "quantized"])).gguf_weights == "quantized"
    assert engine_config_from_args(parser.parse_args([])).gguf_weights == "dequantize"
    with pytest.raises(SystemExit):
        parser.parse_args(["--gguf-weights", "int4"])
