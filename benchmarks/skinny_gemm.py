"""The skinny GEMM (``src/infer/kernels/skinny_gemm.py``) against cuBLAS (``F.linear``) at decode shapes.

    python benchmarks/skinny_gemm.py --out /tmp/skinny.json                  # GPU: Qwen3-0.6B and 4B shapes
    python benchmarks/skinny_gemm.py --tune --out /tmp/skinny.json           # + a sweep of the tiles
    python benchmarks/skinny_gemm.py --rows 1 --pdl --fused --out /tmp/s.json # + launched with PDL, + the norms

For every projection of the chosen models (the merged QKV and gate/up ones, o, down, the LM head) and
batch M in 1, 2, 4, 8: the time of one ``y = x @ W^T``, measured as CUDA-graph replays of calls that
rotate over enough copies of ``W`` (>= 256 MB) that none is still in L2 when it is read again, so the
bytes come from HBM as in a real decode step. Reports microseconds, GB/s of weight read, and the
kernel's speed-up over cuBLAS; ``--tune`` also times each ``(BLOCK_N, BLOCK_K, num_warps, STAGES)`` tile and
reports the best (what :func:`infer.kernels.skinny_gemm.default_config` should pick; at one row with
both of the kernel's K loops). ``--pdl`` also
times the kernel launched with programmatic dependent launch (:mod:`infer.kernels.pdl`: each call's
first weight tile is loaded while the call before it finishes; the tiles are then tuned that way).
``--fused`` adds, at one row, the steps the decoder layer runs around its QKV and gate/up projections:
the residual add + RMSNorm kernel, the projection (cuBLAS) and, for gate/up, the activation kernel, against
:func:`~infer.kernels.skinny_gemm.skinny_norm_linear` doing all of it in one kernel (with ``--pdl`` too),
and the engine's two kernels (``two_kernels_us``: :func:`~infer.kernels.fused_triton.add_rms_norm_linear`
itself, the norm's kernel, then the skinny GEMM with the activation in its epilogue). A chain of one
projection times each kernel alone; which of them makes a faster decode step is measured in the engine
(the two kernels).
Writes the JSON report (environment, every row) to ``--out`` (default ``benchmarks/runs/skinny_gemm.json``),
the Markdown table (``.md``) and a plot (``.png``: GB/s per projection at one row) beside it;
``--replot REPORT.json`` redraws the plot.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from types import SimpleNamespace

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
import torch.nn.functional as F
from common import environment, markdown_table, out_argument, save_figure, write_report

# (hidden, q heads, kv heads, head_dim, intermediate, vocab)
MODELS = {"qwen3-0.6b": (1024, 16, 8, 128, 3072, 151936), "qwen3-4b": (2560, 32, 8, 128, 9728, 151936),
          "qwen3-8b": (4096, 32, 8, 128, 12288, 151936)}


def projections(model: str) -> list[tuple[str, int, int]]:
    h, hq, hkv, d, i, v = MODELS[model]
    return [("qkv", (hq + 2 * hkv) * d, h), ("o", h, hq * d), ("gate_up", 2 * i, h), ("down", h, i), ("lm_head", v, h)]


def time_us(fn, weights: list[torch.Tensor], x: torch.Tensor, replays: int = 10) -> float:
    """Mean microseconds of ``fn(x, w)`` over CUDA-graph replays of one call per weight copy."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights[:2]:
            fn(x, w)  # compile / pick the algorithm outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(weights))


def tile_grid(m: int, k: int, act: bool = False) -> list[tuple[int, int, int, int]]:
    """The ``(BLOCK_N, BLOCK_K, num_warps, STAGES)`` tiles tried by ``--tune``: at most 64 float32 product sums
    per thread (``M_PAD * BLOCK_N * BLOCK_K`` per program, twice that for a gate/up pair), BLOCK_K up to the
    whole row (one K step: what a norm's first pass over the row needs least); at one row each with both K
    loops (STAGES 0: one tile ahead in registers; 3: two through shared memory, Triton's pipeliner)."""
    m_pad = 1 << (max(m, 1) - 1).bit_length()
    k_pad = 1 << (max(k, 1) - 1).bit_length()
    out = []
    for bn, bk, warps, stages in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048, 4096), (2, 4, 8),
                                                   (0, 3) if m == 1 else (0,)):
        if bk <= max(256, k_pad) and m_pad * bn * bk * (2 if act else 1) <= 64 * 32 * warps and bn * bk >= 32 * warps:
            out.append((bn, bk, warps, stages))
    return out


