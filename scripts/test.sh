#!/usr/bin/env bash
# Run the test suite on a fresh or prepared machine: venv, redis-server, default model, pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow`). `--all` first: the fast
# suite, then the slow one (end-to-end through the API on the real model), as CI runs them.
set -euo pipefail
all=0
if [ "${1:-}" = "--all" ]; then
  all=1
  shift
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# Tests start their own redis-server (they kill and restart it), so the binary must exist; the
# dashboard test renders the page in headless Chromium (Debian's `chromium` package).
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ "${#missing[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
source "$ROOT/scripts/env.sh"
ruff check --quiet .
ruff format --check --quiet .
mypy engine/outputs.py redis_io/ worker/ schemas/
inferq model pull >/dev/null
# Tests run the engine in several processes at once (pytest, worker subprocesses) on few cores:
# spinning OpenMP threads then starve each other, passive waiting keeps every step fast.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
if [ "$all" -eq 0 ]; then
  exec pytest -q -p no:cacheprovider "$@"
fi
started=$SECONDS
pytest -q -p no:cacheprovider "$@"
echo "fast suite: $((SECONDS - started)) s"
started=$SECONDS
pytest -q -p no:cacheprovider -m slow --durations=15 "$@"
echo "slow suite: $((SECONDS - started)) s"
