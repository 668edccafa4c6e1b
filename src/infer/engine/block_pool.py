"""The pool of KV-cache blocks: a free list and a reference count per block (phase 5).

PagedAttention (Kwon et al., SOSP 2023, arXiv:2309.06180) hands out KV-cache memory in blocks of
``block_size`` token slots. This pool only counts: which block ids are free, and how many holders
each block in use has (the ``n`` sequences of a request share their prompt's blocks; with prefix
caching, requests share a common prefix). :class:`~infer.engine.kv_cache_manager.KVCacheManager`
builds each sequence's block table from it; :class:`~infer.engine.prefix_cache.PrefixCachingBlockPool`
extends it with block hashes and an LRU of cached free blocks (phase 7). The tensors the blocks
index live in :class:`infer.attention.KVCache`.
"""

from __future__ import annotations

import heapq


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


class BlockPool:
    """``num_blocks`` KV-cache blocks: a free list and a reference count per block.

    A block is free when its count is 0. :meth:`allocate` hands out free blocks with count 1;
    :meth:`share` adds a holder to blocks already in use (copy-on-write sharing between the
    ``n`` sequences of a request today, between requests with a common prefix in phase 7);
    :meth:`free` drops one holder and returns a block to the free list when none is left.
    The free list is a min-heap, so the lowest free block id is handed out first and the blocks
    in use stay packed at the bottom of the cache.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_blocks = list(range(num_blocks))  # sorted, hence already a heap

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (lowest ids first), each with reference count 1.

        Raises:
            RuntimeError: fewer than ``n`` blocks are free (nothing is taken). The scheduler
                asks :attr:`num_free` first, so this is a bug if it happens.
        """
        if n > len(self.free_blocks):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_blocks)} free")
        blocks = [heapq.heappop(self.free_blocks) for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one holder to each of ``blocks`` (all in use)."""
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise RuntimeError(f"block {b} is free and cannot be shared")
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each of ``blocks``; a block nobody holds returns to the free list.

        Raises:
            RuntimeError: a block that is already free (a double free).
        """
        # >>> EXERCISE block_free
        for b in blocks:
            if self.ref_counts[b] < 1:
                raise RuntimeError(f"block {b} is already free (double free)")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                heapq.heappush(self.free_blocks, b)
        # <<< EXERCISE block_free
