"""A compared system's process, seen from bench/engine/vs_vllm.py: started with the job file, told
`round` on stdin, answering on the stdout line that starts with peer_timing.MARKER; the rest of
its output is its own logging, kept in a log file and shown when it fails."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from bench.engine.peers.peer_timing import MARKER

logger = logging.getLogger("bench.vs_vllm")

SETTLE_S = 1.0  # lets the side that just ran park its threads before the other side is timed


class PeerFailed(RuntimeError):
    """A peer process exited or answered with an error; the message carries its log's tail."""


@dataclass
class Peer:
    """One system's process: started with the job file, told `round`, answering in lines."""

    name: str
    command: list[str]
    env: dict[str, str]
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)
    runs: list[dict[str, float]] = field(default_factory=list)
    _process: subprocess.Popen[str] | None = None
    _log: IO[str] | None = None

    def start(self) -> None:
        self._log = self.log_path.open("w")
        self._process = subprocess.Popen(
            self.command,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        ready = self._answer("ready")
        self.info = ready["info"]
        logger.info(
            "%s ready: load %.1f s, warm-up %.1f s",
            self.name,
            self.info["load_s"],
            ready["warmup_s"],
        )

    def run_round(self) -> dict[str, float]:
        process = self._require_process()
        assert process.stdin is not None
        process.stdin.write("round\n")
        process.stdin.flush()
        answer = self._answer("round")
        answer.pop("kind")
        self.runs.append(answer)
        return answer

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            try:
                assert self._process.stdin is not None
                self._process.stdin.write("quit\n")
                self._process.stdin.close()
                self._process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _require_process(self) -> subprocess.Popen[str]:
        if self._process is None:
            raise PeerFailed(f"{self.name} was not started")
        return self._process

    def _answer(self, kind: str) -> dict[str, Any]:
        """Read lines until the peer's answer; the rest is its own logging, kept in the log."""
        process = self._require_process()
        assert process.stdout is not None and self._log is not None
        for line in process.stdout:
            if line.startswith(MARKER):
                answer = json.loads(line[len(MARKER) :])
                if answer["kind"] == kind:
                    return answer
                line = f"unexpected answer: {line}"
            self._log.write(line)
            self._log.flush()
        process.wait()
        raise PeerFailed(
            f"{self.name} exited with status {process.returncode}; the end of its log "
            f"({self.log_path}):\n{_tail(self.log_path)}"
        )


def _tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_rounds(peers: list[Peer], rounds: int) -> dict[str, str]:
    """Start every peer, then alternate rounds between them; a peer that fails drops out and
    the others go on. Returns the failures by peer name."""
    failures: dict[str, str] = {}
    live: list[Peer] = []
    for peer in peers:
        try:
            peer.start()
            live.append(peer)
        except PeerFailed as exc:
            failures[peer.name] = str(exc)
            peer.stop()
    try:
        for round_index in range(rounds):
            for peer in list(live):
                time.sleep(SETTLE_S)
                try:
                    run = peer.run_round()
                except PeerFailed as exc:
                    failures[peer.name] = str(exc)
                    live.remove(peer)
                    continue
                logger.info(
                    "round %d %s: %.1f output tok/s, %.2f ms/token",
                    round_index + 1,
                    peer.name,
                    run["output_tok_s"],
                    run["decode_ms_per_token"],
                )
    finally:
        for peer in peers:
            peer.stop()
    return failures
