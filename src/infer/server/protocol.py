"""Request bodies of the OpenAI-compatible API, as pydantic models.

Field names, defaults and shapes follow OpenAI's API reference (``/v1/completions``,
``/v1/chat/completions``), plus vLLM's sampling extras (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``skip_special_tokens``). Unknown fields are rejected (``extra="forbid"``), and so are OpenAI
fields infer does not implement (``suffix``, ``best_of > n``, a non-empty ``logit_bias``,
``tools``...), each with an HTTP 400 that names the field: a request is never half-served.
The OpenAPI schema (``/openapi.json``) states what the server enforces, so that a client (or a
fuzzer) can tell a request that will be served from one that will be refused:

* The sampling ranges are checked by :class:`~infer.sampling.SamplingParams` (one place for the
  library and the server; its 400 names the field and the range): the fields carry the same
  ranges, from its constants, for the schema only (:func:`_number_in`).
* Rules across fields (``stream_options`` only with ``stream``, one output constraint per
  request...) are in each model's ``allOf``, each an ``anyOf`` of the ways to satisfy it
  (``_COMMON_RULES``...); the checks that enforce them are the methods below (``_check_common``...).
* Fields whose Python type is broader than what is served (``tool_choice``,
  ``structured_outputs``...) keep it, so that their own check gives the 400 its message, and
  carry the narrower schema (``WithJsonSchema``). Fields infer refuses entirely (``suffix``, a
  non-empty ``logit_bias``) are declared empty.
* Limits that depend on the served model (the vocabulary, the context, ``max_num_seqs``, the
  model's name, the characters its tokenizer has no token for) are marked ``x-infer-limit``
  and filled in by the app when it builds its schema.

A few rules no JSON Schema can state remain: ``min_tokens <= max_tokens``, ``best_of == n``, a
prompt that fits the context with its ``max_tokens``, a ``tool_choice`` naming one of the
``tools`` (with distinct names), a regex or JSON schema that compiles. Each is refused with a
400 naming the field.

The response models at the end only document the responses (the OpenAPI schema); the
endpoints build their JSON directly.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    Tag,
    WithJsonSchema,
)

from infer.chat import apply_chat_template, render_chat_template
from infer.sampling import SamplingParams
from infer.sampling.params import (
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    RequestOutputKind,
)
from infer.sampling.structured import StructuredOutputsParams
from infer.server.tools import NAME_PATTERN, ToolSpec


class UnsupportedField(ValueError):
    """An OpenAI field infer does not implement (HTTP 400 naming the field)."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


