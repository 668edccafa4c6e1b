"""Chat templates: a list of messages -> the prompt string a chat model was trained on.

Every chat model ships a Jinja2 template (``tokenizer_config.json``'s ``chat_template``, a
``chat_template.jinja`` file, or GGUF's ``tokenizer.chat_template``) that lays out the
conversation with the model's control tokens: ChatML's ``<|im_start|>user\\n...<|im_end|>``,
Llama 3's ``<|start_header_id|>user<|end_header_id|>\\n\\n...<|eot_id|>``, Gemma's
``<start_of_turn>user``. The engine never hard-codes a format: it renders the model's own
template, exactly as Hugging Face transformers' ``tokenizer.apply_chat_template(messages,
tokenize=False)`` does (``transformers/utils/chat_template_utils.py``), because a prompt that
differs by one newline from the training format measurably degrades the answers.

What "exactly as transformers" means here:

* an ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
  extensions=[loopcontrols])``: templates come from the Hub and are untrusted code;
* a ``tojson`` filter that does *not* HTML-escape (``json.dumps(ensure_ascii=False)``, with
  ``indent`` / ``separators`` / ``sort_keys``), globals ``raise_exception`` and
  ``strftime_now``, and the same guarded ``dict`` / ``namespace`` helpers;
* the template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and any
  extra keyword (``enable_thinking``, ``date_string``...), plus the tokenizer's special-token
  strings (``bos_token``, ``eos_token``...) when called through :func:`apply_chat_template`;
* message keys whose value is None are dropped (OpenAI clients send ``"content": null`` next
  to ``tool_calls``), and a message's reasoning is also given as ``reasoning_content`` /
  ``thinking`` when it came under another of those names.

One departure, vLLM's (``_detect_content_format`` in ``vllm/entrypoints/chat_utils.py``): a
template that never loops over a message's ``content`` expects a string (SmolLM2's does
``'...' + message['content']``), so OpenAI's content parts ``[{"type": "text", "text": ...}]``
are joined with ``"\n"`` for it, and a missing content (an assistant turn that only made tool
calls) becomes ``""``. Templates that loop over the parts (Gemma 3's) get them as given.
transformers passes parts unchanged, which makes string templates fail or drop the text.

The rendered string already holds the control tokens (BOS included, for templates that write
``bos_token``), so encode it with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "apply_chat_template", "content_format", "render_chat_template",
           "validate_messages"]

ROLES = ("system", "user", "assistant", "tool")
# Names a message's reasoning may come under; templates read the first one (gpt-oss: "thinking").
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template could not be rendered for these messages (or called ``raise_exception``)."""


