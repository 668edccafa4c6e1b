"""Prefix caching (phase 7): keep full KV blocks after their sequence is done, find them again.

Chat turns, system prompts, few-shot templates and agent loops send the same prefix again and
again. A block of ``block_size`` tokens whose K/V is computed depends on nothing but its tokens
and the tokens before it, so it can be *named* by them and reused by any later sequence that
starts with the same tokens: that sequence's prefill starts after the reused blocks.

This is vLLM v1's automatic prefix caching (``vllm/v1/core/block_pool.py``,
``kv_cache_utils.py``):

* **the chained block hash**: block ``i`` of a token stream is keyed by
  ``hash(parent, its block_size token ids, extra keys)``, where ``parent`` is block ``i - 1``'s
  key (:data:`NONE_HASH` for block 0). A key therefore names the whole prefix up to the end of
  its block, and a lookup is a walk over the request's keys that stops at the first miss
  (:func:`block_hashes`, :meth:`PrefixCachingBlockPool.lookup`). Only *full* blocks get a key:
  a partly filled block still changes. ``extra_keys`` carry what makes the same tokens give
  different K/V (here a LoRA adapter, phase 16: see ``kv_cache_manager.block_extra_keys``).
* **verification**: a hit also compares the block's stored token ids with the request's, so
  even a hash collision can never hand a sequence somebody else's K/V.
* **the LRU of cached free blocks**: a freed block that has a key keeps its K/V and stays in
  the key map; it waits in an LRU queue (an ``OrderedDict``) and is *evicted* (its key dropped,
  its slots overwritten) only when a new block is needed and no never-cached block is free.
  A request frees its blocks last-first, so the tail of a prefix is evicted before its head
  (a head block is shared by more prompts than the blocks after it).

SGLang's RadixAttention (Zheng et al., arXiv:2312.07104) indexes the same information as a
radix tree over token sequences; docs/phases/07-prefix-caching.md compares the two.

Hash choice: SHA-256 over the parent key, the token ids as 64-bit integers and ``repr`` of the
extra keys. Python's ``hash`` of a tuple of ints is 64 bits and not cryptographic, so a crafted
prompt could collide with another user's prefix (vLLM moved to SHA-256 for that reason,
CVE-2025-25183); SHA-256 is also the same in every process, which a disk tier (phase 10) needs.
It costs about a microsecond per block, negligible next to the block's prefill.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from infer.engine.block_pool import BlockPool

#: the key of a full block: SHA-256 digest (32 bytes) of its parent's key, tokens and extra keys
BlockHash = bytes
#: the "parent" of block 0
NONE_HASH: BlockHash = bytes(32)
#: ``on_evict(block_hash, block_id, token_ids)``: called just before a cached block is reused
EvictionHook = Callable[[BlockHash, int, tuple[int, ...]], None]


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    """The key of one full block: SHA-256 of ``parent`` (the previous block's key, or
    :data:`NONE_HASH`), ``token_ids`` (packed as int64) and ``repr(extra_keys)``."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: tuple = (),
                 known: list[BlockHash] | None = None) -> list[BlockHash]:
    """Keys of the full blocks of ``token_ids`` (a partly filled last block has none).

    Args:
        known: keys already computed for a prefix of the same stream; they are kept and the
            chain continues after them (a sequence extends its list as it grows).

    Returns:
        ``len(token_ids) // block_size`` keys; key ``i`` names tokens ``[0, (i + 1) * block_size)``.
    """
    # >>> EXERCISE block_hash_chain
    hashes = list(known or [])
    parent = hashes[-1] if hashes else NONE_HASH
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        hashes.append(parent)
    return hashes
    # <<< EXERCISE block_hash_chain


