"""Multi-LoRA serving (phase 16): decode throughput with 0, 1 and N distinct adapters in one batch.

    # CPU (smollm2-135m, rank 16 on all 7 projections, 4 rows)
    python benchmarks/lora.py --device cpu --model smollm2-135m --batch 4 --num-adapters 1 2 4
    # one layer's projections alone: base products vs the LoRA deltas (CPU, or the Triton kernels on CUDA)
    python benchmarks/lora.py --kernels --device cpu --model smollm2-135m --batch 1 4 16 --num-adapters 1 4 16
    # GPU (a random checkpoint at Qwen3-8B's shapes), the issue's workloads with every phase 5-9 flag, CUDA
    # graphs included: batch 1 (one rank-16 adapter), and 32 rows over 1, 8 and 32 adapters of ranks 8-64
    python scripts/make_synthetic_checkpoint.py qwen3-8b /tmp/qwen3-8b --device cuda
    python benchmarks/lora.py --device cuda --model /tmp/qwen3-8b --batch 1 32 --num-adapters 1 8 32 \\
        --rank 16 --prompt-len 128 --output-len 128 --engine-args batching=continuous kv_cache=paged \\
        prefix_caching=true chunked_prefill=true fused_kernels=true async_scheduling=true cuda_graphs=true \\
        pdl=true kv_cache_memory_bytes=8000000000 --out benchmarks/runs/lora-gpu
    python benchmarks/lora.py --device cuda --model /tmp/qwen3-8b --batch 32 --num-adapters 8 \\
        --ranks 8 16 32 64 --prompt-len 128 --output-len 128 --engine-args batching=continuous \\
        kv_cache=paged prefix_caching=true chunked_prefill=true fused_kernels=true async_scheduling=true \\
        cuda_graphs=true pdl=true kv_cache_memory_bytes=8000000000 --out benchmarks/runs/lora-gpu-ranks

Random adapters in PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``, A and B
~ N(0, 0.02)) are written for the model's shapes first (``--rank``, or ``--ranks`` in turn, and
``--targets``); then, for each
batch size, the same ``batch`` prompts (random tokens, ``--prompt-len``, greedy, exactly
``--output-len`` tokens each) run on:

* **base**: an engine without ``enable_lora`` (the reference; both engines live in one process, so on a
  GPU give them a KV budget each, ``--engine-args kv_cache_memory_bytes=...``);
* **lora, 0 adapters**: an engine with ``enable_lora`` whose rows use no adapter (what the wrapped
  projections cost when nobody uses them: nothing but a Python check per projection);
* **lora, N adapters**: the rows spread round-robin over N distinct adapters (``max_loras`` = the largest
  N), every adapter resident (one warm-up run loads them).

TPOT is the median decode step (after every row has its first token; steps timed as the engine runs
them, not synchronized one by one) over ``--repeats`` runs, the configurations interleaved, and decode
throughput ``batch / TPOT``; the ratio to the base row is the claim.
``offline_tok_per_s`` is the whole run's (prefills included): ``batch x output_len`` over the median wall
time of a run, the offline-throughput ratio of the issue (each run's prompts are rotated its own way, so
with ``prefix_caching`` no run reuses another's KV). The engines run the same ``--engine-args``,
``cuda_graphs`` included (with LoRA, each graph has a base and a LoRA variant: phase 16's page).
Report: ``lora.json``, ``lora.md``, ``lora.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
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
    print_row,
    save_figure,
    timed,
    write_report,
)

from infer.config import EngineConfig, ModelConfig
from infer.engine import LLMEngine
from infer.lora import LoRARequest
from infer.lora.adapter import LORA_PROJS, projection_shapes
from infer.sampling import SamplingParams


def write_random_adapter(path: Path, cfg: ModelConfig, rank: int, targets: list[str], seed: int) -> Path:
    """A random LoRA adapter of ``cfg``'s shapes in PEFT's layout (what ``PeftModel.save_pretrained`` writes)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(cfg)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj in targets:
            module = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            fin, fout = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fin, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fout, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none",
        "use_rslora": False, "use_dora": False}))
    return path


