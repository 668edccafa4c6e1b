"""flash-linear-attention's chunked gated delta rule: phase 17's optional prefill form on the GPU.

:func:`chunk_gated_delta_rule_varlen` has the signature and the values of
:func:`infer.kernels.gated_delta_reference.chunk_gated_delta_rule_varlen` (read its docstring: the UT
transform, the chunk-to-chunk recurrence); here the chunks run in flash-linear-attention's Triton kernels
(``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, Yang et al., arXiv:2412.06464; the kernels vLLM and
SGLang serve Qwen3-Next and Qwen3.5 with), the sequences side by side through its ``cu_seqlens``. The
plain-PyTorch form materializes ``[H, chunks, C, C]`` matrices and solves them with
``torch.linalg.solve_triangular``, several dozen launches a layer; these are a few fused kernels.

Chosen with ``EngineConfig.linear_attention_backend = "fla"`` (CUDA, ``pip install flash-linear-attention
fla-core``). The kernels read q, k, v in the model's dtype (bf16) and accumulate in float32. The public
kernel returns only final states, so a step that takes prefix-caching snapshots inside a prefill
(``states_out`` with counts) cuts the sequences at them and runs the pieces in rounds
(:func:`~infer.kernels.gated_delta_reference.chunk_rule_in_rounds`): the same kernels everywhere, so a
prefix hit that starts from a snapshot repeats a cold run's pieces exactly. Each call costs about 1 ms of
host time on an H200 (its kernels take 0.06-0.18 ms at 256-2,048 tokens of Qwen3.5-4B), and each snapshot
inside a step adds a call per layer: with prefix caching this backend's prefills are slower than the
reference's one pass (the phase 17 page has the numbers).
"""

from __future__ import annotations

import functools

import torch

from infer.kernels import gated_delta_reference as reference

__all__ = ["chunk_gated_delta_rule_varlen", "prefill_rule"]


def chunk_gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, seq_lens: list[int],
                                  initial_states: list[torch.Tensor | None] | None = None, scale: float | None = None,
                                  chunk_size: int = reference.CHUNK_SIZE,
                                  states_out: list[dict[int, torch.Tensor]] | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~infer.kernels.gated_delta_reference.chunk_gated_delta_rule_varlen` in flash-linear-attention's
    kernels: ``q, k [T, H, Dk]`` (L2-normalized, one key head per value head), ``v [T, H, Dv]``, ``g, beta
    [T, H]`` (``g`` the log of the decay), ``T = sum(seq_lens)``, on a CUDA device.

    Returns:
        ``(o [T, H, Dv] float32, final states [B, H, Dk, Dv] float32)``.

    Raises:
        ValueError: lengths that do not add up to ``T``.
    """
    if states_out and any(states_out):  # snapshots inside the prefills: the sequences cut at them
        return reference.chunk_rule_in_rounds(_fla_rule, q, k, v, g, beta, seq_lens, initial_states, scale,
                                              chunk_size, states_out)
    return _fla_rule(q, k, v, g, beta, seq_lens, initial_states, scale, chunk_size)


def prefill_rule(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int, seq_lens: list[int],
                 initial_states: list[torch.Tensor | None] | None = None,
                 states_out: list[dict[int, torch.Tensor]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`infer.kernels.gated_delta_reference.prefill_rule` with fla's chunked rule, q, k and v in the
    model's dtype (``y``'s)."""
    return reference.prefill_rule(y, a, b, A_log, dt_bias, num_k_heads, head_k_dim, num_v_heads, head_v_dim,
                                  seq_lens, initial_states, states_out, rule=chunk_gated_delta_rule_varlen,
                                  dtype=y.dtype)


def _fla_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              seq_lens: list[int], initial_states: list[torch.Tensor | None] | None, scale: float | None,
              chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of fla's ``chunk_gated_delta_rule`` over the sequences side by side (``cu_seqlens``)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    t, h, dk = k.shape
    dv = v.shape[-1]
    reference.check_seq_lens(seq_lens, t)
    h0 = reference.stacked_initial_states(initial_states, len(seq_lens), h, dk, dv, q.device)
    bounds, bounds_dev = _cu_seqlens(tuple(int(n) for n in seq_lens), q.device)
    q, k, v = (x.contiguous()[None] for x in (q, k, v))  # ([1, T, H, D]: cu_seqlens' layout)
    o, final = chunk_gated_delta_rule(q, k, v, g.float().contiguous()[None], beta.to(v.dtype).contiguous()[None],
                                      scale=dk ** -0.5 if scale is None else scale, initial_state=h0,
                                      output_final_state=True, cu_seqlens=bounds_dev, cu_seqlens_cpu=bounds,
                                      chunk_size=chunk_size)
    return o[0].float(), final.float()


@functools.lru_cache(maxsize=8)
def _cu_seqlens(seq_lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens`` on the host and on ``device``, the same two tensors for every layer of a step: fla
    caches what it derives from them (chunk indices and offsets) by the tensors' identity, so its later
    layers skip that work and its host-to-device copies (read only)."""
    bounds = torch.tensor([0, *seq_lens], dtype=torch.long).cumsum(0)
    return bounds, bounds.to(device)
