"""Draw a step trace (``EngineConfig.trace``) as a picture: tokens per step, KV blocks, queues, time.

    python benchmarks/plot_trace.py /tmp/steps.json --plot /tmp/steps.png        # a trace you recorded
    python benchmarks/plot_trace.py --record --configs "chunked_prefill=false;chunked_prefill=true,max_num_batched_tokens=48" \\
        --engine-args batching=continuous kv_cache=paged --plot /tmp/chunked.png
    python benchmarks/plot_trace.py --record --warmup --device cuda --model DIR --panels tokens,time,graph \\
        --configs "cuda_graphs=false;cuda_graphs=true" --engine-args batching=continuous kv_cache=paged \\
        fused_kernels=true --plot $OUT/phase9_trace.png --save-traces $OUT   # on a GPU; DIR: a checkpoint

Each trace becomes one column of panels that share the step axis (``--panels``, top to bottom):

* ``tokens``: prefill tokens (orange) under decode tokens (blue), the token budget dashed, a red
  triangle above a step that preempted a request;
* ``kv``: KV-cache blocks held by sequences, and cached (free but holding a prefix-cache block), of
  the cache's blocks (after the step's scheduling);
* ``seqs``: sequences running and waiting after the step's scheduling;
* ``requests``: one row per sequence: waiting (grey, from its arrival to its admission; red after a
  preemption), then each step it ran in (orange: prefill, blue: decode);
* ``offload``: blocks copied down to the ``kv_offload`` tiers in the step (up) and restored from them
  (down), and the blocks the host tier holds;
* ``time``: per step, milliseconds (log scale): the step's wall time, the host's launch of its
  forward and sampling (``forward``: on a CPU, their run) and, on CUDA, the device's span of them
  (two CUDA events);
* ``graph``: how the step's forward ran: eagerly (grey) or as a captured CUDA graph (its kind by
  colour, its bucket in tokens written in the cell).

``--record`` first runs a scripted workload (``--scenario``) once per ``--configs`` entry
(EngineConfig overrides, ``;`` between configs, each on top of ``--engine-args``) with a trace, on one
engine process each, and keeps the traces (``--save-traces DIR``) beside the picture:

* ``mixed`` (the default): three requests of ``--short-len`` tokens at step 0; a request with a
  ``--long-len``-token prompt at step 6; then two requests whose prompts are the long prompt's first
  ``--shared-len`` tokens and a few of their own, at steps 14 and 22 (a prefix-cache hit when
  ``prefix_caching`` is on). Every request asks for ``--output-len`` tokens (the long one half as many).
* ``static``: four requests of ``--short-len`` tokens at step 0 asking for 1/4, 2/4, 3/4 and all of
  ``--output-len`` tokens, then two more (half of ``--output-len``) at steps 4 and 10: under static
  batching the batch shrinks as its members finish, and the newcomers wait for its longest one.
* ``offload``: the long prompt at step 0 (half of ``--output-len``); at step 14, ``--fillers``
  requests of ``--filler-len`` tokens that need the cache's room, so that the long prompt's cached
  blocks are evicted (with ``kv_offload``, copied to the host tier); at step 40 a prompt of its first
  ``--shared-len`` tokens and 8 of its own (restored from the host tier, or recomputed).

Every request is greedy and ``ignore_eos``. The arrivals are counted in the scheduler's steps, not in
seconds, so the picture is the scheduler's and the same on any machine (but for static batching's
wait for its batch to fill, ``batch_wait_timeout_ms``); an engine that has finished everything before
the next arrival skips ahead to it. ``--warmup`` runs the workload once first (other prompts) and
leaves it out of the trace: on CUDA the first steps of each shape compile Triton kernels.

Reads the Trace Event Format that :mod:`infer.engine.step_trace` writes: the ``steps`` thread's step
slices (their ``args``: prefill and decode tokens, budget, graph, counts, times), the counters
``KV cache blocks``, ``sequences`` and ``KV offload blocks``, and the ``requests`` process's tracks.
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
RUN_NAMES = {"prefill", "prefill chunk", "recompute", "decode"}
PANELS = ("tokens", "kv", "seqs", "requests", "offload", "time", "graph")
HEIGHTS = {"tokens": 2.2, "kv": 1.2, "seqs": 1.0, "requests": 1.8, "offload": 1.2, "time": 1.8, "graph": 0.45}
SCENARIOS = ("mixed", "static", "offload")
GRAPH_COLORS = {"eager": "#d9d9d9", "decode": "#2ca02c", "prefill": "#9467bd", "mixed-whole": "#17becf",
                "mixed-pieces": "#bcbd22"}
PREFILL, DECODE = "#e6862e", "#3b7dd8"
LEGEND_AT = {"offload blocks": "lower left", "ms": "best"}  # by the panel's y label


def load_steps(trace: dict) -> list[dict]:
    """One dict per step of a step trace (``{"traceEvents": ...}``), in order: ``step``, ``ts`` (µs),
    ``prefill``, ``decode`` (tokens), ``budget``, ``preemptions``, ``kv_used``, ``kv_cached``,
    ``kv_free``, ``running``, ``waiting``, ``graph`` (``"eager"`` or the graph's kind), ``graph_size``,
    ``offloaded``, ``restored`` (blocks copied to and from the offload tiers), ``host_blocks`` (the host
    tier's blocks; None without ``kv_offload``), and the times in milliseconds: ``wall_ms`` (the step),
    ``forward_ms`` (launching the forward and sampling; on a CPU, running them), ``device_ms`` (CUDA:
    the device's span of them; on a CPU the forward's).

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
    tiers = counters.get("KV offload blocks") or [None] * len(steps)
    if not len(kv) == len(seqs) == len(tiers) == len(steps):
        raise ValueError(f"{len(steps)} steps but {len(kv)} KV, {len(seqs)} sequence and {len(tiers)} "
                         "offload counters")
    out = []
    for e, k, s, t in zip(steps, kv, seqs, tiers):
        a = e["args"]
        out.append({"step": a["step"], "ts": e["ts"], "prefill": a["prefill_tokens"], "decode": a["decode_tokens"],
                    "budget": a["budget"], "preemptions": a.get("preemptions", 0), "kv_used": k["used"],
                    "kv_cached": k["cached"], "kv_free": k["free"], "running": s["running"],
                    "waiting": s["waiting"], "graph": a.get("graph", "eager"), "graph_size": a.get("graph_size"),
                    "offloaded": a.get("offloaded_blocks", 0), "restored": a.get("restored_blocks", 0),
                    "host_blocks": None if t is None else t["host"], "wall_ms": e["dur"] / 1e3,
                    "forward_ms": a.get("forward_ms"), "device_ms": a.get("device_ms")})
    return out


def load_requests(trace: dict, steps: list[dict]) -> list[dict]:
    """One dict per sequence track of a step trace's ``requests`` process, in track order: ``name``,
    ``runs`` (``(step, slice name)`` for each step it ran in) and ``waits`` (``(first step, last step,
    kind)``: the steps that ran while it was ``queued`` or ``preempted``; ``steps`` from
    :func:`load_steps` place the waits, which the trace times in µs)."""
    import bisect

    events = trace["traceEvents"]
    pid = next((e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and e["args"]["name"] == "requests"), None)
    names = {e["tid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] == pid}
    tracks = {tid: {"name": name, "runs": [], "waits": []} for tid, name in sorted(names.items())}
    starts = [s["ts"] for s in steps]
    for e in events:
        if e.get("pid") != pid or e.get("ph") != "X" or e.get("tid") not in tracks:
            continue
        if e["name"] in RUN_NAMES:
            tracks[e["tid"]]["runs"].append((e["args"]["step"], e["name"]))
        elif e["name"] in ("queued", "preempted"):
            lo, hi = bisect.bisect_left(starts, e["ts"]), bisect.bisect_left(starts, e["ts"] + e["dur"] - 1e-3)
            if hi > lo:  # steps ran while it waited
                tracks[e["tid"]]["waits"].append((steps[lo]["step"], steps[hi - 1]["step"], e["name"]))
    return list(tracks.values())


def _tokens(ax, x, steps, legend) -> None:
    pre, dec = [s["prefill"] for s in steps], [s["decode"] for s in steps]
    ax.bar(x, pre, width=0.9, color=PREFILL, label="prefill tokens")
    ax.bar(x, dec, width=0.9, bottom=pre, color=DECODE, label="decode tokens")
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
    ax.set_ylabel("tokens in the step")
    legend.append(ax)


def _kv(ax, x, steps, legend) -> None:
    total = steps[0]["kv_used"] + steps[0]["kv_cached"] + steps[0]["kv_free"]
    ax.stackplot(x, [s["kv_used"] for s in steps], [s["kv_cached"] for s in steps],
                 colors=["#6a3d9a", "#9fd8cb"], labels=["held", "cached (prefix cache)"], step="mid")
    ax.set_ylim(0, total)
    ax.set_ylabel(f"KV blocks (of {total})")
    legend.append(ax)


def _seqs(ax, x, steps, legend) -> None:
    ax.step(x, [s["running"] for s in steps], where="mid", color="#2ca02c", label="running")
    ax.step(x, [s["waiting"] for s in steps], where="mid", color="#d62728", label="waiting")
    ax.set_ylabel("sequences")
    legend.append(ax)


def _requests(ax, x0, requests) -> None:
    from matplotlib.patches import Patch

    for row, r in enumerate(requests):
        for lo, hi, kind in r["waits"]:
            ax.barh(row, hi - lo + 0.9, left=lo - x0 - 0.45, height=0.6, color="#bbbbbb" if kind == "queued"
                    else "#f4a6a6", edgecolor="none")
        for step, name in r["runs"]:
            ax.barh(row, 0.9, left=step - x0 - 0.45, height=0.6, color=DECODE if name == "decode" else PREFILL)
    ax.set_yticks(range(len(requests)), [r["name"] for r in requests], fontsize=7)
    ax.set_ylim(len(requests) - 0.4, -0.6)
    ax.set_ylabel("requests")
    handles = [Patch(color="#bbbbbb", label="waiting"), Patch(color=PREFILL, label="prefill"),
               Patch(color=DECODE, label="decode")]
    if any(kind == "preempted" for r in requests for *_, kind in r["waits"]):
        handles.insert(1, Patch(color="#f4a6a6", label="preempted"))
    ax.legend(handles=handles, fontsize=7, loc="upper right")


def _offload(ax, x, steps, legend) -> None:
    ax.bar(x, [s["offloaded"] for s in steps], width=0.9, color="#8c564b", label="copied to a lower tier")
    ax.bar(x, [-s["restored"] for s in steps], width=0.9, color="#2ca02c", label="restored from it")
    if steps[0]["host_blocks"] is not None:
        ax.step(x, [s["host_blocks"] for s in steps], where="mid", color="#444", label="in the host tier")
    ax.axhline(0, color="#777", linewidth=0.6)
    if not any(s["offloaded"] or s["restored"] or s["host_blocks"] for s in steps):
        ax.set_ylim(-1, 1)
        ax.text(0.5, 0.5, "nothing copied", transform=ax.transAxes, ha="center", va="bottom", color="#777")
    else:  # room below the restores for the legend (lower left)
        bottom, top = ax.get_ylim()
        ax.set_ylim(min(bottom, -0.9 * top), top)
    ax.set_ylabel("offload blocks")
    legend.append(ax)


def _time(ax, x, steps, legend, ylim) -> None:
    ax.plot(x, [s["wall_ms"] for s in steps], color="#444", marker=".", markersize=3, linewidth=1,
            label="step (wall)")
    fwd = [(xi, s["forward_ms"]) for xi, s in zip(x, steps) if s["forward_ms"]]
    ax.plot([f[0] for f in fwd], [f[1] for f in fwd], color="#e377c2", marker=".", markersize=3, linewidth=1,
            label="host: prepare + launch forward, sampling" if _on_cuda(steps) else "forward + sampling")
    if _on_cuda(steps):
        dev = [(xi, s["device_ms"]) for xi, s in zip(x, steps) if s["device_ms"]]
        ax.plot([d[0] for d in dev], [d[1] for d in dev], color="#1f77b4", marker=".", markersize=3,
                linewidth=1, label="device: forward + sampling")
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    ax.set_ylim(*ylim)
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5) if ylim[1] / ylim[0] < 300 else (1,)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("ms")
    legend.append(ax)


def _on_cuda(steps: list[dict]) -> bool:
    """The trace timed the device (CUDA): its device span differs from the host's forward span."""
    return any(s["device_ms"] is not None and s["device_ms"] != s["forward_ms"] for s in steps)


def _graph(ax, x, steps, legend) -> None:
    from matplotlib.patches import Patch

    kinds = [s["graph"] for s in steps]
    ax.bar(x, [1] * len(x), width=1.0, color=[GRAPH_COLORS.get(k, "#7f7f7f") for k in kinds])
    for xi, s in zip(x, steps):
        if s["graph"] != "eager" and s["graph_size"] is not None:
            ax.text(xi, 0.5, str(s["graph_size"]), ha="center", va="center", fontsize=5, rotation=90)
    ax.set_yticks([])
    ax.set_ylim(0, 1)
    ax.set_ylabel("graph", fontsize=8)
    seen = dict.fromkeys(kinds)
    ax.legend(handles=[Patch(color=GRAPH_COLORS.get(k, "#7f7f7f"), label=k) for k in seen], fontsize=6,
              loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(seen), frameon=False, borderaxespad=0.1)


def plot(columns: list[tuple[str, list[dict]]], path: str, panels: tuple[str, ...] = ("tokens", "kv", "seqs"),
         requests: list[list[dict]] | None = None) -> None:
    """One column of ``panels`` (:data:`PANELS`) per ``(title, steps)`` (:func:`load_steps`; the
    ``requests`` panel needs :func:`load_requests` of each column), written to ``path``.

    Raises:
        ValueError: an unknown panel, or the ``requests`` panel without ``requests``.
    """
    import matplotlib

    if set(panels) - set(PANELS) or "requests" in panels and (requests is None or len(requests) != len(columns)):
        raise ValueError(f"panels {panels} (of {PANELS}; 'requests' needs load_requests of every column)")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(columns)
    height = sum(HEIGHTS[p] for p in panels) * 6.4 / 4.4
    fig, axes = plt.subplots(len(panels), n, figsize=(5.2 * n, height), sharex="col", squeeze=False,
                             gridspec_kw={"height_ratios": [HEIGHTS[p] for p in panels]})
    times = [v for _, steps in columns for s in steps for v in (s["wall_ms"], s["forward_ms"], s["device_ms"]) if v]
    ylim = (min(times) / 1.5, max(times) * 1.5) if times else (0.1, 10)
    legends: dict[int, list] = {}  # row -> its panels with a legend to draw, per column
    for c, (title, steps) in enumerate(columns):
        x = [s["step"] - steps[0]["step"] for s in steps]
        for r, panel in enumerate(panels):
            ax, legend = axes[r][c], legends.setdefault(r, [])
            if panel == "requests":
                _requests(ax, steps[0]["step"], requests[c])
            elif panel == "time":
                _time(ax, x, steps, legend, ylim)
            else:
                {"tokens": _tokens, "kv": _kv, "seqs": _seqs, "offload": _offload, "graph": _graph}[panel](
                    ax, x, steps, legend)
        axes[0][c].set_title(title, fontsize=10)
        axes[-1][c].set_xlabel("engine step")
    for row in legends.values():  # the first column's, and any other whose handles differ from it
        for ax in row:
            if ax is row[0] or ax.get_legend_handles_labels()[1] != row[0].get_legend_handles_labels()[1]:
                ax.legend(fontsize=8, loc=LEGEND_AT.get(ax.get_ylabel(), "upper right"))
    save_figure(fig, path)


def arrivals(args, vocab: int, seed: int = 0) -> dict[int, list[tuple[list[int], int]]]:
    """The scenario's requests (module docstring): step -> ``[(prompt, max_tokens), ...]``."""
    out, long_prompt = args.output_len, random_prompt(vocab, args.long_len, 1000 + seed)
    if args.scenario == "static":
        first = [(random_prompt(vocab, args.short_len, seed + i), max(1, out * (i + 1) // 4)) for i in range(4)]
        return {0: first, 4: [(random_prompt(vocab, args.short_len, seed + 4), max(1, out // 2))],
                10: [(random_prompt(vocab, args.short_len, seed + 5), max(1, out // 2))]}
    shared = [(long_prompt[:args.shared_len] + random_prompt(vocab, 8, seed + i), out) for i in (14, 22)]
    if args.scenario == "offload":
        fillers = [(random_prompt(vocab, args.filler_len, seed + 100 + i), out) for i in range(args.fillers)]
        return {0: [(long_prompt, max(1, out // 2))], 14: fillers, 40: shared[:1]}
    return {0: [(random_prompt(vocab, args.short_len, seed + i), out) for i in range(3)],
            6: [(long_prompt, max(1, out // 2))], 14: shared[:1], 22: shared[1:]}


def run_scenario(engine, args, seed: int = 0) -> None:
    """Add the scenario's requests to ``engine`` at their steps and step it until all have finished."""
    from infer.sampling import SamplingParams

    pending = sorted(arrivals(args, engine.vocab_size, seed).items())
    step0 = engine.scheduler.num_steps
    while pending or engine.has_unfinished_requests():
        # the clock is the steps the scheduler ran (static batching may wait for its batch without one);
        # an idle engine skips ahead to the next arrival
        while pending and (pending[0][0] <= engine.scheduler.num_steps - step0 or not engine.has_unfinished_requests()):
            for prompt, n in pending.pop(0)[1]:
                engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        engine.step(stream=False)


def record(model: str, overrides: dict, args, path: str) -> None:
    """Run the scripted workload (``args.scenario``, module docstring) on a fresh engine with
    ``overrides`` and a trace written to ``path`` (with ``args.warmup``, after a first run left out)."""
    longest = max(args.long_len, args.filler_len) + args.output_len + 8
    llm = make_llm(model, {"device": args.device, **overrides, "trace": path}, longest, progress=False)
    engine = llm.engine
    if getattr(args, "warmup", False):
        run_scenario(engine, args, seed=10_000)
        if engine.config.prefix_caching:
            engine.reset_prefix_cache()
        engine.tracer.clear()
    run_scenario(engine, args)
    engine.write_trace()
    llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", help="step trace JSON files (one column each)")
    ap.add_argument("--plot", required=True, help="write the picture here (PNG)")
    ap.add_argument("--titles", nargs="*", help="a title per column (default: the file name or the config)")
    ap.add_argument("--panels", default="tokens,kv,seqs", help=f"panels, top to bottom, of {','.join(PANELS)}")
    ap.add_argument("--record", action="store_true", help="record the scripted workload's traces first")
    ap.add_argument("--save-traces", metavar="DIR", help="--record: keep the traces in DIR (PLOT-NAME-i.json)")
    ap.add_argument("--scenario", default="mixed", choices=SCENARIOS)
    ap.add_argument("--warmup", action="store_true", help="--record: run the workload once first, untraced")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--configs", default="", help="EngineConfig overrides per column, ';' between columns")
    ap.add_argument("--engine-args", nargs="*", default=[], help="EngineConfig overrides for every column")
    ap.add_argument("--short-len", type=int, default=24)
    ap.add_argument("--long-len", type=int, default=160)
    ap.add_argument("--shared-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=24)
    ap.add_argument("--fillers", type=int, default=4, help="offload scenario: requests that evict the long prompt")
    ap.add_argument("--filler-len", type=int, default=56)
    args = ap.parse_args(argv)
    panels = tuple(p.strip() for p in args.panels.split(",") if p.strip())
    if not panels or set(panels) - set(PANELS):
        ap.error(f"--panels: choose from {','.join(PANELS)}, got {args.panels!r}")
    columns = []
    if args.record:
        base = engine_overrides(args.engine_args)
        folder = args.save_traces or tempfile.mkdtemp(prefix="plot_trace-")
        os.makedirs(folder, exist_ok=True)
        stem = os.path.splitext(os.path.basename(args.plot))[0]
        for i, cfg in enumerate(parse_infer_configs(args.configs) or [{}]):
            path = os.path.join(folder, f"{stem}-{i}.json")
            print(f"[plot_trace] recording {format_overrides({**base, **cfg}) or 'defaults'} -> {path}", flush=True)
            record(args.model, {**base, **cfg}, args, path)
            args.traces.append(path)
            columns.append(format_overrides(cfg) or format_overrides(base) or "defaults")
    else:
        columns = [os.path.basename(p) for p in args.traces]
    if not args.traces:
        ap.error("give trace files, or --record")
    titles = args.titles or columns
    data, requests = [], []
    for title, path in zip(titles, args.traces):
        with open(path) as f:
            trace = json.load(f)
        steps = load_steps(trace)
        requests.append(load_requests(trace, steps))
        graphs = sum(s["graph"] != "eager" for s in steps)
        print(f"[plot_trace] {title}: {len(steps)} steps ({graphs} replayed a graph), "
              f"{sum(s['prefill'] for s in steps)} prefill and {sum(s['decode'] for s in steps)} decode tokens, "
              f"{sum(s['preemptions'] for s in steps)} preemptions, peak {max(s['kv_used'] for s in steps)} "
              f"blocks held, {sum(s['offloaded'] for s in steps)} blocks offloaded and "
              f"{sum(s['restored'] for s in steps)} restored, {sum(s['wall_ms'] for s in steps):.1f} ms", flush=True)
        data.append((title, steps))
    plot(data, args.plot, panels, requests)
    print(f"[plot_trace] wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
