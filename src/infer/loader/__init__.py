"""From a checkpoint on disk to a model on its device: :func:`load_model`.

Accepts a Hugging Face model directory, a ``.gguf`` file or a short name of a shipped model
(:mod:`infer.loader.registry`). The model is built on the ``meta`` device (no memory, no
random init), then each tensor is read, converted and copied straight to its device and
dtype, one at a time, so the host never holds a float32 copy of the whole model.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from infer.config import GGUF_WEIGHTS, ModelConfig, default_device, parse_dtype
from infer.errors import ModelLoadError
from infer.loader.quantized import QuantizedParams, resolve_scheme, scheme_from_hf_config
from infer.loader.registry import DEFAULT_MODEL, SHIPPED_MODELS, resolve_model
from infer.models import MODEL_CLASSES, CausalLM
from infer.models.quant import QuantizedLinear, QuantScheme, quantize_modules
from infer.models.quant import quantize_lm_head as quantize_lm_head_  # the parameter has its name
from infer.parallel.state import ParallelState, building_for, shard
from infer.tokenizer import Tokenizer

__all__ = ["DEFAULT_MODEL", "SHIPPED_MODELS", "LoadedModel", "ModelLoadError", "load_model", "read_model_config",
           "resolve_model"]

_log = logging.getLogger("infer")


@dataclass
class LoadedModel:
    """A model ready for a forward, with its tokenizer.

    Attributes:
        model: the :class:`~infer.models.layers.CausalLM` (eval mode, no grad).
        tokenizer: the :class:`~infer.tokenizer.Tokenizer`, or None when the directory has none.
        config: the :class:`~infer.config.ModelConfig`.
        path: the resolved file or directory.
        format: ``"gguf"`` or ``"hf"``.
        load_seconds: wall time of :func:`load_model`.
    """

    model: CausalLM
    tokenizer: Tokenizer | None
    config: ModelConfig
    path: Path
    format: str
    load_seconds: float = 0.0


@contextlib.contextmanager
def _skip_init():
    """Make ``torch.nn.init`` a no-op while the model is built on ``meta``.

    Random init is wasted work for weights that are about to be loaded; on ``meta`` it does no
    arithmetic but still routes every call through PyTorch's Python reference kernels, whose
    first use costs more than a second of imports (transformers' ``no_init_weights`` does the
    same).
    """
    names = ["normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_",
             "xavier_normal_", "zeros_", "ones_", "constant_"]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def _whole_model_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter of ``cfg``'s whole (unsharded) model, built on ``meta``."""
    with torch.device("meta"), _skip_init(), building_for(ParallelState()):
        return [(n, tuple(p.shape)) for n, p in MODEL_CLASSES[cfg.architecture](cfg).named_parameters()]


class _StackedParams:
    """Fills stacked parameters (an MoE layer's ``experts.gate_up_proj[E, 2I, H]``) from checkpoints
    that store one tensor per expert (``experts.{e}.gate_proj.weight``): each piece is copied into
    its slice of a tensor allocated on the device (see :mod:`infer.models.moe`)."""

    def __init__(self, model, expected: dict, device, dtype, source: Path) -> None:
        from infer.models.moe import per_expert_shard, stacked_checkpoint_slice

        self.model, self.expected, self.device, self.dtype, self.source = model, expected, device, dtype, source
        self.locate = stacked_checkpoint_slice
        self.piece_shard = per_expert_shard
        self.tensors: dict[str, torch.Tensor] = {}
        self.filled: dict[str, int] = {}  # elements written per stacked parameter

    def take(self, name: str, w) -> bool:
        where = self.locate(self.model, name)
        if where is None:
            return False
        param, index = where
        if not param:  # an expert held by another rank
            return True
        if param not in self.tensors:
            self.tensors[param] = torch.empty(self.expected[param], device=self.device, dtype=self.dtype)
            self.filled[param] = 0
        t = torch.as_tensor(w) if isinstance(w, torch.Tensor) else torch.from_numpy(np.require(w, requirements="W"))
        t = shard(t, self.piece_shard(self.model, name))  # tensor-parallel experts: this rank's rows
        dst = self.tensors[param][index]
        if tuple(t.shape) != tuple(dst.shape):
            raise ModelLoadError(self.source, f"tensor {name} has shape {tuple(t.shape)}, the config implies "
                                 f"{tuple(dst.shape)}")
        dst.copy_(t)
        self.filled[param] += t.numel()
        return True

    def finish(self, loaded: set[str]) -> dict[str, torch.Tensor]:
        for param, t in self.tensors.items():
            if param in loaded:
                raise ModelLoadError(self.source, f"{param} is stored both stacked and per expert")
            if self.filled[param] != t.numel():
                raise ModelLoadError(self.source, f"{param}: the per-expert tensors fill {self.filled[param]} of "
                                     f"its {t.numel()} elements (an expert is missing or repeated)")
        return self.tensors


