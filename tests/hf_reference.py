"""Helpers that build Hugging Face reference models for the tests (transformers is a dev
dependency; infer itself never imports it). Importing this module imports nothing of infer."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import torch


class FastReaderMixin:
    """``gguf.GGUFReader`` slicing a plain ndarray view of its memory map instead of the
    ``numpy.memmap`` itself: identical bytes, a third of the time (infer.loader.gguf._Reader
    does the same). Written out here so that the reference runs none of infer's code."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain_view")
        if plain is None:
            plain = self._plain_view = self.data.view(np.ndarray)
        dt = np.dtype(dtype)
        count = int(count)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


@contextlib.contextmanager
def fast_gguf_reader():
    """Inside: transformers' GGUF loading (``from_pretrained(..., gguf_file=...)``, which imports
    ``gguf.GGUFReader`` when called) parses each file's header once, with :class:`FastReaderMixin`.
    From a GGUF, transformers reads the header twice (the config, then the weights); Gemma 3's
    262k-token vocabulary took ~47 s that way with the stock reader, 31 s with the fast one parsing
    twice. The readers are read-only and the file does not change inside."""
    import gguf

    stock = gguf.GGUFReader
    fast = type("FastGGUFReader", (FastReaderMixin, stock), {})
    parsed: dict[tuple, object] = {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in parsed:
            parsed[key] = fast(path, mode)
        return parsed[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = stock


@contextlib.contextmanager
def hf_qwen35_plain_pytorch():
    """Inside: HF's Qwen3.5 runs its plain-PyTorch gated delta rules. With flash-linear-attention importable
    (a GPU machine with the extra), transformers' kernel decorator swaps in fla's Triton kernels, which refuse
    the CPU tensors of an HF reference on the CPU ("Pointer argument ... cannot be accessed from Triton")."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen35

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    stock = {name: getattr(hf_qwen35, name) for name in names}
    for name, fn in stock.items():
        setattr(hf_qwen35, name, getattr(fn, "__wrapped__", fn))
    try:
        yield
    finally:
        for name, fn in stock.items():
            setattr(hf_qwen35, name, fn)


def tiny_hf_model(kind: str, seed: int = 0, **overrides):
    """A tiny random-init transformers model: ``kind`` in llama, llama3-scaled, qwen3, gemma3, qwen3_moe,
    qwen3_moe-sparse-step."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  rms_norm_eps=1e-6)
    if kind in ("llama", "llama3-scaled"):
        cfg = dict(common, tie_word_embeddings=False, rope_theta=10000.0)
        if kind == "llama3-scaled":
            cfg.update(rope_theta=500000.0, tie_word_embeddings=True,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cfg.update(overrides)
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    elif kind == "qwen3":
        cfg = dict(common, tie_word_embeddings=True, rope_theta=1e6)
        cfg.update(overrides)
        model = Qwen3ForCausalLM(Qwen3Config(**cfg))
    elif kind == "gemma3":
        cfg = dict(common, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=24,
                   rope_theta=1e6, rope_local_base_freq=10000.0, hidden_activation="gelu_pytorch_tanh")
        cfg.update(overrides)
        model = Gemma3ForCausalLM(Gemma3TextConfig(**cfg))
    elif kind in ("qwen3_moe", "qwen3_moe-sparse-step"):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        # 8 experts, top-2, renormalized; the second kind: dense MLPs on layers 0 and 1
        # (decoder_sparse_step=2 makes layers 1, 3, 5 sparse; mlp_only_layers removes layer 1), top-3
        # without renormalization
        cfg = dict(common, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                   tie_word_embeddings=False, rope_theta=1e6)
        if kind == "qwen3_moe-sparse-step":
            cfg.update(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[1], num_experts_per_tok=3,
                       norm_topk_prob=False, tie_word_embeddings=True)
        cfg.update(overrides)
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))
        # HF's default init (std 0.02) leaves the router near uniform: a wrong top-k would barely show
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.normal_(0.0, 0.1)
    else:
        raise ValueError(kind)
    # random (not default-init) norm weights, so that a wrong (1 + w) or a missing norm shows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if kind == "gemma3" else 1.0, 0.1)
    return model.eval()


def save_hf(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    return path


def infer_logits(net, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced float32 logits ``[len, vocab]`` of each sequence, all in one flattened batch."""
    from infer.attention import AttentionMetadata, TorchAttentionBackend

    if getattr(net, "attn_backend", None) is None:
        net.set_attention_backend(TorchAttentionBackend())
    device = next(net.parameters()).device
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    pos = torch.cat([torch.arange(len(s), device=device) for s in seqs])
    meta = AttentionMetadata.for_prefill([len(s) for s in seqs], device)
    with torch.no_grad():
        logits = net.compute_logits(net(ids, pos, meta)).float()
    return list(torch.split(logits, [len(s) for s in seqs]))


def hf_logits(model, seq: list[int]) -> torch.Tensor:
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(torch.tensor([seq], device=device)).logits[0].float()
