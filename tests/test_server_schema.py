"""``/openapi.json`` says what the server enforces (issue #48).

A request the schema allows is served (2xx); one it refuses is answered 4xx. schemathesis checks
this at random (``test_server.py::test_schemathesis_fuzz``); these tests pin the cases it once
found and the rules the schema states:

* the sampling ranges of the schema are :class:`~infer.sampling.SamplingParams`' own (its
  constants; each bound accepted, the next float refused);
* ``top_logprobs: 0`` without ``logprobs`` is served, as the schema (and OpenAI) allow;
  ``guided_choice: []`` is refused by the schema (``minItems: 1``) and by the server;
* extreme sampling values (``temperature: 4.99e307``, ``1e39``, ``repetition_penalty: 1e-50``)
  are refused by both with a 400 naming the field and its range, never a 500, with or without
  an output constraint;
* a table of requests, each judged by the schema (``jsonschema``) and by the server: they agree;
* after all of them the server gives the greedy answer it gave before.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("fastapi")
jsonschema = pytest.importorskip("jsonschema")
import httpx  # noqa: E402

from infer.sampling import SamplingParams  # noqa: E402
from infer.sampling.params import (  # noqa: E402
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
)
from tests.server_fixture import ServerProcess  # noqa: E402

MODEL = "smollm2-135m"
MAX_MODEL_LEN = 1024
VOCAB = 49152  # SmolLM2's
CMPL, CHATP = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("schema-server"),
                        ["--model", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu",
                         "--log-level", "warning"], "schema", {"OMP_NUM_THREADS": str(torch.get_num_threads())})
    try:
        srv.wait_ready()
        srv.baseline = greedy_text(srv)  # recorded before any other request: the last test compares
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    r = httpx.get(f"{server.url}/openapi.json", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def greedy_text(srv: ServerProcess) -> str:
    r = httpx.post(f"{srv.url}{CMPL}", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def body_validator(openapi: dict, path: str) -> jsonschema.protocols.Validator:
    """A JSON Schema validator of ``path``'s request body, as ``/openapi.json`` states it."""
    ref = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**ref, "components": openapi["components"]})


def schema_allows(openapi: dict, path: str, body: dict) -> bool:
    return body_validator(openapi, path).is_valid(body)


def post(server, path: str, body: dict) -> httpx.Response:
    base = {"messages": MSG} if path == CHATP else {"prompt": "hi"}
    return httpx.post(f"{server.url}{path}", json={**base, "max_tokens": 2, **body}, timeout=120)


def field_schema(openapi: dict, request: str, field: str) -> dict:
    """The (non-null) schema of ``field`` in request model ``request``."""
    prop = openapi["components"]["schemas"][request]["properties"][field]
    alternatives = [s for s in prop.get("anyOf", [prop]) if s.get("type") != "null"]
    assert len(alternatives) == 1, prop
    return alternatives[0]


# ---------------------------------------------------------------------------- ranges


RANGES = [  # field, schema bounds (JSON Schema keywords), the requests that carry it
    ("temperature", {"minimum": 0.0, "maximum": MAX_TEMPERATURE}, ("CompletionRequest", "ChatCompletionRequest")),
    ("repetition_penalty", {"minimum": MIN_REPETITION_PENALTY, "maximum": MAX_REPETITION_PENALTY},
     ("CompletionRequest", "ChatCompletionRequest")),
    ("top_p", {"exclusiveMinimum": 0.0, "maximum": 1.0}, ("CompletionRequest", "ChatCompletionRequest")),
    ("min_p", {"minimum": 0.0, "maximum": 1.0}, ("CompletionRequest", "ChatCompletionRequest")),
    ("presence_penalty", {"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
     ("CompletionRequest", "ChatCompletionRequest")),
    ("frequency_penalty", {"minimum": -MAX_PENALTY, "maximum": MAX_PENALTY},
     ("CompletionRequest", "ChatCompletionRequest")),
    ("logprobs", {"minimum": 0, "maximum": MAX_LOGPROBS}, ("CompletionRequest",)),
    ("top_logprobs", {"minimum": 0, "maximum": MAX_LOGPROBS}, ("ChatCompletionRequest",)),
]


@pytest.mark.parametrize("field,bounds,requests", RANGES, ids=[r[0] for r in RANGES])
def test_schema_ranges_are_sampling_params_ranges(openapi, field, bounds, requests):
    """The schema's bounds are SamplingParams' constants, and SamplingParams takes each bound and
    refuses the float just past it (``top_logprobs`` is chat's name for ``logprobs``)."""
    for request in requests:
        schema = field_schema(openapi, request, field)
        assert {k: schema.get(k) for k in bounds} == bounds, (request, schema)
        assert not {"minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"} - set(bounds) & set(schema), schema
    name = "logprobs" if field == "top_logprobs" else field
    low_key = "minimum" if "minimum" in bounds else "exclusiveMinimum"
    low, high = bounds[low_key], bounds["maximum"]
    integral = name == "logprobs"
    step_down = (lambda x: x - 1) if integral else (lambda x: math.nextafter(x, -math.inf))
    step_up = (lambda x: x + 1) if integral else (lambda x: math.nextafter(x, math.inf))
    SamplingParams(**{name: high})
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: step_up(high)})
    if low_key == "minimum":
        SamplingParams(**{name: low})
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: step_down(low)})
    else:
        SamplingParams(**{name: step_up(low)})
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: low})


