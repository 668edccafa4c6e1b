#!/usr/bin/env python3
"""Tensor/expert-parallel parity gate: the engine on W ranks against the engine on one, same weights.

For each preset (scripts/make_synthetic_checkpoint.py: random weights at a real model's shapes) it
writes a checkpoint, then runs the *whole engine* (``infer.llm.LLM``) once per configuration:
one rank, ``tensor_parallel_size=W`` and, for an MoE preset, ``expert_parallel_size=W``. Every run
scores the same prompts of random token ids teacher-forced (``prompt_logprobs``: the logprob of
each prompt token given the ones before) and then decodes greedily. Compared with the one-rank
run:

* ``|delta logprob|`` of the prompt tokens: mean, p99, max;
* greedy tokens: the share of requests whose tokens are identical, and the first position where
  they part.

Gates: ``fp32`` max |delta logprob| <= 1e-3 and every greedy token identical (splitting a sum over
ranks only reorders fp32 additions); ``bf16`` mean <= 0.06 and p99 <= 0.2 (scripts/gpu_parity.py's
bf16 gate: the reduction order changes bf16 rounding, and random weights give near-tied argmaxes,
so greedy tokens are reported, not gated).

Usage::

    python scripts/tp_parity.py --device cuda --presets qwen3-4b,tiny-qwen3-moe --dtype bf16 --out tp_parity.json
    python scripts/tp_parity.py --device cuda --dtype float32 --presets qwen3-0.6b,gemma3-1b,qwen3-30b-a3b-4l
    python scripts/tp_parity.py --device cuda --presets qwen3-8b --graphs  # + TP=2 replaying CUDA graphs
    python scripts/tp_parity.py --device cpu --dtype float32 --presets tiny-llama,tiny-qwen3-moe   # gloo

Exit status 1 when a configuration fails its gate (or raises).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import traceback
from pathlib import Path

import torch


def run(path: Path, kw: dict, prompts: list[list[int]], args) -> tuple[list[list[float]], list[list[int]]]:
    from infer.llm import LLM
    from infer.sampling import SamplingParams

    llm = LLM(str(path), progress=False, device=args.device, dtype=args.dtype, batching="continuous",
              max_model_len=max(map(len, prompts)) + args.max_tokens + 8, **kw)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                                                    prompt_logprobs=0), use_tqdm=False)
        lps = [[p.token.logprob for p in o.prompt_logprobs[1:]] for o in outs]
        return lps, [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.engine.shutdown()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def compare(ref, got, gate: str) -> dict:
    (lp0, tok0), (lp1, tok1) = ref, got
    d = torch.tensor([abs(a - b) for x, y in zip(lp0, lp1) for a, b in zip(x, y)])
    same = [a == b for a, b in zip(tok0, tok1)]
    parts = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), None) for a, b in zip(tok0, tok1)]
    m = {"mean_abs_dlogprob": d.mean().item(), "p99_abs_dlogprob": d.quantile(0.99).item(),
         "max_abs_dlogprob": d.max().item(), "greedy_identical": sum(same) / len(same),
         "first_divergence": [p for p in parts if p is not None]}
    if gate == "fp32":
        m["pass"] = m["max_abs_dlogprob"] <= 1e-3 and all(same)
    else:
        m["pass"] = m["mean_abs_dlogprob"] <= 0.06 and m["p99_abs_dlogprob"] <= 0.2
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="qwen3-0.6b,tiny-qwen3-moe")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bf16 (default on cuda) or float32")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--lengths", default="7,64,300")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--graphs", action="store_true", help="also run TP=W with cuda_graphs (decode replays "
                    "captured graphs on every rank; CUDA only)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    gate = "fp32" if args.dtype in ("float32", "fp32") else "bf16"
    from make_synthetic_checkpoint import make_checkpoint

    from infer.loader import read_model_config

    work = args.workdir or Path(tempfile.mkdtemp(prefix="tp_parity_"))
    results, ok = [], True
    for preset in [p for p in args.presets.split(",") if p]:
        try:
            path = work / preset
            if not (path / "config.json").exists():  # a workdir may hold it already (same preset, dtype, seed)
                path = make_checkpoint(preset, path, dtype=args.dtype, device=args.device, seed=args.seed)
            mcfg = read_model_config(path)
            rng = random.Random(args.seed)
            prompts = [[rng.randrange(mcfg.vocab_size) for _ in range(int(n))] for n in args.lengths.split(",")]
            ref = run(path, {}, prompts, args)
            configs = {f"TP={args.ranks}": {"tensor_parallel_size": args.ranks}}
            if args.graphs:
                configs[f"TP={args.ranks} graphs"] = {"tensor_parallel_size": args.ranks, "cuda_graphs": True}
            if mcfg.num_experts:
                configs[f"EP={args.ranks}"] = {"expert_parallel_size": args.ranks}
            for label, kw in configs.items():
                m = compare(ref, run(path, kw, prompts, args), gate)
                results.append({"preset": preset, "config": label, "dtype": args.dtype, "gate": gate, **m})
                ok &= m["pass"]
                print(json.dumps(results[-1]), flush=True)
        except Exception:
            traceback.print_exc()
            results.append({"preset": preset, "error": traceback.format_exc(limit=3), "pass": False})
            ok = False
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
