#!/usr/bin/env bash
# The main job: Redis (started here when none answers at INFERQ_REDIS_URL), the HTTP API and one
# worker on the default model. Ctrl-C stops all three. Extra arguments go to `inferq up`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi
source "$ROOT/scripts/env.sh"
inferq model pull >/dev/null
exec inferq up "$@"
