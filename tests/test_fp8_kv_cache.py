"""FP8 KV cache (phase 11, ``kv_cache_dtype='fp8'``): the format, each kernel that writes or reads an
FP8 cache against its plain-PyTorch twin, and the engine with one.

* The format: :func:`quantize_kv` against the e4m3 grid worked out by hand (its step and its clamp).
* Kernels (the Triton interpreter on the CPU, tiny shapes): the cache write, the RoPE kernel that
  writes the cache (phase 8) and the paged decode and prefill attention, on fresh random inputs with
  random per-layer scales, against :mod:`infer.kernels.attention_reference` /
  :mod:`infer.kernels.fused_reference`.
* The engine (a tiny random Llama, the torch backend): the greedy tokens and logprobs equal those of
  the float model whose K/V are rounded through e4m3 by the test itself (the only difference an FP8
  cache may make), the prefix cache and KV offload give the cold run's tokens and logprobs, the
  pool holds 4x the float32 blocks in the same bytes, a host-tier round trip is byte-identical, and
  ``calculate_kv_scales`` sets each layer's scales from the first prompt's K/V.
"""

from __future__ import annotations

import pytest
import torch

from infer.attention import AttentionMetadata
from infer.attention.kv_cache import K_SCALE_CONSTANT, V_SCALE_CONSTANT, KVCache
from infer.attention.torch_backend import TorchAttentionBackend
from infer.config import EngineConfig
from infer.kernels import attention_reference as ref
from infer.kernels import decode_attention as dec
from infer.kernels import fused_reference as fref
from infer.kernels import fused_triton as fops
from infer.kernels import kv_cache_write as kvw
from infer.kernels import prefill_attention as pre
from infer.kernels.attention_reference import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from infer.sampling import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = FP8_KV_DTYPE


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, built from the format's definition (4 exponent bits, bias
    7, 3 mantissa bits, subnormals at exponent field 0, 0x7F is NaN), sorted."""
    vals = [m / 8 * 2.0**-6 for m in range(8)]  # subnormals: 0.m * 2^(1 - 7)
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8) if not (e == 15 and m == 7)]
    return torch.tensor(sorted(vals), dtype=torch.float64)


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x`` (within +-448) to the nearest grid value, ties to the even code: the reference for
    :func:`quantize_kv`, by search over the grid."""
    grid = e4m3_grid()
    a = x.double().abs()
    i = torch.searchsorted(grid, a).clamp(1, len(grid) - 1)
    lo, hi = grid[i - 1], grid[i]
    pick_hi = (hi - a < a - lo) | ((hi - a == a - lo) & (i % 2 == 0))  # grid index parity = code parity
    return torch.where(pick_hi, hi, lo).copysign(x.double())


# ------------------------------------------------------------------------------------ the format


def test_quantize_kv_is_the_nearest_e4m3_value_of_x_over_scale_clamped_at_448():
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.37])
    x = torch.cat([torch.randn(4000, generator=g) * s for s in (1e-3, 0.03, 1.0, 30.0)])
    x = torch.cat([x, torch.tensor([0.0, 448 * 0.37, 460 * 0.37, -1e4, 127.5 * 0.37, 2.0**-10 * 0.37])])
    got = dequantize_kv(quantize_kv(x, scale), scale, torch.float64)
    y = (x / scale).double().clamp(-448, 448)  # the float32 quotient; its rounding to e4m3 is under test
    torch.testing.assert_close(got, nearest_e4m3(y) * scale.double(), rtol=1e-7, atol=0)
    # the step: a normal value is within 2^-4 of itself, a subnormal within 2^-10 * scale
    err = (got - x.double()).abs()
    inside = y.abs() < 448
    assert bool((err[inside] <= torch.maximum(x.double().abs() * 2.0**-4, torch.tensor(0.3701 * 2.0**-10))[inside]).all())
    assert got[-3].item() == pytest.approx(-448 * 0.37, rel=1e-6)  # saturated, not NaN


# ------------------------------------------------------------------------------------ kernels


