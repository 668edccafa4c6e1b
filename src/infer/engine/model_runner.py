"""The model runner decides *how* a scheduled step runs: tensors, KV cache, forward, sampling.

Input: the scheduler's ``[(sequence, num_new_tokens), ...]``. It flattens every sequence's
new tokens into ``input_ids[T]`` / ``positions[T]``, builds the attention metadata (where
each sequence starts, its context length, the KV slots its new tokens go to), runs one
forward, computes logits only where a token will be sampled (the last new token of each
sequence whose tokens are all in the cache after this step), and samples all of them in one
batched call.

With chunked prefill (phase 6) a scheduled sequence may run only a *chunk* of its prompt:
tokens ``first .. first + n - 1`` with ``first = num_computed_tokens``. Nothing else changes
here: the chunk's keys are the cached prefix plus the chunk (:func:`chunk_extent`), the
attention backends already read a cached prefix through the block table, and a sequence
samples only after its last chunk.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from infer.attention import AttentionMetadata, KVCache, TorchAttentionBackend
from infer.engine.scheduler import ScheduledSeq
from infer.engine.sequence import PLACEHOLDER, Sequence
from infer.kernels import pdl
from infer.loader import LoadedModel
from infer.sampling import SamplerOutput, SamplingTensors, sample

log = logging.getLogger("infer")

_NUM_TOKENS = operator.attrgetter("num_tokens")
_FORKS = operator.attrgetter("forks")
_SEQ = operator.attrgetter("seq")
_PARAMS = operator.attrgetter("params")
_SEED = operator.attrgetter("seed")
_NUM_OUTPUT_TOKENS = operator.attrgetter("num_output_tokens")


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
        need_lp = any(s.params.logprobs is not None for s in self.sampled)
        tensors = [out.next_tokens] + ([out.logprobs, out.top_logprob_ids, out.top_logprobs] if need_lp else [])
        if out.next_tokens.device.type != "cuda":
            self._host = tuple(tensors)
            return
        self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                           for t in tensors)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def host_outputs(self) -> tuple[list, list | None, list | None, list | None]:
        """``(tokens, chosen logprobs, top ids, top logprobs)`` as host lists (the logprob ones None
        when no sampled sequence asked for logprobs); waits for :meth:`start_copy_to_host`'s copy."""
        self.start_copy_to_host()
        if self._ready is not None:
            self._ready.synchronize()
        lists = [t.tolist() for t in self._host]
        return (lists[0], *(lists[1:] if len(lists) > 1 else (None, None, None)))


def patch_input_ids(input_ids: torch.Tensor, patch: tuple[torch.Tensor | None, torch.Tensor]) -> None:
    """Async scheduling: write the tokens the previous step sampled into this step's ``input_ids``
    (``[T]`` int64, on the device). ``patch`` is ``(flat positions [P] int64, tokens [P] int64)``,
    or ``(None, tokens)`` when the positions are the first ``P``."""
    index, tokens = patch
    if index is None:
        input_ids[: tokens.shape[0]].copy_(tokens)
    else:
        input_ids.index_copy_(0, index, tokens)


def kv_heads_per_rank(model) -> int:
    """KV heads this process caches: all of them, or with tensor parallelism its rank's share."""
    return model.model.layers[0].self_attn.num_kv_heads


