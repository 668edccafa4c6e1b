"""Engine faults: an exception inside a step fails that step's requests only; the server serves on.

In-process and fast: an :class:`LLMEngine` on the tiny random-weight Llama (``tiny_llama``),
run by :class:`AsyncEngine` and served by the FastAPI app through httpx's ASGI transport (an
exception escaping the app would be raised here, so "no ASGI traceback" is checked too). The
fault is injected by wrapping the model runner's ``execute``: it raises ``RuntimeError`` on the
steps the test chooses, as a bug in a kernel or a device error would.

Checked: the failed request gets OpenAI's error body (500, or a last SSE event then
``data: [DONE]``), a request waiting behind it is served with the same greedy answer as
before the fault, the KV-cache pool is whole again (every block free, no reference left),
the traceback is logged once per fault; when steps keep failing, ``/health`` and the
requests in flight get 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

from infer.config import EngineConfig  # noqa: E402
from infer.engine import LLMEngine  # noqa: E402
from infer.errors import EngineStepError  # noqa: E402
from infer.server.app import build_app  # noqa: E402
from infer.server.async_engine import AsyncEngine  # noqa: E402

CMPL, CHATP = "/v1/completions", "/v1/chat/completions"
GREEDY = {"prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


class Fault:
    """Wraps ``runner.execute``: raises ``RuntimeError("injected fault")`` on the calls made while
    :attr:`armed` is set; ``once`` disarms it after the first."""

    def __init__(self, runner, once: bool = True) -> None:
        self.execute = runner.execute
        self.once = once
        self.armed = threading.Event()
        self.raised = 0

    def __call__(self, *args, **kwargs):
        if self.armed.is_set():
            if self.once:
                self.armed.clear()
            self.raised += 1
            raise RuntimeError("injected fault")
        return self.execute(*args, **kwargs)


@pytest.fixture
def served(tiny_llama, monkeypatch):
    """``(async_engine, app, fault)``: one request at a time (batching "none"), so which
    request a failing step holds is known."""
    holder = {}

    def factory(max_step_failures=3, once=True):
        cfg = EngineConfig(model=str(tiny_llama.path), device="cpu", dtype="float32", max_model_len=512,
                           batching="none", kv_cache="paged", block_size=16)
        eng = AsyncEngine(lambda: LLMEngine(cfg, loaded=tiny_llama, progress=False),
                          max_step_failures=max_step_failures)
        fault = Fault(eng.engine.runner, once=once)
        monkeypatch.setattr(eng.engine.runner, "execute", fault)
        holder["eng"] = eng
        return eng, build_app(eng, "tiny"), fault

    yield factory
    if "eng" in holder:
        holder["eng"].shutdown()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def sse(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def assert_openai_error(body: dict, type_: str) -> None:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == type_ and body["error"]["message"], body


def assert_pool_whole(eng: LLMEngine) -> None:
    """Every KV block is free and unreferenced, and the engine holds no request."""
    pool = eng.kv_manager.pool
    assert pool.num_free == pool.num_blocks and not any(pool.ref_counts), "KV blocks leaked"
    assert sorted(pool.free_blocks) == list(range(pool.num_blocks))
    assert not eng.requests and not eng.has_unfinished_requests()


async def wait_for(predicate, timeout=30.0):
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


@pytest.fixture
def caplog():
    """The engine handle's log records with a traceback, captured by a handler on its own logger
    (``infer.server``): what another test of the same process did to the root logger's handlers or to
    propagation (libraries that configure logging) cannot hide them. Shadows pytest's ``caplog``."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger, handler = logging.getLogger("infer.server"), Collect(logging.ERROR)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def fault_records(records) -> list[logging.LogRecord]:
    return [r for r in records if r.name == "infer.server" and r.exc_info]


def test_step_fault_fails_only_that_step(served, caplog):
    """A long stream (A) runs, a greedy request (B) waits behind it; a step of A raises. A's stream
    ends with an error event, B is served with the answer it had before the fault, the pool is
    whole, the traceback is logged once; then a non-streamed request and a chat hit a fault too."""
    aeng, app, fault = served()
    eng = aeng.engine

    async def main():
        async with client(app) as c:
            before = (await c.post(CMPL, json=GREEDY)).json()["choices"][0]["text"]

            async def stream_a():
                r = await c.post(CMPL, json={"prompt": "a long one", "max_tokens": 400, "ignore_eos": True,
                                             "stream": True})
                return r

            ta = asyncio.create_task(stream_a())
            await wait_for(lambda: aeng.num_running == 1)
            tb = asyncio.create_task(c.post(CMPL, json=GREEDY))
            await wait_for(lambda: aeng.num_waiting == 1)
            fault.armed.set()  # the next step holds A only (batching "none")
            ra, rb = await ta, await tb
            assert ra.status_code == 200
            events = sse(ra.text)
            assert events[-1] == "[DONE]"
            assert_openai_error(events[-2], "internal_error")
            assert "injected fault" in events[-2]["error"]["message"]
            assert all("choices" in ev for ev in events[:-2]) and len(events) >= 3  # A had streamed a little
            assert rb.status_code == 200 and rb.json()["choices"][0]["text"] == before
            await wait_for(lambda: not eng.has_unfinished_requests())
            assert_pool_whole(eng)
            assert len(fault_records(caplog)) == 1

            # non-streamed and streamed, completions and chat: the same (a good request after each
            # fault: failures in a row would stop the engine, see the next test)
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            for path, body in ((CMPL, GREEDY), (CMPL, {**GREEDY, "stream": True}), (CHATP, chat),
                               (CHATP, {**chat, "stream": True})):
                fault.armed.set()
                r = await c.post(path, json=body)
                if body.get("stream"):
                    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                    events = sse(r.text)
                    assert events[-1] == "[DONE]"
                    assert_openai_error(events[-2], "internal_error")
                else:
                    assert r.status_code == 500, r.text
                    assert_openai_error(r.json(), "internal_error")
                assert (await c.get("/health")).status_code == 200
                assert (await c.post(CMPL, json=GREEDY)).json()["choices"][0]["text"] == before
            assert fault.raised == 5 and len(fault_records(caplog)) == 5
            assert_pool_whole(eng)

    asyncio.run(main())


