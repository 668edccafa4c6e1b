"""KV offload (phase 10): block copies, the host and disk tiers, the tiered lookup, the break-even.

The tier tests run on tiny random KV caches against plain-PyTorch references (``k[:, b]`` and
``v[:, b]`` of the cache); the engine tests compare greedy outputs and logprobs with the
offloaded prefix against a run without prefix caching.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch

from infer.attention.kv_cache import KVCache
from infer.config import EngineConfig
from infer.engine.kv_offload import (
    BlockCopier,
    DiskTier,
    KVOffloader,
    block_nbytes,
    block_shape,
    break_even_tokens,
    tiered_lookup,
)
from tests.test_batching import make_engine
from tests.test_prefix_caching import (
    BS,
    KW,
    assert_drained,
    assert_prefix_pool_consistent,
    assert_same_logprobs,
    eviction_arrivals,
    run_logprobs,
    run_with_aborts,
    shared_prefix_workload,
)

L, NB, TBS, H, D = 3, 8, 4, 2, 5  # layers, blocks, block size, kv heads, head dim


def random_cache(block_major: bool, device="cpu", seed=0, dtype=torch.float32) -> KVCache:
    kv = KVCache(L, NB, TBS, H, D, dtype, device, block_major=block_major)
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


def block_ref(kv: KVCache, b: int) -> torch.Tensor:
    """Block ``b`` across layers from the per-layer views: the reference for every copy."""
    return torch.stack([kv.k[:, b], kv.v[:, b]]).cpu()


# ------------------------------------------------------------------------------- layout, copies


def test_block_major_cache_has_the_same_views_and_contiguous_blocks():
    a, b = KVCache(L, NB, TBS, H, D, torch.float32, "cpu"), KVCache(L, NB, TBS, H, D, torch.float32, "cpu",
                                                                    block_major=True)
    assert a.k.shape == b.k.shape and a.nbytes == b.nbytes and b.blocks[3].is_contiguous()
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor([0, 5, 6, 13, 31])
    for layer in range(L):
        k, v = torch.randn(5, H, D, generator=g), torch.randn(5, H, D, generator=g)
        a.write(layer, k, v, slots)
        b.write(layer, k, v, slots)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    for blk in range(NB):
        assert torch.equal(b.blocks[blk], block_ref(a, blk))
    assert torch.equal(b.read(1, [3, 1], 6)[0], a.read(1, [3, 1], 6)[0])


@pytest.mark.parametrize("block_major", [False, True], ids=["layer_major", "block_major"])
def test_copier_round_trip_moves_every_layer_of_a_block(block_major):
    src, dst = random_cache(block_major, seed=0), random_cache(block_major, seed=1)
    copier = BlockCopier(src)
    bufs = [torch.empty(block_shape(src)) for _ in range(2)]
    copier.to_host([5, 2], bufs)
    assert torch.equal(bufs[0], block_ref(src, 5)) and torch.equal(bufs[1], block_ref(src, 2))
    before = [block_ref(dst, b) for b in range(NB)]
    BlockCopier(dst).to_device(bufs, [0, 7])
    assert torch.equal(block_ref(dst, 0), block_ref(src, 5)) and torch.equal(block_ref(dst, 7), block_ref(src, 2))
    assert all(torch.equal(block_ref(dst, b), before[b]) for b in range(1, 7))  # nothing else written


def test_triton_kernels_read_and_write_the_block_major_cache():
    """The Triton write and attention kernels take the cache's strides: on a block-major layer view
    (interpreted on the CPU) they give exact attention over the raw K/V, and write only their slots."""
    from infer.kernels import decode_attention, kv_cache_write, prefill_attention

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(31)
    hq, hkv, d, bs, n = 4, 2, 32, 16, 21
    k, v, q = (torch.randn(n, h, d, generator=g, dtype=torch.float64) for h in (hkv, hkv, hq))
    kv = KVCache(3, 4, bs, hkv, d, torch.float32, dev, block_major=True)
    kv.blocks.fill_(float("nan"))
    k_cache, v_cache = kv.layer(1)
    assert not k_cache.is_contiguous()
    table = torch.tensor([[3, 1, 0]], dtype=torch.int32)
    pos = torch.arange(n)
    slots = table[0, pos // bs].long() * bs + pos % bs
    kv_cache_write.reshape_and_cache(k.float().to(dev), v.float().to(dev), k_cache, v_cache,
                                     slots.to(dev))
    assert torch.isnan(kv.blocks[:, :, [0, 2]]).all() and torch.isnan(kv.blocks[2]).all()  # other layers, block 2
    i32 = {"dtype": torch.int32, "device": dev}
    out = prefill_attention.paged_prefill_attention(q.float().to(dev), k_cache, v_cache, table.to(dev),
                                                    torch.tensor([0, n], **i32), torch.tensor([n], **i32), n,
                                                    d**-0.5)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=causal, scale=d**-0.5).transpose(0, 1)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-5, rtol=1e-5)
    dec = decode_attention.paged_decode_attention(q[-1:].float().to(dev), k_cache, v_cache, table.to(dev),
                                                  torch.tensor([n], **i32), d**-0.5)
    torch.testing.assert_close(dec.cpu().double(), expected[-1:], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------ the tiers


def test_host_tier_lru_keeps_the_most_recent_blocks_and_restores_them():
    kv = random_cache(False)
    want = {f"h{b}": block_ref(kv, b) for b in range(NB)}
    off = KVOffloader(kv, "host", host_bytes=3 * block_nbytes(kv) + 7)
    assert off.host.num_slots == 3
    off.offload([("h0", 0), ("h1", 1), ("h2", 2)])
    off.offload([("h0", 0)])  # already there: only touched, so h1 is now the least recent
    off.offload([("h3", 3)])
    off.flush()
    assert {k for k in want if k in off.host} == {"h0", "h2", "h3"} and off.contains("h1") is None
    kv.k.zero_()
    kv.v.zero_()  # the device copies are gone: what comes back must come from the tier
    off.restore(["h3", "h0"], [6, 7])
    assert torch.equal(block_ref(kv, 6), want["h3"]) and torch.equal(block_ref(kv, 7), want["h0"])
    s = off.stats()
    assert s["kv_offload_stored_blocks"] == 4 and s["kv_offload_host_evictions"] == 1
    assert s["kv_offload_host_hits"] == 2 and s["kv_offload_host_bytes_restored"] == 2 * block_nbytes(kv)
    with pytest.raises(KeyError):
        off.restore(["h1"], [0])


def test_a_full_tier_evicts_and_a_batch_larger_than_the_tier_spills_the_right_data(tmp_path):
    """Host holds 2 blocks, disk 3: offloading 6 blocks in one call evicts inside the batch; every
    block still held anywhere restores to its own data, and nothing fails."""
    kv = random_cache(True)
    want = {f"h{b}": block_ref(kv, b) for b in range(NB)}
    nb = block_nbytes(kv)
    off = KVOffloader(kv, "disk", host_bytes=2 * nb, disk_dir=str(tmp_path), disk_bytes=3 * nb)
    off.offload([(f"h{b}", b) for b in range(6)])
    off.flush()
    off.disk.flush()
    assert [k for k in want if off.contains(k) == "host"] == ["h4", "h5"]
    assert [k for k in want if off.contains(k) == "disk"] == ["h1", "h2", "h3"]  # h0 fell off the bottom
    kv.k.zero_()
    kv.v.zero_()
    off.restore(["h1", "h2", "h3", "h4", "h5"], [0, 1, 2, 3, 4])
    for i, k in enumerate(["h1", "h2", "h3", "h4", "h5"]):
        assert torch.equal(block_ref(kv, i), want[k]), k
    s = off.stats()
    assert s["kv_offload_disk_hits"] == 3 and s["kv_offload_host_hits"] == 2
    assert s["kv_offload_host_evictions"] == 4 and s["kv_offload_disk_evictions"] == 1
    path = off.disk.path
    assert path.exists() and path.stat().st_size == 3 * nb
    assert off.reset() == 5 and all(off.contains(k) is None for k in want)
    off.check_invariants()
    off.close()
    off.close()
    assert not path.exists()


def test_disk_tier_serves_a_block_before_its_write_lands_and_deletes_its_file(tmp_path):
    shape, nb = (2, 3), 2 * 3 * 4
    tier = DiskTier(tmp_path, 2, shape, torch.float32)
    release = __import__("threading").Event()
    tier._writer.submit(release.wait)  # hold the writer: the next put stays pending
    a, b, c = (torch.full(shape, float(i)) for i in range(3))
    tier.put("a", a)
    assert torch.equal(tier.read("a"), a)  # from the pending copy
    release.set()
    tier.put("b", b)
    assert tier.put("c", c) == "a"  # full: the LRU block goes
    tier.flush()
    assert "a" not in tier and torch.equal(tier.read("b"), b) and torch.equal(tier.read("c"), c)
    assert tier.bytes_written == 3 * nb and len(os.listdir(tmp_path)) == 1
    del tier  # garbage collection removes the file too
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------ exercises


def test_tiered_lookup():
    host, disk, device = {"b", "d", "e"}, {"c", "d", "f"}, {"a", "e"}
    tiers = [("host", host.__contains__), ("disk", disk.__contains__)]
    look = lambda hs: tiered_lookup(hs, device.__contains__, tiers)  # noqa: E731
    assert look(["a", "b", "c", "d", "e", "f"]) == ["device", "host", "disk", "host", "device", "disk"]
    assert look(["a", "x", "b"]) == ["device"]  # a hole ends the prefix
    assert look(["c", "a"]) == ["disk", "device"]  # a device block after a lower-tier one still counts
    assert look(["x", "a"]) == [] and look([]) == []


def test_break_even_tokens():
    def brute(bpt, bw, tps, fixed):
        n = 1
        while n < 10**6:
            if fixed + n * Fraction(bpt) / bw < Fraction(n) / tps:
                return n
            n += 1
        return None

    F = Fraction
    # saving per token 1/100 - 1/200 = 1/200 s; fixed 1/20 s: restore ties at n = 10, wins from 11
    assert break_even_tokens(1, 200, 100, F(1, 20)) == 11 == brute(1, 200, 100, F(1, 20))
    assert break_even_tokens(1, 200, 100, 0) == 1  # no fixed cost: one token already wins
    # plain ints: 1/5 - 1/10 = 1/10 s saved per token, 3/10 s fixed: a tie at 3, a win from 4 (in floats
    # 0.3 / 0.1 is 2.9999999999999996, and the tie would count as a win)
    assert break_even_tokens(1, 10, 5, F(3, 10)) == 4 == brute(1, 10, 5, F(3, 10))
    assert break_even_tokens(2, 200, 100, F(1, 20)) is None  # the copy costs as much as the compute
    assert break_even_tokens(3, 200, 100, 1) is None
    for bpt, bw, tps, fixed in [(147456, 50e9, 20000, 0.002), (46080, 2e9, 600, F(3, 100)), (7, 1000, 90, F(1, 7))]:
        got = break_even_tokens(bpt, bw, tps, fixed)
        assert got == brute(F(bpt), F(bw), F(tps), F(fixed)), (bpt, bw, tps, fixed)
    # the Qwen3-4B shapes: 147456 B/token, 50 GB/s, 20k tok/s prefill, 2 ms fixed -> ~42 tokens
    assert math.isclose(break_even_tokens(147456, 50e9, 20000, 0.002), 0.002 / (1 / 20000 - 147456 / 50e9), abs_tol=1)


# ------------------------------------------------------------------------------------ the flag


def test_kv_offload_config_is_validated():
    with pytest.raises(ValueError, match="kv_offload must be one of"):
        EngineConfig(device="cpu", kv_offload="ssd").validate()
    with pytest.raises(ValueError, match="needs prefix_caching"):
        EngineConfig(device="cpu", kv_offload="host").validate()
    with pytest.raises(ValueError, match="need kv_offload='disk'"):
        EngineConfig(device="cpu", kv_offload_dir="/tmp").validate()
    assert "kv_offload" in EngineConfig.ablation_values()


# ------------------------------------------------------------------------------------ the engine


def offload_kw(mode: str, tmp_path, host_blocks: int, disk_blocks: int, kv_bytes_per_block: int) -> dict:
    kw = dict(prefix_caching=True, kv_offload=mode, kv_offload_bytes=host_blocks * kv_bytes_per_block)
    if mode == "disk":
        kw.update(kv_offload_dir=str(tmp_path), kv_offload_disk_bytes=disk_blocks * kv_bytes_per_block)
    return kw


def check_all(engine) -> None:
    assert_prefix_pool_consistent(engine)
    engine.offloader.check_invariants()


@pytest.mark.parametrize("mode,extra", [("host", {}), ("disk", {}), ("host", {"async_scheduling": True})],
                         ids=["host", "disk", "host-async"])
def test_a_prefix_restored_from_a_tier_gives_the_outputs_of_a_recompute(tiny_llama, tmp_path, mode, extra):
    """A 12-block device cache: two other prompts evict the first prompt's blocks, which come back
    from the host tier (or, with a 2-block host tier, from the disk below it) on its next request:
    the same greedy tokens and logprobs as an engine without any cache, and 16 tokens not prefilled."""
    first, arrivals = eviction_arrivals(tiny_llama.config.vocab_size)
    per_block = BS * tiny_llama.config.kv_bytes_per_token(torch.float32)
    kw = {**KW, "max_model_len": 48, "kv_cache_memory_bytes": 12 * per_block}
    ref = run_logprobs(make_engine(tiny_llama, **kw), arrivals, check=None)
    eng = make_engine(tiny_llama, **kw, **extra,
                      **offload_kw(mode, tmp_path, 64 if mode == "host" else 2, 64, per_block))
    assert eng.runner.kv_cache.blocks is None  # the torch backend keeps the layer-major cache
    got = run_logprobs(eng, arrivals, check=check_all)
    assert_same_logprobs(got, ref)
    st = eng.stats()
    assert got["r1"]["cached"] == 16 and got["r4"]["cached"] == 16  # r1 from the device, r4 from a tier
    assert st["kv_offload_hit_tokens"] == 16 and st["prefix_cache_evictions"] > 0
    assert st[f"kv_offload_{mode}_hits"] > 0
    assert st["kv_offload_host_hits"] + st["kv_offload_disk_hits"] + st["kv_offload_device_copies"] == 4
    assert_drained(eng)
    from prometheus_client import CollectorRegistry, generate_latest

    from infer.server.metrics import SchedulerCollector

    reg = CollectorRegistry()
    reg.register(SchedulerCollector(eng.scheduler, "m"))
    text = generate_latest(reg).decode()
    want = float(st[f"kv_offload_{mode}_hits"])
    assert f'infer:kv_offload_hits_total{{model_name="m",tier="{mode}"}} {want}' in text
    assert 'infer:kv_offload_hit_tokens_total{model_name="m"} 16.0' in text
    eng.shutdown()
    assert os.listdir(tmp_path) == []  # the disk tier's file is gone


HOST_BLOCKS, DISK_BLOCKS = 10, 8


@pytest.mark.parametrize("mode", ["host", "disk"])
def test_stress_tiny_tiers_aborts_and_preemptions(tiny_llama, tmp_path, mode):
    """Random prompts over a few shared prefixes, random aborts, a device pool that forces
    preemptions and evictions, a host tier of 3 blocks (and a disk tier of 6): the pool's and the
    tiers' invariants hold after every step, every request that was not aborted gets the tokens
    of the engine without any cache, and nothing leaks."""
    arrivals, aborts = shared_prefix_workload(tiny_llama.config.vocab_size, 4, 8, 16, 60)
    per_block = BS * tiny_llama.config.kv_bytes_per_token(torch.float32)
    kw = {**KW, "max_model_len": 40, "kv_cache_memory_bytes": 20 * per_block, "chunked_prefill": True,
          "max_num_batched_tokens": 12}
    results = {}
    for offload in (False, True):
        tiers = offload_kw(mode, tmp_path, HOST_BLOCKS, DISK_BLOCKS, per_block) if offload else {}
        eng = make_engine(tiny_llama, **kw, **tiers)
        results[offload] = run_with_aborts(eng, arrivals, aborts, check_all if offload else None)
        if offload:
            assert_drained(eng)
            st = eng.stats()
            assert eng.num_preemptions > 0 and st["kv_offload_host_evictions"] > 0
            assert st["kv_offload_host_hits"] > 0 and (mode == "host" or st["kv_offload_disk_hits"] > 0)
            assert st["kv_offload_host_blocks"] <= HOST_BLOCKS and st["kv_offload_disk_blocks"] <= DISK_BLOCKS
            eng.shutdown()
            assert os.listdir(tmp_path) == []
    done = results[False].keys() & results[True].keys() - set(aborts)
    assert len(done) >= 8
    for rid in done:
        assert results[True][rid]["tokens"] == results[False][rid]["tokens"], rid


def test_benchmark_program_smoke(tiny_llama, tmp_path):
    """benchmarks/kv_offload.py at tiny sizes: every part runs and the report says where the
    restored blocks came from (what it counts, not how fast)."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import kv_offload as bench

    assert bench.main(["--device", "cpu", "--model", str(tiny_llama.path), "--shapes", "smollm2-135m",
                       "--bandwidth-bytes", "2000000", "--prefix-lens", "16", "40", "--tier", "disk",
                       "--multi-turn", "--conversations", "2", "--turns", "2", "--system-len", "24",
                       "--turn-len", "8", "--output-len", "2", "--multi-turn-kv-cache-memory-bytes",
                       str(10 * 16 * tiny_llama.config.kv_bytes_per_token(torch.float32)),
                       "--out", str(tmp_path)]) == 0
    rep = json.loads((tmp_path / "kv_offload.json").read_text())
    rows = rep["restore_vs_recompute"]
    assert [r["prefix_tokens"] for r in rows] == [16, 40]
    assert [r["disk_hit_blocks"] + r["host_hit_blocks"] for r in rows] == [1, 2]  # full blocks before the last token
    assert rows[1]["disk_hit_blocks"] >= 1 and rep["break_even"]["computed_tokens"] is not None
    assert [(r["workload"], r["kv_offload"]) for r in rep["multi_turn"]] == [
        ("2 turn(s)", "none"), ("2 turn(s)", "host"), ("1 turn(s)", "none"), ("1 turn(s)", "host")]
    assert (tmp_path / "kv_offload.png").stat().st_size > 0 and (tmp_path / "kv_offload.md").exists()


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_major", [False, True], ids=["layer_major", "block_major"])
def test_cuda_copies_are_ordered_against_the_compute_stream(block_major):
    """A block offloaded right after a long kernel wrote it, then overwritten right away on the
    compute stream, must reach the host as it was between the two; a block restored and read at
    once on the compute stream must read the restored data. Without the event waits the side
    stream races the compute stream (vLLM #45704)."""
    kv = KVCache(36, 64, 16, 8, 128, torch.bfloat16, "cuda", block_major=block_major)
    copier = BlockCopier(kv)
    pin = [torch.empty(block_shape(kv), dtype=torch.bfloat16, pin_memory=True) for _ in range(8)]
    x = torch.randn(4096, 4096, device="cuda")
    for trial in range(3):
        for _ in range(20):
            x = x @ x / 64  # keep the compute stream busy
        kv.k[:, :8].fill_(trial + 1.0)
        kv.v[:, :8].fill_(-(trial + 1.0))
        ev = copier.to_host(list(range(8)), pin)
        kv.k.zero_()
        kv.v.zero_()
        ev.synchronize()
        assert all(bool((p[0] == trial + 1).all() and (p[1] == -(trial + 1)).all()) for p in pin)
        for _ in range(20):
            x = x @ x / 64
        copier.to_device(pin, list(range(8, 16)))
        got = kv.k[:, 8:16].float().mean().item(), kv.v[:, 8:16].float().mean().item()  # compute stream
        assert got == (trial + 1.0, -(trial + 1.0))


