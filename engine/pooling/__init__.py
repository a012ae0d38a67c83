"""Pooling models (embeddings): prefill-only batches through an encoder or a decoder, no KV
cache kept afterwards, each sequence's token states pooled into one vector."""
