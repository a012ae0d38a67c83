"""Quantization test fixtures: the default model's fp32 folder and tiny random model folders
(shared with the engine tests)."""

from tests.engine.conftest import default_model_path, tiny_llama_dir, tiny_model_factory

__all__ = ["default_model_path", "tiny_llama_dir", "tiny_model_factory"]
