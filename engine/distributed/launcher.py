"""Start the executor ranks of a replica, and take the whole replica down when one dies.

The process that builds the engine is rank 0, the driver. Unless torchrun (or another launcher)
already set RANK and WORLD_SIZE, it starts ranks 1..N-1 itself as subprocesses
(`python -m engine.distributed.executor`), which join it through a rendezvous on a free local
port. From then on:

- a watchdog thread in the driver polls the executors; one that exits unbidden takes the driver
  down at once (exit status 1), so a worker's jobs stay unacknowledged and another worker
  reclaims them, as with any crashed worker;
- an error inside a tensor-parallel step is fatal too (the ranks no longer agree on what runs);
- every executor watches its parent and exits when the driver is gone;
- at exit the driver tells the executors to stop and waits for them (then kills stragglers).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.group import (
    Rendezvous,
    TensorParallel,
    init_tensor_parallel,
    launched_by_torchrun,
)
from engine.distributed.step_channel import StepSender

logger = logging.getLogger(__name__)

_POLL_S = 0.2
_STOP_WAIT_S = 10.0
# Thread binding set for a process that owns every core; ranks sharing a host must not inherit it.
_BINDING_VARS = ("OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY", "GOMP_CPU_AFFINITY")


def threads_per_rank(config: EngineConfig, device: torch.device) -> int | None:
    """CPU threads of each rank: num_threads if set; 1 under tensor parallelism on the CPU
    (ranks sharing a host must not oversubscribe it); None: torch's default."""
    if config.num_threads:
        return config.num_threads
    if config.tensor_parallel_size > 1 and device.type == "cpu":
        return 1
    return None


@dataclass
class RankProcesses:
    """The executor subprocesses the driver started (none when torchrun started them), the
    watchdog over them, and the replica's stop."""

    processes: list[subprocess.Popen[bytes]]
    sender: StepSender | None = None
    stopping: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def watch(self) -> None:
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while not self.stopping:
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                if code is not None and not self.stopping:
                    logger.error(
                        "tensor-parallel rank %d exited (status %s); taking the replica down",
                        rank,
                        code,
                    )
                    self.kill()
                    os._exit(1)
            time.sleep(_POLL_S)

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()

    def stop(self) -> None:
        """Tell the executors to stop, wait for them, kill what is left."""
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
        if self.sender is not None:
            try:
                self.sender.shutdown()
            except Exception as error:  # the executors are gone already
                logger.warning("could not tell the executors to stop: %s", error)
        deadline = time.monotonic() + _STOP_WAIT_S
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
        if dist.is_initialized():  # a later replica in this process starts a group of its own
            dist.destroy_process_group()
        logger.info("tensor-parallel executors stopped")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_executors(
    config: EngineConfig, model_path: Path | None, rendezvous: Rendezvous, threads: int | None
) -> RankProcesses:
    arguments = ["--config", json.dumps(asdict(config))]
    if model_path is not None:
        arguments += ["--model-path", str(model_path)]
    processes = []
    for rank in range(1, rendezvous.world_size):
        env = {k: v for k, v in os.environ.items() if k not in _BINDING_VARS}
        env.update(
            Rendezvous(
                rendezvous.master_addr, rendezvous.master_port, rank, rendezvous.world_size
            ).env()
        )
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        command = [sys.executable, "-m", "engine.distributed.executor", *arguments]
        processes.append(subprocess.Popen(command, env=env))
    return RankProcesses(processes)


def join_replica(
    config: EngineConfig, model_path: Path | None, device: torch.device
) -> tuple[TensorParallel, RankProcesses | None]:
    """Join this process's replica: as the rank torchrun's environment names, else as the
    driver of ranks it starts itself. A driver gets the RankProcesses that stop the replica
    (at exit, or when told); an executor None."""
    if launched_by_torchrun():
        tp = init_tensor_parallel(Rendezvous.from_env(), config.tensor_parallel_size, device)
        if not tp.is_driver:
            return tp, None
        outside = RankProcesses([])  # the ranks are torchrun's; the driver still says "stop"
        atexit.register(outside.stop)
        return tp, outside
    rendezvous = Rendezvous("127.0.0.1", _free_port(), 0, config.tensor_parallel_size)
    ranks = spawn_executors(config, model_path, rendezvous, threads_per_rank(config, device))
    ranks.watch()
    try:
        tp = init_tensor_parallel(rendezvous, config.tensor_parallel_size, device)
    except BaseException:
        ranks.stopping = True
        ranks.kill()
        raise
    atexit.register(ranks.stop)
    return tp, ranks


@contextlib.contextmanager
def fatal_step_errors(ranks: RankProcesses | None) -> Iterator[None]:
    """An error in a tensor-parallel step leaves the ranks out of step with each other: the
    replica goes down (a worker's jobs are then reclaimed by other workers)."""
    try:
        yield
    except Exception:
        logger.exception("tensor-parallel step failed; taking the replica down")
        if ranks is not None:
            ranks.stopping = True
            ranks.kill()
        os._exit(1)
