"""All-reduce latency per message size: NCCL against PyTorch symmetric memory's one-shot and two-shot
kernels, eager and inside a CUDA graph (issue 55; phase 14's all_reduce_backend).

    python benchmarks/allreduce.py --ranks 2 --out benchmarks/runs/allreduce_h100x2.json
    python benchmarks/allreduce.py --ranks 4 --out benchmarks/runs/allreduce_h100x4.json

Needs ``--ranks`` CUDA GPUs of one host (spawned processes, one per GPU; NVLink multicast stays
off: ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` unless set). For every size
from ``--min-bytes`` to ``--max-bytes`` (powers of 2, bf16 ``[1, n]`` messages; 8 KB is one row of
a 4096-wide model) and every method, through the engine's own code path
(:class:`infer.parallel.allreduce.SymmMemAllReduce` with its crossover forced to one algorithm, and
``dist.all_reduce``):

- **eager**: ``--iters`` calls back to back, timed with CUDA events (launch cost included);
- **graph**: ``--per-graph`` calls captured in one CUDA graph, replayed ``--iters / --per-graph``
  times: the cost inside a captured decode step.

Each row reports microseconds per all-reduce (median of ``--repeats`` timings, rank 0's) and, once
per size, the largest difference of each symmetric-memory result from NCCL's on the same random
input. The suggested ``--symm-mem-one-shot-max-bytes`` / ``--symm-mem-max-bytes`` are the
largest sizes where one-shot beats two-shot and where symmetric memory beats NCCL, in graphs.

Writes the JSON report (environment, arguments, rows, suggested thresholds) to ``--out`` (default
``benchmarks/runs/allreduce.json``), the Markdown table (``.md``) and the latency curves (``.png``)
beside it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
import torch.distributed as dist
from common import environment, free_port, markdown_table, out_argument, print_row, save_figure, write_report

METHODS = ("nccl", "one_shot", "two_shot")


def _time_us(fn, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the CUDA-event time of ``iters`` calls of ``fn``, per call, in us."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def _rank(rank: int, world: int, port: int, args, out: dict) -> None:
    from infer.parallel.allreduce import NCCL, ONE_SHOT, TWO_SHOT, SymmMemAllReduce

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), device_id=dev)
    group = dist.group.WORLD
    symm = SymmMemAllReduce(group, dev, args.max_bytes, one_shot_max_bytes=0)
    dtype = torch.bfloat16
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        n = size // dtype.itemsize
        gen = torch.Generator(device=dev).manual_seed(1234 + rank)
        x = torch.randn((1, n), device=dev, dtype=dtype, generator=gen)
        ref = x.clone()
        dist.all_reduce(ref, group=group)
        row = {"bytes": size, "shape": f"[1, {n}]"}

        def call(method, x=x, size=size):
            if method == "nccl":  # in place, as the engine's NCCL path
                dist.all_reduce(x, group=group)
                return x
            symm.one_shot_max_bytes = size if method == "one_shot" else 0
            y = symm(x)
            assert y is not None, f"{method} declined {size} bytes"
            return y

        for method in METHODS:
            if method != "nccl":
                symm.one_shot_max_bytes = size if method == "one_shot" else 0
                assert symm.algorithm(x) == {"one_shot": ONE_SHOT, "two_shot": TWO_SHOT}[method] != NCCL
                got = call(method, x.clone())
                row[f"{method}_max_abs_diff"] = (got.float() - ref.float()).abs().max().item()
            work = x.clone()
            row[f"{method}_eager_us"] = _time_us(lambda m=method, w=work: call(m, w), args.iters, args.repeats)
            # graph: warm up on a side stream, capture per_graph calls, replay
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    call(method, work)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.per_graph):
                    call(method, work)
            replays = max(1, args.iters // args.per_graph)
            row[f"{method}_graph_us"] = _time_us(graph.replay, replays, args.repeats) / args.per_graph
            del graph
        if rank == 0:
            print_row(row)
        rows.append(row)
        size *= 2
    if rank == 0:
        out["rows"] = rows
    dist.barrier()
    dist.destroy_process_group()


def suggest(rows: list[dict]) -> dict:
    """The thresholds the measurements suggest (graph times): the largest size where one-shot is the
    fastest of the three, and the largest where a symmetric-memory kernel beats NCCL."""
    one = [r["bytes"] for r in rows if r["one_shot_graph_us"] <= min(r["two_shot_graph_us"], r["nccl_graph_us"])]
    symm = [r["bytes"] for r in rows if min(r["one_shot_graph_us"], r["two_shot_graph_us"]) < r["nccl_graph_us"]]
    return {"symm_mem_one_shot_max_bytes": max(one, default=0), "symm_mem_max_bytes": max(symm, default=0)}


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = [r["bytes"] for r in rows]
    for method in METHODS:
        for mode, style in (("graph", "-"), ("eager", ":")):
            ax.plot(x, [r[f"{method}_{mode}_us"] for r in rows], style, marker="o", ms=3, label=f"{method} ({mode})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size, bytes (bf16)")
    ax.set_ylabel("us per all-reduce")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="GPUs, one process each (default: 2)")
    p.add_argument("--min-bytes", type=int, default=1 << 10, help="smallest message (default: 1 KiB)")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="largest message and the symmetric buffer "
                   "(default: 64 MiB)")
    p.add_argument("--iters", type=int, default=200, help="calls per timing (default: 200)")
    p.add_argument("--per-graph", type=int, default=20, help="calls captured in one graph (default: 20)")
    p.add_argument("--repeats", type=int, default=5, help="timings per point, median taken (default: 5)")
    out_argument(p, "allreduce.json", "JSON report; .md and .png beside it")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < args.ranks:
        print(f"error: {args.ranks} ranks need {args.ranks} CUDA GPUs, {torch.cuda.device_count()} visible",
              file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Manager().dict()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args, out)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    if any(proc.exitcode for proc in procs):
        print(f"error: a rank failed: exit codes {[proc.exitcode for proc in procs]}", file=sys.stderr)
        return 1
    rows = list(out["rows"])
    env = environment("cuda")
    thresholds = suggest(rows)
    columns = ["bytes", *[f"{m}_{mode}_us" for mode in ("graph", "eager") for m in METHODS],
               "one_shot_max_abs_diff", "two_shot_max_abs_diff"]
    table = markdown_table(rows, columns)
    table += (f"\n\n{args.ranks} x {env.get('gpu')}, commit {env['commit']}; suggested: "
              f"--symm-mem-one-shot-max-bytes {thresholds['symm_mem_one_shot_max_bytes']} "
              f"--symm-mem-max-bytes {thresholds['symm_mem_max_bytes']}")
    write_report({"environment": env, "args": vars(args), "rows": rows, "suggested": thresholds}, args.out, table)
    if args.out:
        plot(rows, Path(args.out).with_suffix(".png"), f"all-reduce, {args.ranks} x {env.get('gpu')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
