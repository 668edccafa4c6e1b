"""Paged attention kernels: decode bandwidth and prefill FLOP rate, next to PyTorch SDPA.

    python benchmarks/paged_attention.py                                            # H100/H200, ~1 min
    python benchmarks/paged_attention.py --tune [decode|prefill]                    # tile sweeps
    python benchmarks/paged_attention.py --plot DIR/paged_attention.json            # PNG from a report
    TRITON_INTERPRET=1 python benchmarks/paged_attention.py --device cpu --out /tmp/pa  # smoke test

Shapes are Qwen3-4B's attention (32 query heads, 8 KV heads, head_dim 128, bf16) over a paged cache
of 16-token blocks, every sequence of a batch at the same context length.

Decode (one new token per sequence, ``infer.kernels.decode_attention.paged_decode_attention``): for each
batch x context, the kernel time (``triton.testing.do_bench``, median, after warm-up; do_bench also
clears the L2 cache before every run, and the calls rotate among several block tables that place the
sequences on different physical blocks), the bandwidth it reaches (K/V bytes read / time) and that as
a fraction of the device-to-device copy bandwidth measured in the same run (``common.ceilings``: bytes
read + written / time). Beside it, PyTorch's ``F.scaled_dot_product_attention(enable_gqa=True)`` over
the same K/V already gathered into contiguous ``[B, Hkv, ctx, D]`` (its best case: it gets the
layout for free), and the gather (``k_cache[block_table]``) + SDPA that a paged cache would cost it.

Prefill (``infer.kernels.prefill_attention.paged_prefill_attention``): 8 sequences x 2048 new tokens,
causal, FLOP rate and MFU against the measured bf16 matmul rate, next to SDPA with ``is_causal`` on
contiguous inputs (FlashAttention on a GPU); and an extend step (512 new tokens after a 1536-token
cached prefix) for the kernel alone.

Writes ``paged_attention.json`` (commit, hardware, versions, ceilings, every row), ``paged_attention.md``
(the tables) and, when matplotlib is installed, ``paged_attention.png`` (bandwidth fraction vs context,
one line per batch, Triton solid, SDPA dashed) into ``--out DIR`` (default ``benchmarks/runs/``);
``--plot REPORT.json`` draws the PNG of an existing report beside it.

``--kv-cache-dtype fp8`` (phase 11): each decode shape is measured a second time over an FP8 cache
(e4m3 codes, one byte per value, scales 1.0; the kernel converts each tile to bf16 as it loads it), with
its bandwidth (the FP8 bytes read / time), its time against the bf16 cache's (``speedup_vs_auto``) and
its largest difference from the bf16 kernel over the same values dequantized. The GPU question of the
FP8 KV cache, batch 32 at 16k context::

    python benchmarks/paged_attention.py --batches 32 --contexts 16384 --kv-cache-dtype fp8 --prefill 1 16

On the CPU (``--device cpu``, with ``TRITON_INTERPRET=1``) the same program runs at tiny shapes in
float32; it checks the program, not the speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
import torch.nn.functional as F
from common import (
    bench,
    capture_calls,
    ceilings,
    environment,
    markdown_table,
    out_argument,
    print_row,
    resolve_device,
    sync,
    write_report,
)

GPU_SHAPE = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": "bfloat16"}
CPU_SHAPE = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32, "block_size": 16, "dtype": "float32"}
GPU_BATCHES, GPU_CONTEXTS = [1, 8, 32, 64, 128], [1024, 4096, 16384, 32768]
CPU_BATCHES, CPU_CONTEXTS = [1, 2], [32, 64]
ROTATE_BYTES = 1 << 30  # cache pool at least this big, so rotated block tables hit different memory
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Rotating:
    """Calls ``fn(i)`` with ``i`` cycling over ``n`` prepared inputs (defeats caches between calls)."""

    def __init__(self, fn, n: int) -> None:
        self.fn, self.n, self.i = fn, n, 0

    def __call__(self):
        self.i = (self.i + 1) % self.n
        return self.fn(self.i)


def bench_gpu_time(fn, n: int, device: torch.device) -> float:
    """Median seconds of one ``fn(i)``, GPU time alone: ``fn(0) .. fn(n-1)`` captured in one CUDA graph and
    replayed (as an engine that captures its decode steps would run them), so Python's launch overhead,
    which dominates small calls, is left out. Wall time of the same calls on the CPU."""
    if device.type != "cuda":
        return bench(Rotating(fn, n), device)
    graph = capture_calls(fn, n)
    return bench(graph.replay, device) / n


def make_pool(num_blocks: int, shape: dict, device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V caches ``[num_blocks, block_size, Hkv, D]`` (random, never zeros)."""
    dims = (num_blocks, shape["block_size"], shape["num_kv_heads"], shape["head_dim"])
    dtype = DTYPES[shape["dtype"]]
    k = torch.randn(dims, device=device, dtype=dtype, generator=gen)
    v = torch.randn(dims, device=device, dtype=dtype, generator=gen)
    return k, v


