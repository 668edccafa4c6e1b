"""The fused MoE kernel (phase 15): Triton sort-by-expert + grouped GEMM vs the loop over experts.

    python benchmarks/moe_kernel.py                                                # H100/H200, ~2 min
    python benchmarks/moe_kernel.py --tokens 1 8 64 --tune                          # + tile-size sweep
    python benchmarks/moe_kernel.py --device cpu --tokens 1 2 4 8 16 32 64          # the loop on the CPU
    TRITON_INTERPRET=1 python benchmarks/moe_kernel.py --device cpu --shapes tiny   # smoke test

One MoE layer's experts at Qwen3-30B-A3B's shapes (hidden 2048, 128 experts of width 768, top-8
renormalized routing), bf16 on a GPU (float32 on the CPU), for T tokens (T = 1 is batch-1 decode,
256 a large decode batch, 2048-4096 a prefill chunk). The routing comes from random router logits
(softmax, top-8: close to uniform load, every expert equally likely).

* ``fused``: :func:`infer.kernels.moe_triton.fused_experts` (sort + two grouped GEMMs + act + sum),
  captured in a CUDA graph and replayed under ``triton.testing.do_bench`` (median, L2 cleared before each
  replay): the device time a captured decode step pays.
* ``sort_one_program_us`` / ``sort_reference_us``: the sort by expert alone, the one-program Triton kernel
  vs the reference's device ops (graph replay): where ``ALIGN_ONE_PROGRAM_MAX_PAIRS`` should sit.
* ``reference``: :func:`infer.kernels.moe_reference.fused_experts`, Hugging Face's loop (one
  gather + 2 GEMMs + index_add per expert hit, with host synchronization): timed eagerly (it cannot be
  captured), so its launch overhead is included: that is what running it costs.

Bytes: at T tokens the layer reads the weights of every expert hit at least once,
``distinct * 3 * H * I`` elements (``distinct`` is measured on the routing; for uniform routing it is
``E * (1 - (1 - k/E)^T)``: 8 at T = 1, ~64 at T = 8, all 128 from T ~ 64), plus the activations.
``fused_gb_s`` = those bytes / the fused time and ``fused_frac`` that as a fraction of the copy
bandwidth measured in the same run. ``tflops`` = ``2 * T * k * 3 * H * I`` / the fused time.

Writes ``moe_kernel.json`` / ``.md`` and ``moe_kernel.png`` (time and bytes vs T) into ``--out DIR``
(default ``benchmarks/runs/``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import (
    capture_calls,
    ceilings,
    environment,
    markdown_table,
    out_argument,
    print_row,
    resolve_device,
    save_figure,
    sync,
    timed,
    write_report,
)

SHAPES = {
    "qwen3-30b-a3b": {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8},
    "tiny": {"hidden": 32, "inter": 16, "experts": 8, "top_k": 2},
}
GPU_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
CPU_TOKENS = [1, 2, 4, 8, 16, 32, 64]
TUNE_CONFIGS = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, num_warps=w, num_stages=s)
                for m, n, k, g, w, s in [(16, 32, 64, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3),
                                         (16, 64, 256, 1, 4, 3), (32, 64, 128, 8, 4, 3), (64, 64, 64, 8, 4, 3),
                                         (64, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3)]]


def inputs(m: dict, t: int, dtype, device, seed: int):
    g = torch.Generator().manual_seed(seed)
    h, i, e, k = m["hidden"], m["inter"], m["experts"], m["top_k"]
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).to(dtype).to(device)
    w2 = (torch.randn(e, h, i, generator=g) * 0.02).to(dtype).to(device)
    from infer.kernels.moe_reference import select_experts

    weights, ids = select_experts(torch.randn(t, e, generator=g).to(device), k, True)
    return x, w13, w2, weights, ids


def time_graph(fn, device) -> float:
    """Seconds per call: captured in a CUDA graph and replayed (median); wall time on the CPU."""
    if device.type != "cuda":
        return timed(fn, device, repeats=3, warmup=1)
    import triton.testing

    graph = capture_calls(lambda _: fn(), 1)
    t = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") / 1e3
    del graph
    return t


def time_eager(fn, device) -> float:
    if device.type != "cuda":
        return timed(fn, device, repeats=3, warmup=1)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=100, return_mode="median") / 1e3


def run_row(name: str, m: dict, t: int, dtype, device, ceil: dict, fused: bool, seed: int) -> dict:
    from infer.kernels import moe_reference

    x, w13, w2, weights, ids = inputs(m, t, dtype, device, seed)
    h, i, e, k = m["hidden"], m["inter"], m["experts"], m["top_k"]
    item = x.element_size()
    distinct = int(torch.unique(ids).numel())
    expected_distinct = e * (1 - (1 - k / e) ** t)
    nbytes = distinct * 3 * h * i * item + 2 * t * h * item
    row = {"model": name, "tokens": t, "experts_hit": distinct, "experts_hit_uniform": expected_distinct,
           "weight_mb_read": distinct * 3 * h * i * item / 1e6}
    ref = lambda: moe_reference.fused_experts(x, w13, w2, weights, ids)  # noqa: E731
    row["reference_us"] = 1e6 * time_eager(ref, device)
    row["reference_gb_s"] = nbytes / (row["reference_us"] / 1e6) / 1e9
    if fused:
        from infer.kernels import moe_triton

        fn = lambda: moe_triton.fused_experts(x, w13, w2, weights, ids, num_experts=e)  # noqa: E731
        expected = moe_reference.fused_experts(x.float(), w13.float(), w2.float(), weights, ids)
        row["max_rel_diff"] = ((fn().float() - expected).abs().max() / expected.abs().max()).item()
        row["fused_us"] = 1e6 * time_graph(fn, device)
        row["fused_gb_s"] = nbytes / (row["fused_us"] / 1e6) / 1e9
        row["fused_frac"] = row["fused_gb_s"] / ceil["bandwidth_gb_s"]
        row["tflops"] = 2 * t * k * 3 * h * i / (row["fused_us"] / 1e6) / 1e12
        row["speedup_vs_reference"] = row["reference_us"] / row["fused_us"]
        row["config"] = moe_triton.block_config(t, k, e, 2 * i, h)
        # the two sorts alone (both graph-safe): where the one-program kernel stops paying
        # (moe_triton.ALIGN_ONE_PROGRAM_MAX_PAIRS)
        bm = row["config"]["BLOCK_M"]
        row["sort_one_program_us"] = 1e6 * time_graph(lambda: moe_triton.moe_align_block_size(ids, bm, e), device)
        row["sort_reference_us"] = 1e6 * time_graph(lambda: moe_reference.moe_align_block_size(ids, bm, e), device)
    return row


def tune(m: dict, tokens: list[int], dtype, device, seed: int) -> list[dict]:
    """Each tile configuration of TUNE_CONFIGS at each T: the fused time (graph replay)."""
    from infer.kernels import moe_triton

    out = []
    for t in tokens:
        x, w13, w2, weights, ids = inputs(m, t, dtype, device, seed)
        for cfg in TUNE_CONFIGS:
            def fn(args=(x, w13, w2, weights, ids), cfg=cfg):
                return moe_triton.fused_experts(*args, num_experts=m["experts"], config=cfg)

            try:
                us = 1e6 * time_graph(fn, device)
            except Exception as e:  # e.g. out of shared memory for a large tile
                us = None
                print(f"  T={t} {cfg}: {type(e).__name__}", flush=True)
            out.append({"tokens": t, **cfg, "fused_us": us})
        best = min((r for r in out if r["tokens"] == t and r["fused_us"]), key=lambda r: r["fused_us"])
        print(f"T={t}: best {best}", flush=True)
    return out


def plot(rows: list[dict], path: Path, ceil: dict, device_name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ts = [r["tokens"] for r in rows]
    if rows and "fused_us" in rows[0]:
        a.plot(ts, [r["fused_us"] for r in rows], "o-", label="fused (Triton, graph replay)")
    a.plot(ts, [r["reference_us"] for r in rows], "s-", label="reference loop (eager)")
    a.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="µs per MoE layer", title=f"MoE layer, {device_name}")
    a.legend()
    b.plot(ts, [r["weight_mb_read"] for r in rows], "o-", label="expert weights read (MB)")
    b.set(xscale="log", xlabel="tokens T", ylabel="MB", title="expert weights one layer reads")
    b.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="cuda, cpu or auto")
    ap.add_argument("--shapes", default=None, choices=sorted(SHAPES),
                    help="layer shapes (default qwen3-30b-a3b; tiny for the interpreter smoke test)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help=f"numbers of tokens (default {GPU_TOKENS} on a GPU, {CPU_TOKENS} on the CPU)")
    ap.add_argument("--tune", action="store_true", help="also sweep the kernel's tile sizes (GPU)")
    out_argument(ap, "", "directory for moe_kernel.json/.md/.png")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = resolve_device(args.device)
    gpu = device.type == "cuda"
    from infer.kernels import moe_triton

    fused = gpu or moe_triton.INTERPRET  # the kernel on the CPU only under the interpreter (not a speed)
    name = args.shapes or "qwen3-30b-a3b"
    m = SHAPES[name]
    tokens = args.tokens or (GPU_TOKENS if gpu else CPU_TOKENS)
    dtype = torch.bfloat16 if gpu else torch.float32
    print(f"measuring ceilings on {device} ...", flush=True)
    ceil = ceilings(device, quick=not gpu)
    start = time.perf_counter()
    rows = []
    with torch.inference_mode():
        for t in tokens:
            row = run_row(name, m, t, dtype, device, ceil, fused, args.seed)
            rows.append(row)
            print_row(row)
        tuned = tune(m, tokens, dtype, device, args.seed) if args.tune and gpu else None
    sync(device)
    env = environment(device)
    report = {"benchmark": "moe_kernel", "env": env, "dtype": str(dtype).replace("torch.", ""), "shapes": m,
              "ceilings": ceil, "rows": rows, "tune": tuned, "seconds": time.perf_counter() - start,
              "command": " ".join(sys.argv)}
    cols = ["tokens", "experts_hit", "weight_mb_read", "reference_us", "reference_gb_s"]
    if fused:
        cols += ["fused_us", "fused_gb_s", "fused_frac", "tflops", "speedup_vs_reference", "max_rel_diff",
                 "sort_one_program_us", "sort_reference_us"]
    table = markdown_table(rows, cols)
    table += (f"\n\n{name} {m}, {report['dtype']}; copy bandwidth {ceil['bandwidth_gb_s']:.0f} GB/s; "
              f"{env.get('gpu') or env['cpu']}")
    if not gpu and fused:
        table += "\n(the fused kernel ran under the Triton interpreter: its times are not a speed)"
    out = Path(args.out) / "moe_kernel.json" if args.out else None
    write_report(report, out, table)
    if args.out:
        plot(rows, Path(args.out) / "moe_kernel.png", ceil, env.get("gpu") or env["cpu"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
