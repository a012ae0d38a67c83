"""Greedy tokens of a float32 LM head at bfloat16 cost, on CPUs that compute bfloat16 natively.

A decode step's LM head is its largest matmul (49k x 576 for SmolLM2: 113 MB of fp32 weights a
step, 57 MFLOP a row). A greedy row needs only the argmax of its logits, and the bf16 product
of the same vectors is within a computable bound of every fp32 logit: the fp32 argmax is among
the tokens whose bf16 logit comes within twice that bound of the row's best, typically one to a
few dozen of them, and only those get an exact fp32 logit (kernels/cpu/greedy.cpp has the
bound). The tokens are those of the fp32 logits; the bf16 pass reads half the bytes and runs at
twice the FLOP rate where AVX512-BF16 or AMX does bf16.

Whether it pays is measured at start-up against the fp32 head as the model computes it (its
tuned matmul plan), and the answer is kept per machine (engine.platforms.cpu.machine_cache).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.layers.linear import Linear
from engine.platforms.cpu.machine_cache import cached, machine_key
from kernels import cpu_ops

logger = logging.getLogger(__name__)

CACHE_KIND = "cpu_greedy_screen"
# A row with more near-best tokens than this is computed in full (a flat or broken row).
MAX_CANDIDATES = 4096
# The screen must take at most this share of the fp32 head's time to be used.
_REQUIRED_SHARE = 0.85
_MEASURE_ROWS = (1, 64)  # a single stream, and a decode step of many sequences
_REPEATS = 5
_HIDDEN_NORM = 50.0  # a final hidden state's typical L2 norm (SmolLM2: ~55)


class ScreenedLMHead:
    """The argmax tokens of lm_head's float32 logits (first `vocab_size` columns)."""

    def __init__(self, lm_head: Linear, vocab_size: int) -> None:
        weight = lm_head.weight.detach()
        self.lm_head = lm_head
        self.weight = weight  # the plain fp32 weight the exact logits are computed from
        self.vocab_size = vocab_size
        self.out_features = weight.shape[0]
        with torch.inference_mode():
            self.row_norms = weight.double().norm(dim=1).float()
            self.panels = cpu_ops.pack_panels(weight.bfloat16())

    @property
    def nbytes(self) -> int:
        """Memory the screen adds to the model's: its bf16 copy and the row norms."""
        return sum(t.numel() * t.element_size() for t in (self.panels, self.row_norms))

    @torch.inference_mode()
    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows] int64 greedy tokens of float32 hidden states [rows, in_features]."""
        hidden = hidden.contiguous()
        approx = cpu_ops.panel_linear(hidden.bfloat16(), self.panels, None, self.out_features)
        tokens = cpu_ops.screened_argmax(
            approx, hidden, self.weight, self.row_norms, self.vocab_size, MAX_CANDIDATES
        )
        unsettled = (tokens < 0).nonzero().squeeze(1)
        if unsettled.numel():
            tokens[unsettled] = self.full_argmax(hidden.index_select(0, unsettled))
        return tokens

    def full_argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy tokens through the full fp32 head, as the sampler takes them."""
        logits = self.lm_head(hidden).float()
        return cpu_ops.argmax_rows(logits[:, : self.vocab_size])


def screen_supported(lm_head: Linear) -> bool:
    """Whether this head can be screened here: a plain fp32 weight on the CPU (not quantized,
    not freed by a packed plan) and bf16 panel kernels for this CPU."""
    weight = lm_head.weight
    return (
        not lm_head.is_quantized
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.is_contiguous()
        and cpu_ops.cpu_kernels_available()
        and cpu_ops.panel_matmul_supported(torch.bfloat16)
    )


def build(lm_head: Linear, vocab_size: int, choice: str) -> ScreenedLMHead | None:
    """The screened head for `choice` (EngineConfig.cpu_greedy_screen): "on" where the head
    and CPU support it, "auto" where it also measures faster than the fp32 head (cached per
    machine); None elsewhere."""
    if choice == "off":
        return None
    if not screen_supported(lm_head):
        if choice == "on":
            raise ValueError(
                "cpu_greedy_screen='on' needs a float32 LM head on the CPU and bfloat16 panel "
                "kernels (AVX512-BF16); use 'auto' or 'off' here"
            )
        return None
    started = time.perf_counter()
    screened = ScreenedLMHead(lm_head, vocab_size)
    if choice == "on":
        logger.info("greedy LM head: bf16 screen, fp32 check (on)")
        return screened
    key = machine_key(shape=list(lm_head.weight.shape), plan=lm_head.plan.describe())
    share = cached(CACHE_KIND, key, lambda: measure_share(screened), _read_share)
    used = share <= _REQUIRED_SHARE
    logger.info(
        "greedy LM head: %s (bf16 screen at %.2f of the fp32 head's time; %.0f ms)",
        "bf16 screen, fp32 check" if used else "fp32",
        share,
        (time.perf_counter() - started) * 1e3,
    )
    return screened if used else None


def measure_share(
    screened: ScreenedLMHead, clock: Callable[[], float] = time.perf_counter
) -> float:
    """The screen's time over the fp32 head's, summed over _MEASURE_ROWS, fastest of the
    alternated repeats (a burst of load from elsewhere hits both alike)."""
    generator = torch.Generator().manual_seed(0)
    vocab = screened.vocab_size
    inputs = {}
    for rows in _MEASURE_ROWS:
        # Hidden states near some tokens' embeddings, like a model's: a few clear favourites.
        picks = torch.randint(0, vocab, (rows,), generator=generator)
        near = screened.weight[picks] + 0.5 * torch.randn(
            rows, screened.weight.shape[1], generator=generator
        )
        inputs[rows] = near * (_HIDDEN_NORM / near.norm(dim=1, keepdim=True))

    best = {(name, rows): float("inf") for name in ("fp32", "screen") for rows in _MEASURE_ROWS}
    with torch.inference_mode():
        for repeat in range(_REPEATS + 1):
            for name, run in (("fp32", screened.full_argmax), ("screen", screened.argmax)):
                for rows, hidden in inputs.items():
                    began = clock()
                    run(hidden)
                    if repeat:  # the first pass warms up
                        best[name, rows] = min(best[name, rows], clock() - began)
    fp32 = sum(best["fp32", rows] for rows in _MEASURE_ROWS)
    screen = sum(best["screen", rows] for rows in _MEASURE_ROWS)
    return screen / fp32


def _read_share(stored: Any) -> float:
    return float(stored)
