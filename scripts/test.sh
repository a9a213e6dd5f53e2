#!/usr/bin/env bash
# Set up (once) and run the test suite. Extra arguments go to pytest (e.g. -k parity, -m "not slow").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec .venv/bin/python -m pytest -q "$@"