# ---------------------------------------------------------------------------- what schemathesis found (ST202)


def test_top_logprobs_0_without_logprobs_is_served(server, openapi):
    """Allowed by the schema, so served (OpenAI accepts it too): no logprobs are returned."""
    body = {"logprobs": False, "top_logprobs": 0}
    assert schema_allows(openapi, CHATP, {"messages": MSG, **body})
    r = post(server, CHATP, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None
    r = post(server, CHATP, {"top_logprobs": 0})
    assert r.status_code == 200, r.text
    # more than 0 still needs logprobs: refused by both
    assert not schema_allows(openapi, CHATP, {"messages": MSG, "top_logprobs": 2})
    assert post(server, CHATP, {"top_logprobs": 2}).json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize("path", [CMPL, CHATP])
def test_empty_guided_choice_is_refused_by_the_schema(server, openapi, path):
    base = {"messages": MSG} if path == CHATP else {"prompt": "hi"}
    errors = list(body_validator(openapi, path).iter_errors({**base, "guided_choice": []}))
    assert errors and any(e.validator == "minItems" for err in errors for e in [err, *(err.context or [])]), errors
    r = post(server, path, {"guided_choice": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice", r.text


# ---------------------------------------------------------------------------- extreme sampling values

EXTREMES = [("temperature", 4.99e307, "[0, 100]"), ("temperature", 1e39, "[0, 100]"),
            ("repetition_penalty", 1e-50, "[0.01, 100]")]
CONSTRAINTS = {"none": {}, "guided_choice": {"guided_choice": ["yes", "no"]},
               "json_object": {"response_format": {"type": "json_object"}},
               "tool_choice_required": {"tools": TOOLS, "tool_choice": "required"}}  # (tools: chat only)
WITH_CONSTRAINT = [(path, c) for path in (CMPL, CHATP) for c in CONSTRAINTS
                   if not (path == CMPL and c == "tool_choice_required")]


@pytest.mark.parametrize("path,constraint", WITH_CONSTRAINT, ids=[f"{p[4:]}-{c}" for p, c in WITH_CONSTRAINT])
@pytest.mark.parametrize("field,value,range_text", EXTREMES, ids=[f"{f}={v:g}" for f, v, _ in EXTREMES])
def test_extreme_sampling_values_are_400s(server, openapi, path, constraint, field, value, range_text):
    """Refused by the schema and by the server (a 400 naming the field and its range, never a 500),
    with or without an output constraint; the same request inside the range is served."""
    body = {field: value, **CONSTRAINTS[constraint]}
    base = {"messages": MSG} if path == CHATP else {"prompt": "hi"}
    assert not schema_allows(openapi, path, {**base, **body})
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and range_text in err["message"], err
    assert schema_allows(openapi, path, {**base, **body, field: 1.0})
    r = post(server, path, {**body, field: 1.0})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------------------- the schema and the server agree

AGREEMENT = [  # id, path, body (added to a minimal valid one), served (2xx) or the 4xx status, its param
    ("minimal", CMPL, {}, 200, None),
    ("minimal-chat", CHATP, {}, 200, None),
    ("model-served", CMPL, {"model": MODEL}, 200, None),
    ("model-other", CMPL, {"model": "gpt-4"}, 404, "model"),
    ("model-other-tokenize", "/tokenize", {"model": "gpt-4"}, 404, "model"),
    ("prompt-without-a-token", CMPL, {"prompt": "\u0006\u0014"}, 400, "prompt"),
    ("prompt-with-a-token", CMPL, {"prompt": "\u0006a"}, 200, None),
    ("prompt-list-without-a-token", CMPL, {"prompt": ["ok", "\u0004"]}, 400, "prompt"),
    ("stop_token_ids-in-vocab", CMPL, {"stop_token_ids": [VOCAB - 1], "min_tokens": 1}, 200, None),
    ("stop_token_ids-past-vocab", CMPL, {"stop_token_ids": [VOCAB]}, 400, "stop_token_ids"),
    ("stop_token_ids-huge-min_tokens", CMPL, {"stop_token_ids": [2 ** 81], "min_tokens": 1}, 400, "stop_token_ids"),
    ("stream_options-without-stream", CMPL, {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("stream_options-null", CMPL, {"stream_options": None}, 200, None),
    ("continuous-without-include_usage", CMPL,
     {"stream": True, "stream_options": {"continuous_usage_stats": True}}, 400, "stream_options"),
    ("max_tokens-0", CMPL, {"max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens-0-echo", CMPL, {"max_tokens": 0, "echo": True}, 200, None),
    ("two-constraints", CMPL, {"guided_choice": ["a"], "guided_regex": "a"}, 400, "guided_choice"),
    ("constraint-and-text-format", CMPL, {"guided_regex": "a", "response_format": {"type": "text"}}, 200, None),
    ("constraint-and-null", CMPL, {"guided_regex": "a", "guided_json": None}, 200, None),
    ("json_schema-without-schema", CMPL, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "response_format"),
    ("structured_outputs-empty", CMPL, {"structured_outputs": {}}, 400, "structured_outputs"),
    ("structured_outputs-two", CMPL, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, 400,
     "structured_outputs"),
    ("structured_outputs-unknown", CMPL, {"structured_outputs": {"xml": "<a/>"}}, 400, "structured_outputs"),
    ("structured_outputs-regex", CMPL, {"structured_outputs": {"regex": "[ab]", "json": None}}, 200, None),
    ("guided_choice-empty-string", CMPL, {"guided_choice": [""]}, 400, "guided_choice"),
    ("suffix", CMPL, {"suffix": "x"}, 400, "suffix"),
    ("suffix-empty", CMPL, {"suffix": ""}, 200, None),
    ("logit_bias", CHATP, {"logit_bias": {"42": 1}}, 400, "logit_bias"),
    ("logit_bias-empty", CHATP, {"logit_bias": {}}, 200, None),
    ("top_logprobs-with-logprobs", CHATP, {"logprobs": True, "top_logprobs": 2}, 200, None),
    ("forced-tool-and-constraint", CHATP, {"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, 400,
     "tool_choice"),
    ("auto-tool-and-constraint", CHATP, {"tools": TOOLS, "tool_choice": "auto", "guided_regex": "a"}, 200, None),
    ("tool-bad-name", CHATP, {"tools": [{"type": "function", "function": {"name": "bad name"}}]}, 400, "tools"),
    ("tool_choice-unknown", CHATP, {"tools": TOOLS, "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("template-kwargs-clash", CHATP, {"chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("template-kwargs-documents", CHATP, {"chat_template_kwargs": {"documents": ["x"]}}, 400, "messages"),
    ("template-kwargs-other", CHATP, {"chat_template_kwargs": {"enable_thinking": False}}, 200, None),
    ("tokenize-template-kwargs-clash", "/tokenize", {"chat_template_kwargs": {"tokenizer": 1}}, 400,
     "chat_template_kwargs"),
]


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in AGREEMENT], ids=[c[0] for c in AGREEMENT])
def test_schema_and_server_agree(server, openapi, path, body, status, param):
    """The schema allows the request exactly when the server serves it."""
    base = {"messages": MSG} if path in (CHATP, "/tokenize") else {"prompt": "hi"}
    full = {**base, **({"max_tokens": 2} if "completions" in path else {}), **body}
    allowed = schema_allows(openapi, path, full)
    r = httpx.post(f"{server.url}{path}", json=full, timeout=120)
    assert r.status_code == status, r.text
    assert allowed == (status < 300), (allowed, r.text)
    if status >= 400:
        assert r.json()["error"]["param"] == param, r.text


def test_same_greedy_answer_after_all_of_them(server):
    assert greedy_text(server) == server.baseline


def test_token_ids_are_json_schema_integers():
    """Token ids (a prompt, a batch of prompts, ``stop_token_ids``, ``/detokenize``'s tokens) are JSON Schema
    integers: an integral float is taken as the int; a fraction, a boolean or a negative id is refused; a list
    of strings is a batch of text prompts; and every form meets the same schema (integer items, minimum 0)."""
    from pydantic import ValidationError

    from infer.server.protocol import CompletionRequest, DetokenizeRequest

    req = CompletionRequest.model_validate({"prompt": [1.0, 2, 3.0], "stop_token_ids": [7.0, 8]})
    assert req.prompt == [1, 2, 3] and all(type(t) is int for t in req.prompt) and req.stop_token_ids == [7, 8]
    assert CompletionRequest.model_validate({"prompt": [[3.0], [4, 5.0]]}).prompt == [[3], [4, 5]]
    assert DetokenizeRequest.model_validate({"tokens": [9.0, 10]}).tokens == [9, 10]
    assert CompletionRequest.model_validate({"prompt": ["1", "2"]}).prompt == ["1", "2"]
    for bad in ([1.5], [True], [-1.0], [[2], [0.5]], []):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": bad})
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": [1], "stop_token_ids": [2.5]})
    item = {"type": "integer", "minimum": 0, "x-infer-limit": "vocab"}
    schema = CompletionRequest.model_json_schema()
    forms = schema["properties"]["prompt"]["anyOf"]
    assert {"type": "array", "items": item, "minItems": 1, "x-infer-limit": "context"} in forms
    assert any(f.get("items", {}).get("items") == item for f in forms)
    assert DetokenizeRequest.model_json_schema()["properties"]["tokens"]["items"] == item
