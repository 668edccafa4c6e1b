"""Attention through the Triton kernels of :mod:`infer.kernels` (the CUDA default).

The same steps as the plain-PyTorch backend, each one kernel launch per layer:

1. ``reshape_and_cache`` (:mod:`infer.kernels.kv_cache_write`): scatter the step's new K/V into
   their cache slots;
2. ``paged_decode_attention`` (:mod:`infer.kernels.decode_attention`): the step's decode sequences
   (first in the batch), split-KV;
3. ``paged_prefill_attention`` (:mod:`infer.kernels.prefill_attention`): the remaining sequences,
   variable-length, reading any cached prefix from the blocks (split over the keys too, when a few
   new tokens meet a long prefix).

The contiguous cache is a paged cache with one block per sequence, so the same kernels serve
both. An FP8 cache (phase 11) passes each layer's ``k_scale``/``v_scale`` to the three kernels. A cache-less forward (parity gate, memory profiling) uses the plain-PyTorch path.
"""

from __future__ import annotations

import functools

import torch

from infer.attention.metadata import AttentionMetadata
from infer.attention.torch_backend import cacheless_attention, paged_attention


class TritonAttentionBackend:
    """Triton kernels over the KV cache (paged or contiguous); see the module docstring."""

    name = "triton"
    # the fused forward (phase 8) stores K/V in its RoPE kernel, then passes kv_written=True
    cache_write_in_rope = True

    def __init__(self, device: torch.device | str) -> None:
        # these import triton
        from infer.kernels import decode_attention, kv_cache_write, prefill_attention

        self.kv_cache_write = kv_cache_write
        self.decode_attention = decode_attention
        self.prefill_attention = prefill_attention
        self.device = torch.device(device)

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None, kv_written: bool = False) -> torch.Tensor:
        """Write this step's K/V to the cache (unless ``kv_written``: the caller stored them), then attend.

        Args:
            q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]``.
        Returns:
            ``[T, num_heads, head_dim]``.
        """
        cache = meta.kv_cache
        if cache is None:
            return cacheless_attention(q, k, v, meta, scale, window)
        k_cache, v_cache = cache.layer(layer_idx)
        scales = cache.scales(layer_idx)  # an FP8 cache's (k_scale, v_scale), else None
        if not kv_written:
            if cache.needs_calibration(layer_idx):
                cache.calibrate(layer_idx, k, v)
            self.kv_cache_write.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, *(scales or ()))
        # flash-decoding split plan: once per step and window size, from host numbers only (no sync)
        key = ("decode_fn", window)
        decode = meta.scratch.get(key)
        if decode is None and meta.num_decodes:
            max_len = max(meta.seq_lens_cpu[: meta.num_decodes])
            if window is not None:
                max_len = min(max_len, window)
            splits, min_keys = self.decode_attention.decode_split_plan(
                meta.decode_split_batch or meta.num_decodes, k.shape[1], max_len, self.device)
            decode = meta.scratch[key] = functools.partial(self.decode_attention.paged_decode_attention,
                                                           num_splits=splits, min_split_keys=min_keys)
        if scales is not None:  # the layer's own scales (the split plan above is shared by the layers)
            decode = decode and functools.partial(decode, k_scale=scales[0], v_scale=scales[1])
        # extends split their keys too when they are few programs over long contexts (also from host
        # numbers: under a CUDA graph, the capture's context bound)
        key = ("prefill_fn", window)
        prefill = meta.scratch.get(key)
        if prefill is None:
            ctx = max(meta.seq_lens_cpu[meta.num_decodes:], default=0)
            if window is not None:
                ctx = min(ctx, window + meta.max_query_len)
            prefill = meta.scratch[key] = functools.partial(self.prefill_attention.paged_prefill_attention,
                                                            max_context=ctx)
        if scales is not None:
            prefill = functools.partial(prefill, k_scale=scales[0], v_scale=scales[1])
        return paged_attention(q, k_cache, v_cache, meta, scale, window, decode, prefill)
