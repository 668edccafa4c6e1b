"""What the engine hands back: request outputs in vLLM's shape.

A :class:`RequestOutput` holds one :class:`CompletionOutput` per sampled sequence (``n`` of
them). While streaming, each output carries the *delta* since the previous one
(``delta_text``, ``delta_token_ids``, ``delta_logprobs``) and, by default, the cumulative
``text`` / ``token_ids``; the final output (``finished=True``) is complete. A request's
``SamplingParams.output_kind`` (:class:`~infer.sampling.params.RequestOutputKind`) can ask for
the deltas alone (``DELTA``, what the server's streams use) or for the final output only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One token's log-probability under the model (natural log, raw logits).

    Attributes:
        token_id: the token.
        logprob: ``log_softmax(logits)[token_id]`` in float32.
        rank: 1 for the most likely token of the position (None when not computed).
        decoded: the token's text on its own (for display; may be a partial UTF-8 character).
    """

    token_id: int
    logprob: float
    rank: int | None
    decoded: str


@dataclass
class PositionLogprobs:
    """Log-probabilities at one position: the chosen token and the top-N alternatives."""

    token: TokenLogprob
    top: list[TokenLogprob] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: which of the request's ``n`` sequences this is.
        text: generated text so far (stop strings cut per ``include_stop_str_in_output``).
        token_ids: generated token ids so far.
        finish_reason: None while running, then ``"stop"`` (EOS, stop token or stop string),
            ``"length"`` (max_tokens or the context limit), ``"abort"``, or ``"error"`` (a
            failed engine step: see :class:`~infer.errors.EngineStepError`).
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: per generated token, when the request asked for ``logprobs``.
        cumulative_logprob: sum of the chosen tokens' logprobs.
        delta_text, delta_token_ids, delta_logprobs: what is new since the previous output.
        num_generated_tokens: tokens generated so far, whatever the output carries (a ``DELTA``
            output's ``token_ids`` hold only the new ones: see
            :class:`~infer.sampling.params.RequestOutputKind`); None at construction means
            ``len(token_ids)``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None
    num_generated_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.num_generated_tokens is None:
            self.num_generated_tokens = len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """All sequences of one request.

    Attributes:
        request_id: the id given to :meth:`LLMEngine.add_request`.
        prompt: the prompt text, when the request had one.
        prompt_token_ids: the prompt's tokens.
        prompt_logprobs: per prompt position (the first is None: nothing predicts it), when
            the request asked for ``prompt_logprobs``.
        outputs: one per sequence, ordered by index.
        finished: True when every sequence has finished.
        metrics: timing of the request (seconds, ``time.perf_counter`` clock): ``arrival`` (added),
            ``first_scheduled`` (first admitted by the scheduler), ``first_token``, ``finished``; each
            once it happened.
        num_cached_tokens: prefix caching (phase 7): prompt tokens whose K/V was found in the
            prefix cache at admission (vLLM's field; the server reports it as OpenAI's
            ``usage.prompt_tokens_details.cached_tokens``); None without prefix caching.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int | None = None
