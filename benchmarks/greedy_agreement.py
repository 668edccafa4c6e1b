#!/usr/bin/env python3
"""Do the optimization flags change greedy output? The share of identical continuations.

Runs the same greedy requests through infer once per configuration (the first is the
baseline) and compares every other configuration's tokens with the baseline's, request by
request:

* ``identical``: the share of continuations equal token for token (all ``--output-len``);
* for each one that differs: the first position that differs, and the baseline's *margin*
  there (its top-1 logprob minus its top-2 logprob, in nats). In float32 every flag must give
  identical tokens (tests/test_fused_engine.py checks it on the CPU). In bfloat16 a fused
  kernel rounds differently from the unfused ops, so a position whose two best tokens are
  within a few bf16 ulps of each other (a *near tie*) may flip; after a flip the two
  continuations are different texts and are no longer compared. Random-weight checkpoints
  make near ties common (a nearly flat next-token distribution), so the share is a lower
  bound of what a trained model shows.

Usage (GPU, a synthetic checkpoint from scripts/make_synthetic_checkpoint.py)::

    python benchmarks/greedy_agreement.py --model /tmp/ck/qwen3-0.6b --device cuda --dtype bfloat16 \\
        --num-prompts 64 --prompt-len 128 --output-len 256 \\
        --infer-configs "batching=continuous,kv_cache=paged;batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true" \\
        --out benchmarks/runs/greedy_agreement_qwen3-0.6b.json

Writes the JSON report (environment, model, workload, every configuration's agreement with the
baseline) to ``--out`` (default ``benchmarks/runs/greedy_agreement.json``).

Exit status 1 when a configuration's identical share is below ``--min-identical``, or a
divergence is not a near tie (margin above ``--tie-nats``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import common  # noqa: F401  (before torch: it sets the OpenMP spin, which libgomp reads once)
import torch
from common import (
    environment,
    free_device_memory,
    infer_label,
    out_argument,
    parse_infer_configs,
    resolve_device,
)


def run_config(model: str, overrides: dict, prompts, prompt_len: int, output_len: int, device: str,
               dtype: str) -> tuple[list[list[int]], list[list[float]], dict]:
    """Greedy continuations of ``prompts(vocab_size)`` (a list of token-id lists) and, per token,
    the top-1 minus top-2 logprob (nats)."""
    from infer.llm import LLM
    from infer.sampling import SamplingParams

    llm = LLM(model, device=device, dtype=dtype, progress=False,
              **{"max_model_len": prompt_len + output_len + 8, **overrides})
    prompts = prompts(llm.engine.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, logprobs=2)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens, margins = [], []
    for o in outs:
        c = o.outputs[0]
        tokens.append(list(c.token_ids))
        margins.append([p.top[0].logprob - p.top[1].logprob if len(p.top) > 1 else float("inf")
                        for p in c.logprobs])
    config = llm.config.to_dict()
    del llm
    free_device_memory()
    return tokens, margins, {"wall_s": round(wall, 2), "engine_config": config}


def compare(base: list[list[int]], base_margins: list[list[float]], other: list[list[int]],
            tie_nats: float) -> dict:
    """Per-request agreement of ``other`` with ``base`` (see the module docstring)."""
    diverged = []
    for i, (a, b) in enumerate(zip(base, other)):
        if a == b:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        margin = base_margins[i][pos] if pos < len(base_margins[i]) else float("nan")
        diverged.append({"request": i, "first_diff": pos, "baseline_margin_nats": round(margin, 5),
                         "near_tie": margin <= tie_nats})
    n = len(base)
    return {
        "requests": n,
        "identical": n - len(diverged),
        "identical_share": round((n - len(diverged)) / n, 4),
        "median_first_diff": statistics.median([d["first_diff"] for d in diverged]) if diverged else None,
        "all_near_ties": all(d["near_tie"] for d in diverged),
        "max_margin_at_divergence_nats": max((d["baseline_margin_nats"] for d in diverged), default=0.0),
        "diverged": diverged,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (random ids)")
    ap.add_argument("--output-len", type=int, default=256, help="greedy tokens per request")
    ap.add_argument("--infer-configs", required=True,
                    help='";"-separated EngineConfig overrides; the first is the baseline')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tie-nats", type=float, default=0.2,
                    help="a divergence where the baseline's top-2 margin is at most this is a near tie")
    ap.add_argument("--min-identical", type=float, default=0.0,
                    help="exit 1 when a configuration's identical share is below this")
    out_argument(ap, "greedy_agreement.json", "JSON report")
    args = ap.parse_args(argv)

    configs = parse_infer_configs(args.infer_configs)
    if len(configs) < 2:
        ap.error("--infer-configs needs a baseline and at least one other configuration")
    from infer.llm import LLM  # noqa: F401  (fail early when infer is not importable)

    def prompts(vocab: int) -> list[list[int]]:  # the same random prompts for every configuration
        g = torch.Generator().manual_seed(args.seed)
        return [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.num_prompts)]

    results, failed = [], False
    base = base_margins = None
    for ov in configs:
        label = infer_label(ov)
        print(f"{label}: {args.num_prompts} x {args.output_len} greedy tokens ...", flush=True)
        tokens, margins, info = run_config(args.model, ov, prompts, args.prompt_len, args.output_len,
                                           args.device, args.dtype)
        row = {"label": label, "overrides": ov, **info}
        if base is None:
            base, base_margins = tokens, margins
            flat = [m for ms in margins for m in ms]
            row["baseline_margin_quantiles_nats"] = {
                q: round(float(torch.tensor(flat).quantile(q)), 4) for q in (0.01, 0.05, 0.5)}
        else:
            row.update(compare(base, base_margins, tokens, args.tie_nats))
            bad = row["identical_share"] < args.min_identical or not row["all_near_ties"]
            failed |= bad
            print(f"  identical {row['identical']}/{row['requests']} ({row['identical_share']:.1%}); "
                  f"median first difference at token {row['median_first_diff']}; largest baseline margin "
                  f"at a divergence {row['max_margin_at_divergence_nats']:.3f} nats"
                  f"{' FAIL' if bad else ''}", flush=True)
        results.append(row)
    device = str(resolve_device(args.device))
    report = {"kind": "greedy_agreement", "env": environment(device),
              "model": args.model, "dtype": args.dtype, "num_prompts": args.num_prompts,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "tie_nats": args.tie_nats,
              "results": results, "passed": not failed}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