def decode_steps(engine: LLMEngine, prompts: list[list[int]], loras: list[LoRARequest | None], output_len: int
                 ) -> tuple[list[float], float]:
    """Run ``prompts`` together: the seconds of each decode step after every row has its first token, and
    of the whole run. The steps run as the engine runs them, not synchronized one by one: with async
    scheduling the host prepares a step while the device runs the one before, and a synchronization around
    each step would add the host's work (LoRA's included) to every step; in the steady state a step's call
    lasts until the previous step's tokens are back, i.e. one step of the device (or of the host, if slower)."""
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0, ignore_eos=True)
    cuda = engine.runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    begin = time.perf_counter()
    reqs = [engine.add_request(p, params, lora_request=lora) for p, lora in zip(prompts, loras)]
    while any(r.seqs[0].num_output_tokens < 1 for r in reqs):  # the prefill (and first tokens)
        engine.step(stream=False)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step(stream=False)
        times.append(time.perf_counter() - start)
    if cuda:
        torch.cuda.synchronize()
    total = time.perf_counter() - begin
    return times[:-1] or times, total  # the last step only retires the finished requests


def measure(configs: list[tuple[str, LLMEngine, list]], prompts, args) -> list[dict[str, Any]]:
    """Each ``(name, engine, per-row adapters)`` run ``--repeats`` times, the configurations interleaved
    (a machine whose load drifts during the run shifts every configuration alike). TPOT: the median
    decode step over every run (:func:`decode_steps`: timed as the engine runs them).
    ``graph_steps``: the share of the steps that replayed a CUDA graph (0 without ``cuda_graphs``), so a
    LoRA row that fell back to the eager forward shows."""
    for _, engine, loras in configs:  # warm-up: adapters loaded into their slots, kernels compiled
        decode_steps(engine, prompts, loras, min(args.output_len, 8))
    steps: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    totals: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    routes: dict[str, list[str | None]] = {name: [] for name, _, _ in configs}
    for rep in range(args.repeats):
        for i, (name, engine, loras) in enumerate(configs):
            # each run's prompts rotated its own way: no run finds another's blocks in the prefix cache
            shift = 1 + rep * len(configs) + i
            rotated = [q[shift % len(q):] + q[:shift % len(q)] for q in prompts]
            engine.runner.on_executed = lambda out, r=routes[name]: r.append(out.graph)
            times, total = decode_steps(engine, rotated, loras, args.output_len)
            engine.runner.on_executed = None
            steps[name] += times
            totals[name].append(total)
    rows = []
    for name, _, _ in configs:
        median = statistics.median(steps[name])
        rows.append({"batch": len(prompts), "config": name, "decode_tok_per_s": len(prompts) / median,
                     "tpot_ms": 1e3 * median, "decode_steps": len(steps[name]),
                     "offline_tok_per_s": len(prompts) * args.output_len / statistics.median(totals[name]),
                     "graph_steps": sum(g is not None for g in routes[name]) / max(1, len(routes[name]))})
    return rows


