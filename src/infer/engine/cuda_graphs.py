"""CUDA graphs for decode steps (phase 9, ``EngineConfig.cuda_graphs``).

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python,
each costs the host 5-50 µs, far more than the GPU needs to run it, so the GPU idles between
kernels. A CUDA graph records the launches of one forward once (*capture*) and replays them
all with one call (*replay*): the host cost of a step becomes one launch.

A graph replays exactly what was captured: the same kernels, the same grid sizes, the same
memory addresses. So (nano-vllm's ``capture_cudagraph``, vLLM's ``CUDAGraphRunner``,
mini-sglang's ``GraphRunner`` all do this):

* **Static buffers.** Every input of the forward lives in a buffer allocated once, sized for
  the largest batch: input ids, positions, slot mapping, context lengths, block tables (padded
  to the widest table a sequence can have: ``ceil(max_model_len / block_size)`` columns). Before
  a replay the runner copies the step's values into them in place.
* **Buckets.** One graph per batch size would be too many; graphs are captured for batch sizes
  1, 2, 4, 8, then every multiple of 8 up to ``cuda_graph_max_batch_size`` (vLLM's list). A step
  of ``B`` sequences replays the smallest bucket ``>= B``; the rows past ``B`` are *padding*:
  slot -1 (the cache write skips it), context length 0 (the attention reads no key and writes
  zeros), token 0 at position 0. Their logits are computed and dropped.
* **Graph-safe kernels.** The decode attention's launch grid depends on the number of
  flash-decoding splits, chosen on the host: under a graph it is fixed per bucket for the
  longest context (``max_model_len``), and splits that fall past a sequence's end exit at once.
  Nothing inside the forward may read the device from the host (no ``.item()``), allocate with
  data-dependent shapes, or compile a kernel: each bucket runs eagerly once (warm-up, which
  compiles the Triton kernels) before it is captured.
* **One memory pool.** Tensors a graph allocates while it is captured stay reserved for its
  replays. All graphs share one pool and are captured largest first, so the smaller ones reuse
  the largest one's memory (they never run at the same time). The engine counts this memory
  before it sizes the KV cache (:func:`~infer.engine.memory.num_kv_blocks`).

**Prefill graphs** (``cuda_graph_prefill_max_tokens``). A step that prefills *one* sequence alone
(a lone request's prompt, a prompt chunk, the few tokens left after a prefix-cache hit) is as
launch-bound as a decode step when it is short: the same hundreds of kernels, each doing little.
Such steps are captured too, one graph per token bucket (16, 32, 64, ... up to the maximum),
with the same static buffers: the step's ``T`` tokens fill the bucket's first rows, the padding
rows get slot -1 and are not attended (the prefill kernel's grid covers the bucket, and its
query tiles past ``T``, read from the device, exit at once); the LM head runs on row ``T - 1``
only, picked by a device index. Under a graph the cost of a 64-token extend after a 4k-token
prefix hit becomes its compute.

**Mixed steps, whole** (``cuda_graph_mixed_max_tokens``; vLLM's full graphs). Chunked prefill's
usual step is the running decodes plus *one* prompt chunk. Both attention kernels read their row
ranges on the device, so such a step is one graph per token bucket (64, 128, ... powers of 2):
its first ``D`` rows (:meth:`CUDAGraphRunner.mixed_decode_rows`) go to the decode kernel, with
context length 0 past the step's ``nd`` decodes (those programs read nothing; the chunk's rows
among them are written by the prefill kernel after), and the prefill kernel reads the chunk's
query rows ``[nd, T)`` from a device buffer; its grid covers the bucket. The graph returns the
final hidden states; the LM head runs on the sampled rows after it, as for an eager step.

**Mixed steps, piecewise** (the same buckets; vLLM's piecewise CUDA graphs). A step that prefills
several prompts cannot be one graph this way: its attention splits the tokens by sequence in ways
no fixed grid holds. But the attention is only a few launches per layer; everything between two attention
calls (norms, projections, RoPE with the cache write, the MLP) only sees a ``[T, hidden]`` tensor.
So such steps are captured per token bucket as ``L + 1`` graphs, one per stretch between attention
calls: while capturing, the attention backend is replaced by
:class:`~infer.engine.graph_pieces.Pieces`, which ends the current graph at each attention call
(allocating its output in the pool) and begins the next one. At replay the runner replays graph 0,
runs layer 0's attention eagerly with the step's real metadata on the tensors graph 0 wrote (q, k, v),
copies its output where graph 1 reads it, replays graph 1, and so on. The host cost of a mixed step
becomes ``L + 1`` graph launches and a few attention launches per layer instead of hundreds of kernels.
The ``T`` tokens fill the bucket's first rows; the padding rows have slot -1 (no K/V written) and are
not passed to the attention.

**LoRA** (phase 16, :meth:`CUDAGraphRunner.enable_lora`). Each graph (and each mixed bucket's pieces)
is captured twice: its base variant, and a LoRA variant whose shrink / expand kernels read the
step's rows grouped by adapter slot from one fixed buffer, staged before the replay like the other
inputs (:mod:`infer.lora.graphs`); a step where some row has an adapter replays the LoRA variant.

**Hybrid models** (phase 17: a recurrent state per sequence in a slot of the
:class:`~infer.attention.state_cache.RecurrentStateCache`). A decode step also reads each row's state
slot, a fifth vector of the packed step, and whether the slot holds a state yet: ``position > 0``,
computed inside the graph. A padding row cannot use slot -1 as the KV write does: the recurrent step
reads and writes a whole state at its slot, and -1 is out of bounds (as a PyTorch index, the last
slot: a real sequence's). So the state cache keeps one slot that no sequence owns
(:attr:`RecurrentStateCache.pad_slot`), which every padding row reads (as zeros) and writes. Prefill
and mixed steps of a hybrid model run eagerly (the chunked form loops over the sequences on the host).

Other steps (wider than the largest bucket, or with the buckets off) run eagerly. Sampling
runs eagerly after the replay, on the graph's logits: its randomness comes from each
sequence's own ``(seed, step)`` counter (:mod:`infer.sampling.rng`), so no random state is
frozen into a graph and replaying never repeats the same draws.
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from infer.attention import AttentionMetadata, KVCache
from infer.engine.graph_pieces import Hole, Pieces
from infer.engine.graph_staging import _SEQ, packed_size, stage_decodes, stage_rows  # noqa: F401  (re-exported)
from infer.engine.step import BlockTableRows, ForwardOutput, StepInputs, patch_input_ids
from infer.lora.graphs import LoRAGraphInputs

log = logging.getLogger("infer")


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then multiples of 8 up to ``max_batch_size``
    (included even when it is not a multiple of 8), ascending.

    Raises:
        ValueError: ``max_batch_size < 1``.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    # >>> EXERCISE graph_buckets
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    sizes.append(max_batch_size)
    return sizes
    # <<< EXERCISE graph_buckets


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The captured prefill token counts: 16, 32, 64, ... (powers of 2) below ``max_tokens``, then
    ``max_tokens`` itself, ascending; empty when ``max_tokens < 2`` (a one-token step is a decode)."""
    # >>> EXERCISE prefill_buckets
    if max_tokens < 2:
        return []
    sizes = []
    t = 16
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    return sizes + [max_tokens]
    # <<< EXERCISE prefill_buckets


