"""A request's LoRA adapter, as vLLM names it: `LoRARequest(lora_name, lora_int_id, lora_path)`."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import RequestRejectedError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter folder in PEFT's format (adapter_config.json + adapter_model.safetensors).
    `lora_int_id` (> 0) identifies the adapter: requests with the same id share its slot and
    its prefix-cache entries, so one id must always name the same weights."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def cache_salt(self) -> str:
        """What keeps this adapter's prefix-cache blocks apart from the base model's and every
        other adapter's: K/V computed under an adapter differ from the base model's."""
        return f"lora:{self.lora_int_id}"


# Every LoRAAdapterError message starts with it: the engine finishes the request with the
# message as its stop_reason, and a worker tells an adapter failure from other errors by it.
LORA_FAILURE_PREFIX = "LoRA "


class LoRAAdapterError(RequestRejectedError):
    """An adapter that cannot serve: missing, for another base model, of too high a rank, with
    bad tensors or targets this engine does not adapt. It fails only its request."""

    def __init__(self, message: str) -> None:
        if not message.startswith(LORA_FAILURE_PREFIX):
            message = LORA_FAILURE_PREFIX + "adapter: " + message
        super().__init__(message)

    code = "invalid_lora_adapter"  # schemas.errors.ErrorCode.INVALID_LORA_ADAPTER
