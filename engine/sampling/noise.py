"""Random noise for exponential-race sampling, with per-request seeded streams.

Sampling picks argmax(probs / q) with q ~ Exp(1) i.i.d. per token, which draws exactly from
`probs`. A seeded sequence draws its row of q from its own generator, always V values per
sampled token, so its tokens do not depend on which other rows share the batch; unseeded rows
share one batch-wide draw from the default generator.
"""

from __future__ import annotations

import torch

from engine.sequence import Sequence

_MASK64 = (1 << 64) - 1


def choice_seed(seed: int, choice_index: int) -> int:
    """Seed of one choice of a seeded request: the seed itself for choice 0.

    Other choices mix (seed, index) with splitmix64 so sibling streams are unrelated.
    """
    if choice_index == 0:
        return seed
    z = (seed + (choice_index * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _generator(seq: Sequence, row: torch.Tensor) -> torch.Generator:
    """The sequence's own stream, made on its first draw (it lives on the sequence)."""
    state = seq.sampler_state
    if state.generator is None:
        assert seq.params.seed is not None
        generator = torch.Generator(device=row.device)
        generator.manual_seed(choice_seed(seq.params.seed, seq.choice_index))
        # A sequence resumed with output tokens already made continues the same stream:
        # skip the draws (one row per token) its earlier run consumed. Draws are of the same
        # size as live ones, since a generator's stream may depend on the draw size.
        scratch = torch.empty_like(row)
        for _ in range(seq.num_output_tokens):
            scratch.exponential_(generator=generator)
        state.generator = generator
    return state.generator


def race_noise(seqs: list[Sequence], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab_size] Exp(1) noise, rows aligned with `seqs`, strictly positive."""
    noise = torch.empty(len(seqs), vocab_size, dtype=torch.float32, device=device)
    seeded = [row for row, seq in enumerate(seqs) if seq.params.seed is not None]
    if len(seeded) < len(seqs):
        noise.exponential_()
    for row in seeded:
        noise[row].exponential_(generator=_generator(seqs[row], noise[row]))
    # probs / 0 would make a masked (zero-probability) token win through NaN.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
