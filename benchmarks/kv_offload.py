"""KV offload (phase 10): copy bandwidths of the tiers, restore vs recompute, a multi-turn workload.

    # CPU (smollm2-135m): bandwidths, then a 3000-token prefix restored from the disk tier vs recomputed
    python benchmarks/kv_offload.py --device cpu --model smollm2-135m --shapes smollm2-135m \\
        --prefix-lens 500 1000 2000 3000 --tier disk
    # GPU (Qwen3-4B shapes, a synthetic checkpoint): H2D bandwidth, 8k/16k from the host tier, multi-turn
    python benchmarks/kv_offload.py --device cuda --model /tmp/qwen3-4b --shapes qwen3-4b \\
        --prefix-lens 1024 4096 8192 16384 --tier host --multi-turn --out /tmp/phase10-gpu

Three parts, in one process, one report (``kv_offload.json``, ``kv_offload.md``, ``kv_offload.png``, in
``--out DIR``, default ``benchmarks/runs/``):

1. **bandwidths** (``--shapes`` picks the KV block's shape; no model needed): host memcpy, one
   block across all layers gathered from the KV cache into a host buffer with the block-major
   layout (one contiguous copy) and the layer-major one (``2 * num_layers`` pieces); the disk
   tier's write (into the page cache, then ``fsync`` to the disk) and read (from the page
   cache, and cold after the pages were dropped); on CUDA host-to-device and device-to-host,
   pinned and pageable.
2. **restore vs recompute** (``--prefix-lens``): TTFT (one output token) of a prompt whose
   prefix is (a) new: recomputed, (b) restored from ``--tier`` (host or disk): the prefix ran
   once, then other prompts evicted it from the device, (c) still on the device. The engine
   runs with ``prefix_caching`` and ``kv_offload``; the ratio recompute / restore is the claim.
   The break-even prefix length is computed from the measured bandwidth and prefill rate
   (:func:`infer.engine.kv_offload.break_even_tokens`) and read off the measured curves.
3. **multi-turn** (``--multi-turn``): conversations whose history (the working set) is larger
   than the device's KV pool (``--kv-cache-memory-bytes``); every turn resends its history.
   Throughput and TTFT with ``kv_offload`` none vs host, and the ITL of a run where nothing hits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import (
    engine_overrides,
    environment,
    free_device_memory,
    markdown_table,
    out_argument,
    save_figure,
    sync,
    timed,
    ttft_alone,
    write_report,
)

from infer.attention.kv_cache import KVCache
from infer.engine.kv_offload import BlockCopier, DiskTier, block_nbytes, block_shape

#: (num_layers, num_kv_heads, head_dim) of the KV cache of some models
SHAPES = {"smollm2-135m": (30, 3, 64), "qwen3-4b": (36, 8, 128), "qwen3-0.6b": (28, 8, 128)}


def token_range(vocab: int) -> tuple[int, int]:
    """Random prompt token ids: ordinary tokens, clear of the special ones at either end."""
    return min(1000, vocab // 4), min(vocab - 8, 20000)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def best_of(fn, device, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timed calls after a warm-up (seconds; device synchronized)."""
    return timed(fn, device, repeats, stat=min)


# -------------------------------------------------------------------------------- 1. bandwidths


