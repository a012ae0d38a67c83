"""Launch-side helpers shared by the kernel wrappers: device checks, block-size arithmetic."""

from __future__ import annotations

import functools

import torch
import triton


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 and so runs on CPU tensors."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(kernel: object, *tensors: torch.Tensor) -> None:
    """Fail early with a clear message instead of a deep Triton error on CPU tensors."""
    if is_interpreted(kernel):
        return
    for tensor in tensors:
        if tensor.device.type != "cuda":
            raise RuntimeError(
                "Triton kernels need CUDA tensors; to run them on the CPU set "
                "TRITON_INTERPRET=1 before the kernels module is imported"
            )


def dot_upcast(kernel: object, dtype: torch.dtype) -> bool:
    """The interpreter's tl.dot multiplies bf16 bit patterns as integers, so upcast there."""
    return is_interpreted(kernel) and dtype == torch.bfloat16


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.lru_cache(maxsize=8)
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_compute_units(device: torch.device) -> int:
    """Streaming multiprocessors on CUDA; a small stand-in for the CPU interpreter."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sm_count(index)
