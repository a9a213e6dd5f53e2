#!/usr/bin/env bash
# Install the optional llama.cpp peer of `flashmemory bench` (llama-cpp-python) into .venv.
# It compiles llama.cpp from source: about 10-20 minutes on a 2-core machine. Never part of the test command.
# After it, `flashmemory bench` measures the llamacpp-* engines (f16 / q8_0 / q4_0 KV, flash attention on/off)
# with OpenMP's default wait policy (the torch engines run PASSIVE) and the same thread count as the other engines
# (recorded in the report); `flashmemory bench --decode-only` compares decode speed with it side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${FLASHMEMORY_VENV:-.venv}"
# A CPU build; pass CMAKE_ARGS="-DGGML_CUDA=on" for CUDA. GGML_NATIVE tunes for this CPU (AVX2 etc.).
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
echo "install_llama_cpp: building llama-cpp-python (CMAKE_ARGS=$CMAKE_ARGS), 10-20 min" >&2
# The same requirement as the `llama-cpp` extra of pyproject.toml (installed alone: the project stays editable).
"$VENV/bin/python" -m pip install --disable-pip-version-check "llama-cpp-python>=0.3.0"
"$VENV/bin/python" - <<'PY'
import llama_cpp
import torch

print(f"llama-cpp-python {llama_cpp.__version__} installed; torch still {torch.__version__}")
PY
