#!/usr/bin/env python3
"""Write a random-weight Hugging Face model directory at a real architecture's shapes.

No model hub is reachable from the GPU machine, so GPU correctness is checked on synthetic
checkpoints: random weights at the shapes of a real model, written by HF transformers itself
(its config class, its model class, ``save_pretrained``), then loaded both by transformers and
by infer (scripts/gpu_parity.py). The directory looks like a real one:

* ``config.json`` (+ ``generation_config.json``), written by transformers;
* ``model.safetensors`` or shards + ``model.safetensors.index.json`` (``--max-shard-size``);
* ``tokenizer.json``: a byte-level BPE whose vocabulary exactly fills ``vocab_size`` (the 256
  byte symbols, synthetic merges, then the special tokens at the top ids), and
  ``tokenizer_config.json`` with a ChatML ``chat_template``.

Weights: every matrix ~ N(0, 0.02) (tiny presets: larger, see PRESETS). RMSNorm weights are *not* left at their trivial init (a
model that ignored them would still match): ``1 + N(0, 0.05)`` for Llama/Qwen3 (``w * x``)
and ``N(0, 0.1)`` for Gemma 3 (``(1 + w) * x``). Generated on ``--device`` (an 8B model takes
seconds on a GPU) directly in ``--dtype``.

Usage::

    python scripts/make_synthetic_checkpoint.py qwen3-4b /tmp/qwen3-4b --device cuda
    python scripts/make_synthetic_checkpoint.py tiny-gemma3 /tmp/tg --device cpu --dtype float32

or ``make_checkpoint(preset, outdir, dtype, device, seed)`` from Python.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["PRESETS", "Preset", "build_tokenizer", "make_checkpoint"]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Special tokens, in id order, placed at the top of the vocabulary.
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


@dataclass(frozen=True)
class Preset:
    """A model family (``llama`` | ``qwen3`` | ``gemma3`` | ``qwen3_moe``) and its config.json fields."""

    family: str
    fields: dict[str, Any]
    bos_token: str | None = None  # prepended by the tokenizer when set
    max_shard_size: str = "2GB"
    description: str = ""
    init_std: float = 0.02  # std of every weight matrix
    extra: dict[str, Any] = field(default_factory=dict)


_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
}


def _qwen3(hidden, layers, heads, kv, inter, vocab=151936, tied=True, head_dim=128, max_pos=40960):
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, hidden_act="silu",
        max_position_embeddings=max_pos, rms_norm_eps=1e-6, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False,
        use_sliding_window=False,
    )


def _qwen3_moe(hidden, layers, heads, kv, inter, moe_inter, experts, top_k, vocab=151936, tied=False, head_dim=128,
               max_pos=40960, mlp_only_layers=()):
    d = _qwen3(hidden, layers, heads, kv, inter, vocab=vocab, tied=tied, head_dim=head_dim, max_pos=max_pos)
    d.update(moe_intermediate_size=moe_inter, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
             decoder_sparse_step=1, mlp_only_layers=list(mlp_only_layers), router_aux_loss_coef=0.001)
    return d


def _qwen3_5(hidden, layers, heads, kv, inter, lin_k_heads, lin_v_heads, vocab=248320, tied=True, head_dim=256,
             lin_head_dim=128, max_pos=262144):
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, hidden_act="silu",
        max_position_embeddings=max_pos, rms_norm_eps=1e-6, tie_word_embeddings=tied, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        linear_conv_kernel_dim=4, linear_key_head_dim=lin_head_dim, linear_value_head_dim=lin_head_dim,
        linear_num_key_heads=lin_k_heads, linear_num_value_heads=lin_v_heads,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    )


def _llama(hidden, layers, heads, kv, inter, vocab=128256, tied=False, head_dim=None, max_pos=131072):
    return dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim or hidden // heads,
        hidden_act="silu", max_position_embeddings=max_pos, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_parameters=dict(_LLAMA31_ROPE), attention_bias=False, mlp_bias=False,
    )


def _gemma3(hidden, layers, heads, kv, inter, vocab=262144, head_dim=256, window=512, layer_types=None,
            max_pos=32768):
    d = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=max_pos, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={k: dict(v) for k, v in _GEMMA3_ROPE.items()},
        query_pre_attn_scalar=256, sliding_window=window, final_logit_softcapping=None,
        attn_logit_softcapping=None, attention_bias=False,
    )
    if layer_types is not None:
        d["layer_types"] = list(layer_types)
    return d


PRESETS: dict[str, Preset] = {
    "qwen3-0.6b": Preset("qwen3", _qwen3(1024, 28, 16, 8, 3072, tied=True), description="Qwen3-0.6B shapes"),
    "qwen3-4b": Preset("qwen3", _qwen3(2560, 36, 32, 8, 9728, tied=True), description="Qwen3-4B shapes"),
    "qwen3-4b-2l": Preset("qwen3", _qwen3(2560, 2, 32, 8, 9728, tied=True),
                          description="Qwen3-4B layer shapes, 2 layers (GPU tests)"),
    "qwen3-8b": Preset("qwen3", _qwen3(4096, 36, 32, 8, 12288, tied=False), description="Qwen3-8B shapes",
                       max_shard_size="5GB"),
    # Qwen3-30B-A3B: 128 experts of width 768, 8 per token (~3.3B active of 30.5B); 61 GB in bf16, more
    # than this machine's disk holds next to anything else: write it with --random-weights (config and
    # tokenizer only; the loader generates the weights on the device). The 4-layer cut has the real
    # per-layer shapes at 2.6 GB, for the parity gate.
    "qwen3-30b-a3b": Preset("qwen3_moe", _qwen3_moe(2048, 48, 32, 4, 6144, 768, 128, 8),
                            description="Qwen3-30B-A3B shapes (128 experts, top-8)", max_shard_size="5GB"),
    "qwen3-30b-a3b-4l": Preset("qwen3_moe", _qwen3_moe(2048, 4, 32, 4, 6144, 768, 128, 8),
                               description="Qwen3-30B-A3B layer shapes, 4 layers"),
    # Qwen3.5-4B: 24 Gated DeltaNet + 8 gated-attention layers (hybrid linear attention, phase 17)
    "qwen3.5-4b": Preset("qwen3_5", _qwen3_5(2560, 32, 16, 4, 9216, 16, 32), description="Qwen3.5-4B shapes "
                         "(text; 3 Gated DeltaNet layers per gated-attention layer)"),
    # a CPU-sized pair of similar size for benchmarks/hybrid.py: 8 layers, hidden 512 (hybrid: 6 + 2)
    "small-qwen3.5": Preset("qwen3_5", _qwen3_5(512, 8, 8, 2, 1536, 4, 8, vocab=4096, head_dim=64, lin_head_dim=64,
                                                max_pos=32768),
                            description="small Qwen3.5 (6 Gated DeltaNet + 2 gated-attention layers, CPU benchmark)"),
    "small-qwen3": Preset("qwen3", _qwen3(512, 8, 8, 2, 1536, vocab=4096, head_dim=64, max_pos=32768),
                          description="small Qwen3 (8 attention layers, CPU benchmark beside small-qwen3.5)"),
    "llama3-8b": Preset("llama", _llama(4096, 32, 32, 8, 14336), bos_token="<|begin_of_text|>",
                        description="Llama-3.1-8B shapes (llama3 rope scaling)", max_shard_size="5GB"),
    "gemma3-1b": Preset("gemma3", _gemma3(1152, 26, 4, 1, 6912), bos_token="<bos>",
                        description="Gemma 3 1B (text) shapes"),
    # CPU-sized: a few layers, every feature of the family still exercised.
    # Their init std is 0.02 * sqrt(4096 / hidden), so that activations, attention sharpness
    # and logits have the spread of an 8B model at 0.02 (with 0.02 a tiny Llama's attention is
    # near uniform and a wrong RoPE barely moves the logits).
    "tiny-qwen3": Preset("qwen3", _qwen3(96, 3, 4, 2, 256, vocab=768, tied=True, head_dim=32, max_pos=4096),
                         description="tiny Qwen3 (tied, QK-norm, GQA 2:1)", init_std=0.13),
    "tiny-qwen3-moe": Preset("qwen3_moe", _qwen3_moe(64, 3, 4, 2, 128, 32, 8, 2, vocab=512, head_dim=16,
                                                     max_pos=4096, mlp_only_layers=[1]),
                             description="tiny Qwen3-MoE (8 experts, top-2, layer 1 dense)", init_std=0.16),
    "tiny-qwen3.5": Preset("qwen3_5", _qwen3_5(64, 4, 4, 2, 128, 2, 4, vocab=512, head_dim=16, lin_head_dim=16,
                                               max_pos=4096),
                           description="tiny Qwen3.5 (3 Gated DeltaNet + 1 gated-attention layer)", init_std=0.16),
    "tiny-llama": Preset("llama", _llama(128, 3, 4, 2, 320, vocab=1024, tied=False),
                         bos_token="<|begin_of_text|>", description="tiny Llama (untied, llama3 rope, GQA 2:1)",
                         init_std=0.113),
    "tiny-gemma3": Preset("gemma3", _gemma3(64, 4, 4, 1, 192, vocab=512, head_dim=32, window=32, max_pos=4096,
                                            layer_types=["sliding_attention", "sliding_attention",
                                                         "full_attention", "sliding_attention"]),
                          bos_token="<bos>", description="tiny Gemma 3 (window 32, 3 sliding + 1 global)",
                          init_std=0.16),
}

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r} (use bf16, fp16 or float32)") from None


# ----------------------------------------------------------------------------- tokenizer


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable unicode character table (byte-level BPE's alphabet)."""
    from infer.tokenizer import bytes_to_unicode as table

    return table()


