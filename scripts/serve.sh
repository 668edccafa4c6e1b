#!/usr/bin/env bash
# Installs whatever is missing (scripts/setup.sh), then serves the default model (smollm2-135m)
# over the OpenAI-compatible API on http://127.0.0.1:8000.
#   bash scripts/serve.sh                                 # defaults
#   bash scripts/serve.sh --model gemma3-270m --port 8001 # arguments go to python -m infer.server
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${INFER_VENV:-.venv}/bin/activate"
exec python -m infer.server "$@"
