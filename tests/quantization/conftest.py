"""Quantization test fixtures: the default model's fp32 folder (shared with the engine tests)."""

from tests.engine.conftest import default_model_path

__all__ = ["default_model_path"]
