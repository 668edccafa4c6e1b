"""Writing a step's new K/V into the paged KV cache (phase 5): vLLM's ``reshape_and_cache``, in Triton.

The cache of one layer is ``k_cache``, ``v_cache`` of shape ``[num_blocks, block_size, num_kv_heads,
head_dim]`` (vLLM v1's and FlashAttention's layout). Token ``p`` of a sequence lives in block
``block_table[p // block_size]`` at offset ``p % block_size``; its flat *slot* is ``block *
block_size + offset`` (PagedAttention, Kwon et al., SOSP 2023, arXiv:2309.06180: the blocks of a
sequence need not be contiguous, so memory is allocated a block at a time). Before the attention of
a step reads the cache, :func:`reshape_and_cache` scatters the step's new keys and values into their
slots, which the engine computed on the host (``AttentionMetadata.slot_mapping``).

Sibling modules: :mod:`infer.kernels.decode_attention` and :mod:`infer.kernels.prefill_attention`
read what this writes; :mod:`infer.kernels.attention_reference` holds the plain-PyTorch
``reshape_and_cache`` (same signature) that the tests compare against and the CPU backend runs;
the fused forward (phase 8) writes K/V in its RoPE kernel instead
(:func:`infer.kernels.fused_triton.qk_norm_rope`). :mod:`infer.attention.triton_backend` calls
these kernels for a model.

Importing this module works on any machine; launching needs a CUDA tensor, or CPU tensors with
``TRITON_INTERPRET=1`` set before Triton is imported (the tests' conftest does it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer.kernels.triton_common import check_kv_scales, check_launchable, check_paged_cache, to_fp8_e4m3

__all__ = ["reshape_and_cache"]


@triton.jit(do_not_specialize_on_alignment=["key_ptr", "value_ptr", "slot_ptr"])
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
):
    # One program per new token: copy its [num_kv_heads, head_dim] keys and values into its slot
    # (an FP8 cache: x / scale rounded to e4m3, the layer's scales read from memory, not baked in).
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token (vLLM's convention): nothing to write
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    src_k = key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = block * stride_cb + offset * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if FP8:
        k = to_fp8_e4m3(k.to(tl.float32), tl.load(k_scale_ptr), k_cache_ptr.dtype.element_ty)
        v = to_fp8_e4m3(v.to(tl.float32), tl.load(v_scale_ptr), v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each new token's K/V into its cache slot (vLLM's ``reshape_and_cache``, Kwon et al. 2023).

    Args:
        key, value: ``[T, num_kv_heads, head_dim]``, the cache's dtype (an FP8 cache: float32, float16
            or bfloat16, stored as ``x / scale`` rounded to e4m3); may be strided views (e.g.
            slices of a fused qkv output), only the last dimension must be contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same shape, dtype and
            strides, last dimension contiguous. Written in place.
        slot_mapping: int64 ``[T]``: ``key[t]`` goes to flat slot ``slot_mapping[t]`` (block ``slot //
            block_size``, offset ``slot % block_size``); negative slots are skipped (padding).
        k_scale, v_scale: an FP8 cache's float32 ``[1]`` scales of this layer (None: 1.0); ignored otherwise.

    Raises:
        ValueError: wrong rank, shapes, dtypes or devices, a non-contiguous last dimension, bad scales, or
            ``slot_mapping`` not int64.
    """
    check_paged_cache(k_cache, v_cache)
    for name, x in (("key", key), ("value", value)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be [T, num_kv_heads, head_dim], got shape {tuple(x.shape)}")
        if tuple(x.shape[1:]) != tuple(k_cache.shape[2:]):
            raise ValueError(f"{name} heads/head_dim {tuple(x.shape[1:])} do not match the cache "
                             f"{tuple(k_cache.shape[2:])}")
        if x.dtype != k_cache.dtype and (k_cache.dtype != torch.float8_e4m3fn or not x.dtype.is_floating_point):
            raise ValueError(f"{name} dtype {x.dtype} differs from the cache dtype {k_cache.dtype}")
        if x.device != k_cache.device:
            raise ValueError(f"{name} is on {x.device}, the cache on {k_cache.device}")
        if x.shape[2] > 1 and x.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride {x.stride()})")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} tokens, value {value.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    if slot_mapping.device != k_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the cache on {k_cache.device}")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    k_scale, v_scale = check_kv_scales(k_cache, k_scale, v_scale)
    check_launchable(k_cache)
    _, block_size, hkv, d = k_cache.shape
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, H_PAD=triton.next_power_of_2(hkv), D_PAD=triton.next_power_of_2(d),
        BLOCK_SIZE=block_size, FP8=k_cache.dtype == torch.float8_e4m3fn, num_warps=4 if hkv * d >= 1024 else 1,
    )
