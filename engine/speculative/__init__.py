"""Speculative decoding: proposers beside the model runner, verification beside the sampler."""