# ---------------------------------------------------------------------------- environment


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes ("<" -> "\u003c"), which chat templates do not want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` for templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (no CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja2: {e} (line {e.lineno})") from e


# ---------------------------------------------------------------------------- content format


def _accesses(node: jinja2.nodes.Node, names: set[str], key: str | None = None) -> bool:
    """``node`` reads one of the variables ``names`` (``key``: its ``[key]`` / ``.key`` item),
    possibly through filters, tests or a slice (``messages[1:]``, ``message.content | list``)."""
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            break
    if key is None:
        return isinstance(node, jinja2.nodes.Name) and node.name in names
    if isinstance(node, jinja2.nodes.Getitem):
        hit = isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    elif isinstance(node, jinja2.nodes.Getattr):
        hit = node.attr == key
    else:
        return False
    return hit and isinstance(node.node, jinja2.nodes.Name) and node.node.name in names


@lru_cache(maxsize=32)
def content_format(template: str) -> str:
    """``"openai"`` if ``template`` loops over a message's ``content`` (it reads a list of parts),
    else ``"string"``: vLLM's detection, from the template's syntax tree.

    Aliases of ``messages`` (``{% set loop_messages = messages[1:] %}``) are followed.
    A template that does not parse counts as ``"string"`` (rendering it reports the error).
    """
    try:
        root = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    lists = {"messages"}
    for a in root.find_all(jinja2.nodes.Assign):
        if isinstance(a.target, jinja2.nodes.Name) and _accesses(a.node, lists):
            lists.add(a.target.name)
    loops = list(root.find_all(jinja2.nodes.For))
    messages = {f.target.name for f in loops if isinstance(f.target, jinja2.nodes.Name) and _accesses(f.iter, lists)}
    return "openai" if any(_accesses(f.iter, messages, "content") for f in loops) else "string"


def _join_text_parts(messages: list[dict]) -> list[dict]:
    """For string templates: text parts joined with ``"\n"``, a missing content as ``""``."""
    out = []
    for m in messages:
        content = m.get("content")
        if content is None:
            m = {**m, "content": ""}
        elif not isinstance(content, str):
            m = {**m, "content": "\n".join(part["text"] for part in content)}
        out.append(m)
    return out


# ---------------------------------------------------------------------------- messages


def validate_messages(messages: Any) -> None:
    """Check an OpenAI-style message list; raise ``ValueError`` saying what is wrong.

    Each message is a dict with ``role`` in system / user / assistant / tool and ``content``
    a string or a list of ``{"type": "text", "text": ...}`` parts. An assistant message that
    carries ``tool_calls`` may have no content. Other part types (images, audio) are rejected:
    infer serves text-only models.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]['role'] is {role!r}; expected one of {', '.join(ROLES)}")
        content = m.get("content")
        if content is None:
            if role == "assistant" and m.get("tool_calls"):
                continue
            raise ValueError(f"messages[{i}] ({role}) has no 'content'")
        if isinstance(content, str):
            continue
        if not isinstance(content, (list, tuple)):
            raise ValueError(
                f"messages[{i}]['content'] must be a string or a list of text parts, got {type(content).__name__}"
            )
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ValueError(f"messages[{i}]['content'][{j}] must be a dict like {{'type': 'text', 'text': ...}}")
            kind = part.get("type")
            if kind != "text":
                raise ValueError(
                    f"messages[{i}]['content'][{j}] has type {kind!r}: only 'text' parts are supported "
                    "(infer serves text-only models; images and audio cannot be given to them)"
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}]['content'][{j}]['text'] must be a string")


def _prepare(messages: list[dict]) -> list[dict]:
    """What transformers does to a chat before rendering: drop None values, alias reasoning."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


# ---------------------------------------------------------------------------- rendering


def render_chat_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Render ``template`` for ``messages`` as transformers' ``apply_chat_template(tokenize=False)``.

    Args:
        template: the Jinja2 chat template source.
        messages: OpenAI-style messages (see :func:`validate_messages`); content parts are
            joined for templates that expect a string (see :func:`content_format`).
        add_generation_prompt: end with the header that opens the assistant's turn.
        **kwargs: variables for the template: ``bos_token``, ``eos_token``, ``tools`` (JSON
            schemas), ``documents``, ``enable_thinking``, ``date_string``...

    Raises:
        ValueError: for malformed messages.
        ChatTemplateError: (a ValueError) when the template is invalid, calls
            ``raise_exception`` or fails on these messages.
    """
    validate_messages(messages)
    compiled = _compile(template)
    if content_format(template) == "string":
        messages = _join_text_parts(list(messages))
    tools = kwargs.pop("tools", None)
    documents = kwargs.pop("documents", None)
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise ValueError("documents must be a list of dicts (with 'title' and 'text' keys)")
    try:
        return compiled.render(
            messages=_prepare(list(messages)),
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e


def apply_chat_template(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True,
                        **kwargs: Any) -> str:
    """Render ``messages`` with the model's own chat template and special tokens.

    ``tokenizer`` is an :class:`infer.tokenizer.Tokenizer`: its ``chat_template`` is rendered
    with its ``special_tokens`` strings (``bos_token``, ``eos_token``, ``pad_token``,
    ``unk_token``) as variables, as transformers passes ``special_tokens_map``; ``kwargs``
    override them.

    Raises:
        ValueError: when the model has no chat template (a base model such as gemma3-270m:
            prompt it with plain text instead), or for malformed messages.
        ChatTemplateError: see :func:`render_chat_template`.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "this model has no chat template (it is probably a base model, not an instruction-tuned one): "
            "use a plain-text completion prompt, or pass a template to render_chat_template()"
        )
    specials = {k: v for k, v in (getattr(tokenizer, "special_tokens", None) or {}).items() if v is not None}
    return render_chat_template(template, messages, add_generation_prompt, **{**specials, **kwargs})
