"""Who holds a batch's lease, in its token: a controller process on the same host (and PID
namespace) as a restarted one can tell its predecessor died, and the batch need not wait out the
lease (`batch_lease_s`) before a new run takes it over.

The token is `<host>/<pid namespace>/<pid>/<random>`. Only a holder on this host, in this PID
namespace, whose process no longer exists counts as dead; anything else (another host, another
container, a reused PID, a token of another form) waits for the lease as before."""

from __future__ import annotations

import os
import secrets
import socket


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "-"


def holder_token() -> str:
    """A fresh lease token naming this process."""
    return f"{socket.gethostname()}/{_pid_namespace()}/{os.getpid()}/{secrets.token_hex(8)}"


def holder_known_dead(token: str) -> bool:
    """Whether the token's holder is a process of this host and PID namespace that has exited."""
    parts = token.split("/")
    if len(parts) != 4 or not parts[2].isdigit():
        return False
    host, namespace, pid = parts[0], parts[1], int(parts[2])
    if host != socket.gethostname() or namespace != _pid_namespace() or namespace == "-":
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, another user's
        return False
    return False
