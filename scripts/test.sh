#!/usr/bin/env bash
# Installs whatever is missing (scripts/setup.sh) and runs the full test suite.
#   bash scripts/test.sh            # everything (GPU-only tests skip on a CPU machine)
#   bash scripts/test.sh -k parity  # extra arguments go to pytest
#   INFER_TEST_WORKERS=1 bash scripts/test.sh   # one pytest process (default: one per core, at most 4)
# With more than one worker the files are spread over pytest-xdist's processes, one file at a time, the
# longest first (tests/conftest.py): on CI's 2 cores the tests take ~15 min instead of 20-22 (2026-11-26).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${INFER_VENV:-.venv}/bin/activate"
# the suite starts servers and clients beside pytest on two cores: its workers never spin (infer's own
# default is a short spin, src/infer/__init__.py)
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
workers="${INFER_TEST_WORKERS:-$(python -c 'import os; print(min(os.cpu_count() or 1, 4))')}"
if [ "$workers" -gt 1 ]; then
    exec python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
exec python -m pytest "$@"
