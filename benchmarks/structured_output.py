"""Structured output (phase 13): index compile time, per-step masking overhead, constrained throughput.

    python benchmarks/structured_output.py                       # smollm2-135m on this CPU
    # GPU, Qwen3-0.6B shapes (a synthetic checkpoint: its byte-level BPE tokenizer fills the 151,936 ids)
    python scripts/make_synthetic_checkpoint.py qwen3-0.6b /tmp/qwen3-0.6b
    python benchmarks/structured_output.py --model /tmp/qwen3-0.6b --device cuda --dtype bfloat16 \\
        --batch-sizes 1 32 --out /tmp/phase13-gpu/structured.json
    # the same with the phase 8-9 optimizations (a constrained row waits for its token: no overlap)
    python benchmarks/structured_output.py --model /tmp/qwen3-0.6b --device cuda --dtype bfloat16 \\
        --attention-backend triton --fused-kernels --cuda-graphs --async-scheduling --out /tmp/phase13-gpu-fast/structured.json

Three measurements, all in one process:

1. **Compile**: for each schema of the test suite (tests/test_structured.py), the time to build
   its regex and its :class:`outlines_core.Index` over the model's vocabulary with a cold
   :class:`~infer.sampling.structured.IndexCache` (the vocabulary built once beforehand, timed
   apart), then the time of a cached lookup.
2. **Per-step overhead (TPOT)**: ``B`` requests decode ``--output-len`` tokens each, all
   unconstrained or all constrained by a regex that never ends (``[a-zA-Z ,.]+``: the mask of a
   JSON string's inside, thousands of allowed tokens), and a mixed batch (half and half);
   rounds alternate so both see the same machine state. TPOT = decode time / decode steps.
3. **Throughput**: ``--num-requests`` requests with the JSON schemas vs the same requests
   unconstrained (``ignore_eos`` to the same ``max_tokens``), output tokens per second.

Writes the JSON report to ``--out`` (default ``benchmarks/runs/structured_output.json``), the Markdown
tables (``.md``) and a plot (``.png``: TPOT per batch size and mode) beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import environment, markdown_table, out_argument, save_figure, sync, timed, write_report

from infer.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.sampling import SamplingParams, SamplingTensors, sample
from infer.sampling.structured import IndexCache, StructuredOutputsParams

OPEN_REGEX = "[a-zA-Z ,.]+"
TEST_FILE = Path(__file__).resolve().parent.parent / "tests" / "test_structured.py"


def schemas() -> dict:
    """The schema suite of tests/test_structured.py (``SCHEMAS``), read from that file: the test suite
    is not on this program's import path."""
    spec = importlib.util.spec_from_file_location("test_structured", TEST_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SCHEMAS


def compile_times(engine: LLMEngine) -> list[dict]:
    cache = IndexCache(engine.tokenizer, engine.eos_token_ids[0])
    t = time.perf_counter()
    cache.vocabulary()
    rows = [{"schema": "(vocabulary)", "cold_ms": 1e3 * (time.perf_counter() - t), "cached_ms": None}]
    for name, schema in {**schemas(), "json_object": None, "open_regex": None}.items():
        t = time.perf_counter()
        if name == "json_object":
            so = StructuredOutputsParams(json_object=True)
        elif name == "open_regex":
            so = StructuredOutputsParams(regex=OPEN_REGEX)
        else:
            so = StructuredOutputsParams(json=schema)
        cache.get(so.to_regex()).result()
        cold = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(100):
            StructuredOutputsParams(**so.to_dict()).to_regex()  # what a repeated request pays
            cache.get(so.to_regex()).result()
        cached = (time.perf_counter() - t) / 100
        rows.append({"schema": name, "cold_ms": 1e3 * cold, "cached_ms": 1e3 * cached})
    cache.close()
    return rows


def decode_tpot(engine: LLMEngine, batch: int, constrained: list[bool], output_len: int, input_len: int) -> float:
    """Seconds per decode step of ``batch`` sequences (the prefill step excluded)."""
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(100, 5000, (input_len,), generator=g).tolist()
        so = {"regex": OPEN_REGEX} if constrained[i] else None
        engine.add_request(ids, SamplingParams(max_tokens=output_len, temperature=1.0, seed=i, ignore_eos=True,
                                               structured_outputs=so))
    while engine.num_waiting or engine._compiling:  # admit and prefill everyone first
        engine.step()
    sync(engine.runner.device)
    steps, t = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    sync(engine.runner.device)
    return (time.perf_counter() - t) / max(steps, 1)


def sampler_cost(engine: LLMEngine, batch: int, constrained: int) -> dict:
    """The masking work alone, timed in isolation (steadier than step times on a shared CPU): the
    sampler on ``[batch, V]`` logits without a mask, and with ``constrained`` rows masked (the
    bitmask written from real guides, copied to the device, applied)."""
    from types import SimpleNamespace

    from outlines_core import Guide

    index = engine.index_cache.get(OPEN_REGEX).result()
    runner, dev = engine.runner, engine.runner.device
    seqs = [SimpleNamespace(guide=Guide(index) if i < constrained else None) for i in range(batch)]
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(batch)]
    logits = torch.randn(batch, engine.vocab_size, device=dev, dtype=runner.dtype)
    t = SamplingTensors.from_params(params, list(range(batch)), [0] * batch, None, None, None, engine.vocab_size,
                                    device=dev)
    plain = timed(lambda: sample(logits, t), dev, repeats=20, warmup=3)

    def masked():
        t.token_bitmask, t.token_bitmask_rows = runner._token_bitmask(seqs, engine.eos_token_ids)
        return sample(logits, t)

    with_mask = timed(masked, dev, repeats=20, warmup=3)
    t.token_bitmask = t.token_bitmask_rows = None
    return {"batch": batch, "constrained_rows": constrained, "sample_ms": 1e3 * plain,
            "sample_with_mask_ms": 1e3 * with_mask, "mask_ms": 1e3 * (with_mask - plain)}


