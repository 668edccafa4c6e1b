"""Loading a Hugging Face model directory.

Reads ``config.json`` (architecture), ``*.safetensors`` (one file, or shards listed in
``model.safetensors.index.json``), and the tokenizer files. safetensors is a JSON header
(name -> dtype, shape, byte range) followed by raw little-endian tensor data, so each tensor
is memory-mapped and copied once, straight to its device and dtype.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from infer.config import ModelConfig
from infer.errors import ModelLoadError
from infer.models import ARCHITECTURES, HF_CLASS_NAMES


def read_config(path: Path) -> dict[str, Any]:
    """``config.json`` of a model directory as a dict.

    Raises:
        ModelLoadError: when it is missing or not valid JSON.
    """
    f = path / "config.json"
    if not f.is_file():
        raise ModelLoadError(f, "file not found (a Hugging Face model directory needs config.json)")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f, f"not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f, "expected a JSON object")
    return cfg


def model_type_of(cfg: dict[str, Any], source: Path) -> str:
    """The key into :data:`infer.models.ARCHITECTURES`.

    Raises:
        ModelLoadError: for an architecture infer does not implement.
    """
    mt = cfg.get("model_type")
    for cls_name in cfg.get("architectures") or []:
        if cls_name in HF_CLASS_NAMES:
            return HF_CLASS_NAMES[cls_name]
    if mt == "gemma3" and "text_config" not in cfg:
        mt = "gemma3_text"
    if mt not in ARCHITECTURES:
        supported = ", ".join(sorted(ARCHITECTURES))
        what = mt or (cfg.get("architectures") or ["<none>"])[0]
        raise ModelLoadError(source, f"unsupported architecture {what!r} (supported model_type: {supported})")
    return mt


def model_config_from_dir(path: Path) -> tuple[ModelConfig, dict[str, Any]]:
    raw = read_config(path)
    source = path / "config.json"
    parse = ARCHITECTURES[model_type_of(raw, source)][1]
    return parse(raw, str(source)), raw


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a directory, shards in index order.

    Raises:
        ModelLoadError: when there is none, or the index names a missing shard.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
            raise ModelLoadError(index, f"not a valid safetensors index ({e})") from None
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f, "shard listed in model.safetensors.index.json not found")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "no *.safetensors weights found")
    return files


def count_tensors(files: list[Path]) -> int:
    n = 0
    for f in files:
        with _open(f) as st:
            n += len(list(st.keys()))
    return n


def _open(f: Path):
    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise ModelLoadError(f, f"not a valid safetensors file ({e})") from None


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` (memory-mapped, in the stored dtype) from every file.

    Raises:
        ModelLoadError: naming the file, when it is truncated or corrupt.
    """
    for f in files:
        with _open(f) as st:
            for name in st.keys():
                try:
                    yield name, st.get_tensor(name)
                except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                    raise ModelLoadError(f, f"cannot read tensor {name!r} ({e})") from None
