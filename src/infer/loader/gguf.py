"""Loading a single GGUF file (llama.cpp's format) through the ``gguf`` package.

A GGUF is a header of typed key/value metadata (architecture hyper-parameters, the
tokenizer's vocabulary, the chat template), a table of tensors (name, shape, quantization
type, offset) and the tensor data. Quantized tensors are stored in blocks (for example
Q4_1: 32 weights as 4-bit integers plus a float16 scale and minimum, 20 bytes); we
dequantize each tensor with ``gguf.quants.dequantize`` to float32 on the host, cast it to
the target dtype and move it to the device one tensor at a time. (Phase 11: with
``EngineConfig.gguf_weights`` ``quantized`` the decoder's Q8_0, Q4_0, Q4_1, Q4_K and Q6_K
projections are repacked into infer's quantized layouts instead: :mod:`infer.loader.gguf_quant`.)

Two conversions are needed to reach Hugging Face's weights (docs/phases/00-weights-to-logits.md):

* llama.cpp's converter permutes the rows of the Q and K projections of ``llama``
  checkpoints (it uses the interleaved-pairs RoPE layout, HF the rotate-half one); we undo it.
* Gemma stores its RMSNorm weights as ``1 + w``; we subtract 1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from infer.config import ModelConfig, RopeConfig
from infer.errors import ModelLoadError
from infer.loader.gguf_quant import repack
from infer.models.gemma3 import gemma3_layer_types
from infer.tokenizer import Tokenizer

try:  # the gguf package is a hard dependency; imported lazily for a clear error if missing
    import gguf
    from gguf import GGMLQuantizationType
except ImportError:  # pragma: no cover
    gguf = None

# Quantization types gguf.quants.dequantize handles that we accept.
SUPPORTED_TYPES = {
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # llama/qwen3: the pre-MLP norm; gemma3 overrides below
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class _Reader(gguf.GGUFReader if gguf else object):
    """``gguf.GGUFReader`` reading the header from a plain ndarray view of the memory map.

    The stock reader slices a ``numpy.memmap`` once per metadata item, and each slice pays
    memmap's subclass bookkeeping: 4.5 s for SmolLM2's 49k-token vocabulary on our CPU. Slicing
    a plain ``ndarray`` view of the same mapping gives identical values in a third of that.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        dt = np.dtype(dtype)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: Path):
    """Parse a GGUF header.

    Raises:
        ModelLoadError: when the file is missing, truncated or not a GGUF.
    """
    if gguf is None:  # pragma: no cover
        raise ModelLoadError(path, "the 'gguf' package is not installed: pip install gguf")
    if not path.is_file():
        raise ModelLoadError(path, "file not found")
    try:
        try:
            return _Reader(path)
        except AttributeError:  # a gguf release whose reader internals differ
            return gguf.GGUFReader(path)
    except (ValueError, KeyError, IndexError, OverflowError, TypeError) as e:
        size = path.stat().st_size
        raise ModelLoadError(path, f"not a valid GGUF file ({size} bytes; {e})") from None


def _field_value(field) -> Any:
    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        sub = types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]][0].item()


