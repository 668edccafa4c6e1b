"""Tensor and expert parallelism: what splitting a model over ranks costs and buys (phases 14-15).

    python benchmarks/parallel.py --model gemma3-270m --moe-model /tmp/tiny-qwen3-moe \\
        --out benchmarks/runs/parallel_cpu.json                                       # CPU, 2 gloo ranks
    python benchmarks/parallel.py --device cuda --model /tmp/qwen3-4b --moe-model /tmp/qwen3-30b-a3b-4l \\
        --decode-tokens 128 --requests 64 --prompt-len 256 --output-len 128 --out benchmarks/runs/parallel_h200x2.json

Runs unchanged on 2 GPUs (NCCL) and on a 2-core CPU (gloo). Two parts, each in one run so the
ratios come from one run:

1. **Collectives** at the message sizes a decode step sends (``--ranks`` processes, spawned):
   all-reduce of ``[B, hidden]`` (each row-parallel layer: attention's o_proj and the MLP's down),
   all-gather of ``[B, vocab / W]`` logits (the vocab-parallel LM head) and all-to-all of
   ``[B * k / W, hidden]`` rows each way (expert-parallel dispatch), for decode batches ``B`` in
   ``--batches``. Median latency over ``--iters`` calls and the bus bandwidth (bytes each rank sends
   and receives / time: NCCL-tests' "busbw" definition, ``2 (W - 1) / W * size`` for all-reduce).
2. **Engine**: for each configuration (``tensor_parallel_size`` 1 and 2 on ``--model``; 1, TP 2 and
   EP 2 on ``--moe-model``): batch-1 decode (ms per output token, median over ``--decode-repeats``
   requests of ``--decode-tokens`` tokens after a 4-token prompt) and offline throughput
   (``--requests`` greedy requests of ``--prompt-len`` random tokens and ``--output-len`` outputs,
   continuous batching, all submitted at once: output tokens per second).

On the CPU this is a correctness path: two ranks share two cores with the other processes and every
collective is a TCP round trip, so the numbers say what the communication costs, not a speed-up.

Writes the JSON report (environment, arguments, every collective and engine row) to ``--out``
(default ``benchmarks/runs/parallel.json``), the Markdown tables (``.md``) and a bar chart (``.png``)
beside it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
import torch.distributed as dist
from common import (
    environment,
    free_device_memory,
    free_port,
    markdown_table,
    out_argument,
    parse_overrides,
    save_figure,
    timed,
    write_report,
)


def _collectives_rank(rank: int, world: int, port: int, device: str, dtype: str, hidden: int, vocab: int,
                      top_k: int, batches: list[int], iters: int, out: dict) -> None:
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dt = getattr(torch, dtype)
    item = torch.empty((), dtype=dt).element_size()
    rows = []
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    for b in batches:
        x = torch.randn(b, hidden, device=dev, dtype=dt)
        t = timed(lambda x=x: dist.all_reduce(x), dev, iters, warmup=3)
        size = x.numel() * item
        rows.append({"collective": "all_reduce", "batch": b, "shape": f"[{b}, {hidden}]", "bytes": size,
                     "latency_us": t * 1e6, "busbw_gb_s": 2 * (world - 1) / world * size / t / 1e9})
        lg = torch.randn(b, vocab // world, device=dev, dtype=dt)
        full = torch.empty(world * b, vocab // world, device=dev, dtype=dt)
        t = timed(lambda full=full, lg=lg: gather(full, lg), dev, iters, warmup=3)
        size = full.numel() * item
        rows.append({"collective": "all_gather (logits)", "batch": b, "shape": f"[{b}, {vocab // world}] x {world}",
                     "bytes": size, "latency_us": t * 1e6, "busbw_gb_s": (world - 1) / world * size / t / 1e9})
        n = max(1, b * top_k // world) * world  # pairs this rank sends, spread evenly over the ranks
        send = torch.randn(n, hidden, device=dev, dtype=dt)
        recv = torch.empty_like(send)
        splits = [n // world] * world
        t = timed(lambda r=recv, s=send, p=splits: dist.all_to_all_single(r, s, p, p), dev, iters, warmup=3)
        size = send.numel() * item
        rows.append({"collective": "all_to_all (dispatch)", "batch": b, "shape": f"[{n}, {hidden}]", "bytes": size,
                     "latency_us": t * 1e6, "busbw_gb_s": (world - 1) / world * size / t / 1e9})
    if rank == 0:
        out["rows"] = rows
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(args) -> list[dict]:
    ctx = torch.multiprocessing.get_context("spawn")
    manager = ctx.Manager()
    out = manager.dict()
    port = free_port()
    argv = (args.ranks, port, args.device, args.dtype, args.hidden, args.vocab, args.top_k, args.batches,
            args.iters, out)
    procs = [ctx.Process(target=_collectives_rank, args=(r, *argv)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a collectives rank failed: exit codes {[p.exitcode for p in procs]}")
    return list(out["rows"])


def measure_engine(model: str, label: str, kw: dict, args) -> dict:
    from infer.llm import LLM
    from infer.sampling import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, progress=False, device=args.device, batching="continuous", max_num_seqs=args.max_num_seqs,
              max_model_len=args.prompt_len + args.output_len + 8, **{**args.engine_flags, **kw})
    startup = time.perf_counter() - t0
    vocab = llm.engine.vocab_size
    rng = random.Random(0)
    try:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
        tpots = []
        for _ in range(args.decode_repeats):
            stream = llm.generate_stream([rng.randrange(vocab) for _ in range(4)],
                                         SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True))
            next(stream)  # the first token: prefill
            t = time.perf_counter()
            n = sum(1 for _ in stream)
            tpots.append((time.perf_counter() - t) / max(n, 1))
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        workers = llm.engine.workers
        traffic = workers.state.traffic if workers is not None else {}
        before = {k: list(v) for k, v in traffic.items()}
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        wall = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        # rank 0's bytes into each collective during the offline run, per token run through the model
        # (prompt + output; the last output token is sampled, never fed back) and per sampled token
        forward_tokens = args.requests * args.prompt_len + tokens - len(outs)
        comm = {}
        for kind, (calls, nbytes) in traffic.items():
            c0, b0 = before.get(kind, [0, 0])
            per = tokens if kind == "all_gather" else forward_tokens  # the logits: one row per sampled token
            comm[f"{kind}_calls"] = calls - c0
            comm[f"{kind}_bytes_per_token"] = (nbytes - b0) / per
    finally:
        llm.engine.shutdown()
        del llm
        free_device_memory()
    return {"model": Path(model).name, "config": label, "startup_s": startup,
            "decode_ms_per_token": 1e3 * statistics.median(tpots), "offline_output_tok_s": tokens / wall, **comm}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default="gemma3-270m", help="dense model (its heads must split over 2 ranks)")
    ap.add_argument("--moe-model", default=None, help="Qwen3-MoE directory (e.g. make_synthetic_checkpoint.py "
                    "tiny-qwen3-moe); skipped when not given")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="collectives' dtype (default float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--hidden", type=int, default=None, help="collectives' hidden size (default: --model's)")
    ap.add_argument("--vocab", type=int, default=None, help="collectives' vocabulary (default: --model's)")
    ap.add_argument("--top-k", type=int, default=8, help="experts per token for the all-to-all sizes")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--decode-repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--flags", default="", help="EngineConfig overrides for every engine run, as offline_throughput's "
                    "--infer-configs items (e.g. fused_kernels=true,cuda_graphs=true)")
    ap.add_argument("--skip-collectives", action="store_true")
    out_argument(ap, "parallel.json", "JSON report (a .md table and a .png plot beside it)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from infer.loader import read_model_config

    args.engine_flags = parse_overrides(args.flags)

    mcfg = read_model_config(args.model)
    args.hidden = args.hidden or mcfg.hidden_size
    args.vocab = args.vocab or mcfg.vocab_size
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    report = {"env": environment(args.device), "args": vars(args), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    tables = []
    if not args.skip_collectives:
        coll = measure_collectives(args)
        report["collectives"] = coll
        tables.append(markdown_table(coll, ["collective", "batch", "shape", "bytes", "latency_us", "busbw_gb_s"]))
    runs = [(args.model, "TP=1", {}), (args.model, "TP=2", {"tensor_parallel_size": 2})]
    if args.moe_model:
        runs += [(args.moe_model, "TP=1", {}), (args.moe_model, "TP=2", {"tensor_parallel_size": 2}),
                 (args.moe_model, "EP=2", {"expert_parallel_size": 2})]
    # expert parallelism is captured only with the fixed-capacity dispatch (EngineConfig says why): else eager
    if args.engine_flags.get("cuda_graphs") and args.engine_flags.get("all2all_backend") != "fixed_capacity":
        runs = [(m, f"{label} eager", {**kw, "cuda_graphs": False}) if "expert_parallel_size" in kw else (m, label, kw)
                for m, label, kw in runs]
    engine = []
    for model, label, kw in runs:
        print(f"{Path(model).name} {label} ...", flush=True)
        engine.append(measure_engine(model, label, kw, args))
    for r in engine:  # ratios against the same model's one-rank run
        base = next(b for b in engine if b["model"] == r["model"] and b["config"] == "TP=1")
        r["decode_vs_tp1"] = r["decode_ms_per_token"] / base["decode_ms_per_token"]
        r["offline_vs_tp1"] = r["offline_output_tok_s"] / base["offline_output_tok_s"]
    report["engine"] = engine
    tables.append(markdown_table(engine, ["model", "config", "decode_ms_per_token", "decode_vs_tp1",
                                          "offline_output_tok_s", "offline_vs_tp1", "startup_s"]))
    comm_cols = sorted({k for r in engine for k in r if k.endswith(("_calls", "_per_token")) and "decode" not in k})
    tables.append(markdown_table([r for r in engine if r["config"] != "TP=1"], ["model", "config", *comm_cols]))
    write_report(report, args.out, "\n\n".join(tables))
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
        names = [f"{r['model']}\n{r['config']}" for r in engine]
        axes[0].bar(names, [r["decode_ms_per_token"] for r in engine], color="tab:blue")
        axes[0].set_ylabel("batch-1 decode, ms / token (lower is better)")
        axes[1].bar(names, [r["offline_output_tok_s"] for r in engine], color="tab:green")
        axes[1].set_ylabel("offline output tok/s (higher is better)")
        for ax in axes:
            ax.tick_params(axis="x", labelsize=7)
        fig.suptitle(f"tensor / expert parallelism, {args.device}, {args.ranks} ranks")
        save_figure(fig, Path(args.out).with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
