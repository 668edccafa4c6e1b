"""Prefix caching (phase 7): cold vs warm TTFT by prefix length, and serving workloads with the
cache off and on, in one process (no HTTP server needed: runs where fastapi is not installed).

    python benchmarks/prefix_caching.py --prefix-lens 256 1024 --num-requests 8 --out /tmp/pc.json \\
        --plot /tmp/pc.png                                                    # smollm2-135m, this CPU
    # the GPU run (Qwen3-4B shapes, synthetic weights)
    python scripts/make_synthetic_checkpoint.py qwen3-4b /tmp/qwen3-4b --device cuda
    python benchmarks/prefix_caching.py --model /tmp/qwen3-4b --device cuda --max-model-len 8192 \\
        --prefix-lens 1024 2048 4096 --num-requests 64 --request-rate 8 --out benchmarks/runs/pc.json \\
        --plot benchmarks/runs/pc.png
    # only a plot: TTFT per request of serve_bench runs (e.g. an ablation's runs/*.json)
    python benchmarks/prefix_caching.py --serve-reports off=runs/all-off.json on=runs/prefix_caching_true.json \\
        --plot ttft.png

**Part 1, TTFT cold vs warm.** For each ``--prefix-lens`` L, ``--repeats`` times: the prefix
cache is reset, a request of L prefix tokens + ``--suffix-len`` unique tokens runs alone
(``max_tokens=1``: its TTFT is its whole run) — *cold* —, then a request with the same prefix and
another suffix — *warm*: only the suffix and the prefix's last partial block are prefilled (a
hybrid model, phase 17: everything after the last state snapshot at or below the prefix; the
``warm_cached_tokens`` column says how much was reused). The same cold request also runs on an
engine with ``prefix_caching`` off (the flag's cost on a miss). Medians, and the ratio cold / warm.
``--check-tokens N``: N greedy tokens of the last warm prompt against the flag-off engine's.

    # phase 17, a hybrid model (Qwen3.5: Gated DeltaNet + attention) on this CPU
    python scripts/make_synthetic_checkpoint.py small-qwen3.5 /tmp/small-qwen3.5
    python benchmarks/prefix_caching.py --model /tmp/small-qwen3.5 --prefix-lens 1024 1000 200 \\
        --workloads --repeats 3 --check-tokens 8 --out /tmp/pc-hybrid.json

**Part 2, serving workloads**, each on an engine with the flag off and one with it on
(continuous batching, the paged cache; ``--engine-args`` adds EngineConfig overrides), requests
arriving at ``--request-rate`` (Poisson; ``inf``: all at once), driven in this process:

* ``shared-prefix``: ``--num-requests`` requests: one ``--workload-prefix-len`` prefix +
  ``--suffix-len`` unique tokens, ``--output-len`` tokens each;
* ``multi-turn``: ``--num-requests // --turns`` conversations of ``--turns`` turns; a turn is
  ``--suffix-len`` new tokens after the whole history (the earlier turns and the tokens generated
  for them), sent when the previous turn's answer is complete; the first turn starts with the
  shared ``--workload-prefix-len`` system prompt;
* ``random``: ``--num-requests`` prompts of prefix + suffix length with nothing shared (what the
  flag costs where it cannot help).

Per workload and configuration: output tok/s and total tok/s (prompt + output tokens / wall),
TTFT p50/p90 (from each request's arrival time: time queued counts), the prefix-cache hit rate,
the prefill tokens the engine ran, and ``prefix_cache_host_share``: the fraction of the wall
time spent in the prefix cache's host work (hashing, keying blocks, lookups), timed directly,
which bounds what the flag can cost where nothing is shared even when run-to-run noise is larger
than that. All requests are greedy with ``ignore_eos``.

Writes the JSON report (environment, the EngineConfig with the flag on, arguments, both parts' rows)
to ``--out`` (default ``benchmarks/runs/prefix_caching.json``) and the Markdown tables beside it
(``.md``); ``--plot X.png`` draws TTFT vs prefix length and throughput per workload.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import time
from pathlib import Path
from typing import Any

from common import (
    RUNS,
    engine_overrides,
    environment,
    free_device_memory,
    markdown_table,
    out_argument,
    percentiles_ms,
    save_figure,
    sync,
    ttft_alone,
    write_report,
)


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def engine_config(args, prefix_caching: bool):
    from infer.config import EngineConfig

    kw = dict(device=args.device, kv_cache="paged", batching="continuous", prefix_caching=prefix_caching,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    kw.update(engine_overrides(args.engine_args))
    return EngineConfig.from_kwargs(model=args.model, **kw)


_LOADED: list = []  # the weights, loaded once and shared by every engine of the run


def make_engine(args, prefix_caching: bool):
    from infer.engine import LLMEngine
    from infer.loader import load_model

    cfg = engine_config(args, prefix_caching)
    if not _LOADED:
        _LOADED.append(load_model(cfg.model, cfg.resolved_device(), cfg.resolved_dtype(), progress=False))
    return LLMEngine(cfg, loaded=_LOADED[0], progress=False)


def greedy_tokens(engine, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of ``prompt`` (run alone)."""
    from infer.sampling import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out = None
    while engine.has_unfinished_requests():
        out = next((o.outputs[0].token_ids for o in engine.step() if o.finished), out)
    return out


