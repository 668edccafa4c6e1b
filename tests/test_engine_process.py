"""The engine in a process of its own (``python -m infer.server --engine-process``,
:class:`infer.server.engine_core.EngineProcess`): the same answers as the engine on a thread, the same
behaviour on disconnects, bad input, failed steps and a dead engine, and no engine process left behind.

One engine process serves most tests (module scope: a spawned process imports torch and builds the
engine, ~3 s); the tests that break an engine start their own."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import operator
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from infer.config import EngineConfig
from infer.engine import LLMEngine
from infer.errors import InvalidRequestError
from infer.server.app import build_app
from infer.server.async_engine import AsyncEngine, EngineDead
from infer.server.engine_core import EngineProcess
from tests.server_fixture import ServerProcess, metric_value, wait_until


def _config(path) -> EngineConfig:
    return EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=256, batching="continuous",
                        kv_cache="paged", block_size=16, prefix_caching=True)


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """``(engine process, engine thread)``: the same configuration both ways."""
    proc = EngineProcess(_config(tiny_llama.path))
    thread = AsyncEngine(lambda: LLMEngine(_config(tiny_llama.path), loaded=tiny_llama, progress=False))
    yield proc, thread
    proc.shutdown()
    thread.shutdown()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60)


def sse(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def _assert_same(got, want, where="answer") -> None:
    """Equal JSON, floats (logprobs) within float32 rounding: the two engines may split their matmuls over
    different thread counts (the engine process starts with torch's default, this one with the test run's)."""
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-5), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def _strip(body: dict) -> dict:
    """A completion without what differs between two servers (ids, timestamps)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


