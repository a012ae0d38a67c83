"""Pick the attention backend for a device: plain torch everywhere, Triton on CUDA."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """name: "torch", "triton", or "auto" (Triton on CUDA, torch elsewhere)."""
    device_type = torch.device(device).type
    if name == "auto":
        name = "triton" if device_type == "cuda" else "torch"
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend
        from engine.platforms.cpu.prefill_choice import sdpa_prefill_wins

        return TorchAttentionBackend(sdpa_prefill=sdpa_prefill_wins)
    if name == "triton":
        # Imported only here: CPU installs without Triton never load it.
        from engine.attention.triton_backend import TritonAttentionBackend

        if device_type != "cuda":  # the interpreter: the kernel's default tiles
            return TritonAttentionBackend()
        from engine.attention.cuda_prefill import choose_cuda_prefill

        # Steps with prefills attend through whichever path measures fastest on this GPU.
        return TritonAttentionBackend(choose_prefill=choose_cuda_prefill)
    raise ValueError(f"unknown attention backend {name!r} (expected auto, torch or triton)")