def fp8_pair(k: torch.Tensor, v: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor):
    return quantize_kv(k, ks), quantize_kv(v, vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_the_reference_codes(dtype):
    g = torch.Generator().manual_seed(1)
    nb, bs, hkv, d, t = 6, 5, 2, 24, 11
    ks, vs = torch.rand(1, generator=g) * 0.1 + 0.01, torch.rand(1, generator=g) * 0.1 + 0.01
    key = (torch.randn(t, hkv, d, generator=g) * 3).to(dtype)
    value = (torch.randn(t, hkv, d, generator=g) * 0.5).to(dtype)
    key[0, 0, :4] = torch.tensor([127.5, 60.0, -1e3, 0.0]).to(dtype) * ks  # a carry into the exponent, clamps
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[2] = -1  # padding: nothing written
    init = quantize_kv(torch.randn(nb, bs, hkv, d, generator=g), 1.0)
    kc, vc, kr, vr = (init.clone().to(DEVICE) for _ in range(4))
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    kvw.reshape_and_cache(dev(key), dev(value), kc, vc, dev(slots), dev(ks), dev(vs))
    kr, vr = kr.cpu(), vr.cpu()
    ref.reshape_and_cache(key, value, kr, vr, slots, ks, vs)
    # the same values (a -0 may come out +0: the interpreter's conversion drops the sign of a zero)
    assert torch.equal(kc.cpu().float(), kr.float()) and torch.equal(vc.cpu().float(), vr.float())
    keep = torch.ones(nb * bs, dtype=torch.bool)
    keep[slots[slots >= 0]] = False  # every slot not written keeps its bytes
    assert torch.equal(kc.cpu().view(torch.uint8).flatten(0, 1)[keep], init.view(torch.uint8).flatten(0, 1)[keep])
    written = kr.float().flatten(0, 1)[slots[slots >= 0]]
    assert torch.equal(written, nearest_e4m3((key[slots >= 0].double() / ks.double()).clamp(-448, 448)).float())


def scaled_case(seq_lens, hkv, d, bs, seed):
    """An FP8 paged cache with random K/V of each sequence, random scales, tables pointing at shuffled
    blocks: ``(k8, v8, ks, vs, tables, seq_lens)``."""
    g = torch.Generator().manual_seed(seed)
    needs = [-(-n // bs) for n in seq_lens]
    nb = sum(needs) + 2
    ks, vs = torch.rand(1, generator=g) * 0.02 + 0.005, torch.rand(1, generator=g) * 0.02 + 0.005
    k8, v8 = fp8_pair(torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g) * 0.3, ks, vs)
    perm = torch.randperm(nb, generator=g)
    tables = torch.zeros(len(seq_lens), max(needs) + 1, dtype=torch.int32)
    used = 0
    for b, need in enumerate(needs):
        tables[b, :need] = perm[used:used + need].to(torch.int32)
        used += need
    return k8, v8, ks, vs, tables, torch.tensor(seq_lens, dtype=torch.int32), g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_reads_an_fp8_cache_like_the_reference(dtype):
    hq, hkv, d, bs = 8, 2, 32, 8
    k8, v8, ks, vs, tables, lens, g = scaled_case([37, 5, 20], hkv, d, bs, seed=2)
    q = torch.randn(3, hq, d, generator=g).to(dtype)
    expected = ref.paged_decode_attention(q.float(), k8, v8, tables, lens, d**-0.5, k_scale=ks, v_scale=vs)
    # the reference reads what the codes stand for: the same as attending over the dequantized cache
    plain = ref.paged_decode_attention(q.float(), k8.float() * ks, v8.float() * vs, tables, lens, d**-0.5)
    torch.testing.assert_close(expected, plain, rtol=1e-6, atol=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for splits, window in ((1, None), (3, None), (2, 9)):
        exp = expected if window is None else ref.paged_decode_attention(
            q.float(), k8, v8, tables, lens, d**-0.5, window=window, k_scale=ks, v_scale=vs)
        out = dec.paged_decode_attention(q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), tables.to(DEVICE),
                                         lens.to(DEVICE), d**-0.5, window=window, num_splits=splits,
                                         k_scale=ks.to(DEVICE), v_scale=vs.to(DEVICE))
        torch.testing.assert_close(out.float().cpu(), exp, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_paged_prefill_reads_an_fp8_cache_like_the_reference(dtype):
    hq, hkv, d, bs = 4, 2, 16, 8
    seq_lens, q_lens = [22, 9, 5], [7, 9, 1]
    k8, v8, ks, vs, tables, lens, g = scaled_case(seq_lens, hkv, d, bs, seed=3)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hq, d, generator=g).to(dtype)
    qsl = torch.tensor(starts, dtype=torch.int32)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for splits, window in ((2, 6),):  # split-KV (partials, then the merge kernel) and a window
        exp = ref.paged_prefill_attention(q.float(), k8, v8, tables, qsl, lens, max(q_lens), d**-0.5, window=window,
                                          k_scale=ks, v_scale=vs)
        out = pre.paged_prefill_attention(q.to(DEVICE), k8.to(DEVICE), v8.to(DEVICE), tables.to(DEVICE),
                                          qsl.to(DEVICE), lens.to(DEVICE), max(q_lens), d**-0.5, window=window,
                                          num_splits=splits, k_scale=ks.to(DEVICE), v_scale=vs.to(DEVICE))
        torch.testing.assert_close(out.float().cpu(), exp, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_kernel_writes_the_reference_fp8_codes(dtype):
    """The fused QK-norm + RoPE kernel (phase 8) that also writes the cache: the same e4m3 codes as the
    reference (the rotated k and the loaded v over the layer's scales), padding slots untouched."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, d, t, nb, bs = 4, 2, 32, 6, 5, 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    qw, kw = (torch.randn(d, generator=g) * 0.5).to(dtype), (torch.randn(d, generator=g) * 0.5).to(dtype)
    cache = fref.build_cos_sin_cache(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), 64, "cpu")
    pos = torch.randint(0, 64, (t,), generator=g)
    slots = torch.randperm(nb * bs, generator=g)[:t]
    slots[1] = -1
    ks, vs = torch.tensor([0.013]), torch.tensor([0.004])
    init = quantize_kv(torch.randn(nb, bs, hkv, d, generator=g), 1.0)
    kc, vc, kr, vr = init.clone().to(DEVICE), init.clone().to(DEVICE), init.clone(), init.clone()
    a = qkv.clone().to(DEVICE)
    fops.qk_norm_rope(a, pos.to(DEVICE), cache.to(DEVICE), hq, hkv, d, qw.to(DEVICE), kw.to(DEVICE), 1e-6, False,
                      kv_cache=(kc, vc), slot_mapping=slots.to(DEVICE), kv_scales=(ks.to(DEVICE), vs.to(DEVICE)))
    _, k, _ = fref.qk_norm_rope(qkv.clone(), pos, cache, hq, hkv, d, qw, kw, 1e-6, False, kv_cache=(kr, vr),
                                slot_mapping=slots, kv_scales=(ks, vs))
    # codes equal, or (where the two rotations differ by an ulp of the dtype right at a rounding
    # boundary of e4m3) one step apart
    diff = (kc.cpu().float() - kr.float()).abs()
    assert bool((diff <= kr.float().abs() * 2.0**-3 + 1e-9).all())
    assert (diff > 0).float().mean() < 0.02
    assert torch.equal(vc.cpu().float(), vr.float())
    keep = torch.ones(nb * bs, dtype=torch.bool)
    keep[slots[slots >= 0]] = False
    assert torch.equal(kc.cpu().float().flatten(0, 1)[keep], init.float().flatten(0, 1)[keep])


def test_kernels_reject_bad_scales():
    k8 = quantize_kv(torch.randn(2, 4, 1, 16), 1.0)
    key = torch.randn(1, 1, 16)
    with pytest.raises(ValueError, match="k_scale"):
        kvw.reshape_and_cache(key, key, k8, k8.clone(), torch.tensor([0]), torch.ones(2), torch.ones(1))
    with pytest.raises(ValueError, match="v_scale"):
        dec.paged_decode_attention(torch.randn(1, 2, 16), k8, k8, torch.zeros(1, 1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32), 0.25, v_scale=torch.ones(1, dtype=torch.float64))


# ------------------------------------------------------------------------------------ the engine

ENGINE = dict(kv_cache="paged", block_size=4, batching="continuous", max_model_len=64, max_num_seqs=4,
              kv_cache_dtype="fp8")


class RoundedKV(TorchAttentionBackend):
    """The reference: a plain list of each layer's K/V, every value rounded to e4m3 by the test's own
    grid search (:func:`nearest_e4m3`) with the given per-layer scales as it is appended, and SDPA of
    the new tokens over all of it. Each position's K/V is computed once, in the forward that adds it
    (as in the engine: recomputing it in a longer forward can move its last float32 bit, and with it an
    e4m3 code that sits on a rounding boundary). Records each layer's first K and V."""

    def __init__(self, k_scales, v_scales):
        self.k_scales, self.v_scales, self.seen, self.kv = k_scales, v_scales, {}, {}

    def forward(self, layer_idx, q, k, v, meta, scale, window, kv_written=False):
        from infer.attention.torch_backend import sdpa_attention

        self.seen.setdefault(layer_idx, (k.clone(), v.clone()))
        ks, vs = float(self.k_scales[layer_idx]), float(self.v_scales[layer_idx])
        k = (nearest_e4m3((k / ks).double().clamp(-448, 448)) * ks).to(k.dtype)
        v = (nearest_e4m3((v / vs).double().clamp(-448, 448)) * vs).to(v.dtype)
        old_k, old_v = self.kv.get(layer_idx, (k[:0], v[:0]))
        self.kv[layer_idx] = (torch.cat([old_k, k]), torch.cat([old_v, v]))
        return sdpa_attention(q, *self.kv[layer_idx], scale, window)


def greedy_reference(model, prompt: list[int], n: int, backend) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs: the prompt in one forward, then one token per forward."""
    model.set_attention_backend(backend)
    ids, lps, done = list(prompt), [], 0
    with torch.inference_mode():
        for _ in range(n):
            new = ids[done:]
            hidden = model(torch.tensor(new), torch.arange(done, len(ids)), AttentionMetadata.for_prefill([len(new)], "cpu"))
            done = len(ids)
            logp = model.compute_logits(hidden[-1:]).float().log_softmax(-1)[0]
            ids.append(int(logp.argmax()))
            lps.append(float(logp[ids[-1]]))
    return ids[len(prompt):], lps


@pytest.mark.parametrize("calibrate,extra", [(False, {}), (True, {}),
                                             (False, dict(attention_backend="triton"))],
                         ids=["scale-1", "calculate_kv_scales", "triton-scale-1"])
def test_engine_gives_the_model_with_e4m3_rounded_kv(tiny_llama, calibrate, extra):
    """The engine with an FP8 cache (paged, prefill then decode steps, two sequences in a batch) gives
    the greedy tokens and logprobs of the float model whose every K and V value is rounded to the
    nearest e4m3 value of ``x / scale`` (times scale): the only difference the format may make. With
    ``calculate_kv_scales``, each layer's scales are ``max|k| / 200`` and ``max|v| / 100`` of the first
    prompt's K/V (computed here from the reference's own K/V), kept for the second request. With the
    Triton backend (the interpreter on a CPU): its cache write, decode and prefill kernels.

    Only where the float32 K/V are bit-identical to the reference's: a last-bit difference moves a value
    that sits on a rounding boundary of e4m3 to the neighbouring code, a step of 6%. Fused kernels
    (other float32 rounding) and calibrated scales under the Triton backend (whose attention output
    differs in the last bits, so the next layer's ``max|k|`` does) are such cases: the largest value
    ``max|k| / scale`` is 200 by construction, exactly halfway between the e4m3 values 192 and 208, so an
    ulp decides which. (The RoPE kernel's write is tested against its reference above.)"""
    from tests.test_batching import make_engine

    vocab = tiny_llama.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (13, 6)]
    eng = make_engine(tiny_llama, **ENGINE, calculate_kv_scales=calibrate, **extra)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    eng.add_request(prompts[0], params, request_id="0")
    eng.step()  # the first prefill alone: it sets the scales (with calibrate)
    kv = eng.runner.kv_cache
    k_scales, v_scales = kv.k_scale.clone(), kv.v_scale.clone()
    eng.add_request(prompts[1], params, request_id="1")
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step(stream=False):
            out[o.request_id] = (o.outputs[0].token_ids, [p.token.logprob for p in o.outputs[0].logprobs])
    assert torch.equal(kv.k_scale, k_scales) and torch.equal(kv.v_scale, v_scales)  # frozen after the first
    if not calibrate:
        assert bool((k_scales == 1).all() and (v_scales == 1).all())
    for rid, prompt in enumerate(prompts):
        backend = RoundedKV(k_scales, v_scales)
        tokens, lps = greedy_reference(tiny_llama.model, prompt, 6, backend)
        assert out[str(rid)][0] == tokens, rid
        assert out[str(rid)][1] == pytest.approx(lps, abs=1e-4), rid
        if calibrate and rid == 0:  # the scales came from this prompt's prefill
            for layer, (k, v) in backend.seen.items():
                assert float(k_scales[layer]) == pytest.approx(float(k.abs().max()) / K_SCALE_CONSTANT, rel=1e-6)
                assert float(v_scales[layer]) == pytest.approx(float(v.abs().max()) / V_SCALE_CONSTANT, rel=1e-6)


def test_prefix_hits_and_offloaded_blocks_give_the_cold_fp8_run(tiny_llama):
    """With an FP8 cache, a prefix found in the device's prefix cache, and one evicted to the host tier
    and restored from it (the same bytes), give the tokens and logprobs of an engine that recomputes."""
    from tests.test_batching import make_engine
    from tests.test_prefix_caching import BS, assert_same_logprobs, eviction_arrivals, run_logprobs

    first, arrivals = eviction_arrivals(tiny_llama.config.vocab_size)
    per_block = BS * tiny_llama.config.kv_bytes_per_token(E4M3)
    kw = {**ENGINE, "block_size": BS, "max_model_len": 48, "kv_cache_memory_bytes": 12 * per_block}
    ref_out = run_logprobs(make_engine(tiny_llama, **kw), arrivals, check=None)
    eng = make_engine(tiny_llama, **kw, prefix_caching=True, kv_offload="host", kv_offload_bytes=64 * per_block)
    assert eng.runner.kv_cache.num_blocks == 12 and eng.offloader.host.buffers.dtype == E4M3
    got = run_logprobs(eng, arrivals, check=None)
    assert_same_logprobs(got, ref_out)
    assert got["r1"]["cached"] == 16 and got["r4"]["cached"] == 16  # r1 from the device, r4 from the host tier
    assert eng.stats()["kv_offload_host_hits"] > 0


def test_the_pool_holds_twice_the_bf16_blocks_in_the_same_bytes(tiny_llama):
    from infer.engine.memory import cache_sizes

    cfg = tiny_llama.config
    budget = 40 * 16 * cfg.kv_bytes_per_token(torch.float32)  # 40 float32 blocks of 16 tokens
    blocks = {dt: cache_sizes(tiny_llama, 16, 64, 1000, 64, budget, kv_cache_dtype=dt)[0]
              for dt in (None, torch.bfloat16, E4M3)}
    assert blocks == {None: 40, torch.bfloat16: 80, E4M3: 160}
    kv = KVCache(cfg.num_kv_layers, blocks[E4M3], 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu",
                 cache_dtype=E4M3)
    assert kv.k.dtype == E4M3 and kv.nbytes == budget  # one byte per value, the whole budget


@pytest.mark.parametrize("block_major", [False, True], ids=["layer-major", "block-major"])
def test_a_host_tier_round_trip_is_byte_identical(block_major):
    from infer.engine.kv_offload import BlockCopier, block_shape

    src = KVCache(2, 6, 4, 2, 8, torch.float32, "cpu", block_major=block_major, cache_dtype=E4M3)
    g = torch.Generator().manual_seed(6)
    src.k.copy_(quantize_kv(torch.randn(src.k.shape, generator=g), 1.0))
    src.v.copy_(quantize_kv(torch.randn(src.v.shape, generator=g) * 1e-3, 1.0))  # subnormals too
    dst = KVCache(2, 6, 4, 2, 8, torch.float32, "cpu", block_major=block_major, cache_dtype=E4M3)
    bufs = [torch.empty(block_shape(src), dtype=src.k.dtype) for _ in range(2)]
    BlockCopier(src).to_host([4, 1], bufs)
    BlockCopier(dst).to_device(bufs, [0, 5])
    for s, d in ((4, 0), (1, 5)):
        assert torch.equal(src.k[:, s].view(torch.uint8), dst.k[:, d].view(torch.uint8))
        assert torch.equal(src.v[:, s].view(torch.uint8), dst.v[:, d].view(torch.uint8))


def test_kv_cache_dtype_is_validated():
    assert EngineConfig(device="cpu", kv_cache_dtype="fp8_e4m3").validate().resolved_kv_cache_dtype() == E4M3
    assert EngineConfig(device="cpu").validate().resolved_kv_cache_dtype() is None
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(device="cpu", kv_cache_dtype="int8").validate()
    with pytest.raises(ValueError, match="calculate_kv_scales .* needs kv_cache_dtype='fp8'"):
        EngineConfig(device="cpu", calculate_kv_scales=True).validate()
    with pytest.raises(ValueError, match="tensor/expert parallelism"):
        EngineConfig(device="cpu", kv_cache_dtype="fp8", tensor_parallel_size=2).validate()
    from infer.model_config import ModelConfig, RopeConfig

    hybrid = ModelConfig("qwen3_5", 64, 8, 16, 2, 2, 2, 4, 1e-6, 64, RopeConfig(1e4),
                         layer_types=["linear_attention", "full_attention"])
    with pytest.raises(ValueError, match="not supported for hybrid models"):
        EngineConfig(model="x", device="cpu", kv_cache_dtype="fp8").validate().validate_model(hybrid)


# ------------------------------------------------------------------------------------ GPU, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,group", [(128, 4), (64, 8), (256, 2)])
def test_gpu_fp8_decode_and_prefill_at_real_shapes(head_dim, group):
    """Qwen3-like shapes on the GPU, bf16 queries over an FP8 cache with random scales: the Triton decode
    (auto split plan and 4 splits) and prefill (an extend after a long prefix) against the reference."""
    hkv, bs = 8 if head_dim < 256 else 4, 16
    hq = hkv * group
    seq_lens = [1, 17, 4096, 1000, 8191]
    k8, v8, ks, vs, tables, lens, g = scaled_case(seq_lens, hkv, head_dim, bs, seed=head_dim + group)
    k8, v8, ks, vs, tables, lens = (x.cuda() for x in (k8, v8, ks, vs, tables, lens))
    q = torch.randn(len(seq_lens), hq, head_dim, generator=g).to(torch.bfloat16).cuda()
    expected = ref.paged_decode_attention(q.float(), k8, v8, tables, lens, head_dim**-0.5, k_scale=ks, v_scale=vs)
    for splits in (None, 4):
        out = dec.paged_decode_attention(q, k8, v8, tables, lens, head_dim**-0.5, num_splits=splits, k_scale=ks,
                                         v_scale=vs)
        err = ((out.float() - expected).norm() / expected.norm()).item()
        assert err < 1e-2, (splits, err)
    q_lens = [1, 17, 512, 1000, 64]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
    qp = torch.randn(int(starts[-1]), hq, head_dim, generator=g).to(torch.bfloat16).cuda()
    exp = ref.paged_prefill_attention(qp.float(), k8, v8, tables, starts, lens, max(q_lens), head_dim**-0.5,
                                      k_scale=ks, v_scale=vs)
    out = pre.paged_prefill_attention(qp, k8, v8, tables, starts, lens, max(q_lens), head_dim**-0.5,
                                      max_context=max(seq_lens), k_scale=ks, v_scale=vs)
    assert ((out.float() - exp).norm() / exp.norm()).item() < 1e-2