def throughput(engine: LLMEngine, n: int, constrained: bool, max_tokens: int) -> dict:
    items = list(schemas().items())
    reqs = []
    t = time.perf_counter()
    for i in range(n):
        name, schema = items[i % len(items)]
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i,
                            structured_outputs={"json": schema} if constrained else None,
                            ignore_eos=not constrained)
        reqs.append(engine.add_request(f"Here is the data as JSON ({name}):", sp))
    while engine.has_unfinished_requests():
        engine.step(stream=False)
    sync(engine.runner.device)
    dt = time.perf_counter() - t
    tokens = sum(s.num_output_tokens for r in reqs for s in r.seqs)
    return {"mode": "json schemas" if constrained else "unconstrained", "requests": n, "output_tokens": tokens,
            "seconds": dt, "output_tok_s": tokens / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--cuda-graphs", action="store_true")
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--fused-kernels", action="store_true")
    ap.add_argument("--attention-backend", default=None)
    out_argument(ap, "structured_output.json", "JSON report (a .md table and a .png plot beside it)")
    args, extra = ap.parse_known_args()
    if extra:
        ap.error(f"unknown arguments {extra}")
    opt = {k: getattr(args, k) for k in ("cuda_graphs", "async_scheduling", "fused_kernels") if getattr(args, k)}
    if args.attention_backend:
        opt["attention_backend"] = args.attention_backend
    # continuous batching over the paged cache, as a server runs: with the default (batching="none") a
    # "batch" of 32 would decode one request per step
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_model_len=512,
                                    batching="continuous", kv_cache="paged",
                                    max_num_seqs=max(args.batch_sizes + [args.num_requests]), **opt), progress=False)
    compile_rows = compile_times(engine)
    print(markdown_table(compile_rows, ["schema", "cold_ms", "cached_ms"]), flush=True)
    engine.index_cache = IndexCache(engine.tokenizer, engine.eos_token_ids[0])
    engine.index_cache.get(StructuredOutputsParams(regex=OPEN_REGEX).to_regex()).result()  # cached from here on

    tpot_rows = []
    for b in args.batch_sizes:
        modes = {"unconstrained": [False] * b, "constrained": [True] * b,
                 "mixed (half)": [i % 2 == 0 for i in range(b)] if b > 1 else None}
        modes = {k: v for k, v in modes.items() if v is not None}
        decode_tpot(engine, b, [False] * b, 4, args.input_len)  # warm-up
        times: dict[str, list[float]] = {k: [] for k in modes}
        for _ in range(args.rounds):  # alternate, so both see the same machine
            for k, v in modes.items():
                times[k].append(decode_tpot(engine, b, v, args.output_len, args.input_len))
                print(f"batch {b} {k}: {1e3 * times[k][-1]:.1f} ms/step", flush=True)
        base = statistics.median(times["unconstrained"])
        for k, v in times.items():
            med = statistics.median(v)
            tpot_rows.append({"batch": b, "mode": k, "tpot_ms": 1e3 * med, "vs_unconstrained": med / base,
                              "rounds_ms": [round(1e3 * x, 2) for x in v]})

    mask_rows = [sampler_cost(engine, b, c) for b in args.batch_sizes for c in sorted({1, b // 2, b}) if c]
    for r in mask_rows:
        step = next(x["tpot_ms"] for x in tpot_rows if x["batch"] == r["batch"] and x["mode"] == "unconstrained")
        r["mask_vs_step"] = r["mask_ms"] / step
    print(markdown_table(mask_rows, ["batch", "constrained_rows", "sample_ms", "sample_with_mask_ms", "mask_ms",
                                     "mask_vs_step"]), flush=True)

    tp_rows = []
    for _ in range(2):
        for c in (False, True):
            tp_rows.append(throughput(engine, args.num_requests, c, args.max_tokens))
            print(tp_rows[-1], flush=True)
    tp_rows = tp_rows[2:]  # the first pair warms up

    report = {"args": vars(args), "environment": environment(args.device), "compile": compile_rows,
              "tpot": tpot_rows, "mask_cost": mask_rows, "throughput": tp_rows}
    table = "\n\n".join([
        "Index compile (ms)\n\n" + markdown_table(compile_rows, ["schema", "cold_ms", "cached_ms"]),
        f"Decode step time with masking (regex {OPEN_REGEX!r}, {args.output_len} tokens, median of "
        f"{args.rounds} alternating rounds)\n\n" + markdown_table(tpot_rows, ["batch", "mode", "tpot_ms",
                                                                               "vs_unconstrained"]),
        "Masking work alone (sampler without / with the mask; mask_vs_step: its share of an unconstrained "
        "decode step)\n\n" + markdown_table(mask_rows, ["batch", "constrained_rows", "sample_ms", "sample_with_mask_ms",
                                                      "mask_ms", "mask_vs_step"]),
        "Throughput\n\n" + markdown_table(tp_rows, ["mode", "requests", "output_tokens", "seconds", "output_tok_s"]),
    ])
    write_report(report, args.out, table)
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        modes = list(dict.fromkeys(r["mode"] for r in tpot_rows))
        width = 0.8 / len(modes)
        for j, m in enumerate(modes):
            xs = [i + j * width for i, b in enumerate(args.batch_sizes)
                  for r in tpot_rows if r["batch"] == b and r["mode"] == m]
            ys = [r["tpot_ms"] for b in args.batch_sizes for r in tpot_rows if r["batch"] == b and r["mode"] == m]
            ax.bar(xs, ys, width, label=m)
        ax.set_xticks([i + width for i in range(len(args.batch_sizes))], [f"batch {b}" for b in args.batch_sizes])
        ax.set_ylabel("decode step time (ms)")
        ax.set_title(f"Structured output: masking cost ({Path(args.model).name}, {args.device})")
        ax.legend()
        save_figure(fig, Path(args.out).with_suffix(".png"))
    print(json.dumps({"done": True}))


if __name__ == "__main__":
    main()
