"""Ablation: one workload, one run per value of each EngineConfig optimization flag.

    python benchmarks/ablate.py --workload offline --scale 0.05 --out /tmp/abl
    python benchmarks/ablate.py --workload offline --model /path/qwen3-0.6b --device cuda --max-num-seqs 256 \\
        --out benchmarks/runs/ablation-offline
    python benchmarks/ablate.py --workload serve --scale 0.05 --request-rates 1 4 inf --out /tmp/abl-serve
    python benchmarks/ablate.py --workload offline --flags batching --dry-run        # list the configurations
    # TTFT and TPOT of one request alone, per flag (a 128-token prompt)
    python benchmarks/ablate.py --workload single --model DIR --device cuda --dtype bfloat16 \\
        --prompt-lens 128 --output-len 32 --out /tmp/abl-single
    # chunked prefill alone, on its own workload: 4 decode streams, a 3000-token prompt arriving
    python benchmarks/ablate.py --workload serve --serve-workload decode-interference --flags chunked_prefill \
        --batching continuous --max-model-len 4096 --num-requests 4 --input-len 32 --output-len 200 \
        --long-len 3000 --out /tmp/abl-chunked
    # prefix caching alone, on a sharing workload (a 2000-token prefix, one request at a time) and a
    # non-sharing one (random token ids); --reset-prefix-cache makes each rate start cold
    python benchmarks/ablate.py --workload serve --serve-workload shared-prefix --flags prefix_caching \
        --batching continuous --kv-cache paged --max-model-len 4096 --prefix-len 2000 --input-len 32 \
        --output-len 16 --num-requests 8 --max-concurrency 1 --request-rates inf --reset-prefix-cache --out /tmp/abl-pc
    python benchmarks/ablate.py --workload serve --flags prefix_caching --batching continuous --kv-cache paged \
        --scale 0.25 --request-rates inf --out /tmp/abl-pc-random

The flags and their values come from ``EngineConfig.ablation_values()``: ``{field: (off, ...,
on)}`` (``--flags`` picks some; default: all). The base configuration has *every* flag at its
first ("off") value; the runs are:

* ``all-off``: the base;
* for each picked flag and each of its other values: the base with only that flag changed;
* ``all-on``: every picked flag at its last value;
* ``optimize`` (when every flag is picked, or with ``--with-optimize``): ``--optimize`` and no flag set, so the engine turns
  on what this device supports (the start-up log of its run says what).

Configurations that coincide are run once (``batching=continuous`` is also ``all-on`` while
batching is the only flag). A configuration that ``EngineConfig.validate()`` rejects is
reported as skipped, with the reason; one whose run fails is reported as failed, with the end
of its log.

Each configuration runs in a fresh process, so that no memory, allocator, compile or
CUDA-graph state of one run reaches the next:

* ``--workload offline``: ``benchmarks/offline_throughput.py --engines infer --infer-configs
  <that configuration>`` (the nano-vllm workload; ``--scale`` and every other workload flag of
  that program are passed on).
* ``--workload single``: ``benchmarks/single_stream.py``: one request alone (``--prompt-lens``,
  ``--output-len``, ``--repeats`` are passed on), its TTFT and TPOT, the latency a flag buys where
  nothing queues (the TTFT row per flag).
* ``--workload serve``: ``benchmarks/serve_bench.py --launch`` (a ``python -m infer.server`` with
  the configuration's flags), Poisson arrivals at ``--request-rates``, token-id prompts of
  ``--input-len`` tokens and ``--output-len`` output tokens (defaults: 200 requests, 512 and 256
  tokens, times ``--scale``); other serve_bench flags are passed on. ``--serve-workload`` picks
  serve_bench's ``--workload`` (``decode-interference`` for chunked prefill: decode streams and
  long prompts arriving; its stream ITL p99, largest gap and long-prompt TTFT are reported too).

Arguments this program does not know are passed on: EngineConfig flags (``--device cuda
--max-num-seqs 64``, or an ablation flag that ``--flags`` does not vary, such as ``--batching
continuous`` beside ``--flags chunked_prefill``) fix the rest of the configuration for every run (to the server for
``serve``); the others go to the workload program. The ceilings (bandwidth, matmul rate) are
measured once, here, after the runs.

Output in ``--out DIR`` (default ``benchmarks/runs/ablation/``): ``ablation.json`` (commit,
hardware, versions, ceilings, the base EngineConfig, every configuration with its full
EngineConfig, status and figures, the workload), ``ablation.md`` (config, output tok/s, total
tok/s, TTFT p50/p99, TPOT p50/p99, speedup vs all-off), ``ablation_throughput.png``,
``ablation_latency.png`` and, for ``serve``, ``ablation_vs_rate.png`` (latency and throughput vs
request rate, one line per configuration); each run's own report and log are in ``DIR/runs/``.
Method: docs/contributing.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    ceilings,
    environment,
    format_overrides,
    format_value,
    markdown_table,
    out_argument,
    plot_throughput,
    save_figure,
    server_flags,
    write_report,
)

HERE = Path(__file__).resolve().parent

OFFLINE = HERE / "offline_throughput.py"
SERVE = HERE / "serve_bench.py"
SINGLE = HERE / "single_stream.py"
SERVE_DEFAULTS = {"num_requests": 200, "input_len": 512, "output_len": 256}

# ---------------------------------------------------------------------------------- configurations


def ablation_configs(values: dict[str, tuple], flags: list[str] | None = None,
                     optimize: bool = False) -> list[dict[str, Any]]:
    """``[{"name", "overrides", "aliases"}]``: all-off, each flag's other values, all-on and, with
    ``optimize``, ``optimize`` (the one switch, no flag set: what the engine picks here); no duplicates.

    ``values`` is ``{flag: (off, ..., on)}``; ``overrides`` sets every flag of ``values`` (the
    ones not picked stay off). A configuration equal to an earlier one is not repeated: its
    name is added to the earlier one's ``aliases``.
    """
    flags = list(values) if flags is None else list(flags)
    unknown = [f for f in flags if f not in values]
    if unknown:
        raise ValueError(f"not ablation flags: {', '.join(unknown)} (known: {', '.join(values) or 'none'})")
    off = {f: vals[0] for f, vals in values.items()}
    configs: list[dict[str, Any]] = []

    def add(name: str, overrides: dict[str, Any]) -> None:
        for c in configs:
            if c["overrides"] == overrides:
                c["aliases"].append(name)
                return
        configs.append({"name": name, "overrides": overrides, "aliases": []})

    add("all-off", dict(off))
    for f in flags:
        for v in values[f][1:]:
            add(f"{f}={format_value(v)}", {**off, f: v})
    add("all-on", {**off, **{f: values[f][-1] for f in flags}})
    if optimize:
        add("optimize", {"optimize": True})
    return configs


def display_name(c: dict[str, Any]) -> str:
    return " = ".join([c["name"], *c["aliases"]])


def validate_configs(configs: list[dict[str, Any]], base: dict[str, Any]) -> None:
    """Mark each configuration that ``EngineConfig.validate()`` rejects as skipped (in place)."""
    from infer.config import EngineConfig

    for c in configs:
        try:
            cfg = EngineConfig.from_kwargs(**{**base, **c["overrides"]}).validate()
            c["engine_config"] = cfg.to_dict()
            c["status"] = "pending"
        except (TypeError, ValueError) as e:
            c["status"], c["reason"] = "skipped", str(e)


def usable_all_on(configs: list[dict[str, Any]], values: dict[str, tuple], flags: list[str] | None,
                  base: dict[str, Any]) -> None:
    """When ``all-on`` is rejected here (``attention_backend=triton`` on a CPU, say), add the all-on
    of what is usable: each flag at its last value whose one-flag configuration validated, the
    others off (in place, after :func:`validate_configs`; the new configuration is named
    ``all-on`` and its ``note`` names the flags left off)."""
    from infer.config import EngineConfig

    flags = list(values) if flags is None else list(flags)
    old = next(c for c in configs if c["name"] == "all-on" or "all-on" in c["aliases"])
    if old["status"] != "skipped":
        return
    off = {f: vals[0] for f, vals in values.items()}
    overrides, left_off = dict(off), []
    for f in flags:
        ok = [c["overrides"][f] for c in configs
              if c["status"] == "pending" and c["overrides"] == {**off, f: c["overrides"].get(f)} and c["overrides"][f] != off[f]]
        if ok:
            overrides[f] = ok[-1]
        elif len(values[f]) > 1:
            left_off.append(f)
    if old["name"] == "all-on":
        old["name"] = "all-on (as asked)"
    else:
        old["aliases"].remove("all-on")
    if any(c["overrides"] == overrides for c in configs):
        next(c for c in configs if c["overrides"] == overrides)["aliases"].append("all-on")
        return
    new = {"name": "all-on", "overrides": overrides, "aliases": [], "status": "pending",
           "note": f"all-on without {', '.join(left_off)} (rejected here)"}
    try:
        new["engine_config"] = EngineConfig.from_kwargs(**{**base, **overrides}).validate().to_dict()
    except (TypeError, ValueError) as e:
        new["status"], new["reason"] = "skipped", str(e)
    configs.append(new)


def split_engine_args(tokens: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``(EngineConfig kwargs given explicitly, the other tokens)`` of the passed-on arguments."""
    from infer.config import add_engine_args

    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_engine_args(ap)
    for action in ap._actions:
        action.default = argparse.SUPPRESS
    ns, rest = ap.parse_known_args(tokens)
    return vars(ns), rest


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "config"


