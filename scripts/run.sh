#!/usr/bin/env bash
# Set up (once) and run the main job: stream SmolLM2's answer to a sample chat prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
if [[ $# -eq 0 ]]; then
    set -- generate --chat --prompt "What is the capital of France?"
fi
exec .venv/bin/flashmemory "$@"
