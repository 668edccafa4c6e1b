"""Schemathesis hooks for the server's fuzz test (``SCHEMATHESIS_HOOKS=tests.schemathesis_hooks``).

:func:`map_body` changes a generated body in two ways, each only where the values are ones the
schema allows, so that a schema-violating case stays one and must still be rejected:

1. The work it asks of a CPU engine is capped: at most 2 tokens per sequence (chat's default
   is "until the context ends"), ``n`` at most 2, at most 4 prompts of at most 64 token ids.
   The server's limits, which the schema states, come from ``INFER_FUZZ_MAX_MODEL_LEN`` and
   ``INFER_FUZZ_MAX_N``.
2. It is kept inside the rules that no JSON Schema can state (``infer/server/protocol.py``
   lists them), so that every request the schema allows is one the server must serve
   (schemathesis' ``positive_data_acceptance``): ``min_tokens <= max_tokens``, ``best_of == n``,
   tools with distinct names and a named ``tool_choice`` naming one of them, regexes and JSON
   schemas that compile (asked of the server's own ``StructuredOutputsParams``; one that does not
   is replaced by a small one that does). The 400s of these rules are tested by
   ``test_server.py::test_bad_request`` and ``test_structured_server.py``.

With ``INFER_FUZZ_LOG`` set, :func:`after_call` appends one JSON line per request sent (its
operation, generation mode, phase and status): the test counts the cases per operation and
checks every status against the schema.
"""

from __future__ import annotations

import json
import os
import re

import schemathesis

from infer.sampling.structured import StructuredOutputsParams
from infer.server.tools import NAME_PATTERN

MAX_TOKENS, MAX_N, MAX_PROMPTS, MAX_PROMPT_IDS = 2, 2, 4, 64
CONTEXT = int(os.environ.get("INFER_FUZZ_MAX_MODEL_LEN", "1024")) - 1  # the schema's maximum
SCHEMA_MAX_N = int(os.environ.get("INFER_FUZZ_MAX_N", "8"))
SCHEMA_MAX_PROMPTS = 1024
SCHEMA_MAX_BEST_OF = 16
#: what replaces a generated regex / JSON schema that does not compile
SMALL_REGEX, SMALL_SCHEMA = "[a-z]{1,8}", {"type": "string", "maxLength": 8}
CHAT = "/v1/chat/completions"