BODIES = [
    {"prompt": [5, 17, 99, 3, 42], "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    {"prompt": "The capital of", "max_tokens": 9, "temperature": 0, "ignore_eos": True, "logprobs": 2},
    {"prompt": [7, 7, 8], "max_tokens": 6, "temperature": 0.8, "seed": 3, "n": 2, "ignore_eos": True},
    {"prompt": [1, 2, 3, 4], "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True},
]


async def _answers(app) -> list:
    async with client(app) as c:  # one at a time: the same batches (the same float sums) both ways
        rs = [await c.post("/v1/completions", json=b) for b in BODIES]
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [[_strip(e) for e in sse(r.text)] if b.get("stream") else _strip(r.json()) for b, r in zip(BODIES, rs)]


def test_engine_process_answers_as_the_engine_thread(engines):
    """Greedy, sampled (seeded, n=2), logprob and streamed completions: the engine process's answers equal
    the engine thread's, field by field (the tokens exactly, the logprobs to float32 rounding)."""
    proc, thread = engines
    assert proc.engine is None and proc.process.pid != os.getpid()
    assert proc.info.max_model_len == thread.info.max_model_len == 256
    assert proc.info.cache_config == thread.info.cache_config
    got, want = asyncio.run(_answers(build_app(proc, "tiny"))), asyncio.run(_answers(build_app(thread, "tiny")))
    _assert_same(got, want)
    assert len(got[3]) >= 10 and got[0]["usage"]["completion_tokens"] == 12


def _refuse(eng) -> None:
    """Run in the engine process: raise an error the server answers 400 to."""
    raise InvalidRequestError("refused in the engine process", param="prompt")


def _unsendable_result(eng):
    """Run in the engine process: a result pickle cannot carry."""
    return lambda: eng


def test_bad_requests_and_calls_leave_the_engine_process_serving(engines):
    """A prompt outside the vocabulary is a 400 (refused in the server's process); a call the pipe cannot
    carry (a lambda) raises TypeError, one that raises in the engine process raises the same error here, one
    whose result the pipe cannot carry raises TypeError; the engine serves the next request."""
    proc, _ = engines
    app = build_app(proc, "tiny")

    async def go():
        async with client(app) as c:
            bad = await c.post("/v1/completions", json={"prompt": [10 ** 6], "max_tokens": 2})
            with pytest.raises(TypeError, match="cannot send 'call'"):
                await proc.call(lambda eng: eng.num_running)
            with pytest.raises(InvalidRequestError, match="refused in the engine process") as refused:
                await proc.call(_refuse)
            assert refused.value.param == "prompt"
            with pytest.raises(TypeError, match="cannot be sent back"):
                await proc.call(_unsendable_result)
            good = await c.post("/v1/completions", json=BODIES[0])
            return bad, good

    bad, good = asyncio.run(go())
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 12
    assert proc.alive


def test_abort_in_the_engine_process_and_metrics_come_from_it(engines):
    """A stream closed after its first output (a client that went away) aborts the request in the engine
    process: its final output says ``abort`` and is counted, running falls back to 0; /metrics reads the
    scheduler's and output processor's statistics from the engine process (steps, prefix-cache queries),
    and /reset_prefix_cache reaches its cache."""
    from infer.sampling import SamplingParams

    proc, _ = engines
    app = build_app(proc, "tiny")
    finished = []
    record = proc.on_finished
    proc.on_finished = lambda out: (finished.append(out), record(out))

    async def go():
        stream = await proc.submit([3, 4, 5, 6], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        first = await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if finished:
                break
            await asyncio.sleep(0.02)
        async with client(app) as c:
            await c.post("/v1/completions", json=BODIES[0])
            return first, (await c.get("/metrics")).text, (await c.post("/reset_prefix_cache")).json()

    try:
        first, text, reset = asyncio.run(go())
    finally:
        proc.on_finished = record
    assert not first.finished and finished[0].request_id == first.request_id
    assert finished[0].outputs[0].finish_reason == "abort" and proc.num_running == 0
    assert metric_value(text, "infer:request_success_total", finished_reason="abort") == 1
    assert metric_value(text, "infer:iteration_tokens_total_count") > 0
    assert metric_value(text, "infer:prefix_cache_queries_total") > 0
    assert reset["prefix_caching"] is True and reset["num_blocks_dropped"] >= 1


def _failing_step(eng) -> None:
    """Run in the engine process: its next forward raises (once)."""
    execute = eng.runner.execute

    def fail(*args, **kwargs):
        eng.runner.execute = execute
        raise RuntimeError("injected fault")

    eng.runner.execute = fail


def test_failed_step_and_dead_engine_process(tiny_llama):
    """A step that raises fails its request with a 500 and the engine process serves on; when the engine
    process dies (SIGKILL) an open stream ends with EngineDead (the routes' 503 / error event), /health says
    503, a new request gets 503, and shutdown returns at once."""
    from infer.sampling import SamplingParams

    proc = EngineProcess(_config(tiny_llama.path))
    app = build_app(proc, "tiny")
    try:
        async def go():
            async with client(app) as c:
                await proc.call(_failing_step)
                failed = await c.post("/v1/completions", json=BODIES[0])
                served = await c.post("/v1/completions", json=BODIES[0])
                stream = await proc.submit([3, 4, 5], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
                await stream.__anext__()
                os.kill(proc.process.pid, signal.SIGKILL)
                with pytest.raises(EngineDead, match="engine process exited"):
                    async for _ in stream:
                        pass
                for _ in range(200):
                    if not proc.alive:
                        break
                    await asyncio.sleep(0.02)
                return failed, served, await c.get("/health"), await c.post("/v1/completions", json=BODIES[0])

        failed, served, health, after = asyncio.run(go())
    finally:
        start = time.monotonic()
        proc.shutdown()
        stopped = time.monotonic() - start
    assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
    assert served.status_code == 200
    assert health.status_code == 503 and after.status_code == 503
    assert stopped < 5 and not proc.process.is_alive()
    with pytest.raises(EngineDead):
        proc.call_blocking(operator.methodcaller("reset_prefix_cache"))


def test_cli_engine_process_with_the_openai_client(tiny_llama, tmp_path):
    """``python -m infer.server --engine-process``: the official ``openai`` client gets the tokens the offline
    engine makes; SIGTERM ends the server and its engine process; ``--live-page`` is refused with the reason, and
    a model the engine process cannot load exits with its error (status 2)."""
    openai = pytest.importorskip("openai")  # (in the dev extras; a GPU image may lack it)

    server = ServerProcess(tmp_path, ["--model", str(tiny_llama.path), "--device", "cpu", "--dtype", "float32",
                                      "--max-model-len", "256", "--engine-process"],
                           name="engine-process").wait_ready()
    try:
        children = psutil.Process(server.proc.pid).children(recursive=True)
        assert children, "no engine process"
        out = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none").completions.create(
            model=str(tiny_llama.path), prompt=[5, 17, 99, 3, 42], max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True})
        assert "in a process of its own" in server.stderr()
    finally:
        server.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        server.stop()
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in children), 10,
               "the engine process to exit")
    eng = LLMEngine(EngineConfig(model=str(tiny_llama.path), device="cpu", dtype="float32", max_model_len=256),
                    loaded=tiny_llama, progress=False)
    from infer.sampling import SamplingParams

    eng.add_request([5, 17, 99, 3, 42], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), request_id="r")
    final = None
    while eng.has_unfinished_requests():
        final = [o for o in eng.step(stream=False) if o.finished] or final
    assert out.choices[0].text == final[0].outputs[0].text

    refused = ServerProcess(tmp_path, ["--model", str(tiny_llama.path), "--engine-process", "--live-page"],
                            name="live-refused")
    missing = ServerProcess(tmp_path, ["--model", str(tmp_path / "no-such-model"), "--engine-process"],
                            name="missing")  # the engine process's ModelLoadError, raised in the server's
    try:
        assert refused.proc.wait(60) == 2
        assert "live page" in refused.stderr() and "--engine-process" in refused.stderr()
        assert missing.proc.wait(60) == 2 and "no-such-model: no such file" in missing.stderr()
    finally:
        refused.stop()
        missing.stop()


