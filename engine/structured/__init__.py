"""Structured output: grammars compiled off the step path, token masks applied before sampling."""

from engine.structured.decoding import StructuredDecoding

__all__ = ["StructuredDecoding"]
