"""One step as the model runner sees it: its inputs (flattened on demand) and its result.

The scheduler hands the model runner ``[ScheduledSeq(sequence, num_new_tokens), ...]``. Every
route a step can take (a captured CUDA graph, :mod:`infer.engine.cuda_graphs`, or the eager
forward, :class:`~infer.engine.model_runner.ModelRunner`) reads it through :class:`StepInputs`:

* :func:`flatten` lays the step out as one batch: every sequence's new tokens back to back in
  ``input_ids[T]`` / ``positions[T]``, where each sequence starts (``query_start_loc``), its
  context length after the step and its block table, and which rows sample (vLLM's flattened
  batch; nano-vllm's ``prepare_prefill``);
* :func:`chunk_extent` says where a prefill chunk (phase 6) or a decode token sits;
* :func:`input_ids_patch` / :func:`patch_input_ids`: with async scheduling (phase 9) the previous
  step's tokens are still on the device, and are written into this step's input ids there;
* :class:`BlockTableRows` keeps the block tables' host rows from step to step (CUDA-graph staging).

A forward produces a :class:`ForwardOutput` (logits of the sampled rows, or every token's hidden
states); sampling turns it into the :class:`StepResult` the output processor reads.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from infer.engine.scheduler import ScheduledSeq
from infer.engine.sequence import PLACEHOLDER, Sequence
from infer.sampling import SamplerOutput

_NUM_TOKENS = operator.attrgetter("num_tokens")
_FORKS = operator.attrgetter("forks")
_SPEC = operator.attrgetter("spec_token_ids")


@dataclass
class StepResult:
    """What one forward produced.

    Attributes:
        sampled: the sequences that sampled a token, in the sampler's row order (a request's
            forks sample right after the sequence that prefilled for them).
        sampler_output: their tokens and logprobs (device tensors).
        prompt_logprobs: ``id(sequence) -> (chosen [L] f32, ranks [L], top_ids [L, K],
            top_logprobs [L, K])`` for the prompt positions computed this step (CPU tensors),
            for sequences that asked for prompt logprobs.
        before_next_sampling: async scheduling: set by the engine when the *next* step's sampling
            needs this step's tokens on the host (penalty counts, a structured-output automaton).
            The next :meth:`ModelRunner.execute` calls it once its forward is launched and before
            it builds its sampling tensors, so the host applies these tokens while the device runs
            that forward (vLLM and SGLang fill the grammar bitmask of step N + 1 the same way).
    """

    sampled: list[Sequence]
    sampler_output: SamplerOutput | None
    prompt_logprobs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    before_next_sampling: Callable[[], None] | None = None
    _host: tuple[torch.Tensor, ...] | None = None
    _ready: torch.cuda.Event | None = None

    def start_copy_to_host(self) -> None:
        """Start copying the sampled tokens (and logprobs) to pinned host memory, in stream order,
        without waiting: :meth:`host_outputs` waits for this copy only, not for work enqueued after
        it (async scheduling enqueues the next step's forward before reading this one's tokens)."""
        out = self.sampler_output
        if out is None or self._host is not None:
            return
        # the chosen logprobs always: NaN marks a row that had no token to sample (infer.sampling.sampler)
        need_top = any(s.params.logprobs is not None for s in self.sampled)
        tensors = [out.next_tokens, out.logprobs] + ([out.top_logprob_ids, out.top_logprobs] if need_top else [])
        if out.next_tokens.device.type != "cuda":
            self._host = tuple(tensors)
            return
        self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                           for t in tensors)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def host_outputs(self) -> tuple[list, list, list | None, list | None]:
        """``(tokens, chosen logprobs, top ids, top logprobs)`` as host lists (the top ones None when no
        sampled sequence asked for logprobs; a NaN chosen logprob marks a row that had no token to
        sample); waits for :meth:`start_copy_to_host`'s copy."""
        self.start_copy_to_host()
        if self._ready is not None:
            self._ready.synchronize()
        lists = [t.tolist() for t in self._host]
        return (lists[0], lists[1], *(lists[2:] if len(lists) > 2 else (None, None)))


