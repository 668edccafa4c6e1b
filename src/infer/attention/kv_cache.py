"""The KV cache tensors: a pool of blocks per layer.

Every layer's keys and values live in ``[num_blocks, block_size, num_kv_heads, head_dim]``
tensors (vLLM v1's and FlashAttention's layout). A token's K/V is at flat *slot*
``block * block_size + offset``; which blocks a sequence owns (its *block table*) is decided by
the scheduler's :class:`~infer.engine.kv_cache_manager.KVCacheManager`, and writing a step's
new K/V is one scatter through the *slot mapping* (``reshape_and_cache`` in vLLM's terms).

Two layouts, one class (``EngineConfig.kv_cache``):

* ``"contiguous"`` (phases 1-4): ``block_size = max_model_len``, one block ("row") per
  sequence, reserved whole at admission. Simple, and the attention can read a sequence's
  context as one slice; the cost is fragmentation, every row being sized for the longest
  possible sequence (measured in docs/phases/05-paged-kv.md).
* ``"paged"`` (phase 5, PagedAttention, Kwon et al., SOSP 2023): small blocks (16 tokens by
  default) taken as a sequence grows; the attention walks the block table.

Two memory orders of the same ``[num_layers, num_blocks, ...]`` views (``block_major``): the
default keeps each layer's blocks together (``k[layer]`` is one contiguous tensor); the
*block-major* order (phase 10, KV offload) keeps each block's K and V of every layer together,
so that copying one block to or from the host tier is one large contiguous copy instead of
``2 * num_layers`` small ones (vLLM's offloading connector made the same change).

An FP8 cache (phase 11, ``EngineConfig.kv_cache_dtype='fp8'``, ``cache_dtype=torch.float8_e4m3fn``)
stores ``x / scale`` in one byte per value, with one float32 scale per layer for K and one for V
(:attr:`KVCache.k_scale`, :attr:`KVCache.v_scale`: 1.0, vLLM's default for a checkpoint without
scales, or calibrated from the first forward that writes the cache: :meth:`KVCache.calibrate`). The
writers quantize, the readers multiply by the scale (:mod:`infer.kernels.attention_reference`).
"""

from __future__ import annotations

import contextlib

import torch

from infer.kernels.attention_reference import FP8_KV_DTYPE, dequantize_kv, quantize_kv

#: calculate_kv_scales: ``scale = max|x| / constant`` of the first forward's K and V (vLLM's
#: K_SCALE_CONSTANT and V_SCALE_CONSTANT): below e4m3's 448, leaving room for later tokens larger than
#: the first prompt's
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0

_LAZY_ZERO_BYTES = 128 << 20  # CPU caches at least this big (k + v) come from fresh zero pages


