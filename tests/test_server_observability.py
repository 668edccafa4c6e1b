"""Phase 2: what the server tells its operator (``/metrics``) and whom it serves (``--api-key``).

Two ``python -m infer.server`` subprocesses on the tiny random-weight Llama (``tiny_llama``),
started together when the module begins: ``server`` without a key, ``keyed`` with the key in
``$INFER_API_KEY``. Both are driven over real HTTP (raw ``httpx``, and the official ``openai``
client for the key). A failing engine step needs a fault injected into the model runner, so that
test runs the app in-process (``tests/test_server_faults.py``'s ``Fault``).

Checked: every HTTP request is counted by route template and status, 4xx and 5xx included; a
request whose step failed counts as ``finished_reason="error"``; the per-request and per-step
histograms count what was sent; the process and garbage-collector series are there and no
``*_created`` one is; with a key, every route but ``/health`` and ``/metrics`` answers 401 in
OpenAI's error body without it, and ``/openapi.json`` declares the bearer scheme on exactly
those routes; a server listening beyond loopback without a key warns.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from infer.config import EngineConfig  # noqa: E402
from infer.engine import LLMEngine  # noqa: E402
from infer.server.__main__ import is_loopback, resolve_api_key, warn_if_exposed  # noqa: E402
from infer.server.app import build_app  # noqa: E402
from infer.server.async_engine import AsyncEngine  # noqa: E402
from tests.server_fixture import ServerProcess, metric_value, wait_until  # noqa: E402
from tests.test_server import assert_error, wait_idle  # noqa: E402
from tests.test_server_faults import Fault  # noqa: E402

KEY = "sk-test-0123456789"
MODEL = "tiny"
CMPL, CHATP = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
# every route that needs the key, with a request it answers 200
PROTECTED = [
    ("POST", CMPL, {"prompt": [5, 6, 7], "max_tokens": 2}),
    ("POST", CHATP, {"messages": MSG, "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/tokenize", {"prompt": "hello"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
    ("GET", "/tokenizer_info", None),
    ("POST", "/reset_prefix_cache", None),
]


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def _servers(request, tiny_llama, tmp_path_factory):
    """Start the servers this run uses now (they load in parallel); kill them at the end."""
    log_dir = tmp_path_factory.mktemp("observability-logs")
    args = ["--model", str(tiny_llama.path), "--served-model-name", MODEL, "--device", "cpu", "--batching",
            "continuous", "--kv-cache", "paged", "--block-size", "16", "--max-model-len", "256",
            "--log-level", "warning"]
    env = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    started: dict[str, ServerProcess] = {}
    try:
        if "server" in used:
            started["open"] = ServerProcess(log_dir, args, "open", env)
        if "keyed" in used:
            started["keyed"] = ServerProcess(log_dir, args, "keyed", {**env, "INFER_API_KEY": KEY})
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def server(_servers) -> ServerProcess:
    return _servers["open"].wait_ready()


@pytest.fixture(scope="module")
def keyed(_servers) -> ServerProcess:
    return _servers["keyed"].wait_ready()


def call(srv: ServerProcess, method: str, path: str, body=None, headers=None) -> httpx.Response:
    return httpx.request(method, f"{srv.url}{path}", json=body, headers=headers, timeout=60)


def http_count(text: str, handler: str, status: int, method: str = "POST") -> float:
    return metric_value(text, "http_requests_total", handler=handler, method=method, status=str(status))


# ---------------------------------------------------------------------------- HTTP requests counted


def test_every_response_is_counted_by_route_and_status(server):
    """A 200, a 400 (a bad field), a 404 (an unknown model; an unknown path) and a 413 each show in
    ``http_requests_total`` under the route's template, never the raw path."""
    before = server.metrics()
    assert call(server, "POST", CMPL, {"prompt": [5, 6], "max_tokens": 1}).status_code == 200
    assert_error(call(server, "POST", CMPL, {"prompt": [5, 6], "max_tokens": -1}), 400, "max_tokens")
    assert_error(call(server, "POST", CMPL, {"model": "gpt-9", "prompt": [5], "max_tokens": 1}), 404, "model")
    assert_error(call(server, "GET", "/v1/models/gpt-9"), 404, "model")
    assert_error(call(server, "GET", "/v1/no/such/path/12345"), 404)
    big = httpx.post(f"{server.url}{CMPL}", content=b"x" * (9 << 20), headers={"content-type": "application/json"},
                     timeout=60)
    assert_error(big, 413)
    want = [(CMPL, 200, "POST"), (CMPL, 400, "POST"), (CMPL, 404, "POST"), (CMPL, 413, "POST"),
            ("/v1/models/{model_id:path}", 404, "GET"), ("none", 404, "GET")]

    def counted():  # the middleware counts a response once it is sent: the client may have it first
        text = server.metrics()
        return text if all(http_count(text, h, s, m) == http_count(before, h, s, m) + 1 for h, s, m in want) else None

    text = wait_until(counted, 10, "every response to be counted")
    assert "12345" not in text and "gpt-9" not in text  # no raw path in a label
    assert 'handler="/metrics"' not in text and 'handler="/health"' not in text  # left out, as vLLM does


