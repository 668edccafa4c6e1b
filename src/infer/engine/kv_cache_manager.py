"""The scheduler's view of the KV cache: a pool of blocks and each sequence's block table.

PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model Serving
with PagedAttention", SOSP 2023, arXiv:2309.06180) treats KV-cache memory the way an
operating system treats RAM: the cache is a pool of fixed-size *blocks* of ``block_size``
token slots, and each sequence owns a *block table*, the list of its blocks in order. Token
``p`` of a sequence lives in block ``block_table[p // block_size]`` at offset
``p % block_size``; its flat *slot* is ``block * block_size + offset``. A sequence takes a
new block only when it crosses a block boundary, so it wastes less than one block, instead
of the ``max_model_len - length`` slots a contiguous row wastes.

The contiguous cache of phases 1-4 is the special case ``block_size = max_model_len``: one
block (a "row") per sequence, taken at admission and never outgrown. The same manager serves
both; only the numbers differ (``EngineConfig.kv_cache``).

Nothing here touches tensors: this module only decides which block ids each sequence owns.
The tensors live in :class:`infer.attention.KVCache`.
"""

from __future__ import annotations

import heapq

from infer.engine.sequence import Request, Sequence


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


class KVCacheManager:
    """Block tables of the running sequences over one :class:`BlockPool`.

    Args:
        num_blocks: blocks in the cache.
        block_size: token slots per block (``max_model_len`` for the contiguous cache).

    Each :class:`~infer.engine.sequence.Sequence` keeps its own ``block_table`` (a list of
    block ids); this class grows, forks and frees it.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> float:
        """Fraction (0-1) of the blocks in use."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens of one sequence."""
        return cdiv(num_tokens, self.block_size)

    # ------------------------------------------------------------------ admission

    def blocks_to_admit(self, request: Request) -> int:
        """Blocks :meth:`admit` takes for ``request``'s unfinished sequences.

        A fresh request prefills once for its ``n`` sequences: sequence 0 takes the prompt's
        blocks, and every other sequence shares the full ones and gets a copy of the last,
        partly filled block (it will write its own tokens there). A request resumed after a
        preemption has generated tokens that differ between its sequences, so each sequence
        recomputes, and holds, all of its own tokens.
        """
        if request.shares_prefill:
            p = request.prompt_len
            return self.blocks_for(p) + (len(request.seqs) - 1) * (1 if p % self.block_size else 0)
        return sum(self.blocks_for(len(s.token_ids)) for s in request.unfinished_seqs)

    def can_admit(self, request: Request) -> bool:
        return self.blocks_to_admit(request) <= self.pool.num_free

    def admit(self, request: Request) -> None:
        """Give ``request``'s unfinished sequences the blocks their prefill writes to.

        Raises:
            RuntimeError: not enough free blocks (check :meth:`can_admit` first).
        """
        seqs = request.unfinished_seqs
        if not request.shares_prefill:
            for seq in seqs:
                seq.block_table = self.pool.allocate(self.blocks_for(len(seq.token_ids)))
            return
        first, *forks = seqs
        first.block_table = self.pool.allocate(self.blocks_for(request.prompt_len))
        full = request.prompt_len // self.block_size
        for fork in forks:
            shared = first.block_table[:full]
            self.pool.share(shared)
            fork.block_table = shared + self.pool.allocate(len(first.block_table) - full)

    # ------------------------------------------------------------------ growing

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make ``seq``'s block table cover its computed tokens plus ``num_new_tokens``.

        Returns:
            False, taking nothing, when too few blocks are free (the scheduler then preempts).
        """
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block ``seq`` holds (shared blocks stay while another holder remains)."""
        if seq.block_table:
            self.pool.free(seq.block_table)
        seq.block_table = []