def block_tables(batch: int, blocks_per_seq: int, num_blocks: int, n: int, device, gen) -> list[torch.Tensor]:
    """``n`` int32 block tables ``[batch, blocks_per_seq]``, each a different random placement."""
    need = batch * blocks_per_seq
    return [torch.randperm(num_blocks, device=device, generator=gen)[:need].view(batch, blocks_per_seq)
            .to(torch.int32) for _ in range(n)]


@contextlib.contextmanager
def sdpa_backend(device: torch.device):
    """FlashAttention for SDPA on a GPU when it takes these inputs (else PyTorch's own choice)."""
    if device.type != "cuda":
        yield "default"
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                      SDPBackend.MATH]):
        yield "flash/efficient/cudnn/math (first that fits)"


def decode_row(ops, batch: int, ctx: int, shape: dict, device, ceil: dict, gen, num_splits=None,
               with_sdpa: bool = True, fp8: bool = False) -> dict:
    """One decode measurement: Triton kernel, SDPA on gathered K/V, gather + SDPA (``ops``: the module
    :mod:`infer.kernels.decode_attention`). ``fp8``: the kernel alone over an FP8 cache of the same shape
    (scales 1.0), and its largest difference from the kernel over the same values in the model's dtype."""
    hq, hkv, d, bs = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"], shape["block_size"]
    dtype = DTYPES[shape["dtype"]]
    item = 1 if fp8 else torch.empty((), dtype=dtype).element_size()
    per_seq = -(-ctx // bs)
    need = batch * per_seq
    block_bytes = 2 * bs * hkv * d * item
    num_blocks = max(need, ROTATE_BYTES // block_bytes) if device.type == "cuda" else need * 2
    k_cache, v_cache = make_pool(num_blocks, shape, device, gen)
    scales = {}
    if fp8:
        from infer.kernels.attention_reference import quantize_kv

        k_cache, v_cache = quantize_kv(k_cache, 1.0), quantize_kv(v_cache, 1.0)
        one = torch.ones(1, dtype=torch.float32, device=device)
        scales = {"k_scale": one, "v_scale": one}
    n_tables = max(1, min(4, num_blocks // need))
    tables = block_tables(batch, per_seq, num_blocks, n_tables, device, gen)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, device=device, dtype=dtype, generator=gen)
    out = torch.empty_like(q)
    scale = d**-0.5
    kv_bytes = 2 * batch * ctx * hkv * d * item
    bw = ceil["bandwidth_gb_s"]

    def triton_call(i):
        ops.paged_decode_attention(q, k_cache, v_cache, tables[i], seq_lens, scale, out=out, num_splits=num_splits,
                                   **scales)

    t = bench_gpu_time(triton_call, n_tables, device)
    t_call = bench(Rotating(triton_call, n_tables), device)
    splits = num_splits or (ops.decode_num_splits(batch, hkv, per_seq * bs, device) if device.type == "cuda"
                            else "auto")
    row = {"batch": batch, "context": ctx, "kv_cache_dtype": "fp8" if fp8 else shape["dtype"],
           "num_splits": splits, "kv_mb": kv_bytes / 1e6,
           "triton_us": 1e6 * t, "triton_gb_s": kv_bytes / t / 1e9, "triton_frac": kv_bytes / t / 1e9 / bw,
           "triton_call_us": 1e6 * t_call}
    if fp8:  # the same values in the model's dtype, through the same kernel
        triton_call(0)
        got = out.float()
        ops.paged_decode_attention(q, k_cache.to(dtype), v_cache.to(dtype), tables[0], seq_lens, scale, out=out,
                                   num_splits=num_splits)
        row["max_abs_diff_vs_dequantized"] = (got - out.float()).abs().max().item()
        return row
    if not with_sdpa:
        return row

    def gather(i):
        table = tables[i].long()
        k = k_cache[table].view(batch, per_seq * bs, hkv, d)[:, :ctx].transpose(1, 2)
        v = v_cache[table].view(batch, per_seq * bs, hkv, d)[:, :ctx].transpose(1, 2)
        return k, v

    qs = q.view(batch, hq, 1, d)
    try:
        with sdpa_backend(device):
            gathered = {i: gather(i) for i in range(n_tables)}  # cleared before gather + SDPA runs

            def sdpa(i):
                k, v = gathered[i]
                return F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True)

            def gather_sdpa(i):
                k, v = gather(i)
                return F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True)

            ref = sdpa(0).view(batch, hq, d).float()
            triton_call(0)
            row["max_abs_diff_vs_sdpa"] = (out.float() - ref).abs().max().item()
            t_sdpa = bench_gpu_time(sdpa, n_tables, device)
            gathered.clear()
            t_gs = bench_gpu_time(gather_sdpa, n_tables, device)
    except torch.OutOfMemoryError:
        row["sdpa_note"] = "out of memory"
        return row
    row.update({"sdpa_us": 1e6 * t_sdpa, "sdpa_frac": kv_bytes / t_sdpa / 1e9 / bw,
                "gather_sdpa_us": 1e6 * t_gs, "gather_sdpa_frac": kv_bytes / t_gs / 1e9 / bw,
                "speedup_vs_gather_sdpa": t_gs / t})
    return row


def prefill_row(ops, batch: int, q_len: int, prefix: int, shape: dict, device, ceil: dict, gen,
                with_sdpa: bool = True, max_context: int | None = None) -> dict:
    """One prefill (prefix 0) or extend measurement; SDPA is_causal beside it when there is no prefix.
    ``ops``: the module :mod:`infer.kernels.prefill_attention`. ``max_context``: passed on, so the kernel
    splits the keys as the engine's step would (None: 1 split)."""
    hq, hkv, d, bs = shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"], shape["block_size"]
    dtype = DTYPES[shape["dtype"]]
    ctx = prefix + q_len
    per_seq = -(-ctx // bs)
    k_cache, v_cache = make_pool(batch * per_seq, shape, device, gen)
    table = block_tables(batch, per_seq, batch * per_seq, 1, device, gen)[0]
    qsl = torch.arange(0, batch + 1, device=device, dtype=torch.int32) * q_len
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch * q_len, hq, d, device=device, dtype=dtype, generator=gen)
    out = torch.empty_like(q)
    scale = d**-0.5
    # causal FLOPs: 2 matmuls x 2 FLOP per multiply-add x D, over the visible (query, key) pairs
    pairs = batch * sum(prefix + i + 1 for i in range(q_len))
    flops = 4 * hq * d * pairs
    peak = ceil["matmul_tflops"]
    t = bench(lambda: ops.paged_prefill_attention(q, k_cache, v_cache, table, qsl, seq_lens, q_len, scale, out=out,
                                                  max_context=max_context), device)
    row = {"batch": batch, "new_tokens": q_len, "prefix": prefix, "triton_ms": 1e3 * t,
           "triton_tflops": flops / t / 1e12, "triton_mfu": flops / t / 1e12 / peak}
    if prefix == 0 and with_sdpa:
        tl_ = table.long()
        k = k_cache[tl_].view(batch, per_seq * bs, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
        v = v_cache[tl_].view(batch, per_seq * bs, hkv, d)[:, :ctx].transpose(1, 2).contiguous()
        qs = q.view(batch, q_len, hq, d).transpose(1, 2).contiguous()
        with sdpa_backend(device):
            t_s = bench(lambda: F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale,
                                                               enable_gqa=True), device)
            ref = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        row["max_abs_diff_vs_sdpa"] = (out.view(batch, q_len, hq, d).transpose(1, 2).float() - ref.float()).abs() \
            .max().item()
        row.update({"sdpa_ms": 1e3 * t_s, "sdpa_tflops": flops / t_s / 1e12, "sdpa_mfu": flops / t_s / 1e12 / peak})
    return row


def tune(decode_ops, prefill_ops, shape: dict, device, ceil: dict, gen, what: str = "all") -> list[dict]:
    """Sweep the decode kernel's split counts and tiles (``what`` "all" or "decode"), and the prefill
    kernel's tiles ("all" or "prefill": a prefill of 8 x 2048 tokens, one of 16,384, and the extend of a chunked-prefill
    step, 512 new tokens after a 4096-token prefix, split as the engine splits it); how the defaults
    were chosen."""
    rows = []

    def note(row):
        rows.append(row)
        print_row(row)

    if what in ("all", "decode"):
        _tune_decode(decode_ops, shape, device, ceil, gen, note)
    if what in ("all", "prefill"):
        _tune_prefill(prefill_ops, shape, device, ceil, gen, note)
    return rows


def _tune_decode(ops, shape: dict, device, ceil: dict, gen, note) -> None:
    for batch, ctx in ((1, 4096), (1, 32768), (8, 4096), (8, 32768), (32, 1024), (32, 4096), (32, 32768),
                       (64, 1024), (64, 4096), (128, 1024)):
        for splits in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64):
            if splits * 256 > ctx:
                continue
            r = decode_row(ops, batch, ctx, shape, device, ceil, gen, num_splits=splits, with_sdpa=False)
            note({"kernel": "decode", **r})
    original = ops._decode_config
    try:
        for block_n in (32, 64, 128):
            for warps in (2, 4, 8):
                for stages in (2, 3, 4):
                    ops._decode_config = lambda *_a, c={"BLOCK_N": block_n, "num_warps": warps,
                                                        "num_stages": stages}: c
                    for batch, ctx, splits in ((64, 4096, 1), (8, 32768, 16)):
                        try:
                            r = decode_row(ops, batch, ctx, shape, device, ceil, gen, num_splits=splits,
                                           with_sdpa=False)
                        except Exception as e:  # noqa: BLE001 (a config that does not compile: note it)
                            r = {"batch": batch, "context": ctx, "error": type(e).__name__}
                        note({"kernel": "decode", "BLOCK_N": block_n, "warps": warps, "stages": stages, **r})
    finally:
        ops._decode_config = original


