"""Prompt lookup: guess that the text goes on as it did after the last time its tail appeared.

For n from prompt_lookup_max down to prompt_lookup_min, the sequence's last n tokens are looked
up among its earlier tokens (prompt and output); the latest earlier occurrence wins, and the
tokens that followed it are the proposal. Chat answers quoting their prompt, code edits and
rewrites repeat long runs, so the guesses there are often right for several tokens; the
search costs a vectorised scan of the sequence, no model.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.sequence import Sequence


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """Up to max_tokens[i] guessed next tokens of each sequence (possibly none)."""
        return [
            propose_ngram(seq.token_ids, limit, self.prompt_lookup_min, self.prompt_lookup_max)
            for seq, limit in zip(seqs, max_tokens, strict=True)
        ]


def propose_ngram(
    token_ids: list[int], num_tokens: int, lookup_min: int, lookup_max: int
) -> list[int]:
    """The up to num_tokens tokens that followed the latest earlier occurrence of the longest
    suffix (of lookup_min..lookup_max tokens) found again in token_ids; [] when none is."""
    length = len(token_ids)
    if num_tokens <= 0 or length <= lookup_min:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = tokens[length - n :]
        # Windows starting before the suffix itself, so a continuation follows each.
        windows = sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return tokens[follow : follow + num_tokens].tolist()
    return []
