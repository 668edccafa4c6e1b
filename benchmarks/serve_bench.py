"""Online-serving benchmark (like ``vllm bench serve``) for any OpenAI-compatible server.

    # infer, end to end: start `python -m infer.server`, sweep, stop it
    python benchmarks/serve_bench.py --launch --server-args "--max-model-len 512" \\
        --num-requests 6 --request-rates 1 inf --input-len 32 --output-len 8 \\
        --out /tmp/sb.json --plot /tmp/sb.png
    # a server that is already running (infer, vLLM, SGLang, ...)
    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000/v1 --request-rates 1 2 4 inf
    python benchmarks/serve_bench.py --workload shared-prefix --prefix-len 1024 --input-len 32
    # prefix caching (phase 7): chat conversations resending their history, cache off and on
    python benchmarks/serve_bench.py --launch --workload multi-turn --num-requests 8 --turns 4 --input-len 64 \
        --prefix-len 256 --output-len 32 --server-args "--batching continuous --kv-cache paged" \
        --server-configs "off=" "prefix=--prefix-caching" --reset-prefix-cache
    python benchmarks/serve_bench.py --workload long-prompt-interference --long-fraction 0.1 --long-len 4096
    # chunked prefill (phase 6): 4 decode streams, a 3000-token prompt arriving 2 s in; one server
    # per configuration, the streams' inter-token gaps compared
    python benchmarks/serve_bench.py --launch --workload decode-interference --token-prompts \
        --num-requests 4 --input-len 32 --output-len 200 --long-len 3000 \
        --server-args "--batching continuous --max-model-len 4096" \
        --server-configs "off=" "chunked-512=--chunked-prefill --max-num-batched-tokens 512" \
        --out /tmp/di.json --plot /tmp/di.png

For each request rate of ``--request-rates`` the same ``--num-requests`` requests are sent
with Poisson arrivals (exponential gaps of mean 1/rate; ``inf`` = all at once), each streamed
(SSE) with ``max_tokens = --output-len`` and ``ignore_eos: true`` (a vLLM/infer extra field
so that every request really generates ``--output-len`` tokens; OpenAI itself ignores or
rejects it: use ``--no-ignore-eos`` there). ``stream_options.include_usage`` is asked for so
the server's own token counts are used (``--no-usage`` for servers that reject it).

Per request: TTFT (send to the first chunk with content), ITL (gaps between content chunks; with
``--token-itl``, per token: TTFT to the first token's chunk, and a chunk of ``d`` tokens after a
gap ``g`` counts ``d`` gaps of ``g / d``, whether it has text or not),
TPOT = (E2E - TTFT) / (output tokens - 1), E2E, success or the error (HTTP errors, error
events, ``--timeout``: counted as failures, the run goes on). Output tokens are
``usage.completion_tokens`` when reported, else the number of content chunks.

Per rate: request throughput, output tok/s, total tok/s (prompt + output tokens / the rate's
duration, from its first send to its last answer), TTFT/TPOT/ITL/E2E mean, p50, p90, p99,
failures. ``long-prompt-interference`` also reports the short requests' ITL/TTFT separately
(the decodes that long prefills interrupt); ``shared-prefix`` the TTFT of the sweep's first
request (cold prefix) beside the others'; ``multi-turn`` the TTFT of first turns beside later
ones (conversations start with Poisson arrivals; a conversation sends its next turn, with the
history, once the previous reply is complete). Where the server reports
``usage.prompt_tokens_details.cached_tokens`` (infer and vLLM with prefix caching), the prefix
cache hit rate (cached / prompt tokens) is reported too. ``decode-interference`` sends ``--num-requests``
decode streams at once and ``--long-prompts`` long prompts at fixed offsets while they decode
(``--long-start-s``, ``--long-interval-s``; the request rate plays no part) and reports the
streams' ITL p50/p99 and largest gap, and the long prompts' TTFT: the stall a prefill puts on
running decodes, which chunked prefill bounds.

``--server-configs LABEL=ARGS ...`` (with ``--launch``): one server per configuration, its
``ARGS`` appended to ``--server-args``, the same workload against each; the table, report and
plot have one row (per rate) per configuration.

Prompts: random common words, about one token each (see workloads.py); the server's
``usage.prompt_tokens`` is recorded to check that. ``--token-prompts`` sends token ids instead
(exact lengths; /v1/completions only, accepted by infer and vLLM).

Output: the Markdown table on stdout; the JSON report (client environment, server command,
workload parameters, seed, per-rate aggregates, raw per-request records) in ``--out X.json``
(default ``benchmarks/runs/serve_bench.json``) and the table in ``X.md``; with ``--plot X.png``
latency and throughput vs request rate.
Method: docs/contributing.md ("How infer is measured") and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from common import (
    environment,
    free_port,
    markdown_table,
    out_argument,
    percentiles_ms,
    save_figure,
    write_report,
)
from tqdm import tqdm
from workloads import Request, build_requests

# ---------------------------------------------------------------------------------- one request


async def send(client: httpx.AsyncClient, url: str, body: dict, chat: bool, timeout: float) -> dict[str, Any]:
    """Stream one request; return its record (times in seconds, relative to its send).

    Without ``stream_options.continuous_usage_stats`` in ``body``, TTFT and the gaps ``itl`` are
    those of *content* chunks (chunks with text; vLLM's benchmark_serving does the same). With it
    (``--token-itl``) every chunk says how many tokens have been generated so far, and they are
    those of *tokens*: a chunk that brings ``d`` new tokens after a gap ``g``, with text or without
    (infer sends a chunk per token even while the detokenizer holds its text back), gives ``d``
    gaps of ``g / d`` (``chunk_tokens`` lists each such chunk's ``d``); ``chunks`` then counts
    those chunks."""
    rec: dict[str, Any] = {"success": False, "error": None, "ttft": None, "e2e": None, "itl": [],
                           "output_tokens": 0, "chunks": 0, "prompt_tokens": None, "usage_tokens": None,
                           "cached_tokens": None, "chunk_tokens": []}
    pieces: list[str] = []
    per_token = bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
    start = time.perf_counter()
    rec["send_t"] = start
    last = None
    counted = 0  # --token-itl: completion tokens up to the last chunk that brought some

    async def run() -> None:
        nonlocal last, counted
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec["error"] = f"HTTP {r.status_code}: {text[:300]}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank lines, SSE comments (":"), event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    rec["error"] = f"bad SSE data: {data[:200]}"
                    return
                if "error" in chunk:
                    rec["error"] = f"error event: {json.dumps(chunk['error'])[:300]}"
                    return
                now = time.perf_counter()
                usage = chunk.get("usage")
                if usage:
                    rec["usage_tokens"] = usage.get("completion_tokens")
                    rec["prompt_tokens"] = usage.get("prompt_tokens")
                    details = usage.get("prompt_tokens_details") or {}  # prefix caching (OpenAI, vLLM)
                    if details.get("cached_tokens") is not None:
                        rec["cached_tokens"] = details["cached_tokens"]
                content = False
                for ch in chunk.get("choices") or []:
                    if chat:
                        d = ch.get("delta") or {}
                        content |= bool(d.get("content") or d.get("reasoning_content") or d.get("reasoning"))
                        pieces.append(d.get("content") or "")
                    else:
                        content |= bool(ch.get("text"))
                        pieces.append(ch.get("text") or "")
                if per_token:  # an event is a chunk that brings tokens, with text or without
                    generated = (usage or {}).get("completion_tokens") or 0
                    new_tokens = generated - counted
                    if new_tokens <= 0:
                        continue
                    counted = generated
                    rec["chunk_tokens"].append(new_tokens)
                else:  # an event is a chunk with text
                    if not content:
                        continue
                    new_tokens = 1
                if last is None:
                    rec["ttft"] = now - start  # a first chunk's other tokens get no gap: unknowable
                else:
                    rec["itl"].extend([(now - last) / new_tokens] * new_tokens)
                last = now
                rec["chunks"] += 1
            else:
                if rec["chunks"] == 0:
                    rec["error"] = "stream ended without [DONE]"
                    return
            rec["success"] = rec["chunks"] > 0
            if not rec["success"]:
                rec["error"] = "no content in the stream"

    try:
        await asyncio.wait_for(run(), timeout)
    except TimeoutError:
        rec["error"] = f"timeout after {timeout:g} s"
    except httpx.HTTPError as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    end = time.perf_counter()
    rec["e2e"] = end - start
    rec["end_t"] = end
    rec["reply"] = "".join(pieces)  # multi-turn: the next turn resends it (dropped from the records)
    if rec["success"]:
        rec["output_tokens"] = rec["usage_tokens"] if rec["usage_tokens"] else rec["chunks"]
        n = rec["output_tokens"]
        rec["tpot"] = (rec["e2e"] - rec["ttft"]) / (n - 1) if n > 1 else None
    else:
        rec["itl"] = []
        rec["tpot"] = None
    return rec


def request_body(req: Request, args, model: str, history: list[tuple[str, str]] | None = None) -> tuple[str, dict]:
    """The request's path and body; ``history``: multi-turn, the earlier (user, assistant) turns of
    its conversation, resent before this turn's prompt (as chat messages, or joined as text)."""
    history = history or []
    if args.endpoint == "chat":
        messages = [m for u, a in history for m in ({"role": "user", "content": u},
                                                     {"role": "assistant", "content": a})]
        body: dict[str, Any] = {"model": model, "messages": [*messages, {"role": "user", "content": req.prompt}],
                                "max_completion_tokens": req.output_len}
        path = "/chat/completions"
    else:
        prompt = req.prompt if not history else "".join(f"{u}{a} " for u, a in history) + req.prompt
        body = {"model": model, "prompt": prompt, "max_tokens": req.output_len}
        path = "/completions"
    body.update(stream=True, temperature=args.temperature)
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.usage:
        body["stream_options"] = {"include_usage": True}
        if args.token_itl:
            body["stream_options"]["continuous_usage_stats"] = True
    return path, body


# ---------------------------------------------------------------------------------- one rate


def arrival_times(n: int, rate: float, arrival: str, rng: random.Random) -> list[float]:
    """Offsets (s) at which the n requests are sent."""
    if arrival == "burst" or math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate
    return out


async def run_rate(reqs: list[Request], rate: float, args, base_url: str, model: str,
                   desc: str | None = None) -> list[dict]:
    rng = random.Random(f"{args.seed}-{rate}")
    offsets = arrival_times(len(reqs), rate, args.arrival, rng)
    if args.workload == "decode-interference":  # fixed offsets: streams at 0, long prompts later
        offsets = [r.extra.get("arrival_s", 0.0) for r in reqs]
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    bar = tqdm(total=len(reqs), desc=desc or f"rate {rate:g}", unit="req", disable=args.no_progress)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits,
                                 headers=_headers(args)) as client:
        t0 = time.perf_counter()

        async def one(req: Request, offset: float, history=None) -> dict:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            queued = time.perf_counter()
            path, body = request_body(req, args, model, history)
            if sem is not None:
                async with sem:
                    rec = await send(client, base_url + path, body, args.endpoint == "chat", args.timeout)
            else:
                rec = await send(client, base_url + path, body, args.endpoint == "chat", args.timeout)
            bar.update(1)
            rec.update(req.extra)  # workload labels; arrival_s below is when it was actually due
            rec.update(idx=req.idx, kind=req.kind, input_len=req.input_len, output_len=req.output_len,
                       arrival_s=offset, client_wait_s=rec["send_t"] - queued,
                       send_s=rec.pop("send_t") - t0, end_s=rec.pop("end_t") - t0)
            return rec

        async def conversation(turns: list[Request], offset: float) -> list[dict]:
            """multi-turn: one conversation's turns in order, each resending the history."""
            history, out = [], []
            for req in turns:
                rec = await one(req, offset, history)
                history.append((req.prompt, rec["reply"]))
                out.append(rec)
                if not rec["success"]:
                    break  # the rest of the conversation cannot be sent without this reply
            return out

        if reqs and "conversation" in reqs[0].extra:  # multi-turn (not its warm-up)
            convs: dict[int, list[Request]] = {}
            for r in reqs:
                convs.setdefault(r.extra["conversation"], []).append(r)
            starts = arrival_times(len(convs), rate, args.arrival, rng)
            done = await asyncio.gather(*(conversation(t, o) for t, o in zip(convs.values(), starts)))
            recs = [rec for conv in done for rec in conv]
        else:
            recs = await asyncio.gather(*(one(r, o) for r, o in zip(reqs, offsets)))
        for rec in recs:
            rec.pop("reply", None)
    bar.close()
    return list(recs)


def _headers(args) -> dict[str, str]:
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


# ---------------------------------------------------------------------------------- aggregates


def aggregate(recs: list[dict], rate: float, workload: str) -> dict[str, Any]:
    ok = [r for r in recs if r["success"]]
    duration = (max(r["end_s"] for r in recs) - min(r["send_s"] for r in recs)) if recs else 0.0
    out_tok = sum(r["output_tokens"] for r in ok)
    prompt_known = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
    prompt_tok = sum(r["prompt_tokens"] if r["prompt_tokens"] is not None else r["input_len"] for r in ok)
    agg: dict[str, Any] = {
        "rate": "inf" if math.isinf(rate) else rate,
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "duration_s": duration,
        "req_per_s": len(ok) / duration if duration else None,
        "output_tok_per_s": out_tok / duration if duration else None,
        "total_tok_per_s": (out_tok + prompt_tok) / duration if duration else None,
        "output_tokens": out_tok,
        "prompt_tokens": prompt_tok,
        "prompt_tokens_source": "usage" if len(prompt_known) == len(ok) and ok else "estimate (input_len)",
        "mean_prompt_tokens": float(np.mean(prompt_known)) if prompt_known else None,
        "mean_input_len_asked": float(np.mean([r["input_len"] for r in recs])) if recs else None,
        "mean_output_tokens": out_tok / len(ok) if ok else None,
    }
    agg.update(percentiles_ms([r["ttft"] for r in ok], "ttft"))
    agg.update(percentiles_ms([r["tpot"] for r in ok if r["tpot"] is not None], "tpot"))
    agg.update(percentiles_ms([g for r in ok for g in r["itl"]], "itl"))
    agg.update(percentiles_ms([r["e2e"] for r in ok], "e2e"))
    if workload == "long-prompt-interference":
        short = [r for r in ok if r["kind"] == "short"]
        long_ = [r for r in ok if r["kind"] == "long"]
        agg["short_completed"], agg["long_completed"] = len(short), len(long_)
        agg.update(percentiles_ms([g for r in short for g in r["itl"]], "short_itl"))
        agg.update(percentiles_ms([r["ttft"] for r in short], "short_ttft"))
        agg.update(percentiles_ms([r["ttft"] for r in long_], "long_ttft"))
    if workload == "decode-interference":
        streams = [r for r in ok if r["kind"] == "stream"]
        long_ = [r for r in ok if r["kind"] == "long"]
        gaps = [g for r in streams for g in r["itl"]]
        agg["stream_completed"], agg["long_completed"] = len(streams), len(long_)
        agg.update(percentiles_ms(gaps, "stream_itl"))
        agg["stream_itl_max_ms"] = 1e3 * max(gaps) if gaps else None
        agg.update(percentiles_ms([r["tpot"] for r in streams if r["tpot"] is not None], "stream_tpot"))
        agg.update(percentiles_ms([r["ttft"] for r in long_], "long_ttft"))
        agg.update(percentiles_ms([r["e2e"] for r in long_], "long_e2e"))
    cached = [r for r in ok if r.get("cached_tokens") is not None and r["prompt_tokens"]]
    if cached:  # prefix caching: prompt tokens the server found cached (usage.prompt_tokens_details)
        agg["cached_tokens"] = sum(r["cached_tokens"] for r in cached)
        agg["prefix_hit_rate"] = agg["cached_tokens"] / sum(r["prompt_tokens"] for r in cached)
    if workload == "multi-turn" and ok:
        agg.update(percentiles_ms([r["ttft"] for r in ok if r["turn"] == 0], "ttft_first_turn"))
        agg.update(percentiles_ms([r["ttft"] for r in ok if r["turn"] > 0], "ttft_later_turns"))
    if workload == "shared-prefix" and ok:
        first = min(ok, key=lambda r: r["send_s"])
        agg["ttft_first_ms"] = 1e3 * first["ttft"]
        agg.update(percentiles_ms([r["ttft"] for r in ok if r is not first], "ttft_rest"))
    errors: dict[str, int] = {}
    for r in recs:
        if not r["success"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    agg["errors"] = errors
    return agg


# ---------------------------------------------------------------------------------- server


def launch_server(args) -> tuple[subprocess.Popen, str, list[str], Path]:
    extra = shlex.split(args.server_args)
    if "--port" in extra:
        port = int(extra[extra.index("--port") + 1])
    else:
        port = free_port()
        extra += ["--port", str(port)]
    if "--model" not in extra and args.model:
        extra += ["--model", args.model]
    if "--log-level" not in extra:
        extra += ["--log-level", "warning"]
    cmd = [sys.executable, "-m", "infer.server", *extra]
    log = Path(args.server_log) if args.server_log else Path(tempfile.mkstemp(prefix="infer-server-", suffix=".log")[1])
    print(f"launching: {shlex.join(cmd)}  (log: {log})", flush=True)
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/v1"
    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.perf_counter() - t0 > args.launch_timeout:
            stop_server(proc)
            raise SystemExit(f"server not healthy after {args.launch_timeout} s:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    print(f"server healthy after {time.perf_counter() - t0:.1f} s", flush=True)
    return proc, base, cmd, log


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def reset_prefix_cache(base_url: str, args) -> None:
    """``POST /reset_prefix_cache`` at the server's root (``base_url`` without ``/v1``)."""
    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    try:
        r = httpx.post(f"{root}/reset_prefix_cache", headers=_headers(args), timeout=60)
        if r.status_code != 200:
            print(f"warning: /reset_prefix_cache answered {r.status_code}: {r.text[:200]}", flush=True)
    except httpx.HTTPError as e:
        print(f"warning: /reset_prefix_cache failed: {type(e).__name__}: {e}", flush=True)


def server_models(base_url: str, args) -> dict:
    try:
        r = httpx.get(base_url + "/models", timeout=30, headers=_headers(args))
        r.raise_for_status()
        return r.json()
    except httpx.HTTPError as e:
        raise SystemExit(f"cannot list models at {base_url}/models: {type(e).__name__}: {e}") from None


# ---------------------------------------------------------------------------------- report


def plot(aggs: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [a["rate"] if isinstance(a["rate"], str) else f"{a['rate']:g}" for a in aggs]
    x = np.arange(len(aggs))

    def col(key: str) -> list[float]:
        return [a[key] if a.get(key) is not None else np.nan for a in aggs]

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        (axes[0], "TTFT (ms)", [("ttft_p50_ms", "p50", "o-"), ("ttft_p99_ms", "p99", "s--")]),
        (axes[1], "TPOT / ITL (ms)", [("tpot_p50_ms", "TPOT p50", "o-"), ("tpot_p99_ms", "TPOT p99", "s--"),
                                      ("itl_p99_ms", "ITL p99", "^:")]),
    ]
    if any(a.get("short_itl_p99_ms") is not None for a in aggs):
        panels[1][2].append(("short_itl_p99_ms", "ITL p99, short requests", "v-."))
    for ax, ylabel, series in panels:
        for key, lab, style in series:
            ax.plot(x, col(key), style, label=lab)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
    ax = axes[2]
    ax.plot(x, col("output_tok_per_s"), "o-", label="output tok/s")
    ax.plot(x, col("total_tok_per_s"), "s--", label="total tok/s")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax2 = ax.twinx()
    ax2.plot(x, col("req_per_s"), "^:", color="tab:red", label="requests/s")
    ax2.set_ylabel("completed requests / s", color="tab:red")
    ax2.set_ylim(bottom=0)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper left")
    for a in axes:
        a.set_xticks(x, labels)
        a.set_xlabel("offered request rate (req/s)")
        a.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    axes[0].set_title("time to first token")
    axes[1].set_title("time per output token")
    axes[2].set_title("throughput")
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def plot_interference(runs: list[dict], path: str, title: str) -> None:
    """decode-interference: each configuration's stream inter-token gaps over time (left; the long
    prompts' arrivals marked) and its stream ITL p50/p99/max and long-prompt TTFT (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    for run in runs:
        ts, gs = [], []
        for r in run["requests"]:
            if r["kind"] != "stream" or not r["success"]:
                continue
            t = r["send_s"] + r["ttft"]
            for g in r["itl"]:
                t += g
                ts.append(t)
                gs.append(1e3 * g)
        order = np.argsort(ts)
        ax.plot(np.asarray(ts)[order], np.asarray(gs)[order], ".", ms=3, label=run["label"] or "default")
    for r in runs[0]["requests"] if runs else []:
        if r["kind"] == "long":
            ax.axvline(r["arrival_s"], color="grey", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_ylim(bottom=1.0)  # tokens delivered back to back (one read of the socket) sit at ~0 ms
    ax.set_xlabel("time since the streams started (s); dotted: a long prompt arrives")
    ax.set_ylabel("stream inter-token gap (ms)")
    ax.set_title("decode streams' inter-token gaps")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, markerscale=3)
    labels = [run["label"] or "default" for run in runs]
    x = np.arange(len(runs))
    keys = [("stream_itl_p50_ms", "stream ITL p50"), ("stream_itl_p99_ms", "stream ITL p99"),
            ("stream_itl_max_ms", "stream largest gap"), ("long_ttft_p50_ms", "long prompt TTFT")]
    w = 0.8 / len(keys)
    for i, (k, lab) in enumerate(keys):
        vals = [run["agg"].get(k) or np.nan for run in runs]
        bx.bar(x + (i - (len(keys) - 1) / 2) * w, vals, w, label=lab)
    bx.set_xticks(x, labels, rotation=15, fontsize=8)
    bx.set_yscale("log")
    bx.set_ylabel("ms")
    bx.set_title("per configuration")
    bx.grid(alpha=0.3, axis="y", which="both")
    bx.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)


def parse_config(s: str) -> tuple[str, str]:
    label, sep, extra = s.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"--server-configs takes LABEL=ARGS, got {s!r}")
    return label, extra


def parse_rate(s: str) -> float:
    r = float(s)
    if r <= 0:
        raise argparse.ArgumentTypeError("rates must be > 0 (or inf)")
    return r


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = ap.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="OpenAI-compatible base URL, ending in /v1 (default: %(default)s; ignored with --launch)")
    s.add_argument("--model", default=None,
                   help="model name to send (default: the first id of GET /v1/models); with --launch also "
                        "passed to the server as --model unless --server-args has one")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    s.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    s.add_argument("--launch", action="store_true",
                   help="start `python -m infer.server` on a free port, wait for /health, run, stop it (SIGTERM)")
    s.add_argument("--server-args", default="",
                   help='extra arguments for the launched server, one string, e.g. "--max-model-len 512"')
    s.add_argument("--server-configs", type=parse_config, nargs="+", default=None, metavar="LABEL=ARGS",
                   help='with --launch: one server per configuration, ARGS appended to --server-args, e.g. '
                        '"off=" "chunked-512=--chunked-prefill --max-num-batched-tokens 512"')
    s.add_argument("--launch-timeout", type=float, default=600, help="seconds to wait for /health (default: 600)")
    s.add_argument("--server-log", default=None, help="file for the launched server's output (default: a temp file)")

    w = ap.add_argument_group("workload")
    w.add_argument("--workload", choices=["random", "shared-prefix", "long-prompt-interference", "decode-interference",
                                          "multi-turn"],
                   default="random",
                   help="random: independent prompts; shared-prefix: --prefix-len shared words + --input-len unique; "
                        "long-prompt-interference: --input-len prompts with a --long-fraction of --long-len ones; "
                        "decode-interference: --num-requests decode streams, --long-prompts --long-len prompts "
                        "arriving while they decode; multi-turn: --num-requests conversations of --turns turns of "
                        "--input-len words, each resending the history (and --prefix-len shared system words)")
    w.add_argument("--num-requests", type=int, default=100, help="requests per rate (default: 100)")
    w.add_argument("--request-rates", type=parse_rate, nargs="+", default=[float("inf")],
                   help="offered request rates (req/s) to sweep; inf = all requests at once (default: inf)")
    w.add_argument("--arrival", choices=["poisson", "constant", "burst"], default="poisson",
                   help="inter-arrival gaps: poisson (exponential, mean 1/rate), constant (1/rate), "
                        "burst (all at once at every rate) (default: poisson)")
    w.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals (default: 0)")
    w.add_argument("--input-len", type=int, default=128,
                   help="prompt length in words (~tokens) or token ids (default: 128); the unique suffix for "
                        "shared-prefix, the short prompts for long-prompt-interference")
    w.add_argument("--output-len", type=int, default=128, help="max_tokens of every request (default: 128)")
    w.add_argument("--prefix-len", type=int, default=512,
                   help="shared-prefix: shared prefix length; multi-turn: the shared system prompt (0: none) "
                        "(default: 512)")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation (default: 4)")
    w.add_argument("--long-fraction", type=float, default=0.1,
                   help="long-prompt-interference: fraction of long requests (at least one) (default: 0.1)")
    w.add_argument("--long-len", type=int, default=2048,
                   help="long-prompt-interference: long prompt length (default: 2048)")
    w.add_argument("--long-prompts", type=int, default=1,
                   help="decode-interference: long prompts sent while the streams decode (default: 1)")
    w.add_argument("--long-output-len", type=int, default=16,
                   help="decode-interference: max_tokens of the long prompts (default: 16)")
    w.add_argument("--long-start-s", type=float, default=2.0,
                   help="decode-interference: when the first long prompt is sent, s after the streams (default: 2)")
    w.add_argument("--long-interval-s", type=float, default=5.0,
                   help="decode-interference: seconds between long prompts (default: 5)")
    w.add_argument("--token-prompts", action="store_true",
                   help="send token ids instead of text (exact lengths; completions endpoint of infer/vLLM only)")
    w.add_argument("--token-range", type=int, nargs=2, default=[1000, 20000], metavar=("LO", "HI"),
                   help="token ids are drawn from [LO, HI) (default: 1000 20000)")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    w.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos (for servers that reject it, e.g. OpenAI's); outputs may end early")
    w.add_argument("--no-usage", dest="usage", action="store_false",
                   help="do not ask for stream_options.include_usage; tokens are then counted from chunks")
    w.add_argument("--token-itl", action="store_true",
                   help="TTFT and ITL per token, not per content chunk: asks for "
                        "stream_options.continuous_usage_stats (infer, vLLM) and times every chunk that brings "
                        "tokens, with text or without (a chunk's gap spread over its tokens). The detokenizer "
                        "holds back text that is not valid UTF-8 yet (byte-fragment tokens, common in a "
                        "random-weight model's output), so text arrives in bursts that per-chunk ITL counts as "
                        "long gaps")

    r = ap.add_argument_group("run")
    r.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (the others wait in the client; default: no cap)")
    r.add_argument("--timeout", type=float, default=300, help="seconds per request before it counts as failed "
                                                              "(default: 300)")
    r.add_argument("--warmup", type=int, default=1, help="requests sent (and discarded) before the sweep (default: 1)")
    r.add_argument("--reset-prefix-cache", action="store_true",
                   help="POST /reset_prefix_cache (infer's and vLLM's endpoint, at the server's root) before each "
                        "rate, so that every rate starts with a cold prefix cache")
    out_argument(r, "serve_bench.json", "JSON report (and the Markdown table beside it, .md)")
    r.add_argument("--plot", default=None, help="PNG: TTFT, TPOT/ITL and throughput vs request rate")
    r.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    return ap


COLUMNS = ["rate", "completed", "failed", "duration_s", "req_per_s", "output_tok_per_s", "total_tok_per_s",
           "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "e2e_p50_ms", "e2e_p99_ms"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.token_prompts and args.endpoint == "chat":
        raise SystemExit("--token-prompts needs --endpoint completions")
    if args.token_prompts and args.workload == "multi-turn":
        raise SystemExit("multi-turn resends the replies' text: drop --token-prompts")
    if args.server_configs and not args.launch:
        raise SystemExit("--server-configs needs --launch")
    if args.token_itl and not args.usage:
        raise SystemExit("--token-itl reads the usage in every chunk: drop --no-usage")
    rates = [float("inf")] if args.arrival == "burst" or args.workload == "decode-interference" else args.request_rates
    configs = args.server_configs or [("", "")]
    base_server_args = args.server_args
    aggs, raw, server_cmds = [], [], []
    reqs = build_requests(args.workload, args.num_requests, args.input_len, args.output_len, args.seed,
                          token_prompts=args.token_prompts, prefix_len=args.prefix_len,
                          long_fraction=args.long_fraction, long_len=args.long_len,
                          token_range=tuple(args.token_range), long_prompts=args.long_prompts,
                          long_output_len=args.long_output_len, long_start_s=args.long_start_s,
                          long_interval_s=args.long_interval_s, turns=args.turns)
    for label, extra in configs:
        proc = None
        server_cmd = None
        try:
            base_url = args.base_url.rstrip("/")
            if args.launch:
                args.server_args = f"{base_server_args} {extra}".strip()
                proc, base_url, server_cmd, _ = launch_server(args)
            models = server_models(base_url, args)
            model = args.model or models["data"][0]["id"]
            print(f"model {model} at {base_url}{f' ({label})' if label else ''}: {args.workload}, {len(reqs)} "
                  f"requests x rates {[f'{r:g}' for r in rates]}", flush=True)
            if args.warmup:
                warm = build_requests("random", args.warmup, min(args.input_len, 16), min(args.output_len, 4),
                                      args.seed + 12345, token_prompts=args.token_prompts,
                                      token_range=tuple(args.token_range))
                wrecs = asyncio.run(run_rate(warm, float("inf"), args, base_url, model, desc="warm-up"))
                bad = [r["error"] for r in wrecs if not r["success"]]
                if bad:
                    print(f"warning: warm-up failed: {bad[0]}", flush=True)
            for rate in rates:
                if args.reset_prefix_cache:
                    reset_prefix_cache(base_url, args)
                recs = asyncio.run(run_rate(reqs, rate, args, base_url, model))
                agg = aggregate(recs, rate, args.workload)
                if args.server_configs:
                    agg = {"config": label, **agg}
                aggs.append(agg)
                raw.append({"config": label, "rate": agg["rate"], "requests": recs})
                if agg["failed"]:
                    print(f"rate {rate:g}: {agg['failed']} failed: {agg['errors']}", flush=True)
        finally:
            if proc is not None:
                stop_server(proc)
                print(f"server stopped (exit code {proc.returncode})", flush=True)
        server_cmds.append(server_cmd)
    args.server_args = base_server_args

    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        device = "cpu"
    report = {
        "benchmark": "serve_bench",
        "env": environment(device),
        "env_note": "the client machine's environment; it is the server's too only with --launch",
        "base_url": base_url,
        "model": model,
        "server_models": models,
        "server_command": server_cmds[0] if len(server_cmds) == 1 else None,
        "server_commands": {label: cmd for (label, _), cmd in zip(configs, server_cmds)} if args.server_configs
        else None,
        "args": {k: (v if not isinstance(v, float) or math.isfinite(v) else "inf") for k, v in vars(args).items()
                 if k not in ("api_key",)},
        "workload": {"name": args.workload, "num_requests": args.num_requests, "input_len": args.input_len,
                     "output_len": args.output_len, "prefix_len": args.prefix_len
                     if args.workload in ("shared-prefix", "multi-turn") else None,
                     "turns": args.turns if args.workload == "multi-turn" else None,
                     "reset_prefix_cache": args.reset_prefix_cache, "long_fraction": args.long_fraction, "long_len": args.long_len,
                     "token_prompts": args.token_prompts, "arrival": args.arrival, "seed": args.seed,
                     "long_prompts": args.long_prompts if args.workload == "decode-interference" else None,
                     "long_output_len": args.long_output_len if args.workload == "decode-interference" else None,
                     "long_start_s": args.long_start_s if args.workload == "decode-interference" else None,
                     "long_interval_s": args.long_interval_s if args.workload == "decode-interference" else None,
                     "endpoint": args.endpoint, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
                     "max_concurrency": args.max_concurrency, "prompt_note": "text prompts: random common words, "
                     "~1 token each; see mean_prompt_tokens (server usage) per rate"},
        "rates": aggs,
        "raw": raw,
    }
    columns = (["config"] if args.server_configs else []) + list(COLUMNS)
    if args.workload == "decode-interference":
        columns = (["config"] if args.server_configs else []) + [
            "completed", "failed", "duration_s", "stream_itl_p50_ms", "stream_itl_p99_ms", "stream_itl_max_ms",
            "stream_tpot_mean_ms", "ttft_p50_ms", "long_ttft_p50_ms", "long_ttft_p99_ms", "output_tok_per_s"]
    if args.workload == "long-prompt-interference":
        columns += ["short_itl_p50_ms", "short_itl_p99_ms", "short_ttft_p50_ms", "long_ttft_p50_ms"]
    if args.workload == "shared-prefix":
        columns += ["ttft_first_ms", "ttft_rest_p50_ms"]
    if args.workload == "multi-turn":
        columns += ["ttft_first_turn_p50_ms", "ttft_later_turns_p50_ms"]
    if any(a.get("prefix_hit_rate") is not None for a in aggs):
        columns += ["prefix_hit_rate"]
    rows = [{c: ("" if a.get(c) is None else a.get(c)) for c in columns} for a in aggs]
    mp = aggs[0].get("mean_prompt_tokens") if aggs else None
    table = (f"serve_bench: {model} at {base_url}, {args.workload}, {args.num_requests} requests/rate, "
             f"input {args.input_len}" + (f" + prefix {args.prefix_len}" if args.workload == "shared-prefix" else "")
             + (f" x {args.turns} turns + system {args.prefix_len}" if args.workload == "multi-turn" else "")
             + (f", long {args.long_len} x {args.long_fraction:g}" if args.workload == "long-prompt-interference"
                else "")
             + (f", {args.long_prompts} x long {args.long_len} (out {args.long_output_len}) from "
                f"{args.long_start_s:g} s every {args.long_interval_s:g} s" if args.workload == "decode-interference"
                else "")
             + f", output {args.output_len}, {args.arrival} arrivals, seed {args.seed}"
             + (f"; server-counted prompt tokens: mean {mp:.1f}" if mp is not None else "") + "\n\n"
             + markdown_table(rows, columns))
    write_report(report, args.out, table)
    if args.plot and args.workload == "decode-interference":
        runs = [{"label": r["config"] or "", "requests": r["requests"], "agg": a} for r, a in zip(raw, aggs)]
        plot_interference(runs, args.plot, f"{model}: {args.num_requests} decode streams (in {args.input_len}, out "
                          f"{args.output_len}) + {args.long_prompts} x {args.long_len}-token prompt "
                          f"(commit {report['env']['commit']})")
    elif args.plot:
        plot(aggs, args.plot, f"{model}: {args.workload}, in {args.input_len} / out {args.output_len}, "
                              f"{args.num_requests} req/rate, {args.arrival} (commit {report['env']['commit']})")
    return 0 if all(a["completed"] for a in aggs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