def _int(value) -> bool:
    """An integer as JSON Schema has it (``4.0`` included)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _compiles(**spec) -> bool:
    """Whether the server would accept this output constraint (``StructuredOutputsParams``' check)."""
    try:
        StructuredOutputsParams(**spec).check()
    except (TypeError, ValueError):
        return False
    return True


def _cap_work(body: dict, path: str) -> None:
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(key)
        if _int(value) and MAX_TOKENS < value <= CONTEXT:
            body[key] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # chat: until the context ends; completions: 16
    n = body.get("n")
    if _int(n) and MAX_N < n <= SCHEMA_MAX_N:
        body["n"] = MAX_N
    prompt = body.get("prompt")
    if isinstance(prompt, list) and MAX_PROMPTS < len(prompt) <= SCHEMA_MAX_PROMPTS \
            and all(isinstance(p, (str, list)) for p in prompt):
        body["prompt"] = prompt = prompt[:MAX_PROMPTS]
    if isinstance(prompt, list) and prompt and all(_int(t) for t in prompt):
        body["prompt"] = prompt[:MAX_PROMPT_IDS]
    elif isinstance(prompt, list):
        body["prompt"] = [p[:MAX_PROMPT_IDS] if isinstance(p, list) and p and all(_int(t) for t in p) else p
                          for p in prompt]


def _cross_field_rules(body: dict, path: str) -> None:
    """``min_tokens <= max_tokens`` and ``best_of == n``."""
    limit = body.get("max_completion_tokens") if path == CHAT else None
    limit = body.get("max_tokens") if limit is None else limit
    min_tokens = body.get("min_tokens")
    if _int(limit) and 0 <= limit <= CONTEXT and _int(min_tokens) and limit < min_tokens <= CONTEXT:
        body["min_tokens"] = limit
    n = body.get("n", 1)
    best_of = body.get("best_of")
    if _int(n) and 1 <= n <= SCHEMA_MAX_N and _int(best_of) and 1 <= best_of <= SCHEMA_MAX_BEST_OF:
        body["best_of"] = n


def _tool_rules(body: dict) -> None:
    """Tools for a ``tool_choice`` other than ``none`` (a rule the schema could state, but
    protocol.py's ``_CHAT_RULES`` says why it does not), with distinct names; a named
    ``tool_choice`` names one of them; a forced call's parameters compile."""
    choice = body.get("tool_choice")
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
    if (named or choice in ("auto", "required")) and body.get("tools") in (None, []):
        body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    tools = body.get("tools")
    functions = [t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
                 for t in tools] if isinstance(tools, list) else []
    if not functions or not all(isinstance(f, dict) and isinstance(f.get("name"), str)
                                and re.fullmatch(NAME_PATTERN, f["name"]) for f in functions):
        return
    seen: set[str] = set()
    for i, f in enumerate(functions):
        while f["name"] in seen:
            f["name"] = f"{f['name'][:56]}_{i}"
        seen.add(f["name"])
    if named and isinstance(choice["function"].get("name"), str) and choice["function"]["name"] not in seen:
        choice["function"]["name"] = functions[0]["name"]
    if named or choice == "required":
        for f in functions:
            params = f.get("parameters")
            if isinstance(params, dict) and not _compiles(json=params):
                f["parameters"] = {"type": "object", "properties": {}}


def _constraint_rules(body: dict) -> None:
    """Regexes and JSON schemas that compile."""
    if isinstance(body.get("guided_regex"), str) and not _compiles(regex=body["guided_regex"]):
        body["guided_regex"] = SMALL_REGEX
    if isinstance(body.get("guided_json"), (dict, str)) and not _compiles(json=body["guided_json"]):
        body["guided_json"] = SMALL_SCHEMA
    so = body.get("structured_outputs")
    if isinstance(so, dict) and set(so) <= {"json", "regex", "choice", "json_object", "whitespace_pattern"} \
            and not _compiles(**so):
        if isinstance(so.get("regex"), str):
            so["regex"] = SMALL_REGEX
        if isinstance(so.get("json"), (dict, str)):
            so["json"] = SMALL_SCHEMA
        if isinstance(so.get("whitespace_pattern"), str) and not _compiles(**so):
            del so["whitespace_pattern"]
    rf = body.get("response_format")
    js = rf.get("json_schema") if isinstance(rf, dict) and rf.get("type") == "json_schema" else None
    if isinstance(js, dict) and isinstance(js.get("schema"), (dict, str)) and not _compiles(json=js["schema"]):
        js["schema"] = SMALL_SCHEMA


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    path = context.operation.path if context.operation is not None else ""
    if path.endswith("/completions"):
        _cap_work(body, path)
        _cross_field_rules(body, path)
        _constraint_rules(body)
    if path == CHAT:
        _tool_rules(body)
    return body


_LOG = os.environ.get("INFER_FUZZ_LOG")


@schemathesis.hook
def after_call(context, case, response):
    """One JSON line per request sent (``INFER_FUZZ_LOG``): what the test reads."""
    if not _LOG:
        return
    meta = case.meta
    record = {"operation": f"{case.method.upper()} {case.operation.path}",
              "mode": meta.generation.mode.value if meta else None,
              "phase": meta.phase.name.value if meta else None,
              "status": response.status_code,
              "elapsed_s": round(float(response.elapsed), 3),
              "body": json.dumps(case.body, default=repr)[:2000] if response.status_code >= 400 else None,
              "response": response.text[:500] if response.status_code >= 400 else None}
    with open(_LOG, "a") as f:
        f.write(json.dumps(record) + "\n")
