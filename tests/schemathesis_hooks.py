"""Schemathesis hooks for the server's fuzz test (``SCHEMATHESIS_HOOKS=tests.schemathesis_hooks``).

Generated bodies keep their shape, but the work they ask of a CPU engine is capped: at most
4 tokens per sequence (chat's default is "until the context ends"), ``n`` at most 2, at most
4 prompts per request. Only values inside the schema's ranges are capped (the server's limits
come from ``INFER_FUZZ_MAX_MODEL_LEN`` and ``INFER_FUZZ_MAX_N``), so that a schema-violating
case stays one and must still be rejected.
"""

from __future__ import annotations

import os

import schemathesis

MAX_TOKENS, MAX_N, MAX_PROMPTS = 4, 2, 4
CONTEXT = int(os.environ.get("INFER_FUZZ_MAX_MODEL_LEN", "1024")) - 1  # the schema's maximum
SCHEMA_MAX_N = int(os.environ.get("INFER_FUZZ_MAX_N", "8"))
SCHEMA_MAX_PROMPTS = 1024


def _int(value) -> bool:
    """An integer as JSON Schema has it (``4.0`` included)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


@schemathesis.hook
def map_body(context, body):
    if not isinstance(body, dict):
        return body
    path = context.operation.path if context.operation is not None else ""
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(key)
        if _int(value) and MAX_TOKENS < value <= CONTEXT:
            body[key] = MAX_TOKENS
    if path.endswith("/completions") and body.get("max_tokens", None) is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # chat: until the context ends; completions: 16
    n = body.get("n")
    if _int(n) and MAX_N < n <= SCHEMA_MAX_N:
        body["n"] = MAX_N
        if body.get("best_of") == n:
            body["best_of"] = MAX_N
    prompt = body.get("prompt")
    if isinstance(prompt, list) and MAX_PROMPTS < len(prompt) <= SCHEMA_MAX_PROMPTS \
            and all(isinstance(p, (str, list)) for p in prompt):
        body["prompt"] = prompt[:MAX_PROMPTS]
    return body
