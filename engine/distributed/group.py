"""The tensor-parallel process group: who this rank is, and the collectives the layers call.

Ranks meet through the standard torch.distributed rendezvous (MASTER_ADDR, MASTER_PORT, RANK,
WORLD_SIZE, as torchrun sets them, or as engine.distributed.launcher sets them for the ranks it
starts). Collectives run on gloo on the CPU and on NCCL on CUDA, with a timeout so a peer that
hangs fails the collective instead of blocking it forever. Step descriptions travel on a second
gloo group without such a timeout: an executor may wait for the next step for as long as the
driver is idle.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A live peer answers a collective within milliseconds to seconds; loading a large model on
# every rank before the first one takes longest.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
# The step channel's waits are bounded by the watchdogs (a dead peer closes its sockets).
IDLE_TIMEOUT = timedelta(days=365)

_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class Rendezvous:
    master_addr: str
    master_port: int
    rank: int
    world_size: int

    @classmethod
    def from_env(cls) -> Rendezvous:
        missing = [name for name in _RENDEZVOUS_VARS if not os.environ.get(name)]
        if missing:
            raise RuntimeError(f"tensor parallelism needs {', '.join(missing)} in the environment")
        return cls(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
        )

    def env(self) -> dict[str, str]:
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
        }


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a group started outside (torchrun, a scheduler)."""
    return bool(os.environ.get("RANK")) and bool(os.environ.get("WORLD_SIZE"))


def is_torchrun_executor(tensor_parallel_size: int) -> bool:
    """Whether this process is a non-driver rank of a replica torchrun started: it serves the
    driver's steps (engine.distributed.executor.run_executor) instead of an engine."""
    return (
        tensor_parallel_size > 1
        and launched_by_torchrun()
        and int(os.environ.get("RANK", "0")) != 0
    )


@dataclass
class TensorParallel:
    """This rank's place in the group; the collectives the parallel layers need."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # model collectives (gloo or NCCL)
    control: dist.ProcessGroup | None = None  # step descriptions (gloo, no timeout)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank-major."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())


def init_tensor_parallel(rendezvous: Rendezvous, size: int, device: torch.device) -> TensorParallel:
    """Join the group (gloo on the CPU, NCCL on CUDA) and return this rank's TensorParallel."""
    if rendezvous.world_size != size:
        raise ValueError(
            f"tensor_parallel_size={size} but WORLD_SIZE={rendezvous.world_size}: one replica "
            "per group (pipeline and data parallel groups are not supported)"
        )
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rendezvous.rank))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=f"tcp://{rendezvous.master_addr}:{rendezvous.master_port}",
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    logger.info(
        "tensor parallel rank %d of %d joined (%s, master %s:%d)",
        rendezvous.rank,
        size,
        backend,
        rendezvous.master_addr,
        rendezvous.master_port,
    )
    return TensorParallel(rendezvous.rank, size, dist.group.WORLD, control)
