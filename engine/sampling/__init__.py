"""Building blocks of the sampler: logit penalties, top-k/top-p/min-p filters, per-request noise.

`engine.sampler.Sampler` composes them; each piece works on a whole batch of logits at once.
"""
