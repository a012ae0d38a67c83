"""LoRA adapters over the base model: requests, loading, slots and the batched term."""

from engine.lora.request import LoRAAdapterError, LoRARequest

__all__ = ["LoRAAdapterError", "LoRARequest"]
