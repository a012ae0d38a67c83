"""vLLM's `allowed_token_ids` and `bad_words`: logits processors that forbid tokens (-inf), for
the rows that ask, with one masked write per batch.

bad_words follow vLLM: each word is tokenized as it reads at the start of a text and after a
space; a one-token word is always banned, a longer one has its last token banned wherever the
output so far ends with the tokens before it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.sequence import Sequence


def _rows_tensor(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


class AllowedTokens:
    """Only each row's allowed_token_ids keep their logits; ids past the vocabulary are none."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def applies_to(self, seq: Sequence) -> bool:
        return seq.params.allowed_token_ids is not None

    def _allowed_ids(self, seq: Sequence, device: torch.device) -> torch.Tensor:
        state = seq.sampler_state
        if state.allowed_ids is None:
            ids = [t for t in seq.params.allowed_token_ids or [] if t < self.vocab_size]
            state.allowed_ids = _rows_tensor(sorted(set(ids)), device)
        return state.allowed_ids

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [row for row, seq in enumerate(seqs) if self.applies_to(seq)]
        if not rows:
            return
        device = logits.device
        ids = [self._allowed_ids(seqs[row], device) for row in rows]
        lengths = torch.tensor([len(t) for t in ids])
        keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=device)
        local_rows = torch.repeat_interleave(torch.arange(len(rows)), lengths).to(device)
        keep[local_rows, torch.cat(ids)] = True
        index = _rows_tensor(rows, device)
        masked = logits.index_select(0, index).masked_fill_(~keep, -math.inf)
        logits.index_copy_(0, index, masked)


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Token sequences of `words` as vLLM builds them: each word as it reads at the start of a
    text, and after a space where that gives other tokens of the same count."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            sequences.append(spaced)
    return sequences


class BadWords:
    """Each row's bad_words: their last token is banned where the output ends with the rest."""

    def __init__(self, tokenizer: Any | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size

    def applies_to(self, seq: Sequence) -> bool:
        return bool(seq.params.bad_words)

    def _sequences(self, seq: Sequence) -> list[list[int]]:
        state = seq.sampler_state
        if state.bad_words_ids is None:
            if self.tokenizer is None:
                raise ValueError("bad_words need a tokenizer")
            state.bad_words_ids = bad_words_token_ids(self.tokenizer, seq.params.bad_words)
        return state.bad_words_ids

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows: list[int] = []
        tokens: list[int] = []
        for row, seq in enumerate(seqs):
            if not self.applies_to(seq):
                continue
            output = seq.output_token_ids
            for words in self._sequences(seq):
                *prefix, last = words
                if last >= self.vocab_size or len(prefix) > len(output):
                    continue
                if not prefix or output[len(output) - len(prefix) :] == prefix:
                    rows.append(row)
                    tokens.append(last)
        if rows:
            device = logits.device
            index = (_rows_tensor(rows, device), _rows_tensor(tokens, device))
            logits.index_put_(index, torch.tensor(-math.inf, device=device))
