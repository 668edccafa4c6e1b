"""SamplingParams: defaults, normalisation, and a precise ValueError for every invalid value."""

from __future__ import annotations

import numpy as np
import pytest

from infer.sampling import SamplingParams

NAN = float("nan")
INF = float("inf")


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.min_tokens) == (1, 16, 0)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, -1, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.skip_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert p.logprobs is None and p.prompt_logprobs is None
    assert not p.greedy


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(temperature=0).greedy
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    # numpy scalars are numbers too
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int64(7))
    assert p.temperature == 0.5 and p.top_k == 3 and p.seed == 7 and type(p.seed) is int


def test_valid_edges():
    SamplingParams(top_p=1.0, min_p=1.0, min_tokens=16, max_tokens=16)
    SamplingParams(max_tokens=None, min_tokens=10_000)
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01)
    SamplingParams(repetition_penalty=100, temperature=100)
    SamplingParams(logprobs=0, prompt_logprobs=20, seed=-5)
    SamplingParams(seed=2**70)


INVALID = [
    ("n", {"n": 0}),
    ("n", {"n": 1.0}),
    ("n", {"n": True}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": -3}),
    ("max_tokens", {"max_tokens": 2.5}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 17}),  # > max_tokens = 16
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": NAN}),
    ("temperature", {"temperature": INF}),
    ("temperature", {"temperature": "hot"}),
    ("temperature", {"temperature": True}),
    ("temperature", {"temperature": None}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 2.0}),
    ("top_k", {"top_k": True}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": -0.5}),
    ("top_p", {"top_p": NAN}),
    ("top_p", {"top_p": "0.9"}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("min_p", {"min_p": NAN}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("repetition_penalty", {"repetition_penalty": INF}),
    ("repetition_penalty", {"repetition_penalty": NAN}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.01}),
    ("presence_penalty", {"presence_penalty": NAN}),
    ("frequency_penalty", {"frequency_penalty": 3}),
    ("frequency_penalty", {"frequency_penalty": -INF}),
    ("frequency_penalty", {"frequency_penalty": [1]}),
    ("seed", {"seed": 1.5}),
    ("seed", {"seed": True}),
    ("seed", {"seed": "42"}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop", {"stop": [1]}),
    ("stop", {"stop": 5}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": ["2"]}),
    ("stop_token_ids", {"stop_token_ids": [True]}),
    ("stop_token_ids", {"stop_token_ids": 3}),
    ("ignore_eos", {"ignore_eos": "yes"}),
    ("skip_special_tokens", {"skip_special_tokens": 1}),
    ("include_stop_str_in_output", {"include_stop_str_in_output": None}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 21}),
    ("logprobs", {"logprobs": 2.0}),
    ("logprobs", {"logprobs": True}),
    ("prompt_logprobs", {"prompt_logprobs": 21}),
    ("prompt_logprobs", {"prompt_logprobs": -1}),
]


@pytest.mark.parametrize("field,kwargs", INVALID, ids=[f"{f}={v}" for f, v in INVALID])
def test_invalid_values_raise_naming_the_field(field, kwargs):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(field), str(info.value)


def test_messages_are_precise():
    cases = [
        ({"temperature": NAN}, "temperature must be in [0, 100], got nan"),
        ({"temperature": -1}, "temperature must be in [0, 100], got -1.0"),
        ({"temperature": 1e39}, "temperature must be in [0, 100], got 1e+39"),  # inf in float32
        ({"temperature": "hot"}, "temperature must be a number (int or float), got 'hot' (str)"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0"),
        ({"min_p": 2}, "min_p must be in [0, 1], got 2.0"),
        ({"top_k": -5}, "top_k must be -1 or 0 (disabled) or >= 1, got -5"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in [0.01, 100], got 0.0"),
        ({"repetition_penalty": 1e-50}, "repetition_penalty must be in [0.01, 100], got 1e-50"),  # 0 in float32
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0"),
        ({"n": 0}, "n must be an int >= 1, got 0"),
        ({"max_tokens": 0}, "max_tokens must be an int >= 1 or None, got 0"),
        ({"min_tokens": 20}, "min_tokens must be <= max_tokens (16), got 20"),
        ({"logprobs": 21}, "logprobs must be None or an int in [0, 20], got 21"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids[1] must be an int >= 0, got -2"),
        ({"seed": True}, "seed must be an int or None, got True (bool)"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as info:
            SamplingParams(**kwargs)
        assert str(info.value) == message


def test_a_tiny_positive_temperature_is_raised_to_the_smallest_one_that_stays_finite():
    """vLLM's rule: float32 logits divided by a temperature below 0.01 may overflow (1 / 1e-39 is inf in
    float32), and sampling that cold is greedy in all but name."""
    assert SamplingParams(temperature=1e-39).temperature == 0.01
    assert SamplingParams(temperature=0.005).temperature == 0.01
    assert SamplingParams(temperature=0).temperature == 0.0 and SamplingParams(temperature=0.02).temperature == 0.02


def test_from_dict():
    p = SamplingParams.from_dict({"temperature": 0.3, "top_k": 5, "stop": "x", "max_tokens": None})
    assert p == SamplingParams(temperature=0.3, top_k=5, stop=["x"], max_tokens=None)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict({}) == SamplingParams()


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError) as info:
        SamplingParams.from_dict({"temperature": 0.5, "top_q": 0.9, "best_of": 2})
    msg = str(info.value)
    assert "best_of, top_q" in msg
    for name in SamplingParams.field_names():
        assert name in msg.split("valid fields are:")[1]


def test_from_dict_validates_values_and_type():
    with pytest.raises(ValueError, match="^top_p"):
        SamplingParams.from_dict({"top_p": 2})
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict([("temperature", 1.0)])


def test_field_names():
    assert SamplingParams.field_names() == [
        "n", "max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p",
        "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
        "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "skip_special_tokens",
        "include_stop_str_in_output", "structured_outputs", "output_kind",
    ]  # fmt: skip