def patch_input_ids(input_ids: torch.Tensor, patch: tuple[torch.Tensor | None, torch.Tensor]) -> None:
    """Async scheduling: write the tokens the previous step sampled into this step's ``input_ids``
    (``[T]`` int64, on the device). ``patch`` is ``(flat positions [P] int64, tokens [P] int64)``,
    or ``(None, tokens)`` when the positions are the first ``P``."""
    index, tokens = patch
    if index is None:
        input_ids[: tokens.shape[0]].copy_(tokens)
    else:
        input_ids.index_copy_(0, index, tokens)


def placeholders(scheduled: list[ScheduledSeq], starts: list[int], prev: StepResult) -> tuple[list, list]:
    """Async scheduling: where this step's input holds tokens the previous step sampled and the
    host has not seen yet (:data:`~infer.engine.sequence.PLACEHOLDER`).

    Returns:
        ``(flat positions in input_ids, rows of prev's sampled tokens)``, one pair per placeholder
        (a sequence holds at most one: the previous step's token is its last).
    """
    row_of = {id(s): r for r, s in enumerate(prev.sampled)}
    flat, rows = [], []
    for k, item in enumerate(scheduled):
        seq = item.seq
        last = len(seq.token_ids) - 1
        if seq.token_ids[last] == PLACEHOLDER and seq.num_computed_tokens <= last:
            flat.append(starts[k] + last - seq.num_computed_tokens)
            rows.append(row_of[id(seq)])
    return flat, rows

