"""Tokenizer loading and end-of-sequence ids for a model folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_path: Path) -> Any | None:
    """The model's HF tokenizer, or None for weight-only folders (dummy benchmark models)."""
    if not any((model_path / name).exists() for name in _TOKENIZER_FILES):
        logger.info("no tokenizer in %s: token-id prompts only", model_path)
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def read_eos_token_ids(model_path: Path, tokenizer: Any | None, hf_config: Any) -> set[int]:
    """EOS ids from generation_config.json, the model config and the tokenizer, merged."""
    ids: set[int] = set()
    generation_config = model_path / "generation_config.json"
    if generation_config.exists():
        ids |= _as_id_set(json.loads(generation_config.read_text()).get("eos_token_id"))
    ids |= _as_id_set(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        ids |= _as_id_set(tokenizer.eos_token_id)
    return ids


def _as_id_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else {int(v) for v in value}
