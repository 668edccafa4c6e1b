"""Smoke test of ``python -m infer.server`` on whatever device is there (the GPU suite runs it).

    python scripts/gpu_server_smoke.py MODEL_DIR

Starts the server, sends a completion (with logprobs), a chat with n=2, a streamed chat and one
bad request, checks the answers' shapes and status codes, then SIGTERMs the server.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx


def main() -> int:
    port = 8765
    proc = subprocess.Popen([sys.executable, "-m", "infer.server", "--model", sys.argv[1], "--port", str(port),
                             "--served-model-name", "m", "--max-model-len", "2048"])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            if proc.poll() is not None or time.time() > deadline:
                print("server did not come up")
                return 1
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 16,
                                                        "temperature": 0, "logprobs": 2}, timeout=60)
        print("completions", r.status_code, json.dumps(r.json())[:300])
        r2 = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 8, "n": 2, "seed": 1}, timeout=60)
        print("chat", r2.status_code, json.dumps(r2.json())[:300])
        chunks = []
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as s:
            chunks = [line for line in s.iter_lines() if line.startswith("data: ")]
        print("stream chunks", len(chunks), chunks[-1] if chunks else None)
        bad = httpx.post(url + "/v1/completions", json={"prompt": "x", "temperature": -1}, timeout=10)
        print("bad request", bad.status_code, bad.text)
        ok = (r.status_code == 200 and r2.status_code == 200 and len(r2.json()["choices"]) == 2
              and chunks and chunks[-1] == "data: [DONE]" and bad.status_code == 400)
        print("server smoke:", "PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    raise SystemExit(main())
