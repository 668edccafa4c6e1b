#!/usr/bin/env bash
# Installs whatever is missing (scripts/setup.sh) and runs the full test suite.
#   bash scripts/test.sh            # everything (GPU-only tests skip on a CPU machine)
#   bash scripts/test.sh -k parity  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${INFER_VENV:-.venv}/bin/activate"
# the suite starts servers and clients beside pytest on two cores: its workers never spin (infer's own
# default is a short spin, src/infer/__init__.py)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec python -m pytest "$@"
