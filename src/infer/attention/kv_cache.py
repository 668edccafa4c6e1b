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
        # Uninitialized: a slot is only ever read after it was written (attention reads the
        # first seq_len slots of a row), and on the CPU untouched pages cost no memory.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
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

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[T, num_kv_heads, head_dim]``) at ``slot_mapping`` (int64 ``[T]``)."""
        kl, vl = self.k[layer_idx], self.v[layer_idx]
        kl.view(-1, *kl.shape[2:]).index_copy_(0, slot_mapping, k.to(kl.dtype))
        vl.view(-1, *vl.shape[2:]).index_copy_(0, slot_mapping, v.to(vl.dtype))

    def read(self, layer_idx: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` cached tokens of ``row``: two ``[length, num_kv_heads, head_dim]`` views."""
        return self.k[layer_idx, row, :length], self.v[layer_idx, row, :length]
