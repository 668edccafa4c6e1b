"""Single-stream latency: TTFT and TPOT of one request at a time, infer next to HF transformers.

    python benchmarks/single_stream.py                                   # smollm2-135m on this CPU
    python benchmarks/single_stream.py --prompt-lens 128 1024 --output-len 128 --hf eager
    python benchmarks/single_stream.py --model /path/qwen3-0.6b --device cuda --hf eager compiled

For each prompt length: prompts of random token ids (fixed seeds), ``output-len`` tokens
generated greedily with ``ignore_eos`` (so every run produces the same number of tokens). infer
gets a new prompt each run (a warm-up, then ``--repeats``), so that with prefix caching on its
TTFT is still a cold prefill; HF, which caches nothing across calls, repeats one.
TTFT is the time to the first token, TPOT the mean time per later token. TPOT is also given as a
fraction of the batch-1 decode floor (weights + KV bytes / measured bandwidth). HF
transformers runs the same weights in the same process: ``eager`` is its default
``generate``; ``compiled`` uses ``cache_implementation="static"``, with which transformers compiles its
forward with ``torch.compile`` (GPU only). ``--infer-configs "kv_cache=contiguous;kv_cache=paged"``
runs one infer per ``;``-separated set of EngineConfig overrides (as in offline_throughput.py).

Writes the JSON report (commit, hardware, versions, every EngineConfig, workload, ceilings, every
row) to ``--out`` (default ``benchmarks/runs/single_stream.json``) and the Markdown table beside it
(``.md``); ``plot_single_stream.py`` draws reports.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import (
    ceilings,
    decode_floor_s,
    environment,
    free_device_memory,
    infer_label,
    load_hf,
    markdown_table,
    out_argument,
    parse_infer_configs,
    sync,
    write_report,
)
from workloads import random_prompt


def bench_infer(llm, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Median TTFT and TPOT (ms) of the prompts run one after the other, the first as a warm-up. Each
    prompt is new to the engine, so with prefix caching on no run is a cache hit (a cold TTFT)."""
    from infer.sampling import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ttfts, tpots = [], []
    device = llm.engine.runner.device
    for prompt in prompts:  # the first run warms up
        sync(device)
        start = time.perf_counter()
        first = None
        n = 0
        for out in llm.generate_stream(prompt, params):
            if first is None and out.outputs[0].delta_token_ids:
                first = time.perf_counter()
            n += len(out.outputs[0].delta_token_ids)
        end = time.perf_counter()
        assert n == output_len, n
        ttfts.append(first - start)
        tpots.append((end - first) / (n - 1))
    return {"ttft_ms": 1e3 * statistics.median(ttfts[1:]), "tpot_ms": 1e3 * statistics.median(tpots[1:])}


