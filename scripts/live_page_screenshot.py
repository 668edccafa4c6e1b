#!/usr/bin/env python3
"""Take the live page's screenshot for docs/reading-the-engine.md.

Starts ``python -m infer.server --live-page`` (continuous batching, chunked prefill, prefix caching
and a paged KV cache too small for every running request, so that the queues, the block map and
the steps all have something to show, preemptions included), opens ``/live`` in headless Chromium (Playwright driving Debian's ``chromium``: ``apt-get install
chromium``; ``pip install playwright``), sends requests that share a system prompt and arrive one
after another, and takes the screenshot once the page shows requests running and waiting and
prefix-cache blocks; then it waits for the requests and stops the server.

    python scripts/live_page_screenshot.py                                  # smollm2-135m on the CPU
    python scripts/live_page_screenshot.py --out /tmp/live.png --requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx

SYSTEM = ("You are a helpful assistant for a course on LLM inference engines. Answer in two or three "
          "sentences, plainly, and mention the engine's scheduler or its KV cache where it helps. ")
QUESTIONS = ["What is a KV cache?", "Why batch requests?", "What does paged attention change?",
             "What is a prefix cache hit?", "Why chunk a long prompt?", "What is a preemption?",
             "What does a CUDA graph save?", "What is speculative decoding?", "Why quantize weights?",
             "What is time to first token?", "What is inter-token latency?", "Why stream the output?",
             "What is continuous batching?", "What is the token budget of a step?", "What is tensor parallelism?",
             "What is KV offload?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send(url: str, n: int, gap_s: float, max_tokens: int) -> None:
    async def one(c: httpx.AsyncClient, i: int) -> None:
        await asyncio.sleep(i * gap_s)
        prompt = SYSTEM * (1 + i % 3) + QUESTIONS[i % len(QUESTIONS)]
        r = await c.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens + 8 * (i % 4),
                                                        "temperature": 0.7, "seed": i})
        r.raise_for_status()

    async def main() -> None:
        async with httpx.AsyncClient(timeout=600) as c:
            await asyncio.gather(*(one(c, i) for i in range(n)))

    asyncio.run(main())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", default="docs/img/live-page.png")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--gap", type=float, default=0.3, help="seconds between two requests' arrivals")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=40, help="take the picture once the page has seen this many steps")
    p.add_argument("--server-args", default="--batching continuous --chunked-prefill --max-num-batched-tokens 128 "
                   "--prefix-caching --kv-cache paged --block-size 16 --max-num-seqs 6 --max-model-len 512 "
                   "--kv-cache-memory-bytes 45000000", help="flags of python -m infer.server")
    p.add_argument("--chromium", default=os.environ.get("INFER_CHROMIUM") or shutil.which("chromium"))
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "infer.server", "--model", args.model, "--device", "cpu", "--port", str(port),
           "--live-page", "--log-level", "warning", *args.server_args.split()]
    print("[live] starting:", " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not come up")
            time.sleep(0.5)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 860})
            page.goto(f"{url}/live")
            load = threading.Thread(target=send, args=(url, args.requests, args.gap, args.max_tokens))
            load.start()
            print("[live] waiting for running and waiting requests", flush=True)
            shown = ("[document.querySelectorAll('#running tr').length, document.querySelectorAll('#waiting tr').length,"
                     " +document.getElementById('kv-cached').textContent, S.steps.length,"
                     " document.getElementById('status').textContent]")
            while True:
                running, waiting, cached, steps, status = page.evaluate(shown)
                print(f"[live] page: {running} running, {waiting} waiting, {cached} cached blocks, {steps} steps "
                      f"({status})", flush=True)
                if (running >= 4 and waiting >= 1 and steps >= args.steps) or not load.is_alive():
                    break
                page.wait_for_timeout(500)
            page.wait_for_timeout(300)  # the frame after the last state
            page.screenshot(path=args.out, full_page=True)
            print(f"[live] wrote {args.out}", flush=True)
            load.join()
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
