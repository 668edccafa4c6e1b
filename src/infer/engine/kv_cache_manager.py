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

Hybrid models (phase 17) have a second resource: a sequence running through linear-attention
layers holds one *state slot* (its conv and SSM state, a fixed size whatever its length). The same
manager hands them out: one per sequence at admission (a request is admitted only when its blocks
*and* its slots are free, so a request that finds no slot waits), given back at finish, abort and
preemption (recompute: readmitted, the sequence starts from a zero state and recomputes it). With
prefix caching they also hold *snapshots* of that state every ``stride`` tokens, owned by KV blocks
(:mod:`infer.engine.state_snapshots`): a hit is cut back to its last snapshot, which the sequence's
first step starts from.

Nothing here touches tensors: this module only decides which block ids (and slots) each sequence
owns. The tensors live in :class:`infer.attention.KVCache` (and
:class:`~infer.attention.state_cache.RecurrentStateCache`).
"""

from __future__ import annotations

from infer.engine.block_pool import BlockPool, cdiv
from infer.engine.prefix_cache import PrefixCachingBlockPool, block_hashes
from infer.engine.sequence import PLACEHOLDER, Request, Sequence
from infer.engine.state_snapshots import StateSnapshotPool
from infer.engine.state_snapshots import snapshot_stride as snapshot_stride_of


class KVCacheManager:
    """Block tables of the running sequences over one :class:`BlockPool`.

    Args:
        num_blocks: blocks in the cache.
        block_size: token slots per block (``max_model_len`` for the contiguous cache).
        prefix_caching: phase 7 (:mod:`infer.engine.prefix_cache`): the pool is a
            :class:`~infer.engine.prefix_cache.PrefixCachingBlockPool`; admission maps the
            longest cached prefix of each sequence (:meth:`find_cached_prefix`) into its block
            table and starts its prefill after it; computed full blocks get their key
            (:meth:`cache_blocks`) before they are freed.

        num_state_slots: hybrid models (phase 17): recurrent-state slots, one per running sequence
            (0: the model has none).
        num_snapshot_slots, snapshot_stride: hybrid models with prefix caching: slots of the state cache
            after the running ones that hold state snapshots, and the tokens between two snapshots
            (0: :data:`~infer.engine.state_snapshots.DEFAULT_SNAPSHOT_STRIDE`, block-aligned).

    Each :class:`~infer.engine.sequence.Sequence` keeps its own ``block_table`` (a list of
    block ids); this class grows, forks and frees it.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 num_state_slots: int = 0, num_snapshot_slots: int = 0, snapshot_stride: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))  # popped from the end: 0 first
        self.prefix_caching = prefix_caching
        if prefix_caching:  # phase 7: full blocks keep a key and outlive their sequence
            self.pool: BlockPool = PrefixCachingBlockPool(num_blocks)
        else:
            self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.snapshots: StateSnapshotPool | None = None  # hybrid prefix caching (phase 17)
        if prefix_caching and num_state_slots:
            self.snapshots = StateSnapshotPool(num_state_slots, num_snapshot_slots,
                                               snapshot_stride_of(snapshot_stride, block_size), block_size)
            self.pool.on_forget = self.snapshots.forget
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache (admissions)
        self.prefix_cache_hits = 0  # of those, tokens found cached (their prefill skipped)
        # phase 10 (kv_offload): the tiers below the device, set by the engine
        # (:class:`~infer.engine.kv_offload.KVOffloader`); a lookup continues there after a device miss
        self.offloader = None
        self.offload_hit_tokens = 0  # prompt tokens restored from the tiers (their prefill skipped)
        self._last_hits: tuple | None = None  # (key, hits) of the last _prefix_hits

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

    def blocks_to_admit(self, request: Request, hits: list[list[int]] | None = None) -> int:
        """Blocks :meth:`admit` takes for ``request``'s unfinished sequences.

        A fresh request prefills once for its ``n`` sequences: sequence 0 takes the prompt's
        blocks, and every other sequence shares the full ones and gets a copy of the last,
        partly filled block (it will write its own tokens there). A request resumed after a
        preemption has generated tokens that differ between its sequences, so each sequence
        recomputes, and holds, all of its own tokens. With prefix caching, blocks found in the
        cache are not taken anew, but a hit on a cached *free* block takes that block off the
        free queue, so it counts.
        """
        hits = self._prefix_hits(request) if hits is None else hits
        revived = len({b for hit in hits for b in hit if self.pool.ref_counts[b] == 0})
        if request.shares_prefill:
            p = request.prompt_len
            new = self.blocks_for(p) - len(hits[0]) + (len(request.seqs) - 1) * (1 if p % self.block_size else 0)
        else:
            new = sum(self.blocks_for(len(s.token_ids)) - len(h) for s, h in zip(request.unfinished_seqs, hits))
        return new + revived

    def can_admit(self, request: Request) -> bool:
        if self.num_state_slots and len(self.free_state_slots) < len(request.unfinished_seqs):
            return False  # hybrid: every sequence needs its state slot
        return self.blocks_to_admit(request) <= self.pool.num_free

    def _take_state_slots(self, seqs: list[Sequence]) -> None:
        """Give each of ``seqs`` a recurrent-state slot (hybrid models; checked by :meth:`can_admit`)."""
        if not self.num_state_slots:
            return
        if len(self.free_state_slots) < len(seqs):
            raise RuntimeError(f"{len(seqs)} state slots needed, {len(self.free_state_slots)} free")
        for seq in seqs:
            if seq.state_slot < 0:
                seq.state_slot = self.free_state_slots.pop()

    def admit(self, request: Request) -> None:
        """Give ``request``'s unfinished sequences the blocks their prefill writes to.

        With prefix caching, this is where a request's cached prefix is applied: each sequence
        that prefills (sequence 0 of a fresh request; every sequence after a preemption) takes
        the blocks :meth:`find_cached_prefix` found, which become the start of its block table,
        and its ``num_computed_tokens`` is set past them, so its prefill starts there.

        Raises:
            RuntimeError: not enough free blocks (check :meth:`can_admit` first).
        """
        seqs = request.unfinished_seqs
        self._take_state_slots(seqs)
        hits = self._prefix_hits(request)
        for hit in hits:  # first, so that allocating below cannot evict them
            if hit:
                self.pool.touch(hit)
        if self.snapshots is not None:  # hybrid: the state at the end of the hit, from its snapshot
            for seq, hit in zip(seqs, hits):
                if hit:
                    seq.state_restore = self.snapshots.of_block[hit[-1]]
                    self.snapshots.num_hits += 1
        first_admission = request.num_cached_tokens is None
        self._count_prefix_hits(request, hits)
        if not request.shares_prefill:
            for seq, hit in zip(seqs, hits):
                seq.block_table = hit + self.pool.allocate(self.blocks_for(len(seq.token_ids)) - len(hit))
                seq.num_cached_blocks = len(hit)
                seq.num_computed_tokens = len(hit) * self.block_size
                self._restore_from_tiers(seq, first_admission)
            return
        first, *forks = seqs
        first.block_table = hits[0] + self.pool.allocate(self.blocks_for(request.prompt_len) - len(hits[0]))
        first.num_cached_blocks = len(hits[0])
        first.num_computed_tokens = len(hits[0]) * self.block_size
        self._restore_from_tiers(first, first_admission)
        full = request.prompt_len // self.block_size
        for fork in forks:
            shared = first.block_table[:full]
            self.pool.share(shared)
            fork.block_table = shared + self.pool.allocate(len(first.block_table) - full)

    # ------------------------------------------------------------------ prefix caching (phase 7)

    def seq_block_hashes(self, seq: Sequence) -> list:
        """Keys of ``seq``'s full blocks (:func:`~infer.engine.prefix_cache.block_hashes`), kept in
        ``seq.block_hashes`` and extended as the sequence grows. An async-scheduling placeholder
        (the last token, not sampled yet on the host) is never hashed."""
        tokens = seq.token_ids
        if tokens and tokens[-1] == PLACEHOLDER:
            tokens = tokens[:-1]
        if len(tokens) // self.block_size > len(seq.block_hashes):
            seq.block_hashes = block_hashes(tokens, self.block_size, block_extra_keys(seq.request), seq.block_hashes)
        return seq.block_hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks holding the longest cached prefix of ``seq.token_ids`` (the lookup).

        Walks the sequence's block keys from the first and stops at the first miss (a key names
        its whole prefix, so nothing after a miss can be used). At most ``len(token_ids) - 1``
        tokens are taken from the cache: the last token is always recomputed, because its
        forward gives the logits the next token is sampled from. Nothing changes (the caller
        :meth:`~infer.engine.prefix_cache.PrefixCachingBlockPool.touch` es what it keeps).

        Returns:
            Block ids, in order (``[]`` without prefix caching, and for a request that asks for
            prompt logprobs: those need the forward of every prompt token, so it bypasses the
            cache, as in vLLM).
        """
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        bs, tokens = self.block_size, seq.token_ids
        # >>> EXERCISE prefix_lookup
        hashes = self.seq_block_hashes(seq)
        max_blocks = (len(tokens) - 1) // bs  # the last token is recomputed
        hits: list[int] = []
        for i, h in enumerate(hashes[:max_blocks]):
            block = self.pool.lookup(h, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits
        # <<< EXERCISE prefix_lookup

    def _prefix_hits(self, request: Request) -> list[list[int]]:
        """:meth:`find_cached_prefix` of each unfinished sequence of ``request`` that prefills (a
        fresh request's forks get theirs from sequence 0: ``[]``).

        Admitting a request asks three times (:meth:`cached_prefix_tokens`, :meth:`can_admit`,
        :meth:`admit`), and a 4k-token prefix is a walk over 256 keys, so the last answer is kept
        while no key was added to or dropped from the pool (its ``generation``; and no state snapshot, for
        a hybrid model) and the request's sequences are the same."""
        seqs = request.unfinished_seqs
        key = (request, self.pool.generation, self.snapshots and self.snapshots.generation, tuple(map(id, seqs)),
               tuple((len(s.token_ids), s.token_ids[-1]) for s in seqs)) if self.prefix_caching else None
        if key is not None and self._last_hits is not None and self._last_hits[0] == key:
            return self._last_hits[1]
        if request.shares_prefill:
            hits = [self.find_cached_prefix(seqs[0])] + [[] for _ in seqs[1:]]
        else:
            hits = [self.find_cached_prefix(s) for s in seqs]
        if self.snapshots is not None:  # hybrid: only up to the last block with a state snapshot
            hits = [self.snapshots.usable_hit(h) for h in hits]
        if key is not None:
            self._last_hits = (key, hits)
        return hits

    def cached_prefix_tokens(self, request: Request) -> int:
        """Tokens of ``request``'s first prefill that the prefix cache would skip now (with
        ``kv_offload``, the blocks the tiers below would restore included)."""
        seq, hit = request.unfinished_seqs[0], self._prefix_hits(request)[0]
        return (len(hit) + len(self.tier_prefix(seq, hit))) * self.block_size

    # ------------------------------------------------------------------ KV offload (phase 10)

    def tier_prefix(self, seq: Sequence, hit: list[int]) -> list:
        """Keys of the blocks after ``seq``'s device hit ``hit`` that a tier can supply (pure):
        :func:`~infer.engine.kv_offload.tiered_lookup` over the device, then the offload tiers,
        capped like :meth:`find_cached_prefix`. ``[]`` without ``kv_offload``."""
        if self.offloader is None or not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        from infer.engine.kv_offload import tiered_lookup

        bs, tokens = self.block_size, seq.token_ids
        hashes = self.seq_block_hashes(seq)
        start, stop = len(hit), min(len(hashes), (len(tokens) - 1) // bs)
        on_device = {h for i, h in enumerate(hashes[start:stop], start)
                     if self.pool.lookup(h, tokens[i * bs : (i + 1) * bs]) is not None}
        found = tiered_lookup(hashes[start:stop], on_device.__contains__, self.offloader.lower_tiers())
        return hashes[start : start + len(found)]

    def _restore_from_tiers(self, seq: Sequence, first_admission: bool) -> None:
        """Fill the blocks after ``seq``'s device hit (just allocated) from the tiers that hold
        them, key them, and set ``num_computed_tokens`` past them (phase 10).

        Looked up again here because allocating may have evicted device blocks into the host
        tier and host blocks to disk or out; the run stops at the first block no tier holds now.
        A block still cached on the device (after a device miss) is copied device to device."""
        if self.offloader is None:
            return
        start, bs = seq.num_cached_blocks, self.block_size
        keys = self.tier_prefix(seq, seq.block_table[:start])
        if not keys:
            return
        device_copies, restores, n = [], [], 0
        for i, h in enumerate(keys, start):
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            src = self.pool.lookup(h, tokens)
            if src is not None and src != seq.block_table[i]:
                device_copies.append((src, seq.block_table[i]))
            elif self.offloader.contains(h):
                restores.append((h, seq.block_table[i]))
            else:
                break
            n += 1
        self.offloader.restore([h for h, _ in restores], [b for _, b in restores], device_copies)
        for i in range(start, start + n):
            self.pool.cache_block(seq.block_table[i], keys[i - start], seq.token_ids[i * bs : (i + 1) * bs])
        seq.num_cached_blocks += n
        seq.num_computed_tokens += n * bs
        self.offload_hit_tokens += n * bs
        if first_admission and seq.request.num_cached_tokens is not None:
            seq.request.num_cached_tokens += n * bs

    def _count_prefix_hits(self, request: Request, hits: list[list[int]]) -> None:
        """``infer:prefix_cache_queries`` / ``_hits`` (tokens), and the request's cached tokens
        (``usage.prompt_tokens_details.cached_tokens``; its first admission only)."""
        if not self.prefix_caching or request.params.prompt_logprobs is not None:
            return
        seqs = request.unfinished_seqs[:1] if request.shares_prefill else request.unfinished_seqs
        hit_tokens = sum(len(h) for h in hits) * self.block_size
        self.prefix_cache_queries += sum(len(s.token_ids) for s in seqs)
        self.prefix_cache_hits += hit_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = hit_tokens

    def cache_blocks(self, seq: Sequence) -> None:
        """Give a key to each of ``seq``'s full blocks whose K/V is computed and that has none yet
        (called before a step adds to the sequence, and before its blocks are freed)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        hashes = self.seq_block_hashes(seq)
        n = min(seq.num_computed_tokens // bs, len(seq.block_table), len(hashes))
        for i in range(seq.num_cached_blocks, n):
            self.pool.cache_block(seq.block_table[i], hashes[i], seq.token_ids[i * bs : (i + 1) * bs])
        seq.num_cached_blocks = max(seq.num_cached_blocks, n)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (vLLM's ``reset_prefix_cache``); returns how many cached free
        blocks were dropped (0 without prefix caching)."""
        if not self.prefix_caching:
            return 0
        if self.offloader is not None:  # phase 10: the tiers below forget theirs too
            self.offloader.reset()
        return self.pool.reset()

    # ------------------------------------------------------------------ growing

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make ``seq``'s block table cover its computed tokens plus ``num_new_tokens``.

        Returns:
            False, taking nothing, when too few blocks are free (the scheduler then preempts).
        """
        self.cache_blocks(seq)  # what the last steps computed can be found from now on
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back ``seq``'s blocks past the first ``num_tokens`` tokens (speculative decoding, phase 12:
        the blocks taken for drafts that were rejected). Such blocks hold no computed full block, so none
        has a prefix-cache key. The table becomes a new list (a list's identity stands for its contents
        in the CUDA-graph staging rows, :class:`~infer.engine.step.BlockTableRows`, which assume a table
        only grows)."""
        keep = self.blocks_for(num_tokens)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:])
            seq.block_table = seq.block_table[:keep]

    def free(self, seq: Sequence) -> None:
        """Release every block ``seq`` holds (shared blocks stay while another holder remains;
        with prefix caching, its computed full blocks get their key first and stay cached)."""
        if seq.block_table:
            self.cache_blocks(seq)
            self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0
        if seq.state_slot >= 0:  # hybrid: its recurrent state is dropped (a preempted one recomputes it)
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = -1
        seq.state_restore = -1

    # ------------------------------------------------------------------ hybrid prefix caching (phase 17)

    def plan_state_snapshots(self, scheduled: list) -> None:
        """Fill each scheduled item's ``state_restore`` (the snapshot a prefix hit starts from, taken off
        the sequence) and ``state_snapshots``: at every multiple of the stride its tokens reach this step,
        a split of the linear layers' prefill and a snapshot slot for the block that ends there
        (:meth:`~infer.engine.state_snapshots.StateSnapshotPool.take`; -1 when it has one or none is
        free). Called by the scheduler once the step is final; the model runner writes the tensors."""
        snaps, bs = self.snapshots, self.block_size
        for item in scheduled:
            seq = item.seq
            item.state_restore, seq.state_restore = seq.state_restore, -1
            start = seq.num_computed_tokens
            item.state_snapshots = [(p - start, snaps.take(seq.block_table[p // bs - 1], self.pool.cached_free))
                                    for p in snaps.boundaries(start, start + item.num_tokens)]

    def check_invariants(self) -> None:
        """Raise AssertionError unless the pools are consistent: the blocks
        (:meth:`~infer.engine.prefix_cache.PrefixCachingBlockPool.check_invariants`), the running slots
        (each free or held by one running sequence is checked by the caller) and the snapshot slots,
        each owned by a block that is in use or cached."""
        if self.prefix_caching:
            self.pool.check_invariants()
        assert len(set(self.free_state_slots)) == len(self.free_state_slots)
        assert all(0 <= s < self.num_state_slots for s in self.free_state_slots)
        if self.snapshots is not None:
            self.snapshots.check_invariants()
            for b in self.snapshots.of_block:
                assert self.pool.ref_counts[b] > 0 or b in self.pool.cached_free, f"snapshot of free block {b}"


def block_extra_keys(request: Request) -> tuple:
    """What besides its tokens decides a block's K/V, hashed into every key of ``request``'s
    blocks (vLLM's "extra keys": a LoRA adapter, multimodal inputs, a cache salt). Here the LoRA
    adapter (phase 16): its K and V projections change the cached K/V, so the same prompt under two
    adapters (or one adapter and the base model) never shares a block."""
    lora = request.lora_request
    if lora is None:
        return ()
    return (("lora", lora.lora_int_id, lora.lora_name, lora.lora_path),)