def bandwidths(device: torch.device, shapes: str, block_size: int, dtype: torch.dtype, total_bytes: int,
               disk_dir: str) -> list[dict[str, Any]]:
    """GB/s of each copy a tier does, on ``total_bytes`` worth of KV blocks."""
    layers, heads, head_dim = SHAPES[shapes]
    probe = KVCache(layers, 1, block_size, heads, head_dim, dtype, "cpu")
    nblk = max(2, total_bytes // block_nbytes(probe))
    del probe
    rows: list[dict[str, Any]] = []

    def add(name: str, nbytes: int, seconds: float, copies: int) -> None:
        rows.append({"copy": name, "MB": round(nbytes / 1e6, 1), "copies": copies, "ms": round(seconds * 1e3, 2),
                     "GB/s": round(gbps(nbytes, seconds), 2)})
        print(f"  {name:<48} {gbps(nbytes, seconds):8.2f} GB/s")

    add("host memcpy (one large copy)", total_bytes, memcpy_s(total_bytes), 1)
    host_blocks = None
    for block_major in (True, False):
        host_blocks = layout_copies(add, device, (layers, nblk, block_size, heads, head_dim), dtype, block_major)
    # the disk tier: one slot per block; writes by its background thread
    shape = tuple(host_blocks.shape[1:])
    tier = DiskTier(disk_dir, nblk, shape, dtype)
    data = [host_blocks[i].clone() for i in range(nblk)]
    t = time.perf_counter()
    for i in range(nblk):
        tier.put(i, data[i])
    tier.flush()
    t_write = time.perf_counter() - t
    add("disk tier write (into the page cache)", nblk * tier.nbytes, t_write, nblk)
    t = time.perf_counter()
    tier._mm.flush()
    os.fsync(os.open(tier.path, os.O_RDONLY))
    add("disk tier write-back (fsync to the disk)", nblk * tier.nbytes, time.perf_counter() - t, 1)
    out = torch.empty(shape, dtype=dtype)

    def read_all() -> None:
        for i in range(nblk):
            out.copy_(tier.read(i))

    add("disk tier read (page cache)", nblk * tier.nbytes, best_of(read_all, "cpu", 3), nblk)
    tier.drop_page_cache()
    t = time.perf_counter()
    read_all()
    add("disk tier read (cold: pages dropped)", nblk * tier.nbytes, time.perf_counter() - t, nblk)
    tier.close()
    return rows


def memcpy_s(nbytes: int) -> float:
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    return best_of(lambda: dst.copy_(src), "cpu")


def layout_copies(add, device: torch.device, dims: tuple[int, ...], dtype: torch.dtype,
                  block_major: bool) -> torch.Tensor:
    """Time the block copies out of and into a cache of ``dims`` in one layout; returns the host blocks."""
    layers, nblk = dims[0], dims[1]
    cuda = device.type == "cuda"
    kv = KVCache(*dims, dtype, device, block_major=block_major)
    kv.k.normal_()
    kv.v.normal_()
    bufs = torch.empty((nblk, *block_shape(kv)), dtype=dtype, pin_memory=cuda)
    copier = BlockCopier(kv)
    blocks = list(range(nblk))
    name = "block-major" if block_major else "layer-major"
    pieces = nblk * (1 if block_major else 2 * layers)
    nbytes = nblk * block_nbytes(kv)
    t = best_of(lambda: copier.to_host(blocks, list(bufs)), device)
    add(f"{'device->host (pinned)' if cuda else 'KV cache->host tier'}, {name}", nbytes, t, pieces)
    t = best_of(lambda: copier.to_device(list(bufs), blocks), device)
    add(f"{'host (pinned)->device' if cuda else 'host tier->KV cache'}, {name}", nbytes, t, pieces)
    if cuda and block_major:  # pageable host memory: the copy goes through a staging buffer
        page = torch.empty(bufs.shape, dtype=dtype)
        add("device->host (pageable), block-major", nbytes, best_of(lambda: page.copy_(kv.blocks), device), 1)
        add("host (pageable)->device, block-major", nbytes, best_of(lambda: kv.blocks.copy_(page), device), 1)
    return bufs


# ------------------------------------------------------------------------ 2. restore vs recompute


def make_engine(args, offload: str, **over: Any):
    from infer.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine

    kw = dict(model=args.model, device=args.device, dtype=args.dtype, kv_cache="paged", block_size=args.block_size,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, batching="continuous",
              prefix_caching=True, kv_offload=offload, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    if args.chunked_prefill:
        kw.update(chunked_prefill=True, max_num_batched_tokens=args.max_num_batched_tokens)
    if offload != "none":
        kw["kv_offload_bytes"] = args.kv_offload_bytes
    if offload == "disk":
        kw["kv_offload_bytes"] = 1 << 20  # replaced below by a one-block host tier
    if offload == "disk":
        kw.update(kv_offload_dir=args.disk_dir, kv_offload_disk_bytes=args.kv_offload_disk_bytes)
    kw.update(engine_overrides(args.engine_args))
    kw.update(over)
    engine = LLMEngine(EngineConfig(**kw), progress=False)
    if offload == "disk":  # a one-block host tier: what the device evicts goes on to the disk
        from infer.engine.kv_offload import HostTier

        off = engine.offloader
        off.host = HostTier(1, off.shape, engine.runner.dtype, pin=off.cuda)
    return engine


def restore_vs_recompute(args, engine) -> list[dict[str, Any]]:
    """TTFT of a prefix: recomputed, restored from the tier, found on the device."""
    import random

    rng = random.Random(args.seed)
    vocab = engine.vocab_size
    lo, hi = token_range(vocab)
    tok = lambda n: [rng.randrange(lo, hi) for _ in range(n)]  # noqa: E731
    rows = []
    ttft_alone(engine, tok(40))  # warm-up: the first forward pays one-time costs
    for n in args.prefix_lens:
        rec, res, dev = [], [], []
        for _ in range(args.repeats):
            prefix = tok(n)
            rec.append(ttft_alone(engine, prefix + tok(8)))  # new prefix: recomputed (and cached)
            dev.append(ttft_alone(engine, prefix + tok(8)))  # the prefix is on the device
            flush_device(engine, args, rng)  # other prompts take the device's blocks: the prefix goes down
            before = engine.stats()
            res.append(ttft_alone(engine, prefix + tok(8)))
            after = engine.stats()
            hits = {k: after.get(k, 0) - before.get(k, 0) for k in ("kv_offload_host_hits", "kv_offload_disk_hits")}
        row = {"prefix_tokens": n, "recompute_ms": 1e3 * statistics.median(rec),
               f"{args.tier}_restore_ms": 1e3 * statistics.median(res), "device_hit_ms": 1e3 * statistics.median(dev),
               "host_hit_blocks": hits["kv_offload_host_hits"], "disk_hit_blocks": hits["kv_offload_disk_hits"]}
        row["speedup"] = row["recompute_ms"] / row[f"{args.tier}_restore_ms"]
        rows.append({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()})
        print("  ", rows[-1])
    return rows


def flush_device(engine, args, rng) -> None:
    """Evict every cached block from the device, through the prefix cache's own eviction path:
    take all free blocks (each cached one is reported to the eviction hook, which offloads it),
    then give them back. With ``--tier disk`` the host tier is one block, so the blocks land on
    disk; ``--cold`` then drops the disk tier's pages from the OS cache."""
    pool = engine.kv_manager.pool
    blocks = pool.allocate(pool.num_free)
    engine.offloader.flush()
    pool.free(blocks)
    sync(engine.runner.device)
    if args.tier == "disk" and engine.offloader.disk is not None:
        engine.offloader.disk.flush()
        if args.cold:
            engine.offloader.disk.drop_page_cache()


# ------------------------------------------------------------------------------- 3. multi-turn


def multi_turn(args, offload: str, turns: int) -> dict[str, Any]:
    """``--conversations`` chats of ``turns`` turns, round-robin; each turn resends the history
    plus ``--turn-len`` new tokens and generates ``--output-len`` tokens. With ``turns=1`` every
    prompt is new: nothing can hit, and the run measures what offloading the evicted blocks costs."""
    import random

    from infer.sampling import SamplingParams

    engine = make_engine(args, offload, kv_cache_memory_bytes=args.multi_turn_kv_cache_memory_bytes)
    rng = random.Random(args.seed)
    lo, hi = token_range(engine.vocab_size)
    hist = [[rng.randrange(lo, hi) for _ in range(args.system_len)] for _ in range(args.conversations)]
    ttfts, itls, out_tokens = [], [], 0
    t0 = time.perf_counter()
    for _turn in range(turns):
        starts, firsts, last = {}, {}, {}
        for c in range(args.conversations):
            hist[c] += [rng.randrange(lo, hi) for _ in range(args.turn_len)]
            rid = f"c{c}-t{_turn}"
            engine.add_request(list(hist[c]), SamplingParams(max_tokens=args.output_len, ignore_eos=True,
                                                             temperature=0.0), request_id=rid)
            starts[rid] = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if out.request_id not in firsts:
                    firsts[out.request_id] = now
                else:
                    itls.append(now - last[out.request_id])
                last[out.request_id] = now
                if out.finished:
                    c = int(out.request_id[1:].split("-")[0])
                    toks = out.outputs[0].token_ids
                    hist[c] += list(toks)
                    out_tokens += len(toks)
        ttfts += [firsts[r] - starts[r] for r in starts]
    wall = time.perf_counter() - t0
    s = engine.stats()
    engine.shutdown()
    del engine
    free_device_memory()
    return {"workload": f"{turns} turn(s)", "kv_offload": offload, "wall_s": round(wall, 2), "output_tok_s": round(out_tokens / wall, 1),
            "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 1),
            "ttft_p90_ms": round(1e3 * sorted(ttfts)[int(0.9 * (len(ttfts) - 1))], 1),
            "itl_p50_ms": round(1e3 * statistics.median(itls), 2) if itls else None,
            "itl_mean_ms": round(1e3 * statistics.fmean(itls), 2) if itls else None,
            **{k: v for k, v in s.items() if k.startswith(("prefix_cache", "kv_offload"))}}


# -------------------------------------------------------------------------------------- main


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.get("restore_vs_recompute") or []
    fig, axes = plt.subplots(1, 2 if rows else 1, figsize=(11 if rows else 6, 4))
    axes = list(axes) if rows else [axes]
    bw = report["bandwidths"]
    axes[0].barh([r["copy"] for r in bw], [r["GB/s"] for r in bw], color="tab:blue")
    axes[0].set_xlabel("GB/s")
    axes[0].set_title(f"copy bandwidths ({report['shapes']} KV blocks)")
    axes[0].tick_params(axis="y", labelsize=7)
    if rows:
        tier = report["tier"]
        x = [r["prefix_tokens"] for r in rows]
        ax = axes[1]
        ax.plot(x, [r["recompute_ms"] for r in rows], "o-", label="recompute (new prefix)")
        ax.plot(x, [r[f"{tier}_restore_ms"] for r in rows], "s-", label=f"restored from the {tier} tier")
        ax.plot(x, [r["device_hit_ms"] for r in rows], "^-", label="device hit")
        ax.set_xlabel("prefix tokens")
        ax.set_ylabel("TTFT (ms)")
        ax.set_title("TTFT of a prefix: recompute vs restore")
        ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--shapes", default="smollm2-135m", choices=sorted(SHAPES), help="KV shapes of the bandwidths")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--bandwidth-bytes", type=int, default=None, help="bytes per bandwidth copy "
                    "(default 256 MB on CPU, 2 GB on CUDA)")
    ap.add_argument("--prefix-lens", type=int, nargs="*", default=[], help="prefix lengths for part 2 (none: skip)")
    ap.add_argument("--tier", default="disk", choices=("host", "disk"))
    ap.add_argument("--cold", action="store_true", help="disk tier: drop its pages before each restore")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: the longest prefix or conversation + 64")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--chunked-prefill", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--kv-offload-bytes", type=int, default=1 << 30)
    ap.add_argument("--kv-offload-disk-bytes", type=int, default=4 << 30)
    ap.add_argument("--disk-dir", default=None, help="the disk tier's directory (default: a temporary one)")
    ap.add_argument("--multi-turn", action="store_true", help="part 3")
    ap.add_argument("--multi-turn-kv-cache-memory-bytes", type=int, default=None,
                    help="part 3: the device's KV pool (smaller than the conversations' histories)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--turn-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-args", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="EngineConfig overrides of every engine (e.g. fused_kernels=true cuda_graphs=true)")
    out_argument(ap, "", "directory for kv_offload.json/.md/.png")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    from infer.config import parse_dtype

    dtype = parse_dtype(args.dtype, device)
    tmp = tempfile.TemporaryDirectory(prefix="infer-kv-bench-", dir=args.disk_dir)
    args.disk_dir = tmp.name
    report: dict[str, Any] = {"environment": environment(device), "shapes": args.shapes, "tier": args.tier,
                              "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    print("bandwidths:")
    total = args.bandwidth_bytes or ((2 << 30) if device.type == "cuda" else (256 << 20))
    report["bandwidths"] = bandwidths(device, args.shapes, args.block_size, dtype, total, tmp.name)
    longest_chat = args.system_len + args.turns * (args.turn_len + args.output_len) if args.multi_turn else 0
    args.max_model_len = max(args.max_model_len or 0, max(args.prefix_lens or [0]) + 64, longest_chat + 64, 128)
    if args.prefix_lens:
        print(f"restore ({args.tier} tier) vs recompute:")
        engine = make_engine(args, args.tier)
        report["kv_bytes_per_token"] = engine.loaded.config.kv_bytes_per_token(engine.runner.dtype)
        report["restore_vs_recompute"] = restore_vs_recompute(args, engine)
        report["break_even"] = break_even(report, args.tier)
        engine.shutdown()
        del engine
        free_device_memory()
    if args.multi_turn:
        print("multi-turn:")
        report["multi_turn"] = [multi_turn(args, m, t) for t in (args.turns, 1) for m in ("none", "host")]
        for r in report["multi_turn"]:
            print("  ", r)
    table = markdown_table(report["bandwidths"], ["copy", "MB", "copies", "ms", "GB/s"])
    if report.get("restore_vs_recompute"):
        rows = report["restore_vs_recompute"]
        table += "\n\n" + markdown_table(rows, list(rows[0]))
        table += "\n\nbreak-even: " + json.dumps(report["break_even"])
    if report.get("multi_turn"):
        table += "\n\n" + markdown_table(report["multi_turn"], [
            "workload", "kv_offload", "wall_s", "output_tok_s", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms",
            "itl_mean_ms", "prefix_cache_hit_rate", "kv_offload_hit_tokens", "kv_offload_stored_blocks"])
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_report(report, out / "kv_offload.json", table)
        plot(report, out / "kv_offload.png")
    tmp.cleanup()
    return 0


def break_even(report: dict[str, Any], tier: str) -> dict[str, Any]:
    """The break-even prefix length: computed from the measured rates, and read off the curves."""
    from infer.engine.kv_offload import break_even_tokens

    rows = report["restore_vs_recompute"]
    longest = rows[-1]
    prefill_tps = longest["prefix_tokens"] / (longest["recompute_ms"] / 1e3)
    name = {"host": ("host (pinned)->device, block-major", "host tier->KV cache, block-major"),
            "disk": ("disk tier read (cold: pages dropped)",) if report["args"]["cold"] else ("disk tier read (page cache)",)}[tier]
    bw = next(r["GB/s"] for r in report["bandwidths"] if r["copy"] in name) * 1e9
    # the fixed cost: the restore's TTFT beyond the copy and the suffix's compute, at the shortest length
    short = rows[0]
    copy_s = short["prefix_tokens"] * report["kv_bytes_per_token"] / bw
    fixed = max(0.0, short[f"{tier}_restore_ms"] / 1e3 - copy_s - short["device_hit_ms"] / 1e3)
    computed = break_even_tokens(report["kv_bytes_per_token"], bw, prefill_tps, fixed)
    measured = next((r["prefix_tokens"] for r in rows if r[f"{tier}_restore_ms"] < r["recompute_ms"]), None)
    return {"prefill_tok_s": round(prefill_tps, 1), "bandwidth_GB_s": bw / 1e9, "fixed_latency_ms": round(fixed * 1e3, 2),
            "computed_tokens": computed, "measured_first_winning_length": measured}


if __name__ == "__main__":
    raise SystemExit(main())