def _byte_rank_order() -> list[int]:
    """Bytes roughly by how common they are in text, so that early merges look like words."""
    order = [ord(" ")] + list(b"etaoinshrdlcumwfgypbvkjxqz") + list(b"ETAOINSHRDLCUMWFGYPBVKJXQZ")
    order += list(b"0123456789") + list(b".,'\"-:;!?()\n\t/_=+*&%$#@[]{}<>|\\^`~")
    order += [b for b in range(256) if b not in set(order)]
    assert len(order) == 256 and len(set(order)) == 256
    return order


def build_tokenizer(vocab_size: int, bos_token: str | None = None):
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size`` ids.

    Ids ``0..255`` are the bytes (id = byte value), then synthetic merges (pairs of frequent
    bytes, then longer tokens, each the concatenation of two earlier tokens, enumerated in
    order of increasing rank sum), then the special tokens at the top ids.

    Returns:
        ``(tokenizer, specials)`` with ``specials`` mapping each special token to its id.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = ([bos_token] if bos_token else []) + CHATML_SPECIALS
    n_bpe = vocab_size - len(specials)
    if n_bpe < 256:
        raise ValueError(f"vocab_size {vocab_size} too small (need at least {256 + len(specials)})")
    b2u = bytes_to_unicode()
    vocab: dict[str, int] = {b2u[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    order = [b2u[b] for b in _byte_rank_order()]
    prev = order  # tokens of the previous length, by rank
    need = n_bpe - 256
    while len(merges) < need:
        level: list[str] = []
        # enumerate (prev[i], order[j]) by increasing i + j: frequent prefixes + frequent bytes first
        for r in range(len(prev) + len(order) - 1):
            for i in range(max(0, r - len(order) + 1), min(r, len(prev) - 1) + 1):
                a, b = prev[i], order[r - i]
                tok = a + b
                if tok in vocab:
                    continue
                vocab[tok] = len(vocab)
                merges.append((a, b))
                level.append(tok)
                if len(merges) == need:
                    break
            if len(merges) == need:
                break
        prev = level
    assert len(vocab) == n_bpe, (len(vocab), n_bpe)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    ids = {s: tok.token_to_id(s) for s in specials}
    if bos_token:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", pair=f"{bos_token} $A {bos_token} $B", special_tokens=[(bos_token, ids[bos_token])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} ids, wanted {vocab_size}")
    return tok, ids


# ----------------------------------------------------------------------------- weights


def _hf_config(preset: Preset, ids: dict[str, int], dtype: torch.dtype):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3MoeConfig

    cls = {"qwen3": Qwen3Config, "llama": LlamaConfig, "gemma3": Gemma3TextConfig,
           "qwen3_moe": Qwen3MoeConfig, "qwen3_5": Qwen3_5TextConfig}[preset.family]
    arch = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}[preset.family]
    tokens = dict(
        bos_token_id=ids.get(preset.bos_token) if preset.bos_token else None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|pad|>"],
    )
    cfg = cls(**preset.fields, **tokens, architectures=[arch])
    cfg.dtype = dtype
    return cfg


