"""The sampler: each sequence's next token from the model's logits, batched (vLLM semantics).

Order of operations per row: repetition / frequency / presence penalties, then the min_tokens
mask on EOS and stop token ids; greedy rows (temperature 0) take the argmax of that; other rows
divide by their temperature, apply top-k, top-p and min-p, and draw from the softmax by an
exponential race. Reported logprobs come from the log-softmax of the raw logits.

Work a batch does not need is skipped: a batch of greedy rows with no penalties, no min_tokens
and no logprobs costs one argmax.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.sampling.filters import apply_min_p, apply_top_k_top_p
from engine.sampling.noise import race_noise
from engine.sampling.penalties import apply_penalties, min_tokens_mask_indices, uses_penalties
from engine.sequence import Sequence
from kernels.cpu_ops import argmax_rows, cpu_kernels_available


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # logprob of the chosen token under the raw logits; None where params.logprobs is False
    logprobs: list[float | None]
    # the top_logprobs most likely (token id, logprob) pairs; None where not requested
    top_logprobs: list[list[tuple[int, float]] | None]


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[rows] long: each row's first maximum; on the CPU over the rows in parallel, reading
    bfloat16 as it is (argmax is exact in any float dtype)."""
    if (
        logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and logits.stride(-1) == 1
        and logits.shape[-1] > 0
        and cpu_kernels_available()
    ):
        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def takes_only_argmax(seq: Sequence) -> bool:
    """Whether the row's token is the raw logits' argmax and nothing else is asked of them."""
    params = seq.params
    return (
        params.greedy
        and not params.logprobs
        and not uses_penalties(seq)
        and seq.num_output_tokens >= params.min_tokens
    )


def _rows_tensor(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


class Sampler:
    """Picks tokens for a batch. Per-sequence state (a seeded generator, the prompt as a tensor)
    lives on each Sequence, so it goes when the sequence does."""

    def __init__(
        self, vocab_size: int, eos_token_ids: Iterable[int], device: torch.device | str = "cpu"
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.device = torch.device(device)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample one token per row of `logits` [len(seqs), >= vocab_size]; input is not modified."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} rows of logits for {len(seqs)} sequences")
        if not seqs:
            return SamplerOutput([], [], [])
        # Columns past vocab_size are padding of the LM head, never valid tokens.
        if all(takes_only_argmax(seq) for seq in seqs):
            token_ids = argmax(logits[:, : self.vocab_size]).tolist()
            return SamplerOutput(token_ids, [None] * len(seqs), [None] * len(seqs))
        raw = logits[:, : self.vocab_size].float()
        chosen = self._choose(self.process_logits(raw, seqs), seqs)
        token_ids = chosen.tolist()  # the one host-device sync of a step
        logprobs, top_logprobs = self._logprobs(raw, chosen, seqs)
        return SamplerOutput(token_ids, logprobs, top_logprobs)

    def process_logits(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Logits after penalties and the min_tokens mask; `logits` itself when nothing applies."""
        vocab_size, device = logits.shape[1], logits.device
        penalised = [row for row, seq in enumerate(seqs) if uses_penalties(seq)]
        if len(penalised) == len(seqs):
            logits = apply_penalties(logits, seqs)
        elif penalised:
            index = _rows_tensor(penalised, device)
            rows = apply_penalties(logits[index], [seqs[row] for row in penalised])
            logits = logits.index_copy(0, index, rows)
        rows, tokens = min_tokens_mask_indices(seqs, self.eos_token_ids, vocab_size)
        if rows:
            if not penalised:
                logits = logits.clone()
            logits.index_put_(
                (_rows_tensor(rows, device), _rows_tensor(tokens, device)),
                torch.tensor(-math.inf, device=device),
            )
        return logits

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """[B] long device tensor of picked token ids."""
        sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
        if len(sampled) < len(seqs):
            picked = argmax(logits)
            if not sampled:
                return picked
        if len(sampled) == len(seqs):
            return self._sample(logits, seqs)
        index = _rows_tensor(sampled, logits.device)
        drawn = self._sample(logits[index], [seqs[row] for row in sampled])
        return picked.index_copy_(0, index, drawn)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Random draw for rows with temperature > 0; `logits` is not modified."""
        params = [seq.params for seq in seqs]
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        scaled = logits / temperature.to(logits.device, non_blocking=True)[:, None]
        scaled = apply_top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params])
        scaled = apply_min_p(scaled, [p.min_p for p in params])
        probs = scaled.softmax(dim=-1)
        noise = race_noise(seqs, logits.shape[1], logits.device)
        return probs.div_(noise).argmax(dim=-1)

    def _logprobs(
        self, raw: torch.Tensor, chosen: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
        batch = len(seqs)
        logprobs: list[float | None] = [None] * batch
        top_logprobs: list[list[tuple[int, float]] | None] = [None] * batch
        wanted = [row for row, seq in enumerate(seqs) if seq.params.logprobs]
        if not wanted:
            return logprobs, top_logprobs
        if len(wanted) < batch:
            index = _rows_tensor(wanted, raw.device)
            raw, chosen = raw[index], chosen[index]
        log_probs = raw.log_softmax(dim=-1)
        chosen_values = log_probs.gather(1, chosen[:, None]).squeeze(1).tolist()
        max_top = max(seqs[row].params.top_logprobs for row in wanted)
        if max_top:
            top = log_probs.topk(max_top, dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for i, row in enumerate(wanted):
            logprobs[row] = chosen_values[i]
            k = seqs[row].params.top_logprobs
            if k:
                top_logprobs[row] = list(zip(top_ids[i][:k], top_values[i][:k], strict=True))
        return logprobs, top_logprobs