def ttft_part(args, vocab: int) -> list[dict[str, Any]]:
    import statistics

    rng = random.Random(args.seed)
    cases = [(L, [(random_ids(rng, L, vocab), random_ids(rng, args.suffix_len, vocab),
                   random_ids(rng, args.suffix_len, vocab)) for _ in range(args.repeats)]) for L in args.prefix_lens]
    rows = {L: {"prefix_len": L} for L in args.prefix_lens}
    for flag in (True, False):
        engine = make_engine(args, flag)
        ttft_alone(engine, random_ids(rng, 64, vocab))  # warm-up
        for L, reps in cases:
            cold, warm, hits = [], [], []
            for prefix, a, b in reps:
                engine.reset_prefix_cache()
                cold.append(ttft_alone(engine, prefix + a))
                if flag:
                    before = engine.kv_manager.prefix_cache_hits
                    warm.append(ttft_alone(engine, prefix + b))
                    hits.append(engine.kv_manager.prefix_cache_hits - before)
            r = rows[L]
            if args.check_tokens:  # the warm run's greedy tokens against the flag-off engine's (a hybrid
                prefix, _, b = reps[-1]  # model restores a state snapshot here: it must not change them)
                r["tokens_on" if flag else "tokens_off"] = greedy_tokens(engine, prefix + b, args.check_tokens)
            if flag:
                r["ttft_cold_ms"] = 1e3 * statistics.median(cold)
                r["ttft_warm_ms"] = 1e3 * statistics.median(warm)
                r["cold_over_warm"] = r["ttft_cold_ms"] / r["ttft_warm_ms"]
                r["warm_cached_tokens"] = statistics.median(hits)
            else:
                r["ttft_off_ms"] = 1e3 * statistics.median(cold)
        del engine
        free_device_memory()
    for r in rows.values():
        r["cold_vs_off"] = r["ttft_cold_ms"] / r["ttft_off_ms"]
        if args.check_tokens:
            r["warm_tokens_equal_off"] = r.pop("tokens_on") == r.pop("tokens_off")
    return list(rows.values())


# ---------------------------------------------------------------------------------- serving workloads