def read_metadata(reader) -> dict[str, Any]:
    """Every metadata key as a Python value (arrays as lists)."""
    return {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def _need(meta: dict[str, Any], key: str, source: Path) -> Any:
    if key not in meta:
        raise ModelLoadError(source, f"required metadata key {key!r} is missing")
    return meta[key]


def model_config_from_gguf(meta: dict[str, Any], tensor_names: set[str], source: Path) -> ModelConfig:
    """Architecture hyper-parameters from GGUF metadata.

    Raises:
        ModelLoadError: for an unsupported architecture or a missing key.
    """
    arch = _need(meta, "general.architecture", source)
    if arch not in ("llama", "qwen3", "gemma3"):
        raise ModelLoadError(source, f"unsupported architecture {arch!r} (supported: llama, qwen3, gemma3)")

    def k(name: str, default: Any = ...) -> Any:
        key = f"{arch}.{name}"
        if key in meta:
            return meta[key]
        if default is ...:
            raise ModelLoadError(source, f"required metadata key {key!r} is missing")
        return default

    hidden = int(k("embedding_length"))
    heads = int(k("attention.head_count"))
    head_dim = int(k("attention.key_length", hidden // heads))
    n_layers = int(k("block_count"))
    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or int(k("vocab_size"))
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(k("feed_forward_length")),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(k("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(k("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(k("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_gguf_eos_ids(meta),
    )
    theta = float(k("rope.freq_base", 10000.0))
    scaling = None
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    rope = RopeConfig(theta=theta, scaling=scaling)
    if arch == "gemma3":
        return ModelConfig(
            architecture="gemma3",
            **common,
            rope=rope,
            rope_local=RopeConfig(theta=10000.0),
            hidden_act="gelu_pytorch_tanh",
            qk_norm=True,
            norm_unit_offset=True,
            embedding_scale=hidden**0.5,
            attention_scale=head_dim**-0.5,
            layer_types=gemma3_layer_types(n_layers),
            sliding_window=int(k("attention.sliding_window", 4096)),
        )
    return ModelConfig(architecture=arch, **common, rope=rope, qk_norm=arch == "qwen3")


def _gguf_eos_ids(meta: dict[str, Any]) -> list[int]:
    ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if meta.get(key) is not None:
            ids.append(int(meta[key]))
    return list(dict.fromkeys(ids))


def hf_name(gguf_name: str, arch: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors HF has no use for."""
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        table = _GEMMA3_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES
        if part not in table:
            return None
        return f"model.layers.{idx}.{table[part]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    return None  # e.g. rope_freqs (handled separately)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q or K projection (``[n_head * head_dim, in]``; an ndarray or a
    tensor, whose rows may be any per-row data: repacked codes, scales).

    llama.cpp's converter reorders each head's rows from rotate-half order (HF: pairs
    ``(i, i + d/2)``) to interleaved order (pairs ``(2i, 2i + 1)``); this is the inverse.
    """
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_tensors(reader, cfg: ModelConfig, source: Path,
                      layouts: dict[str, Any] | None = None) -> Iterator[tuple[str, Any]]:
    """Yield ``(hf_name, float32 ndarray)`` for every tensor the model needs, converted.

    With ``layouts`` (phase 11, :func:`infer.loader.gguf_quant.gguf_layouts`: the projections served quantized,
    by module name) those projections' blocks are not dequantized: each yields its repacked tensors instead,
    ``(module + ".qweight", tensor)``, ``".weight_scale"`` and, for Q4_1 / Q4_K, ``".weight_zero_point"``
    (:func:`infer.loader.gguf_quant.repack`; the rows of Llama's Q and K unpermuted alike).

    Raises:
        ModelLoadError: for a quantization type we cannot dequantize or a truncated tensor.
    """
    arch = cfg.architecture
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        qtype = GGMLQuantizationType(t.tensor_type).name
        if qtype not in SUPPORTED_TYPES:
            raise ModelLoadError(
                source, f"tensor {t.name} has unsupported GGUF type {qtype} (supported: {sorted(SUPPORTED_TYPES)})"
            )
        qk = arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight"))
        heads = cfg.num_heads if "q_proj" in name else cfg.num_kv_heads
        if layouts and (prefix := name.removesuffix(".weight")) in layouts:
            try:
                parts = repack(t.data, qtype)
            except ValueError as e:
                raise ModelLoadError(source, f"cannot repack tensor {t.name} ({qtype}): {e}") from None
            for leaf, v in parts.items():  # a row permutation moves each row's codes, scales and zero points
                yield f"{prefix}.{leaf}", unpermute_qk(v, heads) if qk else v
            continue
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:  # numpy reshape errors on truncated data, NotImplementedError, ...
            raise ModelLoadError(source, f"cannot dequantize tensor {t.name} ({qtype}): {e}") from None
        w = np.asarray(w, dtype=np.float32)
        if qk:
            w = unpermute_qk(w, heads)
        if arch == "gemma3" and "norm.weight" in name:
            w = w - 1.0
        yield name, w


def tensor_types(reader, cfg: ModelConfig) -> dict[str, str]:
    """The GGUF type (``"Q4_K"``, ``"F32"``, ...) of every tensor the model loads, by Hugging Face name."""
    return {name: GGMLQuantizationType(t.tensor_type).name for t in reader.tensors
            if (name := hf_name(t.name, cfg.architecture)) is not None}


def rope_freq_factors(reader) -> np.ndarray | None:
    """llama.cpp's ``rope_freqs.weight`` (Llama 3.1 scaling baked into per-frequency divisors)."""
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    return None


# ----------------------------------------------------------------------------- tokenizer cache

TOKENIZER_CACHE_VERSION = 2  # 2: SentencePiece user-defined pieces matched after normalization


def cache_dir() -> Path:
    """``$INFER_CACHE_DIR`` or ``~/.cache/infer``."""
    return Path(os.environ.get("INFER_CACHE_DIR", Path.home() / ".cache" / "infer"))


def cached_path(source: Path, what: str) -> Path:
    """A cache file for ``source`` that changes whenever the file does (name, size, mtime)."""
    st = source.stat()
    key = f"{source.name}-{st.st_size}-{st.st_mtime_ns}-v{TOKENIZER_CACHE_VERSION}"
    return cache_dir() / "gguf" / key / what


def gguf_tokenizer(meta: dict[str, Any], source: Path) -> Tokenizer:
    """The file's tokenizer, from the cache when it was built before."""
    from tokenizers import Tokenizer as Backend

    from infer.loader.gguf_tokenizer import build_tokenizer

    cache = cached_path(source, "tokenizer.json")
    backend = None
    if cache.is_file():
        try:
            backend = Backend.from_file(str(cache))
        except Exception:
            backend = None
    if backend is None:
        backend = build_tokenizer(meta, str(source))
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".tmp{os.getpid()}")
            backend.save(str(tmp))
            os.replace(tmp, cache)
        except OSError:
            pass  # a read-only home is fine: we just rebuild next time
    tokens = meta["tokenizer.ggml.tokens"]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = meta.get("tokenizer.ggml.model") == "llama"  # llama.cpp's default for SPM
    specials = {
        name: tokens[meta[key]] if meta.get(key) is not None and meta[key] < len(tokens) else None
        for name, key in (
            ("bos_token", "tokenizer.ggml.bos_token_id"),
            ("eos_token", "tokenizer.ggml.eos_token_id"),
            ("pad_token", "tokenizer.ggml.padding_token_id"),
            ("unk_token", "tokenizer.ggml.unknown_token_id"),
        )
    }
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=_gguf_eos_ids(meta),
        add_bos_token=bool(add_bos),
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens=specials,
    )

