"""Sampling: per-request parameters and the batched sampler (phase 1).

* :class:`SamplingParams`: what one request asks for (vLLM's fields), validated on creation
  (:mod:`.params`); :class:`RequestOutputKind`: what its streamed outputs carry.
* :class:`SamplingTensors`: a batch's parameters as ``[B]`` device tensors (:mod:`.metadata`).
* :func:`sample`: ``[B, V]`` logits to ``[B]`` next tokens plus raw logprobs, one batched
  pipeline for every row (:mod:`.sampler`, whose docstring lists the steps and their sources);
  its steps are the logits processors of :mod:`.logits_processors` (penalties, temperature,
  min-p, top-k, top-p) and the counter-based random streams of :mod:`.rng`; on the GPU it runs
  the Triton kernels of :mod:`.triton_sampler` (phase 8); :mod:`.structured` holds the
  structured-output constraints (JSON schema, regex, choice) and their token masks (phase 13).
"""

from infer.sampling.logits_processors import (
    apply_min_p,
    apply_penalties,
    apply_penalties_sparse,
    apply_temperature,
    apply_top_k,
    apply_top_k_partial,
    apply_top_p,
    apply_top_p_rows,
    suppress_tokens,
)
from infer.sampling.metadata import SamplingTensors
from infer.sampling.params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from infer.sampling.rng import random_uniform, sample_from_probs
from infer.sampling.sampler import SamplerOutput, sample, sample_reference

__all__ = [
    "MAX_LOGPROBS",
    "RequestOutputKind",
    "SamplerOutput",
    "SamplingParams",
    "SamplingTensors",
    "apply_min_p",
    "apply_penalties",
    "apply_penalties_sparse",
    "apply_temperature",
    "apply_top_k",
    "apply_top_k_partial",
    "apply_top_p",
    "apply_top_p_rows",
    "random_uniform",
    "sample",
    "sample_from_probs",
    "sample_reference",
    "suppress_tokens",
]
