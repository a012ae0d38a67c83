"""The inference engine: models, paged KV cache, scheduler, sampler, detokenizer, the offline
`LLM` API and the asynchronous `AsyncLLMEngine`, named as vLLM's Python API names them.

Heavy modules (torch, transformers) load on first use, so `import engine` stays cheap.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from engine.prompts import TextPrompt, TokensPrompt
from engine.sampling_params import RequestOutputKind, SamplingParams
from schemas.pooling import PoolingParams

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM, AsyncLLMEngine
    from engine.beam_search import BeamSearchParams
    from engine.beam_search_output import BeamSearchOutput, BeamSearchSequence
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.engine_args import AsyncEngineArgs, EngineArgs
    from engine.llm import LLM
    from engine.lora.request import LoRARequest
    from engine.outputs import CompletionOutput, RequestOutput

# name -> the module that defines it, imported on first use
_LAZY = {
    "LLM": "engine.llm",
    "Engine": "engine.engine",
    "AsyncLLM": "engine.async_llm",
    "AsyncLLMEngine": "engine.async_llm",
    "BeamSearchParams": "engine.beam_search",
    "BeamSearchOutput": "engine.beam_search_output",
    "BeamSearchSequence": "engine.beam_search_output",
    "EngineConfig": "engine.config",
    "EngineArgs": "engine.engine_args",
    "AsyncEngineArgs": "engine.engine_args",
    "CompletionOutput": "engine.outputs",
    "LoRARequest": "engine.lora.request",
    "RequestOutput": "engine.outputs",
}

__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLM",
    "AsyncLLMEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "Engine",
    "EngineArgs",
    "EngineConfig",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    return getattr(import_module(module), name)
