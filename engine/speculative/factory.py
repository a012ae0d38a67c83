"""The speculator an engine configuration asks for, with its proposer."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.speculative.ngram import NgramProposer
from engine.speculative.speculator import Proposer, Speculator


def make_speculator(config: EngineConfig, max_model_len: int, vocab_size: int) -> Speculator | None:
    spec = config.speculative_config
    if spec is None:
        return None
    proposer: Proposer
    if spec.method == "ngram":
        proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        from engine.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, spec, vocab_size)
    return Speculator(spec, proposer, max_model_len)