def num_kv_blocks(
    loaded: LoadedModel,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_memory_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    cuda_graph_batch_size: int = 0,
    cuda_graph_prefill_tokens: int = 0,
    cuda_graph_mixed_tokens: int = 0,
) -> int:
    """How many KV-cache blocks of ``block_size`` tokens to allocate.

    The budget is ``kv_cache_memory_bytes`` if given; on CUDA otherwise, as vLLM does, the
    memory left under ``gpu_memory_utilization`` of the GPU after the weights and a profiling
    forward of ``max_num_batched_tokens`` tokens (the largest step's activations), and, with CUDA
    graphs (``cuda_graph_batch_size`` > 0, the largest bucket), the memory their shared pool will
    keep: the peak of a decode forward + LM head of that many sequences, or of a one-sequence
    prefill of ``cuda_graph_prefill_tokens`` (or ``cuda_graph_mixed_tokens``) tokens if larger, plus
    what the mixed-step pieces keep between them (every layer's q, k, v and attention output for
    each bucket, :func:`~infer.engine.cuda_graphs.mixed_graph_sizes`); on CPU otherwise, room
    for ``max_num_seqs`` sequences of ``max_model_len`` tokens (pages are only touched when
    written).

    Returns:
        ``min(budget // block_bytes, max_num_seqs * ceil(max_model_len / block_size))``: more
        blocks than ``max_num_seqs`` full-length sequences can hold would sit idle. For the
        contiguous cache (``block_size = max_model_len``) that is the number of rows.

    Raises:
        ValueError: when not even one ``max_model_len``-token sequence fits, with the numbers.
    """
    cfg = loaded.config
    p = next(loaded.model.parameters())
    # tensor parallelism: each rank caches only its KV heads
    block_bytes = cfg.kv_bytes_per_token(p.dtype) * block_size * kv_heads_per_rank(loaded.model) // cfg.num_kv_heads
    per_seq = -(-max_model_len // block_size)
    cap = max_num_seqs * per_seq
    if kv_cache_memory_bytes is not None:
        budget, where = kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif p.device.type == "cuda":
        budget, where = _profile_free_gpu_memory(loaded, max_model_len, max_num_seqs, max_num_batched_tokens,
                                                 gpu_memory_utilization, cuda_graph_batch_size,
                                                 cuda_graph_prefill_tokens, cuda_graph_mixed_tokens), \
            "gpu_memory_utilization"
    else:
        return cap
    blocks = min(cap, budget // block_bytes)
    if blocks < per_seq:
        seq_bytes = per_seq * block_bytes
        raise ValueError(
            f"the KV cache budget ({where}: {budget / 2**30:.2f} GiB) cannot hold one sequence of "
            f"max_model_len={max_model_len} tokens ({seq_bytes / 2**30:.2f} GiB); lower max_model_len or "
            f"raise the budget"
        )
    return int(blocks)


@torch.inference_mode()
def _profile_free_gpu_memory(loaded: LoadedModel, max_model_len: int, max_num_seqs: int, num_tokens: int,
                             utilization: float, graph_batch_size: int = 0, graph_prefill_tokens: int = 0,
                             graph_mixed_tokens: int = 0) -> int:
    """Bytes left for the KV cache after a forward of ``num_tokens`` tokens (no cache) and, when
    ``graph_batch_size`` > 0, the CUDA graphs' memory pool (estimated by an eager decode forward of
    that many sequences and, with ``graph_prefill_tokens``, an eager one-sequence prefill of that
    many tokens: the larger is the largest graph's working set; the pool is shared by all graphs)."""
    model, cfg = loaded.model, loaded.config
    dev = next(model.parameters()).device
    model.set_attention_backend(TorchAttentionBackend())
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    lens = [max_model_len] * (num_tokens // max_model_len) + ([num_tokens % max_model_len] if num_tokens % max_model_len else [])
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=dev)
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])
    hidden = model(ids, pos, AttentionMetadata.for_prefill(lens, dev))
    model.compute_logits(hidden[: max_num_seqs]).float().softmax(-1)  # the sampler's working set
    del hidden
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    graph_bytes = 0
    if graph_batch_size:
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        n = graph_batch_size
        logits = model.compute_logits(model(ids[:n], torch.zeros_like(ids[:n]), AttentionMetadata.for_prefill([1] * n, dev)))
        del logits
        torch.cuda.synchronize(dev)
        graph_bytes = torch.cuda.max_memory_allocated(dev) - base
        t = min(max(graph_prefill_tokens, graph_mixed_tokens), num_tokens)
        if t > 1:
            torch.cuda.reset_peak_memory_stats(dev)
            hidden = model(ids[:t], torch.arange(t, device=dev),
                           AttentionMetadata.for_prefill([t], dev))
            del hidden
            torch.cuda.synchronize(dev)
            graph_bytes = max(graph_bytes, torch.cuda.max_memory_allocated(dev) - base)
        if graph_mixed_tokens:  # the holes between the pieces: q, k, v and output per layer and bucket
            from infer.engine.cuda_graphs import mixed_graph_sizes

            attn = model.model.layers[0].self_attn
            per_token = 2 * (attn.num_heads + attn.num_kv_heads) * attn.head_dim * next(model.parameters()).element_size()
            graph_bytes += per_token * cfg.num_layers * sum(mixed_graph_sizes(graph_mixed_tokens))
        log.info("CUDA graphs: %.0f MiB kept for their memory pool (decode batch %d, prefill %d tokens)",
                 graph_bytes / 2**20, n, t)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    # memory held outside PyTorch's allocator (CUDA context, other processes) also counts
    free, _ = torch.cuda.mem_get_info(dev)
    outside = total - free - torch.cuda.memory_reserved(dev)
    return max(0, int(total * utilization) - peak - outside - graph_bytes)


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


