"""How the engine runs a model: :class:`EngineConfig`.

Every optimization of the phases is a field here, so that it can be switched on alone and measured
alone (see ``docs/phases/``). :meth:`EngineConfig.validate` rejects every combination that is not
supported, with a reason, instead of silently ignoring a flag. What a checkpoint *is*
(:class:`ModelConfig`, read by the loaders, never set by a user) lives in :mod:`infer.model_config`
and is re-exported here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from infer.config_phases import GGUF_WEIGHTS, KV_CACHE_DTYPES, QUANTIZATION_METHODS, PhaseChecks  # noqa: F401  (re-exported)
from infer.model_config import (  # noqa: F401  (re-exported: what a checkpoint is)
    LayerType,
    ModelConfig,
    RopeConfig,
    default_device,
    default_dtype,
    parse_dtype,
)
from infer.speculative_config import SPECULATIVE_METHODS, SpeculativeConfig  # noqa: F401  (re-exported)

BATCHING_MODES = ("none", "static", "continuous")
KV_CACHE_LAYOUTS = ("contiguous", "paged")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
KV_OFFLOAD_MODES = ("none", "host", "disk")
MOE_BACKENDS = ("auto", "torch", "triton")
LINEAR_ATTENTION_BACKENDS = ("auto", "torch", "triton", "fla")
SSM_STATE_DTYPES = ("float32", "bfloat16")
ALL_REDUCE_BACKENDS = ("nccl", "symm_mem")
ALL2ALL_BACKENDS = ("dynamic", "fixed_capacity")


def _flag(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field whose ``help`` text becomes the command-line flag's help; ``phase``: the phase
    whose page explains it (docs/index.md's table of flags is checked against these)."""
    return field(default=default, metadata={"help": help, **kw})


def _optimization(off: Any, on: Any, help: str, **kw: Any) -> Any:
    """A field left unset (``None``) by default: :meth:`EngineConfig.validate` sets it to ``off`` (the
    phase-by-phase default), or to ``on`` with ``optimize`` where the device and the other flags
    allow it. A value given explicitly always wins."""
    return _flag(None, help, off=off, on=on, **kw)


