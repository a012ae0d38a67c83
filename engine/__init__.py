"""The inference engine: models, paged KV cache, scheduler, sampler, detokenizer, offline LLM API.

Heavy modules (torch, transformers) load on first use, so `import engine` stays cheap.
"""

from typing import TYPE_CHECKING, Any

from schemas.pooling import PoolingParams
from schemas.sampling import SamplingParams

if TYPE_CHECKING:
    from engine.beam_search import BeamSearchParams
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.llm import LLM

__all__ = ["LLM", "BeamSearchParams", "Engine", "EngineConfig", "PoolingParams", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    if name == "BeamSearchParams":
        from engine.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "EngineConfig":
        from engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
