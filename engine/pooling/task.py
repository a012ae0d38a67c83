"""Which runner serves a model: generation, or pooling (embeddings). Named by `runner` (vLLM's
argument) or vLLM's older `task`; else detected from the folder: a sentence-transformers
folder, an encoder (BERT family) or a bare transformer with no LM head is a pooling model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from engine.pooling.model_config import (
    ENCODER_MODEL_TYPES,
    is_bare_model,
    is_sentence_transformers_folder,
)

Runner = Literal["generate", "pooling"]
# vLLM's task names -> the runner that serves them.
TASK_RUNNERS: dict[str, Runner | None] = {
    "auto": None,
    "generate": "generate",
    "embed": "pooling",
    "embedding": "pooling",
    "encode": "pooling",
}


def runner_of_task(task: str) -> Runner | None:
    """The runner vLLM's `task` names (None: detect it); ValueError for tasks not served."""
    if task not in TASK_RUNNERS:
        raise ValueError(f"task {task!r} is not served; one of {', '.join(TASK_RUNNERS)}")
    return TASK_RUNNERS[task]


def detect_runner(model_path: Path, hf_config: Any) -> Runner:
    if (
        is_sentence_transformers_folder(model_path)
        or hf_config.model_type in ENCODER_MODEL_TYPES
        or is_bare_model(hf_config.architectures)
    ):
        return "pooling"
    return "generate"


def resolve_runner(requested: str, model_path: Path, hf_config: Any) -> Runner:
    """The runner `requested` ("auto", "generate" or "pooling") resolves to for this model."""
    if requested == "generate" or requested == "pooling":
        return requested
    return detect_runner(model_path, hf_config)
