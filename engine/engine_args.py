"""vLLM's engine-argument names on top of ours: `EngineArgs(...)` / `AsyncEngineArgs(...)`.

Every `EngineConfig` field is an argument under its own name (most are vLLM's names already).
The vLLM names below differ from ours or mean nothing here; each is mapped onto ours, accepted
because it changes nothing a user sees (the reason logged), or refused naming what to use
instead. Any other name is refused by the dataclass itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from engine.config import EngineConfig
from schemas.sampling import MAX_TOP_LOGPROBS

logger = logging.getLogger(__name__)

# vLLM arguments accepted with no effect here, and why that is harmless.
_NO_EFFECT = {
    "trust_remote_code": "models load through inferq's own model definitions; no remote code runs",
    "disable_log_stats": "the in-process engines log no periodic stats (the worker serves "
    "/metrics)",
    "disable_log_requests": "requests are logged at debug level only",
    "enable_log_requests": "requests are logged at debug level only",
    "swap_space": "preempted sequences are recomputed, never swapped to host memory",
    "enable_chunked_prefill": "prompts are always prefilled in chunks within "
    "max_num_batched_tokens; outputs are the same",
    "served_model_name": "only the API servers name models",
}


@dataclass
class EngineArgs(EngineConfig):
    """EngineConfig's fields plus vLLM's names for them; `create_engine_config()` maps them."""

    # vLLM names for arguments of ours
    num_gpu_blocks_override: int | None = None  # ours: num_kv_blocks
    # vLLM arguments that change nothing here (see _NO_EFFECT)
    trust_remote_code: bool = False
    disable_log_stats: bool = False
    disable_log_requests: bool = False
    enable_log_requests: bool = False
    swap_space: float | None = None
    enable_chunked_prefill: bool | None = None
    served_model_name: str | list[str] | None = None
    # vLLM arguments taken at the value this engine has, refused at any other
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    kv_cache_dtype: str = "auto"
    pipeline_parallel_size: int = 1
    max_logprobs: int = MAX_TOP_LOGPROBS

    def create_engine_config(self) -> EngineConfig:
        """The EngineConfig these arguments give; a ValueError names a refused argument."""
        if self.tokenizer is not None and self.tokenizer != self.model:
            raise ValueError(
                "tokenizer: the tokenizer is loaded from the model folder (`model`); a separate "
                "tokenizer is not supported"
            )
        if self.tokenizer_mode != "auto":
            raise ValueError("tokenizer_mode: only 'auto' (the model's HF tokenizer) is supported")
        if self.kv_cache_dtype != "auto":
            raise ValueError("kv_cache_dtype: the KV cache is held in `dtype`; set that instead")
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                "pipeline_parallel_size: pipeline parallelism is not supported; use "
                "tensor_parallel_size"
            )
        if self.max_logprobs > MAX_TOP_LOGPROBS:
            raise ValueError(f"max_logprobs: at most {MAX_TOP_LOGPROBS} top logprobs per token")
        values = {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
        if self.num_gpu_blocks_override is not None:
            if self.num_kv_blocks not in (None, self.num_gpu_blocks_override):
                raise ValueError("num_gpu_blocks_override: give num_kv_blocks only")
            values["num_kv_blocks"] = self.num_gpu_blocks_override
        for name, reason in _NO_EFFECT.items():
            if getattr(self, name) != _DEFAULTS[name]:
                logger.info(
                    "engine argument %s=%r has no effect: %s", name, getattr(self, name), reason
                )
        return EngineConfig(**values)


_DEFAULTS = {f.name: f.default for f in fields(EngineArgs) if f.name in _NO_EFFECT}


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs for `AsyncLLMEngine.from_engine_args`, as vLLM names them."""


ENGINE_ARG_NAMES = frozenset(f.name for f in fields(EngineArgs))
