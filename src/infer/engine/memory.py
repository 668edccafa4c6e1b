"""How many KV-cache blocks an engine gets: the memory budget, profiled on a GPU (phase 5).

vLLM's rule (``determine_available_memory``): on a GPU the KV cache gets what is left of
``gpu_memory_utilization`` of the device after the weights, the activations of the largest step
(measured by a profiling forward) and, with CUDA graphs (phase 9), their memory pool. On a CPU the
cache is sized for ``max_num_seqs`` full-length sequences (pages are only touched when written),
unless ``kv_cache_memory_bytes`` says otherwise.
"""

from __future__ import annotations

import logging
import os

import torch

from infer.attention import AttentionMetadata, TorchAttentionBackend
from infer.engine.cuda_graphs import mixed_graph_sizes
from infer.loader import LoadedModel

log = logging.getLogger("infer")


#: On a CPU without ``kv_cache_memory_bytes``: the KV pool takes at most this share of the memory the host
#: has available at start-up (``MemAvailable``), so that touching all of it cannot exhaust the machine.
CPU_KV_FRACTION = 0.5


def host_available_bytes() -> int | None:
    """Memory the host can give without swapping (Linux's ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def kv_heads_per_rank(model) -> int:
    """KV heads this process caches: all of them, or with tensor parallelism its rank's share."""
    # (the first layer with attention: a hybrid model's first layers may be linear attention, phase 17)
    return next(layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")).num_kv_heads


def num_kv_blocks(*args, **kwargs) -> int:
    """The block count of :func:`cache_sizes` (for a model without recurrent state)."""
    return cache_sizes(*args, **kwargs)[0]


def split_state_budget(budget: int, slot_bytes: int, max_num_seqs: int) -> int:
    """Hybrid models (phase 17): how many recurrent-state slots to take out of a ``budget``-byte cache.

    One slot per sequence that can run (``max_num_seqs``), as long as they take at most half the
    budget; otherwise as many as half the budget holds: the KV blocks of the attention layers still
    need room, and a request that finds no free slot waits in the queue like one that finds no block.

    Raises:
        ValueError: when not even one slot fits, with the numbers.
    """
    slots = min(max_num_seqs, budget // 2 // slot_bytes)
    if slots < 1:
        raise ValueError(f"the cache budget ({budget / 2**20:.1f} MiB) cannot hold one recurrent-state slot "
                         f"({slot_bytes / 2**20:.1f} MiB) in half of it; raise the budget")
    return int(slots)


def split_snapshot_budget(budget: int, slot_bytes: int, reserve: int, block_bytes: int, block_size: int,
                          stride: int, max_blocks: int) -> int:
    """Hybrid prefix caching (phase 17): how many state-snapshot slots to take out of what is left of the
    cache budget after the running sequences' slots.

    Enough for one snapshot per ``stride`` tokens of every block the rest can hold (the cached prefixes
    then never lack a snapshot), i.e. ``x`` with ``x * slot_bytes + (x * stride / block_size) *
    block_bytes = budget``; but at most half the budget (a snapshot can cost more bytes than the K/V of
    its stride: Qwen3.5-4B's 49 MiB against 8 MiB for 256 tokens, and the blocks are what lets sequences
    run), no more than ``max_blocks`` (the pool's cap) can use, and leaving ``reserve`` bytes (one
    ``max_model_len`` sequence's blocks). 0 when nothing is left.
    """
    cover = budget * block_size // (stride * block_bytes + block_size * slot_bytes)
    return max(0, int(min(cover, budget // 2 // slot_bytes, max_blocks * block_size // stride,
                          (budget - reserve) // slot_bytes)))


def cache_sizes(
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
    state_slot_bytes: int = 0,
    cuda_graph_variants: int = 1,
    state_pad_slots: int = 0,
    snapshot_stride: int = 0,
    kv_cache_dtype: torch.dtype | None = None,
) -> tuple[int, int, int]:
    """How many KV-cache blocks of ``block_size`` tokens, and recurrent-state slots, to allocate.

    The budget is ``kv_cache_memory_bytes`` if given; on CUDA otherwise, as vLLM does, the
    memory left under ``gpu_memory_utilization`` of the GPU after the weights and a profiling
    forward of ``max_num_batched_tokens`` tokens (the largest step's activations), and, with CUDA
    graphs (``cuda_graph_batch_size`` > 0, the largest bucket), the memory their shared pool will
    keep: the peak of a decode forward + LM head of that many sequences, or of a one-sequence
    prefill of ``cuda_graph_prefill_tokens`` (or ``cuda_graph_mixed_tokens``) tokens if larger, plus
    what the mixed-step pieces keep between them (every layer's q, k, v and attention output for
    each bucket, :func:`~infer.engine.cuda_graphs.mixed_graph_sizes`); on CPU otherwise, room
    for ``max_num_seqs`` sequences of ``max_model_len`` tokens, but no more than
    :data:`CPU_KV_FRACTION` of the memory the host has available when the engine starts. (The
    pool is allocated at once and its pages are touched as sequences write them: a server's resident
    memory grows towards the pool's size as it serves, and stays there: SmolLM2's pool at 8 sequences
    of 4,096 tokens is 1.5 GB.)

    ``cuda_graph_variants``: 2 with LoRA (phase 16), whose mixed-step pieces are captured twice (their
    tensors between the pieces counted twice).

    A block's bytes are those of ``kv_cache_dtype`` (None: the model's dtype): an FP8 cache (phase 11,
    one byte per value) gets twice the blocks of a bf16 one from the same budget, four times float32's.

    A hybrid model (phase 17, ``state_slot_bytes`` > 0: the bytes of one sequence's recurrent state)
    first takes its state slots out of the budget (:func:`split_state_budget`), and ``state_pad_slots``
    more that no sequence owns (the CUDA graphs' padding slot); with prefix caching (``snapshot_stride``
    > 0, tokens between two state snapshots) then its snapshot slots (:func:`split_snapshot_budget`); the
    blocks get the rest.

    Returns:
        ``(blocks, slots)``: ``min(budget // block_bytes, max_num_seqs * ceil(max_model_len / block_size))``
        blocks (more than ``max_num_seqs`` full-length sequences can hold would sit idle; for the
        contiguous cache, ``block_size = max_model_len``, that is the number of rows), and the state
        slots (0 without ``state_slot_bytes``), and the snapshot slots (0 without ``snapshot_stride``).

    Raises:
        ValueError: when not even one ``max_model_len``-token sequence fits, with the numbers.
    """
    cfg = loaded.config
    p = next(loaded.model.parameters())
    # tensor parallelism: each rank caches only its KV heads
    block_bytes = cfg.kv_bytes_per_token(kv_cache_dtype or p.dtype) * block_size * kv_heads_per_rank(loaded.model) // cfg.num_kv_heads
    per_seq = -(-max_model_len // block_size)
    cap = max_num_seqs * per_seq
    if kv_cache_memory_bytes is not None:
        budget, where = kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif p.device.type == "cuda":
        budget, where = _profile_free_gpu_memory(loaded, max_model_len, max_num_seqs, max_num_batched_tokens,
                                                 gpu_memory_utilization, cuda_graph_batch_size,
                                                 cuda_graph_prefill_tokens, cuda_graph_mixed_tokens,
                                                 cuda_graph_variants), \
            "gpu_memory_utilization"
    else:
        available = host_available_bytes()
        if available is None:
            return cap, max_num_seqs if state_slot_bytes else 0, \
                cap * block_size // snapshot_stride if state_slot_bytes and snapshot_stride else 0
        budget, where = int(CPU_KV_FRACTION * available), f"{CPU_KV_FRACTION:.0%} of the host's available memory"
    slots = split_state_budget(budget, state_slot_bytes, max_num_seqs) if state_slot_bytes else 0
    budget -= (slots + state_pad_slots) * state_slot_bytes
    snapshots = split_snapshot_budget(budget, state_slot_bytes, block_bytes * per_seq, block_bytes, block_size,
                                      snapshot_stride, cap) if state_slot_bytes and snapshot_stride else 0
    budget -= snapshots * state_slot_bytes
    blocks = min(cap, budget // block_bytes)
    if blocks < per_seq:
        seq_bytes = per_seq * block_bytes
        raise ValueError(
            f"the KV cache budget ({where}: {budget / 2**30:.2f} GiB) cannot hold one sequence of "
            f"max_model_len={max_model_len} tokens ({seq_bytes / 2**30:.2f} GiB); lower max_model_len or "
            f"raise the budget"
        )
    return int(blocks), slots, snapshots


@torch.inference_mode()
def _profile_free_gpu_memory(loaded: LoadedModel, max_model_len: int, max_num_seqs: int, num_tokens: int,
                             utilization: float, graph_batch_size: int = 0, graph_prefill_tokens: int = 0,
                             graph_mixed_tokens: int = 0, graph_variants: int = 1) -> int:
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
            attn = model.model.layers[0].self_attn
            per_token = 2 * (attn.num_heads + attn.num_kv_heads) * attn.head_dim * next(model.parameters()).element_size()
            graph_bytes += per_token * cfg.num_layers * sum(mixed_graph_sizes(graph_mixed_tokens)) * graph_variants
        log.info("CUDA graphs: %.0f MiB kept for their memory pool (decode batch %d, prefill %d tokens)",
                 graph_bytes / 2**20, n, t)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(dev).total_memory
    # memory held outside PyTorch's allocator (CUDA context, other processes) also counts
    free, _ = torch.cuda.mem_get_info(dev)
    outside = total - free - torch.cuda.memory_reserved(dev)
    return max(0, int(total * utilization) - peak - outside - graph_bytes)
