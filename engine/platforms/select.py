"""The platform of a device: the CPU platform on the CPU, the do-nothing one elsewhere."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend
from engine.config import EngineConfig
from engine.distributed.group import TensorParallel
from engine.platforms.base import Platform

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def platform_for(
    device: torch.device,
    config: EngineConfig,
    hf_config: PretrainedConfig,
    attention: AttentionBackend,
    tp: TensorParallel | None,
) -> Platform:
    """The platform of device for the model hf_config describes (this rank's shards under
    tensor parallelism)."""
    if device.type != "cpu":
        return Platform()
    # Imported here: engine.layers imports the CPU matmul from this package, so the package
    # must not import the layers back while they load.
    from engine.platforms.cpu.platform import CpuPlatform

    return CpuPlatform(config, hf_config, attention, tp)