def plot(rows: list[dict], path: str | Path) -> None:
    """Bars of the weight bandwidth (GB/s) of cuBLAS and the skinny GEMM at one row, per projection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = [r for r in rows if r["M"] == 1]
    labels = [f"{r['model']}\n{r['proj']} ({r['MB']:.0f} MB)" for r in one]
    x = range(len(one))
    fig, ax = plt.subplots(figsize=(max(6, 1.25 * len(one)), 4))
    ax.bar([i - 0.2 for i in x], [r["cublas_GB_s"] for r in one], 0.4, label="cuBLAS (F.linear)")
    ax.bar([i + 0.2 for i in x], [r.get("best_us") and r["N"] * r["K"] * 2 / r["best_us"] / 1e3 or r["skinny_GB_s"]
                                  for r in one], 0.4, label="skinny GEMM (best tile)")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("weight read, GB/s")
    ax.set_title("one-row products (batch-1 decode), bf16, weights from HBM")
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    import json

    from infer.kernels import fused_triton as ft
    from infer.kernels import pdl
    from infer.kernels import skinny_gemm as sg

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-4b"], choices=sorted(MODELS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--projs", nargs="+", default=None, choices=["qkv", "o", "gate_up", "down", "lm_head"],
                    help="only these projections [all]")
    ap.add_argument("--tune", action="store_true", help="time every tile of tile_grid() too")
    ap.add_argument("--pdl", action="store_true", help="also time the kernel launched with PDL (Hopper)")
    ap.add_argument("--fused", action="store_true", help="one row: the norm (+ activation) steps around QKV "
                    "and gate/up, unfused (cuBLAS) against skinny_norm_linear")
    ap.add_argument("--fused-only", action="store_true", help="with --fused: at one row, QKV and gate/up only "
                    "with their norm (the fused row), not also alone")
    ap.add_argument("--flush-bytes", type=int, default=256 << 20, help="bytes of weight copies per timing")
    out_argument(ap, "skinny_gemm.json", "JSON report (a .md table and a .png plot beside it)")
    ap.add_argument("--replot", default=None, help="redraw the plot of this report (no GPU needed)")
    args = ap.parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text())["results"], Path(args.replot).with_suffix(".png"))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    torch.manual_seed(0)
    def tuned():  # --pdl: the tiles are tuned as the engine launches them
        return pdl.scope(args.pdl)

    rows = []
    for model in args.models:
        for name, n, k in projections(model):
            if args.projs and name not in args.projs:
                continue
            nbytes = n * k * 2
            copies = max(1, min(64, -(-args.flush_bytes // nbytes)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                if args.fused and args.fused_only and m == 1 and name in ("qkv", "gate_up"):
                    rows.append(fused_row(model, name, n, k, weights, x, args, ft, sg, pdl, tuned))
                    print({k: v for k, v in rows[-1].items() if k != "tiles"}, flush=True)
                    continue
                err = (sg.skinny_linear(x, weights[0]).float() - sg.skinny_linear_reference(x, weights[0]).float())
                ref_scale = sg.skinny_linear_reference(x, weights[0]).float().abs().max().item()
                cublas = time_us(lambda a, w: F.linear(a, w), weights, x)
                ours = time_us(lambda a, w: sg.skinny_linear(a, w), weights, x)
                row = {"model": model, "proj": name, "N": n, "K": k, "M": m, "MB": round(nbytes / 2**20, 1),
                       "cublas_us": round(cublas, 2), "skinny_us": round(ours, 2),
                       "cublas_GB_s": round(nbytes / cublas / 1e3, 0), "skinny_GB_s": round(nbytes / ours / 1e3, 0),
                       "speedup": round(cublas / ours, 2), "max_err_rel": err.abs().max().item() / ref_scale,
                       "default_tile": list(sg.default_config(m, n, k))}
                if args.pdl:
                    with pdl.scope():
                        ours_pdl = time_us(lambda a, w: sg.skinny_linear(a, w), weights, x)
                    row.update(skinny_pdl_us=round(ours_pdl, 2), skinny_pdl_GB_s=round(nbytes / ours_pdl / 1e3, 0),
                               pdl_speedup=round(cublas / ours_pdl, 2))
                if args.tune:
                    with tuned():
                        tiles = [(time_us(lambda a, w, c=c: sg.skinny_linear(a, w, config=c), weights, x), c)
                                 for c in tile_grid(m, k)]
                    best = min(tiles)
                    row.update(best_us=round(best[0], 2), best_tile=list(best[1]), best_speedup=round(cublas / best[0], 2),
                               tiles={str(list(c)): round(t, 2) for t, c in sorted(tiles)})
                rows.append(row)
                print({k: v for k, v in row.items() if k != "tiles"}, flush=True)
                if args.fused and m == 1 and name in ("qkv", "gate_up"):
                    rows.append(fused_row(model, name, n, k, weights, x, args, ft, sg, pdl, tuned))
                    print({k: v for k, v in rows[-1].items() if k != "tiles"}, flush=True)
            del weights
            torch.cuda.empty_cache()
    cols = ["model", "proj", "M", "MB", "cublas_us", "skinny_us", "cublas_GB_s", "skinny_GB_s", "speedup"]
    if args.pdl:
        cols += ["skinny_pdl_us", "skinny_pdl_GB_s", "pdl_speedup"]
    if args.fused:
        cols += ["two_kernels_pdl_us" if args.pdl else "two_kernels_us"]
    if args.tune:
        cols += ["best_us", "best_tile", "best_speedup"]
    table = "skinny GEMM vs cuBLAS (bf16, weights read from HBM)\n\n" + markdown_table(rows, cols)
    write_report({"benchmark": "skinny_gemm", "environment": environment("cuda"), "results": rows}, args.out, table)
    if args.out:
        plot(rows, Path(args.out).with_suffix(".png"))
    return 0


def fused_row(model, name, n, k, weights, x, args, ft, sg, pdl, tuned) -> dict:
    """One row, ``norm -> projection (-> activation)``: the three unfused launches (the Triton norm, cuBLAS,
    the Triton activation) against skinny_norm_linear, plain and (``--pdl``) with PDL."""
    act = "silu" if name == "gate_up" else None
    residual = torch.randn_like(x)
    nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5

    def unfused(a, w):
        h, r = ft.fused_add_rms_norm(a.clone(), residual.clone(), nw, 1e-6)
        y = F.linear(h, w)
        return ft.act_and_mul(y, act) if act else y

    def fused(a, w, config=None):
        return sg.skinny_norm_linear(a, residual, nw, 1e-6, False, w, None, act, config=config)[0]

    engine_tile = sg.after_norm_config(weights[0], act)

    def two_kernels(a, w):  # the engine's one-row path itself (the residual add is upstream, in o or down)
        return ft.add_rms_norm_linear(a, None, nw, 1e-6, False, SimpleNamespace(weight=w, bias=None), act)[0]

    y = fused(x, weights[0])
    y_ref, _ = sg.skinny_norm_linear_reference(x, residual, nw, 1e-6, False, weights[0], None, act)
    row = {"model": model, "proj": f"norm+{name}" + ("+act" if act else ""), "N": n, "K": k, "M": 1,
           "MB": round(n * k * 2 / 2**20, 1), "cublas_us": round(time_us(unfused, weights, x), 2),
           "skinny_us": round(time_us(fused, weights, x), 2),
           "max_err_rel": (y.float() - y_ref.float()).abs().max().item() / y_ref.float().abs().max().item(),
           "default_tile": list(engine_tile)}
    row.update(cublas_GB_s=round(n * k * 2 / row["cublas_us"] / 1e3, 0), skinny_GB_s=round(n * k * 2 / row["skinny_us"] / 1e3, 0),
               speedup=round(row["cublas_us"] / row["skinny_us"], 2))
    row["two_kernels_us"] = round(time_us(two_kernels, weights, x), 2)
    if args.pdl:
        with pdl.scope():
            t = time_us(fused, weights, x)
            row["two_kernels_pdl_us"] = round(time_us(two_kernels, weights, x), 2)
        row.update(skinny_pdl_us=round(t, 2), skinny_pdl_GB_s=round(n * k * 2 / t / 1e3, 0),
                   pdl_speedup=round(row["cublas_us"] / t, 2))
    if args.tune:
        with tuned():
            tiles = [(time_us(lambda a, w, c=c: fused(a, w, c), weights, x), c) for c in tile_grid(1, k, bool(act))]
        best = min(tiles)
        row.update(best_us=round(best[0], 2), best_tile=list(best[1]), best_speedup=round(row["cublas_us"] / best[0], 2),
                   tiles={str(list(c)): round(t, 2) for t, c in sorted(tiles)})
    return row


if __name__ == "__main__":
    raise SystemExit(main())
