"""Staging a decode step for a CUDA graph (phase 9): the sequences' ids, positions, KV slots, context
lengths (and, for a hybrid model, recurrent-state slots) and block tables written into one packed int64
host array, copied to the device in one transfer before the graph replays
(:meth:`infer.engine.cuda_graphs.CUDAGraphRunner.replay`)."""

from __future__ import annotations

import operator

import numpy as np

from infer.engine.step import BlockTableRows

_BLOCK_TABLE = operator.attrgetter("block_table")
_NUM_COMPUTED = operator.attrgetter("num_computed_tokens")
_TOKEN_IDS = operator.attrgetter("token_ids")
_SEQ = operator.attrgetter("seq")
_STATE_SLOT = operator.attrgetter("state_slot")


def stage_decodes(seqs: list, table_rows: BlockTableRows, block_size: int, h: np.ndarray, bs: int,
                  state_pad_slot: int | None = None) -> tuple[int, np.ndarray | None]:
    """Write a decode step of ``B = len(seqs)`` sequences, one new token each, into ``h`` (int64, the
    packed layout of :meth:`CUDAGraphRunner.replay`: ``[ids | positions | slots | context lengths]``
    of ``bs >= B`` rows each, padding rows included, then the ``[B, width]`` block tables). With
    ``state_pad_slot`` (hybrid models, phase 17) a fifth vector comes before the tables: each row's
    recurrent-state slot (``seq.state_slot``), ``state_pad_slot`` in the padding rows.

    The step is read from the sequences with a few C-level maps and computed with NumPy: sequence
    ``i``'s new token sits at position ``p = num_computed_tokens`` (the token the last step sampled,
    or with chunked prefill the last token of a prompt chunk of one), its context is ``p + 1`` keys and
    its slot ``table[p // block_size] * block_size + p % block_size``, read from the block-table rows
    ``table_rows`` keeps between steps. Per sequence this is the same as the general path's
    ``flatten`` (:mod:`infer.engine.step`) and ``KVCache.slot_mapping`` (tested against them at every step), without
    their per-token Python loops: 82 against 261 us at 256 sequences on the development CPU, 259 against
    842 us on an H100 machine's host (the kept table rows' gather included in both). vLLM's
    persistent batch computes its slot mapping from a kept block table the same way.

    Returns:
        ``(width, rows)``: the widest table (blocks), and the rows that sample a token this step (those
        whose every token is computed after it), ``None`` when all of them do.

    Raises:
        RuntimeError: with ``state_pad_slot``, a sequence without a state slot (a scheduler bug: the
            kernels would write outside the state cache).
    """
    b = len(seqs)
    tables = list(map(_BLOCK_TABLE, seqs))
    width = max(map(len, tables))
    computed = list(map(_NUM_COMPUTED, seqs))
    token_ids = list(map(_TOKEN_IDS, seqs))
    pos = h[bs: bs + b]
    pos[:] = computed
    h[:b] = list(map(operator.getitem, token_ids, computed))
    h[3 * bs: 3 * bs + b] = pos + 1
    at = 4 * bs
    if state_pad_slot is not None:
        state = h[at: at + bs]
        state[:b] = list(map(_STATE_SLOT, seqs))
        state[b:] = state_pad_slot
        if b and state[:b].min() < 0:
            raise RuntimeError(f"a decode row has no recurrent-state slot: {state[:b].tolist()}")
        at += bs
    rows = h[at: at + b * width].reshape(b, width)
    table_rows.gather(tables, width, rows)
    h[2 * bs: 2 * bs + b] = rows[np.arange(b), pos // block_size] * block_size + pos % block_size
    _pad_rows(h, b, bs)
    samples = pos + 1 == np.fromiter(map(len, token_ids), dtype=np.int64, count=b)
    return width, None if samples.all() else np.flatnonzero(samples)


def _pad_rows(h: np.ndarray, b: int, bs: int) -> None:
    """The padding rows ``b .. bs - 1`` of the packed step's four vectors: id 0 at position 0, slot -1 (writes
    nothing), context length 0 (reads nothing)."""
    for k, pad in enumerate((0, 0, -1, 0)):
        h[k * bs + b: (k + 1) * bs] = pad


def packed_size(b: int, bs: int, width: int, vectors: int = 4) -> int:
    """Entries of a packed decode step (:meth:`CUDAGraphRunner.replay`): ``vectors`` vectors of the
    bucket's ``bs`` rows (four; five with a hybrid model's state slots) and ``b`` block tables of
    ``width`` columns."""
    return vectors * bs + b * width


def stage_rows(ids: list[int], positions: list[int], slots: list[int], row_seq: np.ndarray,
               tables: list[list[int]], table_rows: BlockTableRows, h: np.ndarray, bs: int) -> int:
    """Write a step whose every token is laid out as a decode row into ``h`` (int64, :meth:`CUDAGraphRunner.replay`'s
    packed layout for ``T = len(ids) <= bs`` rows): speculative decoding's verify step (phase 12), where a
    sequence runs its last token and its ``k`` drafts. Token ``r`` at position ``p`` attends keys ``0 .. p``
    of its sequence, the last ones written by this step's rows before it: a decode of context ``p + 1``
    over the sequence's block table. So a verify step of ``B`` sequences is a decode step of ``T`` rows,
    each with its own position, slot and context length and its sequence's table (the same table in
    ``k + 1`` rows), and the decode graphs serve it (SGLang's and vLLM's uniform "decode" batches of
    ``1 + k`` tokens per request are this shape).

    Args:
        ids, positions, slots: one int per row (the flat step's).
        row_seq: int64 ``[T]``, the index in ``tables`` of each row's sequence.
        tables: the step's ``B`` block tables.
        table_rows: the kept host copies of the tables (:class:`~infer.engine.step.BlockTableRows`).

    Returns:
        The widest table (blocks).
    """
    t = len(ids)
    width = max(map(len, tables))
    seq_rows = np.empty((len(tables), width), dtype=np.int64)
    table_rows.gather(tables, width, seq_rows)
    h[:t] = ids
    h[bs: bs + t] = positions
    h[2 * bs: 2 * bs + t] = slots
    h[3 * bs: 3 * bs + t] = h[bs: bs + t] + 1
    _pad_rows(h, t, bs)
    np.take(seq_rows, row_seq, axis=0, out=h[4 * bs: 4 * bs + t * width].reshape(t, width))
    return width