def _tune_prefill(ops, shape: dict, device, ceil: dict, gen, note) -> None:
    original = ops._prefill_config
    try:
        for block_m, block_n in ((64, 64), (64, 32), (128, 32), (128, 64), (128, 128), (64, 128)):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    ops._prefill_config = lambda *_a, c={"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps,
                                                         "num_stages": stages}: c
                    for batch, q_len, prefix in ((8, 2048, 0), (1, 16384, 0), (1, 512, 4096)):
                        try:
                            r = prefill_row(ops, batch, q_len, prefix, shape, device, ceil, gen, with_sdpa=False,
                                            max_context=prefix + q_len)
                        except Exception as e:  # noqa: BLE001 (a config that does not compile: note it)
                            r = {"batch": batch, "new_tokens": q_len, "prefix": prefix, "error": type(e).__name__}
                        note({"kernel": "prefill", "BLOCK_M": block_m, "BLOCK_N": block_n, "warps": warps,
                              "stages": stages, **r})
    finally:
        ops._prefill_config = original


def plot(report: dict, path: Path) -> bool:
    """Bandwidth fraction vs context, one color per batch: Triton solid, SDPA (gathered K/V) dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (draw it later with --plot the JSON)")
        return False
    rows = report["decode"]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    batches = sorted({r["batch"] for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, b in enumerate(batches):
        rs = sorted((r for r in rows if r["batch"] == b and r.get("kv_cache_dtype") != "fp8"),
                    key=lambda r: r["context"])
        c = colors[i % len(colors)]
        ax.plot([r["context"] for r in rs], [r["triton_frac"] for r in rs], "-o", color=c, label=f"B={b} triton")
        r8 = sorted((r for r in rows if r["batch"] == b and r.get("kv_cache_dtype") == "fp8"), key=lambda r: r["context"])
        if r8:
            ax.plot([r["context"] for r in r8], [r["triton_frac"] for r in r8], ":s", color=c, label=f"B={b} triton, fp8 KV")
        sd = [r for r in rs if "sdpa_frac" in r]
        if sd:
            ax.plot([r["context"] for r in sd], [r["sdpa_frac"] for r in sd], "--x", color=c, alpha=0.7,
                    label=f"B={b} SDPA (gathered)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("K/V bytes read / time, fraction of copy bandwidth")
    env = report["env"]
    shape = report["shape"]
    ax.set_title(f"paged decode, {shape['num_q_heads']}q/{shape['num_kv_heads']}kv heads, d={shape['head_dim']}, "
                 f"{shape['dtype']}, block {shape['block_size']}\n{env.get('gpu') or env.get('cpu')}, "
                 f"copy {report['ceilings']['bandwidth_gb_s']:.0f} GB/s", fontsize=9)
    ax.axhline(0.7, color="gray", lw=0.8, ls=":")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="cuda, cpu (needs TRITON_INTERPRET=1) or auto")
    out_argument(ap, "", "directory for paged_attention.json/.md/.png")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="decode batch sizes")
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="decode context lengths")
    ap.add_argument("--prefill", type=int, nargs=2, default=None, metavar=("SEQS", "TOKENS"),
                    help="prefill sequences x new tokens (default 8 2048 on a GPU)")
    ap.add_argument("--tune", nargs="?", const="all", choices=["all", "decode", "prefill"], default=None,
                    help="also sweep the kernels' tiles (and the decode split counts): all, decode or prefill")
    ap.add_argument("--plot", default=None, metavar="JSON", help="only draw the PNG of an existing report")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                    help="fp8: also measure each decode shape over an FP8 (e4m3) cache")
    args = ap.parse_args(argv)

    if args.plot:
        path = Path(args.plot)
        return 0 if plot(json.loads(path.read_text()), path.with_suffix(".png")) else 1

    device = resolve_device(args.device)
    from infer.kernels import decode_attention, prefill_attention
    from infer.kernels.triton_common import INTERPRET

    if device.type == "cpu" and not INTERPRET:
        ap.error("on the CPU the kernels run under the Triton interpreter: set TRITON_INTERPRET=1")
    gpu = device.type == "cuda"
    shape = GPU_SHAPE if gpu else CPU_SHAPE
    batches = args.batches or (GPU_BATCHES if gpu else CPU_BATCHES)
    contexts = args.contexts or (GPU_CONTEXTS if gpu else CPU_CONTEXTS)
    pre_b, pre_t = args.prefill or ((8, 2048) if gpu else (2, 32))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    item = torch.empty((), dtype=DTYPES[shape["dtype"]]).element_size()

    print(f"measuring ceilings on {device} ...", flush=True)
    ceil = ceilings(device, quick=not gpu)
    print(f"copy {ceil['bandwidth_gb_s']:.0f} GB/s, matmul {ceil['matmul_tflops']:.1f} TFLOP/s", flush=True)
    start = time.perf_counter()
    decode = []
    for batch in batches:
        for ctx in contexts:
            kv = 2 * batch * ctx * shape["num_kv_heads"] * shape["head_dim"] * item
            if gpu and 2.2 * kv + ROTATE_BYTES > torch.cuda.mem_get_info(device)[0]:
                print(f"decode B={batch} ctx={ctx}: skipped (memory)", flush=True)
                continue
            row = decode_row(decode_attention, batch, ctx, shape, device, ceil, gen)
            decode.append(row)
            print_row(row)
            if gpu:
                torch.cuda.empty_cache()
            if args.kv_cache_dtype == "fp8":
                row8 = decode_row(decode_attention, batch, ctx, shape, device, ceil, gen, fp8=True)
                row8["speedup_vs_auto"] = row["triton_us"] / row8["triton_us"]
                decode.append(row8)
                print_row(row8)
                if gpu:
                    torch.cuda.empty_cache()
    prefill = []
    for q_len, prefix in ((pre_t, 0), (pre_t // 4, pre_t - pre_t // 4)):
        row = prefill_row(prefill_attention, pre_b, q_len, prefix, shape, device, ceil, gen)
        prefill.append(row)
        print_row(row)
    tuned = (tune(decode_attention, prefill_attention, shape, device, ceil, gen, args.tune) if args.tune
             else None)
    sync(device)

    report = {
        "benchmark": "paged_attention",
        "env": environment(device),
        "shape": shape,
        "ceilings": ceil,
        "method": "do_bench median (warm-up, L2 cleared per run), block tables rotated; bandwidth = K/V bytes "
                  "read / time; fraction of the copy bandwidth (read + write) measured in the same run",
        "decode": decode,
        "prefill": prefill,
        "tune": tuned,
        "seconds": time.perf_counter() - start,
    }
    table = "### Decode\n\n" + markdown_table(decode, [
        "batch", "context", "kv_cache_dtype", "num_splits", "kv_mb", "triton_us", "triton_gb_s", "triton_frac",
        "triton_call_us",
        "sdpa_us", "sdpa_frac", "gather_sdpa_us", "gather_sdpa_frac", "speedup_vs_gather_sdpa", "speedup_vs_auto",
        "max_abs_diff_vs_dequantized"])
    table += "\n\n### Prefill\n\n" + markdown_table(prefill, [
        "batch", "new_tokens", "prefix", "triton_ms", "triton_tflops", "triton_mfu", "sdpa_ms", "sdpa_tflops",
        "sdpa_mfu"])
    table += (f"\n\nceilings: {ceil['bandwidth_gb_s']:.0f} GB/s copy, {ceil['matmul_tflops']:.1f} TFLOP/s "
              f"{ceil['matmul_dtype']} matmul; {report['env'].get('gpu') or report['env']['cpu']}; shape {shape}")
    out = Path(args.out) / "paged_attention.json" if args.out else None
    write_report(report, out, table)
    if out:
        plot(report, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