def bench_hf(model, prompt: list[int], output_len: int, repeats: int, compiled: bool) -> dict[str, float]:
    """TTFT = generate(1 token); TPOT = (generate(N) - generate(1)) / (N - 1)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        if compiled:
            cfg.cache_implementation = "static"
        sync(device)
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, generation_config=cfg)
        sync(device)
        return time.perf_counter() - t

    if compiled:
        # transformers >= 4.50 compiles the forward itself when the cache is static on a GPU
        # (GenerativePreTrainedModel._valid_auto_compile_criteria); warm it up at this shape.
        for _ in range(3):
            gen(output_len)
    else:
        gen(4)
    t1 = statistics.median(gen(1) for _ in range(repeats))
    tn = statistics.median(gen(output_len) for _ in range(repeats))
    return {"ttft_ms": 1e3 * t1, "tpot_ms": 1e3 * (tn - t1) / (output_len - 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="short name, .gguf or HF directory")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128], help="prompt lengths (tokens)")
    ap.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median)")
    ap.add_argument("--hf", nargs="*", default=["eager"], choices=["eager", "compiled"],
                    help="HF transformers configurations to measure beside infer (none: --hf)")
    ap.add_argument("--infer-configs", default=None,
                    help='";"-separated EngineConfig overrides, one infer run each, e.g. '
                         '"attention_backend=torch;attention_backend=triton" (default: one run, defaults)')
    ap.add_argument("--seed", type=int, default=0)
    out_argument(ap, "single_stream.json", "write the JSON report here (and a .md beside it)")
    args = ap.parse_args(argv)

    from infer.llm import LLM

    rows = []
    results = {}
    engine_configs = {}
    ceil = None
    for ov in parse_infer_configs(args.infer_configs):
        label = infer_label(ov)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, progress=True,
                  **{"max_model_len": max(args.prompt_lens) + args.output_len + 8, **ov})
        engine_configs[label] = llm.config.to_dict()
        cfg = llm.engine.loaded.config
        device = str(llm.engine.runner.device)
        dtype = llm.engine.runner.dtype
        if ceil is None:
            print(f"measuring ceilings on {device} ...", flush=True)
            ceil = ceilings(device)
        for plen in args.prompt_lens:
            prompts = [random_prompt(cfg.vocab_size, plen, args.seed + r) for r in range(args.repeats + 1)]
            floor_ms = 1e3 * decode_floor_s(cfg, dtype, plen + args.output_len // 2, ceil["bandwidth_gb_s"])
            print(f"{label}: prompt {plen} ...", flush=True)
            r = bench_infer(llm, prompts, args.output_len)
            results[f"{label}/{plen}"] = r
            rows.append({"engine": label, "prompt": plen, **r, "floor_ms": floor_ms,
                         "tok_s": 1e3 / r["tpot_ms"], "floor_frac": floor_ms / r["tpot_ms"]})
            print(f"  ttft {r['ttft_ms']:.2f} ms, tpot {r['tpot_ms']:.3f} ms ({floor_ms / r['tpot_ms']:.0%} of floor)",
                  flush=True)
        path = llm.engine.loaded.path
        del llm
        free_device_memory()
    from infer.loader.synthetic import random_weights_spec

    if args.hf and path.is_dir() and random_weights_spec(path) is not None:
        print("skipping HF transformers: the model's weights are generated at load time (--random-weights), "
              "there is no checkpoint for transformers to load")
        args.hf = []
    for mode in args.hf or []:
        if mode == "compiled" and torch.device(device).type != "cuda":
            print("skipping HF compiled on CPU")
            continue
        print(f"HF transformers ({mode}): loading ...", flush=True)
        hf = load_hf(path, device, dtype)
        for plen in args.prompt_lens:
            prompt = random_prompt(cfg.vocab_size, plen, args.seed)
            floor_ms = 1e3 * decode_floor_s(cfg, dtype, plen + args.output_len // 2, ceil["bandwidth_gb_s"])
            print(f"HF {mode}: prompt {plen} ...", flush=True)
            r = bench_hf(hf, prompt, args.output_len, args.repeats, compiled=mode == "compiled")
            results[f"hf-{mode}/{plen}"] = r
            rows.append({"engine": f"hf-{mode}", "prompt": plen, **r, "floor_ms": floor_ms,
                         "tok_s": 1e3 / r["tpot_ms"], "floor_frac": floor_ms / r["tpot_ms"]})
        del hf
        free_device_memory()
    for row in rows:
        base = next((x for x in rows if x["engine"] == "hf-eager" and x["prompt"] == row["prompt"]), None)
        row["speedup_vs_hf_eager"] = base["tpot_ms"] / row["tpot_ms"] if base else ""
    report = {
        "benchmark": "single_stream",
        "env": environment(device),
        "model": str(path),
        "dtype": str(dtype),
        "engine_config": engine_configs,
        "workload": {"prompt_lens": args.prompt_lens, "output_len": args.output_len, "seed": args.seed,
                     "ignore_eos": True, "greedy": True, "repeats": args.repeats},
        "ceilings": ceil,
        "results": results,
        "rows": rows,
    }
    table = markdown_table(rows, ["engine", "prompt", "ttft_ms", "tpot_ms", "tok_s", "floor_ms", "floor_frac",
                                  "speedup_vs_hf_eager"])
    table += (f"\n\nceilings: {ceil['bandwidth_gb_s']:.0f} GB/s copy, {ceil['matmul_tflops']:.2f} TFLOP/s "
              f"{ceil['matmul_dtype']} matmul; {report['env'].get('gpu') or report['env']['cpu']}")
    write_report(report, args.out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
