"""Attention through the Triton kernels of :mod:`infer.attention.triton_ops` (the CUDA default).

The same steps as the plain-PyTorch backend, each one kernel launch per layer:

1. ``reshape_and_cache``: scatter the step's new K/V into their cache slots;
2. ``paged_decode_attention``: the step's decode sequences (first in the batch), split-KV;
3. ``paged_prefill_attention``: the remaining sequences, variable-length, reading any cached
   prefix from the blocks.

The contiguous cache is a paged cache with one block per sequence, so the same kernels serve
both. A cache-less forward (parity gate, memory profiling) uses the plain-PyTorch path.
"""

from __future__ import annotations

import torch

from infer.attention.metadata import AttentionMetadata
from infer.attention.torch_backend import cacheless_attention, paged_attention


def decode_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      min_keys_per_split: int = 256, max_splits: int = 32) -> int:
    """Split-KV factor of a decode step (flash-decoding, Dao et al. 2023), chosen on the host.

    Enough programs (``num_decodes * num_kv_heads * splits``) to give every SM two, but no split
    shorter than ``min_keys_per_split`` keys (each split's partial result costs a write and a
    combine). Returns 1 when the batch alone fills the GPU.
    """
    programs = num_decodes * num_kv_heads
    want = -(-2 * num_sms // max(programs, 1))
    by_len = max(1, max_seq_len // min_keys_per_split)
    return max(1, min(want, by_len, max_splits))


class TritonAttentionBackend:
    """Triton kernels over the KV cache (paged or contiguous); see the module docstring."""

    name = "triton"

    def __init__(self, device: torch.device | str) -> None:
        from infer.attention import triton_ops  # imports triton

        self.ops = triton_ops
        dev = torch.device(device)
        self.num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None) -> torch.Tensor:
        """Write this step's K/V to the cache, then attend.

        Args:
            q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]``.
        Returns:
            ``[T, num_heads, head_dim]``.
        """
        cache = meta.kv_cache
        if cache is None:
            return cacheless_attention(q, k, v, meta, scale, window)
        k_cache, v_cache = cache.layer(layer_idx)
        self.ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        key = ("num_splits", window)
        splits = meta.scratch.get(key)
        if splits is None and meta.num_decodes:  # once per step and window size, from host numbers only
            max_len = max(meta.seq_lens_cpu[: meta.num_decodes])
            if window is not None:
                max_len = min(max_len, window)
            splits = meta.scratch[key] = decode_num_splits(meta.num_decodes, k.shape[1], max_len, self.num_sms)
        return paged_attention(q, k_cache, v_cache, meta, scale, window, self.ops.paged_decode_attention,
                               self.ops.paged_prefill_attention, num_splits=splits)
