"""The platform of a device without fast paths of its own (CUDA, anything but the CPU)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.models.interface import CausalLM
    from engine.platforms.cpu.greedy_screen import ScreenedLMHead


class Platform:
    """What the model runner asks of its device's platform; here every answer is "nothing"."""

    # The greedy screen whose argmax the runner takes for argmax-only steps; None: no screen.
    greedy_screen: ScreenedLMHead | None = None

    def auto_dtype(self) -> torch.dtype:
        """The dtype for EngineConfig.dtype "auto" where the device has no rule of its own."""
        return torch.float32

    def prepare(self, model: CausalLM, dtype: torch.dtype) -> None:
        """Set the loaded model up for this device's fast paths (once, before any step)."""

    @property
    def extra_weight_bytes(self) -> int:
        """Bytes of weights the platform holds beside the model's (they count against
        EngineConfig.memory_budget)."""
        return 0

    def step(self, num_tokens: int, decode_only: bool) -> contextlib.AbstractContextManager[None]:
        """Wraps the model forward of one step of num_tokens tokens."""
        return contextlib.nullcontext()
