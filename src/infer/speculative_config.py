"""Speculative decoding's settings (phase 12): :class:`SpeculativeConfig`, parsed from vLLM's
``speculative_config`` JSON by :meth:`~infer.config.EngineConfig.validate`, which re-exports it."""

from __future__ import annotations

import json
from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram", "draft", "eagle3")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (phase 12), parsed from ``EngineConfig.speculative_config`` (vLLM's keys).

    Attributes:
        method: ``"ngram"`` (prompt lookup: the tokens that followed the latest n-gram's earlier
            occurrence in the prompt and output; Saxena 2023, vLLM's ``ngram``) or ``"draft"`` (a
            smaller model with the same tokenizer; vLLM's ``draft_model`` is accepted as a synonym) or
            ``"eagle3"`` (an EAGLE-3 draft head fed with three of the target's layers' hidden states; Li
            et al., arXiv:2503.01840; :mod:`infer.engine.eagle3`). Left out with a ``model`` given: ``"draft"``.
        num_speculative_tokens: ``k``, the most tokens proposed per sequence per step (>= 1).
        prompt_lookup_max, prompt_lookup_min: ngram: the longest and shortest n-gram matched (vLLM:
            when one is left out it takes the other's value; both left out: 5).
        model: draft: the draft model (a short name, a .gguf file or a Hugging Face directory); eagle3:
            the head's directory (config.json + safetensors, the ``speculators`` or the EAGLE/SGLang layout).
        backoff: (infer's own key, default true) a sequence whose drafts were rejected whole
            ``BACKOFF_AFTER`` rounds in a row pauses speculating for 1, 2, 4, ... up to 16 steps
            (:func:`infer.engine.spec_decode.record_round`), so speculation that never pays costs little;
            false: every step verifies whatever the proposer gives, as vLLM does.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    backoff: bool = True

    KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "backoff")

    @classmethod
    def parse(cls, value: dict | str) -> SpeculativeConfig:
        """Read and check a ``speculative_config`` (a dict, or its JSON text).

        Raises:
            ValueError: not a JSON object, an unknown key, an unknown method, ``k < 1``, lookup sizes out
                of order, a draft without a model (each message names the key).
        """
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object (a dict), got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; supported: "
                             f"{', '.join(cls.KEYS)}")
        v = dict(value)
        method = v.get("method") or ("draft" if v.get("model") else None)
        method = "draft" if method == "draft_model" else method
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                             f"{v.get('method')!r} (other methods are not implemented)")
        k = v.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer >= 1, got {k!r}")
        backoff = v.get("backoff", True)
        if not isinstance(backoff, bool):
            raise ValueError(f"speculative_config: backoff must be true or false, got {backoff!r}")
        lo, hi = v.get("prompt_lookup_min"), v.get("prompt_lookup_max")
        if method == "ngram":
            lo, hi = (lo if lo is not None else hi or 5), (hi if hi is not None else lo or 5)
            for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {n!r}")
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min={lo} > prompt_lookup_max={hi}")
            if v.get("model") is not None:
                raise ValueError("speculative_config: method 'ngram' takes no model (it looks tokens up in the "
                                 "prompt); use method 'draft' for a draft model")
        elif method == "eagle3":
            if lo is not None or hi is not None:
                raise ValueError("speculative_config: prompt_lookup_min/max are for method 'ngram'")
            if not v.get("model") or not isinstance(v["model"], str):
                raise ValueError("speculative_config: method 'eagle3' needs model (the EAGLE-3 head's directory: "
                                 "config.json and safetensors)")
        else:
            if lo is not None or hi is not None:
                raise ValueError("speculative_config: prompt_lookup_min/max are for method 'ngram'")
            if not v.get("model") or not isinstance(v["model"], str):
                raise ValueError("speculative_config: method 'draft' needs model (the draft model: a short name, "
                                 "a .gguf file or a Hugging Face directory)")
        return cls(method, k, hi, lo, v.get("model"), backoff)
