"""The inference engine: models, paged KV cache, scheduler, sampler, detokenizer, offline LLM API."""
