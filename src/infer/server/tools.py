"""Tool calling as constrained decoding (phase 13), and parsing a model's own tool calls.

OpenAI's ``tools`` + ``tool_choice`` map onto structured output:

* ``tool_choice={"type": "function", "function": {"name": f}}``: the output is constrained to
  the JSON arguments of ``f`` (its ``parameters`` schema); the response carries one call of ``f``.
* ``tool_choice="required"``: the output is constrained to a JSON array of one or more
  ``{"name": <one of the tools>, "arguments": <that tool's parameters>}`` (vLLM's choice; with
  ``parallel_tool_calls: false`` exactly one).
* ``tool_choice="auto"`` (the default when tools are given): nothing is constrained; the tools
  go to the chat template, and the model's output is parsed for Hermes-style
  ``<tool_call>...</tool_call>`` blocks (Qwen 2.5/3 write one JSON object per block, SmolLM2 a
  JSON list of them) by :func:`parse_tool_calls`.
* ``tool_choice="none"``: tools are ignored.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

__all__ = ["ToolSpec", "parse_tool_calls", "tool_call_dicts"]

#: What a function name may be (OpenAI's rule: 1-64 letters, digits, ``_``, ``.`` or ``-``).
NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"
_NAME = re.compile(NAME_PATTERN)
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolSpec:
    """The request's ``tools`` and ``tool_choice``, checked.

    Raises:
        ValueError: (``param`` set to ``"tools"`` or ``"tool_choice"``) a tool that is not
            ``{"type": "function", "function": {"name", ...}}``, a bad name, parameters that are
            not a JSON schema object, duplicate names, a ``tool_choice`` naming an unknown
            function or not one of ``"none"``, ``"auto"``, ``"required"``, a named function.
    """

    def __init__(self, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> None:
        self.functions: dict[str, dict[str, Any]] = {}
        for i, tool in enumerate(tools or []):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
                raise _error("tools", f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
            name = fn.get("name")
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise _error("tools", f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -, got {name!r}")
            if name in self.functions:
                raise _error("tools", f"tools[{i}]: duplicate function name {name!r}")
            params = fn.get("parameters", EMPTY_PARAMETERS)
            if not isinstance(params, dict):
                raise _error("tools", f"tools[{i}].function.parameters must be a JSON schema object")
            self.functions[name] = {**fn, "parameters": params}
        choice = tool_choice if tool_choice is not None else ("auto" if self.functions else "none")
        self.named: str | None = None
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise _error("tool_choice", "tool_choice must be \"none\", \"auto\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
            if name not in self.functions:
                raise _error("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
            self.named, choice = name, "named"
        elif choice not in ("none", "auto", "required"):
            raise _error("tool_choice", f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, "
                         f"got {choice!r}")
        elif choice != "none" and not self.functions:
            raise _error("tool_choice", f"tool_choice {choice!r} needs tools")
        self.choice: str = choice
        self.parallel = parallel_tool_calls is not False

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (``None`` with ``tool_choice="none"``)."""
        if self.choice == "none":
            return None
        return [{"type": "function", "function": fn} for fn in self.functions.values()]

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output is constrained to (``None``: unconstrained)."""
        if self.choice == "named":
            return self.functions[self.named]["parameters"]
        if self.choice != "required":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"const": name}, "arguments": fn["parameters"]},
                  "required": ["name", "arguments"]} for name, fn in self.functions.items()]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}

    def calls_from_output(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool calls)`` of a finished output (OpenAI message fields).

        Named and required: the constrained JSON (a truncated one, ``finish_reason="length"``,
        gives no calls and the text as content). Auto: :func:`parse_tool_calls`.
        """
        if self.choice == "named":
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return text, []
            return None, tool_call_dicts([(self.named, text)])
        if self.choice == "required":
            try:
                calls = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            return None, tool_call_dicts([(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in calls])
        if self.choice == "auto":
            return parse_tool_calls(text, set(self.functions))
        return text, []


def _error(param: str, message: str) -> ValueError:
    e = ValueError(message)
    e.param = param  # the server's 400 names it
    return e


def tool_call_dicts(calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` entries for ``(name, arguments JSON text)`` pairs, with fresh ids."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": args}} for name, args in calls]


def parse_tool_calls(text: str, names: set[str] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style tool calls in a model's output: ``(content before the first call or None, calls)``.

    Each ``<tool_call>...</tool_call>`` block holds one JSON object ``{"name", "arguments"}``
    (Qwen 2.5 / Qwen3) or a JSON list of them (SmolLM2). A block that is not such JSON, or names
    a function not in ``names``, is left as text: then no calls are returned and the whole output
    is the content (the model did not make a well-formed call).
    """
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        return text, []
    calls: list[tuple[str, str]] = []
    for m in blocks:
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, []
        for c in obj if isinstance(obj, list) else [obj]:
            if not (isinstance(c, dict) and isinstance(c.get("name"), str)
                    and (names is None or c["name"] in names)):
                return text, []
            args = c.get("arguments", c.get("parameters", {}))
            calls.append((c["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    content = text[: blocks[0].start()].strip()
    return content or None, tool_call_dicts(calls)