# ---------------------------------------------------------------------------------- running


def run_logged(cmd: list[str], log: Path, timeout: float | None) -> tuple[int, str]:
    """Run ``cmd``, echoing its output and writing it to ``log``; ``(exit code, last lines)``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print("$ " + shlex.join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
        os.set_blocking(proc.stdout.fileno(), False)
        timed_out = False
        while True:
            chunk = proc.stdout.read()
            if chunk:
                f.write(chunk)
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            if proc.poll() is not None:
                rest = proc.stdout.read()
                if rest:
                    f.write(rest)
                    sys.stdout.buffer.write(rest)
                break
            if timeout and time.perf_counter() - start > timeout and not timed_out:
                timed_out = True
                proc.send_signal(signal.SIGINT)  # serve_bench stops its server in a finally
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            time.sleep(0.05)
        if timed_out:
            f.write(f"\n[ablate] timed out after {timeout:g} s\n".encode())
    text = log.read_text(errors="replace")
    tail = "\n".join(text.replace("\r", "\n").splitlines()[-15:])
    return (124 if timed_out else proc.returncode), tail


def offline_command(c: dict[str, Any], args, passthrough: list[str], out: Path) -> list[str]:
    cmd = [sys.executable, str(OFFLINE), "--engines", "infer", "--infer-configs", format_overrides(c["overrides"]),
           "--no-ceilings", "--out", str(out), "--model", args.model]
    if args.scale is not None:
        cmd += ["--scale", str(args.scale)]
    return cmd + passthrough


def single_command(c: dict[str, Any], args, given: dict[str, Any], rest: list[str], out: Path) -> list[str]:
    """single_stream.py for one configuration: one request alone, TTFT and TPOT (no HF run). The fixed
    EngineConfig flags join the configuration's overrides; device and dtype are that program's own flags."""
    overrides = {k: v for k, v in given.items() if k not in ("device", "dtype")}
    overrides.update(c["overrides"])
    cmd = [sys.executable, str(SINGLE), "--model", args.model, "--hf", "--out", str(out)]
    if overrides:
        cmd += ["--infer-configs", format_overrides(overrides)]
    cmd += [a for k in ("device", "dtype") if k in given for a in (f"--{k}", str(given[k]))]
    return cmd + rest


def serve_command(c: dict[str, Any], args, given: dict[str, Any], rest: list[str], out: Path) -> list[str]:
    scale = 1.0 if args.scale is None else args.scale
    n = max(2, round(SERVE_DEFAULTS["num_requests"] * scale))
    inp = max(1, round(SERVE_DEFAULTS["input_len"] * scale))
    outl = max(2, round(SERVE_DEFAULTS["output_len"] * scale))
    srv = ["--model", args.model, *server_flags(given), *server_flags(c["overrides"])]
    if "max_model_len" not in given:
        srv += ["--max-model-len", str(inp + outl + 16)]
    if args.serve_workload != "random":
        rest = ["--workload", args.serve_workload, *rest]
    tokens = [] if args.serve_workload == "multi-turn" else ["--token-prompts"]  # multi-turn resends reply text
    cmd = [sys.executable, str(SERVE), "--launch", "--server-args", shlex.join(srv), *tokens,
           "--num-requests", str(n), "--input-len", str(inp), "--output-len", str(outl),
           "--request-rates", *[format_value(r) for r in args.request_rates], "--out", str(out)]
    return cmd + rest  # later flags win: the user's serve_bench flags override these defaults


# ---------------------------------------------------------------------------------- figures


def offline_figures(rep: dict[str, Any]) -> dict[str, Any]:
    r = rep["results"][0]
    keys = ["output_tok_per_s", "total_tok_per_s", "req_per_s", "wall_s", "ttft_p50_ms", "ttft_p99_ms",
            "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "tokens_ok"]
    return {k: r.get(k) for k in keys}


def single_figures(rep: dict[str, Any]) -> dict[str, Any]:
    """TTFT and TPOT of single_stream's first prompt length (p50 = the median of its repeats; one
    request at a time, so there is no p99) and the output rate of one stream."""
    r = rep["rows"][0]
    return {"ttft_p50_ms": r["ttft_ms"], "tpot_p50_ms": r["tpot_ms"], "output_tok_per_s": r["tok_s"],
            "prompt_len": r["prompt"]}


def serve_figures(rep: dict[str, Any]) -> dict[str, Any]:
    keys = ["rate", "completed", "failed", "output_tok_per_s", "total_tok_per_s", "req_per_s", "ttft_p50_ms",
            "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
            "stream_itl_p50_ms", "stream_itl_p99_ms", "stream_itl_max_ms", "long_ttft_p50_ms", "prefix_hit_rate",
            "ttft_first_ms", "ttft_rest_p50_ms", "ttft_first_turn_p50_ms", "ttft_later_turns_p50_ms"]
    rates = [{k: a.get(k) for k in keys} for a in rep["rates"]]
    top = rates[-1] if rates else {}
    return {**{k: v for k, v in top.items() if k != "rate"}, "rate_of_summary": top.get("rate"), "rates": rates}


def plot_latency(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """TTFT and TPOT per configuration: p50 bars, p99 markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(rows) + 4), 4.2))
    for ax, key, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        p50 = [r.get(f"{key}_p50_ms") or np.nan for r in rows]
        p99 = [r.get(f"{key}_p99_ms") or np.nan for r in rows]
        ax.bar(x, p50, 0.6, label="p50")
        ax.plot(x, p99, "v", color="tab:red", label="p99")
        ax.set_xticks(x, [r["label"] for r in rows], rotation=15, ha="right", fontsize=8)
        ax.set_ylabel(f"{name} (ms)")
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


