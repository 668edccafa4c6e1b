#!/usr/bin/env bash
# Installs whatever is missing (scripts/setup.sh), then talks to the default model.
#   bash scripts/serve.sh                      # interactive chat with smollm2-135m
#   bash scripts/serve.sh --model gemma3-270m  # arguments go to the program
# Once phase 2 lands this starts the OpenAI-compatible server (python -m infer.server);
# until then it runs the interactive generator.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${INFER_VENV:-.venv}/bin/activate"
if python -c "import infer.server" 2>/dev/null; then
    exec python -m infer.server "$@"
fi
if [ "$#" -eq 0 ]; then
    exec python -m infer.generate --chat
fi
exec python -m infer.generate "$@"
