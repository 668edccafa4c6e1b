"""The checks of :class:`~infer.config.EngineConfig` for phases 11 and 12 (weight and KV-cache quantization,
speculative decoding), a base class of it: :meth:`EngineConfig.validate` calls them. Here so that
``config.py`` stays readable; the fields themselves are declared there."""

from __future__ import annotations

import logging

import torch

from infer.speculative_config import SpeculativeConfig

QUANTIZATION_METHODS = ("none", "int8", "fp8", "fp8_w8a8", "int4", "int4_asym")
GGUF_WEIGHTS = ("dequantize", "quantized")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


class PhaseChecks:
    """Validation of the quantization, KV-cache dtype and speculative-decoding fields (a mixin of
    :class:`~infer.config.EngineConfig`, whose fields it reads)."""

    def _validate_gguf_weights(self, dev: torch.device) -> None:
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise ValueError(f"gguf_weights must be one of {', '.join(GGUF_WEIGHTS)}, got {self.gguf_weights!r}")
        if self.gguf_weights != "quantized":
            return
        if self.quantization != "none":
            raise ValueError(f"gguf_weights='quantized' serves a GGUF's own blocks; quantization="
                             f"{self.quantization!r} would quantize its dequantized weights again: use one of them")
        if self.world_size > 1:
            raise ValueError("gguf_weights='quantized' with tensor/expert parallelism is not supported: the quantized "
                             "projections are not split across ranks; use 'dequantize'")
        if self.enable_lora:
            raise ValueError("gguf_weights='quantized' with enable_lora is not supported yet: LoRA wraps float "
                             "projections; use 'dequantize'")
        if dev.type == "cpu":
            logging.getLogger("infer").warning(
                "gguf_weights='quantized' on the CPU: the Q8_0 and Q6_K projections keep a bfloat16 copy made at load "
                "(PyTorch's int8 CPU kernel takes no groups of 16 or 32); Q4_0, Q4_1 and Q4_K run on its int4 kernel")

    def _validate_quantization(self, dev: torch.device) -> None:
        self._validate_gguf_weights(dev)
        if not isinstance(self.quantize_lm_head, bool):
            raise ValueError(f"quantize_lm_head must be a bool, got {self.quantize_lm_head!r}")
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got "
                             f"{self.quantization!r}")
        if self.quantization == "none":
            return
        if self.world_size > 1:
            raise ValueError(f"quantization={self.quantization!r} with tensor/expert parallelism is not supported: "
                             "the quantized projections are not split across ranks")
        if self.quantization == "fp8_w8a8" and dev.type == "cpu":
            logging.getLogger("infer").warning(
                "quantization='fp8_w8a8' on the CPU: every projection runs the float32 reference (activations "
                "quantized per token, times a float32 copy of the weight's e4m3 codes held beside them): the "
                "numerics of W8A8 at float32's speed, not the FP8 tensor cores' (a GPU's)")
        if self.quantization == "fp8" and dev.type == "cpu":
            logging.getLogger("infer").warning(
                "quantization='fp8' on the CPU: no CPU kernel reads e4m3, so each projection is widened once at "
                "load to a bfloat16 copy held beside its fp8 weight (3 bytes per weight instead of float32's 4; "
                "decode reads the 2-byte copy). int8 and int4 are read as stored by PyTorch's CPU kernels")
        if self.quantization == "fp8_w8a8" and dev.type == "cuda" and torch.cuda.is_available():
            if torch.cuda.get_device_capability(dev) < (9, 0):
                raise ValueError("quantization='fp8_w8a8' on CUDA needs compute capability >= 9.0 (Hopper: FP8 "
                                 f"tensor-core GEMMs with row-wise scales), {dev} has less; use fp8 (weight-only)")
        if self.quantization == "fp8" and dev.type == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(dev)
            if (major, minor) < (8, 9):
                raise ValueError(f"quantization='fp8' on CUDA needs compute capability >= 8.9 (Ada, Hopper: fp8 "
                                 f"conversions in hardware), {dev} is {major}.{minor}; use int8 or int4")

    def _validate_kv_cache_dtype(self, dev: torch.device) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "auto":
            if self.calculate_kv_scales:
                raise ValueError("calculate_kv_scales sets the scales of an FP8 KV cache; it needs kv_cache_dtype='fp8'")
            return
        if dev.type == "cuda" and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(dev)
            if (major, minor) < (8, 9):
                raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} on CUDA needs compute capability >= 8.9 "
                                 f"(Ada, Hopper: e4m3 conversions in hardware), {dev} is {major}.{minor}; use 'auto'")
        if self.world_size > 1:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} with tensor/expert parallelism is not supported "
                             "yet: the ranks' caches and scales have not been tested together; use 'auto'")
        if self.calculate_kv_scales and self.cuda_graphs:
            raise ValueError("calculate_kv_scales with cuda_graphs is not supported: the scales are computed in "
                             "Python before the first write of each layer, and the first prefill may replay a "
                             "captured graph, which runs no Python; turn cuda_graphs off or calculate_kv_scales off")

    def resolved_kv_cache_dtype(self) -> torch.dtype | None:
        """The KV cache's storage dtype: ``torch.float8_e4m3fn`` for ``fp8`` / ``fp8_e4m3``; None for
        ``auto`` (the model's dtype)."""
        return None if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def _validate_speculative(self, dev: torch.device) -> None:
        """Parse ``speculative_config`` into :attr:`speculative` (None without it) and reject the flags it
        does not work with."""
        self.speculative = None
        if self.speculative_config is None:
            return
        self.speculative = spec = SpeculativeConfig.parse(self.speculative_config)
        m = spec.method
        if self.world_size > 1 and m in ("draft", "eagle3"):
            raise ValueError(f"speculative_config method {m!r} with tensor/expert parallelism is not supported: "
                             "the draft model runs on rank 0 alone, and its KV cache would need the ranks' block "
                             "geometry; use method 'ngram' or tensor_parallel_size=1")
        if m in ("draft", "eagle3") and dev.type == "cuda" and self.kv_cache_memory_bytes is None:
            raise ValueError(f"speculative_config method {m!r} on CUDA needs kv_cache_memory_bytes: the draft's KV "
                             "cache (as many blocks as the target's) is allocated beside the target's, and the "
                             "memory profile that sizes the target's from gpu_memory_utilization does not count it")
        if self.enable_lora:
            raise ValueError("speculative_config with enable_lora is not supported yet: a verify step's k + 1 rows "
                             "per sequence would need their adapter slots in the LoRA mapping; the two were built "
                             "apart and have not been tested together")
        if m in ("draft", "eagle3") and self.kv_offload != "none":
            raise ValueError(f"speculative_config method {m!r} with kv_offload is not supported: the tiers hold "
                             "the target's KV blocks only, and a restored block would have no draft KV")
