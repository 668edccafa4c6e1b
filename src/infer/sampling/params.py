"""Per-request sampling parameters.

:class:`SamplingParams` has the shape of vLLM's ``SamplingParams`` (same field names, same
defaults, same meaning), so that a request for the OpenAI-compatible server maps onto it
field by field. Every value is checked once, when the object is built: an invalid value raises
:class:`ValueError` whose message names the field, the allowed range and the value received.
The sampler itself (:mod:`infer.sampling.sampler`) then never re-checks anything.
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Largest ``logprobs`` / ``prompt_logprobs`` a request may ask for (OpenAI's limit is 20).
MAX_LOGPROBS = 20
#: ``temperature``'s range. The sampler divides float32 logits by it: above 100 (1e39 is inf in float32)
#: or near 0 (``1 / 1e-39`` is inf) a row of finite logits becomes inf or NaN. A positive temperature
#: below ``MIN_TEMPERATURE`` is raised to it, as vLLM does (it samples almost greedily already).
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
#: ``repetition_penalty``'s range: the penalty divides or multiplies logits, so 1e-50 (0 in float32)
#: would make them inf.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
#: ``presence_penalty`` and ``frequency_penalty`` are in ``[-MAX_PENALTY, MAX_PENALTY]`` (OpenAI's range).
MAX_PENALTY = 2.0


class RequestOutputKind(enum.IntEnum):
    """What each :class:`~infer.outputs.RequestOutput` of a streamed request carries (vLLM's
    ``RequestOutputKind``, same names and values).

    * ``CUMULATIVE``: everything so far (``text``, ``token_ids``, ``logprobs``), plus the
      ``delta_*`` fields. Simple to read, but each output copies the whole output so far: O(length)
      per request per step.
    * ``DELTA``: only what is new since the previous output: ``text``, ``token_ids`` and
      ``logprobs`` equal ``delta_text``, ``delta_token_ids`` and ``delta_logprobs``, the final
      output included. O(new tokens) per output; the reader accumulates what it needs (the
      server's streams do: they only forward deltas and count tokens).
    * ``FINAL_ONLY``: no output until the request finishes, then one complete output (what a
      non-streamed server request waits for).

    ``LLMEngine.step(stream=False)`` makes final outputs only, complete, whatever the kind.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_OUTPUT_KINDS = ", ".join(f"{k.value} ({k.name})" for k in RequestOutputKind)  # (for error messages)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _type_error(name: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops (vLLM's field names and defaults).

    Attributes:
        n: number of completions to generate for the prompt (>= 1). Each completion is its
            own sequence; the engine gives each one its own seed.
        max_tokens: most tokens to generate (>= 1), or ``None`` for "until the context is
            full".
        min_tokens: EOS and ``stop_token_ids`` are banned until this many tokens have been
            generated (0 <= min_tokens <= max_tokens).
        temperature: softmax temperature in [0, 100]. ``0`` means greedy (argmax); a positive value
            below 0.01 is raised to 0.01 (vLLM's rule: float32 logits divided by less overflow).
        top_k: keep the ``top_k`` most likely tokens; ``-1`` or ``0`` disables it (``0`` is
            normalised to ``-1``). Otherwise >= 1.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability mass is
            >= ``top_p``. In (0, 1]; ``1`` disables it.
        min_p: keep tokens whose probability is >= ``min_p`` times the top token's. In
            [0, 1]; ``0`` disables it.
        repetition_penalty: CTRL-style penalty on every token of prompt + output, in
            [0.01, 100]; ``1`` disables it, > 1 discourages repetition.
        presence_penalty: OpenAI presence penalty over output tokens, in [-2, 2].
        frequency_penalty: OpenAI frequency penalty over output tokens, in [-2, 2].
        seed: an ``int`` makes the request's random stream reproducible; ``None`` lets the
            engine pick one.
        stop: stop strings; ``None``, a ``str`` or a list of non-empty ``str``. Always a
            ``list[str]`` after construction.
        stop_token_ids: token ids that end the sequence (in addition to EOS); ``None`` or a
            list of ints >= 0. Always a ``list[int]`` after construction.
        ignore_eos: keep generating after EOS.
        logprobs: ``None``, or how many top alternatives (0..20) to return with the logprob of
            each generated token (``0``: only the chosen token's logprob).
        prompt_logprobs: ``None``, or how many top alternatives (0..20) to return for every
            prompt token.
        skip_special_tokens: leave special tokens out of the detokenized text.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        structured_outputs: ``None``, or the output's constraint (phase 13): a
            :class:`~infer.sampling.structured.StructuredOutputsParams` or a dict of its fields
            (``{"json": schema}``, ``{"regex": r}``, ``{"choice": [...]}``,
            ``{"json_object": True}``). Always the object (or ``None``) after construction.
        output_kind: what each streamed output carries (:class:`RequestOutputKind`: an int 0-2
            or the enum; ``CUMULATIVE`` by default). The server asks ``DELTA`` for streamed
            requests and ``FINAL_ONLY`` for the others.

    Raises:
        ValueError: for any invalid value or wrong type; the message names the field.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # --- counts
        self.n = self._check_int("n", self.n, low=1)
        if self.max_tokens is not None:
            self.max_tokens = self._check_int("max_tokens", self.max_tokens, low=1, none_ok=True)
        self.min_tokens = self._check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

        # --- the distribution transforms
        t = self._check_real("temperature", self.temperature)
        if not (0.0 <= t <= MAX_TEMPERATURE):  # also false for nan
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {t}")
        self.temperature = max(t, MIN_TEMPERATURE) if t > 0.0 else 0.0

        if not _is_int(self.top_k):
            raise _type_error("top_k", "an int (-1 or 0 to disable, or >= 1)", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        self.top_k = -1 if self.top_k == 0 else int(self.top_k)

        p = self._check_real("top_p", self.top_p)
        if not (0.0 < p <= 1.0):  # also false for nan
            raise ValueError(f"top_p must be in (0, 1], got {p}")
        self.top_p = p

        m = self._check_real("min_p", self.min_p)
        if not (0.0 <= m <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {m}")
        self.min_p = m

        r = self._check_real("repetition_penalty", self.repetition_penalty)
        if not (MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY):
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {r}")
        self.repetition_penalty = r

        for name in ("presence_penalty", "frequency_penalty"):
            v = self._check_real(name, getattr(self, name))
            if not (-MAX_PENALTY <= v <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [{-MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}")
            setattr(self, name, v)

        # --- randomness
        if self.seed is not None and not _is_int(self.seed):
            raise _type_error("seed", "an int or None", self.seed)
        if self.seed is not None:
            self.seed = int(self.seed)

        # --- stopping
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _type_error(name, "a bool", getattr(self, name))

        # --- logprobs
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is None:
                continue
            if not _is_int(v):
                raise _type_error(name, f"None or an int in [0, {MAX_LOGPROBS}]", v)
            if not (0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v}")
            setattr(self, name, int(v))

        # --- structured outputs (phase 13)
        if self.structured_outputs is not None:
            from infer.sampling.structured import StructuredOutputsParams

            so = self.structured_outputs
            if isinstance(so, Mapping):
                try:
                    so = StructuredOutputsParams(**dict(so))
                except TypeError as e:
                    raise ValueError(f"structured_outputs: {e}") from None
            if not isinstance(so, StructuredOutputsParams):
                raise _type_error("structured_outputs", "None, a StructuredOutputsParams or a dict", so)
            self.structured_outputs = so

        # --- outputs
        if not _is_int(self.output_kind):
            raise _type_error("output_kind", f"a RequestOutputKind: {_OUTPUT_KINDS}", self.output_kind)
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be one of {_OUTPUT_KINDS}, got {self.output_kind}") from None

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _check_int(name: str, value: Any, *, low: int, none_ok: bool = False) -> int:
        allowed = f"an int >= {low}" + (" or None" if none_ok else "")
        if not _is_int(value):
            raise _type_error(name, allowed, value)
        if value < low:
            raise ValueError(f"{name} must be {allowed}, got {value}")
        return int(value)

    @staticmethod
    def _check_real(name: str, value: Any) -> float:
        if not _is_real(value):
            raise _type_error(name, "a number (int or float)", value)
        return float(value)

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise _type_error("stop", "None, a str or a list of str", stop)
        out = []
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise _type_error(f"stop[{i}]", "a non-empty str", s)
            if not s:
                raise ValueError(f"stop[{i}] must be a non-empty str, got ''")
            out.append(s)
        return out

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise _type_error("stop_token_ids", "None or a list of ints >= 0", ids)
        out = []
        for i, tok in enumerate(ids):
            if not _is_int(tok):
                raise _type_error(f"stop_token_ids[{i}]", "an int >= 0", tok)
            if tok < 0:
                raise ValueError(f"stop_token_ids[{i}] must be an int >= 0, got {tok}")
            out.append(int(tok))
        return out

    # ------------------------------------------------------------------ API

    @property
    def greedy(self) -> bool:
        """``True`` when ``temperature == 0``: the sampler takes the argmax."""
        return self.temperature == 0.0

    @classmethod
    def field_names(cls) -> list[str]:
        """The constructor's keyword names, in declaration order."""
        return [f.name for f in dataclasses.fields(cls) if f.init]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a mapping of field name to value (e.g. a parsed JSON request body).

        Raises:
            ValueError: ``d`` is not a mapping, has keys that are not fields (the message lists
                them and the valid field names), or holds an invalid value.
        """
        if not isinstance(d, Mapping):
            raise _type_error("SamplingParams.from_dict argument", "a mapping", d)
        valid = cls.field_names()
        unknown = sorted(str(k) for k in d if k not in valid)
        if unknown:
            raise ValueError(
                f"unknown SamplingParams field(s): {', '.join(unknown)}; valid fields are: {', '.join(valid)}"
            )
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """The constructor's keywords and their (normalised) values."""
        d = {name: getattr(self, name) for name in self.field_names()}
        if self.structured_outputs is not None:
            d["structured_outputs"] = self.structured_outputs.to_dict()
        return d
