"""KV caches.

Phase 1's cache is *contiguous*: every sequence owns one row of ``max_len`` token slots per
layer, allocated up front and written in place. A token's K/V lives at flat slot
``row * max_len + position``, so writing a step's new K/V is one ``index_copy_`` with a
slot mapping, exactly the shape the paged cache (phase 5) will use with blocks instead of
rows. The cost of this layout is fragmentation: a row is sized for the longest possible
sequence whatever the sequence really needs (measured in docs/phases/05-paged-kv.md).
"""

from __future__ import annotations

import torch

_LAZY_ZERO_BYTES = 128 << 20  # CPU caches at least this big (k + v) come from fresh zero pages


class KVCache:
    """What an attention backend needs from a cache (the interface phase 5 implements again)."""

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, layer_idx: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class ContiguousKVCache(KVCache):
    """``num_rows`` preallocated rows of ``max_len`` tokens, for every layer.

    Storage: ``k`` and ``v`` of shape ``[num_layers, num_rows, max_len, num_kv_heads, head_dim]``
    in ``dtype`` on ``device``. Memory: ``2 * num_layers * num_rows * max_len * num_kv_heads *
    head_dim * itemsize`` bytes.
    """

    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_rows, max_len, num_kv_heads, head_dim)
        # Zeroed: batched decode attention reads every row up to the longest context of the
        # step and masks the rest, and a masked key must still be finite (NaN * 0 is NaN).
        # On the CPU a large buffer is left to the OS, whose fresh pages read as zero and cost
        # no memory until written (glibc serves allocations above 32 MiB with mmap); zeroing
        # it would touch every page.
        nbytes = 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        alloc = torch.empty if torch.device(device).type == "cpu" and nbytes >= _LAZY_ZERO_BYTES else torch.zeros
        self.k = alloc(shape, dtype=dtype, device=device)
        self.v = alloc(shape, dtype=dtype, device=device)
        self.num_rows = num_rows
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def slot_mapping(self, rows: list[int], starts: list[int], lengths: list[int], device) -> torch.Tensor:
        """int64 ``[sum(lengths)]``: slots for ``lengths[i]`` new tokens of ``rows[i]`` from ``starts[i]``."""
        slots: list[int] = []
        for row, start, n in zip(rows, starts, lengths):
            base = row * self.max_len + start
            slots.extend(range(base, base + n))
        return torch.tensor(slots, dtype=torch.int64, device=device)

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` tokens of row ``src`` into row ``dst``, in every layer.

        Used when a request with ``n > 1`` prefilled once (in ``src``) for all its sequences.
        """
        self.k[:, dst, :length] = self.k[:, src, :length]
        self.v[:, dst, :length] = self.v[:, src, :length]

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[T, num_kv_heads, head_dim]``) at ``slot_mapping`` (int64 ``[T]``)."""
        kl, vl = self.k[layer_idx], self.v[layer_idx]
        kl.view(-1, *kl.shape[2:]).index_copy_(0, slot_mapping, k.to(kl.dtype))
        vl.view(-1, *vl.shape[2:]).index_copy_(0, slot_mapping, v.to(vl.dtype))

    def read(self, layer_idx: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` cached tokens of ``row``: two ``[length, num_kv_heads, head_dim]`` views."""
        return self.k[layer_idx, row, :length], self.v[layer_idx, row, :length]