def kernel_rows(cfg: ModelConfig, args, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Part 1 (``--kernels``): one decoder layer's seven projections, the base products against the LoRA
    deltas (shrink + expand of :mod:`infer.kernels.lora_triton` on CUDA, the plain-PyTorch path on the
    CPU), for each batch and number of distinct adapters (rows round-robin over them); the fastest of
    ``--kernel-repeats`` calls each, so a shared machine's noise stays out. ``adapter_gb_s``: the bytes of
    the distinct adapters' A and B over the delta's time (what bounds it at decode)."""
    import torch.nn.functional as F

    from infer.kernels import lora_ops
    from infer.kernels.lora_reference import make_lora_meta

    ops = lora_ops("triton" if device.type == "cuda" else "torch")
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    shapes = [projection_shapes(cfg)[p] for p in args.targets]
    n_max = max(args.num_adapters)
    weights = [torch.randn(fout, fin, generator=g).to(device, dtype) * 0.02 for fin, fout in shapes]
    loras = [(torch.randn(n_max, args.rank, fin, generator=g).to(device, dtype) * 0.02,
              torch.randn(n_max, fout, args.rank, generator=g).to(device, dtype) * 0.02) for fin, fout in shapes]
    rows = []
    for b in args.batch:
        xs = [torch.randn(b, fin, generator=g).to(device, dtype) for fin, _ in shapes]
        ys = [F.linear(x, w) for x, w in zip(xs, weights)]
        base = sum(timed(lambda x=x, w=w: F.linear(x, w), device, args.kernel_repeats, stat=min)
                   for x, w in zip(xs, weights))
        for n in [v for v in args.num_adapters if v <= b]:
            meta = make_lora_meta([i % n for i in range(b)], n_max, device)
            delta = sum(timed(lambda x=x, y=y, a=a, bb=bb, m=meta: ops.add_lora(y, x, a, bb, m), device,
                              args.kernel_repeats, stat=min) for x, y, (a, bb) in zip(xs, ys, loras))
            nbytes = n * sum(a[0].nbytes + bb[0].nbytes for a, bb in loras)
            r = {"batch": b, "adapters": n, "base_us": 1e6 * base, "lora_delta_us": 1e6 * delta,
                 "delta_vs_base": delta / base, "adapter_gb_s": nbytes / delta / 1e9}
            rows.append(r)
            print_row(r)
    return rows


def plot_kernels(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Bars: the LoRA delta's time over the base products', per batch and number of adapters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"batch {r['batch']}\n{r['adapters']} adapter{'s' if r['adapters'] != 1 else ''}" for r in rows]
    bars = ax.bar(range(len(rows)), [r["delta_vs_base"] for r in rows], color="C0")
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['delta_vs_base']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("LoRA delta time / base projections' time")
    ax.set_title(title, fontsize=10)
    save_figure(fig, path)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        rs = [r for r in rows if r["batch"] == b]
        bars = ax.bar(range(len(rs)), [r["vs_base"] for r in rs], color=["gray"] + ["C0"] * (len(rs) - 1))
        for bar, r in zip(bars, rs):
            ax.annotate(f"{r['vs_base']:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rs)), [r["config"] for r in rs], fontsize=8, rotation=20)
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_title(f"batch {b}")
        ax.set_ylabel("decode throughput / base")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[4], help="rows decoding together (one table each)")
    ap.add_argument("--num-adapters", type=int, nargs="+", default=[1, 4], help="distinct adapters in a batch")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--ranks", type=int, nargs="+", default=None,
                    help="adapter i gets ranks[i %% len(ranks)] (engine runs; default: --rank for every adapter)")
    ap.add_argument("--max-loras", type=int, default=None,
                    help="the engine's adapter slots (default: the most distinct adapters of --num-adapters); a "
                         "graph's grids have a program column per slot a step could use")
    ap.add_argument("--targets", nargs="+", default=list(LORA_PROJS), choices=LORA_PROJS)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adapter-dir", default=None, help="where the random adapters go (default: --out/adapters)")
    ap.add_argument("--kernels", action="store_true", help="part 1 only: one layer's projections, base vs LoRA")
    ap.add_argument("--kernel-repeats", type=int, default=200)
    ap.add_argument("--engine-args", nargs="*", default=["batching=continuous", "kv_cache=paged"],
                    metavar="FIELD=VALUE", help="EngineConfig overrides of every engine")
    out_argument(ap, "lora", "directory for lora.json/.md/.png")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.kernels:
        from infer.config import parse_dtype
        from infer.loader import read_model_config

        device = torch.device(args.device)
        cfg = read_model_config(args.model)
        rows = kernel_rows(cfg, args, device, parse_dtype(args.dtype, device))
        table = markdown_table(rows, ["batch", "adapters", "base_us", "lora_delta_us", "delta_vs_base",
                                      "adapter_gb_s"])
        write_report({"environment": environment(device), "args": vars(args), "kernels": rows},
                      out / "lora_kernels.json", table)
        plot_kernels(rows, out / "lora_kernels.png", f"{Path(args.model).name}, one layer's {len(args.targets)} "
                     f"projections, rank {args.rank}, {args.device}")
        return 0
    kw = dict(model=args.model, device=args.device, dtype=args.dtype,
              max_num_seqs=max(args.batch), max_model_len=args.prompt_len + args.output_len + 16,
              **engine_overrides(args.engine_args))
    base = LLMEngine(EngineConfig(**kw), progress=False)
    cfg = base.loaded.config
    rng = random.Random(args.seed)
    prompts = {b: [[rng.randrange(100, min(cfg.vocab_size, 30000)) for _ in range(args.prompt_len)]
                   for _ in range(b)] for b in args.batch}
    n_max = max(args.num_adapters)
    adir = Path(args.adapter_dir) if args.adapter_dir else out / "adapters"
    rank_list = args.ranks or [args.rank]
    ranks = [rank_list[i % len(rank_list)] for i in range(n_max)]
    print(f"writing {n_max} random adapters (ranks {sorted(set(ranks))}) on {', '.join(args.targets)} to {adir}",
          flush=True)
    adapters = [LoRARequest(f"adapter{i}", i + 1, str(write_random_adapter(adir / f"adapter{i}", cfg, ranks[i],
                                                                          args.targets, args.seed + i)))
                for i in range(n_max)]
    slots = args.max_loras or n_max
    if slots < n_max:
        ap.error(f"--max-loras {slots} is fewer than the {n_max} distinct adapters asked for")
    lora = LLMEngine(EngineConfig(**kw, enable_lora=True, max_loras=slots, max_lora_rank=max(ranks),
                                  max_cpu_loras=slots), progress=False)
    rows: list[dict[str, Any]] = []
    for b in args.batch:
        configs = [("base", base, [None] * b)]
        configs += [(f"lora, {n} adapter{'s' if n != 1 else ''}", lora, [adapters[i % n] if n else None
                                                                          for i in range(b)])
                    for n in [0, *args.num_adapters] if n <= b]
        for r in measure(configs, prompts[b], args):
            rows.append(r)
            print_row(r)
    for engine in (base, lora):
        engine.shutdown()
    free_device_memory()
    for r in rows:
        ref = next(x for x in rows if x["batch"] == r["batch"] and x["config"] == "base")
        r["vs_base"] = r["decode_tok_per_s"] / ref["decode_tok_per_s"]
    report = {"environment": environment(torch.device(args.device)), "args": vars(args), "rows": rows}
    for r in rows:
        ref = next(x for x in rows if x["batch"] == r["batch"] and x["config"] == "base")
        r["tpot_vs_base"] = r["tpot_ms"] / ref["tpot_ms"]
        r["offline_vs_base"] = r["offline_tok_per_s"] / ref["offline_tok_per_s"]
    table = markdown_table(rows, ["batch", "config", "decode_tok_per_s", "tpot_ms", "vs_base",
                                  "tpot_vs_base", "offline_tok_per_s", "offline_vs_base", "graph_steps"])
    write_report(report, out / "lora.json", table)
    label = f"ranks {min(rank_list)}-{max(rank_list)}" if len(set(rank_list)) > 1 else f"rank-{rank_list[0]}"
    plot(rows, out / "lora.png", f"{Path(args.model).name}: {label} LoRA on {len(args.targets)} "
                                 f"projections, {args.device}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
