"""The experts' MLPs over the tokens routed to them, without a loop over tokens.

Every (token, expert) pair is sorted by expert, so the rows each expert reads are contiguous:
`grouped_experts` then runs one gate-up GEMM and one down GEMM per expert that received rows
(the loop is over the active experts, at most min(E, T * k)). `padded_experts` is the other
shape of the same computation, one batched GEMM over the active experts' rows padded to the
largest group; bench/moe.py measures both (the grouped one is what the layer runs on the CPU).
`reference_experts` is the plain definition, for tests.

Weights stay in the checkpoint's layout: w13 [E, 2I, H] holding [gate; up] rows, w2 [E, H, I].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.layers.activation import silu_and_mul

# (expert, rows [n, in]) -> rows [n, out]: one expert's projection, however its weight is stored
ExpertGemm = Callable[[int, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SortedRoutes:
    """The T * k (token, expert) pairs ordered by expert."""

    order: torch.Tensor  # [T*k] positions in the flattened [T, k] routes
    tokens: torch.Tensor  # [T*k] the token of each sorted pair
    groups: list[tuple[int, int, int]]  # (expert, start, stop) of each active expert's rows


def sort_routes(ids: torch.Tensor, num_experts: int) -> SortedRoutes:
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    groups, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            groups.append((expert, start, start + count))
            start += count
    return SortedRoutes(order, order // ids.shape[1], groups)


def combine(
    x: torch.Tensor, routes: SortedRoutes, weights: torch.Tensor, rows_out: torch.Tensor
) -> torch.Tensor:
    """Sum each token's expert outputs (sorted rows) scaled by their routing weights."""
    scale = weights.reshape(-1).index_select(0, routes.order).unsqueeze(-1)
    scaled = (rows_out.float() * scale).to(x.dtype)
    out = torch.zeros(x.shape[0], rows_out.shape[-1], dtype=x.dtype, device=x.device)
    return out.index_add_(0, routes.tokens, scaled)


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    gate_up: ExpertGemm,
    down: ExpertGemm,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """x [T, H], routing weights/ids [T, k] -> [T, H]: one GEMM pair per active expert, the
    gate-up output activated by `activation` (silu(gate) * up over [gate; up] by default)."""
    routes = sort_routes(ids, num_experts)
    if not routes.groups:
        return torch.zeros_like(x)
    rows = x.index_select(0, routes.tokens)
    outputs = [
        down(expert, activation(gate_up(expert, rows[start:stop])))
        for expert, start, stop in routes.groups
    ]
    return combine(x, routes, weights, torch.cat(outputs))


def plain_gemms(w13: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertGemm, ExpertGemm]:
    """The full-precision projections of stacked expert weights."""
    return (lambda e, rows: F.linear(rows, w13[e])), (lambda e, rows: F.linear(rows, w2[e]))


def padded_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The same as grouped_experts over plain weights, as two batched GEMMs over the active
    experts' rows padded to the largest group (the weights of the active experts gathered)."""
    routes = sort_routes(ids, w13.shape[0])
    if not routes.groups:
        return torch.zeros_like(x)
    longest = max(stop - start for _, start, stop in routes.groups)
    active = torch.tensor([expert for expert, _, _ in routes.groups])
    slots = torch.full((len(routes.groups), longest), -1, dtype=torch.int64)
    for i, (_, start, stop) in enumerate(routes.groups):
        slots[i, : stop - start] = torch.arange(start, stop)
    valid = slots >= 0
    sorted_rows = x.index_select(0, routes.tokens)
    padded = sorted_rows.index_select(0, slots.clamp(min=0).reshape(-1)).view(
        len(routes.groups), longest, -1
    )
    hidden = silu_and_mul(torch.bmm(padded, w13.index_select(0, active).transpose(1, 2)))
    out = torch.bmm(hidden, w2.index_select(0, active).transpose(1, 2))
    rows_out = out.reshape(-1, out.shape[-1])[valid.reshape(-1)]
    return combine(x, routes, weights, rows_out)


def reference_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The definition, token by token and slot by slot (tests only)."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            gate, up = F.linear(x[t].float(), w13[e].float()).chunk(2)
            out[t] += weights[t, slot].float() * F.linear(F.silu(gate) * up, w2[e].float())
    return out.to(x.dtype)