def materialize(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, object]],
    device: torch.device,
    dtype: torch.dtype,
    source: Path,
    total: int | None = None,
    progress: bool = True,
    scheme: QuantScheme | None = None,
    layouts: dict[str, QuantScheme] | None = None,
) -> CausalLM:
    """Build the model on ``meta`` and fill it from ``(hf_name, array)`` pairs.

    With a quantization ``scheme`` (phase 11) the decoder's projections are built as
    :class:`~infer.models.quant.QuantizedLinear` and their tensors go through
    :class:`~infer.loader.quantized.QuantizedParams` (quantized as they load, or stored quantized). With
    ``layouts`` (``{module name: scheme}``: a GGUF served quantized) only those projections are, each in its own
    layout.

    Raises:
        ModelLoadError: for a missing tensor, an unexpected one, or a shape mismatch.
    """
    with torch.device("meta"), _skip_init():
        model = MODEL_CLASSES[cfg.architecture](cfg)
        if scheme is not None:
            try:
                quantize_modules(model, scheme, layouts)
            except ValueError as e:
                raise ModelLoadError(source, f"cannot quantize this model with {scheme.method}: {e}") from None
    quantized = QuantizedParams(model, scheme, device, dtype, source) if scheme is not None else None
    expected = {name: p.shape for name, p in model.named_parameters()}
    # tensor parallelism (phase 14): the piece of each tensor this rank keeps (infer.parallel.state.shard)
    shards = {name: getattr(p, "tp_shard", None) for name, p in model.named_parameters()}
    tied = cfg.tie_word_embeddings
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    bar = tqdm(tensors, total=total, desc=f"loading {source.name}", unit="tensor", disable=not progress,
               leave=False)
    stacked = _StackedParams(model, expected, device, dtype, source)  # MoE experts, one tensor per expert
    rename = getattr(model, "checkpoint_name", None)  # a model whose checkpoints name tensors differently
    for name, w in bar:
        if rename is not None and (name := rename(name)) is None:
            continue
        if tied and name == "lm_head.weight":
            continue
        if quantized is not None and quantized.take(name, w):
            continue
        if name not in expected:
            if stacked.take(name, w):
                continue
            if not name.endswith("rotary_emb.inv_freq"):
                unexpected.append(name)
            continue
        t = torch.as_tensor(w) if isinstance(w, torch.Tensor) else torch.from_numpy(np.require(w, requirements="W"))
        t = shard(t, shards[name])
        if tuple(t.shape) != tuple(expected[name]):
            raise ModelLoadError(
                source, f"tensor {name} has shape {tuple(t.shape)}, the config implies {tuple(expected[name])}"
            )
        # copy=True: never alias the (read-only) memory map of the checkpoint file
        state[name] = t.to(device=device, dtype=dtype, copy=True)
    if unexpected:
        raise ModelLoadError(source, f"unexpected tensors for {cfg.architecture}: {unexpected[:5]}")
    state.update(stacked.finish(set(state)))
    if quantized is not None:
        state.update(quantized.tensors)
    missing = sorted(set(expected) - set(state) - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise ModelLoadError(source, f"missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.to(device)  # the rope buffers; parameters are already there
    model.eval()
    model.requires_grad_(False)
    if scheme is not None:
        for m in model.modules():  # the layout of PyTorch's CPU kernels, or its CUDA int4 kernel's, made once (phase 11)
            if isinstance(m, QuantizedLinear) and torch.device(device).type == "cpu":
                if not m.fp8_activations:  # (W8A8 on the CPU runs the reference: no kernel layout)
                    m.cpu_packed()
            elif isinstance(m, QuantizedLinear) and m.method == "int4":
                m.tinygemm_packed()
    return model


def _gguf_layouts(types: dict[str, str], path: Path, gguf_weights: str, quantization: str) -> dict | None:
    """The projections a GGUF serves quantized (phase 11: ``gguf_weights``, :func:`load_model`), or None to
    dequantize every tensor.

    Raises:
        ModelLoadError: ``"quantized"`` beside an online ``quantization`` (the blocks would be quantized twice).
    """
    if gguf_weights == "dequantize":
        return None
    if quantization not in ("none", None):
        raise ModelLoadError(path, f"gguf_weights='quantized' serves the file's own blocks; quantization="
                             f"{quantization!r} would quantize its dequantized weights again: use one of them")
    from infer.loader.gguf_quant import gguf_layouts

    return gguf_layouts(types)


def _gguf_head(net: CausalLM, reader, cfg: ModelConfig, path: Path, device: torch.device) -> str:
    """``quantize_lm_head`` on a GGUF served quantized: the head in its GGUF type's layout; returns that type.

    Raises:
        ModelLoadError: the head's type has no quantized layout.
    """
    from infer.loader.gguf_quant import SERVED_TYPES, gguf_lm_head

    head, qtype = gguf_lm_head(reader, cfg, device)
    if head is None:
        raise ModelLoadError(path, f"quantize_lm_head: the LM head is stored as {qtype}, which infer cannot serve "
                             f"quantized (it serves {', '.join(SERVED_TYPES)}); use gguf_weights='dequantize' with an "
                             "online quantization, or leave the head in float")
    net.lm_head = head
    return qtype


def read_model_config(model: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint without loading its weights (``config.json`` or the
    GGUF header), e.g. to check a parallel layout before starting worker processes.

    Raises:
        ModelLoadError: as :func:`load_model`.
    """
    path = resolve_model(model)
    if path.is_dir():
        from infer.loader import hf

        return hf.model_config_from_dir(path)[0]
    from infer.loader import gguf as g

    reader = g.open_gguf(path)
    return g.model_config_from_gguf(g.read_metadata(reader), {t.name for t in reader.tensors}, path)


def load_model(
    model: str | Path = DEFAULT_MODEL,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
    quantization: str = "none",
    quantize_lm_head: bool = False,
    gguf_weights: str = "dequantize",
) -> LoadedModel:
    """Load a model and its tokenizer.

    Args:
        model: a short name (``smollm2-135m``, ``gemma3-270m``), a ``.gguf`` file, or a
            Hugging Face model directory (config.json + safetensors + tokenizer files).
        device: ``"cpu"``, ``"cuda"``...; default cuda when available.
        dtype: torch dtype or name; default float32 on CPU, bfloat16 on CUDA.
        progress: show a progress bar while tensors load.
        quantization: ``EngineConfig.quantization`` (phase 11): ``"none"`` loads the weights as stored (a
            pre-quantized checkpoint stays quantized); ``"int8"``, ``"fp8"``, ``"int4"`` quantize the
            decoder's projections as they load (:mod:`infer.loader.quantized`).
        quantize_lm_head: ``EngineConfig.quantize_lm_head``: also quantize the LM head, after loading, with
            the projections' scheme (:func:`~infer.models.quant.quantize_lm_head`); on a GGUF served quantized,
            in the layout of its own GGUF type (:func:`~infer.loader.gguf_quant.gguf_lm_head`).
        gguf_weights: ``EngineConfig.gguf_weights`` (phase 11; ignored for other checkpoints):
            ``"dequantize"`` every GGUF tensor to float (phase 0); ``"quantized"``: the decoder's Q8_0, Q4_0,
            Q4_1, Q4_K and Q6_K projections repacked into :class:`~infer.models.quant.QuantizedLinear` layouts
            (:mod:`infer.loader.gguf_quant`), the rest dequantized.

    Returns:
        A :class:`LoadedModel` (its ``model`` has no attention backend set yet; the engine
        chooses one, or call ``model.set_attention_backend``).

    Raises:
        ModelLoadError: naming the file and what is wrong with it.
        ValueError: an unknown ``gguf_weights``.
    """
    if gguf_weights not in GGUF_WEIGHTS:
        raise ValueError(f"gguf_weights must be one of {', '.join(GGUF_WEIGHTS)}, got {gguf_weights!r}")
    start = time.perf_counter()
    device = torch.device(device or default_device())
    dtype = parse_dtype(dtype, device)
    path = resolve_model(model)
    if path.is_dir():
        from infer.loader import hf

        cfg, raw = hf.model_config_from_dir(path)
        from infer.loader import synthetic

        spec = synthetic.random_weights_spec(path)
        files = hf.safetensors_files(path) if spec is None else []
        tokenizer = Tokenizer.from_dir(path, raw) if (path / "tokenizer.json").is_file() else None
        if not cfg.eos_token_ids and tokenizer is not None:
            cfg.eos_token_ids = list(tokenizer.eos_token_ids)
        if spec is not None:  # no weight files: random weights generated on the device
            tensors, total = synthetic.iter_random_tensors(cfg, spec, _whole_model_shapes(cfg), device, dtype), None
        else:
            tensors, total = hf.iter_safetensors(files), hf.count_tensors(files)
        scheme = resolve_scheme(quantization, scheme_from_hf_config(raw, path / "config.json"), path)
        net = materialize(cfg, tensors, device, dtype, path, total, progress, scheme)
        fmt = "hf"
    elif path.suffix == ".gguf" or path.is_file():
        from infer.loader import gguf as g

        reader = g.open_gguf(path)
        meta = g.read_metadata(reader)
        names = {t.name for t in reader.tensors}
        cfg = g.model_config_from_gguf(meta, names, path)
        tokenizer = g.gguf_tokenizer(meta, path)
        scheme = resolve_scheme(quantization, None, path)
        types = g.tensor_types(reader, cfg)
        layouts = _gguf_layouts(types, path, gguf_weights, quantization)
        if layouts is not None:
            from infer.loader.gguf_quant import GGUF_SCHEME

            scheme = GGUF_SCHEME if layouts else None
        net = materialize(cfg, g.iter_gguf_tensors(reader, cfg, path, layouts), device, dtype, path,
                          len(reader.tensors), progress, scheme,
                          {k: v for k, (_, v) in layouts.items()} if layouts is not None else None)
        factors = g.rope_freq_factors(reader)
        if factors is not None:
            net.inv_freq_full_attention = net.inv_freq_full_attention / torch.from_numpy(factors).to(device)
        fmt = "gguf"
        if layouts is not None:
            from infer.loader.gguf_quant import describe_gguf_weights

            head = _gguf_head(net, reader, cfg, path, device) if quantize_lm_head else None
            _log.info(describe_gguf_weights(types, layouts, head))
            quantize_lm_head = False  # done, in the layout of its GGUF type
    else:  # pragma: no cover
        raise ModelLoadError(path, "not a model directory or a .gguf file")
    if quantize_lm_head:
        if scheme is None:
            raise ModelLoadError(path, "quantize_lm_head needs a quantization: set quantization to int8, fp8 or "
                                 "int4, or load a pre-quantized checkpoint")
        quantize_lm_head_(net, scheme)
    return LoadedModel(net, tokenizer, cfg, path, fmt, time.perf_counter() - start)
