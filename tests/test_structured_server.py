"""Phase 13 through the OpenAI-compatible server: response_format, structured_outputs (and the
guided_* aliases), tool calls, streamed and not, with the official ``openai`` client; the 400s.

Every JSON answer is validated with ``jsonschema`` against the schema the request sent (or the
Pydantic model's own validation, for ``parse``); tool calls round-trip through the client's types.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("outlines_core")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
import httpx  # noqa: E402
import jsonschema  # noqa: E402

from infer.server.tools import parse_tool_calls  # noqa: E402
from tests.server_fixture import ServerProcess  # noqa: E402

MODEL = "smollm2-135m"
CHATP, CMPL = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "What's the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
                                       "required": ["tz"]}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    srv = ServerProcess(tmp_path_factory.mktemp("structured-server"),
                        ["--model", MODEL, "--max-model-len", "512", "--device", "cpu", "--log-level", "warning"],
                        "structured", env)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=15)
    country: str = pydantic.Field(max_length=15)
    population_millions: int = pydantic.Field(ge=0, le=50)


def test_openai_parse_with_a_pydantic_model(client):
    done = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
                                         response_format=City, max_tokens=80, temperature=0)
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, City)  # the client parsed and validated it
    jsonschema.validate(json.loads(msg.content), City.model_json_schema())


@pytest.mark.parametrize("body,check", [
    ({"response_format": {"type": "json_object"}, "temperature": 0, "n": 1, "max_tokens": 100,
      "prompt": "Give a JSON object describing a cat:"},
     lambda t: isinstance(json.loads(t), dict)),
    ({"structured_outputs": {"regex": "[A-Z][a-z]{2,8}"}}, lambda t: re.fullmatch("[A-Z][a-z]{2,8}", t)),
    ({"guided_choice": ["red", "blue"]}, lambda t: t in ("red", "blue")),
    ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}},
                      "required": ["n"]}},
     lambda t: jsonschema.validate(json.loads(t), {"type": "object", "properties": {
         "n": {"type": "integer", "minimum": 1, "maximum": 5}}, "required": ["n"]}) is None),
])
def test_completions_constraints(server, body, check):
    r = httpx.post(f"{server.url}{CMPL}", json={"prompt": "Answer:", "max_tokens": 30, "temperature": 0.8,
                                                "seed": 3, "n": 2, **body}, timeout=120)
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop"
        assert check(c["text"]), c["text"]


def test_chat_json_schema_streamed(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], stream=True, max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), schema)


def test_top_logprobs_of_tokens_a_constraint_excludes_are_json_numbers(client, server):
    """A constraint that leaves fewer tokens than ``top_logprobs`` asks for: the rest of the list has
    probability 0 (logprob -inf, which JSON cannot carry). They come back as OpenAI's -9999.0, streamed
    and not (the same entries both ways), in chat and in legacy completions."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=5, temperature=0,
              logprobs=True, top_logprobs=8, extra_body={"guided_choice": ["no"]})
    done = client.chat.completions.create(**kw)
    entries, text = done.choices[0].logprobs.content, done.choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert text == "no" == "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    assert entries and all(len(e.top_logprobs) == 8 for e in entries)
    excluded = [t.logprob for e in entries for t in e.top_logprobs if t.logprob == -9999.0]
    assert excluded, "the constraint left 8 or more tokens at every step: the test checks nothing"
    for e in entries:  # the chosen token is allowed: a real logprob, listed first among the alternatives
        assert -9999.0 < e.logprob <= 0.0 and e.top_logprobs[0].token == e.token
        assert all(t.logprob == -9999.0 or -9999.0 < t.logprob <= 0.0 for t in e.top_logprobs)
    legacy = httpx.post(f"{server.url}{CMPL}", json={"prompt": "Is water wet?", "max_tokens": 5, "temperature": 0,
                                                     "logprobs": 8, "guided_choice": ["no"]}, timeout=120)
    assert legacy.status_code == 200, legacy.text
    assert -9999.0 in legacy.json()["choices"][0]["logprobs"]["top_logprobs"][-1].values()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_round_trip(client, stream, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    kw = dict(model=MODEL, messages=MSG, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=80,
              temperature=0.7, seed=1)
    if not stream:
        choice0 = client.chat.completions.create(**kw).choices[0]
        calls, reason = choice0.message.tool_calls, choice0.finish_reason
    else:
        with client.chat.completions.stream(**kw) as s:  # the client's own accumulation of the deltas
            final = s.get_final_completion()
        calls, reason = final.choices[0].message.tool_calls, final.choices[0].finish_reason
    assert reason == "tool_calls"
    assert calls and all(c.type == "function" and c.id for c in calls)
    specs = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for c in calls:
        if choice == "named":
            assert c.function.name == "get_weather"
        jsonschema.validate(json.loads(c.function.arguments), specs[c.function.name])
    # the calls go back into the conversation as the client sent them
    follow = client.chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0,
        messages=[*MSG, {"role": "assistant", "tool_calls": [c.model_dump() for c in calls]},
                  {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C"}])
    assert follow.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_none_and_auto_answer_in_text(server):
    for tc in ("none", "auto"):
        r = httpx.post(f"{server.url}{CHATP}", json={"messages": MSG, "tools": [WEATHER], "tool_choice": tc,
                                                     "max_tokens": 8, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        content, calls = parse_tool_calls(msg["content"] or "")
        assert not msg.get("tool_calls") and not calls  # the tiny model makes no call here


# Hermes-style outputs as Qwen3 (one object per block) and SmolLM2 (a list per block) write them
@pytest.mark.parametrize("text,names,content", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     ["get_weather"], None),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     ["get_weather", "get_time"], "Let me check."),
    ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
     '"arguments": {"tz": "UTC"}}]</tool_call>', ["get_weather", "get_time"], None),
    ('<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call>', [], "<tool_call>"),
    ('<tool_call>{"name": broken</tool_call>', [], "<tool_call>"),
])
def test_parse_hermes_tool_calls(text, names, content):
    got_content, calls = parse_tool_calls(text, {"get_weather", "get_time"})
    assert [c["function"]["name"] for c in calls] == names
    if names:
        assert got_content == content
        for c in calls:
            assert isinstance(json.loads(c["function"]["arguments"]), dict)
    else:
        assert got_content == text and content in text


def test_chat_template_renders_tools_for_auto():
    """Qwen3's template (a tools-aware one) gets the tools; the parser reads its call format back."""
    from infer.chat import render_chat_template
    from tests.test_chat_template import QWEN3_TEMPLATE

    text = render_chat_template(QWEN3_TEMPLATE, MSG, add_generation_prompt=True, tools=[WEATHER])
    assert "get_weather" in text and "<tool_call>" in text


@pytest.mark.parametrize("path,body,param", [
    (CHATP, {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    (CHATP, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (CHATP, {"response_format": {"type": "yaml"}}, "response_format"),
    (CMPL, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "number", "maximum": 3}}}}, "response_format"),
    (CMPL, {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    (CMPL, {"guided_regex": "(?<=a)b"}, "guided_regex"),
    (CMPL, {"guided_choice": []}, "guided_choice"),
    (CMPL, {"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    (CMPL, {"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    (CHATP, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    (CHATP, {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    (CHATP, {"tool_choice": "required"}, "tool_choice"),
    (CHATP, {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    (CHATP, {"tools": [WEATHER, WEATHER]}, "tools"),
])
def test_malformed_constraints_are_openai_400s(server, path, body, param):
    base = {"messages": MSG} if path == CHATP else {"prompt": "x"}
    r = httpx.post(f"{server.url}{path}", json={**base, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    # the server still serves
    ok = httpx.post(f"{server.url}{CMPL}", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