class PrefixCachingBlockPool(BlockPool):
    """A :class:`BlockPool` that remembers full blocks by their key after they are freed.

    Every block is in exactly one of three states:

    * **in use** (reference count >= 1; it may have a key: then later requests can share it);
    * **cached free** (count 0, has a key, its K/V intact): in :attr:`cached_free`, an LRU
      queue, oldest first. A hit takes it back (:meth:`touch`); a new allocation evicts from
      the front when no plain free block is left;
    * **free** (count 0, no key): in the min-heap of :class:`BlockPool`.

    Args:
        num_blocks: blocks in the cache.
        on_evict: optional :data:`EvictionHook`, called with ``(key, block id, token ids)`` just
            before a cached free block is reused for new data, while its K/V is still in the
            cache tensors (a lower tier, phase 10, can save it there).

    Attributes:
        cached: key -> block id of every block with a key (in use or cached free).
        block_hash, block_tokens: per block id, its key and token ids (None without a key).
        cached_free: the LRU queue of cached free blocks (``OrderedDict`` block id -> None).
        num_evictions: cached blocks reused for other data so far.
        on_forget: optional ``on_forget(block)``, called when a block's contents can no longer be hit
            (evicted, dropped by a reset while cached free, or freed without a key): hybrid models drop
            the state snapshot the block owns (:mod:`infer.engine.state_snapshots`).
    """

    def __init__(self, num_blocks: int, on_evict: EvictionHook | None = None) -> None:
        super().__init__(num_blocks)
        self.on_evict = on_evict
        self.cached: dict[BlockHash, int] = {}
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0
        self.on_forget: Callable[[int], None] | None = None
        self.generation = 0  # bumped whenever a key is added or dropped: a lookup's result may change

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones and cached free ones (evictable)."""
        return len(self.free_blocks) + len(self.cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self.cached_free)

    # ------------------------------------------------------------------ the key map

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The block cached under ``block_hash`` if its tokens are ``token_ids``, else None.

        Nothing changes: the caller :meth:`touch` es the blocks it keeps."""
        block = self.cached.get(block_hash)
        if block is None or self.block_tokens[block] != tuple(token_ids):
            return None  # a miss, or a hash collision caught by the token check
        return block

    def cache_block(self, block: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Give the full, computed, in-use ``block`` the key ``block_hash``.

        Returns False (nothing changes) when the block has a key already, or when another
        block holds that key (two requests computed the same prefix at once: the first stays,
        this one is freed as a plain block later).
        """
        if self.ref_counts[block] < 1:
            raise RuntimeError(f"block {block} is free and cannot be cached")
        if self.block_hash[block] is not None or block_hash in self.cached:
            return False
        self.cached[block_hash] = block
        self.block_hash[block] = block_hash
        self.block_tokens[block] = tuple(token_ids)
        self.generation += 1
        return True

    def touch(self, blocks: list[int]) -> None:
        """Add a holder to each of ``blocks`` (lookup hits): a cached free block leaves the LRU
        queue and is in use again."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.cached_free[b]  # KeyError here means a hit on an uncached block: a bug
            self.ref_counts[b] += 1

    def _uncache(self, block: int) -> None:
        if self.on_forget is not None:
            self.on_forget(block)
        h = self.block_hash[block]
        if h is not None:
            del self.cached[h]
            self.block_hash[block] = self.block_tokens[block] = None
            self.generation += 1

    # ------------------------------------------------------------------ allocate / free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, each with reference count 1: never-cached free blocks first (lowest
        ids), then cached free blocks, least recently freed first (:meth:`_evict`).

        Raises:
            RuntimeError: fewer than ``n`` blocks are free (nothing is taken).
        """
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks, {self.num_free} free")
        plain = min(n, len(self.free_blocks))
        blocks = super().allocate(plain) if plain else []
        for _ in range(n - plain):
            b = self._evict()
            self.ref_counts[b] = 1
            blocks.append(b)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each of ``blocks``. A block nobody holds keeps its K/V and its key
        and joins the back of the LRU queue; one without a key goes back to the free heap.

        The blocks are released last-first, so that when a sequence's blocks are freed together
        its last blocks, which fewer prompts share, are evicted before its first.

        Raises:
            RuntimeError: a block that is already free (a double free).
        """
        for b in reversed(blocks):
            if self.ref_counts[b] < 1:
                raise RuntimeError(f"block {b} is already free (double free)")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self.cached_free[b] = None  # the most recently used end
                else:
                    heapq.heappush(self.free_blocks, b)
                    if self.on_forget is not None:
                        self.on_forget(b)

    def _evict(self) -> int:
        """Take the least recently freed cached block for new data: report it to ``on_evict``
        while its K/V is intact, then drop its key."""
        # >>> EXERCISE lru_eviction
        b, _ = self.cached_free.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(self.block_hash[b], b, self.block_tokens[b])
        self._uncache(b)
        self.num_evictions += 1
        return b
        # <<< EXERCISE lru_eviction

    def reset(self) -> int:
        """Forget every key (vLLM's ``reset_prefix_cache``): cached free blocks go back to the free
        heap, blocks in use keep their data but can no longer be hit. ``on_evict`` is not called.
        Returns the number of cached free blocks dropped."""
        dropped = len(self.cached_free)
        for b in list(self.cached_free):
            heapq.heappush(self.free_blocks, b)
            if self.on_forget is not None:  # (a block in use keeps what it owns until it is freed, keyless)
                self.on_forget(b)
        self.cached_free.clear()
        for b in range(self.num_blocks):
            self.block_hash[b] = self.block_tokens[b] = None
        self.cached.clear()
        self.generation += 1
        return dropped

    def check_invariants(self) -> None:
        """Raise AssertionError unless the pool is consistent: every block is exactly one of in
        use / cached free / free; the key map and the per-block keys agree; cached free blocks
        have a key and free ones none."""
        free = set(self.free_blocks)
        lru = set(self.cached_free)
        used = {b for b in range(self.num_blocks) if self.ref_counts[b] > 0}
        assert len(free) == len(self.free_blocks) and not (free & lru) and not (free & used) and not (lru & used)
        assert len(free) + len(lru) + len(used) == self.num_blocks, (len(free), len(lru), len(used))
        assert all(self.ref_counts[b] == 0 for b in free | lru)
        assert all(self.block_hash[b] is not None for b in lru)
        assert all(self.block_hash[b] is None for b in free)
        assert {h: b for b, h in enumerate(self.block_hash) if h is not None} == self.cached