def build_workload(name: str, args, vocab: int) -> list[list[tuple[list[int], int]]]:
    """Conversations: each a list of turns ``(new prompt tokens, max_tokens)``; single-turn
    workloads are conversations of one turn."""
    rng = random.Random(f"{args.seed}-{name}")
    P, S, O = args.workload_prefix_len, args.suffix_len, args.output_len
    if name == "shared-prefix":
        prefix = random_ids(rng, P, vocab)
        return [[(prefix + random_ids(rng, S, vocab), O)] for _ in range(args.num_requests)]
    if name == "random":
        return [[(random_ids(rng, P + S, vocab), O)] for _ in range(args.num_requests)]
    if name == "multi-turn":
        system = random_ids(rng, P, vocab)
        n = max(1, args.num_requests // args.turns)
        return [[((system if t == 0 else []) + random_ids(rng, S, vocab), O) for t in range(args.turns)]
                for _ in range(n)]
    raise ValueError(name)


def time_prefix_cache_work(engine) -> list[float]:
    """Wrap the prefix cache's host work (hashing, keying blocks, lookups) so its seconds add up in
    the returned one-element list: the flag's whole cost where nothing is shared."""
    spent = [0.0]
    kv = engine.kv_manager
    for name in ("find_cached_prefix", "cache_blocks"):
        fn = getattr(kv, name)

        def timed_call(*a, fn=fn):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                spent[0] += time.perf_counter() - t

        setattr(kv, name, timed_call)
    return spent


def serve(engine, convs: list[list[tuple[list[int], int]]], rate: float, seed: int) -> dict[str, Any]:
    """Drive ``engine`` over the conversations, arrivals Poisson at ``rate`` conversations/s; a
    conversation's next turn arrives when its previous answer is complete."""
    from infer.sampling import SamplingParams

    spent = time_prefix_cache_work(engine) if engine.config.prefix_caching else [0.0]
    rng = random.Random(seed)
    t, pending = 0.0, []
    for c in range(len(convs)):
        heapq.heappush(pending, (t, c, 0))
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    history: dict[int, list[int]] = {c: [] for c in range(len(convs))}
    recs: dict[str, dict[str, Any]] = {}
    engine.scheduler.reset_stats()
    sync(engine.runner.device)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            at, c, turn = heapq.heappop(pending)
            new, max_tokens = convs[c][turn]
            prompt = history[c] + new
            rid = f"c{c}t{turn}"
            engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               request_id=rid)
            recs[rid] = {"conv": c, "turn": turn, "arrival": at, "prompt": prompt}
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        now = time.perf_counter() - t0
        for out in outs:
            rec = recs[out.request_id]
            if "first" not in rec and out.outputs[0].token_ids:
                rec["first"] = now
            if out.finished:
                rec.update(end=now, output_tokens=len(out.outputs[0].token_ids), cached=out.num_cached_tokens or 0)
                c, turn = rec["conv"], rec["turn"]
                history[c] = rec["prompt"] + out.outputs[0].token_ids
                if turn + 1 < len(convs[c]):
                    heapq.heappush(pending, (now, c, turn + 1))
    wall = time.perf_counter() - t0
    for name in ("find_cached_prefix", "cache_blocks"):  # unwrap (time_prefix_cache_work)
        vars(engine.kv_manager).pop(name, None)
    out_tok = sum(r["output_tokens"] for r in recs.values())
    prompt_tok = sum(len(r["prompt"]) for r in recs.values())
    st = engine.stats()
    res = {"requests": len(recs), "wall_s": wall, "output_tok_per_s": out_tok / wall,
           "total_tok_per_s": (out_tok + prompt_tok) / wall, "prompt_tokens": prompt_tok,
           "prefill_tokens_run": st["num_prefill_tokens"], "num_preemptions": st["num_preemptions"],
           "prefix_hit_rate": sum(r["cached"] for r in recs.values()) / prompt_tok if prompt_tok else 0.0,
           "prefix_cache_host_share": spent[0] / wall,
           **percentiles_ms([r["first"] - r["arrival"] for r in recs.values()], "ttft")}
    later = [r["first"] - r["arrival"] for r in recs.values() if r["turn"] > 0]
    if later:
        res.update(percentiles_ms([r["first"] - r["arrival"] for r in recs.values() if r["turn"] == 0],
                                  "ttft_first_turn"))
        res.update(percentiles_ms(later, "ttft_later_turns"))
    return res


