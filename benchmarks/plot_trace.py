"""Draw a step trace (``EngineConfig.trace``) as a picture: tokens per step, KV blocks, queues.

    python benchmarks/plot_trace.py /tmp/steps.json --plot /tmp/steps.png        # a trace you recorded
    python benchmarks/plot_trace.py --record --configs "chunked_prefill=false;chunked_prefill=true" \\
        --engine-args batching=continuous max_num_batched_tokens=64 --plot docs/img/phase06_trace.png

Each trace becomes one column of three panels that share the step axis:

* **tokens per step**: prefill tokens (orange) under decode tokens (blue), the token budget dashed,
  a red triangle above a step that preempted a request;
* **KV-cache blocks**: held by sequences, and cached (free but holding a prefix-cache block), of the
  cache's blocks (after the step's scheduling);
* **sequences**: running and waiting after the step's scheduling.

``--record`` first runs a scripted workload once per ``--configs`` entry (EngineConfig overrides, ``;``
between configs, each on top of ``--engine-args``) with a trace, on one engine process each: three
requests of ``--short-len`` tokens at step 0; a request with a ``--long-len``-token prompt at step 6;
then two requests whose prompts are the long prompt's first ``--shared-len`` tokens and a few of
their own, at steps 14 and 22 (a prefix-cache hit when ``prefix_caching`` is on). Every request is
greedy, ``ignore_eos``, ``--output-len`` tokens (the long one half as many). The arrivals are counted in
the scheduler's steps, not in seconds, so the picture is the scheduler's and the same on any machine
(but for static batching's wait for its batch to fill, ``batch_wait_timeout_ms``); an engine that has
finished everything before the next arrival skips ahead to it.

Reads the Trace Event Format that :mod:`infer.engine.step_trace` writes: the ``steps`` thread's step
slices (their ``args``: prefill and decode tokens, budget) and the counters ``KV cache blocks`` and
``sequences``, one of each per step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import common  # noqa: F401  (before torch: it sets the OpenMP spin)
from common import engine_overrides, format_overrides, make_llm, parse_infer_configs, save_figure
from workloads import random_prompt

STEP_NAMES = {"prefill", "decode", "mixed", "outputs only"}


def load_steps(trace: dict) -> list[dict]:
    """One dict per step of a step trace (``{"traceEvents": ...}``), in order: ``step``, ``prefill``,
    ``decode`` (tokens), ``budget``, ``preemptions``, ``kv_used``, ``kv_cached``, ``kv_free``,
    ``running``, ``waiting``.

    Raises:
        ValueError: the trace has no step slices (not a step trace).
    """
    events = trace["traceEvents"]
    if not any(e.get("ph") == "M" and e.get("args", {}).get("name") == "infer engine" for e in events):
        raise ValueError("no 'infer engine' process in this trace: is it a step trace (EngineConfig.trace)?")
    engine_pid = next(e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                      and e["args"]["name"] == "infer engine")
    steps = sorted((e for e in events if e.get("ph") == "X" and e["pid"] == engine_pid
                    and e.get("name") in STEP_NAMES and "step" in e.get("args", {})), key=lambda e: e["ts"])
    if not steps:
        raise ValueError("no step slices in this trace: is it a step trace (EngineConfig.trace)?")
    counters: dict[str, list[dict]] = {}
    for e in sorted((e for e in events if e.get("ph") == "C" and e["pid"] == engine_pid), key=lambda e: e["ts"]):
        counters.setdefault(e["name"], []).append(e["args"])
    kv, seqs = counters.get("KV cache blocks", []), counters.get("sequences", [])
    if len(kv) != len(steps) or len(seqs) != len(steps):
        raise ValueError(f"{len(steps)} steps but {len(kv)} KV and {len(seqs)} sequence counters")
    out = []
    for e, k, s in zip(steps, kv, seqs):
        a = e["args"]
        out.append({"step": a["step"], "prefill": a["prefill_tokens"], "decode": a["decode_tokens"],
                    "budget": a["budget"], "preemptions": a.get("preemptions", 0), "kv_used": k["used"],
                    "kv_cached": k["cached"], "kv_free": k["free"], "running": s["running"],
                    "waiting": s["waiting"]})
    return out


def plot(columns: list[tuple[str, list[dict]]], path: str) -> None:
    """One column of three panels per ``(title, steps)`` (:func:`load_steps`), written to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(columns)
    fig, axes = plt.subplots(3, n, figsize=(5.2 * n, 6.4), sharex="col", squeeze=False,
                             gridspec_kw={"height_ratios": [2.2, 1.2, 1]})
    for c, (title, steps) in enumerate(columns):
        x = [s["step"] - steps[0]["step"] for s in steps]
        pre, dec = [s["prefill"] for s in steps], [s["decode"] for s in steps]
        ax = axes[0][c]
        ax.bar(x, pre, width=0.9, color="#e6862e", label="prefill tokens")
        ax.bar(x, dec, width=0.9, bottom=pre, color="#3b7dd8", label="decode tokens")
        budget = steps[0]["budget"]
        top = max(p + d for p, d in zip(pre, dec))
        if budget and budget <= 2 * top:
            ax.axhline(budget, color="#777", linestyle="--", linewidth=1, label="token budget")
            top = max(top, budget)
        ax.set_ylim(0, 1.12 * top)
        hit = [(xi, p + d) for xi, p, d, s in zip(x, pre, dec, steps) if s["preemptions"]]
        if hit:
            ax.scatter([h[0] for h in hit], [h[1] + 0.05 * top for h in hit], marker="v",
                       color="#d62728", zorder=3, label="preemption")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("tokens in the step")
        total = steps[0]["kv_used"] + steps[0]["kv_cached"] + steps[0]["kv_free"]
        ax = axes[1][c]
        ax.stackplot(x, [s["kv_used"] for s in steps], [s["kv_cached"] for s in steps],
                     colors=["#6a3d9a", "#9fd8cb"], labels=["held", "cached (prefix cache)"], step="mid")
        ax.set_ylim(0, total)
        ax.set_ylabel(f"KV blocks (of {total})")
        ax = axes[2][c]
        ax.step(x, [s["running"] for s in steps], where="mid", color="#2ca02c", label="running")
        ax.step(x, [s["waiting"] for s in steps], where="mid", color="#d62728", label="waiting")
        ax.set_ylabel("sequences")
        ax.set_xlabel("engine step")
    for r in range(3):
        for c in range(n if r == 0 else 1):  # the token panels' handles differ (budget, preemptions)
            axes[r][c].legend(fontsize=8, loc="upper right")
    save_figure(fig, path)


