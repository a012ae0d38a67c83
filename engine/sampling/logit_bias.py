"""OpenAI's logit_bias: a per-request additive bias on chosen token ids, before any sampling."""

from __future__ import annotations

import torch

from engine.sequence import Sequence


@torch.inference_mode()
def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence], vocab_size: int) -> None:
    """Add each row's biases to `logits` in place; ids past the vocabulary are ignored."""
    rows: list[int] = []
    columns: list[int] = []
    biases: list[float] = []
    for row, seq in enumerate(seqs):
        for token_id, bias in (seq.params.logit_bias or {}).items():
            if token_id < vocab_size:
                rows.append(row)
                columns.append(token_id)
                biases.append(bias)
    if not rows:
        return
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(columns, device=device))
    logits.index_put_(
        index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True
    )


class LogitBias:
    """apply_logit_bias as a logits processor of the engine's sampling rows."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def applies_to(self, seq: Sequence) -> bool:
        return bool(seq.params.logit_bias)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        apply_logit_bias(logits, seqs, self.vocab_size)
