"""Random weights generated at load time, for model directories that hold no weight files.

``scripts/make_synthetic_checkpoint.py PRESET DIR --random-weights`` writes a model directory with
``config.json``, the tokenizer files and ``synthetic.json`` (``"random_weights": true``), but no
safetensors: Qwen3-30B-A3B's 61 GB of bf16 would not fit next to anything else on a 64 GB disk,
and generating them on the GPU takes seconds where writing and reading them back takes minutes.
:func:`infer.loader.load_model` then generates each tensor on the device, in the model dtype, with
the statistics the script gives written checkpoints: every matrix ``N(0, init_std)``; RMSNorm
weights ``1 + N(0, 0.05)`` (``N(0, 0.1)`` for Gemma's ``(1 + w)`` form). A fixed seed gives the same
weights on the same device and dtype. Only benchmarks use this: a model that was never written
cannot be compared against Hugging Face transformers.

``"decisive": true`` (the script's ``--decisive``) makes greedy decoding robust to rounding. Plain random
weights give nearly flat logits over the vocabulary, so the top two are often within bf16's rounding of
each other, and two computations of the same token that round differently (a one-token decode step and
a speculative verify step of ``k + 1`` rows, phase 12) pick different tokens. Here every layer's output
projection (``o_proj``, ``down_proj``, ``out_proj``) is scaled by :data:`DECISIVE_RESIDUAL_SCALE`, so the
residual stream stays the current token's embedding, and an untied LM head is the embedding's rows in a
random order: the next token is a fixed function of the current one, ``argmax_s <e_t, e_sigma(s)>`` (a tied
head repeats the token), with a margin of ~``sqrt(hidden_size)`` standard deviations of the other logits.
The cost of a forward is unchanged (the same shapes); only the values differ.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from infer.config import ModelConfig
from infer.errors import ModelLoadError


def random_weights_spec(path: Path) -> dict[str, Any] | None:
    """``synthetic.json`` of a directory whose weights are to be generated, else None."""
    f = path / "synthetic.json"
    if not f.is_file():
        return None
    try:
        spec = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f, f"not valid JSON ({e})") from None
    return spec if isinstance(spec, dict) and spec.get("random_weights") else None


#: ``"decisive": true``: the factor on each layer's output projection (the residual stream's contributions
#: stay ~1e-3 of the embedding's over 36 layers at std 0.02)
DECISIVE_RESIDUAL_SCALE = 1e-4
_OUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")


def iter_random_tensors(cfg: ModelConfig, spec: dict[str, Any], shapes: list[tuple[str, tuple[int, ...]]],
                        device: torch.device, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every parameter of ``cfg``'s model, generated on ``device`` in ``dtype``.

    ``shapes``: ``(name, shape)`` of each parameter of the *whole* model (a tensor-parallel rank
    generates every tensor whole, with the same seed as the others, and keeps its piece:
    :func:`infer.parallel.state.shard`).
    """
    std = float(spec.get("init_std", 0.02))
    decisive = bool(spec.get("decisive", False))
    gen = torch.Generator(device=device).manual_seed(int(spec.get("seed", 0)))
    embedding = None
    for name, shape in shapes:
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if decisive and name == "lm_head.weight" and embedding is not None and embedding.shape == shape:
            order = torch.randperm(shape[0], generator=gen, device=device)
            yield name, embedding[order]
            continue
        w = torch.empty(shape, device=device, dtype=dtype)
        if name.endswith("A_log"):  # Gated DeltaNet's decay (phase 17): A in [0.01, 2], as the script does
            w.uniform_(0.01, 2.0, generator=gen).log_()
        elif name.endswith("dt_bias"):
            w.normal_(-1.0, 0.5, generator=gen)
        elif len(shape) == 1 and "linear_attn.norm" in name:  # its output norm multiplies by w, not (1 + w)
            w.normal_(1.0, 0.05, generator=gen)
        elif len(shape) == 1 and "norm" in name:
            w.normal_(0.0, 0.1, generator=gen) if cfg.norm_unit_offset else w.normal_(1.0, 0.05, generator=gen)
        else:
            w.normal_(0.0, std * (DECISIVE_RESIDUAL_SCALE if decisive and name.endswith(_OUT_PROJECTIONS) else 1.0),
                      generator=gen)
        if decisive and name.endswith("embed_tokens.weight"):
            embedding = w
        yield name, w

