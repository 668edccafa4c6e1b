"""What the HTTP server costs: start-up, idle memory, and TTFT/TPOT through HTTP vs in-process.

    python benchmarks/server_latency.py                      # smollm2-135m on this machine
    python benchmarks/server_latency.py --output-len 128 --repeats 10 --out benchmarks/runs/server_latency_10.json
    python benchmarks/server_latency.py --model DIR --prompt-len 128 --output-len 32 \\
        --engine-args device=cuda dtype=bfloat16 optimize=true          # a GPU, every optimization

1. Starts ``python -m infer.server`` in a fresh process and times the command to ``/health``
   answering and to the first completed answer; reads the server's idle RSS.
2. Streams the same greedy request (random prompt of ``--prompt-len`` tokens, ``--output-len``
   tokens, ``ignore_eos``) through HTTP (SSE) and through the offline API in this
   process (``LLM.generate_stream``) as ``--repeats`` *pairs*, the order alternating from pair
   to pair (HTTP first, then offline first, ...). The HTTP client is the standard library's
   ``http.client`` on one kept-alive connection: a lean client, so that the difference is the
   server's. ``--httpx`` adds a third run per pair through ``httpx`` (what the ``openai``
   package uses), whose own Python adds ~0.3-0.5 ms to a TTFT on a fast CPU. The server's TPOT overhead is the median over
   pairs of HTTP TPOT / offline TPOT - 1 (the goal is < 5%), reported with its spread; its TTFT
   overhead the median over pairs of HTTP TTFT - offline TTFT, in ms (the goal: within 1.5 ms).
   Each pair sends a new prompt (the same to both paths, each engine sees it once), so a prefix
   cache never turns a TTFT into a warm hit. ``--engine-args FIELD=VALUE`` configures both
   engines alike (the server gets them as its CLI flags).

Why pairs: on a small shared VM the same decode runs at very different speeds a few minutes
apart (2-core CPU, float32, OpenMP waiting passively: a step is ~250 sleep/wake hand-offs per
thread, and what a wake-up costs depends on the host). Medians taken over each path
separately compare the two paths at different moments; a pair's two runs are adjacent, and
alternating the order cancels a slow drift.

Next to the client-side numbers, each HTTP run also records where the time went:

* the server's own TTFT and TPOT, as its engine thread measured them (the deltas of the
  ``infer:time_to_first_token_seconds`` / ``infer:time_per_output_token_seconds`` histograms of
  ``/metrics``): client TPOT minus server TPOT is what the HTTP/SSE delivery adds;
* CPU time per generated token of the server's threads (the event loop, the engine thread,
  OpenMP workers) and of this client (HTTP + JSON), from the kernel's per-thread counters:
  on 2 cores, whatever the event loop and the client burn competes with the engine's threads;
* the 1-minute load average before, and during the pairs the CPU share used by other
  processes and stolen by the hypervisor (Linux), so that a run taken while the machine was
  busy can be recognised as such.

Writes the JSON report (environment, EngineConfig, workload, start-up, every pair) to ``--out``
(default ``benchmarks/runs/server_latency.json``) and the Markdown table beside it (``.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

if "torch" in sys.modules:  # see below
    raise SystemExit("torch was loaded before benchmarks/common.py could set OMP_WAIT_POLICY")
# common sets OMP_WAIT_POLICY=PASSIVE, which libgomp reads once, when torch loads it: common must be
# imported *before* torch, or this process's offline engine spins (OpenMP's default) while the
# server it starts inherits PASSIVE, and the comparison is between two OpenMP settings. That was
# the "15% server overhead" (2026-11-22): a sorted import block had moved torch above common.
import common  # noqa: E402, F401  (first: before torch)
import torch  # noqa: E402
from common import (  # noqa: E402
    engine_overrides,
    environment,
    free_port,
    markdown_table,
    out_argument,
    server_flags,
    stream_http,
    write_report,
)
from workloads import random_prompt  # noqa: E402


def stream_httpx(client: httpx.Client, port: int, prompt: list[int], n: int) -> tuple[float, float]:
    """The same through ``httpx`` (the HTTP client of the ``openai`` package): what a typical Python
    client adds on its own side. ``client`` is created once, outside the timing: ``httpx.stream()``
    alone builds a client per call, whose SSL context (unused over http://) takes ~47 ms of CPU."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = None
    count = 0
    with client.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                if first is None:
                    first = time.perf_counter()
                count += 1
    end = time.perf_counter()
    return first - start, (end - first) / max(count - 1, 1)


def stream_offline(llm, prompt: list[int], n: int) -> tuple[float, float]:
    from infer.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    first = None
    count = 0
    for out in llm.generate_stream(prompt, params):
        if out.outputs[0].delta_token_ids:
            if first is None:
                first = time.perf_counter()
            count += 1
    end = time.perf_counter()
    return first - start, (end - first) / max(count - 1, 1)


_HIST = ("infer:time_to_first_token_seconds", "infer:time_per_output_token_seconds")


def server_histograms(client: httpx.Client, port: int) -> dict[str, float]:
    """``_sum`` and ``_count`` of the server's TTFT and TPOT histograms (engine-thread timings)."""
    text = client.get(f"http://127.0.0.1:{port}/metrics").text
    out = {}
    for name in _HIST:
        for suffix in ("_sum", "_count"):
            m = re.search(rf"^{re.escape(name + suffix)}(?:{{[^}}]*}})?\s+(\S+)$", text, re.M)
            out[name + suffix] = float(m.group(1)) if m else 0.0
    return out


def _with_children(pid: int) -> list[psutil.Process]:
    """``pid`` and its descendants (the engine process of ``--engine-process``)."""
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid`` and of its child processes."""
    return {t.id: t.user_time + t.system_time for p in _with_children(pid) for t in p.threads()}


def machine_cpu() -> tuple[float, float] | None:
    """(busy, stolen) CPU seconds of the whole machine so far, all CPUs together (Linux's
    /proc/stat; None elsewhere). Busy: user + nice + system + irq + softirq; stolen: time the
    hypervisor gave to other guests."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, IndexError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / tick, f[7] / tick


def process_cpu(*pids: int) -> float:
    """CPU seconds (user + system) used so far by the processes ``pids`` and their child processes."""
    return sum(sum(p.cpu_times()[:2]) for pid in pids for p in _with_children(pid))


def http_run(client: httpx.Client, conn: http.client.HTTPConnection, port: int, pid: int, prompt: list[int],
             n: int, use_httpx: bool = False) -> dict[str, float]:
    """One streamed request (through ``http.client``, or ``httpx`` if ``use_httpx``), with the server's
    own timings and the CPU time each party used."""
    h0, t0, c0 = server_histograms(client, port), thread_cpu(pid), time.process_time()
    ttft, tpot = stream_httpx(client, port, prompt, n) if use_httpx else stream_http(conn, prompt, n)
    c1, t1, h1 = time.process_time(), thread_cpu(pid), server_histograms(client, port)

    def delta(name: str) -> float:
        count = h1[name + "_count"] - h0[name + "_count"]
        return (h1[name + "_sum"] - h0[name + "_sum"]) / count if count else float("nan")

    used = {tid: t1[tid] - t0.get(tid, 0.0) for tid in t1}
    loop = used.pop(pid, 0.0)  # the main thread runs uvicorn's event loop
    engine = max(used.values(), default=0.0)  # the thread that calls engine.step() works the most
    others = sum(used.values()) - engine  # OpenMP workers and the rest
    return {"ttft": ttft, "tpot": tpot, "server_ttft": delta(_HIST[0]), "server_tpot": delta(_HIST[1]),
            "cpu_event_loop": loop / n, "cpu_engine_thread": engine / n, "cpu_other_server_threads": others / n,
            "cpu_client": (c1 - c0) / n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10, help="HTTP/offline pairs (default: 10)")
    ap.add_argument("--engine-args", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="EngineConfig overrides for both the server (as its CLI flags) and the offline engine, "
                         "e.g. device=cuda dtype=bfloat16 optimize=true")
    ap.add_argument("--server-args", type=shlex.split, default=[], metavar="FLAGS",
                    help="more flags for the server only, one string, e.g. --server-args=--no-engine-process (the "
                         "engine on a thread of the server's process) or --server-args='--engine-process "
                         "--busy-poll-ms 0'")
    ap.add_argument("--httpx", action="store_true",
                    help="also stream each pair's prompt through httpx (the openai package's client), to show what "
                         "such a client adds on its own side")
    out_argument(ap, "server_latency.json", "JSON report (and .md beside it)")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()[0]
    if load_before >= 0.5:
        print(f"warning: 1-minute load average {load_before:.2f}: the machine is busy, expect noisy numbers",
              flush=True)
    overrides = engine_overrides(args.engine_args)
    overrides.setdefault("max_model_len", args.prompt_len + args.output_len + 16)
    port = free_port()
    cmd = [sys.executable, "-m", "infer.server", "--model", args.model, "--port", str(port),
           *server_flags(overrides), *args.server_args, "--log-level", "warning"]
    client = httpx.Client(timeout=600)  # one client throughout (see stream_httpx); /health, /metrics
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ready = None
        while ready is None:
            if proc.poll() is not None:
                raise SystemExit(f"server died: {proc.stderr.read().decode()[-2000:]}")
            try:
                if client.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    ready = time.perf_counter() - t0
            except httpx.HTTPError:
                time.sleep(0.1)
        client.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hello", "max_tokens": 1},
                    timeout=120).raise_for_status()
        first_answer = time.perf_counter() - t0
        idle_rss = sum(p.memory_info().rss for p in _with_children(proc.pid)) / 2**20  # (with its engine process)
        print(f"server ready in {ready:.2f} s, first answer at {first_answer:.2f} s, idle RSS {idle_rss:.0f} MB",
              flush=True)

        from infer.llm import LLM

        llm = LLM(args.model, progress=False, **overrides)
        vocab = llm.engine.vocab_size
        warm = random_prompt(vocab, args.prompt_len, 0)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)  # the timed streams' client
        stream_http(conn, warm, 8)
        stream_httpx(client, port, warm, 8)
        stream_offline(llm, warm, 8)  # warm both
        pairs = []
        mach0, ours0, wall0 = machine_cpu(), process_cpu(os.getpid(), proc.pid), time.perf_counter()
        for i in range(args.repeats):
            # a new prompt per pair (the same for both paths, each engine sees it once): with prefix
            # caching on, a repeated prompt would be a cache hit and TTFT would time a warm prefill
            prompt = random_prompt(vocab, args.prompt_len, i + 1)
            run = {}
            paths = ["http", "offline"] + (["httpx"] if args.httpx else [])
            for path in paths[i % len(paths):] + paths[:i % len(paths)]:  # each path first in turn
                if path == "offline":
                    ttft, tpot = stream_offline(llm, prompt, args.output_len)
                    run["offline"] = {"ttft": ttft, "tpot": tpot}
                else:  # httpx sends the same prompt: with prefix caching on, the server has it cached
                    run[path] = http_run(client, conn, port, proc.pid,
                                         prompt if path == "http" else random_prompt(vocab, args.prompt_len, 10_000 + i),
                                         args.output_len, use_httpx=path == "httpx")
            run["tpot_ratio"] = run["http"]["tpot"] / run["offline"]["tpot"]
            run["ttft_diff_ms"] = 1e3 * (run["http"]["ttft"] - run["offline"]["ttft"])
            if args.httpx:
                run["httpx_ttft_diff_ms"] = 1e3 * (run["httpx"]["ttft"] - run["offline"]["ttft"])
            pairs.append(run)
            h, o = run["http"], run["offline"]
            print(f"pair {i + 1}/{args.repeats}: TPOT HTTP {1e3 * h['tpot']:.1f} ms (engine thread "
                  f"{1e3 * h['server_tpot']:.1f}) vs offline {1e3 * o['tpot']:.1f} ms: {run['tpot_ratio'] - 1:+.1%}; "
                  f"TTFT HTTP {1e3 * h['ttft']:.2f} vs offline {1e3 * o['ttft']:.2f} ms",
                  flush=True)
        mach1, ours1, wall1 = machine_cpu(), process_cpu(os.getpid(), proc.pid), time.perf_counter()
    finally:
        client.close()
        if "conn" in locals():
            conn.close()
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()

    def med(path: str, key: str) -> float:
        return statistics.median(p[path][key] for p in pairs)

    ratios = sorted(p["tpot_ratio"] for p in pairs)
    overhead = statistics.median(ratios) - 1
    ttft_diffs = sorted(p["ttft_diff_ms"] for p in pairs)
    ttft_overhead = statistics.median(ttft_diffs)
    rows = [
        {"path": "HTTP (SSE, http.client)", "ttft_ms": 1e3 * med("http", "ttft"), "tpot_ms": 1e3 * med("http", "tpot")},
        {"path": "HTTP, engine thread's own timing", "ttft_ms": 1e3 * med("http", "server_ttft"),
         "tpot_ms": 1e3 * med("http", "server_tpot")},
        {"path": "offline API", "ttft_ms": 1e3 * med("offline", "ttft"), "tpot_ms": 1e3 * med("offline", "tpot")},
    ]
    if args.httpx:
        rows.insert(1, {"path": "HTTP (SSE, httpx)", "ttft_ms": 1e3 * med("httpx", "ttft"),
                        "tpot_ms": 1e3 * med("httpx", "tpot")})
    httpx_overhead = statistics.median(p["httpx_ttft_diff_ms"] for p in pairs) if args.httpx else None
    cpu = {k: 1e3 * med("http", k) for k in ("cpu_event_loop", "cpu_engine_thread", "cpu_other_server_threads",
                                              "cpu_client")}
    # what else ran on the machine meanwhile, as a fraction of its CPU capacity
    capacity = (wall1 - wall0) * (os.cpu_count() or 1)
    foreign = steal = None
    if mach0 is not None and mach1 is not None:
        foreign = max(0.0, (mach1[0] - mach0[0]) - (ours1 - ours0)) / capacity
        steal = (mach1[1] - mach0[1]) / capacity
    report = {
        "benchmark": "server_latency",
        "env": environment("cpu" if not torch.cuda.is_available() else "cuda"),
        "model": args.model,
        "engine_config": dataclasses.asdict(llm.config),  # the server's too: same flags, same defaults
        "server_args": args.server_args,  # --engine-process: the server's engine in a process of its own
        "workload": {"prompt_len": args.prompt_len, "output_len": args.output_len, "pairs": args.repeats,
                     "greedy": True, "ignore_eos": True,
                     "client": "http.client, one kept-alive connection" + (" (and one httpx.Client)" if args.httpx else "")},
        "startup": {"ready_s": ready, "first_answer_s": first_answer, "idle_rss_mb": idle_rss},
        "rows": rows,
        "tpot_overhead": overhead,
        "tpot_overhead_range": [ratios[0] - 1, ratios[-1] - 1],
        "tpot_overhead_of_medians": rows[0]["tpot_ms"] / rows[-1]["tpot_ms"] - 1,
        "ttft_overhead_ms": ttft_overhead,
        "ttft_overhead_ms_range": [ttft_diffs[0], ttft_diffs[-1]],
        "httpx_ttft_overhead_ms": httpx_overhead,
        "http_delivery_tpot_ms": rows[0]["tpot_ms"] - rows[-2]["tpot_ms"],
        "cpu_ms_per_token": cpu,
        "load1_before": load_before,
        "other_processes_cpu_fraction": foreign,
        "steal_fraction": steal,
        "pairs": pairs,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "note": "HTTP and offline alternate in pairs; the server and this process share the machine's cores, "
                "each idle while the other runs",
    }
    table = markdown_table(rows, ["path", "ttft_ms", "tpot_ms"])
    table += (f"\n\nserver TPOT overhead: {overhead:+.1%} (median of {len(ratios)} pairs; pairs range "
              f"{ratios[0] - 1:+.1%} to {ratios[-1] - 1:+.1%}; ratio of the medians {report['tpot_overhead_of_medians']:+.1%})"
              f"\nserver TTFT overhead: {ttft_overhead:+.2f} ms (median of the pairs' HTTP - offline; range "
              f"{ttft_diffs[0]:+.2f} to {ttft_diffs[-1]:+.2f} ms)"
              + (f"\nthrough httpx: {httpx_overhead:+.2f} ms (the same median, another prompt)" if args.httpx else "")
              + f"\nHTTP delivery after the engine: {report['http_delivery_tpot_ms']:+.2f} ms per token"
              f"\nCPU per generated token (ms): server event loop {cpu['cpu_event_loop']:.2f}, engine thread "
              f"{cpu['cpu_engine_thread']:.1f}, other server threads {cpu['cpu_other_server_threads']:.1f}, "
              f"client {cpu['cpu_client']:.2f}"
              f"\nload average {load_before:.2f} before"
              + (f"; during the pairs other processes used {foreign:.1%} of the CPUs and the hypervisor stole "
                 f"{steal:.1%}" if foreign is not None else "")
              + f"\nready {ready:.2f} s after the command, first answer at {first_answer:.2f} s; "
              f"idle RSS {idle_rss:.0f} MB")
    write_report(report, args.out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
