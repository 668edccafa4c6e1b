"""Phase 8 fused operations: Triton kernels vs their plain-PyTorch references vs the unfused layers code.

* Kernel vs reference (:mod:`infer.kernels.fused_triton` vs :mod:`infer.kernels.fused_reference`), on
  fresh random inputs: on the CPU under the Triton interpreter at tiny, odd shapes (row widths 33,
  40, 100, head_dim 24 and 40, T = 1 and T > 1, strided rows), on the GPU at the same shapes; float32,
  float16 and bfloat16. Outputs and untouched regions are poisoned with NaN first.
* Reference vs the unfused code of :mod:`infer.models.layers` (rms_norm, ``h + x``, the per-head
  RMSNorm, rope_cos_sin + apply_rope, ACTIVATIONS): bit-identical in float32 (and in 16-bit dtypes
  wherever the reference keeps the same rounding steps); the one documented difference, RoPE rounded
  once, is bounded against Hugging Face's bf16 sequence and shown closer to a float64 truth.
* No recompilation when T changes (the specialization key of every launch is recorded; on a GPU, the
  compiled-kernel caches are counted), and CUDA-graph capture/replay (GPU).
* ``gpu`` tests (skipped without CUDA) at real shapes: Qwen3-4B (hidden 2560, 32/8 heads, head_dim 128,
  intermediate 9728) and Gemma 3 (head_dim 256).
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import pytest
import torch

from infer.config import EngineConfig, RopeConfig
from infer.kernels import fused_ops
from infer.kernels import fused_reference as ref
from infer.kernels import fused_triton as ops
from infer.kernels.triton_common import INTERPRET, sm_count
from infer.models import layers

ROOT = Path(__file__).resolve().parent.parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# kernel vs reference. The norms and RoPE keep the reference's rounding steps, so they differ only
# where a float32 difference of an ulp or two (rsqrt, FMA contraction, exp) flips one rounding: one
# ulp of the dtype at most. act_and_mul rounds once where the reference rounds twice: ~one ulp too.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
EPS = 1e-6


def randn(g: torch.Generator, *shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def rows(g, t: int, d: int, dtype, pad: int = 0, scale: float = 1.0) -> torch.Tensor:
    """``[t, d]`` random rows; with ``pad`` > 0 a strided view (row stride d + pad, starting pad // 2 in)."""
    if not pad:
        return randn(g, t, d, dtype=dtype, scale=scale)
    return randn(g, t, d + pad, dtype=dtype, scale=scale)[:, pad // 2 : pad // 2 + d]


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(out).any(), "the kernel left NaN (an unwritten element)"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


def ulps(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> float:
    """max |a - b| in units of the dtype's ulp at ``scale`` (element-wise magnitudes)."""
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    e = torch.floor(torch.log2(scale.double().abs().clamp_min(2.0**-14)))
    return ((a.double() - b.double()).abs() / torch.exp2(e - mant)).max().item()


def inv_freq(d: int, theta: float = 10000.0) -> torch.Tensor:
    return layers.rope_inv_freq(d, RopeConfig(theta))


# ---------------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("t,d,pad", [(1, 40, 0), (5, 100, 6), (3, 33, 0)])
def test_rms_norm_matches_reference(dtype, unit_offset, t, d, pad):
    g = torch.Generator().manual_seed(d * 10 + t + unit_offset)
    x = rows(g, t, d, dtype, pad)
    w = randn(g, d, dtype=dtype, scale=0.5)
    expected = ref.rms_norm(x, w, EPS, unit_offset)
    assert expected.dtype == dtype and expected.shape == (t, d)
    assert_close(ops.rms_norm(x, w, EPS, unit_offset), expected, dtype)
    # into a strided `out` (a view of a NaN buffer: nothing else may be written)
    big = torch.full((t + 2, d + 3), float("nan"), dtype=dtype, device=DEVICE)
    out = big[1 : t + 1, 2 : d + 2]
    assert ops.rms_norm(x, w, EPS, unit_offset, out=out) is out
    assert_close(out, expected, dtype)
    big[1 : t + 1, 2 : d + 2] = 0
    assert torch.isnan(big).sum() == big.numel() - t * d
    # in place (out=x), both implementations
    for impl in (ops, ref):
        x2 = x.clone()
        impl.rms_norm(x2, w, EPS, unit_offset, out=x2)
        assert_close(x2, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_reference_is_the_unfused_function(dtype, unit_offset):
    """Bit-identical to layers.rms_norm in every dtype (same rounding steps), strided rows included."""
    g = torch.Generator().manual_seed(7 + unit_offset)
    for t, d, pad in ((1, 64, 0), (7, 100, 10), (4, 576, 0), (3, 1024, 0)):
        x = rows(g, t, d, dtype, pad)
        w = randn(g, d, dtype=dtype, scale=0.5)
        assert torch.equal(ref.rms_norm(x, w, EPS, unit_offset), layers.rms_norm(x, w, EPS, unit_offset))
        out = torch.empty(t, d, dtype=dtype, device=DEVICE)
        ref.rms_norm(x, w, EPS, unit_offset, out=out)
        assert torch.equal(out, layers.rms_norm(x, w, EPS, unit_offset))


# ---------------------------------------------------------------------------------- fused_add_rms_norm


def padded(src: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: a copy of ``src`` as rows of stride ``d + pad`` (starting ``pad // 2`` in) of
    a NaN-filled buffer. (``clone()`` of a strided view is contiguous: it would test no stride.)"""
    t, d = src.shape
    buf = torch.full((t, d + pad), float("nan"), dtype=src.dtype, device=src.device)
    view = buf[:, pad // 2 : pad // 2 + d]
    view.copy_(src)
    return view, buf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("t,d", [(1, 72), (6, 33)])
def test_fused_add_rms_norm_matches_reference(dtype, unit_offset, t, d):
    g = torch.Generator().manual_seed(100 + t * d + unit_offset)
    x0 = rows(g, t, d, dtype)
    r0 = rows(g, t, d, dtype, scale=3)
    w = randn(g, d, dtype=dtype, scale=0.5)
    # strided rows, a different stride each (d + 6 and d + 4): each row is found by its own stride
    (x1, xbuf), (r1, rbuf) = padded(x0, 6), padded(r0, 4)
    xr, rr = x0.clone(), r0.clone()
    got = ops.fused_add_rms_norm(x1, r1, w, EPS, unit_offset)
    assert got[0] is x1 and got[1] is r1  # in place: (x, residual) now hold (normed, new residual)
    exp = ref.fused_add_rms_norm(xr, rr, w, EPS, unit_offset)
    assert exp[0] is xr and exp[1] is rr
    assert torch.equal(r1, rr)  # one correctly rounded add in both
    assert_close(x1, xr, dtype)
    assert torch.isnan(xbuf).sum() == 6 * t and torch.isnan(rbuf).sum() == 4 * t  # nothing written past a row


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_fused_add_rms_norm_normalizes_the_rounded_sum(dtype, unit_offset):
    """The norm is taken of the new residual as stored (x + residual rounded to the dtype), as the unfused
    ``h = h + x; rms_norm(h)`` does, not of the float32 sum. By hand: x is +-16 everywhere, the residual
    +-3/8 of an ulp of 16 everywhere but in row element 0, so the rounded sum is +-16 in every element,
    its root mean square exactly 16 and the output exactly +-1.5 (w = 1.5; Gemma: 1 + w with w = 0.5).
    The float32 sum's root mean square is above 16, and element 0 would come out an ulp low."""
    d = 33
    sign = torch.tensor([1.0, -1.0]).repeat(d)[:d]
    frac = 0.375 * 16 * torch.finfo(dtype).eps  # 3/8 of an ulp of 16: the sum rounds back to 16
    x = (16 * sign)[None].to(dtype).to(DEVICE)
    res = (frac * sign)[None].to(dtype).to(DEVICE)
    res[0, 0] = 0
    w = torch.full((d,), 0.5 if unit_offset else 1.5, dtype=dtype, device=DEVICE)
    for impl in (ref, ops):  # the hand values are the reference's too
        out, new_res = impl.fused_add_rms_norm(x.clone(), res.clone(), w, EPS, unit_offset)
        assert torch.equal(new_res.float().cpu(), 16 * sign[None]), impl.__name__
        assert torch.equal(out.float().cpu(), 1.5 * sign[None]), impl.__name__


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_fused_add_rms_norm_reference_is_the_unfused_code(dtype, unit_offset):
    """``h = h + x; y = rms_norm(h)`` exactly, in every dtype."""
    g = torch.Generator().manual_seed(11 + unit_offset)
    for t, d in ((1, 64), (9, 100)):
        x, h = rows(g, t, d, dtype), rows(g, t, d, dtype)
        w = randn(g, d, dtype=dtype, scale=0.5)
        h_new = h + x
        normed = layers.rms_norm(h_new, w, EPS, unit_offset)
        xr, hr = ref.fused_add_rms_norm(x.clone(), h.clone(), w, EPS, unit_offset)
        assert torch.equal(hr, h_new) and torch.equal(xr, normed)


# ---------------------------------------------------------------------------------- qk_norm_rope

# (num_heads, num_kv_heads, head_dim)
QK_SHAPES = [(4, 2, 24), (3, 1, 40)]
NORMS = ["none", "llama", "gemma"]  # no QK-norm, Qwen3's (cast then * w), Gemma 3's (1 + w)


def qk_case(g, t, hq, hkv, d, dtype, norm, max_pos=50, theta=10000.0, pad=0):
    width = (hq + 2 * hkv) * d
    qkv = rows(g, t, width, dtype, pad)
    cache = ref.build_cos_sin_cache(inv_freq(d, theta), max_pos, DEVICE)
    pos = torch.randint(0, max_pos, (t,), generator=g)
    pos[0] = max_pos - 1
    if t > 2:
        pos[1] = 0
    weights = (None, None) if norm == "none" else (randn(g, d, dtype=dtype, scale=0.5), randn(g, d, dtype=dtype, scale=0.5))
    return qkv, pos.to(DEVICE), cache, weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("shape", QK_SHAPES)
@pytest.mark.parametrize("t", [1, 5])
def test_qk_norm_rope_matches_reference(dtype, norm, shape, t):
    hq, hkv, d = shape
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {norm} {shape} {t}".encode()) % 10000)  # (not hash(): varies by run)
    qkv, pos, cache, (qw, kw) = qk_case(g, t, hq, hkv, d, dtype, norm, pad=2 if t > 1 else 0)
    if t > 1:
        pos = pos.to(torch.int32)  # both index dtypes
    a, b = qkv.clone(), qkv.clone()
    q, k, v = ops.qk_norm_rope(a, pos, cache, hq, hkv, d, qw, kw, EPS, norm == "gemma")
    qr, kr, vr = ref.qk_norm_rope(b, pos, cache, hq, hkv, d, qw, kw, EPS, norm == "gemma")
    assert q.shape == (t, hq, d) and k.shape == (t, hkv, d) and v.shape == (t, hkv, d)
    for view, base in ((q, a), (k, a), (v, a), (qr, b)):
        assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # views, in place
    assert torch.equal(v, qkv[:, (hq + hkv) * d :].view(t, hkv, d))  # v untouched
    assert_close(q, qr, dtype)
    assert_close(k, kr, dtype)
    assert_close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", ["none", "llama"])
@pytest.mark.parametrize("block_major", [False, True], ids=["layer-major", "block-major"])
def test_qk_norm_rope_writes_the_kv_cache(dtype, norm, block_major):
    """With ``kv_cache`` the kernel also stores each token's rotated k and its v at its slot (the
    fused reshape_and_cache); slot -1 (a padding row) writes nothing, and no other slot changes."""
    hq, hkv, d, t, num_blocks, bs = 4, 2, 32, 7, 5, 4
    g = torch.Generator().manual_seed(11 + block_major)
    qkv, pos, cache, (qw, kw) = qk_case(g, t, hq, hkv, d, dtype, norm, pad=3)
    if block_major:  # one block of every layer contiguous: a layer's cache is a strided view (phase 10)
        full = randn(g, num_blocks, 2, 3, bs, hkv, d, dtype=dtype)
        k_cache, v_cache = full[:, 0, 1], full[:, 1, 1]
    else:
        k_cache, v_cache = randn(g, num_blocks, bs, hkv, d, dtype=dtype), randn(g, num_blocks, bs, hkv, d, dtype=dtype)
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    slots[3] = -1
    slots = slots.to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_old, v_old = k_cache.clone(), v_cache.clone()
    a, b = qkv.clone(), qkv.clone()
    q, k, v = ops.qk_norm_rope(a, pos, cache, hq, hkv, d, qw, kw, EPS, False, kv_cache=(k_cache, v_cache),
                               slot_mapping=slots)
    qr, kr, vr = ref.qk_norm_rope(b, pos, cache, hq, hkv, d, qw, kw, EPS, False, kv_cache=(k_ref, v_ref),
                                  slot_mapping=slots)
    assert_close(a, b, dtype)  # the in-place q/k results are the same as without the cache
    assert_close(k_cache, k_ref, dtype)
    assert torch.equal(v_cache, v_ref)
    flat_k, flat_v = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    written = slots[slots >= 0]
    assert torch.equal(flat_k[written], k[slots >= 0]) and torch.equal(flat_v[written], v[slots >= 0])
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[written.cpu()] = False
    assert torch.equal(flat_k[untouched], k_old.reshape(-1, hkv, d)[untouched])
    assert torch.equal(flat_v[untouched], v_old.reshape(-1, hkv, d)[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("warps, stages, loads_x_ahead", [(1, 0, True), (4, 0, False), (1, 3, False)],
                         ids=["register-loop-x-ahead", "register-loop", "pipelined-loop"])
def test_skinny_linear_matches_reference(dtype, m, bias, warps, stages, loads_x_ahead):
    """The skinny GEMM (one program per few outputs, float32 sums) against the float32 reference, with
    K and N that are not multiples of the tiles and x's rows strided; each of its K loops (one tile ahead in
    registers, with x's next slice loaded ahead too (a tile of few warps) or not, and Triton's pipeliner
    with the first tile used last)."""
    from infer.kernels import skinny_gemm as sk

    assert sk.x_ahead(stages, 0, warps) == loads_x_ahead  # the case runs the loop its name says
    g = torch.Generator().manual_seed(m * 10 + bias)
    x = rows(g, m, 70, dtype, pad=5)
    w, b = randn(g, 37, 70, dtype=dtype, scale=0.3), randn(g, 37, dtype=dtype) if bias else None
    out = sk.skinny_linear(x, w, b, config=(*sk.default_config(m, 37, 70)[:2], warps, stages))
    assert out.shape == (m, 37) and out.dtype == dtype
    expected = sk.skinny_linear_reference(x, w, b)
    assert_close(out, expected, dtype)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    torch.testing.assert_close(expected.double(), exact, atol=TOL[dtype][0] * 40, rtol=TOL[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_skinny_linear_activation_in_its_epilogue(dtype, m, activation):
    """skinny_linear(..., activation=a) on a merged gate/up weight: the product's halves rounded, then
    act(gate) * up rounded once (the float32 reference), within an ulp of linear() then act_and_mul()'s
    reference (which rounds act(gate) once more)."""
    from infer.kernels import skinny_gemm as sk

    g = torch.Generator().manual_seed(m)
    x = rows(g, m, 70, dtype, pad=3)
    w, b = randn(g, 38, 70, dtype=dtype, scale=0.3), randn(g, 38, dtype=dtype)
    out = sk.skinny_linear(x, w, b, activation=activation)
    assert out.shape == (m, 19) and out.dtype == dtype
    expected = sk.skinny_linear_reference(x, w, b, activation=activation)
    assert_close(out, expected, dtype)
    # act_and_mul's reference rounds act(gate) before the product: within an ulp of the one rounding
    assert_close(expected, ref.act_and_mul(sk.skinny_linear_reference(x, w, b), activation), dtype)
    with pytest.raises(ValueError, match="even number of rows"):
        sk.skinny_linear(x, w[:37], activation=activation)
    with pytest.raises(ValueError, match="activation and a residual"):
        sk.skinny_linear(x, w, activation=activation, residual=rows(g, m, 38, dtype))
    with pytest.raises(ValueError, match="activation must be one of"):
        sk.skinny_linear(x, w, activation="relu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, norm, activation, residual, programs", [
    (1, False, None, True, 3),      # the engine's case (a down projection + its residual add), 19 row blocks
    (1, False, None, False, 1),     # one program walks every row block
    (3, True, "silu", False, 4),    # what the policy never picks, the kernel still computes: norm + gate/up
    (1, True, None, False, 20),     # more programs than row blocks (19): one each, the rest idle
])
def test_persistent_grid_equals_one_program_per_row_block(dtype, m, norm, activation, residual, programs):
    """The skinny GEMM's persistent grid (``programs`` programs, each computing every P-th row block and
    loading the next block's first tile in the last K step of the one before) against the same tile with one
    program per row block: the same sums in the same order, so bit-identical outputs (and new residual
    stream); and against the plain-PyTorch reference. K (70) off the tile (32 under the interpreter), N off
    BLOCK_N, strided rows. Rejected with the pipelined loop."""
    from infer.kernels import skinny_gemm as sk

    g = torch.Generator().manual_seed(300 + m * 10 + programs)
    n = 38 if activation else 150
    x = rows(g, m, 70, dtype, pad=5)
    w, b = randn(g, n, 70, dtype=dtype, scale=0.3), randn(g, n, dtype=dtype)
    n_out = n // 2 if activation else n
    add = rows(g, m, n_out, dtype, pad=3) if residual else None
    tile = sk.default_config(m, n_out, 70, act=bool(activation), norm=norm)[:3] + (0,)
    if norm:
        nw = randn(g, 70, dtype=dtype, scale=0.2) + 1
        y, s = sk.skinny_norm_linear(x, None, nw, EPS, False, w, b, activation, config=(*tile, programs))
        y1, s1 = sk.skinny_norm_linear(x, None, nw, EPS, False, w, b, activation, config=(*tile, 0))
        expected, _ = sk.skinny_norm_linear_reference(x, None, nw, EPS, False, w, b, activation)
        assert torch.equal(s, s1)
    else:
        y = sk.skinny_linear(x, w, b, config=(*tile, programs), residual=add)
        y1 = sk.skinny_linear(x, w, b, config=(*tile, 0), residual=add)
        expected = sk.skinny_linear_reference(x, w, b, residual=add)
    assert torch.equal(y, y1)
    assert_close(y, expected, dtype)
    with pytest.raises(ValueError, match="persistent grid"):
        sk.skinny_linear(x, w, b, config=(*tile[:3], 3, programs))


def test_persistent_programs_only_for_the_measured_case():
    """The policy (persistent_programs): a persistent grid only for one row, no norm or activation, the
    8-warp register loop, on CUDA, with more row blocks than the grid; never under the interpreter or on CPU."""
    from infer.kernels import skinny_gemm as sk

    cuda = torch.device("cuda", 0)
    for args in [(2, 2560, (2, 2048, 8, 0), False, False, torch.device("cpu")),  # not CUDA
                 (2, 2560, (2, 2048, 8, 0), False, False, cuda), (1, 2560, (2, 2048, 8, 0), True, False, cuda),
                 (1, 2560, (2, 2048, 8, 0), False, True, cuda), (1, 2560, (2, 1024, 4, 0), False, False, cuda),
                 (1, 2560, (2, 2048, 8, 3), False, False, cuda)]:
        assert sk.persistent_programs(*args) == 0, args
    assert not sk.x_ahead(0, 96, 1)  # a persistent grid keeps its own loop (x ahead was slower there)
    if torch.cuda.is_available():
        sms = sm_count(cuda)
        per_sm = sk.PERSISTENT_PROGRAMS_PER_SM
        assert sk.persistent_programs(1, 2 * per_sm * sms + 2, (2, 2048, 8, 0), False, False, cuda) == per_sm * sms
        assert sk.persistent_programs(1, 2 * per_sm * sms, (2, 2048, 8, 0), False, False, cuda) == 0


def test_after_norm_config_is_the_tile_of_the_products_outputs(monkeypatch):
    """The tile of a projection after its norm (what add_rms_norm_linear and benchmarks/skinny_gemm.py
    launch) is default_config's for one row, norm=True, and a merged gate/up's outputs, half its rows: Qwen3-1.7B's
    gate/up (2 x 6,144 rows of 2,048) has 12.6 M weights per half, under PIPELINE_ELEMENTS, so the register
    loop (STAGES 0); counted as 25.2 M rows it would be pipelined. Qwen3-4B's QKV: the one-warp tile."""
    from infer.kernels import skinny_gemm as sk

    monkeypatch.setattr(sk, "INTERPRET", False)  # the GPU's policy, not the interpreter's one tiny tile
    assert sk.after_norm_config(torch.empty(2 * 6144, 2048, device="meta"), "silu") == (2, 512, 2, 0)
    assert sk.default_config(1, 2 * 6144, 2048, act=True, norm=True) == (2, 512, 2, 3)
    assert sk.after_norm_config(torch.empty(6144, 2560, device="meta")) == (2, 256, 1, 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_adds_the_residual_in_its_epilogue(dtype, m, bias):
    """skinny_linear(..., residual=r): the product rounded, plus r, rounded (a block's last projection
    and its residual add in one kernel), against the reference, whose sum is exactly its rounded product
    plus r in the dtype (the layers' ``linear(x) + r``: two roundings, never one); r untouched."""
    from infer.kernels import skinny_gemm as sk

    g = torch.Generator().manual_seed(7 + m * 10 + bias)
    x = rows(g, m, 70, dtype, pad=5)
    w, b = randn(g, 37, 70, dtype=dtype, scale=0.3), randn(g, 37, dtype=dtype) if bias else None
    r = rows(g, m, 37, dtype, pad=3, scale=4.0)
    r0 = r.clone()
    out = sk.skinny_linear(x, w, b, residual=r)
    assert out.shape == (m, 37) and out.dtype == dtype and torch.equal(r, r0)
    expected = sk.skinny_linear_reference(x, w, b, residual=r)
    assert_close(out, expected, dtype)
    # the product alone, then the add: the kernel's two roundings (never the sum rounded once)
    assert torch.equal(expected, sk.skinny_linear_reference(x, w, b) + r)
    with pytest.raises(ValueError, match="residual must be"):
        sk.skinny_linear(x, w, b, residual=rows(g, m, 36, dtype))


@pytest.mark.parametrize("m", [1, 2])
def test_linear_residual_is_the_reference(m):
    """ops.linear_residual (at one row the add in the skinny GEMM's epilogue, residual None after it; at
    two the projection alone, the add left to the next norm) against the reference: the same sum."""
    g = torch.Generator().manual_seed(40 + m)
    layer = torch.nn.Linear(40, 24, bias=True).to(DEVICE).requires_grad_(False)
    x, r = randn(g, m, 40), randn(g, m, 24)
    h, res = ops.linear_residual(x, layer, r.clone())
    h_ref, res_ref = ref.linear_residual(x, layer, r.clone())
    assert res_ref is not None and (res is None) == (m == 1)
    torch.testing.assert_close(h + (0 if res is None else res), h_ref + res_ref, atol=1e-5, rtol=1e-5)
    for impl in (ops, ref):  # no residual: the projection alone
        y, none = impl.linear_residual(x, layer, None)
        assert none is None
        torch.testing.assert_close(y, layer(x), atol=1e-5, rtol=1e-5)
    for impl in (ops, ref):  # add_rms_norm: rms_norm without a residual, fused_add_rms_norm with one
        nw = randn(g, 24) + 1
        y, s = impl.add_rms_norm(h_ref.clone(), None, nw, EPS)
        torch.testing.assert_close(y, ref.rms_norm(h_ref, nw, EPS), atol=1e-5, rtol=1e-5)
        assert torch.equal(s, h_ref)
        y, s = impl.add_rms_norm(h_ref.clone(), res_ref.clone(), nw, EPS)
        torch.testing.assert_close(y, ref.rms_norm(h_ref + res_ref, nw, EPS), atol=1e-5, rtol=1e-5)
        assert torch.equal(s, h_ref + res_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("residual, unit_offset", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("activation", [None, "silu", "gelu_tanh"])
@pytest.mark.parametrize("one_load", [True, False], ids=["rows-in-one-load", "slice-by-slice"])
def test_skinny_norm_linear_matches_reference(dtype, m, residual, unit_offset, activation, one_load, monkeypatch):
    """The norm (+ residual add) before a projection, the projection and the MLP activation in one kernel,
    against the plain-PyTorch twin (rms_norm, a float32 product, the activation rounded once), with K and
    N off the tiles, strided rows, a bias: y within the dtype's tolerance, the new residual stream exactly
    x + residual, and x and residual untouched (the engine reuses neither, but the fallback works in place).
    Both ways of the norm's first pass: the whole rows in one load, and one slice at a time; and both K
    loops (the pipelined one with the slice-by-slice pass)."""
    from infer.kernels import skinny_gemm as sk

    monkeypatch.setattr(sk, "NORM_ONE_LOAD_PER_THREAD", 16 if one_load else 0)
    config = sk.default_config(m, 38, 70, norm=True)
    assert (sk._norm_k_pad(m, 70, config[2]) > 0) == one_load
    monkeypatch.setattr(sk, "default_config", lambda *a, **kw: (*config[:3], 0 if one_load else 3))

    g = torch.Generator().manual_seed(m * 100 + residual * 10 + unit_offset + len(activation or ""))
    x, r = rows(g, m, 70, dtype, pad=6), rows(g, m, 70, dtype, pad=2) if residual else None
    nw = randn(g, 70, dtype=dtype, scale=0.2) + (0 if unit_offset else 1)
    w, b = randn(g, 38, 70, dtype=dtype, scale=0.3), randn(g, 38, dtype=dtype)
    x0, r0 = x.clone(), r.clone() if residual else None
    y, s = sk.skinny_norm_linear(x, r, nw, EPS, unit_offset, w, b, activation)
    y_ref, s_ref = sk.skinny_norm_linear_reference(x, r, nw, EPS, unit_offset, w, b, activation)
    assert y.shape == (m, 19 if activation else 38) and y.dtype == dtype
    assert_close(y, y_ref, dtype)
    assert torch.equal(s, s_ref) and (s is x) == (not residual)
    assert torch.equal(x, x0) and (not residual or torch.equal(r, r0))
    # the twin is the unfused chain: the norm module, the layer's product, the activation of layers.py
    h = layers.rms_norm(s_ref, nw, EPS, unit_offset)
    chain = torch.nn.functional.linear(h.float(), w.float(), b.float()).to(dtype)
    if activation:
        chain = (layers.ACTIVATIONS[activation](chain[:, :19].float()) * chain[:, 19:].float()).to(dtype)
    assert_close(y_ref, chain, dtype)


@pytest.mark.parametrize("m", [1, 2])
def test_add_rms_norm_linear_is_the_reference(m):
    """ops.add_rms_norm_linear (at one row the norm's kernel, then the skinny GEMM with the activation in its
    epilogue; the unfused kernels at two) against the reference (fused_add_rms_norm or rms_norm, linear,
    act_and_mul), first layer (no residual) and later ones, Llama's norm and SiLU and Gemma's (1 + w) and
    GELU-tanh."""
    g = torch.Generator().manual_seed(m)
    layer = torch.nn.Linear(40, 24, bias=False).to(DEVICE)
    nw = randn(g, 40) + 1
    for residual in (None, randn(g, m, 40)):
        for unit_offset, act in ((False, None), (False, "silu"), (True, None), (True, "gelu_pytorch_tanh")):
            x = randn(g, m, 40)
            y, s = ops.add_rms_norm_linear(x.clone(), None if residual is None else residual.clone(), nw, EPS,
                                           unit_offset, layer, act)
            y_ref, s_ref = ref.add_rms_norm_linear(x.clone(), None if residual is None else residual.clone(), nw,
                                                   EPS, unit_offset, layer, act)
            torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s, s_ref, atol=0, rtol=0)


def test_skinny_norm_linear_rejects_bad_inputs():
    from infer.kernels import skinny_gemm as sk

    g = torch.Generator().manual_seed(1)
    x, w, nw = randn(g, 1, 40), randn(g, 24, 40), randn(g, 40)
    with pytest.raises(ValueError, match="residual must be like x"):
        sk.skinny_norm_linear(x, randn(g, 2, 40), nw, EPS, False, w)
    with pytest.raises(ValueError, match="norm_weight"):
        sk.skinny_norm_linear(x, None, randn(g, 41), EPS, False, w)
    with pytest.raises(ValueError, match="activation must be one of"):
        sk.skinny_norm_linear(x, None, nw, EPS, False, w, activation="relu")
    with pytest.raises(ValueError, match="even number of rows"):
        sk.skinny_norm_linear(x, None, nw, EPS, False, randn(g, 23, 40), activation="silu")


def test_pdl_scope_is_per_thread_and_never_on_the_cpu():
    """pdl.scope turns PDL on for launches inside it on this thread only; CPU tensors (the interpreter)
    never launch with it."""
    import threading

    from infer.kernels import pdl

    cuda_like = type("T", (), {"is_cuda": True})()
    seen = []
    with pdl.scope():
        assert pdl.launch_pdl(cuda_like) == (not INTERPRET)
        assert not pdl.launch_pdl(torch.zeros(1))
        t = threading.Thread(target=lambda: seen.append(pdl.launch_pdl(cuda_like)))
        t.start()
        t.join()
        with pdl.scope(False):
            assert not pdl.launch_pdl(cuda_like)
    assert seen == [False] and not pdl.launch_pdl(cuda_like)
    with pytest.raises(ValueError, match="CUDA device"):
        EngineConfig(device="cpu", pdl=True).validate()


@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_splits_few_rows_over_the_threads(bias, monkeypatch):
    """The CPU fused forward's products: with a column-major weight and at most SPLIT_K_MAX_ROWS rows,
    one bmm over the threads' shares of the inner dimension (2 or 3 threads), the layer's values
    within float32 rounding; more rows, a row-major weight or one thread: the layer's own product."""
    g = torch.Generator().manual_seed(7)
    layer = torch.nn.Linear(96, 40, bias=bias)
    row_major = torch.nn.Linear(96, 40, bias=bias)
    row_major.load_state_dict(layer.state_dict())
    layers.set_weight_layout(layer, True)
    bmms = []
    real_bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: bmms.append(a.shape[0]) or real_bmm(a, b))
    threads = torch.get_num_threads()
    try:
        for s in (2, 3, 1):
            torch.set_num_threads(s)
            for m in (1, 5, ref.SPLIT_K_MAX_ROWS, ref.SPLIT_K_MAX_ROWS + 1):
                x = randn(g, m, 96)
                bmms.clear()
                out = ref.linear(x, layer)
                split = s > 1 and m <= ref.SPLIT_K_MAX_ROWS
                assert bmms == ([s] if split else []), (s, m, bmms)
                torch.testing.assert_close(out, row_major(x), atol=1e-5, rtol=1e-5)
                bmms.clear()
                assert torch.equal(ref.linear(x, row_major), row_major(x)) and bmms == []
    finally:
        torch.set_num_threads(threads)


def test_skinny_linear_dispatch_and_errors():
    """``linear`` gives the layer's result whichever product it picks; bad shapes raise ValueError."""
    from infer.kernels import skinny_gemm as sk

    g = torch.Generator().manual_seed(4)
    for n in (24, 3000):  # one row: the skinny kernel; two: cuBLAS/ATen
        layer = torch.nn.Linear(40, n, bias=True)
        for m in (1, 2):
            x = randn(g, m, 40)
            torch.testing.assert_close(ref.linear(x, layer), layer(x))
            torch.testing.assert_close(ops.linear(x, layer), layer(x), atol=1e-5, rtol=1e-5)
    assert sk.use_skinny(1, 1024) and sk.use_skinny(1, 6144) and not sk.use_skinny(2, 1024)
    x, w = randn(g, 2, 40), randn(g, 24, 40)
    with pytest.raises(ValueError, match="same K"):
        sk.skinny_linear(x, randn(g, 24, 41))
    with pytest.raises(ValueError, match="at most 8 rows"):
        sk.skinny_linear(randn(g, 9, 40), w)
    with pytest.raises(ValueError, match="bias"):
        sk.skinny_linear(x, w, randn(g, 23))
    with pytest.raises(ValueError, match="differ"):
        sk.skinny_linear(x.double(), w)


@pytest.mark.parametrize("impl", [ops, ref], ids=["triton", "reference"])
def test_qk_norm_rope_rejects_a_bad_cache(impl):
    g = torch.Generator().manual_seed(3)
    qkv, pos, cache, _ = qk_case(g, 3, 4, 2, 32, torch.float32, "none")
    good = randn(g, 2, 4, 2, 32)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache must be"):
        impl.qk_norm_rope(qkv, pos, cache, 4, 2, 32, kv_cache=(randn(g, 2, 4, 3, 32), good), slot_mapping=slots)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        impl.qk_norm_rope(qkv, pos, cache, 4, 2, 32, kv_cache=(good, good.clone()), slot_mapping=slots.int())
    with pytest.raises(ValueError, match="float32"):
        impl.qk_norm_rope(qkv, pos, cache, 4, 2, 32, kv_cache=(good.double(), good.double()), slot_mapping=slots)


def unfused_qk(qkv, positions, hq, hkv, d, qw, kw, unit_offset, inv):
    """The unfused path of layers.Attention.forward: split, q_norm/k_norm, cat, rope_cos_sin + apply_rope."""
    t = qkv.shape[0]
    q = qkv[:, : hq * d].reshape(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    if qw is not None:
        q, k = layers.rms_norm(q, qw, EPS, unit_offset), layers.rms_norm(k, kw, EPS, unit_offset)
    cos, sin = layers.rope_cos_sin(positions, inv, qkv.dtype)
    qk = layers.apply_rope(torch.cat((q, k), dim=1), cos, sin)
    return qk[:, :hq], qk[:, hq:]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_qk_norm_rope_reference_is_the_unfused_code_in_float32(norm, theta):
    g = torch.Generator().manual_seed(21 + len(norm))
    hq, hkv, d, t = 4, 2, 64, 9
    qkv, pos, _, (qw, kw) = qk_case(g, t, hq, hkv, d, torch.float32, norm)
    inv = inv_freq(d, theta).to(DEVICE)
    cache = ref.build_cos_sin_cache(inv, 4096, DEVICE)
    pos = torch.randint(0, 4096, (t,), generator=g).to(DEVICE)
    q0, k0 = unfused_qk(qkv, pos, hq, hkv, d, qw, kw, norm == "gemma", inv)
    q, k, _ = ref.qk_norm_rope(qkv.clone(), pos, cache, hq, hkv, d, qw, kw, EPS, norm == "gemma")
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_cos_sin_cache_is_rope_cos_sin():
    """The cache rows are bit-identical to layers.rope_cos_sin's tables (float32), any RoPE scaling."""
    scaled = RopeConfig(500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    for rope, d in ((RopeConfig(10000.0), 64), (RopeConfig(1e6), 128), (scaled, 128), (RopeConfig(1e4), 256)):
        inv = layers.rope_inv_freq(d, rope).to(DEVICE)
        cache = ref.build_cos_sin_cache(inv, 3000, DEVICE)
        assert cache.shape == (3000, d) and cache.dtype == torch.float32
        pos = torch.tensor([0, 1, 17, 2047, 2999], device=DEVICE)
        cos, sin = layers.rope_cos_sin(pos, inv, torch.float32)
        assert torch.equal(cache[pos, : d // 2], cos[:, : d // 2]) and torch.equal(cache[pos, d // 2 :], sin[:, d // 2 :])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", NORMS)
def test_qk_norm_rope_reference_in_16_bits(dtype, norm):
    """The norm keeps layers' rounding steps (bit-identical before the rotation); the rotation, computed in
    float32 and rounded once, is within 0.5 ulp of a float64 truth and within 2 ulps (of |x_i| +
    |x_{i+D/2}|) of the unfused four-rounding sequence, which itself is off by up to ~100 ulps of the
    result where the two products cancel."""
    g = torch.Generator().manual_seed(31 + len(norm))
    hq, hkv, d, t = 6, 2, 64, 64
    qkv, _, _, (qw, kw) = qk_case(g, t, hq, hkv, d, dtype, norm)
    qkv = qkv * (1 + 4 * torch.rand(t, 1, generator=g).to(DEVICE)).to(dtype)
    inv = inv_freq(d, 1e6).to(DEVICE)
    cache = ref.build_cos_sin_cache(inv, 40000, DEVICE)
    pos = torch.randint(0, 40000, (t,), generator=g).to(DEVICE)
    uo = norm == "gemma"
    # the normalized (unrotated) heads, as layers computes them
    q_in = qkv[:, : hq * d].reshape(t, hq, d)
    k_in = qkv[:, hq * d : (hq + hkv) * d].reshape(t, hkv, d)
    if qw is not None:
        q_in, k_in = layers.rms_norm(q_in, qw, EPS, uo), layers.rms_norm(k_in, kw, EPS, uo)
    x = torch.cat((q_in, k_in), 1)
    q0, k0 = unfused_qk(qkv, pos, hq, hkv, d, qw, kw, uo, inv)
    q, k, _ = ref.qk_norm_rope(qkv.clone(), pos, cache, hq, hkv, d, qw, kw, EPS, uo)
    ours, hf = torch.cat((q, k), 1), torch.cat((q0, k0), 1)
    # truth: the same angles (float32, as both tables hold them), cos/sin and products in float64
    ang = pos.float()[:, None] * inv[None, :]
    ang = torch.cat((ang, ang), -1).double()
    truth = layers.apply_rope(x.double(), ang.cos(), ang.sin())
    half = d // 2
    scale = x.float().abs() + torch.cat((x[..., half:], x[..., :half]), -1).float().abs()
    assert ulps(ours, truth, truth.abs().clamp_min(1e-2), dtype) <= 0.5 + 0.05  # + float32 noise
    assert ulps(ours, hf, scale, dtype) <= 2.0
    assert (ours.double() - truth).abs().mean() <= (hf.double() - truth).abs().mean()


# ---------------------------------------------------------------------------------- act_and_mul

ACTS = ["silu", "gelu_tanh", "gelu_pytorch_tanh"]


def act64(g: torch.Tensor, name: str) -> torch.Tensor:
    g = g.double()
    if name == "silu":
        return g * torch.sigmoid(g)
    return 0.5 * g * (1 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("t,i,pad", [(1, 37, 0), (5, 100, 8)])
def test_act_and_mul_matches_reference(dtype, activation, t, i, pad):
    g = torch.Generator().manual_seed(41 + t * i + len(activation))
    gate_up = rows(g, t, 2 * i, dtype, pad, scale=3)
    out = ops.act_and_mul(gate_up, activation)
    expected = ref.act_and_mul(gate_up, activation)
    assert out.shape == (t, i) and out.dtype == dtype
    assert_close(out, expected, dtype)
    # one rounding (kernel) vs two (reference, as the unfused MLP): the kernel is correctly rounded
    # (within half an ulp of the float64 truth, plus float32 noise) and never further from it
    if dtype != torch.float32:
        truth = act64(gate_up[:, :i], activation) * gate_up[:, i:].double()
        assert (out.double() - truth).abs().max() <= (expected.double() - truth).abs().max()
        assert ulps(out, truth, truth.abs().clamp_min(1e-2), dtype) <= 0.5 + 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTS)
def test_act_and_mul_reference_is_the_unfused_code(dtype, activation):
    """``ACTIVATIONS[name](gate) * up`` on the separate projections' outputs, exactly (I a multiple of 16,
    as in every real model; see fused_reference's note on PyTorch's vectorization tails)."""
    g = torch.Generator().manual_seed(51 + len(activation))
    for t, i in ((1, 48), (6, 128)):
        gate, up = rows(g, t, i, dtype) * 3, rows(g, t, i, dtype)
        expected = layers.ACTIVATIONS[activation](gate) * up
        assert torch.equal(ref.act_and_mul(torch.cat((gate, up), 1), activation), expected)


# ---------------------------------------------------------------------------------- errors, empty batches


@pytest.mark.parametrize("impl", [ops, ref], ids=["triton", "reference"])
def test_bad_inputs_raise_the_same_clear_errors(impl):
    x = torch.zeros(3, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    qkv = torch.zeros(3, (2 + 2) * 8, device=DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    cache = torch.zeros(10, 8, device=DEVICE)
    cases = [
        (lambda: impl.rms_norm(x[0], w, EPS), "must be \\[T, d\\]"),
        (lambda: impl.rms_norm(x.int(), w, EPS), "float32, float16 or bfloat16"),
        (lambda: impl.rms_norm(x, w[:4], EPS), "weight must have shape"),
        (lambda: impl.rms_norm(x, w.half(), EPS), "weight dtype"),
        (lambda: impl.rms_norm(x.t(), torch.ones(3, device=DEVICE), EPS), "contiguous last dimension"),
        (lambda: impl.rms_norm(x, w, EPS, out=torch.zeros(3, 8, dtype=torch.float16, device=DEVICE)), "out dtype"),
        (lambda: impl.fused_add_rms_norm(x, x[:2], w, EPS), "residual must have shape"),
        (lambda: impl.fused_add_rms_norm(x, x, w, EPS), "must not overlap"),
        (lambda: impl.qk_norm_rope(qkv, pos, cache, 2, 2, 8), "qkv must be"),
        (lambda: impl.qk_norm_rope(qkv, pos, cache, 2, 1, 7), "head_dim must be even"),
        (lambda: impl.qk_norm_rope(qkv, pos, cache, 0, 2, 8), "num_heads must be a positive int"),
        (lambda: impl.qk_norm_rope(qkv[:, :24], pos[:2], cache, 1, 1, 8), "positions must be"),
        (lambda: impl.qk_norm_rope(qkv[:, :24], pos.float(), cache, 1, 1, 8), "int64 or int32"),
        (lambda: impl.qk_norm_rope(qkv[:, :24].contiguous(), pos, cache.half(), 1, 1, 8), "float32"),
        (lambda: impl.qk_norm_rope(qkv[:, :24].contiguous(), pos, cache[:, :4], 1, 1, 8), "cos_sin_cache must be"),
        (lambda: impl.qk_norm_rope(qkv[:, :24].contiguous(), pos, cache, 1, 1, 8, q_weight=w), "both"),
        (lambda: impl.act_and_mul(x, "relu"), "unsupported activation"),
        (lambda: impl.act_and_mul(x[:, :7], "silu"), "odd width"),
    ]
    for fn, match in cases:
        with pytest.raises(ValueError, match=match):
            fn()
    with pytest.raises(ValueError, match="max_positions"):
        impl.build_cos_sin_cache(inv_freq(8), 0, DEVICE)


@pytest.mark.parametrize("impl", [ops, ref], ids=["triton", "reference"])
def test_empty_batches(impl):
    x = torch.zeros(0, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    assert impl.rms_norm(x, w, EPS).shape == (0, 8)
    impl.fused_add_rms_norm(x, torch.zeros(0, 8, device=DEVICE), w, EPS)
    q, k, v = impl.qk_norm_rope(torch.zeros(0, 32, device=DEVICE), torch.zeros(0, dtype=torch.int64, device=DEVICE),
                                torch.zeros(4, 8, device=DEVICE), 2, 1, 8)
    assert q.shape == (0, 2, 8) and v.shape == (0, 1, 8)
    assert impl.act_and_mul(torch.zeros(0, 16, device=DEVICE), "silu").shape == (0, 8)


def test_fused_ops_picks_the_module_for_the_backend():
    assert fused_ops("torch") is ref
    assert fused_ops("triton") is ops
    with pytest.raises(ValueError, match="unknown backend"):
        fused_ops("cuda")
    for name in ("rms_norm", "fused_add_rms_norm", "qk_norm_rope", "act_and_mul", "build_cos_sin_cache"):
        import inspect

        assert inspect.signature(getattr(ops, name)) == inspect.signature(getattr(ref, name)), name


# ---------------------------------------------------------------------------------- no recompilation


class Recorder:
    """Stands in for a kernel object: records what each launch would specialize on, then launches."""

    def __init__(self, kernel) -> None:
        self.kernel, self.keys = kernel, []
        dns = getattr(kernel, "do_not_specialize", None)
        if dns is None:  # the interpreter's InterpretedFunction keeps the decorator's kwargs
            dns = getattr(kernel, "kwargs", {}).get("do_not_specialize") or []
        self.dns = set(dns)
        fn = getattr(kernel, "fn", kernel)
        import inspect

        self.names = list(inspect.signature(fn).parameters)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            key = []
            for name, a in zip(self.names, args):
                if isinstance(a, torch.Tensor):
                    key.append((name, a.dtype, a.data_ptr() % 16 == 0))  # pointers: dtype, alignment
                elif isinstance(a, int) and name not in self.dns:
                    key.append((name, a))  # specialized ints (Triton keys on ==1 and %16; be strict)
            key.append(tuple(sorted(kwargs.items())))
            self.keys.append(tuple(key))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_a_new_number_of_tokens_compiles_nothing(monkeypatch):
    """T is only a grid dimension: the specialization key (constexprs, specialized ints, dtypes, pointer
    alignment) of every kernel is the same for T = 1, 2, 7 and 16 (slices of one static buffer, as
    padded CUDA-graph batches are). The GPU test below counts compiled variants."""
    recs = {n: Recorder(getattr(ops, n)) for n in ("_rms_norm_kernel", "_add_rms_norm_kernel",
                                                   "_qk_norm_rope_kernel", "_act_and_mul_kernel")}
    for n, r in recs.items():
        monkeypatch.setattr(ops, n, r)
    g = torch.Generator().manual_seed(61)
    hq, hkv, d, hidden, inter = 2, 1, 16, 24, 20
    x_buf, r_buf = randn(g, 16, hidden), randn(g, 16, hidden)
    qkv_buf = randn(g, 16, (hq + 2 * hkv) * d)
    gu_buf = randn(g, 16, 2 * inter)
    pos_buf = torch.arange(16, device=DEVICE)
    cache = ref.build_cos_sin_cache(inv_freq(d), 64, DEVICE)
    w, qw, kw = randn(g, hidden), randn(g, d), randn(g, d)
    for t in (1, 2, 7, 16):
        ops.rms_norm(x_buf[:t], w, EPS)
        ops.fused_add_rms_norm(x_buf[:t], r_buf[:t], w, EPS)
        ops.qk_norm_rope(qkv_buf[:t], pos_buf[:t], cache, hq, hkv, d, qw, kw, EPS)
        ops.act_and_mul(gu_buf[:t], "silu")
    for n, r in recs.items():
        assert len(r.keys) == 4 and len(set(r.keys)) == 1, (n, r.keys)


# ---------------------------------------------------------------------------------- compiles for a GPU

AOT_SCRIPT = r"""
import json, re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from infer.kernels import fused_triton as ft

def compile_(fn, sig, consts, num_warps):
    # (what Triton assumes at run time for pointers and ints divisible by 16: strides, the skinny GEMM's K)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig)
             if sig[n].startswith("*") or n.startswith("stride") or n == "K"}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ptx = k.asm["ptx"]
    pdl = ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
    # the loads, and (with USE_PDL) the two griddepcontrol instructions, in the order they come; and whether
    # a load comes before the wait (what no kernel writes, read while the previous kernel finishes)
    # (cp.async: a load through shared memory, Triton's pipeliner)
    return sorted(set(re.findall(r"ld\.global[.\w]*|cp\.async\.c[ag]\.shared\.global", ptx))) + [p for p in pdl if p in ptx] + (
        ["wait-before-launch"] if all(p in ptx for p in pdl) and ptx.index(pdl[0]) < ptx.index(pdl[1]) else []) + (
        ["load-before-wait"] if pdl[0] in ptx and "ld.global" in ptx[:ptx.index(pdl[0])] else [])

bf = "*bf16"
norm_sig = {"stride_x": "i32", "eps": "fp32", "N": "constexpr", "BLOCK": "constexpr", "UNIT_OFFSET": "constexpr",
            "MANUAL_BF16": "constexpr", "USE_PDL": "constexpr"}
out = {}
for uo in (False, True):
    c = {"N": 2560, "BLOCK": 4096, "UNIT_OFFSET": uo, "MANUAL_BF16": False, "USE_PDL": uo}
    out[f"rms{uo}"] = compile_(ft._rms_norm_kernel, {"x_ptr": bf, "w_ptr": bf, "out_ptr": bf, "stride_x": "i32",
                               "stride_o": "i32", **{k: v for k, v in norm_sig.items() if k != "stride_x"}}, c, 8)
    out[f"add{uo}"] = compile_(ft._add_rms_norm_kernel, {"x_ptr": bf, "res_ptr": bf, "w_ptr": bf, "stride_x": "i32",
                               "stride_r": "i32", **{k: v for k, v in norm_sig.items() if k != "stride_x"}}, c, 8)
    for d in (128, 256):
        sig = {"qkv_ptr": bf, "pos_ptr": "*i64", "cs_ptr": "*fp32", "qw_ptr": bf, "kw_ptr": bf, "stride_t": "i32",
               "max_positions": "i32", "eps": "fp32", "k_cache_ptr": bf, "v_cache_ptr": bf, "slot_ptr": "*i64",
               "stride_cb": "i64", "stride_ct": "i32", "stride_ch": "i32", "block_size": "i32"}
        consts = {"NUM_Q_HEADS": 32, "NUM_HEADS": 40, "HEAD_DIM": d, "HALF": d // 2, "HALF_PAD": d // 2,
                  "BLOCK_H": 512 // d, "HAS_NORM": True, "UNIT_OFFSET": uo, "MANUAL_BF16": False,
                  "WRITE_CACHE": uo, "NUM_KV_HEADS": 8, "USE_PDL": uo}  # with and without the cache write, PDL
        out[f"qk{d}{uo}"] = compile_(ft._qk_norm_rope_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts, 2)
    if uo:  # the norm before gate/up: the next kernel may launch before this one's wait
        out["rms_launch_early"] = compile_(ft._rms_norm_kernel, {"x_ptr": bf, "w_ptr": bf, "out_ptr": bf,
                                           "stride_x": "i32", "stride_o": "i32", "LAUNCH_NEXT_EARLY": "constexpr",
                                           **{k: v for k, v in norm_sig.items() if k != "stride_x"}},
                                           {**c, "UNIT_OFFSET": False, "LAUNCH_NEXT_EARLY": True}, 8)
    out[f"act{uo}"] = compile_(ft._act_and_mul_kernel, {"gu_ptr": bf, "out_ptr": bf, "stride_gu": "i32",
                               "stride_o": "i32", "I": "constexpr", "BLOCK": "constexpr", "GELU_TANH": "constexpr",
                               "MANUAL_BF16": "constexpr", "USE_PDL": "constexpr"},
                               {"I": 9728, "BLOCK": 1024, "GELU_TANH": uo, "MANUAL_BF16": False, "USE_PDL": uo}, 4)
from infer.kernels import skinny_gemm as sk
sig = {"x_ptr": bf, "r_ptr": bf, "r_out_ptr": bf, "nw_ptr": bf, "w_ptr": bf, "b_ptr": bf, "add_ptr": bf, "y_ptr": bf,
       "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_rm": "i32", "stride_om": "i32",
       "stride_wn": "i32", "stride_am": "i32", "stride_ym": "i32", "up_offset": "i64", "eps": "fp32"}
for name, norm, act, add, use_pdl, k_pad in (
        ("skinny", 0, 0, False, False, 0), ("skinny_pdl", 0, 0, False, True, 0),
        ("add_pdl", 0, 0, True, True, 0), ("norm_act_pdl", 2, 1, False, True, 0),
        ("norm_one_load_pdl", 1, 1, False, True, 4096), ("pipelined_norm_act_pdl", 1, 1, False, True, 0),
        ("persistent_add_pdl", 0, 0, True, True, 0)):
    consts = {"M_PAD": 1, "BLOCK_N": 4, "BLOCK_K": 512, "HAS_BIAS": False, "NORM": norm, "UNIT_OFFSET": False,
              "ACT": act, "ADD": add, "USE_PDL": use_pdl, "MANUAL_BF16": False, "NORM_K_PAD": k_pad,
              "STAGES": 3 if name.startswith("pipelined") else 0, "PERSISTENT": name.startswith("persistent")}
    out[name] = compile_(sk._skinny_gemm_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts, 4)
from infer.kernels import decode_attention as to
sig = {"q_ptr": bf, "k_cache_ptr": bf, "v_cache_ptr": bf, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
       "out_ptr": bf, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32", "qk_scale": "fp32",
       "window": "i32", "num_splits": "i32", "min_split_keys": "i32", "stride_qb": "i32", "stride_qh": "i32",
       "stride_ob": "i32", "stride_oh": "i32", "stride_cb": "i32", "stride_ct": "i32", "stride_ch": "i32",
       "stride_bt": "i32"}
consts = {"NUM_Q_HEADS": 32, "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "D_PAD": 128, "BLOCK_SIZE": 16,
          "BLOCK_N": 64, "UPCAST": False, "USE_PDL": True}
out["decode_pdl"] = compile_(to._paged_decode_kernel, {**sig, **{k: "constexpr" for k in consts}}, consts, 4)
print(json.dumps(out))
"""


def test_kernels_compile_for_an_h100(tmp_path):
    """The interpreter runs code a GPU compile rejects (it once let a plain Python global into a kernel):
    compile every kernel variant ahead of time for sm_90 (Triton's bundled ptxas, no GPU needed), in a
    fresh process without TRITON_INTERPRET and with an empty cache, and check that the row kernels
    load 16 bytes per instruction (vectorized, coalesced)."""
    import os
    import subprocess

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", AOT_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loads = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(loads) == 19
    early_launch = loads.pop("rms_launch_early")
    for name, kinds in loads.items():
        if not name.startswith(("qk", "decode")):
            assert "ld.global.v4.b32" in kinds, (name, kinds)
        # USE_PDL compiles the wait and the launch of the next kernel, in that order; without it, neither
        pdl = name.endswith(("True", "_pdl"))
        assert ("griddepcontrol.wait" in kinds) == pdl and ("wait-before-launch" in kinds) == pdl, (name, kinds)
    # the norm before gate/up (launch_next_early): both instructions, the launch first, the weight before the wait
    assert {"griddepcontrol.wait", "griddepcontrol.launch_dependents", "load-before-wait"} <= set(early_launch)
    assert "wait-before-launch" not in early_launch, early_launch
    # the skinny GEMM's pipelined K loop streams W through shared memory; its register loop never does
    for name in ("skinny", "skinny_pdl", "add_pdl", "norm_act_pdl", "norm_one_load_pdl", "pipelined_norm_act_pdl",
                 "persistent_add_pdl"):
        assert any(k.startswith("cp.async") for k in loads[name]) == name.startswith("pipelined"), (name, loads[name])
    # with PDL these read before their wait what no kernel of the step writes: the projections their first
    # weight tiles, the norms their weight, the QK norm + RoPE its position, cos/sin row and norm weights,
    # the decode attention its sequence's length (its split plan); the activation has nothing to read early
    early = {n for n, kinds in loads.items() if "load-before-wait" in kinds}
    assert early == {"skinny_pdl", "add_pdl", "norm_act_pdl", "norm_one_load_pdl", "pipelined_norm_act_pdl",
                     "persistent_add_pdl", "rmsTrue", "addTrue", "qk128True", "qk256True", "decode_pdl"}, early


PDL_SCRIPT = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from infer.kernels import fused_triton as ft

sig = {"gu_ptr": "*bf16", "out_ptr": "*bf16", "stride_gu": "i32", "stride_o": "i32"}
consts = {"I": 1024, "BLOCK": 1024, "GELU_TANH": False, "MANUAL_BF16": False}
out = {}
for pdl, cc in ((True, 90), (False, 90), (False, 80)):
    c = {**consts, "USE_PDL": pdl}
    k = triton.compile(ASTSource(fn=ft._act_and_mul_kernel, signature={**sig, **{n: "constexpr" for n in c}},
                                 constexprs=c), target=GPUTarget("cuda", cc, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    find = lambda pat: (m.start() if (m := re.search(pat, ptx)) else None)
    out[f"{pdl}{cc}"] = {"wait": find(r"griddepcontrol\.wait"), "launch": find(r"griddepcontrol\.launch_dependents"),
                         "load": find(r"ld\.global"), "store": find(r"st\.global")}
print(json.dumps(out))
"""


def test_wait_for_previous_waits_then_lets_the_next_kernel_launch(tmp_path):
    """``pdl.wait_for_previous`` (a kernel's first line, infer.kernels.pdl): compiled for an H100 with
    USE_PDL, the kernel waits for the previous one (griddepcontrol.wait) before its first load and store,
    and only then lets the next one launch (griddepcontrol.launch_dependents); without it, neither
    instruction (and it compiles for an A100, sm_80, which has none). The interpreter never runs PDL, so
    this reads the PTX of an ahead-of-time compile (Triton's bundled ptxas, no GPU needed)."""
    import os
    import subprocess

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("Triton's bundled ptxas is missing")
    import infer

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    # the code under test: this process's infer (a graded workspace's, not necessarily this checkout's)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(infer.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", PDL_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    at = json.loads(proc.stdout.strip().splitlines()[-1])
    on = at["True90"]
    assert on["wait"] is not None and on["launch"] is not None, on
    assert on["wait"] < on["launch"], "the next kernel may launch only after this one has waited"
    assert on["wait"] < on["load"] and on["wait"] < on["store"], "nothing is read or written before the wait"
    for off in (at["False90"], at["False80"]):
        assert off["wait"] is None and off["launch"] is None, off


# ---------------------------------------------------------------------------------- benchmark smoke test


@pytest.mark.skipif(not INTERPRET, reason="the CPU smoke run needs the Triton interpreter")
def test_benchmark_smoke(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fused_kernels

    assert fused_kernels.main(["--device", "cpu", "--tokens", "1", "3", "--tune", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "fused_kernels.json").read_text())
    rows_ = report["rows"]
    assert {r["op"] for r in rows_} == {"rms_norm", "fused_add_rms_norm", "qk_norm_rope", "act_and_mul"}
    assert all(r["fused_us"] > 0 and r["reference_us"] > 0 and r["unfused_us"] > 0 for r in rows_)
    assert all(r["max_abs_diff_fused_vs_unfused"] < 1e-4 for r in rows_)
    assert (tmp_path / "fused_kernels.md").exists()
    tuned = report["tune"]
    assert {r["op"] for r in tuned} == set(fused_kernels.OPS) and all(r["fused_us"] > 0 for r in tuned)
    assert {r["num_warps"] for r in tuned} == {1, 4} and {r["block_h"] for r in tuned if "block_h" in r} == {1, 2, 4, 8}
    assert fused_kernels.tune is not None and ops.num_warps_for(4096) == 8  # the defaults are restored


# ---------------------------------------------------------------------------------- GPU, real shapes

QWEN3_4B = {"hidden": 2560, "hq": 32, "hkv": 8, "d": 128, "inter": 9728, "unit_offset": False, "act": "silu"}
GEMMA3_4B = {"hidden": 2560, "hq": 8, "hkv": 4, "d": 256, "inter": 10240, "unit_offset": True, "act": "gelu_pytorch_tanh"}
GEMMA3_1B = {"hidden": 1152, "hq": 4, "hkv": 1, "d": 256, "inter": 6912, "unit_offset": True, "act": "gelu_pytorch_tanh"}


def gpu_randn(g, *shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model", [QWEN3_4B, GEMMA3_4B, GEMMA3_1B], ids=["qwen3-4b", "gemma3-4b", "gemma3-1b"])
@pytest.mark.parametrize("t", [1, 7, 300, 2048])
def test_gpu_real_shapes(model, t, dtype):
    g = torch.Generator(device="cuda").manual_seed(t)
    hidden, hq, hkv, d, inter, uo = (model[k] for k in ("hidden", "hq", "hkv", "d", "inter", "unit_offset"))
    x, res = gpu_randn(g, t, hidden, dtype=dtype), gpu_randn(g, t, hidden, dtype=dtype, scale=4)
    w = gpu_randn(g, hidden, dtype=dtype, scale=0.3)
    assert_close(ops.rms_norm(x, w, EPS, uo), ref.rms_norm(x, w, EPS, uo), dtype)
    assert_close(ops.rms_norm(x, w, EPS, uo), layers.rms_norm(x, w, EPS, uo), dtype)
    x1, r1, x2, r2 = x.clone(), res.clone(), x.clone(), res.clone()
    ops.fused_add_rms_norm(x1, r1, w, EPS, uo)
    ref.fused_add_rms_norm(x2, r2, w, EPS, uo)
    assert torch.equal(r1, r2) and torch.equal(r1, res + x)
    assert_close(x1, x2, dtype)
    qkv = gpu_randn(g, t, (hq + 2 * hkv) * d, dtype=dtype, scale=3)
    qw, kw = gpu_randn(g, d, dtype=dtype, scale=0.3), gpu_randn(g, d, dtype=dtype, scale=0.3)
    inv = inv_freq(d, 1e6).cuda()
    cache = ref.build_cos_sin_cache(inv, 32768, "cuda")
    pos = torch.randint(0, 32768, (t,), generator=g, device="cuda")
    for weights in ((qw, kw), (None, None)):
        a, b = qkv.clone(), qkv.clone()
        ops.qk_norm_rope(a, pos, cache, hq, hkv, d, *weights, EPS, uo)
        ref.qk_norm_rope(b, pos, cache, hq, hkv, d, *weights, EPS, uo)
        assert_close(a, b, dtype)
        q0, k0 = unfused_qk(qkv, pos, hq, hkv, d, *weights, uo, inv)
        qk = a[:, : (hq + hkv) * d].view(t, hq + hkv, d)
        if dtype == torch.float32:
            assert_close(qk, torch.cat((q0, k0), 1), dtype)
        else:
            # RoPE rounded once vs four times: <= 2 ulps of |x_i| + |x_{i+D/2}| (the CPU test), +1 for the
            # kernel's own rounding flips vs the reference, +1 for a flip in the normalized input x
            x = qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d)
            if weights[0] is not None:
                x = torch.cat((layers.rms_norm(x[:, :hq], qw, EPS, uo), layers.rms_norm(x[:, hq:], kw, EPS, uo)), 1)
            x = x.float()
            scale = x.abs() + torch.cat((x[..., d // 2 :], x[..., : d // 2]), -1).abs()
            assert ulps(qk, torch.cat((q0, k0), 1), scale, dtype) <= 4.0
    gate_up = gpu_randn(g, t, 2 * inter, dtype=dtype, scale=2)
    out = ops.act_and_mul(gate_up, model["act"])
    assert_close(out, ref.act_and_mul(gate_up, model["act"]), dtype)
    assert_close(out, layers.ACTIVATIONS[model["act"]](gate_up[:, :inter]) * gate_up[:, inter:], dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 8])
def test_gpu_skinny_linear_real_shapes(m):
    """Qwen3-0.6B/4B projections and the LM head, bf16: the skinny GEMM against the float32 reference
    and against cuBLAS (one bf16 rounding each: within two ulps of the result); o and down also with the
    residual add in the epilogue."""
    from infer.kernels import skinny_gemm as sk

    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in ((1024, 2048), (1024, 3072), (6144, 1024), (2560, 9728), (151936, 1024)):
        x, w = gpu_randn(g, m, k), gpu_randn(g, n, k, scale=0.02)
        out = sk.skinny_linear(x, w)
        assert_close(out, sk.skinny_linear_reference(x, w), torch.bfloat16)
        assert_close(out, torch.nn.functional.linear(x, w), torch.bfloat16)
        if n <= 2560:  # a block's last projection (o, down) with the residual add in its epilogue
            r = gpu_randn(g, m, n, scale=2.0)
            assert_close(sk.skinny_linear(x, w, residual=r), sk.skinny_linear_reference(x, w, residual=r),
                         torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "silu"])
def test_gpu_skinny_norm_linear_real_shapes(activation):
    """Qwen3-0.6B/4B's norm + QKV and norm + gate/up + SiLU, bf16, one row, with the engine's tiles: against
    the reference, and bit for bit the same launched with PDL, in a CUDA graph of back-to-back calls
    (where each call starts while the one before it runs)."""
    from infer.kernels import skinny_gemm as sk

    g = torch.Generator(device="cuda").manual_seed(3)
    for n, k in ((4096, 1024), (6144, 2560)) if activation is None else ((6144, 1024), (19456, 2560)):
        x, r, w = gpu_randn(g, 1, k), gpu_randn(g, 1, k), gpu_randn(g, n, k, scale=0.02)
        nw = gpu_randn(g, k, scale=0.1) + 1
        y_ref, s_ref = sk.skinny_norm_linear_reference(x, r, nw, EPS, False, w, None, activation)
        same_with_pdl_in_a_graph(
            lambda x=x, r=r, nw=nw, w=w: sk.skinny_norm_linear(x, r, nw, EPS, False, w, None, activation), y_ref, s_ref)


def same_with_pdl_in_a_graph(call, y_ref: torch.Tensor, s_ref: torch.Tensor) -> None:
    """``call() -> (y, s)``, once alone and 8 times back to back in a CUDA graph, PDL off and on: ``y``
    within a bf16 rounding of ``y_ref``, ``s`` equal to ``s_ref``, and every ``y`` the same bits."""
    from infer.kernels import pdl

    outs = []
    for on in (False, True):
        with pdl.scope(on):
            y, s = call()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain = [call()[0] for _ in range(8)]
            graph.replay()
            torch.cuda.synchronize()
        assert_close(y, y_ref, torch.bfloat16)
        assert torch.equal(s, s_ref)
        assert all(torch.equal(c, y) for c in chain)
        outs.append(y)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "silu"])
def test_gpu_add_rms_norm_linear_one_row_real_shapes(activation):
    """The engine's one-row "norm, then project" (the norm's kernel, then the skinny GEMM at the tile of a
    projection after a norm, the activation in its epilogue): Qwen3-0.6B/4B's QKV and gate/up, bf16, against
    the reference ops, and bit for bit the same with PDL in a CUDA graph of back-to-back calls (each on
    copies of x and the residual, which the norm overwrites)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    for n, k in ((4096, 1024), (6144, 2560)) if activation is None else ((6144, 1024), (19456, 2560)):
        layer = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        layer.weight.data = gpu_randn(g, n, k, scale=0.02)
        x, r = gpu_randn(g, 1, k), gpu_randn(g, 1, k)
        nw = gpu_randn(g, k, scale=0.1) + 1
        y_ref, s_ref = ref.add_rms_norm_linear(x.clone(), r.clone(), nw, EPS, False, layer, activation)
        same_with_pdl_in_a_graph(
            lambda x=x, r=r, nw=nw, layer=layer: ops.add_rms_norm_linear(x.clone(), r.clone(), nw, EPS, False, layer,
                                                                         activation), y_ref, s_ref)


@pytest.mark.gpu
def test_gpu_skinny_benchmark_runs(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import skinny_gemm as bench

    out = tmp_path / "skinny.json"
    assert bench.main(["--models", "qwen3-0.6b", "--rows", "1", "--flush-bytes", str(64 << 20), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 5 and all(r["max_err_rel"] < 1e-2 and r["skinny_us"] > 0 for r in rows)
    # --fused: the norm's steps around QKV and gate/up, three ways (unfused, one kernel, the engine's two)
    assert bench.main(["--models", "qwen3-0.6b", "--rows", "1", "--projs", "qkv", "gate_up", "--pdl", "--fused",
                       "--fused-only", "--flush-bytes", str(64 << 20), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["proj"] for r in rows] == ["norm+qkv", "norm+gate_up+act"]
    assert all(r["max_err_rel"] < 1e-2 and r["two_kernels_us"] > 0 and r["two_kernels_pdl_us"] > 0 for r in rows)


def compiled_variants(kernel) -> int:
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


@pytest.mark.gpu
def test_gpu_no_recompilation_when_t_changes():
    m = QWEN3_4B
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, hq, hkv, d, inter = m["hidden"], m["hq"], m["hkv"], m["d"], m["inter"]
    x, r = gpu_randn(g, 512, hidden), gpu_randn(g, 512, hidden)
    qkv, gu = gpu_randn(g, 512, (hq + 2 * hkv) * d), gpu_randn(g, 512, 2 * inter)
    pos = torch.arange(512, device="cuda")
    cache = ref.build_cos_sin_cache(inv_freq(d, 1e6).cuda(), 4096, "cuda")
    w, qw, kw = gpu_randn(g, hidden), gpu_randn(g, d), gpu_randn(g, d)

    def step(t):
        ops.rms_norm(x[:t], w, EPS)
        ops.fused_add_rms_norm(x[:t], r[:t], w, EPS)
        ops.qk_norm_rope(qkv[:t], pos[:t], cache, hq, hkv, d, qw, kw, EPS)
        ops.act_and_mul(gu[:t], "silu")

    step(3)
    kernels = (ops._rms_norm_kernel, ops._add_rms_norm_kernel, ops._qk_norm_rope_kernel, ops._act_and_mul_kernel)
    before = [compiled_variants(k) for k in kernels]
    for t in (1, 2, 8, 64, 129, 512):
        step(t)
    torch.cuda.synchronize()
    assert [compiled_variants(k) for k in kernels] == before


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_and_replay():
    """Every op captured in one CUDA graph; replaying it on new inputs (copied into the static buffers)
    gives what eager calls give."""
    m = QWEN3_4B
    g = torch.Generator(device="cuda").manual_seed(1)
    t, hidden, hq, hkv, d, inter = 8, m["hidden"], m["hq"], m["hkv"], m["d"], m["inter"]
    cache = ref.build_cos_sin_cache(inv_freq(d, 1e6).cuda(), 4096, "cuda")
    w, qw, kw = gpu_randn(g, hidden), gpu_randn(g, d), gpu_randn(g, d)
    static = {"x": gpu_randn(g, t, hidden), "r": gpu_randn(g, t, hidden), "qkv": gpu_randn(g, t, (hq + 2 * hkv) * d),
              "gu": gpu_randn(g, t, 2 * inter), "pos": torch.arange(t, device="cuda")}

    def run(b):
        n = ops.rms_norm(b["r"], w, EPS)
        ops.fused_add_rms_norm(b["x"], b["r"], w, EPS)
        ops.qk_norm_rope(b["qkv"], b["pos"], cache, hq, hkv, d, qw, kw, EPS)
        return n, ops.act_and_mul(b["gu"], "silu")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run({k: v.clone() for k, v in static.items()})  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run(static)
    fresh = {"x": gpu_randn(g, t, hidden), "r": gpu_randn(g, t, hidden), "qkv": gpu_randn(g, t, (hq + 2 * hkv) * d),
             "gu": gpu_randn(g, t, 2 * inter), "pos": torch.randint(0, 4096, (t,), generator=g, device="cuda")}
    eager_in = {k: v.clone() for k, v in fresh.items()}
    eager = run(eager_in)
    for k, v in fresh.items():
        static[k].copy_(v)
    graph.replay()
    torch.cuda.synchronize()
    for k in ("x", "r", "qkv"):
        assert torch.equal(static[k], eager_in[k]), k
    assert torch.equal(outs[0], eager[0]) and torch.equal(outs[1], eager[1])


@pytest.mark.gpu
def test_gpu_benchmark_runs(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fused_kernels

    assert fused_kernels.main(["--models", "qwen3-0.6b", "--tokens", "1", "64", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "fused_kernels.json").read_text())
    assert all(r["fused_us"] > 0 and r["fused_gb_s"] > 0 for r in report["rows"])

