"""`python -m producer_api up|api ...`: the same as `inferq up` / `inferq api`."""

import sys

from producer_api import serve, up

_COMMANDS = {"up": up.main, "api": serve.main}

if len(sys.argv) < 2 or sys.argv[1] not in _COMMANDS:
    print("usage: python -m producer_api {up,api} [options]", file=sys.stderr)
    sys.exit(2)
sys.exit(_COMMANDS[sys.argv[1]](sys.argv[2:]))