@torch.no_grad()
def _init_weights(model: torch.nn.Module, family: str, gen: torch.Generator, std: float = 0.02) -> None:
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied lm_head / embed_tokens
            continue
        seen.add(id(p))
        if family == "qwen3_5" and name.endswith(("A_log", "dt_bias")):
            _init_decay(p, name, gen)
        elif p.ndim == 1 and "norm" in name:
            if family == "gemma3" or (family == "qwen3_5" and "linear_attn" not in name):  # (1 + w) norms
                p.normal_(0.0, 0.1, generator=gen)
            else:
                p.normal_(1.0, 0.05, generator=gen)
        else:
            p.normal_(0.0, std, generator=gen)
    for name, p in model.named_parameters():
        if not torch.isfinite(p).all() or p.abs().max() == 0:
            raise AssertionError(f"bad initialisation of {name}")


def _init_decay(p: torch.Tensor, name: str, gen: torch.Generator) -> None:
    """Gated DeltaNet's decay parameters (``g = -exp(A_log) * softplus(a + dt_bias)``): ``A`` uniform in
    [0.01, 2] and ``dt_bias`` around -1, so that heads range from forgetting within a few tokens to
    remembering hundreds (a test of the state carried across chunks needs the long memories)."""
    if name.endswith("A_log"):
        p.copy_(torch.empty(p.shape, device=p.device).uniform_(0.01, 2.0, generator=gen).log())
    else:
        p.normal_(-1.0, 0.5, generator=gen)