def test_failed_step_counts_as_error(tiny_llama, monkeypatch):
    """A request whose engine step fails ends with ``finish_reason="error"`` in
    ``infer:request_success_total``, streamed (200, then an error event) or not (a 500, also in
    ``http_requests_total``); a request served after it counts as usual."""
    cfg = EngineConfig(model=str(tiny_llama.path), device="cpu", dtype="float32", max_model_len=256,
                       batching="none", kv_cache="paged", block_size=16)
    eng = AsyncEngine(lambda: LLMEngine(cfg, loaded=tiny_llama, progress=False))
    fault = Fault(eng.engine.runner)
    monkeypatch.setattr(eng.engine.runner, "execute", fault)
    app = build_app(eng, MODEL)
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            fault.armed.set()
            failed = await c.post(CMPL, json=body)
            fault.armed.set()
            streamed = await c.post(CMPL, json={**body, "stream": True})
            ok = await c.post(CMPL, json=body)
            return failed, streamed, ok, (await c.get("/metrics")).text

    try:
        failed, streamed, ok, text = asyncio.run(go())
    finally:
        eng.shutdown()
    assert fault.raised == 2
    assert failed.status_code == 500 and streamed.status_code == 200 and ok.status_code == 200
    assert '"internal_error"' in streamed.text
    assert metric_value(text, "infer:request_success_total", finished_reason="error") == 2
    assert metric_value(text, "infer:request_success_total", finished_reason="length") == 1
    assert http_count(text, CMPL, 500) == 1 and http_count(text, CMPL, 200) == 2
    assert metric_value(text, "infer:request_prompt_tokens_count") == 3  # a failed request is a finished one


# ---------------------------------------------------------------------------- vLLM's families


