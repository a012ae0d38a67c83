#!/usr/bin/env bash
# Run the main job on the default model. Until `inferq up` (API + worker + Redis) lands this
# greets the default model offline; extra arguments go to `inferq generate`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
INFERQ_EXTRAS="${INFERQ_EXTRAS:-test}" source "$ROOT/scripts/env.sh"
inferq model pull >/dev/null
if [ "$#" -eq 0 ]; then set -- --chat "Hello! What can you do?"; fi
exec inferq generate "$@"
