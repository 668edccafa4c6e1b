"""Request bodies of the OpenAI-compatible API, as pydantic models.

Field names, defaults and shapes follow OpenAI's API reference (``/v1/completions``,
``/v1/chat/completions``), plus vLLM's sampling extras (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``skip_special_tokens``). Unknown fields are rejected (``extra="forbid"``), and so are OpenAI
fields infer does not implement (``suffix``, ``best_of > n``, a non-empty ``logit_bias``,
``tools``...), each with an HTTP 400 that names the field: a request is never half-served.
Range checks live in :class:`~infer.sampling.SamplingParams` (one place for the library and
the server).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictInt, Tag

from infer.sampling import SamplingParams


class UnsupportedField(ValueError):
    """An OpenAI field infer does not implement (HTTP 400 naming the field)."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


#: OpenAI request fields that do not change what is generated.
IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key")

#: ``max_tokens`` of a completions request that leaves it out or sends null (OpenAI's legacy API).
DEFAULT_COMPLETION_MAX_TOKENS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class _Common(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt = 1
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI fields that do not change what is generated: accepted and ignored
    user: str | None = None
    store: StrictBool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False

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

    def _sampling(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None) -> SamplingParams:
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
        )
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        return SamplingParams(**kw)


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: ResponseFormat | None = None
    parallel_tool_calls: StrictBool | None = None

    def sampling_params(self) -> SamplingParams:
        self._check_common()
        if self.tools:
            raise UnsupportedField("tools", "tools are not supported by this server")
        if self.tool_choice not in (None, "none"):
            raise UnsupportedField("tool_choice", "tool_choice is not supported by this server")
        if self.response_format is not None and self.response_format.type != "text":
            raise UnsupportedField("response_format", "response_format other than text is not supported yet")
        if self.top_logprobs is not None and not self.logprobs:
            raise UnsupportedField("top_logprobs", "top_logprobs requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, None)

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
    model: str | None = None
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with chat messages, rendered by the model's chat template (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: StrictBool = False

    def message_dicts(self) -> list[dict[str, Any]]:
        return _message_dicts(self.messages)


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[StrictInt]


def _tokenize_kind(body: Any) -> str:
    has_messages = isinstance(body, dict) and "messages" in body or hasattr(body, "messages")
    return "Chat" if has_messages else "Completion"


#: ``POST /tokenize``'s body: a chat request when it has ``messages``, else a text one.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("Completion")] | Annotated[TokenizeChatRequest, Tag("Chat")],
    Discriminator(_tokenize_kind),
]
