"""Prefix caching for hybrid models (phase 17): snapshots of the recurrent state, owned by KV blocks.

A prefix-cache hit (phase 7) hands a new sequence the K/V blocks of its first ``n`` tokens. A
linear-attention layer has no per-token entries to hand over: it needs its state *after exactly
``n`` tokens*, and the state a finished sequence left in its slot is the state after *its* last token.
So every ``stride`` tokens (a multiple of ``block_size``) the prefill stores a copy of every linear
layer's conv and SSM state in a *snapshot slot* (extra slots of the same
:class:`~infer.attention.state_cache.RecurrentStateCache`), owned by the KV block that ends at that
position. The block's key (its chained hash, :mod:`infer.engine.prefix_cache`) names the whole prefix,
so it names the snapshot too.

A hit is then cut back to its last block that owns a snapshot (:meth:`StateSnapshotPool.usable_hit`):
the blocks after it are not reused but recomputed, since recomputing only the state would mean running
the whole model over those tokens anyway (a linear layer's input is the hidden state the attention
layers below it produce). The first step of the sequence starts its linear layers from the snapshot.

A snapshot lives as long as its block's K/V: it is dropped when the block is evicted (LRU), reset,
or freed without a key (:meth:`StateSnapshotPool.forget`). When no snapshot slot is free, the
snapshot of the least recently freed cached block that owns one is dropped first (its block stays
cached: a longer hit through it is cut back to an earlier snapshot); when every snapshot belongs to
a block in use, the new snapshot is skipped.

SGLang's ``MambaRadixCache`` and vLLM's hybrid KV-cache manager (``mamba_cache_mode="align"``, one
state per ``mamba_block_size`` tokens) keep states the same way; the stride is the trade-off between
recompute after a hit (up to ``stride - 1`` tokens more) and snapshot memory (one state per stride).
"""

from __future__ import annotations

from collections.abc import Iterable

#: the default snapshot stride in tokens (rounded up to a multiple of the block size), as openinfer's
DEFAULT_SNAPSHOT_STRIDE = 256


def snapshot_stride(stride: int, block_size: int) -> int:
    """``stride`` (tokens, a multiple of ``block_size``), or for 0 :data:`DEFAULT_SNAPSHOT_STRIDE` rounded
    up to a multiple of ``block_size``.

    Raises:
        ValueError: ``stride`` is negative or not a multiple of ``block_size``.
    """
    if stride == 0:
        return -(-DEFAULT_SNAPSHOT_STRIDE // block_size) * block_size
    if stride < 0 or stride % block_size:
        raise ValueError(f"the snapshot stride must be a positive multiple of block_size={block_size}, got {stride}")
    return stride


class StateSnapshotPool:
    """Which snapshot slots are free and which KV block owns each of the others (ids only: the tensors
    are slots ``first_slot ..`` of the model runner's recurrent-state cache).

    Args:
        first_slot: the first snapshot slot in the state cache (after the running sequences' slots).
        num_slots: snapshot slots.
        stride: tokens between two snapshots (a multiple of ``block_size``).
        block_size: tokens per KV block.

    Attributes:
        of_block: block id -> its snapshot slot.
        num_stored, num_hits, num_evicted, num_skipped: snapshots taken, prefix hits that started from a
            snapshot, snapshots dropped (with their block, or for room), and snapshots not taken because
            every slot belonged to a block in use.
        generation: bumped whenever a snapshot is added or dropped (a cached lookup is stale then).
    """

    def __init__(self, first_slot: int, num_slots: int, stride: int, block_size: int) -> None:
        self.first_slot, self.num_slots = first_slot, num_slots
        self.stride, self.block_size = stride, block_size
        self.free_slots = list(range(first_slot + num_slots - 1, first_slot - 1, -1))  # popped from the end
        self.of_block: dict[int, int] = {}
        self.num_stored = self.num_hits = self.num_evicted = self.num_skipped = 0
        self.generation = 0  # bumped whenever a snapshot is added or dropped: a usable hit may change

    def usable_hit(self, hit: list[int]) -> list[int]:
        """The part of a prefix hit (block ids, in order) a hybrid sequence can reuse: up to and
        including its last block that owns a snapshot; ``[]`` when none does (a hit shorter than one
        stride, or whose snapshots were evicted: the sequence then prefills from token 0)."""
        # >>> EXERCISE snapshot_lookup
        for n in range(len(hit), 0, -1):
            if n * self.block_size % self.stride == 0 and hit[n - 1] in self.of_block:
                return hit[:n]
        return []
        # <<< EXERCISE snapshot_lookup

    def boundaries(self, start: int, end: int) -> range:
        """Token counts ``p`` in ``(start, end]`` at which a snapshot is due (multiples of the stride)."""
        return range((start // self.stride + 1) * self.stride, end + 1, self.stride)

    def take(self, block: int, lru_blocks: Iterable[int]) -> int:
        """A snapshot slot for ``block`` (the block that ends at the snapshot's position), or -1 when it
        has one already or none can be freed. ``lru_blocks``: the cached free blocks, least recently
        freed first; the first of them that owns a snapshot loses it when no slot is free."""
        if block in self.of_block:
            return -1
        if not self.free_slots:
            for b in lru_blocks:
                if b in self.of_block:
                    self.forget(b)
                    break
        if not self.free_slots:
            self.num_skipped += 1
            return -1
        slot = self.of_block[block] = self.free_slots.pop()
        self.num_stored += 1
        self.generation += 1
        return slot

    def forget(self, block: int) -> None:
        """``block``'s K/V is gone or can no longer be hit (evicted, reset, freed without a key): its
        snapshot, if any, goes back to the free slots."""
        slot = self.of_block.pop(block, None)
        if slot is not None:
            self.free_slots.append(slot)
            self.num_evicted += 1
            self.generation += 1

    def check_invariants(self) -> None:
        """Raise AssertionError unless every snapshot slot is exactly once free or owned by one block."""
        owned = list(self.of_block.values())
        assert sorted(owned + self.free_slots) == list(range(self.first_slot, self.first_slot + self.num_slots))

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_snapshot_hits": self.num_hits, "prefix_cache_snapshots_stored": self.num_stored,
                "prefix_cache_snapshots_evicted": self.num_evicted, "prefix_cache_snapshots_skipped": self.num_skipped,
                "prefix_cache_snapshots_held": len(self.of_block), "prefix_cache_snapshot_slots": self.num_slots,
                "prefix_cache_snapshot_stride": self.stride}
