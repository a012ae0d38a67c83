"""The LoRA term of a step's rows, batched by adapter slot.

Each adapted base layer holds stacked slot weights: a [slots, parts * max_rank, in] and
b [slots, out, parts * max_rank] (`parts`: one block of rank columns per shard of a fused
layer; b is block-diagonal over them, so [q; k; v] or [gate; up] take their terms in one
matmul). A step groups its rows by slot once (`LoRAStep`); each layer then does two matmuls
per adapter present in the step, over that adapter's rows only, whatever the number of
requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class RowGroup:
    slot: int
    rows: torch.Tensor  # int64 row indices of the layer's input
    whole: bool  # every row: no gather or scatter needed


@dataclass
class LoRAStep:
    """The rows of each slot in the current step, for inputs of every row count the forward
    uses: all tokens, and the sampled rows the last layer's o_proj and MLP keep."""

    groups: dict[int, list[RowGroup]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.groups)

    @classmethod
    def of(
        cls, token_slots: np.ndarray, sample_rows: np.ndarray | None, device: torch.device
    ) -> LoRAStep:
        """token_slots: [T] the slot of each token's adapter, -1 for the base model."""
        step = cls()
        if not (token_slots >= 0).any():
            return step
        step.groups[len(token_slots)] = _group(token_slots, device)
        if sample_rows is not None:
            step.groups[len(sample_rows)] = _group(token_slots[sample_rows], device)
        return step

    def for_rows(self, num_rows: int) -> list[RowGroup]:
        groups = self.groups.get(num_rows)
        if groups is None:
            raise RuntimeError(f"no LoRA row mapping for an input of {num_rows} rows this step")
        return groups


def _group(slots: np.ndarray, device: torch.device) -> list[RowGroup]:
    groups = []
    for slot in np.unique(slots[slots >= 0]).tolist():
        rows = np.flatnonzero(slots == slot)
        groups.append(
            RowGroup(int(slot), torch.from_numpy(rows).to(device), len(rows) == len(slots))
        )
    return groups


class LoRASlots:
    """One base layer's resident adapter weights and the step they are applied in."""

    def __init__(
        self,
        num_slots: int,
        in_features: int,
        out_features: int,
        columns: int,
        step_of: StepSource,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.a = torch.zeros(num_slots, columns, in_features, device=device, dtype=dtype)
        self.b = torch.zeros(num_slots, out_features, columns, device=device, dtype=dtype)
        self.targeted = [False] * num_slots  # whether the slot's adapter adapts this layer
        self._step_of = step_of

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes

    @property
    def step_active(self) -> bool:
        """Whether any adapter runs in the current step."""
        return self._step_of.current.active

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.targeted[slot] = False

    def active(self) -> bool:
        """Whether any adapter in this step adapts this layer (else it computes as the base)."""
        step = self._step_of.current
        return step.active and any(
            self.targeted[group.slot] for groups in step.groups.values() for group in groups
        )

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base layer's x @ W.T) plus each adapted row's LoRA term."""
        step = self._step_of.current
        if not step.active:
            return out
        for group in step.for_rows(x.shape[0]):
            if not self.targeted[group.slot]:
                continue
            a, b = self.a[group.slot], self.b[group.slot]
            if group.whole:
                out = out + (x @ a.T) @ b.T
                continue
            rows = x.index_select(0, group.rows)
            out = out.index_add(0, group.rows, (rows @ a.T) @ b.T)
        return out


class StepSource:
    """The step every layer's slots read: set by the runner around each forward."""

    def __init__(self) -> None:
        self.current = LoRAStep()
