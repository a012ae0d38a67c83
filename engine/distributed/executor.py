"""An executor rank: load this rank's shard of the model, then run each step the driver sends.

Started by the driver (`python -m engine.distributed.executor --config JSON --model-path DIR`,
RANK etc. in the environment) or by torchrun through `run_executor`. SIGTERM and SIGINT are
left to the driver, which drains and then stops every rank; an executor whose driver is gone
exits on its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.step_channel import StepReceiver
from engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


def run_executor(config: EngineConfig, model_path: Path | None = None) -> int:
    """Serve the driver's steps until it shuts the replica down; 0 then."""
    if model_path is None:
        from engine.model_files import resolve_model_path

        model_path = resolve_model_path(config.model)
    runner = ModelRunner(config, model_path)
    if runner.tp is None:
        raise RuntimeError("an executor rank needs tensor_parallel_size > 1")
    receiver = StepReceiver(runner.tp)
    logger.info("executor rank %d ready", runner.tp.rank)
    runner.follow_driver(receiver)
    dist.barrier(group=runner.tp.control)  # the driver's shutdown waits for it (see there)
    dist.destroy_process_group()
    logger.info("executor rank %d stopped", runner.tp.rank)
    return 0


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        logger.error("the driver rank is gone; exiting")
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="EngineConfig as JSON")
    parser.add_argument("--model-path", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s rank{os.environ.get('RANK', '?')} %(levelname)s %(name)s: %(message)s",
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    _exit_with_parent()
    return run_executor(EngineConfig(**json.loads(args.config)), args.model_path)


if __name__ == "__main__":
    raise SystemExit(main())
