"""What the HTTP server costs: start-up, idle memory, and TTFT/TPOT through HTTP vs in-process.

    python benchmarks/server_latency.py                      # smollm2-135m on this machine
    python benchmarks/server_latency.py --output-len 128 --repeats 3 --out report.json

1. Starts ``python -m infer.server`` in a fresh process and times the command to ``/health``
   answering and to the first completed answer; reads the server's idle RSS.
2. Streams the same greedy request (random prompt of ``--prompt-len`` tokens, ``--output-len``
   tokens, ``ignore_eos``) through HTTP (SSE, httpx) and through the offline API in this
   process (``LLM.generate_stream``), alternating, and reports TTFT, TPOT and the server's
   overhead on TPOT (the goal is < 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402  (after common: it sets OMP_WAIT_POLICY before torch loads)
from common import environment, markdown_table, write_report  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_http(port: int, prompt: list[int], n: int) -> tuple[float, float]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = None
    count = 0
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600) as r:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    port = free_port()
    cmd = [sys.executable, "-m", "infer.server", "--model", args.model, "--port", str(port),
           "--max-model-len", str(args.prompt_len + args.output_len + 16), "--log-level", "warning"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        ready = None
        while ready is None:
            if proc.poll() is not None:
                raise SystemExit(f"server died: {proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    ready = time.perf_counter() - t0
            except httpx.HTTPError:
                time.sleep(0.1)
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hello", "max_tokens": 1},
                   timeout=120).raise_for_status()
        first_answer = time.perf_counter() - t0
        idle_rss = psutil.Process(proc.pid).memory_info().rss / 2**20
        print(f"server ready in {ready:.2f} s, first answer at {first_answer:.2f} s, idle RSS {idle_rss:.0f} MB",
              flush=True)

        from infer.llm import LLM

        llm = LLM(args.model, progress=False, max_model_len=args.prompt_len + args.output_len + 16)
        vocab = llm.engine.vocab_size
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(100, vocab - 100, (args.prompt_len,), generator=g).tolist()
        stream_http(port, prompt, 8)
        stream_offline(llm, prompt, 8)  # warm both
        http, off = [], []
        for i in range(args.repeats):
            print(f"repeat {i + 1}/{args.repeats}", flush=True)
            http.append(stream_http(port, prompt, args.output_len))
            off.append(stream_offline(llm, prompt, args.output_len))
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()

    def med(xs, k):
        return 1e3 * statistics.median(x[k] for x in xs)

    rows = [
        {"path": "HTTP (SSE)", "ttft_ms": med(http, 0), "tpot_ms": med(http, 1)},
        {"path": "offline API", "ttft_ms": med(off, 0), "tpot_ms": med(off, 1)},
    ]
    overhead = rows[0]["tpot_ms"] / rows[1]["tpot_ms"] - 1
    report = {
        "benchmark": "server_latency",
        "env": environment("cpu" if not torch.cuda.is_available() else "cuda"),
        "model": args.model,
        "workload": {"prompt_len": args.prompt_len, "output_len": args.output_len, "repeats": args.repeats,
                     "greedy": True, "ignore_eos": True},
        "startup": {"ready_s": ready, "first_answer_s": first_answer, "idle_rss_mb": idle_rss},
        "rows": rows,
        "tpot_overhead": overhead,
        "note": "the server and the offline engine share the machine's cores; each is idle while the other runs",
        "pid": os.getpid(),
    }
    table = markdown_table(rows, ["path", "ttft_ms", "tpot_ms"])
    table += (f"\n\nserver TPOT overhead: {100 * overhead:+.1f}%; ready {ready:.2f} s after the command, "
              f"first answer at {first_answer:.2f} s; idle RSS {idle_rss:.0f} MB")
    write_report(report, args.out, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