def test_engine_step_error_frees_blocks_offline(tiny_llama):
    """``LLMEngine.step`` itself: the failed step's requests are aborted (``finish_reason``
    "error") and their blocks freed; a request that was not in the step finishes normally."""
    cfg = EngineConfig(model=str(tiny_llama.path), device="cpu", dtype="float32", max_model_len=256,
                       batching="continuous", kv_cache="paged", block_size=16, max_num_seqs=2)
    eng = LLMEngine(cfg, loaded=tiny_llama, progress=False)
    from infer.sampling import SamplingParams

    ref = LLMEngine(cfg, loaded=tiny_llama, progress=False)
    c = ref.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while ref.has_unfinished_requests():
        ref.step()
    want = c.seqs[0].output_token_ids

    a = eng.add_request([1, 2, 3, 4], SamplingParams(max_tokens=50, n=2, temperature=1.0, ignore_eos=True))
    eng.step()
    eng.step()  # a runs, two sequences (shared prompt blocks)
    fault = Fault(eng.runner)
    eng.runner.execute = fault
    fault.armed.set()
    with pytest.raises(EngineStepError, match="injected fault") as e:
        eng.step()
    assert e.value.request_ids == [a.request_id] and isinstance(e.value.__cause__, RuntimeError)
    assert [s.finish_reason for s in a.seqs] == ["error", "error"]
    assert_pool_whole(eng)
    c = eng.add_request([5, 6, 7], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert c.seqs[0].output_token_ids == want
    assert_pool_whole(eng)


def test_engine_that_keeps_failing_is_dead(served, caplog):
    """Steps failing ``max_step_failures`` (2) times in a row stop the engine. A runs, then a stream
    B and a request C wait; every step from then on raises. A's step fails (500), B's step fails
    and the engine gives up: B's stream ends with a 503 error event, C (still waiting) gets 503,
    ``/health`` 503, later requests 503, and nothing reaches the ASGI server as an exception."""
    aeng, app, fault = served(max_step_failures=2, once=False)

    async def main():
        async with client(app) as c:
            ta = asyncio.create_task(c.post(CMPL, json={**GREEDY, "max_tokens": 400}))
            await wait_for(lambda: aeng.num_running == 1)
            tb = asyncio.create_task(c.post(CMPL, json={**GREEDY, "stream": True}))
            await wait_for(lambda: aeng.num_waiting == 1)
            tc = asyncio.create_task(c.post(CMPL, json=GREEDY))
            await wait_for(lambda: aeng.num_waiting == 2)
            fault.armed.set()  # every step from now on
            ra, rb, rc = await ta, await tb, await tc
            assert ra.status_code == 500, ra.text
            assert_openai_error(ra.json(), "internal_error")
            assert rb.status_code == 200
            events = sse(rb.text)
            assert events[-1] == "[DONE]"
            assert_openai_error(events[-2], "server_unavailable")
            assert rc.status_code == 503, rc.text
            assert_openai_error(rc.json(), "server_unavailable")
            await wait_for(lambda: not aeng.alive)
            h = await c.get("/health")
            assert h.status_code == 503
            assert_openai_error(h.json(), "server_unavailable")
            r = await c.post(CMPL, json=GREEDY)
            assert r.status_code == 503
            assert_openai_error(r.json(), "server_unavailable")

    asyncio.run(main())
    assert fault.raised == 2
    assert len(fault_records(caplog)) == 2  # one traceback per failed step, none for giving up


def test_failed_and_aborted_requests_leave_no_first_token_bookkeeping(served):
    """The engine thread remembers which accepted requests still owe their first token (the
    first-token hand-off, ``AsyncEngine._deliver_step``). A request that never produces one, because
    its step failed or it was aborted while it waited, is forgotten too; otherwise the set grows with
    every such request for the life of the server. A request served after them still gets its answer."""
    from infer.sampling import SamplingParams
    from infer.server.async_engine import RequestFailed

    eng, _, fault = served()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def go():
        fault.armed.set()
        failed = await eng.submit([5, 6, 7], params)
        with pytest.raises(RequestFailed):
            async for _ in failed:
                pass
        running = await eng.submit([5, 6, 7], params)  # batching "none": the next one waits behind it
        waiting = await eng.submit([8, 9, 10], params)
        await waiting.aclose()  # aborted before it ran
        outs = [o async for o in running]
        await wait_for(lambda: not eng.engine.has_unfinished_requests())
        return outs

    outs = asyncio.run(go())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert fault.raised == 1
    assert eng._awaiting_first == set()