def _integral(value: Any) -> Any:
    """JSON Schema's integer includes 4.0: take an integral float as the int (not a bool or "4")."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: An integer as JSON Schema has it (``4`` or ``4.0``; not ``true`` or ``"4"``).
Int = Annotated[StrictInt, BeforeValidator(_integral)]


def _int(**constraints: Any) -> Any:
    """:data:`Int` with ``Field`` constraints (placed before the validator, or pydantic leaves
    them out of the JSON schema)."""
    return Annotated[StrictInt, Field(**constraints), BeforeValidator(_integral)]


def _limit(kind: str) -> dict:
    """Schema marker for a bound known only once the model is loaded (see ``build_app``)."""
    return {"x-infer-limit": kind}


def _integral_items(value: Any) -> Any:
    """:func:`_integral` over a list of token ids in one call: a prompt of token ids costs one Python call
    while it is validated, not one per token (the rest is pydantic's compiled validation)."""
    if isinstance(value, list) and float in map(type, value):  # (JSON gives plain floats; the scan runs in C)
        return [_integral(v) for v in value]
    return value


def _token_ids(**constraints: Any) -> Any:
    """A list of token ids, each ``0 <= id < vocab_size`` (integral floats taken as ints: :func:`_integral`,
    once for the list), with ``Field`` constraints on the list."""
    item = Annotated[StrictInt, Field(ge=0, json_schema_extra=_limit("vocab"))]
    return Annotated[list[item], Field(**constraints), BeforeValidator(_integral_items)]


#: A list of token ids (``stop_token_ids``, ``/detokenize``'s ``tokens``).
TokenIds = _token_ids()
#: The ``model`` field: the served model's name (another one is answered 404), or none.
ModelName = Annotated[str, Field(json_schema_extra=_limit("model"))] | None
#: Most sequences (prompts x n) one completions request may carry.
MAX_SEQS_PER_REQUEST = 1024
#: Largest ``n`` (also at most the engine's ``max_num_seqs``).
MAX_N = 16
_Float = Annotated[StrictFloat, Field(allow_inf_nan=False)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


def _number_in(low: float, high: float, *, open_low: bool = False) -> Any:
    """A number in ``[low, high]`` (``(low, high]`` with ``open_low``), a range that
    :class:`SamplingParams` checks (its 400 names the field and the range): stated here for the
    schema only."""
    return Annotated[_Float, Field(json_schema_extra={"exclusiveMinimum" if open_low else "minimum": low,
                                                      "maximum": high})]


#: A text prompt: it must encode to at least one token (the schema's ``pattern``: a character the
#: tokenizer has a token for; SmolLM2 has none for six ASCII control characters).
PromptText = Annotated[str, Field(min_length=1, json_schema_extra=_limit("prompt_text"))]

#: OpenAI request fields that do not change what is generated.
IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key")

#: ``max_tokens`` of a completions request that leaves it out or sends null (OpenAI's legacy API).
DEFAULT_COMPLETION_MAX_TOKENS = 16


# ---------------------------------------------------------------------------- rules across fields (JSON Schema)
# Each rule is an ``anyOf`` of the ways to satisfy it ("either stream_options is null, or stream
# is true"): schemathesis' generator handles a product of these, not of if/then or not.


def _either(*alternatives: dict) -> dict:
    """JSON Schema: a body that matches at least one of ``alternatives``."""
    return {"anyOf": list(alternatives)}


def _fields(**schemas: dict) -> dict:
    """JSON Schema: each field, if present, matches its schema."""
    return {"properties": schemas}


def _is(name: str, value: Any) -> dict:
    """JSON Schema: field ``name`` is present and equals ``value``."""
    return {"required": [name], "properties": {name: {"const": value}}}


_NULL = {"type": "null"}
#: The spellings of an output constraint (see ``_structured``), each as "not given" and "given".
_CONSTRAINTS = {
    "response_format": ({"anyOf": [_NULL, {"properties": {"type": {"const": "text"}}}]},
                        {"type": "object", "required": ["type"],
                         "properties": {"type": {"enum": ["json_object", "json_schema"]}}}),
    "structured_outputs": (_NULL, {"type": "object"}),
    "guided_json": (_NULL, {"type": ["object", "string"]}),
    "guided_regex": (_NULL, {"type": "string"}),
    "guided_choice": (_NULL, {"type": "array"}),
}
#: No output constraint.
_NO_CONSTRAINT = _fields(**{name: absent for name, (absent, _) in _CONSTRAINTS.items()})
#: At most one output constraint per request.
_ONE_CONSTRAINT = _either(_NO_CONSTRAINT, *(
    {"required": [name], "properties": {**_NO_CONSTRAINT["properties"], name: given}}
    for name, (_, given) in _CONSTRAINTS.items()))

#: What ``_check_common`` and ``_structured`` enforce.
_COMMON_RULES = [
    _either(_fields(stream_options=_NULL), _is("stream", True)),
    _ONE_CONSTRAINT,
]
#: What ``CompletionRequest.sampling_params`` enforces (``max_tokens: 0`` only scores the prompt).
_COMPLETION_RULES = [
    _either(_fields(max_tokens={"anyOf": [_NULL, {"type": "integer", "minimum": 1}]}), _is("echo", True)),
]
#: What ``ChatCompletionRequest.sampling_params`` and ``ToolSpec`` enforce. One more rule could be
#: stated, "a ``tool_choice`` other than ``none`` needs ``tools``", but each rule doubles the
#: alternatives of this 40-field object, and with it they are more than schemathesis' generator
#: (jsonschema-rs' canonical form) takes: its fuzz test keeps generated requests inside that rule.
_CHAT_RULES = [
    _either(_fields(top_logprobs={"enum": [0, None]}), _is("logprobs", True)),
    # a forced tool call is constrained decoding: no other output constraint with it
    _either(_fields(tool_choice={"enum": ["none", "auto", None]}), _NO_CONSTRAINT),
]

#: ``tools`` items (``ToolSpec`` checks them): functions with distinct names.
_TOOL_SCHEMA = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": NAME_PATTERN},
        "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON schema (compiled when the call is forced)"}}}}}
