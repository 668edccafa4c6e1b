"""The attention-metadata object every forward receives.

A step of the engine is one flattened batch: ``input_ids[T]`` and ``positions[T]`` hold the
new tokens of every sequence, back to back, and this object says where each sequence starts
and how long its context is. Prefill (many new tokens, empty cache), decode (one new token,
long cache) and mixed steps are the same call; only these numbers differ. The same idea is
``FlashAttentionMetadata`` in vLLM v1 and ``ForwardBatch`` in SGLang.

Example: two sequences, the first prefilling 3 tokens, the second decoding its 6th token::

    input_ids        = [a0 a1 a2 | b5]                T = 4
    positions        = [0  1  2  | 5 ]
    query_start_loc  = [0, 3, 4]                      (cu_seqlens_q, B + 1 entries)
    seq_lens         = [3, 6]                         (context incl. the new tokens)
    block_tables     = [[7, -], [2, 9]]               (block_size 4: b0-b3 in block 2, b4-b5 in 9)
    slot_mapping     = [28, 29, 30, 37]               (block * block_size + offset of each new token)

The model runner puts the decode sequences (one new token each) first, so an attention backend
can hand ``q[:num_decodes]`` to a decode kernel and the rest to a prefill kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infer.attention.kv_cache import KVCache
    from infer.attention.state_cache import RecurrentStateCache


@dataclass
class AttentionMetadata:
    """Describes one flattened batch to the attention backend.

    Attributes:
        query_start_loc: int32 ``[B + 1]`` on the device: offsets of each sequence's new
            tokens in the flattened batch (``cu_seqlens_q``).
        seq_lens: int32 ``[B]`` on the device: context length of each sequence *after* this
            step's tokens are written (cached tokens + new tokens).
        query_start_loc_cpu, seq_lens_cpu: the same numbers as Python lists, so the host
            never has to synchronize with the device to read them.
        kv_cache: the cache K/V are written to and read from, or ``None`` for a cache-less
            forward over whole sequences (used by the parity gate and by scoring).
        slot_mapping: int64 ``[T]``: the flat cache slot of every new token (only with a cache).
        block_tables: int32 ``[B, W]`` on the device: the KV blocks of each sequence, padded
            with 0 to the widest table of the step (only with a cache).
        block_tables_cpu: the same as lists of ints, unpadded.
        num_decodes: the first ``num_decodes`` sequences have exactly one new token.
        decode_split_batch: the decode batch the flash-decoding split count is chosen for (None:
            ``num_decodes``). A CUDA graph whose decode rows are mostly padding sets the batch it
            expects, so that the few real rows still split their keys over enough programs.
        state_cache: hybrid models (phase 17): the recurrent-state slots of the linear-attention
            layers, or None (a cache-less forward: every sequence starts from a zero state).
        state_slots: int64 ``[B]`` on the device: each sequence's slot in ``state_cache``;
            ``state_slots_cpu`` the same as a list.
        state_restores: hybrid prefix caching: per sequence, the snapshot slot its state starts from this
            step (-1: its own slot), or None when no sequence restores one.
        state_snapshots: hybrid prefix caching: per sequence, ``(offset, slot)`` pairs: the linear layers
            split its tokens after ``offset`` of them and copy the state there into ``slot`` (-1: split
            only); None when prefix caching is off (:mod:`infer.engine.state_snapshots`).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    kv_cache: KVCache | None = None
    slot_mapping: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    block_tables_cpu: list[list[int]] | None = None
    num_decodes: int = 0
    decode_split_batch: int | None = None
    state_cache: RecurrentStateCache | None = None
    state_slots: torch.Tensor | None = None
    state_slots_cpu: list[int] | None = None
    state_restores: list[int] | None = None
    state_snapshots: list[list[tuple[int, int]]] | None = None

    _decode: tuple | None = field(default=None, init=False, repr=False)
    # per-step values an attention backend builds once and reuses in every layer
    scratch: dict = field(default_factory=dict, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @cached_property
    def max_query_len(self) -> int:
        """The most new tokens of one sequence in this step (host int)."""
        q = self.query_start_loc_cpu
        return max((q[i + 1] - q[i] for i in range(self.num_seqs)), default=0)

    def first_positions(self) -> list[int]:
        """Position of each sequence's first new token (tokens already cached before this step); 0 for
        a sequence that starts here, whose recurrent state (phase 17) starts at zero."""
        q = self.query_start_loc_cpu
        return [self.seq_lens_cpu[i] - (q[i + 1] - q[i]) for i in range(self.num_seqs)]

    def prefill_indices(self) -> list[int]:
        """Indices of the sequences with more than one new token this step."""
        q = self.query_start_loc_cpu
        return [i for i in range(self.num_seqs) if q[i + 1] - q[i] > 1]

    def decode_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int] | None:
        """The step's decode sequences (one new token each), built once and shared by all layers.

        Returns:
            ``(token_idx, rows, seq_lens, max_seq_len, max_row + 1)``: int64 ``[B]`` positions of
            their tokens in the flattened batch, int64 ``[B]`` cache rows (the first block of each
            sequence: its only one in the contiguous cache), int64 ``[B]`` context lengths, the
            longest context and the rows spanned (host ints); or None when no sequence decodes.
        """
        if self._decode is None:
            q = self.query_start_loc_cpu
            idx = [i for i in range(self.num_seqs) if q[i + 1] - q[i] == 1]
            if not idx:
                self._decode = ()
            else:
                dev = self.query_start_loc.device
                lens = [self.seq_lens_cpu[i] for i in idx]
                rows = [self.block_tables_cpu[i][0] for i in idx]
                self._decode = (
                    torch.tensor([q[i] for i in idx], dtype=torch.int64, device=dev),
                    torch.tensor(rows, dtype=torch.int64, device=dev),
                    torch.tensor(lens, dtype=torch.int64, device=dev),
                    max(lens),
                    max(rows) + 1,
                )
        return self._decode or None

    @classmethod
    def for_prefill(cls, seq_lens: list[int], device: torch.device | str) -> AttentionMetadata:
        """Cache-less metadata for whole sequences (each attends only to itself, causally).

        Args:
            seq_lens: token count of each sequence, in the order they are flattened.
            device: where the int32 tensors are created.
        """
        starts = [0]
        for n in seq_lens:
            if n <= 0:
                raise ValueError(f"sequence lengths must be positive, got {seq_lens}")
            starts.append(starts[-1] + n)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(seq_lens),
        )