def restore_scenario(vocab: int) -> list:
    """The first prompt (4 full blocks of 4 tokens and one more token) runs, hits on the device,
    is evicted by two longer prompts, and comes back while a short unrelated request decodes."""
    return eviction_arrivals(vocab, short_len=5)[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["host", "disk"])
def test_gpu_bf16_prefix_restored_from_a_tier_gives_the_greedy_tokens_of_a_recompute(tiny_llama, tmp_path, mode):
    """bf16 on the GPU, Triton backend (block-major cache, copies on the side stream): the
    prefix evicted from a 12-block device cache comes back from the host (or disk) tier while
    another request decodes, with the greedy tokens of an engine without any cache."""
    from infer.engine.llm_engine import LLMEngine
    from infer.loader import load_model

    loaded = load_model(str(tiny_llama.path), device="cuda", dtype=torch.bfloat16, progress=False)
    arrivals = restore_scenario(loaded.config.vocab_size)
    per_block = BS * loaded.config.kv_bytes_per_token(torch.bfloat16)
    kw = dict(model=str(loaded.path), device="cuda", dtype="bfloat16", **{**KW, "max_model_len": 48},
              kv_cache_memory_bytes=12 * per_block)
    ref = run_logprobs(LLMEngine(EngineConfig(**kw), loaded=loaded), arrivals, check=None)
    eng = LLMEngine(EngineConfig(**kw, **offload_kw(mode, tmp_path, 64 if mode == "host" else 2, 64, per_block)),
                    loaded=loaded)
    assert eng.runner.kv_cache.blocks is not None and eng.kv_manager.num_blocks == 12
    got = run_logprobs(eng, arrivals, check=check_all)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in ref.items()}
    st = eng.stats()
    assert got["r5"]["cached"] == 16 and st["kv_offload_hit_tokens"] == 16 and st[f"kv_offload_{mode}_hits"] > 0
    eng.shutdown()
    assert os.listdir(tmp_path) == []