class KVCache:
    """``num_blocks`` blocks of ``block_size`` token slots, for every layer.

    Storage: ``k`` and ``v`` of shape ``[num_layers, num_blocks, block_size, num_kv_heads,
    head_dim]`` in ``cache_dtype`` (default ``dtype``) on ``device``; ``2 * num_layers * num_blocks *
    block_size * num_kv_heads * head_dim * itemsize`` bytes (:attr:`nbytes`).

    Args:
        contiguous: True when every sequence owns exactly one block (the contiguous cache); the
            plain-PyTorch attention then reads a sequence's context as one slice.
        block_major: store the cache as one ``[num_blocks, 2, num_layers, block_size,
            num_kv_heads, head_dim]`` tensor (:attr:`blocks`; ``blocks[b]`` is block ``b``'s K and V
            of every layer, contiguous) and make ``k``/``v`` strided views of it with the usual
            shape. The Triton kernels take strides and read either order.
        cache_dtype: the storage dtype, ``dtype`` (the model's, what K/V are computed and read in) by
            default; ``torch.float8_e4m3fn``: an FP8 cache with per-layer scales (:attr:`k_scale`,
            :attr:`v_scale`, float32 ``[num_layers]`` on ``device``, all 1.0 until set or calibrated).
        calibrate: with an FP8 cache, set each layer's scales from the first K/V written to it
            (:meth:`calibrate`; ``EngineConfig.calculate_kv_scales``).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        contiguous: bool = False,
        block_major: bool = False,
        cache_dtype: torch.dtype | None = None,
        calibrate: bool = False,
    ) -> None:
        self.dtype = dtype  # what K/V are computed in and read back as
        dtype = cache_dtype or dtype
        self.k_scale = self.v_scale = None
        self._uncalibrated: set[int] = set()
        if dtype == FP8_KV_DTYPE:
            self.k_scale = torch.ones(num_layers, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(num_layers, dtype=torch.float32, device=device)
            self._uncalibrated = set(range(num_layers)) if calibrate else set()
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeroed: the plain-PyTorch attention reads whole blocks and masks the slots past a
        # sequence's length, and a masked value must still be finite (0 * NaN is NaN). On the CPU
        # a large buffer is left to the OS, whose fresh pages read as zero and cost no memory until
        # written (glibc serves allocations above 32 MiB with mmap); zeroing it would touch every page.
        nbytes = 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        alloc = torch.empty if torch.device(device).type == "cpu" and nbytes >= _LAZY_ZERO_BYTES else torch.zeros
        self.blocks: torch.Tensor | None = None
        if block_major:
            self.blocks = alloc((num_blocks, 2, num_layers, block_size, num_kv_heads, head_dim), dtype=dtype,
                                device=device)
            self.k, self.v = self.blocks[:, 0].transpose(0, 1), self.blocks[:, 1].transpose(0, 1)
        else:
            self.k = alloc(shape, dtype=dtype, device=device)
            self.v = alloc(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.contiguous = contiguous

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def fp8(self) -> bool:
        """Whether this is an FP8 cache (its values need their layer's scale)."""
        return self.k_scale is not None

    def scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An FP8 cache's ``(k_scale, v_scale)`` of one layer, float32 ``[1]`` views (the kernels read them
        from memory, so a calibration or a CUDA graph replay sees the current value); None otherwise."""
        if self.k_scale is None:
            return None
        return self.k_scale[layer_idx:layer_idx + 1], self.v_scale[layer_idx:layer_idx + 1]

    def needs_calibration(self, layer_idx: int) -> bool:
        """Whether :meth:`calibrate` still has to set this layer's scales (before its first write)."""
        return layer_idx in self._uncalibrated

    def calibrate(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set an uncalibrated layer's scales from the K/V about to be written (``[T, Hkv, D]``): ``max|k| /
        200`` and ``max|v| / 100`` (vLLM's ``calculate_kv_scales``: the first batch's largest value lands
        at 200 or 100 of e4m3's 448, leaving room for larger ones later); a layer of zeros keeps 1.0. Then
        frozen: every block of the cache is written with the same scale, so a cached or offloaded block
        means the same values to every reader. A no-op for a calibrated layer."""
        if layer_idx not in self._uncalibrated:
            return
        self._uncalibrated.discard(layer_idx)
        for x, scales, const in ((k, self.k_scale, K_SCALE_CONSTANT), (v, self.v_scale, V_SCALE_CONSTANT)):
            amax = x.detach().abs().amax().float()
            scales[layer_idx] = torch.where(amax > 0, amax / const, torch.ones_like(amax))

    @contextlib.contextmanager
    def calibration_paused(self):
        """A context in which no layer calibrates (dummy forwards: the engine's warm-up)."""
        pending, self._uncalibrated = self._uncalibrated, set()
        try:
            yield
        finally:
            self._uncalibrated = pending

    def dequantize(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``, ``v`` read from this cache, as values in :attr:`dtype` (an FP8 cache's codes times their
        layer's scale; anything else as it is)."""
        if self.k_scale is None:
            return k, v
        ks, vs = self.scales(layer_idx)
        return dequantize_kv(k, ks, self.dtype), dequantize_kv(v, vs, self.dtype)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of one layer, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
        return self.k[layer_idx], self.v[layer_idx]

    def slot_mapping(self, block_tables: list[list[int]], starts: list[int], lengths: list[int]) -> list[int]:
        """Flat slots of ``lengths[i]`` new tokens of sequence ``i``, from position ``starts[i]`` on.

        Position ``p`` of a sequence with block table ``t`` is slot
        ``t[p // block_size] * block_size + p % block_size``.

        Returns:
            ``sum(lengths)`` ints (the model runner makes an int64 tensor of them).
        """
        # >>> EXERCISE slot_mapping
        bs = self.block_size
        slots: list[int] = []
        for table, start, n in zip(block_tables, starts, lengths):
            p, end = start, start + n
            while p < end:  # one run of consecutive slots per block touched
                block, offset = divmod(p, bs)
                run = min(bs - offset, end - p)
                base = table[block] * bs + offset
                slots.extend(range(base, base + run))
                p += run
        return slots
        # <<< EXERCISE slot_mapping

    def copy_block_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` slots of block ``src`` into block ``dst``, in every layer.

        Used when a request with ``n > 1`` prefilled once: the forks share the prompt's full
        blocks and each gets its own copy of the last, partly filled one (copy-on-write).
        """
        self.k[:, dst, :num_tokens] = self.k[:, src, :num_tokens]
        self.v[:, dst, :num_tokens] = self.v[:, src, :num_tokens]

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[T, num_kv_heads, head_dim]``) at ``slot_mapping`` (int64 ``[T]``).

        The plain-PyTorch ``reshape_and_cache``: one ``index_copy_`` per tensor into the cache
        seen as ``[num_blocks * block_size, num_kv_heads, head_dim]``. An FP8 cache stores
        ``x / scale`` in e4m3 (calibrating the layer's scales first if it is its first write).
        """
        kl, vl = self.k[layer_idx], self.v[layer_idx]
        if self.k_scale is not None:
            self.calibrate(layer_idx, k, v)
            ks, vs = self.scales(layer_idx)
            k, v = quantize_kv(k, ks), quantize_kv(v, vs)
            # the CPU's index_copy_ has no float8 kernel: move the bytes (the same bits)
            kl, vl, k, v = kl.view(torch.uint8), vl.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        if self.blocks is not None:  # block-major: a layer's blocks are strided, index (block, offset)
            idx = (slot_mapping // self.block_size, slot_mapping % self.block_size)
            kl.index_put_(idx, k.to(kl.dtype))
            vl.index_put_(idx, v.to(vl.dtype))
            return
        kl.view(-1, *kl.shape[2:]).index_copy_(0, slot_mapping, k.to(kl.dtype))
        vl.view(-1, *vl.shape[2:]).index_copy_(0, slot_mapping, v.to(vl.dtype))

    def read(self, layer_idx: int, block_table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` cached tokens of a sequence: two ``[length, num_kv_heads, head_dim]``
        in :attr:`dtype`.

        A view when the sequence's tokens sit in one block (the contiguous cache), else a copy
        gathered through the block table (an FP8 cache: always a dequantized copy).
        """
        kl, vl = self.k[layer_idx], self.v[layer_idx]
        n = -(-length // self.block_size)
        if n == 1:
            return self.dequantize(layer_idx, kl[block_table[0], :length], vl[block_table[0], :length])
        idx = torch.tensor(block_table[:n], device=kl.device)
        return self.dequantize(layer_idx, kl.index_select(0, idx).flatten(0, 1)[:length],
                               vl.index_select(0, idx).flatten(0, 1)[:length])