def record(model: str, overrides: dict, args, path: str) -> None:
    """Run the scripted workload (module docstring) on a fresh engine with ``overrides`` and a trace
    written to ``path``."""
    from infer.sampling import SamplingParams

    longest = args.long_len + args.output_len + 8
    llm = make_llm(model, {"device": args.device, **overrides, "trace": path}, longest, progress=False)
    engine = llm.engine
    vocab = engine.vocab_size
    long_prompt = random_prompt(vocab, args.long_len, 1000)
    arrivals = {0: [random_prompt(vocab, args.short_len, i) for i in range(3)], 6: [long_prompt],
                14: [long_prompt[:args.shared_len] + random_prompt(vocab, 8, 14)],
                22: [long_prompt[:args.shared_len] + random_prompt(vocab, 8, 22)]}
    pending = sorted(arrivals.items())
    while pending or engine.has_unfinished_requests():
        # the clock is the steps the scheduler ran (static batching may wait for its batch without one);
        # an idle engine skips ahead to the next arrival
        while pending and (pending[0][0] <= engine.scheduler.num_steps or not engine.has_unfinished_requests()):
            for prompt in pending.pop(0)[1]:
                n = args.output_len // 2 if prompt is long_prompt else args.output_len
                engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        engine.step(stream=False)
    engine.write_trace()
    llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", help="step trace JSON files (one column each)")
    ap.add_argument("--plot", required=True, help="write the picture here (PNG)")
    ap.add_argument("--titles", nargs="*", help="a title per column (default: the file name or the config)")
    ap.add_argument("--record", action="store_true", help="record the scripted workload's traces first")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--configs", default="", help="EngineConfig overrides per column, ';' between columns")
    ap.add_argument("--engine-args", nargs="*", default=[], help="EngineConfig overrides for every column")
    ap.add_argument("--short-len", type=int, default=24)
    ap.add_argument("--long-len", type=int, default=160)
    ap.add_argument("--shared-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=24)
    args = ap.parse_args(argv)
    columns = []
    if args.record:
        base = engine_overrides(args.engine_args)
        tmp = tempfile.mkdtemp(prefix="plot_trace-")
        for i, cfg in enumerate(parse_infer_configs(args.configs) or [{}]):
            path = os.path.join(tmp, f"trace{i}.json")
            print(f"[plot_trace] recording {format_overrides({**base, **cfg}) or 'defaults'}", flush=True)
            record(args.model, {**base, **cfg}, args, path)
            args.traces.append(path)
            columns.append(format_overrides(cfg) or "defaults")
    else:
        columns = [os.path.basename(p) for p in args.traces]
    if not args.traces:
        ap.error("give trace files, or --record")
    titles = args.titles or columns
    data = []
    for title, path in zip(titles, args.traces):
        with open(path) as f:
            steps = load_steps(json.load(f))
        print(f"[plot_trace] {title}: {len(steps)} steps, {sum(s['prefill'] for s in steps)} prefill and "
              f"{sum(s['decode'] for s in steps)} decode tokens, {sum(s['preemptions'] for s in steps)} "
              f"preemptions, peak {max(s['kv_used'] for s in steps)} blocks held", flush=True)
        data.append((title, steps))
    plot(data, args.plot)
    print(f"[plot_trace] wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