#: the decode batch a whole mixed step's graph chooses its flash-decoding split count for: its decode
#: rows are the largest decode bucket's, mostly padding, and the few real ones (tens of streams beside
#: a prompt chunk) still split their keys over enough programs
MIXED_DECODE_SPLIT_BATCH = 16


def mixed_graph_sizes(max_tokens: int) -> list[int]:
    """The captured mixed-step token counts: 64, 128, 256, ... (powers of 2) below ``max_tokens``,
    then ``max_tokens`` itself, ascending; empty when ``max_tokens < 2``. (Coarser than the prefill
    buckets: each bucket keeps every layer's q, k, v and attention output in the pool.)"""
    return [t for t in prefill_graph_sizes(max_tokens) if t >= 64 or t == max_tokens]


def bucket_for(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size ``>= batch_size``, or None when the batch is wider than all.

    ``sizes`` is ascending (:func:`graph_batch_sizes`).
    """
    # >>> EXERCISE bucket_for
    for size in sizes:
        if size >= batch_size:
            return size
    return None
    # <<< EXERCISE bucket_for


class CUDAGraphRunner:
    """Captures and replays the model's decode forward (+ LM head) per batch-size bucket.

    Args:
        model: the :class:`~infer.models.layers.CausalLM` (attention backend already set; it must
            be graph-safe: the Triton one).
        kv_cache: the cache the graphs read and write (its tensors' addresses are captured).
        max_batch_size: the largest bucket.
        max_blocks_per_seq: width of the static block-table buffer.
        max_model_len: the longest context (tokens): sizes the decode kernel's split count.
        prefill_max_tokens: the largest one-sequence prefill step captured (0: none;
            :func:`prefill_graph_sizes`).
        state_cache: hybrid models (phase 17): the recurrent-state cache, with its padding slot
            (:attr:`~infer.attention.state_cache.RecurrentStateCache.pad_slot`); decode graphs only.

    Raises:
        ValueError: a state cache without a padding slot, or with prefill or mixed-step buckets.
    """

    def __init__(self, model, kv_cache: KVCache, max_batch_size: int, max_blocks_per_seq: int,
                 max_model_len: int, prefill_max_tokens: int = 0, mixed_max_tokens: int = 0,
                 attention_backend=None, state_cache=None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.state_cache = state_cache
        if state_cache is not None:
            if state_cache.pad_slot is None:
                raise ValueError("a recurrent-state cache in CUDA graphs needs its padding slot (pad_slot=True): "
                                 "the padding rows of a decode bucket write a state")
            if prefill_max_tokens or mixed_max_tokens:
                raise ValueError("prefill and mixed-step CUDA graphs are not supported for hybrid models: their "
                                 "chunked gated delta rule loops over the sequences on the host; use 0")
        # the packed decode step's vectors of one entry per row: [ids | positions | slots | context
        # lengths], and with a state cache each row's state slot
        self.num_vectors = 4 if state_cache is None else 5
        self.sizes = graph_batch_sizes(max_batch_size)
        self.prefill_sizes = prefill_graph_sizes(prefill_max_tokens)
        self.mixed_sizes = mixed_graph_sizes(mixed_max_tokens)
        if self.mixed_sizes and attention_backend is None:
            raise ValueError("mixed-step graphs need the attention backend they run between the pieces")
        self.attention_backend = attention_backend
        self.max_model_len = max_model_len
        dev = kv_cache.k.device
        n = self.sizes[-1]
        rows = max(n, prefill_max_tokens, mixed_max_tokens)  # token rows: a decode batch or a step's tokens
        self.max_rows = rows
        # ids, positions and slot mapping share one [3, rows] buffer, so one copy fills all three
        self._ids_pos_slots = torch.zeros(3, rows, dtype=torch.int64, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self._ids_pos_slots.unbind(0)
        self.slot_mapping.fill_(-1)
        # one row more than the largest decode batch: a whole mixed step's prompt chunk (row D, below)
        self.seq_lens = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n + 1, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # A step's inputs travel packed in one int64 vector (:meth:`replay`): ``[ids | positions |
        # slots | context lengths]``, ``bs`` entries each (padding rows included), then the block
        # tables ``[B, width]`` (only the columns in use). It is built in pinned host memory, copied
        # to the device in one transfer and spread into the static buffers there. Two host buffers,
        # used in turn: when the host fills one for step N, the copy of step N - 2 from it is done
        # (the host waited for step N - 1's tokens, enqueued after it), while step N - 1's copy may
        # still be pending under async scheduling.
        size = self.num_vectors * n + n * max_blocks_per_seq
        pin = dev.type == "cuda"  # (a runner on the CPU only serves tests of the staging; it captures nothing)
        self._staging = [torch.zeros(size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._table_rows = BlockTableRows(2 * (n + 1), max_blocks_per_seq)  # the block tables, kept between steps
        self._turn = 0
        self.packed = torch.zeros(size, dtype=torch.int64, device=dev)
        # Tensor parallelism (phase 14): called with ``(B, bucket, width, packed)`` once the packed
        # inputs are on the device, before the replay; rank 0 broadcasts them to the other ranks,
        # which replay the same bucket (:meth:`run_packed`) with their shard of the model.
        self.on_staged = None
        # Prefill graphs: one sequence, its query range [0, T) and the row its logits come from (T - 1);
        # packed per step as [ids | positions | slots] (bucket rows each), then context length, T, T - 1,
        # then the block table, in its own pinned staging pair.
        self.prefill_query_start_loc = torch.zeros(2, dtype=torch.int32, device=dev)
        self.prefill_sample_index = torch.zeros(1, dtype=torch.int64, device=dev)
        if self.prefill_sizes:
            size = 3 * prefill_max_tokens + 3 + max_blocks_per_seq
            self._prefill_staging = [torch.zeros(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._prefill_turn = 0
            self._prefill_packed = torch.zeros(size, dtype=torch.int64, device=dev)
        # Whole mixed steps (decodes + one prompt chunk): the chunk's query rows [nd, T) on the device, at
        # entries D, D + 1 (D: the bucket's decode rows, mixed_decode_rows); packed per step as [ids |
        # positions | slots] (bucket rows each), the D decode context lengths (0 past nd) and the chunk's,
        # nd and T, then the nd + 1 block tables (:meth:`replay_mixed_full`). The pieces use the first part.
        self.mixed_query_start_loc = torch.zeros(n + 2, dtype=torch.int32, device=dev)
        if self.mixed_sizes:
            size = 3 * mixed_max_tokens + (n + 3) + (n + 1) * max_blocks_per_seq
            self._mixed_staging = [torch.zeros(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
            self._mixed_turn = 0
            self._mixed_packed = torch.zeros(size, dtype=torch.int64, device=dev)
        # mixed-step buckets: T -> (the L + 1 graphs, the L attention holes between them, hidden [T, H])
        self.mixed: dict[int, tuple[list[torch.cuda.CUDAGraph], list[Hole], torch.Tensor]] = {}
        # whole mixed steps: T -> the graph, and its final hidden states [T, H]
        self.mixed_full: dict[int, torch.cuda.CUDAGraph] = {}
        self.mixed_full_hidden: dict[int, torch.Tensor] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_logits: dict[int, torch.Tensor] = {}
        self.pool = None
        # tokens as decode rows (replay_rows): the most extra keys they may re-read, a quarter of the weights' bytes
        weight_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        self.verify_max_extra_keys = max(weight_bytes // 4, 16 << 20) // max(1, kv_cache.nbytes // max(
            1, kv_cache.num_blocks * kv_cache.block_size))
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        # LoRA (phase 16, :meth:`enable_lora`): the row groups' static buffer, and the LoRA variant of each
        # decode, prefill and whole mixed-step graph: (route, size) -> (graph, its output: the base variant's);
        # and of each mixed bucket's pieces, as :attr:`mixed`
        self.lora: LoRAGraphInputs | None = None
        self.lora_graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.lora_pieces: dict[int, tuple[list[torch.cuda.CUDAGraph], list[Hole], torch.Tensor]] = {}

    def enable_lora(self, mapping) -> None:
        """LoRA (phase 16): capture a LoRA variant of every graph (decode, prefill, whole mixed step, a
        mixed bucket's pieces) beside its base variant, reading the step's row groups from a fixed buffer
        (:class:`~infer.lora.graphs.LoRAGraphInputs`); a step where some row has an adapter replays it,
        any other the base variant. Call before :meth:`capture`."""
        self.lora = LoRAGraphInputs(mapping, self.max_rows, self.input_ids.device)

    def _lora_variant(self, rows: int, lora: bool):
        """While capturing: the LoRA layers read the static groups of ``rows`` rows (``lora``) or none."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.mapping.capturing(self.lora.meta(rows) if lora else None)

    def _stage_lora(self) -> bool:
        """Before a replay: stage the step's row groups; False when no row has an adapter (or no LoRA)."""
        return self.lora is not None and self.lora.stage() > 0

    def run(self, step: StepInputs, verify: bool = False) -> ForwardOutput | None:
        """Run ``step`` through a captured graph if one fits it; ``None`` if none does (the model runner
        then runs it eagerly). ``verify``: a step whose rows sample in a way the other graphs do not
        (speculative decoding's verify rows: ``k + 1`` per sequence); only the two routes marked
        (``verify``) serve it. The routes, tried in order:

        * a decode-only step no wider than the largest decode bucket: its bucket's graph (forward + LM
          head of every row), its inputs staged straight from the sequences (:func:`stage_decodes`);
        * (``verify``) a verify step, every sequence decoding or verifying drafts: a decode graph over
          its tokens as decode rows (:meth:`_run_verify`, :meth:`replay_rows`); the logits of the rows that
          sample;
        * one sequence prefilling alone (a prompt, a chunk, a prefix hit's suffix), within the largest
          prefill bucket and without prompt logprobs: its bucket's graph (LM head on the last row);
        * decodes beside one prompt chunk (chunked prefill's usual step): its bucket's whole-step graph;
        * (``verify`` too) any other step within the largest mixed bucket: its bucket's pieces, the attention eagerly
          between them.

        Returns:
            The :class:`~infer.engine.step.ForwardOutput`: logits of the rows that sample (decode and
            prefill graphs), or the hidden states of every token (mixed steps); its ``graph`` names the
            route (``"decode"``, ``"verify"``, ``"prefill"``, ``"mixed-whole"``, ``"mixed-pieces"``, in the
            order above).
        """
        f = step.flat
        t = len(f.ids)
        if verify:
            if self.graphs and (out := self._run_verify(step)) is not None:
                return out
            if self.mixed and self.can_run_mixed(t):
                hidden = self.replay_mixed(f.ids, f.positions, f.slots, step.metadata, step.flat_patch)
                return ForwardOutput(f.sampled, hidden=hidden, graph="mixed-pieces")
            return None
        if step.is_decode_only and self.graphs and step.num_tokens <= self.sizes[-1]:
            return self._run_decode(step)
        if not (self.prefill_graphs or self.mixed_full or self.mixed):
            return None
        if len(f.scheduled) == 1 and self.can_run_prefill(t) and f.scheduled[0].seq.params.prompt_logprobs is None:
            logits = self.replay_prefill(f.ids, f.positions, f.slots, f.seq_lens[0], f.tables[0], step.flat_patch)
            if len(f.sampled) > 1:  # n > 1: the forks sample from the same logits
                logits = logits.expand(len(f.sampled), -1).contiguous()
            return ForwardOutput(f.sampled, logits=logits, graph="prefill")
        if self.can_run_mixed_full(t, len(f.scheduled), f.num_decodes):
            hidden = self.replay_mixed_full(f.ids, f.positions, f.slots, f.seq_lens, f.tables, f.num_decodes,
                                            step.flat_patch)
            return ForwardOutput(f.sampled, hidden=hidden, graph="mixed-whole")
        if self.can_run_mixed(t):
            hidden = self.replay_mixed(f.ids, f.positions, f.slots, step.metadata, step.flat_patch)
            return ForwardOutput(f.sampled, hidden=hidden, graph="mixed-pieces")
        return None

    def _run_decode(self, step: StepInputs) -> ForwardOutput:
        """A decode-only step through its bucket's graph; a one-token prompt chunk among the decodes
        samples nothing (its row's logits are dropped)."""
        seqs = list(map(_SEQ, step.scheduled))
        logits, rows = self.replay(seqs, step.decode_patch())
        if rows is not None:
            if not len(rows):
                return ForwardOutput([], graph="decode")
            rows = rows.tolist()
            seqs = [seqs[r] for r in rows]
            logits = logits[step.to_device(rows, torch.int64)]
        return ForwardOutput(seqs, logits=logits, graph="decode")

    def _run_verify(self, step: StepInputs) -> ForwardOutput | None:
        """Speculative decoding's verify step (phase 12) through a decode graph, each of its ``T`` tokens a
        decode row (:meth:`replay_rows`), so the step costs one decode step of ``T`` rows (one replay)
        instead of a mixed bucket's ``L + 1`` pieces with the attention launched eagerly between them.
        ``None`` (the caller tries the pieces) when some sequence runs a prompt chunk or has forks, or
        :meth:`replay_rows` declines."""
        f = step.flat
        for item in f.scheduled:
            if item.num_tokens != 1 + len(item.spec_token_ids) or item.forks:
                return None
        row_seq = np.repeat(np.arange(len(f.scheduled)), [item.num_tokens for item in f.scheduled])
        logits = self.replay_rows(f.ids, f.positions, f.slots, row_seq, f.tables, step.flat_patch)
        if logits is None:
            return None
        if len(f.sample_at) != len(f.ids):  # a one-token prompt chunk among the rows samples nothing
            logits = logits[step.to_device(f.sample_at, torch.int64)]
        return ForwardOutput(f.sampled, logits=logits, graph="verify")

    def replay_rows(self, ids: list[int], positions: list[int], slots: list[int], row_seq: np.ndarray,
                    tables: list[list[int]], patch: tuple[torch.Tensor | None, torch.Tensor] | None = None
                    ) -> torch.Tensor | None:
        """Run ``T = len(ids)`` tokens, each a decode row of context ``position + 1`` over its sequence's
        block table (:func:`stage_rows`; ``row_seq``: int64 ``[T]``, each row's index in ``tables``), through
        a decode bucket's graph: a verify step, or a draft model's forwards (:mod:`infer.engine.draft`).
        Returns logits ``[T, vocab_size]`` (the graph's output buffer, valid until its next
        replay), or ``None`` (run it eagerly) for a hybrid model (one state per sequence, not per row), for
        ``T`` wider than the largest bucket, or when the rows would re-read too many keys: a sequence's ``n``
        decode rows read its context ``n`` times where the extend kernel reads it once, so the extra keys
        may cost at most a quarter of a weight read (:attr:`verify_max_extra_keys`; at least 16 MiB of KV)."""
        t = len(ids)
        if self.state_cache is not None or not self.graphs or t > self.sizes[-1]:
            return None
        keys = np.asarray(positions, dtype=np.int64) + 1
        once = np.zeros(len(tables), dtype=np.int64)
        np.maximum.at(once, row_seq, keys)  # each sequence's context, read once
        if int(keys.sum() - once.sum()) > self.verify_max_extra_keys:
            return None
        bs = bucket_for(t, self.sizes)
        host = self._staging[self._turn]
        self._turn ^= 1
        width = stage_rows(ids, positions, slots, row_seq, tables, self._table_rows, host.numpy(), bs)
        return self._replay_staged(host, t, bs, width, patch)

    def _meta(self, bs: int) -> AttentionMetadata:
        """Metadata over the static buffers' first ``bs`` rows. Its host fields are what the
        backend reads while the graph is captured: every row a decode, contexts up to
        ``max_model_len`` (so the split count covers the longest sequence). A hybrid model's
        state slots are the packed step's fifth vector (:meth:`_decode_forward` adds the flags)."""
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=[self.max_model_len] * bs,
            kv_cache=self.kv_cache,
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            block_tables_cpu=None,
            num_decodes=bs,
        )
        if self.state_cache is not None:
            meta.state_cache = self.state_cache
            meta.state_slots = self.packed[4 * bs: 5 * bs]
        return meta

    def can_run_prefill(self, num_tokens: int) -> bool:
        """Is a one-sequence step of ``num_tokens`` (> 1) tokens within the largest prefill bucket?"""
        return bool(self.prefill_graphs) and 1 < num_tokens <= self.prefill_sizes[-1]

    def can_run_mixed(self, num_tokens: int) -> bool:
        """Does a step of ``num_tokens`` tokens fit the largest mixed-step bucket?"""
        return bool(self.mixed) and num_tokens <= self.mixed_sizes[-1]

    def mixed_decode_rows(self, t: int) -> int:
        """``D``, the decode rows of mixed bucket ``t``'s whole-step graph: as many as can sit beside a
        chunk of 2 or more tokens, and no more than the largest decode bucket."""
        return max(0, min(t - 2, self.sizes[-1]))

    def can_run_mixed_full(self, num_tokens: int, num_seqs: int, num_decodes: int) -> bool:
        """Is this step decodes beside exactly one prompt chunk (chunked prefill's usual step), within
        the largest mixed bucket, and no more decodes than its graph has rows for?"""
        if not self.mixed_full or num_seqs - num_decodes != 1 or num_tokens > self.mixed_sizes[-1]:
            return False
        return num_decodes <= self.mixed_decode_rows(bucket_for(num_tokens, self.mixed_sizes))

    def _mixed_full_meta(self, t: int) -> AttentionMetadata:
        """Metadata of a whole mixed step over the static buffers: decode rows ``[0, D)`` (context 0
        past the step's ``nd``: they read nothing), then one sequence whose query rows ``[nd, T)`` the
        prefill kernel reads on the device. The host fields size both kernels' grids for the bucket:
        ``D`` decode rows, a chunk of up to ``t`` queries, contexts up to ``max_model_len``."""
        d = self.mixed_decode_rows(t)
        return AttentionMetadata(
            query_start_loc=self.mixed_query_start_loc[: d + 2],
            seq_lens=self.seq_lens[: d + 1],
            query_start_loc_cpu=[0] * (d + 1) + [t],
            seq_lens_cpu=[self.max_model_len] * (d + 1),
            kv_cache=self.kv_cache,
            slot_mapping=self.slot_mapping[:t],
            block_tables=self.block_tables[: d + 1],
            block_tables_cpu=None,
            num_decodes=d,
            decode_split_batch=MIXED_DECODE_SPLIT_BATCH,
        )

    def replay_mixed_full(self, ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
                          tables: list[list[int]], num_decodes: int,
                          patch: tuple[torch.Tensor | None, torch.Tensor] | None = None) -> torch.Tensor:
        """Run a step of ``nd = num_decodes`` decodes then one prompt chunk, ``T = len(ids)`` tokens in
        all (:meth:`can_run_mixed_full`), through its bucket's whole-step graph.

        Args:
            ids, positions, slots: one int per token, decodes first (the runner's flat order).
            seq_lens, tables: each sequence's context length after the step and block table
                (``nd + 1`` of each, the chunk's last).
            patch: async scheduling: ``(flat positions, tokens)`` device tensors of input ids to
                overwrite (or ``(None, tokens)``: the first rows).

        Returns:
            The final hidden states ``[T, hidden_size]`` (a view of the graph's output buffer,
            valid until its next replay).
        """
        t, nd = len(ids), num_decodes
        tb = bucket_for(t, self.mixed_sizes)
        d = self.mixed_decode_rows(tb)
        width = max(len(x) for x in tables)
        host = self._mixed_staging[self._mixed_turn]
        self._mixed_turn ^= 1
        h = host.numpy()
        for k, (values, pad) in enumerate(((ids, 0), (positions, 0), (slots, -1))):
            h[k * tb: k * tb + t] = values
            h[k * tb + t: (k + 1) * tb] = pad  # padding rows: slot -1 writes nothing; no query reads them
        o = 3 * tb
        h[o: o + nd] = seq_lens[:nd]
        h[o + nd: o + d] = 0  # decode rows past nd: no keys, and the chunk's rows are written after them
        h[o + d: o + d + 3] = (seq_lens[nd], nd, t)
        tables_at = o + d + 3
        n = tables_at + (nd + 1) * width
        self._table_rows.gather(tables, width, h[tables_at:n].reshape(nd + 1, width))
        packed = self._mixed_packed[:n]
        packed.copy_(host[:n], non_blocking=True)
        if patch is not None:  # flat positions are rows of the ids part
            patch_input_ids(packed, patch)
        self._ids_pos_slots[:, :tb].copy_(packed[:o].view(3, tb))
        self.seq_lens[: d + 1].copy_(packed[o: o + d + 1])
        self.mixed_query_start_loc[d: d + 2].copy_(packed[o + d + 1: o + d + 3])
        rows = packed[tables_at:n].view(nd + 1, width)
        if nd:
            self.block_tables[:nd, :width].copy_(rows[:nd])
        self.block_tables[d, :width].copy_(rows[nd])
        graph, hidden = (self.lora_graphs["mixed", tb] if self._stage_lora()
                         else (self.mixed_full[tb], self.mixed_full_hidden[tb]))
        graph.replay()
        return hidden[:t]

    def _mixed_meta(self, t: int) -> AttentionMetadata:
        """What the pieces between the attention calls read while capturing: the cache and the
        static slot mapping (the RoPE kernel writes K/V there); the attention itself runs at replay,
        with the step's own metadata."""
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:2],
            seq_lens=self.seq_lens[:1],
            query_start_loc_cpu=[0, t],
            seq_lens_cpu=[t],
            kv_cache=self.kv_cache,
            slot_mapping=self.slot_mapping[:t],
            block_tables=self.block_tables[:1],
            block_tables_cpu=None,
            num_decodes=0,
        )

    def _capture_mixed(self, t: int, stream: torch.cuda.Stream, lora: bool = False) -> int:
        """Capture bucket ``t``'s pieces (see the module docstring); returns how many graphs."""
        dev = self.input_ids.device
        meta = self._mixed_meta(t)
        pieces = Pieces(self.attention_backend, self.pool)
        self.model.set_attention_backend(pieces)
        try:
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                self.model(self.input_ids[:t], self.positions[:t], meta)  # warm-up (attention: zeros)
            torch.cuda.current_stream(dev).wait_stream(stream)
            torch.cuda.synchronize(dev)
            with torch.cuda.stream(stream):
                pieces.begin()
                hidden = self.model(self.input_ids[:t], self.positions[:t], meta)
                pieces.end()
        finally:
            self.model.set_attention_backend(self.attention_backend)
        if self.pool is None:
            self.pool = pieces.graphs[0].pool()
        (self.lora_pieces if lora else self.mixed)[t] = (pieces.graphs, pieces.holes, hidden)
        return len(pieces.graphs)

    def replay_mixed(self, ids: list[int], positions: list[int], slots: list[int], meta: AttentionMetadata,
                     patch: tuple[torch.Tensor | None, torch.Tensor] | None = None) -> torch.Tensor:
        """Run any step of ``T = len(ids)`` tokens (within the largest mixed bucket) through its
        bucket's pieces, its attention eagerly between them.

        Args:
            ids, positions, slots: one int per token, in the step's flat order.
            meta: the step's :class:`AttentionMetadata` (built as for an eager step).
            patch: async scheduling: ``(flat positions, tokens)`` device tensors of input ids to
                overwrite (or ``(None, tokens)``: the first rows).

        Returns:
            The final hidden states ``[T, hidden_size]`` (a view of the bucket's output buffer,
            valid until its next replay).
        """
        t = len(ids)
        tb = bucket_for(t, self.mixed_sizes)
        host = self._mixed_staging[self._mixed_turn]
        self._mixed_turn ^= 1
        h = host.numpy()
        for k, (values, pad) in enumerate(((ids, 0), (positions, 0), (slots, -1))):
            h[k * tb: k * tb + t] = values
            h[k * tb + t: (k + 1) * tb] = pad  # padding rows: slot -1 writes nothing; no attention reads them
        staged = self._ids_pos_slots[:, :tb]
        staged.copy_(host[: 3 * tb].view(3, tb), non_blocking=True)
        if patch is not None:
            patch_input_ids(staged[0], patch)
        graphs, holes, hidden = self.lora_pieces[tb] if self._stage_lora() else self.mixed[tb]
        backend = self.attention_backend
        for graph, hole in zip(graphs, [*holes, None]):
            graph.replay()
            if hole is not None:
                o = backend.forward(hole.layer_idx, hole.q[:t], hole.k[:t], hole.v[:t], meta, hole.scale,
                                    hole.window, kv_written=hole.kv_written)
                hole.out[:t].copy_(o)
        return hidden[:t]

    def _decode_forward(self, bs: int) -> torch.Tensor:
        """Bucket ``bs``'s decode graph: spread the packed step's ``[ids | positions | slots | context
        lengths]`` (:attr:`packed`'s first ``4 * bs`` entries, the same addresses at every replay) into
        the static buffers, then the forward and the LM head of every row. The two copies are part of
        the graph: two launches fewer per step on the host (three such copies and the replay took 265 us
        of an H100 machine's host time against 58 us for the replay alone).

        A hybrid model's layers read each row's state slot from the packed step and whether the slot
        holds a state yet: ``position > 0`` (a decode row's one token is its first new one), computed
        here, inside the graph, into the metadata's per-step scratch where the layers look for it
        (:meth:`infer.models.qwen3_5.GatedDeltaNet.mix`); padding rows (position 0) read zeros."""
        self._ids_pos_slots[:, :bs].copy_(self.packed[: 3 * bs].view(3, bs))
        self.seq_lens[:bs].copy_(self.packed[3 * bs: 4 * bs])
        meta = self._meta(bs)
        if self.state_cache is not None:
            meta.scratch["decode_has_state"] = self.positions[:bs] > 0
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], meta)
        return self.model.compute_logits(hidden)

    def _prefill_meta(self, t: int) -> AttentionMetadata:
        """Metadata of a one-sequence prefill over the static buffers' first ``t`` token rows. The
        host fields size the prefill kernel's grid for all ``t`` queries; the device ones (query range,
        context length, block table) are the step's."""
        return AttentionMetadata(
            query_start_loc=self.prefill_query_start_loc,
            seq_lens=self.seq_lens[:1],
            query_start_loc_cpu=[0, t],
            seq_lens_cpu=[self.max_model_len],
            kv_cache=self.kv_cache,
            slot_mapping=self.slot_mapping[:t],
            block_tables=self.block_tables[:1],
            block_tables_cpu=None,
            num_decodes=0,
        )

    def _prefill_forward(self, t: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:t], self.positions[:t], self._prefill_meta(t))
        return self.model.compute_logits(hidden.index_select(0, self.prefill_sample_index))

    @torch.inference_mode()
    def capture(self, progress: bool = True) -> float:
        """Capture one graph per bucket, largest first, into one shared memory pool.

        The static buffers (and the packed step the decode graphs spread into them) hold padding
        while capturing (slot -1, length 0): the warm-up and capture runs write nothing to the cache
        and read nothing from it.

        Returns:
            Seconds spent (also in :attr:`capture_seconds`; the pool's bytes in :attr:`pool_bytes`).
        """
        start = time.perf_counter()
        dev = self.input_ids.device
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        stream = torch.cuda.Stream(dev)
        jobs = [("decode", bs, lambda bs=bs: self._decode_forward(bs)) for bs in sorted(self.sizes, reverse=True)]
        jobs += [("prefill", t, lambda t=t: self._prefill_forward(t)) for t in sorted(self.prefill_sizes, reverse=True)]
        jobs += [("mixed", t, lambda t=t: self.model(self.input_ids[:t], self.positions[:t], self._mixed_full_meta(t)))
                 for t in sorted(self.mixed_sizes, reverse=True)]
        # LoRA: each graph twice, its base variant and its LoRA variant (enable_lora)
        jobs = [(*job, lora) for job in jobs for lora in ((False, True) if self.lora is not None else (False,))]
        for kind, size, forward, lora in tqdm(jobs, desc="capturing CUDA graphs", unit="graph", disable=not progress,
                                              leave=False):
            if kind == "decode":  # the packed step a decode graph reads: padding rows only
                self.packed[: 4 * size].zero_()
                self.packed[2 * size: 3 * size].fill_(-1)
                if self.state_cache is not None:  # the state slots: the padding slot
                    self.packed[4 * size: 5 * size].fill_(self.state_cache.pad_slot)
            graphs, outputs = {"decode": (self.graphs, self.logits), "prefill": (self.prefill_graphs, self.prefill_logits),
                               "mixed": (self.mixed_full, self.mixed_full_hidden)}[kind]
            with self._lora_variant(size, lora):
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream):
                    forward()  # warm-up: compiles the kernels of this shape
                torch.cuda.current_stream(dev).wait_stream(stream)
                torch.cuda.synchronize(dev)  # the warm-up's collectives (tensor parallelism) are done
                graph = torch.cuda.CUDAGraph()
                # thread_local: only this thread's CUDA calls are checked while capturing, so another
                # thread's (PyTorch's NCCL watchdog polling its events) cannot invalidate the capture
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                    out = forward()
                    if lora:  # into the base variant's output: the pool keeps one output per bucket
                        out = outputs[size].copy_(out)
            if self.pool is None:
                self.pool = graph.pool()
            if lora:
                self.lora_graphs[kind, size] = (graph, out)
            else:
                graphs[size], outputs[size] = graph, out
        num_graphs = len(jobs)
        for t in tqdm(sorted(self.mixed_sizes, reverse=True), desc="capturing mixed-step pieces", unit="bucket",
                      disable=not progress, leave=False):
            for lora in (False, True) if self.lora is not None else (False,):
                with self._lora_variant(t, lora):
                    num_graphs += self._capture_mixed(t, stream, lora)
        torch.cuda.synchronize(dev)
        self.pool_bytes = torch.cuda.memory_reserved(dev) - before
        self.capture_seconds = time.perf_counter() - start
        prefill = (f", prefill {self.prefill_sizes[0]}..{self.prefill_sizes[-1]} tokens" if self.prefill_sizes else "")
        if self.mixed_sizes:
            prefill += f", mixed {self.mixed_sizes[0]}..{self.mixed_sizes[-1]} tokens whole and in pieces"
        log.info("captured %d CUDA graphs (decode batch %d..%d%s) in %.1f s, %.0f MiB", num_graphs,
                 self.sizes[0], self.sizes[-1], prefill, self.capture_seconds, self.pool_bytes / 2**20)
        return self.capture_seconds

    def release(self) -> None:
        """Free the graphs and their memory pool. A graph that captured NCCL collectives keeps
        its communicator busy: ``destroy_process_group`` waits for it forever (PyTorch #115388),
        so a tensor-parallel rank releases its graphs first."""
        for graph in (*self.graphs.values(), *self.prefill_graphs.values(), *self.mixed_full.values(),
                      *(g for graphs, _, _ in (*self.mixed.values(), *self.lora_pieces.values()) for g in graphs),
                      *(g for g, _ in self.lora_graphs.values())):
            graph.reset()
        self.lora_graphs.clear()
        self.lora_pieces.clear()
        self.mixed.clear()
        self.mixed_full.clear()
        self.mixed_full_hidden.clear()
        self.graphs.clear()
        self.logits.clear()
        self.prefill_graphs.clear()
        self.prefill_logits.clear()
        self.pool = None

    def replay(self, seqs: list, patch: tuple[torch.Tensor | None, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, np.ndarray | None]:
        """Run a decode step of ``B = len(seqs)`` sequences (one new token each) through its bucket's graph.

        Args:
            seqs: the step's sequences, in row order (:func:`stage_decodes` reads their new token,
                position, slot, context length and block table).
            patch: async scheduling: ``(positions, tokens)``, device tensors of input ids to
                overwrite (tokens the previous step sampled, not yet seen by the host).

        Returns:
            ``(logits [B, vocab_size], rows)``: the logits are a view of the graph's output buffer,
            valid until the next replay; ``rows`` are the rows that sample (``None``: all of them).
        """
        b = len(seqs)
        bs = bucket_for(b, self.sizes)
        host = self._staging[self._turn]
        self._turn ^= 1
        pad = self.state_cache.pad_slot if self.state_cache is not None else None
        width, rows = stage_decodes(seqs, self._table_rows, self.kv_cache.block_size, host.numpy(), bs, pad)
        return self._replay_staged(host, b, bs, width, patch), rows

    def _replay_staged(self, host: torch.Tensor, b: int, bs: int, width: int,
                       patch: tuple[torch.Tensor | None, torch.Tensor] | None) -> torch.Tensor:
        """Copy the packed step of ``b`` rows staged in ``host`` to the device, patch its input ids (async
        scheduling: a row's flat position is its row), stage the LoRA groups, hand it to the other ranks,
        replay bucket ``bs``: logits ``[b, vocab_size]``."""
        packed = self.packed[: packed_size(b, bs, width, self.num_vectors)]
        packed.copy_(host[: packed.shape[0]], non_blocking=True)
        if patch is not None:
            patch_input_ids(packed, patch)
        lora = self._stage_lora()
        if self.on_staged is not None:
            self.on_staged(b, bs, width, packed, lora)
        return self.run_packed(b, bs, width, lora)

    def run_packed(self, b: int, bs: int, width: int, lora: bool = False) -> torch.Tensor:
        """Replay bucket ``bs``'s graph on the packed step (:meth:`replay`'s layout) in :attr:`packed`
        (``lora``: its LoRA variant, on the row groups staged in :attr:`lora`).
        The graph itself spreads the four vectors into the static buffers (:meth:`_decode_forward`);
        the block tables, whose width varies, are copied here. Returns logits ``[B, vocab_size]`` (a
        view of the graph's output buffer, valid until the next replay)."""
        at = self.num_vectors * bs
        self.block_tables[:b, :width].copy_(self.packed[at: at + b * width].view(b, width))
        if lora:
            graph, logits = self.lora_graphs["decode", bs]
            graph.replay()
            return logits[:b]
        self.graphs[bs].replay()
        return self.logits[bs][:b]


    def replay_prefill(self, ids: list[int], positions: list[int], slots: list[int], seq_len: int,
                       table: list[int], patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Run a step that prefills one sequence, ``T = len(ids)`` tokens (``1 < T <=`` the largest
        prefill bucket), through its bucket's graph.

        Args:
            ids, positions, slots: one int per new token.
            seq_len: the context length after the step (cached prefix + ``T``).
            table: the sequence's block table.
            patch: async scheduling: ``(flat positions, tokens)`` device tensors of input ids to
                overwrite (a token the previous step sampled, not yet seen by the host).

        Returns:
            Logits ``[1, vocab_size]`` of token ``T - 1`` (a view of the graph's output buffer, valid
            until the next replay).
        """
        t = len(ids)
        tb = bucket_for(t, self.prefill_sizes)
        host = self._prefill_staging[self._prefill_turn]
        self._prefill_turn ^= 1
        h = host.numpy()
        for k, (values, pad) in enumerate(((ids, 0), (positions, 0), (slots, -1))):
            h[k * tb: k * tb + t] = values
            h[k * tb + t: (k + 1) * tb] = pad  # padding rows: slot -1 writes nothing; no query reads them
        h[3 * tb: 3 * tb + 3] = (seq_len, t, t - 1)
        n = 3 * tb + 3 + len(table)
        h[3 * tb + 3: n] = table
        packed = self._prefill_packed[:n]
        packed.copy_(host[:n], non_blocking=True)
        if patch is not None:  # flat positions are rows of the ids part
            patch_input_ids(packed, patch)
        self._ids_pos_slots[:, :tb].copy_(packed[: 3 * tb].view(3, tb))
        self.seq_lens[:1].copy_(packed[3 * tb: 3 * tb + 1])
        self.prefill_query_start_loc[1:].copy_(packed[3 * tb + 1: 3 * tb + 2])
        self.prefill_sample_index.copy_(packed[3 * tb + 2: 3 * tb + 3])
        self.block_tables[0, : len(table)].copy_(packed[3 * tb + 3: n])
        graph, logits = (self.lora_graphs["prefill", tb] if self._stage_lora()
                         else (self.prefill_graphs[tb], self.prefill_logits[tb]))
        graph.replay()
        return logits