def test_request_and_step_histograms_count_what_was_sent(server):
    """N requests of known prompts, ``max_tokens`` k each: ``request_prompt_tokens`` counts N whose sum
    is the prompt tokens sent, ``request_generation_tokens`` sums N * k, each phase histogram counts N,
    ``inter_token_latency`` N * (k - 1) gaps, and the steps ran every prompt token and each generated
    token but the last."""
    prompts, k = [[5, 6, 7], list(range(10, 30)), list(range(40, 47))], 5
    names = ["infer:request_prompt_tokens_count", "infer:request_prompt_tokens_sum",
             "infer:request_generation_tokens_count", "infer:request_generation_tokens_sum",
             "infer:inter_token_latency_seconds_count", "infer:iteration_tokens_total_sum",
             *(f"infer:request_{p}_time_seconds_count" for p in ("queue", "prefill", "decode", "inference")),
             "infer:e2e_request_latency_seconds_count", "infer:time_to_first_token_seconds_count"]
    before = wait_idle(server)
    sent = 0
    for p in prompts:
        r = call(server, "POST", CMPL, {"prompt": p, "max_tokens": k, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        sent += r.json()["usage"]["prompt_tokens"]
    assert sent == sum(map(len, prompts))
    text = wait_idle(server)
    got = {n: metric_value(text, n, model_name=MODEL) - metric_value(before, n, model_name=MODEL) for n in names}
    n = len(prompts)
    assert got.pop("infer:request_prompt_tokens_sum") == sent
    assert got.pop("infer:request_generation_tokens_sum") == n * k
    assert got.pop("infer:inter_token_latency_seconds_count") == n * (k - 1)
    assert got.pop("infer:iteration_tokens_total_sum") == sent + n * (k - 1)
    assert got == dict.fromkeys(got, n)
    assert metric_value(text, "infer:request_prompt_tokens_bucket", le="20.0") >= 3  # 1-2-5 buckets


def test_cache_config_info(server):
    text = server.metrics()
    line = next(x for x in text.splitlines() if x.startswith("infer:cache_config_info{"))
    assert line.endswith(" 1.0")
    for label in ('block_size="16"', 'kv_cache="paged"', 'enable_prefix_caching="False"', 'cache_dtype="float32"',
                  'num_gpu_blocks="'):
        assert label in line, line
    assert metric_value(text, "infer:cache_config_info", block_size="16") == 1


def test_process_series_and_no_created_series(server):
    text = server.metrics()
    samples = [line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")]
    assert any(s.startswith("process_") for s in samples), "no process_* series"
    assert "process_resident_memory_bytes" in samples and "process_cpu_seconds_total" in samples
    assert any(s.startswith("python_gc_") for s in samples), "no python_gc_* series"
    assert "python_info" in samples
    assert not [line for line in text.splitlines() if "_created" in line]


def test_engine_timestamps_and_step_histograms(tiny_llama):
    """The engine alone: a request's output carries ``arrival <= first_scheduled <= first_token <=
    finished``; the steps ran its prompt and each generated token but the last; k tokens make
    k - 1 gaps."""
    from infer.sampling import SamplingParams

    cfg = EngineConfig(model=str(tiny_llama.path), device="cpu", dtype="float32", max_model_len=128)
    eng = LLMEngine(cfg, loaded=tiny_llama, progress=False)
    eng.add_request(list(range(10, 21)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    t = outs[-1].metrics
    assert t["arrival"] <= t["first_scheduled"] <= t["first_token"] <= t["finished"]
    assert eng.scheduler.iteration_tokens.sum == 11 + 5 and sum(eng.scheduler.iteration_tokens.counts) == 6
    assert sum(eng.output_processor.inter_token_latency.counts) == 5


def test_token_gaps_are_counted_per_distinct_previous_time():
    """``_record_token_gaps``: one shared previous time (the usual step) and several (a request that
    skipped steps) give the same histogram as counting each gap alone."""
    from types import SimpleNamespace

    from infer.engine.output_processor import OutputProcessor

    op = OutputProcessor(SimpleNamespace(vocab_size=10), [0], 64)
    last = 9.98
    op._record_token_gaps(10.0, [last] * 3)
    op._record_token_gaps(11.0, [10.0, 10.0, 9.0])  # the last one skipped a step
    h = op.inter_token_latency
    le = dict(zip(h.bounds, h.counts))
    assert le[0.025] == 3 and le[1.0] == 2 and le[2.5] == 1 and sum(h.counts) == 6
    assert h.sum == pytest.approx(3 * 0.02 + 2 * 1.0 + 2.0)
    assert h.cumulative()[-1] == ("+Inf", 6)


# ---------------------------------------------------------------------------- --api-key


def test_without_a_key_everything_is_open(server):
    """A server without a key serves every route with or without a header (the ``openai`` client
    always sends one), and its schema declares no security."""
    for method, path, body in PROTECTED:
        for headers in (None, {"Authorization": "Bearer anything"}):
            r = call(server, method, path, body, headers)
            assert r.status_code == 200, (path, r.text)
    schema = call(server, "GET", "/openapi.json").json()
    assert "securitySchemes" not in schema.get("components", {})
    assert not any("security" in op for item in schema["paths"].values() for op in item.values())


def test_key_is_required_on_every_api_route(keyed):
    """No header, a wrong key or another scheme: 401 in OpenAI's body (``invalid_api_key``, with
    ``WWW-Authenticate: Bearer``), counted in ``http_requests_total``; the key: 200. ``/health`` and
    ``/metrics`` answer without it."""
    for method, path, body in PROTECTED:
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                        {"Authorization": f"Basic {KEY}"}, {"Authorization": KEY}):
            r = call(keyed, method, path, body, headers)
            err = assert_error(r, 401)
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error", err
            assert r.headers["www-authenticate"] == "Bearer"
        r = call(keyed, method, path, body, {"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, (path, r.text)
    assert call(keyed, "GET", "/health").status_code == 200
    assert call(keyed, "GET", "/metrics").status_code == 200
    wait_until(lambda: http_count(keyed.metrics(), CMPL, 401) >= 5, 10, "the 401s to be counted")


def test_openai_client_with_the_key(keyed):
    good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in good.models.list().data] == [MODEL]
    assert good.completions.create(model=MODEL, prompt="hello", max_tokens=2).usage.completion_tokens == 2
    chat = good.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    assert chat.choices[0].finish_reason in ("stop", "length")
    bad = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt="hello", max_tokens=2)
    assert e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        list(bad.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, stream=True))


def test_schema_declares_the_bearer_scheme_on_protected_routes_only(server, keyed):
    """With a key, ``/openapi.json`` declares HTTP bearer on every protected operation; removing
    that declaration leaves the schema of the server without a key, unchanged."""
    plain = call(server, "GET", "/openapi.json").json()
    schema = call(keyed, "GET", "/openapi.json", headers=None).json()
    assert schema["components"].pop("securitySchemes") == {
        "HTTPBearer": {"type": "http", "scheme": "bearer", "description": "The server's API key (`--api-key`)"}}
    secured = []
    for path, item in schema["paths"].items():
        for op in item.values():
            if op.pop("security", None) == [{"HTTPBearer": []}]:
                secured.append(path)
    assert sorted(secured) == sorted({"/v1/models/{model_id}" if "/v1/models/" in p else p
                                      for _, p, _ in PROTECTED})
    assert schema == plain


def test_api_key_comes_from_the_flag_then_the_environment():
    assert resolve_api_key("a", {"INFER_API_KEY": "b", "VLLM_API_KEY": "c"}) == "a"
    assert resolve_api_key(None, {"INFER_API_KEY": "b", "VLLM_API_KEY": "c"}) == "b"
    assert resolve_api_key(None, {"VLLM_API_KEY": "c"}) == "c"
    assert resolve_api_key(None, {"INFER_API_KEY": ""}) is None
    assert resolve_api_key("", {}) is None


def test_warns_when_listening_beyond_loopback_without_a_key(caplog):
    log = logging.getLogger("infer.server")
    with caplog.at_level(logging.WARNING, logger="infer.server"):
        assert warn_if_exposed("0.0.0.0", None, log)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "0.0.0.0" in caplog.records[0].getMessage() and "--api-key" in caplog.records[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infer.server"):
        assert not warn_if_exposed("0.0.0.0", KEY, log)
        for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
            assert is_loopback(host) and not warn_if_exposed(host, None, log)
        for host in ("::", "192.168.1.5", "example.com"):
            assert not is_loopback(host) and warn_if_exposed(host, None, log)
    assert len(caplog.records) == 3