@dataclass
class EngineConfig(PhaseChecks):
    """Every knob of the engine. Each optimization is one field, off by default; ``optimize``
    turns on every one that the device, the model and the other flags allow (the fields left
    unset hold ``None`` until :meth:`validate` resolves them).

    The command-line flags of ``python -m infer.generate`` and ``python -m infer.server`` are
    generated from these fields (:func:`add_engine_args`), so each field is a flag with the
    same name (``max_model_len`` -> ``--max-model-len``) and the help text below.
    """

    model: str = _flag("smollm2-135m", "model: a short name (smollm2-135m, gemma3-270m), a .gguf file or a "
                       "Hugging Face model directory", phase=0)
    device: str = _flag("auto", "cpu, cuda, cuda:N or auto (cuda when a GPU is visible)", phase=0)
    dtype: str = _flag("auto", "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16 or float16", phase=0)
    max_model_len: int | None = _flag(None, "longest sequence in tokens (prompt + output); default: the "
                                      "model's context length, capped at 4096 on CPU and 32768 on CUDA", phase=1)
    max_num_seqs: int = _flag(8, "most sequences that hold KV-cache space at once (n > 1 counts n)", phase=3)
    seed: int = _flag(0, "seed of the engine's random stream (requests with their own seed ignore it)", phase=1)
    # ---- phases 3-4: batching
    batching: str | None = _optimization("none", "continuous", "none: one request at a time; static: a batch of up to max_num_seqs runs until "
                          "all of it finishes; continuous: admit and retire requests at every step (Orca)",
                          choices=BATCHING_MODES, ablation=BATCHING_MODES, phase=3)
    max_num_batched_tokens: int | None = _flag(None, "per-step token budget (prefill + decode tokens in one "
                                               "forward); default: max(max_model_len, 2048), or 2048 with "
                                               "chunked_prefill", phase=4)
    # ---- phase 6: chunked prefill
    chunked_prefill: bool | None = _optimization(False, True, "split prompts into chunks under max_num_batched_tokens and run them in the "
                                  "same steps as the running decodes (decode tokens first, prefill chunks fill the rest "
                                  "of the budget; Sarathi-Serve, vLLM's default); lets max_num_batched_tokens be "
                                  "smaller than max_model_len", ablation=(False, True), phase=6)
    long_prefill_token_threshold: int | None = _flag(None, "chunked prefill: the most prompt tokens one request "
                                                     "may prefill in one step, so several long prompts share the "
                                                     "budget (vLLM's name); default: no per-request cap", phase=6)
    batch_wait_timeout_ms: float = _flag(20.0, "static batching: how long the first waiting request waits for "
                                         "others to fill a batch (ms)", phase=3)
    # ---- phase 5: paged KV cache
    kv_cache: str | None = _optimization("contiguous", "paged", "contiguous: one max_model_len row per sequence, reserved at admission; "
                          "paged: blocks of block_size tokens taken as a sequence grows, preemption (recompute) when "
                          "they run out (vLLM's PagedAttention)", choices=KV_CACHE_LAYOUTS, ablation=KV_CACHE_LAYOUTS, phase=5)
    block_size: int = _flag(16, "paged KV cache: tokens per block", phase=5)
    attention_backend: str = _flag("auto", "auto (triton on CUDA, torch on CPU), torch (plain PyTorch, the "
                                   "reference) or triton (the Triton kernels; on a CPU only under TRITON_INTERPRET=1)",
                                   choices=ATTENTION_BACKENDS, ablation=("torch", "triton"), phase=5)
    # ---- phase 7: prefix caching
    prefix_caching: bool | None = _optimization(False, True, "paged KV cache: keep computed full blocks keyed by a hash of their tokens and "
                                 "of the tokens before them, find a new request's longest cached prefix and prefill "
                                 "only the rest; freed cached blocks are evicted LRU (vLLM's automatic prefix "
                                 "caching)", ablation=(False, True), phase=7)
    # ---- KV-cache sizing
    kv_cache_memory_bytes: int | None = _flag(None, "KV-cache budget in bytes; default: room for max_num_seqs "
                                              "full-length rows on CPU, gpu_memory_utilization on CUDA", phase=5)
    gpu_memory_utilization: float = _flag(0.9, "CUDA: fraction of GPU memory the engine may use (weights, "
                                          "activations of the largest step, KV cache), as in vLLM", phase=5)
    # ---- phase 8: fused kernels
    fused_kernels: bool | None = _optimization(False, True, "merge the Q/K/V and gate/up projections into one GEMM each and run "
                                "RMSNorm + residual add, QK-norm + RoPE and SiLU/GELU(gate) * up as one kernel "
                                "each (Triton with the triton attention backend, the same fused functions in "
                                "plain PyTorch with the torch one)", ablation=(False, True), phase=8)
    # ---- phase 9: CUDA graphs
    cuda_graphs: bool | None = _optimization(False, True, "CUDA: capture decode-only steps as CUDA graphs, one per batch-size bucket, "
                              "and replay them (one launch per step instead of one per kernel); needs the "
                              "triton attention backend", ablation=(False, True), phase=9)
    async_scheduling: bool | None = _optimization(False, True, "schedule and prepare step N + 1 and process step N - 1's tokens "
                                   "(stop checks, detokenization, streaming) while the device runs step N; the "
                                   "same outputs, one step later", ablation=(False, True), phase=9)
    pdl: bool | None = _optimization(False, True, "CUDA, compute capability >= 9.0 (Hopper): launch the Triton kernels of a step "
                      "(norms, RoPE, decode attention, the one-row projections) with programmatic dependent "
                      "launch, so each starts while the one before it finishes (a projection loads its first "
                      "weights before it waits); needs the triton attention backend", ablation=(False, True), phase=9)
    # ---- phase 15: mixture of experts
    moe_backend: str = _flag("auto", "MoE models: how the experts run. torch: a loop over experts (Hugging Face's; "
                             "syncs with the host); triton: tokens sorted by expert and one grouped GEMM per "
                             "projection (vLLM's fused_moe; graph-capturable); auto: triton on CUDA, torch on the "
                             "CPU (triton there only under TRITON_INTERPRET=1)", choices=MOE_BACKENDS,
                             ablation=("torch", "triton"), phase=15)
    # ---- phase 17: hybrid linear attention
    linear_attention_backend: str = _flag("auto", "hybrid models (Qwen3.5): the chunked form of the Gated DeltaNet "
                                          "layers' prefills. torch: plain PyTorch (the reference); triton: infer's "
                                          "three Triton kernels (on a CPU only under TRITON_INTERPRET=1); fla: "
                                          "flash-linear-attention's Triton kernels (CUDA; pip install "
                                          "flash-linear-attention fla-core); auto: triton on CUDA, torch on the CPU",
                                          choices=LINEAR_ATTENTION_BACKENDS, ablation=("torch", "triton"),
                                          ablation_opt_in=True, phase=17)
    cuda_graph_max_batch_size: int = _flag(256, "cuda_graphs: the largest decode batch captured (buckets 1, 2, "
                                           "4, 8, then steps of 8 up to this); larger decode steps run eagerly", phase=9)
    cuda_graph_prefill_max_tokens: int | None = _flag(None, "cuda_graphs: also capture steps that prefill one "
                                                      "sequence alone (a prompt, a prompt chunk, the suffix after a "
                                                      "prefix-cache hit) of up to this many tokens, in buckets 16, "
                                                      "32, 64, ... (powers of 2); default with cuda_graphs: 2048 "
                                                      "(at most max_num_batched_tokens, the chunked-prefill budget), "
                                                      "past which a prefill is compute-bound; 0: none",
                                                      with_cuda_graphs=2048, phase=9)
    cuda_graph_mixed_max_tokens: int | None = _flag(None, "cuda_graphs: also capture mixed steps of up to this many "
                                             "tokens, in buckets 64, 128, 256, ... (powers of 2): decodes beside "
                                             "one prompt chunk as one whole graph, other mixed steps (several "
                                             "prompts) piecewise, graphs between the attention calls, which run "
                                             "eagerly (vLLM's full and piecewise CUDA graphs); default with cuda_graphs: "
                                             "512 (at most max_num_batched_tokens); 0: such steps run "
                                             "eagerly", with_cuda_graphs=512, phase=9)
    # ---- the one switch
    optimize: bool = _flag(False, "turn on every optimization this device and model support, for each flag "
                           "left unset: continuous batching, the paged KV cache, prefix caching, chunked "
                           "prefill, fused kernels, async scheduling, and on CUDA the Triton kernels, CUDA graphs "
                           "(decode, prefill and mixed steps) and on Hopper pdl; a flag set on the command line "
                           "keeps its value. The engine logs what is on and why anything is off", phase=9)
    # ---- phase 10: KV offload
    kv_offload: str = _flag("none", "prefix blocks evicted from the device's KV cache go to a tier below instead "
                            "of being dropped, and a prefix hit there is copied back: none; host (host memory, "
                            "pinned on CUDA); disk (host, then memory-mapped files in kv_offload_dir below it); "
                            "needs prefix_caching", choices=KV_OFFLOAD_MODES, ablation=("none", "host"), phase=10)
    kv_offload_bytes: int = _flag(4 << 30, "kv_offload: capacity of the host tier in bytes", phase=10)
    kv_offload_dir: str | None = _flag(None, "kv_offload='disk': directory of the disk tier's file (deleted at "
                                       "shutdown)", phase=10)
    kv_offload_disk_bytes: int | None = _flag(None, "kv_offload='disk': capacity of the disk tier in bytes; "
                                              "default: 4 x kv_offload_bytes", phase=10)
    # ---- phase 11: weight quantization
    quantization: str = _flag("none", "weight-only quantization of the decoder's projections at load: none (the "
                              "checkpoint's weights as stored; a pre-quantized checkpoint stays quantized); int8 "
                              "(per-output-channel symmetric scales); fp8 (e4m3, per-output-channel scales); fp8_w8a8 (fp8 weights, "
                              "and activations quantized to e4m3 per token for prefills and batches of 5+ rows: the "
                              "FP8 tensor cores, Hopper); int4 "
                              "(symmetric, one scale per group of 128 inputs); int4_asym (a scale and a zero point per "
                              "group of 128: each group's range onto the 16 codes, AWQ's layout and torchao's int4 "
                              "default). The matmul reads the quantized "
                              "weights (Triton on CUDA; on the CPU PyTorch's weight-only kernels for int8 and int4, "
                              "a bfloat16 copy made at load for fp8)",
                              choices=QUANTIZATION_METHODS, ablation=QUANTIZATION_METHODS, phase=11)
    quantize_lm_head: bool = _flag(False, "also quantize the LM head (a tied one gets its own quantized copy; the "
                                   "input embedding keeps the float table), with the method and scale layout of "
                                   "the projections; needs a quantization (online or a pre-quantized checkpoint). "
                                   "The LM head is the largest single weight of a small model (SmolLM2-135M: 113 "
                                   "MB of its 538 MB in float32)", phase=11)
    gguf_weights: str = _flag("dequantize", "GGUF checkpoints (ignored for others): quantized serves the decoder's Q8_0, "
                              "Q4_0, Q4_1, Q4_K and Q6_K projections as stored, repacked without loss into the "
                              "int8 / int4 layouts the quantized kernels read (Q4_1 and Q4_K with float zero points; "
                              "other types dequantized); dequantize turns every tensor into float at load (phase 0); "
                              "quantized saves ~3.5x of the weight memory but is not yet faster (on an H200 at batch 1 "
                              "the GEMV over groups of 16-32 was 1.2-3.7x slower than bfloat16; on the CPU Q8_0 / Q6_K "
                              "layers keep a bfloat16 copy)",
                              choices=GGUF_WEIGHTS, phase=11)
    # ---- phase 11: FP8 KV cache
    kv_cache_dtype: str = _flag("auto", "storage of the KV cache: auto (the model's dtype); fp8 or fp8_e4m3 "
                                "(vLLM's names: float8 e4m3, one byte per value, x / scale with one float32 "
                                "scale per layer for K and one for V, 1.0 unless calculate_kv_scales): twice "
                                "the blocks of bf16 in the same kv_cache_memory_bytes (4x float32's)",
                                choices=KV_CACHE_DTYPES, ablation=("auto", "fp8"), phase=11)
    calculate_kv_scales: bool = _flag(False, "kv_cache_dtype='fp8': set each layer's K and V scales from the first "
                                      "forward that writes the cache (max|k| / 200, max|v| / 100, vLLM's "
                                      "calculate_kv_scales), then keep them; off: 1.0", phase=11)
    # ---- phase 12: speculative decoding
    speculative_config: dict | None = _flag(None, "speculative decoding, vLLM's JSON, e.g. '{\"method\": \"ngram\", "
                                            "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                                            "\"prompt_lookup_min\": 2}': propose up to num_speculative_tokens "
                                            "tokens per sequence (ngram: copied from the prompt and output so far; "
                                            "draft: a smaller model's; eagle3: an EAGLE-3 head's, model = its "
                                            "directory) and verify them in one forward of the model; the output is the same "
                                            "as without it (keys: SpeculativeConfig)", cli_type="json", phase=12,
                                            ablation=(None, {"method": "ngram", "num_speculative_tokens": 4,
                                                             "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
                                            ablation_opt_in=True)
    # ---- phases 14-15: tensor and expert parallelism
    tensor_parallel_size: int = _flag(1, "ranks (one process each, torch.distributed: NCCL on CUDA, gloo on the CPU) "
                                      "the model is split over, Megatron-style: attention heads, MLP columns and the "
                                      "vocabulary; rank 0 schedules and samples", ablation=(1, 2), phase=14)
    expert_parallel_size: int = _flag(1, "MoE models: ranks the experts are partitioned over (tokens go to their "
                                      "experts' rank and back with all-to-all); attention and dense layers run "
                                      "tensor-parallel over the same ranks (tensor_parallel_size is 1 or equal)",
                                      ablation=(1, 2), phase=15)
    # ---- phases 14-15: collectives that scale (issue 55), and more than one machine
    all_reduce_backend: str = _flag("nccl", "tensor parallelism on CUDA: how the layers' all-reduces run: nccl; "
                                    "symm_mem (PyTorch symmetric memory: each rank reads its peers' buffers "
                                    "directly, one-shot for small messages, two-shot above "
                                    "symm_mem_one_shot_max_bytes, NCCL above symm_mem_max_bytes; capturable in "
                                    "CUDA graphs). On the CPU (gloo) both run gloo's all-reduce",
                                    choices=ALL_REDUCE_BACKENDS, phase=14)
    symm_mem_one_shot_max_bytes: int = _flag(128 << 10, "all_reduce_backend='symm_mem': messages up to this many "
                                             "bytes use the one-shot all-reduce, larger ones two-shot", phase=14)
    symm_mem_max_bytes: int = _flag(8 << 20, "all_reduce_backend='symm_mem': size of the symmetric buffer each "
                                    "rank allocates once; larger messages go to NCCL", phase=14)
    all2all_backend: str = _flag("dynamic", "expert parallelism: how tokens reach their experts' ranks: dynamic "
                                 "(all-to-all with split sizes read on the host: one sync per MoE layer, no "
                                 "CUDA graphs); fixed_capacity (every rank sends a fixed number of padded rows "
                                 "to every rank, counts stay on the device: capturable in CUDA graphs)",
                                 choices=ALL2ALL_BACKENDS, phase=15)
    ep_capacity_factor: float | None = _flag(None, "all2all_backend='fixed_capacity': rows a rank sends to each "
                                             "rank = this factor x its pairs / ranks (GShard's capacity factor); "
                                             "pairs over it are dropped. Default: the worst case, nothing is "
                                             "dropped", phase=15)
    nnodes: int = _flag(1, "machines the tensor/expert-parallel ranks span (world_size / nnodes ranks each); "
                        "every machine runs the same command with its own --node-rank", phase=14)
    node_rank: int = _flag(0, "this machine's index, 0 .. nnodes - 1: node 0 schedules and serves, the others "
                           "only run their ranks", phase=14)
    master_addr: str | None = _flag(None, "nnodes > 1: address of node 0, where the ranks meet (torch.distributed's "
                                    "TCP rendezvous); default: $MASTER_ADDR, else 127.0.0.1", phase=14)
    master_port: int | None = _flag(None, "nnodes > 1: a free port on node 0 for the rendezvous; default: "
                                    "$MASTER_PORT, else 29500", phase=14)
    # ---- watching the engine (docs/reading-the-engine.md)
    trace: str | None = _flag(None, "record what every engine step did (the sequences it ran, prefill chunk or decode, "
                              "tokens, budget, preemptions, prefix-cache hits, graph or eager, host and device time) "
                              "and write it to this path as a Chrome trace (JSON) for ui.perfetto.dev or "
                              "chrome://tracing, at shutdown and at exit; off by default, and free when off", phase=9)
    # ---- phase 16: LoRA adapters
    enable_lora: bool = _flag(False, "serve LoRA adapters (PEFT's adapter_config.json + adapter_model.safetensors) "
                              "beside the base model: each request may name one (LLM.generate(lora_request=...), "
                              "the server's model field), and rows of different adapters run in the same batch "
                              "(Punica / S-LoRA batching)", phase=16)
    max_loras: int = _flag(1, "enable_lora: adapters resident on the device at once (its slots), so the most "
                           "distinct adapters in one batch", phase=16)
    max_lora_rank: int = _flag(16, "enable_lora: the largest adapter rank accepted; every slot is this wide "
                               "(smaller ranks are padded with zeros)", phase=16)
    max_cpu_loras: int | None = _flag(None, "enable_lora: adapters kept loaded in host memory (an LRU cache in "
                                      "front of the disk); at least max_loras; default: max_loras", phase=16)
    # ---- phase 17: hybrid models (linear attention)
    ssm_state_dtype: str = _flag("float32", "hybrid models: storage of the linear-attention layers' delta-rule "
                                 "state (vLLM's mamba_ssm_cache_dtype): float32, or bfloat16 (half the bytes a "
                                 "decode step reads and writes per sequence, and twice the state slots in the same "
                                 "memory; the kernels still compute in float32, the state rounded once a step, so "
                                 "a prefix hit restores a rounded snapshot: not bit-identical to a cold run)",
                                 choices=SSM_STATE_DTYPES, ablation=("float32", "bfloat16"), ablation_opt_in=True,
                                 phase=17)
    state_snapshot_stride: int = _flag(0, "hybrid models with prefix_caching: tokens between two snapshots of the "
                                       "linear-attention state (a multiple of block_size; a prefix hit is cut back to "
                                       "the last snapshot, so up to this many tokens are recomputed); 0: 256 rounded "
                                       "up to a multiple of block_size (vLLM's mamba_block_size)", phase=17)

    def resolved_device(self) -> torch.device:
        return torch.device(default_device() if self.device in (None, "auto") else self.device)

    def resolved_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.resolved_device())

    def validate(self) -> EngineConfig:
        """Reject unsupported values and flag combinations.

        Raises:
            ValueError: naming the field and why it is rejected.
        """
        try:
            dev = self.resolved_device()
        except RuntimeError as e:
            raise ValueError(f"device: {self.device!r} is not a device ({e})") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device: {self.device!r} is not supported (use cpu, cuda or auto)")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but no CUDA GPU is visible")
        self.resolved_dtype()  # raises on an unknown dtype
        self._resolve_unset(dev)
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}, got {self.batching!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if (not self.chunked_prefill and self.max_num_batched_tokens is not None and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len={self.max_model_len}: "
                "without chunked prefill a prompt runs in one step, so the budget must hold the longest "
                "sequence; raise max_num_batched_tokens, lower max_model_len or turn on chunked_prefill"
            )
        if self.long_prefill_token_threshold is not None:
            if self.long_prefill_token_threshold < 1:
                raise ValueError(
                    f"long_prefill_token_threshold must be >= 1, got {self.long_prefill_token_threshold}")
            if not self.chunked_prefill:
                raise ValueError("long_prefill_token_threshold caps a prompt's chunk per step, so it needs "
                                 "chunked_prefill=True")
        if self.kv_cache not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHE_LAYOUTS)}, got {self.kv_cache!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.state_snapshot_stride < 0 or (self.state_snapshot_stride and self.kv_cache == "paged"
                                               and self.state_snapshot_stride % self.block_size):
            raise ValueError(f"state_snapshot_stride must be 0 (auto) or a positive multiple of block_size="
                             f"{self.block_size}, got {self.state_snapshot_stride}: a snapshot belongs to the block "
                             "that ends at its position")
        if self.prefix_caching and self.kv_cache != "paged":
            raise ValueError("prefix_caching needs kv_cache='paged': a cached prefix is a run of full blocks that a "
                             "new sequence's block table points to, and the contiguous cache has one private row per "
                             "sequence")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.attention_backend == "triton" and dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on the CPU needs the Triton interpreter (set TRITON_INTERPRET=1 before "
                "infer is imported; it is slow, meant for tests); use 'torch' or 'auto'"
            )
        if not self.batch_wait_timeout_ms >= 0:
            raise ValueError(f"batch_wait_timeout_ms must be >= 0, got {self.batch_wait_timeout_ms}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cuda_graphs:
            if self.expert_parallel_size > 1 and self.all2all_backend != "fixed_capacity":
                raise ValueError("cuda_graphs with expert_parallel_size > 1 needs all2all_backend='fixed_capacity': "
                                 "the dynamic all-to-all sizes its messages from each step's routing, read on the "
                                 "host, and a graph replays fixed sizes")
            if dev.type != "cuda":
                raise ValueError("cuda_graphs needs a CUDA device: graphs capture GPU kernel launches, and on the "
                                 f"CPU ({self.device!r}) there are none to capture")
            if self.resolved_attention_backend() != "triton":
                raise ValueError("cuda_graphs needs attention_backend='triton' (or 'auto' on CUDA): the torch "
                                 "backend reads the batch's context lengths on the host and builds tensors of "
                                 "data-dependent shapes, which a captured graph cannot replay")
        if self.pdl:
            if dev.type != "cuda":
                raise ValueError(f"pdl needs a CUDA device (programmatic dependent launch is a CUDA feature), got "
                                 f"{self.device!r}")
            if self.resolved_attention_backend() != "triton":
                raise ValueError("pdl needs attention_backend='triton' (or 'auto' on CUDA): it changes how the "
                                 "Triton kernels are launched, and the torch backend has none")
            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability(dev)
                if major < 9:
                    raise ValueError(f"pdl needs a GPU of compute capability >= 9.0 (Hopper or later), {dev} is "
                                     f"{major}.{minor}; turn it off")
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {', '.join(MOE_BACKENDS)}, got {self.moe_backend!r}")
        if self.moe_backend == "triton" and dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("moe_backend='triton' on the CPU needs the Triton interpreter (set TRITON_INTERPRET=1 "
                             "before infer is imported; slow, meant for tests); use 'torch' or 'auto'")
        if self.cuda_graphs and self.moe_backend == "torch":
            raise ValueError("cuda_graphs needs moe_backend='triton' (or 'auto' on CUDA): the torch loop over experts "
                             "finds each expert's tokens on the host (data-dependent shapes), which a captured graph "
                             "cannot replay")
        if self.ssm_state_dtype not in SSM_STATE_DTYPES:
            raise ValueError(f"ssm_state_dtype must be one of {', '.join(SSM_STATE_DTYPES)}, got "
                             f"{self.ssm_state_dtype!r}")
        if self.linear_attention_backend not in LINEAR_ATTENTION_BACKENDS:
            raise ValueError(f"linear_attention_backend must be one of {', '.join(LINEAR_ATTENTION_BACKENDS)}, got "
                             f"{self.linear_attention_backend!r}")
        if self.linear_attention_backend == "triton" and dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("linear_attention_backend='triton' on the CPU needs the Triton interpreter (set "
                             "TRITON_INTERPRET=1 before starting Python); use 'torch'")
        if self.linear_attention_backend == "fla":
            if dev.type != "cuda":
                raise ValueError("linear_attention_backend='fla' needs a CUDA device (flash-linear-attention's kernels "
                                 "are Triton kernels for GPUs); use 'torch'")
            if importlib.util.find_spec("fla") is None:
                raise ValueError("linear_attention_backend='fla' needs flash-linear-attention, which is not installed: "
                                 "pip install flash-linear-attention fla-core")
        if self.cuda_graph_max_batch_size < 1:
            raise ValueError(f"cuda_graph_max_batch_size must be >= 1, got {self.cuda_graph_max_batch_size}")
        if self.cuda_graph_prefill_max_tokens < 0:
            raise ValueError(f"cuda_graph_prefill_max_tokens must be >= 0, got {self.cuda_graph_prefill_max_tokens}")
        if self.cuda_graph_prefill_max_tokens and not self.cuda_graphs:
            raise ValueError("cuda_graph_prefill_max_tokens needs cuda_graphs (it adds prefill graphs to the decode ones)")
        if self.cuda_graph_prefill_max_tokens and self.world_size > 1:
            raise ValueError("cuda_graph_prefill_max_tokens with tensor_parallel_size > 1 is not supported: the other "
                             "ranks replay only decode graphs (prefill steps there run eagerly); set it to 0")
        if self.cuda_graph_mixed_max_tokens < 0:
            raise ValueError(f"cuda_graph_mixed_max_tokens must be >= 0, got {self.cuda_graph_mixed_max_tokens}")
        if self.cuda_graph_mixed_max_tokens and not self.cuda_graphs:
            raise ValueError("cuda_graph_mixed_max_tokens needs cuda_graphs (it adds mixed-step graphs to the decode ones)")
        if self.cuda_graph_mixed_max_tokens and self.world_size > 1:
            raise ValueError("cuda_graph_mixed_max_tokens with tensor_parallel_size > 1 is not supported: the other "
                             "ranks replay only decode graphs (mixed steps there run eagerly); set it to 0")
        self._validate_kv_offload()
        self._validate_parallel(dev)
        if self.trace is not None:
            folder = os.path.dirname(os.path.abspath(self.trace)) if self.trace else ""
            if not self.trace or os.path.isdir(self.trace) or not os.path.isdir(folder):
                raise ValueError(f"trace: {self.trace!r} is not a file path in an existing directory")
        self._validate_quantization(dev)
        self._validate_kv_cache_dtype(dev)
        self._validate_lora()
        self._validate_speculative(dev)
        return self

    def _resolve_unset(self, dev: torch.device) -> None:
        """Give every optimization left unset (``None``) its value: its ``off`` value (the
        phase-by-phase default) or, with ``optimize``, its ``on`` value wherever
        :meth:`_why_not` finds nothing against it; the reasons an optimization stays off are kept
        in :attr:`optimization_notes` (``{field: reason}``). A value given explicitly is kept.
        Then the graph sizes beyond decode (``with_cuda_graphs``) follow ``cuda_graphs``. Idempotent."""
        if getattr(self, "optimization_notes", None) is not None:
            return  # resolved already
        notes: dict[str, str] = {}
        for f in dataclasses.fields(self):  # in declaration order: kv_cache is settled before prefix_caching
            if "off" not in f.metadata:
                continue
            if getattr(self, f.name) is not None:
                if self.optimize and getattr(self, f.name) == f.metadata["off"]:
                    notes[f.name] = "turned off explicitly"
                continue
            reason = self._why_not(f.name, dev) if self.optimize else None
            setattr(self, f.name, f.metadata["on"] if self.optimize and reason is None else f.metadata["off"])
            if reason is not None:
                notes[f.name] = reason
        defaulted = []
        for f in dataclasses.fields(self):
            if "with_cuda_graphs" in f.metadata and getattr(self, f.name) is None:
                # the model runner clamps these to the step budget and the context length
                on = self.cuda_graphs and self.world_size == 1
                setattr(self, f.name, f.metadata["with_cuda_graphs"] if on else 0)
                defaulted.append(f.name)
        self._graph_sizes_defaulted = tuple(defaulted)  # not given: validate_model may turn them off quietly
        self.optimization_notes = notes

    def _why_not(self, name: str, dev: torch.device) -> str | None:
        """Why ``optimize`` leaves the optimization ``name`` off on ``dev`` with the other flags as
        they are, or ``None`` if nothing stands against it."""
        graphs = ("needs a CUDA device" if dev.type != "cuda"
                  else "needs the triton attention backend" if self.resolved_attention_backend() != "triton"
                  else "needs the triton MoE backend" if self.resolved_moe_backend() != "triton"
                  else "expert parallelism needs all2all_backend='fixed_capacity' in graphs"
                  if self.expert_parallel_size > 1 and self.all2all_backend != "fixed_capacity"
                  else None)
        if name == "prefix_caching" and self.kv_cache != "paged":
            return "needs kv_cache='paged'"
        lora = self._lora_conflict(name)
        if lora is not None:
            return lora
        if name == "cuda_graphs":
            return graphs
        if name == "pdl":
            if graphs in ("needs a CUDA device", "needs the triton attention backend"):
                return graphs
            if torch.cuda.get_device_capability(dev)[0] < 9:
                return "needs a GPU of compute capability 9.0 or later (Hopper)"
        return None

    def optimization_summary(self) -> str:
        """One line for the start-up log: which optimizations are on, and with ``optimize``, why any
        is off (after :meth:`validate`)."""
        flags = {"batching": self.batching, "kv_cache": self.kv_cache}
        on = [f"{k}={v}" for k, v in flags.items()]
        on += [name for name in ("prefix_caching", "chunked_prefill", "fused_kernels", "async_scheduling",
                                 "cuda_graphs", "pdl") if getattr(self, name)]
        if self.quantization != "none":
            on.append(f"quantization={self.quantization}")
        if self.cuda_graphs:
            on.append(f"graphs for prefill <= {self.cuda_graph_prefill_max_tokens} and mixed steps <= "
                      f"{self.cuda_graph_mixed_max_tokens} tokens")
        notes = getattr(self, "optimization_notes", {})
        off = "; off: " + ", ".join(f"{k} ({v})" for k, v in notes.items()) if notes else ""
        return ("optimize: " if self.optimize else "optimizations: ") + ", ".join(on) + off

    def _validate_kv_offload(self) -> None:
        if self.kv_offload not in KV_OFFLOAD_MODES:
            raise ValueError(f"kv_offload must be one of {', '.join(KV_OFFLOAD_MODES)}, got {self.kv_offload!r}")
        if self.kv_offload != "disk" and (self.kv_offload_dir is not None or self.kv_offload_disk_bytes is not None):
            raise ValueError("kv_offload_dir and kv_offload_disk_bytes configure the disk tier; they need "
                             "kv_offload='disk'")
        if self.kv_offload == "none":
            return
        if not getattr(self, "prefix_caching", False):
            raise ValueError(f"kv_offload={self.kv_offload!r} needs prefix_caching=True: the tiers hold the blocks "
                             "that the prefix cache evicts, found by its block hashes")
        if self.kv_offload_bytes <= 0:
            raise ValueError(f"kv_offload_bytes must be > 0, got {self.kv_offload_bytes}")
        if self.kv_offload == "disk":
            if not self.kv_offload_dir:
                raise ValueError("kv_offload='disk' needs kv_offload_dir (the directory of the disk tier's file)")
            if self.kv_offload_disk_bytes is not None and self.kv_offload_disk_bytes <= 0:
                raise ValueError(f"kv_offload_disk_bytes must be > 0, got {self.kv_offload_disk_bytes}")

    def _validate_lora(self) -> None:
        if not self.enable_lora:
            if (self.max_loras, self.max_lora_rank, self.max_cpu_loras) != (1, 16, None):
                raise ValueError("max_loras, max_lora_rank and max_cpu_loras size the LoRA slots; they need "
                                 "enable_lora=True")
            return
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} < max_loras={self.max_loras}: every adapter on "
                             "the device is also kept in host memory")
        if self.expert_parallel_size > 1:
            raise ValueError(f"enable_lora: {self._lora_conflict('expert_parallel_size')}")
        if self.quantization != "none":
            raise ValueError(f"enable_lora with quantization={self.quantization!r} is not supported yet: LoRA and "
                             "quantization were built apart and have not been tested together")

    def _lora_conflict(self, name: str) -> str | None:
        """Why ``enable_lora`` rules out the optimization ``name`` (None if it does not). CUDA graphs are
        not ruled out: the adapters' row groups are a graph input (:mod:`infer.lora.graphs`)."""
        if not self.enable_lora:
            return None
        if name == "expert_parallel_size":
            return ("expert parallelism is not supported with LoRA yet (tensor parallelism is: each rank "
                    "holds its slice of every adapter's A or B)")
        return None

    def resolved_max_cpu_loras(self) -> int:
        """Adapters kept in host memory: ``max_cpu_loras`` or ``max_loras``."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def resolved_kv_offload_disk_bytes(self) -> int:
        """The disk tier's capacity: ``kv_offload_disk_bytes`` or 4 x ``kv_offload_bytes``."""
        return self.kv_offload_disk_bytes if self.kv_offload_disk_bytes is not None else 4 * self.kv_offload_bytes

    @property
    def world_size(self) -> int:
        """Processes the engine runs on: ``max(tensor_parallel_size, expert_parallel_size)``."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    def _validate_parallel(self, dev: torch.device) -> None:
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if tp < 1 or ep < 1:
            raise ValueError(f"tensor_parallel_size and expert_parallel_size must be >= 1, got {tp} and {ep}")
        if tp > 1 and ep > 1 and tp != ep:
            raise ValueError(f"expert_parallel_size={ep} with tensor_parallel_size={tp}: attention runs "
                             "tensor-parallel over the expert-parallel ranks, so the two must be equal (or "
                             "tensor_parallel_size=1)")
        self._validate_collectives()
        if self.world_size == 1:
            return
        if self.kv_offload != "none":
            raise ValueError(f"kv_offload={self.kv_offload!r} with tensor/expert parallelism is not supported: the "
                             "tiers copy one process's KV cache, and every rank holds its own part of each block")
        local = self.world_size // self.nnodes
        if dev.type == "cuda" and torch.cuda.device_count() < local:
            raise ValueError(f"{local} ranks on this machine need {local} GPUs (one per rank); "
                             f"{torch.cuda.device_count()} are visible")

    def _validate_collectives(self) -> None:
        """The fields of issue 55: the all-reduce and all-to-all backends and the machines."""
        if self.all_reduce_backend not in ALL_REDUCE_BACKENDS:
            raise ValueError(f"all_reduce_backend must be one of {', '.join(ALL_REDUCE_BACKENDS)}, "
                             f"got {self.all_reduce_backend!r}")
        if self.symm_mem_one_shot_max_bytes < 0 or self.symm_mem_max_bytes < 0:
            raise ValueError(f"symm_mem_one_shot_max_bytes and symm_mem_max_bytes must be >= 0, got "
                             f"{self.symm_mem_one_shot_max_bytes} and {self.symm_mem_max_bytes}")
        if self.all2all_backend not in ALL2ALL_BACKENDS:
            raise ValueError(f"all2all_backend must be one of {', '.join(ALL2ALL_BACKENDS)}, got "
                             f"{self.all2all_backend!r}")
        if self.ep_capacity_factor is not None:
            if not self.ep_capacity_factor > 0:
                raise ValueError(f"ep_capacity_factor must be > 0, got {self.ep_capacity_factor}")
            if self.all2all_backend != "fixed_capacity":
                raise ValueError("ep_capacity_factor sizes the fixed-capacity dispatch; it needs "
                                 "all2all_backend='fixed_capacity'")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"nnodes must be >= 1 and node_rank in 0 .. nnodes - 1, got nnodes={self.nnodes}, "
                             f"node_rank={self.node_rank}")
        if self.world_size % self.nnodes:
            raise ValueError(f"{self.world_size} ranks do not split evenly over nnodes={self.nnodes} machines")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port (1 .. 65535), got {self.master_port}")

    def validate_model(self, model: ModelConfig) -> None:
        """Reject parallel sizes that do not split ``model`` evenly, with the reason. (The engine calls
        this with the checkpoint's config before it starts any worker: :meth:`validate` checks the
        flags alone and reads no file.)

        Tensor parallelism splits whole query heads, whole KV heads (or copies each KV head to
        ``tp / num_kv_heads`` ranks when there are fewer KV heads than ranks), the MLP's
        intermediate columns and the vocabulary (embedding rows, LM-head rows) in equal parts.

        A hybrid model (phase 17, linear-attention layers with a recurrent state) runs without the
        optimizations that do not handle that state yet: KV offload, CUDA graphs of prefill and mixed steps
        (decode steps are captured: their state slots are graph inputs) and tensor/expert parallelism. Each
        one asked for explicitly is an error; under ``optimize`` it is turned off and the reason noted in the
        start-up log (:meth:`optimization_summary`).

        Raises:
            ValueError: naming the dimension that does not divide, or the flag a hybrid model does not support.
        """
        if model.is_hybrid:
            self._fit_hybrid(model)
        w = self.world_size
        if w == 1:
            return
        name = f"{'expert' if self.expert_parallel_size > 1 else 'tensor'}_parallel_size={w}"
        kv = model.num_kv_heads
        checks = [
            (model.num_heads % w == 0, f"the {model.num_heads} query heads do not split evenly"),
            (kv % w == 0 or w % kv == 0, f"the {kv} KV heads neither split evenly nor are a divisor of it "
                                         "(each KV head would be copied to an unequal number of ranks)"),
            (model.intermediate_size % w == 0, f"the MLP's {model.intermediate_size} columns do not split evenly"),
            (model.vocab_size % w == 0, f"the vocabulary of {model.vocab_size} tokens does not split evenly "
                                        "(the embedding and LM head are split by rows)"),
        ]
        if getattr(model, "num_experts", 0):
            if self.expert_parallel_size > 1:
                checks.append((model.num_experts % w == 0, f"its {model.num_experts} experts do not split evenly"))
            else:
                checks.append((model.moe_intermediate_size % w == 0, f"the experts' {model.moe_intermediate_size} "
                               "columns do not split evenly (tensor-parallel experts)"))
        elif self.expert_parallel_size > 1:
            checks.append((False, "it has no experts (expert_parallel_size is for MoE models); use "
                                  "tensor_parallel_size"))
        for ok, why in checks:
            if not ok:
                raise ValueError(f"{name} cannot split this {model.architecture} model: {why}")

    def _fit_hybrid(self, model: ModelConfig) -> None:
        """:meth:`validate_model` for a hybrid model (phase 17)."""
        notes = getattr(self, "optimization_notes", None) or {}
        # CUDA graphs capture decode steps only: a prefill's chunked gated delta rule loops over the
        # sequences on the host (the default sizes that came with cuda_graphs are turned off quietly)
        defaulted = getattr(self, "_graph_sizes_defaulted", ())
        for name in ("cuda_graph_prefill_max_tokens", "cuda_graph_mixed_max_tokens"):
            if not getattr(self, name):
                continue
            if self.cuda_graphs and not self.optimize and name not in defaulted:
                raise ValueError(f"{name} is not supported for hybrid models ({model.architecture}): prefill and "
                                 "mixed steps run eagerly (the chunked gated delta rule loops over the sequences "
                                 "on the host); decode steps are captured, use 0")
            if self.cuda_graphs:
                notes[name] = f"not supported for hybrid models ({model.architecture}): decode graphs only"
            setattr(self, name, 0)
        self.optimization_notes = notes
        if self.kv_offload != "none":
            raise ValueError(f"kv_offload is not supported for hybrid models ({model.architecture}): it moves "
                             "prefix blocks without the linear-attention state snapshots a hit needs")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported for hybrid models "
                             f"({model.architecture}) yet: the FP8 cache and the recurrent-state cache beside it "
                             "have not been tested together; use 'auto'")
        if self.world_size > 1:
            raise ValueError(f"tensor/expert parallelism is not supported for hybrid models ({model.architecture}): "
                             "the Gated DeltaNet layers are not split across ranks")
        for name, why in (("speculative_config", "a rejected draft's tokens would stay in the recurrent state, "
                                                 "which cannot be rolled back like KV blocks"),
                          ("enable_lora", "the adapters' targets in the Gated DeltaNet layers are not wired")):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported for hybrid models ({model.architecture}) yet: {why}")

    def resolved_attention_backend(self) -> str:
        """``"torch"`` or ``"triton"``: ``auto`` is triton on CUDA, torch on the CPU."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return "triton" if self.resolved_device().type == "cuda" else "torch"

    def resolved_moe_backend(self) -> str:
        """``"torch"`` or ``"triton"``: ``auto`` is triton on CUDA, torch on the CPU."""
        if self.moe_backend != "auto":
            return self.moe_backend
        return "triton" if self.resolved_device().type == "cuda" else "torch"

    def resolved_ssm_state_dtype(self) -> torch.dtype:
        """The torch dtype of :attr:`ssm_state_dtype`."""
        return torch.bfloat16 if self.ssm_state_dtype == "bfloat16" else torch.float32

    def resolved_linear_attention_backend(self) -> str:
        """``"torch"``, ``"triton"`` or ``"fla"``: ``auto`` is triton on CUDA, torch on the CPU."""
        if self.linear_attention_backend != "auto":
            return self.linear_attention_backend
        return "triton" if self.resolved_device().type == "cuda" else "torch"

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        """The per-step token budget: the flag, or ``max(max_model_len, 2048)`` (2048 with
        chunked prefill: prompts longer than that run in chunks; see docs/phases/06-chunked-prefill.md).

        Raises:
            ValueError: without chunked prefill, when the budget cannot hold a
                ``max_model_len``-token prompt.
        """
        if self.chunked_prefill:
            return self.max_num_batched_tokens or 2048
        budget = self.max_num_batched_tokens or max(max_model_len, 2048)
        if budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} < max_model_len={max_model_len}: without chunked prefill "
                "a prompt runs in one step; raise max_num_batched_tokens or lower max_model_len"
            )
        return budget

    @classmethod
    def ablation_values(cls, opt_in: Iterable[str] = ()) -> dict[str, tuple[Any, ...]]:
        """``{field: (off, ..., on)}`` for every optimization flag (the first value is "off").

        The ablation harness (``benchmarks/ablate.py``) runs a workload once per value of one
        flag with every other field left as given. A flag marked ``ablation_opt_in`` is only there
        when ``opt_in`` names it: ``speculative_config`` (prompt lookup, k = 4), whose gain depends on
        the prompts (random token ids give nothing to look up), so the default all-on stays the
        configuration earlier ablations measured.
        """
        named = set(opt_in)
        return {f.name: tuple(f.metadata["ablation"]) for f in dataclasses.fields(cls)
                if "ablation" in f.metadata and (not f.metadata.get("ablation_opt_in") or f.name in named)}

    def default_max_model_len(self, model_max: int) -> int:
        """``max_model_len``, or the model's context capped for this device."""
        if self.max_model_len is not None:
            return self.max_model_len
        cap = 4096 if self.resolved_device().type == "cpu" else 32768
        return min(model_max, cap)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown ones.

        Raises:
            TypeError: for an argument that is not an EngineConfig field.
        """
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise TypeError(
                f"unknown EngineConfig field(s): {', '.join(unknown)}; "
                f"known fields are {', '.join(cls.field_names())}"
            )
        return cls(**kwargs)


def add_engine_args(parser) -> None:
    """Add one ``--flag`` per :class:`EngineConfig` field to an ``argparse`` parser."""
    group = parser.add_argument_group("engine (EngineConfig)")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        md = f.metadata
        default = (f"{md['off']}; {md['on']} with --optimize" if "off" in md
                   else f"{md['with_cuda_graphs']} with --cuda-graphs, else 0" if "with_cuda_graphs" in md
                   else f.default)
        help_text = f"{md.get('help', '')} (default: {default})"
        if base is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif md.get("cli_type") == "json":  # a JSON object, parsed by validate() (SpeculativeConfig.parse)
            group.add_argument(flag, type=str, default=f.default, help=help_text)
        else:
            group.add_argument(flag, type=base, default=f.default, help=help_text,
                               choices=f.metadata.get("choices"))


def engine_config_from_args(args) -> EngineConfig:
    """The :class:`EngineConfig` described by parsed ``argparse`` arguments."""
    return EngineConfig(**{name: getattr(args, name) for name in EngineConfig.field_names()})
