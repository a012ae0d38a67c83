"""Top-k, top-p (nucleus) and min-p filters: excluded tokens get -inf logits, whole batch at once.

Each filter takes per-row settings as Python lists (neutral values for rows that do not use it)
so deciding what to skip never needs a device sync.
"""

from __future__ import annotations

import math

import torch


def _column(values: list, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(like.device, non_blocking=True)[:, None]


def apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep each row's k largest logits (ties with the k-th kept); k <= 0 or >= V disables."""
    vocab_size = logits.shape[1]
    enabled = [0 < k < vocab_size for k in top_k]
    if not any(enabled):
        return logits
    max_k = max(k for k, on in zip(top_k, enabled, strict=True) if on)
    largest = logits.topk(max_k, dim=-1).values
    # Disabled rows read any column and get their threshold replaced by -inf below.
    kth_index = _column(
        [k - 1 if on else 0 for k, on in zip(top_k, enabled, strict=True)], logits, torch.long
    )
    threshold = largest.gather(1, kth_index)
    threshold.masked_fill_(~_column(enabled, logits, torch.bool), -math.inf)
    return logits.masked_fill_(logits < threshold, -math.inf)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-k, then top-p on the renormalised survivors, in place; returns `logits`.

    Top-p keeps a token when the probability mass of the tokens ranked above it is below p,
    so the most likely token always survives.
    """
    if all(p >= 1.0 for p in top_p):
        return apply_top_k(logits, top_k)
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if any(0 < k < vocab_size for k in top_k):
        kth_index = _column(
            [min(k, vocab_size) - 1 if k > 0 else vocab_size - 1 for k in top_k], logits, torch.long
        )
        threshold = sorted_logits.gather(1, kth_index)
        sorted_logits.masked_fill_(sorted_logits < threshold, -math.inf)
    probs = sorted_logits.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    drop = mass_above >= _column(top_p, logits, logits.dtype)
    drop[:, 0] = False
    sorted_logits.masked_fill_(drop, -math.inf)
    return logits.scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the row's top probability, in place.

    Compared in log space (logit < max + log min_p), which needs no softmax and gives the same
    set whether or not earlier filters renormalised the distribution.
    """
    if not any(p > 0.0 for p in min_p):
        return logits
    log_min_p = _column(
        [math.log(p) if p > 0.0 else -math.inf for p in min_p], logits, logits.dtype
    )
    threshold = logits.amax(dim=-1, keepdim=True) + log_min_p
    return logits.masked_fill_(logits < threshold, -math.inf)