def _with_pdl(method):
    """Run a :class:`ModelRunner` method with its kernels launched with programmatic dependent launch
    when the runner's ``pdl`` is set (:func:`infer.kernels.pdl.scope`; graphs captured inside keep it)."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if not self.pdl:
            return method(self, *args, **kwargs)
        with pdl.scope():
            return method(self, *args, **kwargs)

    return wrapped


def make_attention_backend(name: str, device: torch.device):
    """The attention backend called ``name`` (``"torch"`` or ``"triton"``), chosen once per engine."""
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from infer.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    raise ValueError(f"unknown attention backend {name!r}")


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


class ModelRunner:
    """Owns the model on its device, the KV cache and the attention backend.

    Args:
        loaded: the model from :func:`infer.loader.load_model`.
        num_blocks, block_size: the KV cache's blocks (see :func:`num_kv_blocks`).
        contiguous: one block per sequence (``block_size = max_model_len``): the contiguous cache.
        attention_backend: ``"torch"`` or ``"triton"``.
        max_model_len: the longest sequence (tokens): sizes the block-table buffers of the CUDA
            graphs. (Which forward the model runs, fused or not, the engine chooses before it
            profiles memory: :meth:`CausalLM.set_fused_ops`.)
        cuda_graphs: capture decode-only steps up to ``cuda_graph_max_batch_size`` sequences as
            CUDA graphs (phase 9; :class:`~infer.engine.cuda_graphs.CUDAGraphRunner`); call
            :meth:`capture_cuda_graphs` once the runner exists.
        cuda_graph_prefill_max_tokens: with ``cuda_graphs``, also capture steps that prefill one
            sequence of up to this many tokens (0: none).
        block_major: the block-major KV cache (phase 10, KV offload: one block of every layer is one
            contiguous copy; :class:`~infer.attention.KVCache`).
        pdl: launch the Triton kernels of every step, warm-up and capture with programmatic dependent
            launch (:mod:`infer.kernels.pdl`; ``EngineConfig.pdl``).
    """

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, contiguous: bool = False,
                 attention_backend: str = "torch", max_model_len: int = 0,
                 cuda_graphs: bool = False, cuda_graph_max_batch_size: int = 256, block_major: bool = False,
                 cuda_graph_prefill_max_tokens: int = 0, cuda_graph_mixed_max_tokens: int = 0,
                 pdl: bool = False) -> None:
        self.model = loaded.model
        self.pdl = pdl
        cfg = loaded.config
        self.config = cfg
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kv_cache = KVCache(cfg.num_layers, num_blocks, block_size, kv_heads_per_rank(self.model), cfg.head_dim,
                                self.dtype, self.device, contiguous=contiguous, block_major=block_major)
        self.attention_backend = make_attention_backend(attention_backend, self.device)
        self.model.set_attention_backend(self.attention_backend)
        max_model_len = max_model_len or cfg.max_position_embeddings
        self.max_model_len = max_model_len
        self.vocab_size = cfg.vocab_size
        self.graphs = None
        self._bitmask_bufs: list[torch.Tensor] | None = None  # structured output's host staging pair
        self._bitmask_turn = 0
        # the last step's sampling tensors, reused while the same sequences sample (_sampling_tensors)
        self._last_sampling: tuple[list[Sequence], SamplingTensors] | None = None
        if cuda_graphs:
            from infer.engine.cuda_graphs import CUDAGraphRunner

            self.graphs = CUDAGraphRunner(self.model, self.kv_cache, cuda_graph_max_batch_size,
                                          -(-max_model_len // block_size), max_model_len,
                                          prefill_max_tokens=cuda_graph_prefill_max_tokens,
                                          mixed_max_tokens=cuda_graph_mixed_max_tokens,
                                          attention_backend=self.attention_backend)

    @torch.inference_mode()
    @_with_pdl
    def warm_up(self) -> float:
        """CUDA with the Triton backend: launch every attention-kernel variant a step can need once,
        before any request does; returns the seconds it took (0 elsewhere: PyTorch ops and the
        Triton interpreter compile nothing).

        Triton compiles a kernel variant (its ``tl.constexpr`` values) the first time it is
        launched: ~1 s each, or a few hundred ms from the on-disk cache. The first request's
        prefill meets most of them and CUDA-graph capture the decode ones, but an extend that
        splits its keys (``SPLIT=True`` and the merge kernel: a prompt chunk, or a prefix hit's
        suffix, over a long cached prefix) first appears mid-serving, and compiling it there stalled
        every stream for 2.2 s (H200, Qwen3-4B shapes, chunked prefill with a 512-token budget).
        Like vLLM's warm-up runs (``compile_or_warm_up_model``), two dummy steps run through the
        model: a prefill, then a decode next to a 16-token extend over a long context. Their slots
        are -1 (padding: no K/V written) and their block tables point at block 0 (read, and the
        result dropped), so the cache is untouched.
        """
        if self.device.type != "cuda" or isinstance(self.attention_backend, TorchAttentionBackend):
            return 0.0  # (the PyTorch backend's cache write, an index_copy_, has no padding slot)
        start = time.perf_counter()
        bs = self.kv_cache.block_size
        long = min(self.max_model_len, 2048)  # a context split-KV kernels split (>= 1,024 keys)

        def dummy_step(rows: list[tuple[int, int]]) -> None:  # rows: (new tokens, context length)
            starts, positions = [0], []
            for n, ctx in rows:
                starts.append(starts[-1] + n)
                positions.extend(range(ctx - n, ctx))
            t = starts[-1]
            meta = self._metadata(starts, [ctx for _, ctx in rows], self._to_device([-1] * t, torch.int64),
                                  [[0] * -(-ctx // bs) for _, ctx in rows], sum(n == 1 for n, _ in rows))
            hidden = self._forward(self._to_device([0] * t, torch.int64), self._to_device(positions, torch.int64), meta)
            self._logits(hidden, [t - 1])

        n = min(16, long)
        dummy_step([(n, n)])  # a prefill: one program per query tile, no split
        if long > n:
            dummy_step([(1, long), (n, long)])  # decodes first (AttentionMetadata), then a split extend
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    @_with_pdl
    def capture_cuda_graphs(self, progress: bool = True) -> float:
        """Capture the decode graphs (``cuda_graphs``); returns the seconds it took (0 without)."""
        return self.graphs.capture(progress) if self.graphs is not None else 0.0

    def _to_device(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A host list of ints as a tensor on the device: one copy through pinned memory on CUDA
        (no pageable staging, and the host does not wait for it)."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @staticmethod
    def _placeholders(scheduled: list[ScheduledSeq], starts: list[int], prev: StepResult) -> tuple[list, list]:
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

    def _patch(self, scheduled: list[ScheduledSeq], starts, prev: StepResult | None
               ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """Async scheduling: the :func:`patch_input_ids` argument that puts ``prev``'s sampled tokens
        into this step's input ids (``starts``: each sequence's first flat index), or ``None``."""
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
        flat, rows = self._placeholders(scheduled, starts, prev)
        if flat and flat == rows and flat[-1] == len(flat) - 1:  # the same, found the long way
            return None, tokens[: len(flat)]
        if flat:
            return (self._to_device(flat, torch.int64),
                    tokens[self._to_device(rows, torch.int64)])
        return None

    @torch.inference_mode()
    @_with_pdl
    def execute(self, scheduled: list[ScheduledSeq], eos_ids: list[int], prev: StepResult | None = None) -> StepResult:
        """Run one step over ``scheduled`` and sample the sequences that are ready to.

        Args:
            prev: async scheduling: the previous step, whose sampled tokens (still on the device)
                replace the placeholders in this step's input ids, on the device. Its
                ``before_next_sampling``, if set, is called after this step's forward is launched
                and before its sampling tensors are built.

        Returns:
            The :class:`StepResult`, its tokens still on the device (:meth:`StepResult.host_outputs`
            reads them; their copy to the host is already started).
        """
        graphs = self.graphs
        if (graphs is not None and graphs.can_run(sum(map(_NUM_TOKENS, scheduled)), len(scheduled))
                and not any(map(_FORKS, scheduled))):
            # a decode-only step (every sequence runs one token; a 1-token prompt shared by forks
            # takes the general path): replay the captured graph of its bucket (forward + logits of
            # every row), its inputs staged straight from the sequences (stage_decodes)
            seqs = list(map(_SEQ, scheduled))
            patch = self._patch(scheduled, range(len(seqs) + 1), prev)
            logits, rows = graphs.replay(seqs, patch)
            if rows is not None:  # a one-token prefill chunk among the decodes samples nothing
                if not len(rows):
                    return StepResult([], None, {})
                rows = rows.tolist()
                seqs = [seqs[r] for r in rows]
                logits = logits[self._to_device(rows, torch.int64)]
            self._before_sampling(prev)
            return self._result(seqs, sample(logits, self._sampling_tensors(seqs, eos_ids)), {})
        # decodes first (stable), so the attention gets them as one slice (AttentionMetadata)
        scheduled = sorted(scheduled, key=lambda item: item.num_tokens != 1)
        ids, positions, starts, seq_lens, tables, firsts, sample_at, sampled = self._flatten(scheduled)
        slots = self.kv_cache.slot_mapping(tables, firsts, [s.num_tokens for s in scheduled])
        num_decodes = sum(1 for s in scheduled if s.num_tokens == 1)
        patch = self._patch(scheduled, starts, prev)
        if (self.graphs is not None and len(scheduled) == 1 and self.graphs.can_run_prefill(len(ids))
                and scheduled[0].seq.params.prompt_logprobs is None):
            # one sequence prefills alone (a prompt, a chunk, a prefix hit's suffix): its bucket's graph
            logits = self.graphs.replay_prefill(ids, positions, slots, seq_lens[0], tables[0], patch)
            self._copy_fork_blocks(scheduled)
            if not sampled:
                return StepResult([], None, {})
            if len(sampled) > 1:  # n > 1: the forks sample from the same logits
                logits = logits.expand(len(sampled), -1).contiguous()
            self._before_sampling(prev)
            return self._result(sampled, sample(logits, self._sampling_tensors(sampled, eos_ids)), {})
        if self.graphs is not None and self.graphs.can_run_mixed_full(len(ids), len(scheduled), num_decodes):
            # decodes beside one prompt chunk (chunked prefill's usual step): its bucket's whole-step graph
            hidden = self.graphs.replay_mixed_full(ids, positions, slots, seq_lens, tables, num_decodes, patch)
        else:
            meta = self._metadata(starts, seq_lens, self._to_device(slots, torch.int64), tables, num_decodes)
            if self.graphs is not None and self.graphs.can_run_mixed(len(ids)):
                # a step with several prompts: its bucket's pieces, the attention eagerly between them
                hidden = self.graphs.replay_mixed(ids, positions, slots, meta, patch)
            else:
                input_ids = self._to_device(ids, torch.int64)
                if patch is not None:
                    patch_input_ids(input_ids, patch)
                hidden = self._forward(input_ids, self._to_device(positions, torch.int64), meta)
        self._copy_fork_blocks(scheduled)
        prompt_lp = self._prompt_logprobs(scheduled, starts, hidden)
        if not sampled:
            return StepResult([], None, prompt_lp)
        logits = self._logits(hidden, sample_at)
        self._before_sampling(prev)
        tensors = self._sampling_tensors(sampled, eos_ids)
        return self._result(sampled, sample(logits, tensors), prompt_lp)

    def _copy_fork_blocks(self, scheduled: list[ScheduledSeq]) -> None:
        """``n > 1``: after the prompt's forward, each fork gets its copy of the prompt's last,
        partly filled block (the full ones are shared)."""
        bs = self.kv_cache.block_size
        for item in scheduled:
            if not item.forks:
                continue
            n = item.seq.num_computed_tokens + item.num_tokens
            for fork in item.forks:
                src, dst = item.seq.block_table[-1], fork.block_table[-1]
                if src != dst:
                    self._copy_block_prefix(src, dst, n - (len(item.seq.block_table) - 1) * bs)

    @staticmethod
    def _before_sampling(prev: StepResult | None) -> None:
        """Run ``prev.before_next_sampling`` once (see :class:`StepResult`)."""
        if prev is not None and prev.before_next_sampling is not None:
            hook, prev.before_next_sampling = prev.before_next_sampling, None
            hook()

    # The three places a step touches the model or the cache. Tensor parallelism (phase 14,
    # infer.parallel.executor) overrides them to run the same call on every rank.

    def _metadata(self, starts: list[int], seq_lens: list[int], slot_mapping: torch.Tensor,
                  tables: list[list[int]], num_decodes: int) -> AttentionMetadata:
        """The step's :class:`AttentionMetadata` over this runner's KV cache."""
        return AttentionMetadata(
            query_start_loc=self._to_device(starts, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            kv_cache=self.kv_cache,
            slot_mapping=slot_mapping,
            block_tables=self._block_table_tensor(tables),
            block_tables_cpu=tables,
            num_decodes=num_decodes,
        )

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward: ``[T]`` ids and positions -> ``[T, hidden]``."""
        return self.model(input_ids, positions, meta)

    def _logits(self, hidden: torch.Tensor, rows: list[int] | slice) -> torch.Tensor:
        """Logits ``[N, vocab]`` of ``hidden``'s ``rows`` (flat token indices, or a slice of them)."""
        return self.model.compute_logits(hidden[rows if isinstance(rows, slice) else self._to_device(rows, torch.int64)])

    def _copy_block_prefix(self, src: int, dst: int, length: int) -> None:
        self.kv_cache.copy_block_prefix(src, dst, length)

    @staticmethod
    def _result(sampled, sampler_output, prompt_lp) -> StepResult:
        result = StepResult(sampled, sampler_output, prompt_lp)
        result.start_copy_to_host()
        return result

    def _block_table_tensor(self, tables: list[list[int]]) -> torch.Tensor:
        """int32 ``[B, W]`` on the device: the block tables, padded with 0 to the widest."""
        width = max(len(t) for t in tables)
        if width == 1:
            return self._to_device([t[0] for t in tables], torch.int32).view(-1, 1)
        rows = block_table_array(tables, width)
        t = torch.from_numpy(rows)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    @staticmethod
    def _flatten(scheduled: list[ScheduledSeq]):
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

    def _sampling_tensors(self, seqs: list[Sequence], eos_ids: list[int]) -> SamplingTensors:
        """The step's :class:`SamplingTensors` for ``seqs`` (the sampler's rows, in order).

        Building them costs ~0.1-0.2 ms of host time per step, as much as the rest of a batch-1
        decode step's preparation. So when the same sequences sample again, in the same order,
        and no row carries state that changes per step (penalty histories, a ``min_tokens`` ban,
        a structured-output bitmask), the last step's tensors are reused. Only the stream
        positions change (``steps``, each row's output length, which keys its random draws), and
        by exactly one: every row sampled one token in the last sampling step and none since (a
        sequence gains tokens only by sampling), so they are advanced on the device, with no host
        list and no copy (and not at all when every row is greedy). vLLM's persistent batch keeps
        its sampling metadata the same way.
        """
        last = self._last_sampling  # set only when its rows were stateless; none of them can
        # have become stateful since: a guide and penalties are fixed per sequence, and a
        # min_tokens ban, once lifted, stays lifted (the output only grows)
        if last is not None and len(last[0]) == len(seqs) and all(map(operator.is_, last[0], seqs)):
            tensors = last[1]
            if not tensors.all_greedy:
                tensors.steps.add_(1)
            return tensors
        stateless = all(s.guide is None and not s.has_penalties and s.num_output_tokens >= s.params.min_tokens
                        for s in seqs)
        tensors = self._build_sampling_tensors(seqs, eos_ids, stateless)
        self._last_sampling = (list(seqs), tensors) if stateless else None
        return tensors

    def _build_sampling_tensors(self, seqs: list[Sequence], eos_ids: list[int], stateless: bool = False
                                ) -> SamplingTensors:
        """``stateless``: no row has a penalty, a ``min_tokens`` ban or a guide, so no row needs a token
        history, a suppressed id or a bitmask (nothing per row to gather: 181 against 273 us at 256 rows on
        the development CPU, 753 against 1,060 us on an H100 machine's host, run 23)."""
        if stateless:
            return SamplingTensors.from_params(list(map(_PARAMS, seqs)), seeds=list(map(_SEED, seqs)),
                                               steps=list(map(_NUM_OUTPUT_TOKENS, seqs)), prompt_ids_list=None,
                                               output_ids_list=None, suppress_list=None,
                                               vocab_size=self.vocab_size, device=self.device)
        suppress = []
        for seq in seqs:
            p = seq.params
            ban: list[int] = []
            if seq.num_output_tokens < p.min_tokens:
                ban = list(p.stop_token_ids or []) + ([] if p.ignore_eos else list(eos_ids))
            suppress.append(ban)
        # token histories only for rows with a penalty (building them is O(context) per row)
        rep = [s.params.repetition_penalty != 1.0 for s in seqs]
        pen = [s.has_penalties for s in seqs]
        tensors = SamplingTensors.from_params(
            [s.params for s in seqs],
            seeds=[s.seed for s in seqs],
            steps=[s.num_output_tokens for s in seqs],
            prompt_ids_list=[s.token_ids[: s.num_prompt_tokens] if r else [] for s, r in zip(seqs, rep)],
            output_ids_list=[s.output_token_ids if p else [] for s, p in zip(seqs, pen)],
            suppress_list=suppress,
            vocab_size=self.vocab_size,
            device=self.device,
        )
        if any(s.guide is not None for s in seqs):
            tensors.token_bitmask, tensors.token_bitmask_rows = self._token_bitmask(seqs, eos_ids)
        return tensors

    def _token_bitmask(self, seqs: list[Sequence], eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Structured output (phase 13): ``([R, ceil(V / 32)] int32 allowed-token bitmask, [R] int64
        rows)`` of the sequences with a guide, written by outlines-core straight into a host buffer
        (one bit per token), then copied to the device in one transfer.

        A row whose constraint allows no token at all (a dead end: the vocabulary cannot continue
        the automaton) would leave only ``-inf`` logits; it gets EOS instead, and the output
        processor ends it with ``finish_reason="error"``.
        """
        from infer.sampling.structured import guide_masks

        rows = [i for i, s in enumerate(seqs) if s.guide is not None]
        words = -(-self.vocab_size // 32)
        buf = self._bitmask_staging(len(rows), words)
        host = buf.numpy().view(np.uint32)
        for r, i in enumerate(rows):
            mask = guide_masks(seqs[i], eos_ids, self.vocab_size).mask(seqs[i].guide)  # kept per state
            host[r] = mask
            if not mask.any():  # a dead end: only EOS, which ends the sequence with an error
                eos = eos_ids[0]
                host[r, eos // 32] = 1 << (eos % 32)
                seqs[i].guide_dead_end = True
        if self.device.type == "cuda":
            buf = buf.to(self.device, non_blocking=True)
        else:
            buf = buf.clone()  # the staging buffer is reused next step
        return buf, self._to_device(rows, torch.int64)

    def _bitmask_staging(self, num_rows: int, words: int) -> torch.Tensor:
        """int32 ``[num_rows, words]`` host buffer for a step's bitmask (pinned on CUDA): two kept and
        used in turn, so the host never writes one whose copy to the device may still be pending
        (the copy of two steps back is done: the host waited for the previous step's tokens)."""
        staging = self._bitmask_bufs
        if staging is None or staging[0].shape[0] < num_rows:
            cap = max(num_rows, 2 * staging[0].shape[0] if staging is not None else 8)
            pin = self.device.type == "cuda"
            staging = self._bitmask_bufs = [torch.zeros(cap, words, dtype=torch.int32, pin_memory=pin)
                                            for _ in range(2)]
            self._bitmask_turn = 0
        self._bitmask_turn ^= 1
        return staging[self._bitmask_turn][:num_rows]

    def _prompt_logprobs(self, scheduled, starts, hidden):
        """Prompt logprobs of sequences that asked for them (only sequence index 0 of a request)."""
        out = {}
        for i, item in enumerate(scheduled):
            seq = item.seq
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                continue  # a decode (checked first: the common case)
            k = seq.params.prompt_logprobs
            if k is None or seq.index != 0:
                continue
            done = seq.request.prompt_logprobs
            if done is not None and len(done) >= seq.num_prompt_tokens:
                continue  # recomputed after a preemption: already reported
            # after a preemption mid-prefill (chunked), positions before len(done) - 1 were reported
            first = max(seq.num_computed_tokens, len(done) - 1 if done else 0)
            s = starts[i] + first - seq.num_computed_tokens
            end = min(seq.num_computed_tokens + item.num_tokens, seq.num_prompt_tokens)
            # position p predicts token p + 1; the last prompt position predicts the first output
            n_pred = end - first - (1 if end == seq.num_prompt_tokens else 0)
            if n_pred <= 0:
                continue
            lp = torch.log_softmax(self._logits(hidden, slice(s, s + n_pred)).float(), dim=-1)
            targets = torch.tensor(seq.token_ids[first + 1 : first + 1 + n_pred], device=lp.device)
            chosen = lp.gather(1, targets[:, None])[:, 0]
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
            ranks = (lp > chosen[:, None]).sum(-1) + 1
            out[id(seq)] = (chosen.cpu(), ranks.cpu(), top_i.cpu(), top_v.cpu())
        return out