def plot_vs_rate(configs: list[dict[str, Any]], path: Path, title: str) -> None:
    """serve: TTFT, TPOT and output tok/s vs offered request rate, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    done = [c for c in configs if c["status"] == "ok"]
    if not done:
        return
    labels = [str(r["rate"]) if isinstance(r["rate"], str) else f"{r['rate']:g}" for r in done[0]["rates"]]
    x = np.arange(len(labels))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for c in done:
        col = {k: [r.get(k) if r.get(k) is not None else np.nan for r in c["rates"]]
               for k in ("ttft_p50_ms", "tpot_p50_ms", "output_tok_per_s")}
        for ax, k in zip(axes, col):
            ax.plot(x[:len(col[k])], col[k], "o-", label=display_name(c))
    for ax, ylabel in zip(axes, ("TTFT p50 (ms)", "TPOT p50 (ms)", "output tok/s")):
        ax.set_xticks(x, labels)
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path)


# ---------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--workload", choices=["offline", "serve", "single"], default="offline",
                    help="offline: offline_throughput.py; serve: serve_bench.py --launch; single: single_stream.py, "
                         "one request alone (TTFT and TPOT per flag) (default: offline)")
    ap.add_argument("--flags", default=None,
                    help="comma-separated ablation flags to vary (default: every EngineConfig.ablation_values() flag; "
                         "speculative_config only when named)")
    ap.add_argument("--model", default="smollm2-135m", help="short name, .gguf or HF directory (default: %(default)s)")
    ap.add_argument("--scale", type=float, default=None,
                    help="workload scale (offline: see offline_throughput.py; serve: requests and lengths)")
    ap.add_argument("--serve-workload", default="random",
                    choices=["random", "long-prompt-interference", "decode-interference", "shared-prefix", "multi-turn"],
                    help="serve: serve_bench's --workload (default: random)")
    ap.add_argument("--request-rates", type=float, nargs="+", default=[1.0, 4.0, 16.0, math.inf],
                    help="serve: offered request rates, inf = all at once (default: 1 4 16 inf)")
    out_argument(ap, "ablation", "output directory")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per configuration before it counts as failed")
    ap.add_argument("--no-ceilings", dest="ceilings", action="store_false", help="do not measure the ceilings")
    ap.add_argument("--with-optimize", action="store_true",
                    help="add the optimize row when --flags picks some flags (it is always there without --flags)")
    ap.add_argument("--dry-run", action="store_true", help="list the configurations (and skips) and stop")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, passthrough = ap.parse_known_args(argv)
    from infer.config import EngineConfig

    flags = [f.strip() for f in args.flags.split(",") if f.strip()] if args.flags else None
    values = EngineConfig.ablation_values(opt_in=flags or ())
    try:
        configs = ablation_configs(values, flags, optimize=flags is None or args.with_optimize)
    except ValueError as e:
        ap.error(str(e))
    given, rest = split_engine_args(passthrough)
    clash = sorted(set(given) & set(values if flags is None else flags))
    if clash:
        ap.error(f"{', '.join(clash)} is ablated here; do not pass it (use --flags to pick flags)")
    for c in configs:  # an ablation flag that is not varied may be fixed (--batching continuous)
        c["overrides"].update({f: v for f, v in given.items() if f in values})
    base = {**given, "model": args.model}
    validate_configs(configs, base)
    usable_all_on(configs, values, flags, base)
    for c in configs:
        extra = f"  SKIPPED: {c['reason']}" if c["status"] == "skipped" else ""
        print(f"  {display_name(c):40s} {format_overrides(c['overrides'])}{extra}", flush=True)
    if args.dry_run:
        return 0

    out = Path(args.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    base_cfg = EngineConfig.from_kwargs(**base)
    device = str(base_cfg.resolved_device())

    todo = [c for c in configs if c["status"] == "pending"]
    workload = None
    for i, c in enumerate(todo, 1):
        name = display_name(c)
        print(f"\n[{i}/{len(todo)}] {name}: {format_overrides(c['overrides'])}", flush=True)
        rep_path = runs / f"{slug(c['name'])}.json"
        rep_path.unlink(missing_ok=True)
        if args.workload == "offline":
            cmd = offline_command(c, args, passthrough, rep_path)
        elif args.workload == "single":
            cmd = single_command(c, args, given, rest, rep_path)
        else:
            cmd = serve_command(c, args, given, rest, rep_path)
        c["command"] = shlex.join(cmd)
        t = time.perf_counter()
        code, tail = run_logged(cmd, runs / f"{slug(c['name'])}.log", args.timeout)
        c["run_s"] = time.perf_counter() - t
        if not rep_path.exists():
            c["status"], c["reason"] = "failed", f"exit code {code}; log tail:\n{tail}"
            print(f"[{name}] FAILED (exit code {code})", flush=True)
            continue
        rep = json.loads(rep_path.read_text())
        c["report"] = str(rep_path)
        if args.workload == "offline":
            if not rep.get("results"):  # offline_throughput skips what EngineConfig.validate() rejects
                skips = "; ".join(s["reason"] for s in rep.get("skipped", []))
                c["status"], c["reason"] = ("skipped", skips) if skips else ("failed", tail)
                continue
            c.update(offline_figures(rep))
            c["engine_config"] = next(iter(rep["engine_configs"].values()), c.get("engine_config"))
        elif args.workload == "single":
            c.update(single_figures(rep))
            c["engine_config"] = next(iter(rep["engine_config"].values()), c.get("engine_config"))
        else:
            c.update(serve_figures(rep))
            c["server_command"] = rep.get("server_command")
        workload = workload or rep.get("workload")
        c["status"] = "ok" if code == 0 else f"ok (exit code {code})"

    ceil = None
    if args.ceilings:  # after the runs, so that this process holds no GPU memory while they run
        import torch

        print(f"measuring ceilings on {device} ...", flush=True)
        ceil = ceilings(device, quick=torch.device(device).type == "cpu")

    ref = next((c for c in configs if c["name"] == "all-off" and c["status"].startswith("ok")), None)
    interference = ["stream_itl_p50_ms", "stream_itl_p99_ms", "stream_itl_max_ms", "long_ttft_p50_ms"] \
        if args.workload == "serve" and args.serve_workload == "decode-interference" else []
    if args.workload == "serve" and args.serve_workload in ("shared-prefix", "multi-turn"):  # prefix caching
        interference = ["prefix_hit_rate", *(["ttft_first_ms", "ttft_rest_p50_ms"] if args.serve_workload ==
                                             "shared-prefix" else ["ttft_first_turn_p50_ms", "ttft_later_turns_p50_ms"])]
    rows = []
    for c in configs:
        row = {"config": display_name(c), "status": c["status"].split(" ")[0]}
        if c["status"].startswith("ok"):
            for k in ("output_tok_per_s", "total_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                      "tpot_p99_ms", *interference):
                row[k] = c.get(k) if c.get(k) is not None else ""
            if ref and c.get("output_tok_per_s") and ref.get("output_tok_per_s"):
                c["speedup_vs_all_off"] = row["speedup"] = c["output_tok_per_s"] / ref["output_tok_per_s"]
        rows.append(row)
    columns = ["config", "status", "output_tok_per_s", "total_tok_per_s", "ttft_p50_ms", "ttft_p99_ms",
               "tpot_p50_ms", "tpot_p99_ms", *interference, "speedup"]
    env = environment(device)
    model = args.model
    head = f"ablation ({args.workload}): {model} on {env.get('gpu') or env['cpu']}, commit {env['commit']}"
    if args.workload == "serve":
        head += f"; figures at the highest request rate ({format_value(args.request_rates[-1])})"
    table = head + "; speedup = output tok/s vs all-off\n\n" + markdown_table(rows, columns)
    notes = [f"- {display_name(c)}: {c['status']}: {c['reason'].splitlines()[0]}" for c in configs if c.get("reason")]
    if notes:
        table += "\n\n" + "\n".join(notes)
    if args.workload == "serve":
        rate_rows = []
        for c in configs:
            if not c["status"].startswith("ok"):
                continue
            ref_rates = {r["rate"]: r for r in (ref or {}).get("rates", [])}
            for r in c["rates"]:
                b = ref_rates.get(r["rate"])
                sp = r["output_tok_per_s"] / b["output_tok_per_s"] if b and b.get("output_tok_per_s") and \
                    r.get("output_tok_per_s") else ""
                rate_rows.append({"config": display_name(c), **{k: ("" if v is None else v) for k, v in r.items()},
                                  "speedup": sp})
        table += "\n\nPer request rate:\n\n" + markdown_table(
            rate_rows, ["config", "rate", "completed", "failed", "output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms",
                        "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "speedup"])
    if ceil:
        table += (f"\n\nceilings: {ceil['bandwidth_gb_s']:.0f} GB/s copy, {ceil['matmul_tflops']:.3g} TFLOP/s "
                  f"{ceil['matmul_dtype']} matmul")
    report = {
        "benchmark": "ablation",
        "workload_kind": args.workload,
        "env": env,
        "model": model,
        "device": device,
        "ceilings": ceil,
        "ablation_values": {k: list(v) for k, v in values.items()},
        "flags": flags or list(values),
        "base_engine_config": EngineConfig.from_kwargs(**{**base, **configs[0]["overrides"]}).to_dict(),
        "passed_on": passthrough,
        "scale": args.scale,
        "request_rates": [format_value(r) for r in args.request_rates] if args.workload == "serve" else None,
        "workload": workload,
        "configs": configs,
        "rows": rows,
    }
    write_report(report, out / "ablation.json", table)
    done = [c for c in configs if c["status"].startswith("ok")]
    if done:
        prow = [{"label": display_name(c), **{k: c.get(k) or 0.0 for k in ("output_tok_per_s", "total_tok_per_s")},
                 **{k: c.get(k) for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")}}
                for c in done]
        title = f"{Path(model).name}: ablation ({args.workload}), commit {env['commit']}"
        plot_throughput(prow, out / "ablation_throughput.png", title)
        plot_latency(prow, out / "ablation_latency.png", title)
        if args.workload == "serve":
            plot_vs_rate(configs, out / "ablation_vs_rate.png", title)
    return 0 if done and all(c["status"] != "failed" for c in configs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
