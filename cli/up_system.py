"""The processes `inferq up` starts (cli.up): each child's stop (SIGTERM, the hurry signal of
a second Ctrl-C, SIGKILL after its grace), the system's ordered stop, and the waits until the
children answer."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

STOP_TIMEOUT_S = 10.0  # the worker gets its drain timeout on top
HURRIED_STOP_TIMEOUT_S = 10.0  # after a second Ctrl-C: enough to hand jobs back, then SIGKILL
QUIET_STOP_S = 1.0  # a child that stops faster than this is stopped without a word


class UpError(Exception):
    """A start-up problem the user can fix (message says how)."""


def _die_with_parent() -> None:
    # Linux: a child gets SIGTERM if `inferq up` itself is killed, so none outlives it.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """A process this command started. `waits_for` says what a slow stop waits for;
    `hurry_signal` is what a second Ctrl-C sends it (None: it only gets its time); `grace_s`
    is how long its stop may take before SIGKILL."""

    name: str
    process: subprocess.Popen[bytes]
    waits_for: str
    hurry_signal: signal.Signals | None
    grace_s: float

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, hurried: Callable[[], bool]) -> int:
        """SIGTERM; once `hurried()`, the hurry signal (again every second, as signals sent
        close together merge); SIGKILL after `grace_s` (or sooner when hurried). Returns the
        exit code."""
        if not self.alive():
            return self.process.wait()
        self.process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        give_up = started + self.grace_s
        told = hurry_sent = 0.0
        while self.alive():
            now = time.monotonic()
            if not told and now - started >= QUIET_STOP_S and not hurried():
                print(f"inferq up: waiting for the {self.name}: {self.waits_for}", flush=True)
                told = now
            if hurried() and self.hurry_signal is not None and now - hurry_sent >= 1.0:
                if not hurry_sent:
                    print(f"inferq up: stopping the {self.name} now", flush=True)
                    give_up = min(give_up, now + HURRIED_STOP_TIMEOUT_S)
                self.process.send_signal(self.hurry_signal)
                hurry_sent = now
            if now >= give_up:
                print(f"inferq up: {self.name} did not stop in time; killing it", flush=True)
                self.process.kill()
                break
            time.sleep(0.05)
        return self.process.wait()


@dataclass
class System:
    """The children, and the signals received: the first stops everything in order, the
    second hurries whatever is still stopping."""

    children: list[Child] = field(default_factory=list)
    signals: int = 0

    def on_signal(self, signum: int, _frame: object) -> None:
        # only counts: printing from a signal handler can collide with a print it interrupted
        self.signals += 1

    @property
    def stopping(self) -> bool:
        return self.signals > 0

    def hurried(self) -> bool:
        return self.signals > 1

    def spawn(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        *,
        waits_for: str,
        hurry_signal: signal.Signals | None,
        grace_s: float = STOP_TIMEOUT_S,
    ) -> Child:
        preexec = _die_with_parent if sys.platform.startswith("linux") else None
        process = subprocess.Popen(args, env=env, start_new_session=True, preexec_fn=preexec)
        child = Child(name, process, waits_for, hurry_signal, grace_s)
        self.children.append(child)
        return child

    def dead(self) -> list[Child]:
        return [c for c in self.children if not c.alive()]

    def stop(self) -> None:
        """Newest first: worker (drains its jobs), batch controller, gRPC API, API, then the
        Redis server we started."""
        for child in reversed(self.children):
            code = child.stop(self.hurried)
            clean = (0, -signal.SIGTERM, -signal.SIGINT)
            how = "cleanly" if code in clean else f"with exit code {code}"
            print(f"inferq up: {child.name} stopped {how}", flush=True)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def wait_ready(
    system: System,
    base_url: str,
    timeout: float,
    want_worker: bool,
) -> None:
    """Until /ready (or /health without a worker) answers 200, a child dies, or Ctrl-C."""
    give_up = time.monotonic() + timeout
    last_note = time.monotonic()
    path = "/ready" if want_worker else "/health"
    with httpx.Client(base_url=base_url, timeout=2.0) as http:
        while time.monotonic() < give_up:
            if system.stopping:
                return
            if system.dead():
                names = ", ".join(c.name for c in system.dead())
                raise UpError(f"{names} exited during start-up (see its log above)")
            try:
                if http.get(path).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() - last_note > 15:
                print(
                    "inferq up: waiting for the API and the worker (it loads the model, after"
                    " building the CPU kernels where this machine has none yet: see its log) ..."
                )
                last_note = time.monotonic()
            time.sleep(0.25)
    raise UpError(f"{base_url}{path} did not answer 200 in {timeout:.0f} s (--ready-timeout)")


def wait_listening(system: System, host: str, port: int, timeout: float) -> None:
    """Until something accepts connections at host:port, a child dies, or Ctrl-C."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up and not system.stopping:
        if system.dead():
            names = ", ".join(c.name for c in system.dead())
            raise UpError(f"{names} exited during start-up (see its log above)")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.1)
    if not system.stopping:
        raise UpError(f"nothing listens on {host}:{port} after {timeout:.0f} s (--ready-timeout)")
