"""Sampling: per-request parameters and the batched sampler (phase 1).

* :class:`SamplingParams`: what one request asks for (vLLM's fields), validated on creation;
  :class:`RequestOutputKind`: what its streamed outputs carry.
* :class:`SamplingTensors`: a batch's parameters as ``[B]`` device tensors.
* :func:`sample`: ``[B, V]`` logits to ``[B]`` next tokens plus raw logprobs, one batched
  pipeline for every row (see :mod:`infer.sampling.sampler` for the transforms and sources);
  on the GPU it runs the Triton kernels of :mod:`infer.sampling.triton_sampler` (phase 8).
"""

from infer.sampling.params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from infer.sampling.sampler import (
    SamplerOutput,
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_penalties_sparse,
    apply_temperature,
    apply_top_k,
    apply_top_k_partial,
    apply_top_p,
    apply_top_p_rows,
    random_uniform,
    sample,
    sample_from_probs,
    sample_reference,
    suppress_tokens,
)

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
