"""The live page (``python -m infer.server --live-page``): its event stream, its block map, its key.

Two servers on the tiny random-weight Llama (``tiny_llama``), continuous batching, paged KV cache of
16-token blocks, at most 2 running sequences (so a third request waits):

* ``live`` runs in this process (the app of ``build_app(..., live_page=True)`` under uvicorn on a
  thread): a test can hold the engine thread still inside a step (:class:`Gate`, a step listener
  hooked in after the live view's), right after the live view published that step and a snapshot.
  While it is held nothing changes, so the page's state and ``/metrics`` must agree exactly;
* ``keyed`` is ``python -m infer.server --live-page`` with an API key (tests/server_fixture.py): the
  flag, the key on the data routes, the stream through a real process.

Checked: the step events of three requests agree with what their responses say (prompt and
completion tokens, finish reason, a time to first token each) and with paging arithmetic; the
block map's used blocks equal the engine's count and ``/metrics``' ``infer:kv_cache_usage_perc``;
each running request holds ``ceil(tokens in cache / 16)`` blocks; the routes are absent without the
flag (404) and the data needs the key when one is set. In headless Chromium (Playwright driving
Debian's ``chromium``; skipped when either is missing), the page shows the requests in its queues
and the used-block count of ``/metrics``, and reconnects to a restarted server.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading

import pytest
import torch

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from infer.config import EngineConfig  # noqa: E402
from infer.engine import LLMEngine  # noqa: E402
from infer.engine.live_view import CACHED, FREE, SHARED, run_length  # noqa: E402
from infer.server.app import build_app  # noqa: E402
from infer.server.async_engine import AsyncEngine  # noqa: E402
from tests.server_fixture import ServerProcess, free_port, metric_value, wait_until  # noqa: E402

KEY = "sk-live-test-0123"
BLOCK = 16
MAX_SEQS = 2
# three prompts of distinct lengths and first tokens (no prefix-cache hit between them)
PROMPTS = [[5 + i] + [7 + (j * (i + 3)) % 200 for j in range(n - 1)] for i, n in enumerate((21, 37, 50))]
MAX_TOKENS = 24


def config(path) -> EngineConfig:
    return EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=256, batching="continuous",
                        kv_cache="paged", block_size=BLOCK, max_num_seqs=MAX_SEQS, prefix_caching=True)


def used_in_map(runs) -> int:
    """Blocks the block map shows held (by one request or shared), from its run-length form."""
    return sum(n for code, n in runs if code >= 0 or code == SHARED)


class Gate:
    """A step listener that, once :attr:`armed`, holds the engine thread inside the first step whose
    record satisfies ``when`` until :attr:`release` is set (at most 60 s)."""

    def __init__(self, when) -> None:
        self.when = when
        self.armed, self.held, self.release = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, engine, rec) -> None:
        if self.armed.is_set() and self.when(rec):
            self.armed.clear()
            self.held.set()
            self.release.wait(60)


class InProcessServer:
    """``app`` served by uvicorn on a thread, on ``port``."""

    def __init__(self, app, port: int) -> None:
        import uvicorn

        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "uvicorn to start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="module")
def live(tiny_llama):
    """The in-process server with the live page (``.url``, ``.engine``: the AsyncEngine, ``.view``,
    ``.gate``: a :class:`Gate` for the tests to arm, ``.port``)."""
    eng = AsyncEngine(lambda: LLMEngine(config(tiny_llama.path), loaded=tiny_llama, progress=False))
    app = build_app(eng, "tiny", live_page=True)
    view = app.state.live.view
    view.snapshot_interval_s = 0.0  # a snapshot after every step: the held step's is in the ring
    gate = Gate(lambda rec: rec.running == MAX_SEQS and rec.waiting >= 1)
    eng.engine.add_step_listener(gate)  # after the live view's listener
    port = free_port()
    srv = InProcessServer(app, port)
    srv.engine, srv.view, srv.gate, srv.port = eng, view, gate, port
    try:
        yield srv
    finally:
        gate.release.set()
        srv.stop()
        eng.shutdown()


def send_all(url: str, prompts, headers=None) -> list[dict]:
    """POST the prompts as concurrent completions (greedy, ``MAX_TOKENS`` each); their JSON bodies."""
    async def main():
        async with httpx.AsyncClient(timeout=120, headers=headers) as c:
            rs = await asyncio.gather(*(c.post(f"{url}/v1/completions", json={
                "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}) for p in prompts))
        for r in rs:
            assert r.status_code == 200, r.text
        return [r.json() for r in rs]

    return asyncio.run(main())


class SSEReader:
    """Reads ``/live/events`` on a thread into :attr:`events` (``(name, data)`` pairs)."""

    def __init__(self, url: str, headers=None) -> None:
        self.events: list[tuple[str, object]] = []
        self.stop = threading.Event()
        self.status: int | None = None
        self.thread = threading.Thread(target=self._run, args=(url, headers), daemon=True)
        self.thread.start()
        wait_until(lambda: any(n == "state" for n, _ in self.events), 30, "the stream's first state")

    def _run(self, url: str, headers) -> None:
        try:
            with httpx.stream("GET", f"{url}/live/events", headers=headers, timeout=60) as r:
                self.status = r.status_code
                name = None
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        self.events.append((name, json.loads(line[5:])))
                    if self.stop.is_set():
                        return
        except httpx.HTTPError:  # the server stopped first (the end of the module)
            pass

    def of(self, name: str) -> list:
        return [d for n, d in list(self.events) if n == name]

    def steps(self) -> list[dict]:
        return [e for batch in self.of("steps") for e in batch]


def test_block_map_equals_metrics_while_the_engine_is_held(live):
    """Held inside a step with two requests running and one waiting, the state the stream sent is
    the engine's: its block map's used blocks = its used count = ``/metrics``' usage x blocks, each
    running request holds ``ceil(tokens in cache / 16)`` blocks, and the queues match ``/metrics``."""
    reader = SSEReader(live.url)
    live.gate.armed.set()
    sender = threading.Thread(target=send_all, args=(live.url, PROMPTS), daemon=True)
    sender.start()
    try:
        assert live.gate.held.wait(60), "no step ran two requests with one waiting"
        state = wait_until(lambda: next((s for s in reversed(reader.of("state"))
                                         if len(s["running"]) == MAX_SEQS and len(s["waiting"]) == 1), None),
                           10, "the held step's state on the stream")
        text = httpx.get(f"{live.url}/metrics", timeout=10).text
        queues = live.engine.engine.num_running, live.engine.engine.num_waiting  # held: safe to read here
    finally:
        live.gate.release.set()
    sender.join(120)
    reader.stop.set()
    num_blocks = live.view.info["num_blocks"]
    usage = metric_value(text, "infer:kv_cache_usage_perc")
    assert used_in_map(state["blocks"]) == state["kv"]["used"] == round(usage * num_blocks) > 0
    assert sum(n for _, n in state["blocks"]) == num_blocks
    assert state["kv"]["usage"] == pytest.approx(usage, abs=1e-9)
    # (/metrics' running and waiting gauges are set after each step returns: one step behind here)
    assert (len(state["running"]), len(state["waiting"])) == queues == (MAX_SEQS, 1)
    codes = [c for c, n in state["blocks"] for _ in range(n)]
    for i, r in enumerate(state["running"]):  # paging: a sequence holds the blocks its cached tokens fill
        assert r["blocks"] == -(-r["computed"] // BLOCK) == codes.count(i), r
        assert r["prompt"] in {len(p) for p in PROMPTS}
    assert {w["prompt"] for w in state["waiting"]} <= {len(p) for p in PROMPTS}
    assert not any(c == CACHED for c in codes)  # nothing finished yet: no cached free block


def test_events_agree_with_the_requests(live):
    """The step events of three concurrent requests say what their responses say: each request's
    prefill covers its prompt less what the prefix cache held, it sampled ``completion_tokens`` tokens (its prefill's and one per
    decode), finished with ``length``, and got one time to first token; no step runs more than
    ``max_num_seqs`` sequences or more tokens than the budget; the snapshot after them is idle
    with the finished prompts' full blocks cached."""
    reader = SSEReader(live.url)
    bodies = send_all(live.url, PROMPTS)
    wait_until(lambda: any(not s["running"] and not s["waiting"] for s in reader.of("state")[1:])
               and live.engine.num_running == 0, 30, "an idle state after the requests")
    reader.stop.set()
    steps = reader.steps()
    assert steps and [e["step"] for e in steps] == list(range(steps[0]["step"], steps[-1]["step"] + 1))
    by_rid: dict[str, dict] = {}
    for e in steps:
        assert e["prefill"] + e["decode"] <= live.view.info["token_budget"] and len(e["seqs"]) <= MAX_SEQS
        assert e["prefill"] + e["decode"] == sum(s[3] for s in e["seqs"])
        for rid, _index, phase, tokens, context_len in e["seqs"]:
            r = by_rid.setdefault(rid, {"prefill": 0, "sampled": 0, "prompt": None, "finished": None, "ttft": 0,
                                        "cached": 0})
            if phase in ("prefill", "prefill chunk"):
                r["prefill"] += tokens
            if phase == "prefill":
                r["prompt"], r["sampled"] = context_len, r["sampled"] + 1
            elif phase == "decode":
                r["sampled"] += 1
        for rid, _index, cached in e["admitted"]:
            by_rid.setdefault(rid, {"prefill": 0, "sampled": 0, "prompt": None, "finished": None, "ttft": 0,
                                    "cached": 0})["cached"] = cached
        for rid, _index, reason in e["finished"]:
            by_rid[rid]["finished"] = reason
        for rid, ms in e["ttft"]:
            assert ms > 0
            by_rid[rid]["ttft"] += 1
    usage = sorted((b["usage"]["prompt_tokens"], b["usage"]["completion_tokens"]) for b in bodies)
    assert sorted((r["prompt"], r["sampled"]) for r in by_rid.values()) == usage == \
        sorted((len(p), MAX_TOKENS) for p in PROMPTS)
    for r in by_rid.values():
        # the prefill ran what the prefix cache did not hold (the prompts ran before in this module)
        assert r["prefill"] + r["cached"] == r["prompt"] and r["finished"] == "length" and r["ttft"] == 1, r
    last = reader.of("state")[-1]
    assert last["kv"]["used"] == used_in_map(last["blocks"]) == 0
    # the full blocks of every prompt and its generated tokens stay cached for the prefix cache
    cached = sum(n for c, n in last["blocks"] if c == CACHED)
    assert cached == last["kv"]["cached"] >= sum((len(p) + MAX_TOKENS - 1) // BLOCK for p in PROMPTS)
    assert sum(n for c, n in last["blocks"] if c == FREE) == last["kv"]["free"]


def test_the_ring_drops_the_oldest_and_the_host_tier_is_counted(tiny_llama):
    """A :class:`LiveView` of an engine whose prefix cache evicts to the host tier (``kv_offload``): a
    reader behind an 8-event ring is told how many events it missed and gets the last 8 in order;
    the snapshot's host-tier occupancy equals the blocks the step events say were offloaded, and its
    block map counts what the pool holds."""
    from infer.engine.live_view import LiveView
    from infer.sampling import SamplingParams

    block_bytes = 3 * 2 * 2 * 32 * 4 * BLOCK  # tiny-llama: layers x (K, V) x KV heads x head_dim x fp32 x tokens
    eng = LLMEngine(EngineConfig(model=str(tiny_llama.path), device="cpu", dtype="float32", max_model_len=128,
                                 batching="continuous", kv_cache="paged", block_size=BLOCK, prefix_caching=True,
                                 kv_cache_memory_bytes=12 * block_bytes, kv_offload="host",
                                 kv_offload_bytes=64 * block_bytes), loaded=tiny_llama, progress=False)
    try:
        assert eng.kv_manager.num_blocks == 12
        view = LiveView(eng, max_events=8, snapshot_interval_s=0.0)
        for i in range(6):  # distinct prompts: each leaves 2 full blocks cached, 12 in all: some are evicted
            eng.add_request([10 + i] + [20 + i] * 39, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        steps, after = [], 0
        while eng.has_unfinished_requests():
            eng.step()
            steps.extend(view.step_event(*p) for _, kind, p in view.since(after)[0] if kind == "step")
            after = view.num_events
        items, dropped = view.since(0)
        assert view.num_events > 8 and dropped == view.num_events - 8
        assert [n for n, _, _ in items] == list(range(view.num_events - 8, view.num_events))
        snap = view.snapshot()
        offloaded = sum(e["counts"].get("offloaded_blocks", 0) for e in steps)
        assert snap["offload"]["host_used"] == offloaded > 0
        assert sum(e["counts"].get("evictions", 0) for e in steps) >= offloaded
        assert snap["offload"]["host_capacity"] == 64 and snap["kv"]["used"] == 0
        pool = eng.kv_manager.pool
        assert sum(n for c, n in snap["blocks"] if c == CACHED) == pool.num_cached_free > 0
        assert sum(n for c, n in snap["blocks"] if c == FREE) == len(pool.free_blocks) == 12 - pool.num_cached_free
    finally:
        eng.shutdown()


def test_off_by_default_and_keyed_data(tiny_llama):
    """Without ``live_page`` the routes do not exist (404); with an API key, the page is served to
    anyone but its data answers 401 without the key."""
    eng = AsyncEngine(lambda: LLMEngine(config(tiny_llama.path), loaded=tiny_llama, progress=False))
    try:
        async def main():
            plain = httpx.ASGITransport(app=build_app(eng, "tiny"))
            keyed = httpx.ASGITransport(app=build_app(eng, "tiny", api_key=KEY, live_page=True))
            async with httpx.AsyncClient(transport=plain, base_url="http://t") as c:
                for path in ("/live", "/live/live.js", "/live/snapshot", "/live/events"):
                    assert (await c.get(path)).status_code == 404, path
            async with httpx.AsyncClient(transport=keyed, base_url="http://t") as c:
                page = await c.get("/live")
                assert page.status_code == 200 and "/live/live.js" in page.text
                for path in ("/live/live.js", "/live/live.css"):
                    assert (await c.get(path)).status_code == 200
                for path in ("/live/snapshot", "/live/events"):
                    r = await c.get(path, headers={"Authorization": "Bearer wrong"})
                    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                r = await c.get("/live/snapshot", headers={"Authorization": f"Bearer {KEY}"})
                assert r.status_code == 200
                return r.json()

        snap = asyncio.run(main())
        assert snap["info"]["num_blocks"] == eng.engine.kv_manager.num_blocks
        assert snap["state"]["blocks"] == run_length([FREE] * snap["info"]["num_blocks"])
    finally:
        eng.shutdown()


def test_cli_flag_with_a_key(tiny_llama, tmp_path):
    """``python -m infer.server --live-page`` with ``$INFER_API_KEY``: the page is open, the
    stream needs the key and carries a request's steps."""
    srv = ServerProcess(tmp_path, ["--model", str(tiny_llama.path), "--device", "cpu", "--batching", "continuous",
                                   "--kv-cache", "paged", "--block-size", "16", "--max-model-len", "256",
                                   "--live-page", "--log-level", "warning"], "live",
                        {"OMP_NUM_THREADS": str(torch.get_num_threads()), "INFER_API_KEY": KEY})
    try:
        srv.wait_ready()
        auth = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{srv.url}/live", timeout=10).status_code == 200
        assert httpx.get(f"{srv.url}/live/events", timeout=10).status_code == 401
        reader = SSEReader(srv.url, auth)
        (body,) = send_all(srv.url, PROMPTS[:1], auth)
        wait_until(lambda: any(e["finished"] for e in reader.steps()), 30, "the request's last step")
        wait_until(lambda: not reader.of("state")[-1]["running"], 10, "a state without the finished request")
        reader.stop.set()
        mine = [s for e in reader.steps() for s in e["seqs"]]
        assert len(mine) == body["usage"]["completion_tokens"]  # its prefill and one decode per later token
        assert reader.of("hello")[0]["info"]["block_size"] == 16
    finally:
        srv.stop()


# ---------------------------------------------------------------------------- in a browser


def chromium_path() -> str | None:
    return os.environ.get("INFER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    path = chromium_path()
    if path is None:
        pytest.skip("no chromium (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def test_page_shows_the_engine_in_a_browser(live, browser, tmp_path):
    """Headless Chromium on ``/live``: held with two requests running and one waiting, the page lists
    exactly those in its queues, and the used blocks it counts on its block map equal ``/metrics``'
    usage x blocks; then the server restarts (a new app on the same port) and the page reconnects."""
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{live.url}/live")
    page.wait_for_function("document.getElementById('status').textContent === 'live'", timeout=30_000)
    live.gate.held.clear()
    live.gate.release.clear()
    live.gate.armed.set()
    sender = threading.Thread(target=send_all, args=(live.url, PROMPTS), daemon=True)
    sender.start()
    try:
        assert live.gate.held.wait(60), "no step ran two requests with one waiting"
        page.wait_for_function(f"document.querySelectorAll('#running tr').length === {MAX_SEQS} && "
                               "document.querySelectorAll('#waiting tr').length === 1", timeout=10_000)
        text = httpx.get(f"{live.url}/metrics", timeout=10).text
        shown = {q: page.eval_on_selector_all(f"#{q} tr", "rows => rows.map(r => r.dataset.requestId)")
                 for q in ("running", "waiting")}
        used = int(page.text_content("#kv-used"))
        page.screenshot(path=str(tmp_path / "live.png"), full_page=True)
        state = next(p for _, kind, p in reversed(live.view.since(0)[0]) if kind == "state")  # the held step's
        queues = live.engine.engine.num_running, live.engine.engine.num_waiting
    finally:
        live.gate.release.set()
    sender.join(120)
    assert shown == {"running": [r["id"] for r in state["running"]], "waiting": [w["id"] for w in state["waiting"]]}
    assert used == round(metric_value(text, "infer:kv_cache_usage_perc") * live.view.info["num_blocks"]) > 0
    assert queues == (MAX_SEQS, 1)
    # a restart: the server goes away, a new one (a new instance) comes up on the same port
    before = page.evaluate("S.instance")
    live.stop()
    page.wait_for_function("document.getElementById('status').textContent.startsWith('disconnected')",
                           timeout=15_000)
    app = build_app(live.engine, "tiny", live_page=True)
    again = InProcessServer(app, live.port)
    live.server, live.thread = again.server, again.thread
    page.wait_for_function(f"S.instance && S.instance !== {json.dumps(before)} && "
                           "document.getElementById('status').textContent === 'live'", timeout=30_000)
    assert page.evaluate("S.instance") == app.state.live.instance
    assert not errors, errors
    page.close()
