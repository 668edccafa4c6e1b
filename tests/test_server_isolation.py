"""No request may stall the others: a huge prompt costs only its own request.

A real ``python -m infer.server`` (continuous batching, the shipped SmolLM2 on the CPU) decodes 8
streams while a client sends a 5 MB prompt five times (under the server's 8 MiB body limit, far over
what a 1,024-token context can hold). The prompt is measured before it is tokenized
(``infer.engine.input_processor``) and rejected with a 400; what is tokenized is tokenized on the
engine handle's tokenizer threads, never on the event loop or the engine thread. Before, the server
spent 8.4 s tokenizing each such prompt on the engine thread: every stream stalled 8 s and ``/health``
took up to 11.6 s.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from tests.server_fixture import ServerProcess  # noqa: E402

BIG = "a b c d " * 655_360  # 5,242,880 characters
STREAMS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("isolation"),
                        ["--model", "smollm2-135m", "--device", "cpu", "--max-model-len", "1024",
                         "--batching", "continuous", "--max-num-seqs", str(STREAMS), "--log-level", "warning"])
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _stream(url: str, i: int, events: list[tuple[float, float]]) -> None:
    """Stream one long completion; record ``(arrival time, gap since the previous token)`` per token."""
    body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=120) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        last = None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            if last is not None:
                events.append((now, now - last))
            last = now


def test_a_huge_prompt_is_rejected_unread_while_the_streams_go_on(server):
    """Measured as the issue asked: while the five big prompts arrive, no stream waits a second for a
    token and ``/health`` answers within 0.5 s. On a loaded machine (CI's two cores run two test workers
    beside the server) a decode step can itself take over a second, so a gap counts against the server
    only when it also exceeds twice the streams' largest gap outside that window."""
    url = server.url
    events: list[tuple[float, float]] = []
    streams = [threading.Thread(target=_stream, args=(url, i, events)) for i in range(STREAMS)]
    for t in streams:
        t.start()
    health: list[tuple[float, float]] = []
    stop_health = threading.Event()

    def poll_health():
        with httpx.Client(timeout=30) as c:
            while not stop_health.is_set():
                t0 = time.monotonic()
                assert c.get(f"{url}/health").status_code == 200
                health.append((t0, time.monotonic() - t0))
                time.sleep(0.05)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        while len(events) < 4 * STREAMS:  # every stream is decoding
            time.sleep(0.05)
        answers = []
        start = time.monotonic()
        with httpx.Client(timeout=60) as c:
            for path, body in [(f"{url}/v1/completions", {"prompt": BIG, "max_tokens": 4})] * 4 + [
                    (f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}], "max_tokens": 4})]:
                t0 = time.monotonic()
                r = c.post(path, json=body)
                answers.append((r.status_code, r.json()["error"]["param"], time.monotonic() - t0))
        end = time.monotonic() + 0.5  # a token delayed by the last prompt arrives after its answer
    finally:
        stop_health.set()
        poller.join(30)
        for t in streams:
            t.join(120)
    assert [a[:2] for a in answers] == [(400, "prompt")] * 4 + [(400, "messages")], answers
    assert max(a[2] for a in answers) < 2.0, answers  # rejected unread (tokenizing took 8.4 s)
    inside = [g for at, g in events if start <= at <= end]
    outside = [g for at, g in events if not start <= at <= end]
    assert inside and outside
    assert max(inside) < max(1.0, 2 * max(outside)), (max(inside), max(outside))
    during = [d for at, d in health if start <= at <= end]
    assert during and max(during) < 0.5, f"/health took {max(during):.2f} s"
    # and the server still answers a normal request
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                  "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
