"""One-row products on the CPU: how fast each way of computing ``x @ W.T`` streams the weight.

    python benchmarks/cpu_gemv.py                                                  # SmolLM2-135M's shapes
    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_gemv.py                          # workers that never spin

Batch-1 decode is a chain of matrix-vector products, so its speed is the rate at which they read the
weights. For each of SmolLM2-135M's products (the merged QKV, o, the merged gate/up, down and the LM head),
float32, one row (``--rows``), the weight rotated among copies larger than the last-level cache so every
call reads DRAM, median of the timed calls:

* ``linear_row_major``: ``F.linear`` over PyTorch's ``[out, in]`` layout (what HF transformers runs);
* ``mm_column_major``: ``x @ W_cm`` over the ``[in, out]`` layout the fused forward keeps on the CPU
  (``infer.models.layers.set_weight_layout``);
* ``split_k``: ``infer.kernels.fused_reference.linear``, the column-major product with its inner dimension
  split over the threads (one ``bmm``, then the partial sums added).

Reported: microseconds per call and GB/s (weight bytes / time), and per decode token (30 layers' products
and one LM head) in ms, next to the machine's copy bandwidth measured in the same run. The OpenMP wait
policy matters: each split product is a parallel region, and a worker that sleeps between regions
(``OMP_WAIT_POLICY=PASSIVE``) costs tens of microseconds to wake (``src/infer/__init__.py``).

Writes ``cpu_gemv.json`` (environment, ceilings, the OpenMP settings, every product) and
``cpu_gemv.md`` (the table) into ``--out DIR`` (default ``benchmarks/runs/``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import ceilings, environment, markdown_table, out_argument, write_report

# SmolLM2-135M: hidden 576, 9 q / 3 kv heads of 64, intermediate 1536, vocabulary 49,152, 30 layers
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
LAYERS = 30
ROTATE_BYTES = 256 << 20


def _time(fn, calls: int) -> float:
    """Median seconds per call over 5 batches of ``calls`` calls, after a warm-up."""
    for _ in range(min(calls, 10)):
        fn()
    batches = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        batches.append((time.perf_counter() - t) / calls)
    return statistics.median(batches)


def measure(name: str, k: int, n: int, rows: int, quick: bool = False) -> dict:
    from infer.kernels.fused_reference import linear
    from infer.models.layers import set_weight_layout

    copies = 1 if quick else max(1, ROTATE_BYTES // (k * n * 4))
    row_major = [torch.nn.Linear(k, n, bias=False) for _ in range(copies)]
    column_major = []
    for layer in row_major:
        cm = torch.nn.Linear(k, n, bias=False)
        cm.weight = torch.nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
        set_weight_layout(cm, True)
        column_major.append(cm)
    x = torch.randn(rows, k)
    turn = [0]

    def nxt() -> int:
        turn[0] = (turn[0] + 1) % copies
        return turn[0]

    ways = {
        "linear_row_major": lambda: torch.nn.functional.linear(x, row_major[nxt()].weight),
        "mm_column_major": lambda: torch.mm(x, column_major[nxt()].weight.t()),
        "split_k": lambda: linear(x, column_major[nxt()]),
    }
    with torch.inference_mode():
        expected = x @ row_major[0].weight.t()
        for way, fn in ways.items():
            turn[0] = copies - 1  # the next call uses copy 0
            torch.testing.assert_close(fn(), expected, atol=1e-4, rtol=1e-4, msg=way)
        calls = 2 if quick else 20 if name == "lm_head" else 200
        row = {"product": name, "in": k, "out": n, "weight_mb": k * n * 4 / 1e6}
        for way, fn in ways.items():
            s = _time(fn, calls)
            row[f"{way}_us"] = s * 1e6
            row[f"{way}_gb_s"] = k * n * 4 / s / 1e9
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1, help="rows of x (decode batch) [1]")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    out_argument(ap, "", "directory for cpu_gemv.json and .md")
    ap.add_argument("--quick", action="store_true", help="one weight copy, few calls: checks the program only")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ceil = ceilings(torch.device("cpu"), quick=True)
    rows = [measure(name, k, n, args.rows, args.quick) for name, (k, n) in SHAPES.items()]
    ways = ("linear_row_major", "mm_column_major", "split_k")
    per_token = {w: sum(r[f"{w}_us"] * (1 if r["product"] == "lm_head" else LAYERS) for r in rows) / 1e3 for w in ways}
    policy = os.environ.get("OMP_WAIT_POLICY") or f"unset (GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')})"
    table = (f"one-row products on the CPU, {args.rows} row(s), {torch.get_num_threads()} threads, OMP_WAIT_POLICY "
             f"{policy}; copy bandwidth {ceil['bandwidth_gb_s']:.0f} GB/s\n\n"
             + markdown_table(rows, ["product", "weight_mb"] + [f"{w}_{u}" for w in ways for u in ("us", "gb_s")])
             + "\n\nper decode token (30 layers + LM head), ms: "
             + ", ".join(f"{w} {v:.1f}" for w, v in per_token.items()))
    report = {"benchmark": "cpu_gemv", "environment": environment("cpu"), "ceilings": ceil,
              "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
              "threads": torch.get_num_threads(), "rows": args.rows, "results": rows, "per_token_ms": per_token}
    out = str(Path(args.out) / "cpu_gemv.json") if args.out else None
    write_report(report, out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