def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def _write_weights(cfg, p: Preset, out: Path, dtype: torch.dtype, device: torch.device, seed: int,
                   max_shard_size: str | None) -> int:
    """Build the model with transformers, initialise it (:func:`_init_weights`), save its safetensors;
    return its parameter count."""
    from transformers import AutoModelForCausalLM

    with _no_init(), torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if next(model.parameters()).dtype != dtype:
        model = model.to(dtype)
    # no_init_weights also skips post_init's tying (transformers 5): tie explicitly
    tied = bool(p.fields.get("tie_word_embeddings"))
    if tied:
        model.tie_weights()
    if (model.get_output_embeddings().weight is model.get_input_embeddings().weight) != tied:
        raise AssertionError(f"lm_head / embed_tokens tying is not {tied} after building the model")
    gen = torch.Generator(device=device).manual_seed(seed)
    _init_weights(model, p.family, gen, p.init_std)
    model.eval()

    kwargs: dict[str, Any] = {"max_shard_size": max_shard_size or p.max_shard_size}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    model.save_pretrained(str(out), **kwargs)
    n_params = sum(t.numel() for t in model.parameters())
    del model
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return n_params


def make_checkpoint(
    preset: str,
    outdir: str | Path,
    dtype: str | torch.dtype = "bf16",
    device: str | torch.device = "cuda",
    seed: int = 0,
    max_shard_size: str | None = None,
    verbose: bool = False,
    random_weights: bool = False,
    decisive: bool = False,
) -> Path:
    """Write a random-weight HF model directory for ``preset`` into ``outdir``; return its path.

    Args:
        preset: a key of :data:`PRESETS`.
        outdir: created if missing; existing weight files in it are overwritten.
        dtype: dtype of the stored weights (bf16, fp16, float32).
        device: where the weights are generated (cuda for the big presets).
        seed: seed of the weight generator (same seed + device + dtype -> same weights).
        max_shard_size: override of the preset's shard size (e.g. ``"500MB"``).
        random_weights: write no weights: config, tokenizer and ``synthetic.json`` with
            ``"random_weights": true``; infer's loader then generates the weights on its device at
            load time (src/infer/loader/synthetic.py). For models too big to write (qwen3-30b-a3b:
            61 GB); Hugging Face transformers cannot load such a directory.
        decisive: with ``random_weights``: weights whose greedy next token is decided by a wide logit
            margin (``"decisive": true``, :mod:`infer.loader.synthetic`), for benchmarks that replay a
            recorded greedy output (speculative decoding's replayed drafts, phase 12) in bf16.
    """
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if decisive and not random_weights:
        raise ValueError("decisive weights are generated at load time: use them with random_weights")
    p = PRESETS[preset]
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + list(out.glob("*.safetensors.index.json")):
        old.unlink()
    t0 = time.perf_counter()

    tok, ids = build_tokenizer(p.fields["vocab_size"], p.bos_token)
    tok.save(str(out / "tokenizer.json"))
    t_tok = time.perf_counter()

    cfg = _hf_config(p, ids, dtype)
    if random_weights:
        cfg.save_pretrained(str(out))
        n_params = None
    else:
        n_params = _write_weights(cfg, p, out, dtype, device, seed, max_shard_size)
    t_save = time.perf_counter()

    eos_ids = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    gen_cfg = GenerationConfig(
        bos_token_id=ids.get(p.bos_token) if p.bos_token else None,
        eos_token_id=eos_ids,
        pad_token_id=ids["<|pad|>"],
    )
    gen_cfg.save_pretrained(str(out))
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": p.bos_token,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "add_bos_token": p.bos_token is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": p.fields["max_position_embeddings"],
        "chat_template": CHATML_TEMPLATE,
        "additional_special_tokens": [s for s in CHATML_SPECIALS if s != "<|pad|>"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: tcfg[k] for k in ("bos_token", "eos_token", "pad_token") if tcfg[k]}, indent=2) + "\n"
    )
    (out / "synthetic.json").write_text(json.dumps({
        "preset": preset, "description": p.description, "family": p.family, "dtype": str(dtype).removeprefix("torch."),
        "device": str(device), "seed": seed, "num_params": n_params,
        "init_std": p.init_std, "note": "random weights; not a trained model",
        **({"random_weights": True, "note": "no weight files: infer generates random weights at load time"}
           if random_weights else {}),
        **({"decisive": True} if decisive else {}),
    }, indent=2) + "\n")
    if verbose:
        size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**30
        what = "random weights at load time" if n_params is None else f"{n_params / 1e6:.1f}M params, {size:.2f} GiB"
        print(f"{preset}: {what} in {out} (tokenizer {t_tok - t0:.1f}s, init + save {t_save - t_tok:.1f}s)",
              file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Write a random-weight Hugging Face checkpoint (config, safetensors, tokenizer) "
                    "at a real model's shapes.",
        epilog="presets: " + "; ".join(f"{k} ({v.description})" for k, v in PRESETS.items()),
    )
    ap.add_argument("preset", choices=sorted(PRESETS), metavar="PRESET", help="one of: " + ", ".join(PRESETS))
    ap.add_argument("outdir", type=Path, metavar="OUTDIR")
    ap.add_argument("--dtype", default="bf16", help="stored dtype: bf16 (default), fp16, float32")
    ap.add_argument("--device", default=None, help="where to generate the weights (default: cuda if available)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-shard-size", default=None, help="override the preset's shard size, e.g. 500MB")
    ap.add_argument("--random-weights", action="store_true",
                    help="write no weights (config, tokenizer, synthetic.json only): infer generates random "
                         "weights on its device at load time; for models too big to write (qwen3-30b-a3b)")
    ap.add_argument("--decisive", action="store_true",
                    help="with --random-weights: greedy next tokens decided by a wide logit margin, so bf16 "
                         "rounding never flips one (benchmarks/speculative.py's replayed drafts)")
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = make_checkpoint(a.preset, a.outdir, a.dtype, device, a.seed, a.max_shard_size, verbose=True,
                           random_weights=a.random_weights, decisive=a.decisive)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
