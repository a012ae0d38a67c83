"""Constrained decoding for a batch: which requests wait for their grammar, the token mask of
each constrained row before sampling, and each matcher advanced by the token it got.

A matcher belongs to one sequence (one choice) and is made when the sequence first samples,
then caught up with the tokens it already has (a resumed or forked choice), so it follows the
sequence through preemption and forks without further bookkeeping.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch
import xgrammar as xgr

from engine.errors import RequestRejectedError
from engine.sequence import Sequence
from engine.structured.grammars import GrammarCache
from schemas.sampling import SamplingParams

logger = logging.getLogger(__name__)

_BIT_POSITIONS = torch.arange(32, dtype=torch.int32)


class StructuredDecoding:
    """Grammar state of the engine's constrained requests. Unconstrained batches cost nothing."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._cache: GrammarCache | None = None  # made with the first constrained request
        self._grammars: dict[str, Future[xgr.CompiledGrammar]] = {}
        self._matchers: dict[int, xgr.GrammarMatcher] = {}  # by seq_id
        self._seq_ids: dict[str, list[int]] = {}  # request id -> seq ids with matchers

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Start compiling the request's grammar, if it has one. Raises RequestRejectedError
        when the constraint does not make a grammar."""
        constraint = params.structured_output
        if constraint is None:
            return
        if self._tokenizer is None:
            raise RequestRejectedError("structured_output needs a model with a tokenizer")
        if self._cache is None:
            self._cache = GrammarCache(self._tokenizer, self._vocab_size, self._stop_token_ids)
        self._grammars[request_id] = self._cache.get(constraint)

    def is_ready(self, request_id: str) -> bool:
        """Whether the request can run: unconstrained, or its grammar compiled (or failed)."""
        future = self._grammars.get(request_id)
        return future is None or future.done()

    def failure(self, request_id: str) -> str | None:
        """Why the request's grammar failed to compile, once it has; None otherwise."""
        future = self._grammars.get(request_id)
        if future is None or not future.done() or future.exception() is None:
            return None
        return f"the structured_output grammar failed to compile: {future.exception()}"

    def wait_for_any(self, request_ids: list[str], timeout_s: float) -> None:
        """Block until one of these requests' grammars is done, at most timeout_s."""
        futures = [self._grammars[r] for r in request_ids if r in self._grammars]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def release(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)
        for seq_id in self._seq_ids.pop(request_id, []):
            self._matchers.pop(seq_id, None)

    def applies_to(self, seq: Sequence) -> bool:
        """As a logits processor: the rows of constrained requests."""
        return seq.params.structured_output is not None

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        self.mask_logits(logits, seqs)

    @torch.inference_mode()
    def mask_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Set the logits of tokens the grammar forbids to -inf, in place, row by row."""
        rows = [row for row, seq in enumerate(seqs) if seq.request_id in self._grammars]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(rows), self._vocab_size)
        for index, row in enumerate(rows):
            matcher = self._matcher(seqs[row])
            if matcher.is_terminated():
                # Complete, and still going (ignore_eos): only stop tokens keep it valid.
                bitmask[index] = self._stop_only_row()
            else:
                matcher.fill_next_token_bitmask(bitmask, index)
        allowed = _unpack(bitmask, self._vocab_size).to(logits.device, non_blocking=True)
        row_index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        masked = logits[row_index, : self._vocab_size].masked_fill(~allowed, -torch.inf)
        logits[row_index, : self._vocab_size] = masked

    def _stop_only_row(self) -> torch.Tensor:
        words = [0] * xgr.get_bitmask_shape(1, self._vocab_size)[1]
        for token_id in self._stop_token_ids:
            words[token_id // 32] |= 1 << (token_id % 32)
        # int32 words: bit 31 is the sign bit.
        signed = [word - (1 << 32) if word >= 1 << 31 else word for word in words]
        return torch.tensor(signed, dtype=torch.int32)

    def accept(self, seqs: list[Sequence], token_ids: list[int]) -> None:
        """Advance each constrained sequence's matcher by the token it was given."""
        for seq, token_id in zip(seqs, token_ids, strict=True):
            matcher = self._matchers.get(seq.seq_id)
            if matcher is None or matcher.is_terminated():
                continue
            if not matcher.accept_token(token_id):
                logger.warning(
                    "request %s: token %d is outside its grammar", seq.request_id, token_id
                )

    def _matcher(self, seq: Sequence) -> xgr.GrammarMatcher:
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            matcher = xgr.GrammarMatcher(self._grammars[seq.request_id].result())
            for token_id in seq.output_token_ids:
                matcher.accept_token(token_id)
            self._matchers[seq.seq_id] = matcher
            self._seq_ids.setdefault(seq.request_id, []).append(seq.seq_id)
        return matcher


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size] from xgrammar's packed int32 bitmask (bit i of word w: token
    32 * w + i allowed)."""
    bits = (bitmask[:, :, None] >> _BIT_POSITIONS) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