def serving_part(args, vocab: int) -> list[dict[str, Any]]:
    rows = []
    workloads = {w: build_workload(w, args, vocab) for w in args.workloads}
    for flag in (False, True):
        engine = make_engine(args, flag)
        serve(engine, [[(random_ids(random.Random(1), 64, vocab), 4)]], math.inf, 0)  # warm-up
        for w, convs in workloads.items():
            engine.reset_prefix_cache()
            res = serve(engine, convs, args.request_rate, args.seed)
            rows.append({"workload": w, "prefix_caching": flag, **res})
            print(f"{w:14s} prefix_caching={flag!s:5s}: {res['total_tok_per_s']:.0f} tok/s, TTFT p50 "
                  f"{res['ttft_p50_ms']:.1f} ms, hit rate {res['prefix_hit_rate']:.2f}", flush=True)
        del engine
        free_device_memory()
    for r in rows:
        off = next(o for o in rows if o["workload"] == r["workload"] and not o["prefix_caching"])
        r["throughput_vs_off"] = r["total_tok_per_s"] / off["total_tok_per_s"]
        r["ttft_p50_vs_off"] = r["ttft_p50_ms"] / off["ttft_p50_ms"]
    return rows


def plot(ttft_rows: list[dict], serve_rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = (1 if ttft_rows else 0) + (1 if serve_rows else 0)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.2), squeeze=False)
    k = 0
    if ttft_rows:
        ax = axes[0][k]
        k += 1
        x = [r["prefix_len"] for r in ttft_rows]
        for key, label, m in (("ttft_off_ms", "cache off", "s"), ("ttft_cold_ms", "cache on, cold", "o"),
                              ("ttft_warm_ms", "cache on, warm", "^")):
            ax.plot(x, [r[key] for r in ttft_rows], marker=m, label=label)
        for r in ttft_rows:
            ax.annotate(f"{r['cold_over_warm']:.0f}x", (r["prefix_len"], r["ttft_warm_ms"]),
                        textcoords="offset points", xytext=(4, -12), fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("shared prefix (tokens)")
        ax.set_ylabel("TTFT (ms, median)")
        ax.set_title("one request alone: cold vs warm prefix")
        ax.legend()
    if serve_rows:
        ax = axes[0][k]
        names = list(dict.fromkeys(r["workload"] for r in serve_rows))
        xs = np.arange(len(names))
        for j, flag in enumerate((False, True)):
            vals = [next(r for r in serve_rows if r["workload"] == n and r["prefix_caching"] == flag)
                    for n in names]
            bars = ax.bar(xs + (j - 0.5) * 0.38, [v["total_tok_per_s"] for v in vals], 0.38,
                          label=f"prefix caching {'on' if flag else 'off'}")
            for b, v in zip(bars, vals):
                ax.annotate(f"TTFT {v['ttft_p50_ms']:.0f} ms" + (f"\nhit {v['prefix_hit_rate']:.0%}" if flag else ""),
                            (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs, names)
        ax.set_ylabel("total tok/s (prompt + output)")
        ax.set_title("serving workloads (TTFT p50 on the bars)")
        ax.legend(loc="lower right")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def plot_serve_reports(specs: list[str], path: str) -> None:
    """TTFT of every request, in send order, from serve_bench reports (``LABEL=REPORT.json``; each
    report's configurations are drawn separately): a cold first request, then hits."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for spec in specs:
        label, file = spec.split("=", 1) if "=" in spec else (Path(spec).stem, spec)
        rep = json.loads(Path(file).read_text())
        for run in rep["raw"]:
            recs = sorted((r for r in run["requests"] if r["success"]), key=lambda r: r["send_s"])
            name = f"{label} {run['config']}".strip()
            ax.plot(range(1, len(recs) + 1), [1e3 * r["ttft"] for r in recs], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("request (send order)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("shared prefix: TTFT per request", fontsize=10)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--engine-args", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="more EngineConfig overrides for every engine (e.g. block_size=32 chunked_prefill=true)")
    ap.add_argument("--prefix-lens", type=int, nargs="*", default=[256, 1024],
                    help="part 1: shared prefix lengths (tokens); none: skip part 1")
    ap.add_argument("--suffix-len", type=int, default=32, help="unique tokens after the prefix / per turn")
    ap.add_argument("--repeats", type=int, default=3, help="part 1: cold/warm pairs per length (median)")
    ap.add_argument("--check-tokens", type=int, default=0,
                    help="part 1: also compare this many greedy tokens of a warm prompt with the flag-off engine's")
    ap.add_argument("--workloads", nargs="*", default=["shared-prefix", "multi-turn", "random"],
                    choices=["shared-prefix", "multi-turn", "random"], help="part 2 (none: skip)")
    ap.add_argument("--workload-prefix-len", type=int, default=1024,
                    help="part 2: the shared prefix / system prompt; random prompts have this many more tokens")
    ap.add_argument("--num-requests", type=int, default=16, help="part 2: requests per workload")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=math.inf,
                    help="part 2: Poisson arrivals of requests (conversations for multi-turn) per second")
    ap.add_argument("--seed", type=int, default=0)
    out_argument(ap, "prefix_caching.json", "JSON report (and .md beside it)")
    ap.add_argument("--plot", default=None, help="PNG: TTFT vs prefix length, throughput per workload")
    ap.add_argument("--serve-reports", nargs="+", default=None, metavar="LABEL=REPORT.json",
                    help="only plot (to --plot, default benchmarks/runs/ttft_per_request.png) the per-request TTFT "
                         "of serve_bench reports, in send order")
    args = ap.parse_args(argv)
    if args.serve_reports:
        plot_serve_reports(args.serve_reports, args.plot or str(RUNS / "ttft_per_request.png"))
        return 0

    cfg = engine_config(args, True).validate()
    device = str(cfg.resolved_device())
    probe = make_engine(args, True)  # loads the weights (kept for every engine)
    vocab = probe.vocab_size
    del probe
    free_device_memory()
    ttft_rows = ttft_part(args, vocab) if args.prefix_lens else []
    serve_rows = serving_part(args, vocab) if args.workloads else []
    env = environment(device)
    report = {"benchmark": "prefix_caching", "env": env, "model": args.model,
              "engine_config_flag_on": cfg.to_dict(),
              "args": {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf") for k, v in vars(args).items()},
              "ttft": ttft_rows, "serving": serve_rows}
    table = (f"prefix caching: {Path(args.model).name} on {env.get('gpu') or env['cpu']}, commit {env['commit']}, "
             f"suffix {args.suffix_len} tokens\n\n")
    if ttft_rows:
        table += markdown_table(ttft_rows, ["prefix_len", "ttft_off_ms", "ttft_cold_ms", "ttft_warm_ms",
                                            "cold_over_warm", "cold_vs_off", "warm_cached_tokens"]
                                + (["warm_tokens_equal_off"] if args.check_tokens else [])) + "\n\n"
    if serve_rows:
        table += (f"serving: {args.num_requests} requests, prefix {args.workload_prefix_len} + {args.suffix_len}, "
                  f"output {args.output_len}, rate {args.request_rate:g}/s, {args.turns} turns (multi-turn)\n\n")
        table += markdown_table(serve_rows, ["workload", "prefix_caching", "total_tok_per_s", "output_tok_per_s",
                                             "throughput_vs_off", "ttft_p50_ms", "ttft_p90_ms", "ttft_p50_vs_off",
                                             "prefix_hit_rate", "prefix_cache_host_share", "prefill_tokens_run",
                                             "num_preemptions"])
    write_report(report, args.out, table)
    if args.plot:
        plot(ttft_rows, serve_rows, args.plot, f"{Path(args.model).name} on {env.get('gpu') or env['cpu']}, "
                                                f"commit {env['commit']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