def input_ids_patch(scheduled: list[ScheduledSeq], starts, prev: StepResult | None, to_device
                    ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """Async scheduling: the :func:`patch_input_ids` argument that puts ``prev``'s sampled tokens
    into this step's input ids (``starts``: each sequence's first flat index), or ``None``.
    ``to_device(values, dtype)`` copies a host list to the device."""
    if prev is None or prev.sampler_output is None:
        return None
    sampled, tokens = prev.sampled, prev.sampler_output.next_tokens
    n = len(sampled)
    if (0 < n <= len(scheduled) and starts[n] == n
            and all(map(operator.is_, (item.seq for item in scheduled[:n]), sampled))
            and all(item.seq.token_ids[-1] == PLACEHOLDER for item in scheduled[:n])):
        # the usual decode step: the previous step's rows, in its order, are this step's first
        # ids, each decoding its one placeholder (a sequence that finished or was preempted since
        # breaks the match): a device-to-device copy, no index tensors to build and send
        return None, tokens[:n]
    flat, rows = placeholders(scheduled, starts, prev)
    if flat and flat == rows and flat[-1] == len(flat) - 1:  # the same, found the long way
        return None, tokens[: len(flat)]
    if flat:
        return to_device(flat, torch.int64), tokens[to_device(rows, torch.int64)]
    return None


def block_table_array(tables: list[list[int]], width: int, out: np.ndarray | None = None) -> np.ndarray:
    """int32 ``[B, width]`` block tables, padded with 0; one C-level copy per row, 6x faster than
    building a flat list. With ``out`` (a reused buffer), the tables are written into its first rows
    and the columns past each table keep whatever they held: no kernel reads past a sequence's length."""
    rows = np.zeros((len(tables), width), dtype=np.int32) if out is None else out
    for i, t in enumerate(tables):
        rows[i, : len(t)] = t
    return rows


class BlockTableRows:
    """Host copies of the block tables that steps read, kept from step to step (CUDA-graph staging).

    Converting every running sequence's ``block_table`` from its Python list at every step is the
    largest piece of a wide decode step's host work (256 tables of up to 67 blocks: 0.76 ms on an
    H100 machine's host, 0.19 ms on the development CPU). But a table only grows, one block every
    ``block_size`` tokens, between the moments it is replaced by a new list (admission, preemption,
    freeing: :mod:`infer.engine.kv_cache_manager`). So each list gets a row here the first time it
    is seen, later steps write only what it gained, and a step's tables are one gather of rows
    (6x faster at 256 sequences on the CPU). vLLM's persistent batch keeps its block table the same
    way. A list and its length say what its row holds; the row's entry keeps the list alive, so its
    ``id`` is not reused while the row is.

    Args:
        rows: rows kept; at least the widest step's number of tables (more rows: fewer rebuilds,
            which happen when the rows of lists no longer in use have to be taken back).
        max_blocks: the longest table.
    """

    def __init__(self, rows: int, max_blocks: int) -> None:
        self.table = np.zeros((rows, max_blocks), dtype=np.int64)
        self._rows: dict[int, list] = {}  # id(list) -> [row, the list, entries written]
        self._free = list(range(rows - 1, -1, -1))
        self.rebuilds = 0

    def gather(self, tables: list[list[int]], width: int, out: np.ndarray) -> None:
        """Write ``tables`` (at most ``rows`` of them, none longer than ``width``) into ``out``, an int64
        ``[len(tables), width]`` array; columns past a table's length hold anything (no kernel reads
        past a sequence's length)."""
        if len(self._free) < len(tables):  # take back every row: the step's tables are written anew
            self._rows.clear()
            self._free = list(range(len(self.table) - 1, -1, -1))
            self.rebuilds += 1
        rows, table = self._rows, self.table
        idx = []
        for t in tables:
            entry = rows.get(id(t))
            n = len(t)
            if entry is None:
                r = self._free.pop()
                table[r, :n] = t
                rows[id(t)] = [r, t, n]
                idx.append(r)
            else:
                if entry[2] != n:  # it grew since
                    table[entry[0], entry[2]:n] = t[entry[2]:]
                    entry[2] = n
                idx.append(entry[0])
        np.take(table[:, :width], idx, axis=0, out=out)


def chunk_extent(seq: Sequence, num_new_tokens: int) -> tuple[int, int, bool]:
    """Where a step's ``num_new_tokens`` tokens of ``seq`` sit, for prefill chunks and decodes alike.

    Returns:
        ``(first, kv_len, samples)``: the position of the first new token (the tokens whose K/V
        is cached already), the number of keys the new tokens attend over after this step writes
        theirs (the cached prefix plus the chunk: never the whole prompt, whose later tokens are
        not in the cache yet), and whether the sequence samples a token this step (only when
        every one of its tokens is computed: after the last chunk of a prompt, or of the prompt
        and generated tokens recomputed after a preemption).
    """
    # >>> EXERCISE chunk_key_length
    first = seq.num_computed_tokens
    kv_len = first + num_new_tokens
    return first, kv_len, kv_len == len(seq.token_ids)
    # <<< EXERCISE chunk_key_length


def flatten(scheduled: list[ScheduledSeq]):
    """The step as flat host lists (see :class:`~infer.attention.AttentionMetadata`).

    Returns:
        ``(input_ids [T], positions [T], query_start_loc [B + 1], seq_lens [B],
        block_tables [B][*], first new position of each sequence [B], sample_at, sampled)``:
        ``sample_at`` are the flat indices whose logits are sampled, one per sequence in
        ``sampled`` (a sequence whose prompt is complete after this step, then its forks,
        which sample from the same position).
    """
    # >>> EXERCISE flatten_batch
    ids: list[int] = []
    positions: list[int] = []
    starts, seq_lens, tables, firsts = [0], [], [], []
    sample_at: list[int] = []
    sampled: list[Sequence] = []
    for item in scheduled:
        seq, n = item.seq, item.num_tokens
        first, kv_len, samples = chunk_extent(seq, n)
        ids.extend(seq.token_ids[first : first + n])
        positions.extend(range(first, first + n))
        starts.append(starts[-1] + n)
        seq_lens.append(kv_len)
        tables.append(seq.block_table)
        firsts.append(first)
        if samples:  # every token is in the cache after this step: sample the next one
            for s in (seq, *item.forks):
                sample_at.append(starts[-1] - 1)
                sampled.append(s)
    return ids, positions, starts, seq_lens, tables, firsts, sample_at, sampled
    # <<< EXERCISE flatten_batch


def flatten_with_drafts(scheduled: list[ScheduledSeq]):
    """:func:`flatten` for a step in which some sequences verify draft tokens (speculative decoding,
    phase 12: :mod:`infer.engine.spec_decode`).

    A verifying sequence runs its last token and its drafts ``d_1 .. d_k`` (``k + 1`` positions, an
    extend over its cached context) and samples at every one of them: the row after ``d_1 .. d_i`` is
    what decoding would sample after those tokens. So it appears ``k + 1`` times in ``sampled``, in
    position order, with ``sample_at`` its ``k + 1`` flat rows. Other sequences are laid out as
    :func:`flatten` does. Returns: as :func:`flatten`.
    """
    ids: list[int] = []
    positions: list[int] = []
    starts, seq_lens, tables, firsts = [0], [], [], []
    sample_at: list[int] = []
    sampled: list[Sequence] = []
    for item in scheduled:
        seq, n, spec = item.seq, item.num_tokens, item.spec_token_ids
        first, kv_len, samples = chunk_extent(seq, n - len(spec))
        ids.extend(seq.token_ids[first : first + n - len(spec)])
        ids.extend(spec)
        positions.extend(range(first, first + n))
        starts.append(starts[-1] + n)
        seq_lens.append(kv_len + len(spec))
        tables.append(seq.block_table)
        firsts.append(first)
        if spec:
            sample_at.extend(range(starts[-1] - len(spec) - 1, starts[-1]))
            sampled.extend([seq] * (len(spec) + 1))
        elif samples:
            for s in (seq, *item.forks):
                sample_at.append(starts[-1] - 1)
                sampled.append(s)
    return ids, positions, starts, seq_lens, tables, firsts, sample_at, sampled


class FlatStep:
    """A step laid out as one batch by :func:`flatten`, decodes first (the attention backends take
    the decode rows as one slice: :class:`~infer.attention.AttentionMetadata`).

    Attributes:
        scheduled: the step's sequences in flat order (decodes first, otherwise as scheduled).
        ids, positions: ``[T]`` host lists: the new tokens and their positions.
        starts: ``query_start_loc`` ``[B + 1]``: sequence ``i``'s tokens are ``starts[i]:starts[i + 1]``.
        seq_lens: ``[B]`` context lengths after the step (cached keys + new tokens).
        tables: ``[B]`` block tables (the sequences' own lists).
        slots: ``[T]`` slot mapping: where each new token's K/V is written.
        num_decodes: how many of the first sequences run one token.
        sample_at, sampled: the flat rows whose logits are sampled, and their sequences (forks
            sample from their prompt's last row).
    """

    __slots__ = ("scheduled", "ids", "positions", "starts", "seq_lens", "tables", "slots", "num_decodes",
                 "sample_at", "sampled")

    def __init__(self, scheduled: list[ScheduledSeq], slot_mapping: Callable) -> None:
        # decodes first (stable), so the attention gets them as one slice
        self.scheduled = sorted(scheduled, key=lambda item: item.num_tokens != 1)
        lay_out = flatten_with_drafts if any(map(_SPEC, scheduled)) else flatten
        (self.ids, self.positions, self.starts, self.seq_lens, self.tables, firsts, self.sample_at,
         self.sampled) = lay_out(self.scheduled)
        self.slots = slot_mapping(self.tables, firsts, list(map(_NUM_TOKENS, self.scheduled)))
        self.num_decodes = sum(1 for s in self.scheduled if s.num_tokens == 1)


class StepInputs:
    """One scheduled step, read by whichever route runs it (a captured graph, or the eager forward).

    Cheap to make: a decode-only step that replays a CUDA graph reads the sequences directly
    (:func:`~infer.engine.cuda_graphs.stage_decodes`) and never builds the flat lists; every other
    route reads :attr:`flat`, built once on first use.

    Args:
        scheduled: the scheduler's step.
        prev: async scheduling: the previous step, whose sampled tokens (still on the device) replace
            this step's placeholders; None otherwise.
        runner: the model runner: its ``_to_device``, ``_metadata`` and KV cache's ``slot_mapping``
            build the device tensors (a tensor-parallel runner's ``_metadata`` is its own).
    """

    def __init__(self, scheduled: list[ScheduledSeq], prev: StepResult | None, runner) -> None:
        self.scheduled = scheduled
        self.prev = prev
        self.runner = runner
        self.num_tokens = sum(map(_NUM_TOKENS, scheduled))
        self.has_forks = any(map(_FORKS, scheduled))
        self.has_spec = any(map(_SPEC, scheduled))  # some sequence verifies draft tokens (phase 12)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence runs one token (a decode, or a one-token prefill chunk) and none has forks."""
        return self.num_tokens == len(self.scheduled) and not self.has_forks

    @functools.cached_property
    def flat(self) -> FlatStep:
        """The step as one flat batch, decodes first (:class:`FlatStep`)."""
        return FlatStep(self.scheduled, self.runner.kv_cache.slot_mapping)

    def to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A host list as a tensor on the runner's device (one copy through pinned memory on CUDA)."""
        return self.runner._to_device(values, dtype)

    def decode_patch(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """:func:`input_ids_patch` for a decode-only step (sequence ``i``'s token is row ``i``)."""
        return input_ids_patch(self.scheduled, range(len(self.scheduled) + 1), self.prev, self.to_device)

    @functools.cached_property
    def flat_patch(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """:func:`input_ids_patch` for the flat layout (computed once: it may copy to the device)."""
        return input_ids_patch(self.flat.scheduled, self.flat.starts, self.prev, self.to_device)

    @functools.cached_property
    def metadata(self):
        """The step's :class:`~infer.attention.AttentionMetadata` over the runner's KV cache."""
        f = self.flat
        meta = self.runner._metadata(f.starts, f.seq_lens, self.to_device(f.slots, torch.int64), f.tables,
                                     f.num_decodes)
        cache = getattr(self.runner, "state_cache", None)
        if cache is not None:  # hybrid models (phase 17): each sequence's recurrent-state slot
            meta.state_cache = cache
            meta.state_slots_cpu = [item.seq.state_slot for item in f.scheduled]
            meta.state_slots = self.to_device(meta.state_slots_cpu, torch.int64)
            if any(item.state_restore >= 0 for item in f.scheduled):  # prefix hits start from a snapshot
                meta.state_restores = [item.state_restore for item in f.scheduled]
            if any(item.state_snapshots for item in f.scheduled):
                meta.state_snapshots = [item.state_snapshots for item in f.scheduled]
        return meta


@dataclass
class ForwardOutput:
    """What a step's forward left for sampling.

    Attributes:
        sampled: the sequences that sample a token, in row order.
        logits: ``[len(sampled), vocab]``, when the route computed them (a decode or prefill graph
            runs the LM head inside the graph).
        hidden: ``[T, hidden]`` final hidden states of every token otherwise: the runner computes
            prompt logprobs from them and the sampled rows' logits (:attr:`FlatStep.sample_at`).
        graph: the captured graph that ran the step (:meth:`CUDAGraphRunner.run`'s routes:
            ``"decode"``, ``"verify"``, ``"prefill"``, ``"mixed-whole"``, ``"mixed-pieces"``), None when it ran
            eagerly (read by step traces, :mod:`infer.engine.step_trace`).
    """

    sampled: list[Sequence]
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    graph: str | None = None