@pytest.mark.parametrize("busy_poll_s", [0.0, 0.4])
def test_idle_engine_process_busy_polls_then_sleeps(busy_poll_s):
    """``wait_for_command`` returns as soon as a command is in the pipe; until ``busy_poll_s`` after the last
    step it polls the pipe on the CPU (its thread's CPU time grows with the wait), after that, or with 0, it
    sleeps (almost no CPU time)."""
    from infer.server.engine_core import _EngineLoop

    here, there = multiprocessing.Pipe(duplex=True)
    loop = _EngineLoop(None, here, 3, busy_poll_s)
    sender = threading.Timer(0.15, there.send, args=(("abort", None, "r"),))
    start, cpu = time.perf_counter(), time.thread_time()
    sender.start()
    loop.wait_for_command(start)
    waited, used = time.perf_counter() - start, time.thread_time() - cpu
    assert here.recv() == ("abort", None, "r") and 0.1 < waited < 2
    if busy_poll_s:
        assert used > 0.25 * waited, (used, waited)  # on the CPU all along (a busy 2-core machine shares it)
    else:
        assert used < 0.05, (used, waited)  # asleep in the kernel
    sender = threading.Timer(0.15, there.send, args=(("abort", None, "s"),))
    cpu = time.thread_time()
    sender.start()
    loop.wait_for_command(time.perf_counter() - 1.0)  # the window ended long ago: asleep at once
    assert here.recv() == ("abort", None, "s") and time.thread_time() - cpu < 0.05
    sender.join()


def test_event_loop_polls_after_the_last_output_then_sleeps(engines):
    """With ``loop_busy_poll_s`` (the server's ``--busy-poll-ms``), the event loop that read a request's last
    output keeps polling (its thread on the CPU while it has nothing to do) until that long after it, then
    sleeps in the kernel; with 0 (the engine process's default here) it sleeps at once. The request's
    tokens are the same either way."""
    from infer.sampling import SamplingParams

    proc, _ = engines

    async def go():
        stream = await proc.submit([3, 4, 5, 6], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        tokens = [out async for out in stream][-1].outputs[0].token_ids
        polling = proc._poller is not None
        cpu = time.thread_time()
        await asyncio.sleep(0.2)  # inside the window
        used_in = time.thread_time() - cpu
        await asyncio.sleep(max(0.0, proc.loop_busy_poll_s - 0.2) + 0.05)
        cpu = time.thread_time()
        await asyncio.sleep(0.2)  # past it
        return tokens, polling, used_in, time.thread_time() - cpu, proc._poller

    try:
        proc.loop_busy_poll_s = 0.4
        tokens, polling, used_in, used_after, poller = asyncio.run(go())
        assert polling and used_in > 0.25 * 0.2, used_in  # on the CPU (a busy 2-core machine shares it)
        assert used_after < 0.05 and poller is None, used_after  # asleep
        proc.loop_busy_poll_s = 0.0
        tokens_0, polling, used_in, _, _ = asyncio.run(go())
        assert not polling and used_in < 0.05, used_in
        assert tokens == tokens_0 and len(tokens) == 4
    finally:
        proc.loop_busy_poll_s = 0.0


def test_engine_placement_defaults():
    """``--engine-process`` and ``--busy-poll-ms`` as given; else the engine process with ``--optimize`` on one
    GPU (not with the live page or several ranks), busy polling 50 ms on a GPU and none on the CPU; a negative
    value refused."""
    from infer.server.__main__ import engine_placement

    assert engine_placement(None, None, True, True, False) == (True, 50.0)
    assert engine_placement(None, None, True, True, True) == (False, 50.0)  # the live page reads the engine here
    assert engine_placement(None, None, False, True, False) == (False, 50.0)
    assert engine_placement(None, None, True, False, False) == (False, 0.0)  # the CPU: the thread, no polling
    assert engine_placement(None, None, True, True, False, parallel=True) == (False, 50.0)  # several ranks: asked for
    assert engine_placement(True, None, True, True, False, parallel=True) == (True, 50.0)
    assert engine_placement(True, 5.0, False, False, False) == (True, 5.0)
    assert engine_placement(False, 0.0, True, True, False) == (False, 0.0)
    with pytest.raises(ValueError, match="--busy-poll-ms must be >= 0"):
        engine_placement(True, -1.0, True, True, False)
