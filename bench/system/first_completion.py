"""Seconds to the first completion: a stack's first start from a checkout, then workers restarted
after a SIGKILL.

    python bench/system/first_completion.py [--repo PATH] [--python PATH] [--restarts 2]

Starts `inferq up --no-worker --no-grpc` from the checkout (its Redis on a free port, the API and
the batch controller), then an `inferq worker` on the default model, and times from the
worker's spawn to the first `/v1/completions` answer (greedy, 8 tokens); then SIGKILLs the
worker and times a fresh one the same way, --restarts times. Run it after `bash scripts/test.sh`
(or scripts/env.sh) on a fresh clone for the first start `bash scripts/run.sh` gives: the CPU
kernels are built then, and the first start pays for the model's unpacking and the start-up
measurements a machine keeps. The worker's own log lines give its phases (start of the process,
kernels loaded, engine ready), printed beside each figure.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
PHASES = {  # log line -> phase name
    "cpu runtime:": "process up",
    "CPU kernels ready": "kernels loaded",
    "engine ready": "engine ready",
    "worker_started": "worker serving",
}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def first_completion(http: httpx.Client, deadline: float) -> None:
    """Until one completion answers 200 (the API says 503 while no worker serves the model)."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
    body["temperature"] = 0
    while time.monotonic() < deadline:
        try:
            if http.post("/v1/completions", json=body).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError("no completion before the deadline")


def phases(log: Path, spawned: datetime) -> str:
    """Each phase's seconds after the spawn, from the worker's log lines."""
    seen: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        stamp = STAMP.match(line)
        if not stamp:
            continue
        for marker, phase in PHASES.items():
            if marker in line and phase not in seen:
                at = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f")
                seen[phase] = (at - spawned).total_seconds()
    return ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in seen.items())


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to start")
    parser.add_argument("--python", default=sys.executable, help="its venv's python")
    parser.add_argument("--restarts", type=int, default=2, help="workers killed and restarted")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per start")
    args = parser.parse_args()
    repo = args.repo.resolve()
    workdir = Path(tempfile.mkdtemp(prefix="inferq-first-"))
    port = free_port()
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    env = {**os.environ, "PYTHONPATH": str(repo), "INFERQ_REDIS_URL": redis_url}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cli = [args.python, "-m", "cli"]
    up_args = ["up", "--no-worker", "--no-grpc", "--port", str(port)]
    up_args += ["--data-dir", str(workdir / "redis")]
    with (workdir / "up.log").open("w") as up_log:
        up = subprocess.Popen(
            [*cli, *up_args], cwd=repo, env=env, stdout=up_log, stderr=subprocess.STDOUT
        )
    worker: subprocess.Popen[bytes] | None = None
    figures: list[tuple[str, float, str]] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            deadline = time.monotonic() + args.timeout
            while True:
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if up.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the API did not come up: see {workdir / 'up.log'}")
                time.sleep(0.2)
            for run in range(args.restarts + 1):
                label = "first start" if run == 0 else f"restart {run} after SIGKILL"
                log = workdir / f"worker-{run}.log"
                worker_args = [*cli, "--log-level", "info", "worker", "--model", MODEL]
                spawned_at, started = datetime.now(), time.monotonic()
                with log.open("w") as out:
                    worker = subprocess.Popen(
                        worker_args, cwd=repo, env=env, stdout=out, stderr=subprocess.STDOUT
                    )
                first_completion(http, started + args.timeout)
                seconds = time.monotonic() - started
                figures.append((label, seconds, phases(log, spawned_at)))
                print(f"{label}: first completion {seconds:.1f} s ({figures[-1][2]})", flush=True)
                worker.send_signal(signal.SIGKILL)
                worker.wait()
                worker = None
    finally:
        if worker is not None:
            worker.kill()
            worker.wait()
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
    print(f"\n{'start':<26} {'first completion s':>18}  worker phases (s after spawn)")
    for label, seconds, phase_text in figures:
        print(f"{label:<26} {seconds:>18.1f}  {phase_text}")
    print(f"logs: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