#: ``tool_choice`` (``ToolSpec`` checks it; a named function must be one of ``tools``).
_TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}},
    {"type": "null"}]}
_JSON_SCHEMA = {"type": ["object", "string"], "description": "a JSON schema (an object or its JSON text)"}
#: vLLM's ``structured_outputs`` (``StructuredOutputsParams`` checks it): exactly one constraint.
_STRUCTURED_OUTPUTS_SCHEMA = {"anyOf": [
    {"type": "object", "additionalProperties": False,
     "properties": {"json": {"type": ["object", "string", "null"]}, "regex": {"type": ["string", "null"]},
                    "choice": {"anyOf": [{"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                                         _NULL]},
                    "json_object": {"type": "boolean"}, "whitespace_pattern": {"type": ["string", "null"]}},
     # exactly one of json, regex, choice, json_object: true
     "anyOf": [{"required": [name], "properties": {"json": _NULL, "regex": _NULL, "choice": _NULL,
                                                  "json_object": {"const": False}, name: given}}
               for name, given in (("json", {"type": ["object", "string"]}), ("regex", {"type": "string"}),
                                   ("choice", {"type": "array"}), ("json_object", {"const": True}))]},
    {"type": "null"}]}
#: Names the chat template renderer takes itself: not allowed in ``chat_template_kwargs``.
_RENDERER_ARGS = sorted({name for f in (apply_chat_template, render_chat_template)
                         for name, p in inspect.signature(f).parameters.items() if p.kind != p.VAR_KEYWORD})
_TEMPLATE_KWARGS_SCHEMA = {"anyOf": [
    {"type": "object", "propertyNames": {"not": {"enum": _RENDERER_ARGS}},
     "properties": {"documents": {"anyOf": [{"type": "array", "items": {"type": "object"}}, {"type": "null"}]}}},
    {"type": "null"}]}


# ---------------------------------------------------------------------------- request bodies


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_either(
        _fields(continuous_usage_stats={"enum": [False, None]}), _is("include_usage", True)))
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (phase 13)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_either(
        _fields(type={"enum": ["text", "json_object"]}),
        {"required": ["json_schema"], "properties": {"json_schema": {
            "type": "object", "required": ["schema"], "properties": {"schema": _JSON_SCHEMA}}}}))
    type: str = Field(json_schema_extra={"enum": ["text", "json_object", "json_schema"]})  # others: a 400
    json_schema: dict[str, Any] | None = None


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName = None
    temperature: _number_in(0.0, MAX_TEMPERATURE) | None = None
    top_p: _number_in(0.0, 1.0, open_low=True) | None = None
    n: _int(ge=1, le=MAX_N, json_schema_extra=_limit("n")) = 1
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    seed: Int | None = None
    presence_penalty: _number_in(-MAX_PENALTY, MAX_PENALTY) | None = 0.0
    frequency_penalty: _number_in(-MAX_PENALTY, MAX_PENALTY) | None = 0.0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # not supported: the schema says "empty"; the server's 400 says why
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0})
    # OpenAI fields that do not change what is generated: accepted and ignored
    user: str | None = None
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extras
    top_k: _int(ge=-1) | None = None
    min_p: _number_in(0.0, 1.0) | None = None
    repetition_penalty: _number_in(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY) | None = None
    ignore_eos: StrictBool = False
    min_tokens: _int(ge=0, json_schema_extra=_limit("context")) = 0
    stop_token_ids: TokenIds | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # structured output (phase 13): OpenAI's response_format, vLLM's structured_outputs and its
    # older guided_* spellings (see _structured)
    response_format: ResponseFormat | None = None
    structured_outputs: Annotated[dict[str, Any] | None, WithJsonSchema(_STRUCTURED_OUTPUTS_SCHEMA)] = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None

    def ignored_fields(self) -> list[str]:
        """The fields given that do not change generation (the server logs them at debug level)."""
        return [f for f in IGNORED_FIELDS if getattr(self, f) is not None]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries the usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _check_common(self) -> None:
        if self.logit_bias:
            raise UnsupportedField("logit_bias", "logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options is only allowed when stream is true")
        if self.continuous_usage and not self.include_usage:
            raise UnsupportedField("stream_options", "stream_options.continuous_usage_stats requires include_usage "
                                   "to be true (as in vLLM)")

    def _structured(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever spelling it used (at most one).

        Raises:
            UnsupportedField: two spellings at once, an unknown ``response_format`` type, a
                ``json_schema`` without a schema, an invalid or unsupported schema, an
                uncompilable regex, an empty choice list.
        """
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":
                given.append(("response_format", {"json_object": True}))
            elif rf.type == "json_schema":
                js = rf.json_schema
                if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, str)):
                    raise UnsupportedField("response_format", "response_format json_schema needs "
                                           "{\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
                given.append(("response_format", {"json": js["schema"]}))
            else:
                raise UnsupportedField("response_format", f"response_format type must be text, json_object or "
                                       f"json_schema, got {rf.type!r}")
        if self.structured_outputs is not None:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
            if getattr(self, name) is not None:
                given.append((name, {key: getattr(self, name)}))
        if not given:
            return None
        if len(given) > 1:
            raise UnsupportedField(given[1][0], f"only one output constraint per request; got "
                                   f"{', '.join(g[0] for g in given)}")
        param, spec = given[0]
        try:
            so = StructuredOutputsParams(**spec)
            so.check()
        except (TypeError, ValueError) as e:
            raise UnsupportedField(param, f"{param}: {e}") from None
        return so

    def _sampling(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                  structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """The :class:`SamplingParams` of this request (its ``ValueError`` names the field)."""
        kw: dict[str, Any] = dict(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=structured if structured is not None else self._structured(),
            # a stream forwards what is new (no O(length) copy per token); a plain response waits for the end
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return SamplingParams(**kw)


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    model_config = ConfigDict(json_schema_extra={"allOf": [*_COMMON_RULES, *_COMPLETION_RULES]})
    prompt: (PromptText
             | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_SEQS_PER_REQUEST)]
             | _token_ids(min_length=1, json_schema_extra=_limit("context"))
             | Annotated[list[_token_ids(min_length=1, json_schema_extra=_limit("context"))],
                         Field(min_length=1, max_length=MAX_SEQS_PER_REQUEST)])
    max_tokens: _int(ge=0, json_schema_extra=_limit("context")) | None = \
        DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = None
    echo: StrictBool = False
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})
    best_of: _int(ge=1, le=MAX_N) | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids).

        Raises:
            UnsupportedField: for an empty list.
        """
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise UnsupportedField("prompt", "prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.suffix:
            raise UnsupportedField("suffix", "suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise UnsupportedField("best_of", "best_of different from n is not supported by this server")
        prompt_lp = self.logprobs if (self.echo and self.logprobs is not None) else None
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        if max_tokens == 0:
            if not self.echo:
                raise UnsupportedField("max_tokens", "max_tokens must be >= 1 (0 is allowed with echo: true, "
                                       "which scores the prompt without generating)")
            max_tokens = 1  # one token is generated and dropped from the response (see score_only)
        return self._sampling(max_tokens, self.logprobs, prompt_lp)

    @property
    def score_only(self) -> bool:
        """``echo`` with ``max_tokens: 0`` (legacy API): the prompt, and its logprobs, only."""
        return self.echo and self.max_tokens == 0


class TextContentPart(BaseModel):
    """OpenAI's text content part (infer serves text-only models: no image or audio parts)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; other keys (``reasoning_content``...) are passed to the chat template.

    ``content`` is required, except in an assistant message that carries ``tool_calls``.
    """

    model_config = ConfigDict(extra="allow", json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["role", "tool_calls"],
         "properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}},
    ]})
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    model_config = ConfigDict(json_schema_extra={"allOf": [*_COMMON_RULES, *_CHAT_RULES]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: _int(ge=1, json_schema_extra=_limit("context")) | None = None
    max_completion_tokens: _int(ge=1, json_schema_extra=_limit("context")) | None = None
    logprobs: StrictBool = False
    top_logprobs: _int(ge=0, le=MAX_LOGPROBS) | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: Annotated[dict[str, Any] | None, WithJsonSchema(_TEMPLATE_KWARGS_SCHEMA)] = None
    tools: Annotated[list[dict[str, Any]] | None,
                     WithJsonSchema({"anyOf": [{"type": "array", "items": _TOOL_SCHEMA}, {"type": "null"}]})] = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(_TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: StrictBool | None = None

    def tool_spec(self) -> ToolSpec:
        """The checked ``tools`` / ``tool_choice`` (:class:`~infer.server.tools.ToolSpec`).

        Raises:
            UnsupportedField: a malformed tool or tool choice.
        """
        try:
            return ToolSpec(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ValueError as e:
            raise UnsupportedField(getattr(e, "param", "tools"), str(e)) from None

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing: accepted, as OpenAI does
            raise UnsupportedField("top_logprobs", "top_logprobs > 0 requires logprobs to be true")
        structured = None
        schema = self.tool_spec().schema()
        if schema is not None:  # a forced tool call is constrained decoding
            if self._structured() is not None:
                raise UnsupportedField("tool_choice", "a forced tool call cannot be combined with another output "
                                       "constraint (response_format, structured_outputs)")
            try:
                structured = StructuredOutputsParams(json=schema)
                structured.check()
            except ValueError as e:
                raise UnsupportedField("tools", f"tools: {e}") from None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, None, structured)

    def message_dicts(self) -> list[dict[str, Any]]:
        return _message_dicts(self.messages)


def _message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as plain dicts for the chat template (``developer`` is OpenAI's newer name
    for ``system``)."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        out.append(d)
    return out


# ---------------------------------------------------------------------------- vLLM's tokenizer endpoints


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a text prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with chat messages, rendered by the model's chat template (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    chat_template_kwargs: Annotated[dict[str, Any] | None, WithJsonSchema(_TEMPLATE_KWARGS_SCHEMA)] = None
    return_token_strs: StrictBool = False

    def message_dicts(self) -> list[dict[str, Any]]:
        return _message_dicts(self.messages)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName = None
    tokens: TokenIds


def _tokenize_kind(body: Any) -> str:
    has_messages = isinstance(body, dict) and "messages" in body or hasattr(body, "messages")
    return "Chat" if has_messages else "Completion"


#: ``POST /tokenize``'s body: a chat request when it has ``messages``, else a text one.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("Completion")] | Annotated[TokenizeChatRequest, Tag("Chat")],
    Discriminator(_tokenize_kind),
]


# ---------------------------------------------------------------------------- responses (schema only)

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


class ErrorInfo(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, not_found_error, server_overloaded, "
                                  "server_unavailable or internal_error")
    param: str | None = Field(description="the request field at fault, if any")
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every 4xx and 5xx."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``: prompt tokens served from the prefix cache."""

    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # with prefix_caching (phase 7)


class CompletionLogprobs(BaseModel):
    """The legacy logprobs object: one entry per token (echoed prompt first)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    """``POST /v1/completions`` (with ``stream``, each ``data:`` event is one of these with one
    choice and no ``usage``, except the last with ``include_usage``: empty ``choices``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    """``POST /v1/chat/completions`` without ``stream`` (streamed: ``chat.completion.chunk``
    events whose choices carry a ``delta``, then ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None  # a LoRA adapter (phase 16): its directory
    parent: str | None = None  # a LoRA adapter: the served model it adapts


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (``lora_int_id`` accepted and ignored, as vLLM does)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok"]


class ResetPrefixCacheResponse(BaseModel):
    """``POST /reset_prefix_cache`` (vLLM's endpoint): whether prefix caching is on, and how many
    cached free KV blocks were dropped."""

    prefix_caching: bool
    num_blocks_dropped: int


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    add_bos_token: bool
    model_max_length: int
    vocab_size: int
