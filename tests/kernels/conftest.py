"""Kernel tests run the real Triton kernels: compiled on a GPU, interpreted on the CPU.

TRITON_INTERPRET must be set before any @triton.jit function is decorated, i.e. before the
kernel modules are imported, hence at conftest import time. It is only a default (an explicit
setting wins), only set without CUDA, and only changes how Triton kernels execute, which
nothing outside the kernels depends on.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where kernel inputs live: the GPU when kernels compile for it, else the CPU."""
    if torch.cuda.is_available() and not _interpreting():
        return torch.device("cuda")
    return torch.device("cpu")
