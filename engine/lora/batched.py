"""The LoRA term of a step's rows, batched by adapter slot.

Each adapted base layer holds stacked slot weights: a [slots, parts * max_rank, in] and
b [slots, out, parts * max_rank] (`parts`: one block of rank columns per shard of a fused
layer; b is block-diagonal over them, so [q; k; v] or [gate; up] take their terms in one
matmul). A step sorts its adapted rows by slot once (`LoRAStep`); each layer then gathers them
in that order, does two matmuls per adapter present in the step on its contiguous segment
(views, no copies), and adds the terms back in one scatter, whatever the number of requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True)
class Segment:
    slot: int
    start: int  # its rows are order[start:end]
    end: int


@dataclass(frozen=True)
class RowMapping:
    """The rows of one input size: the adapted ones sorted by slot (`order`, int64 row indices,
    in `segments` of one slot each), and as a one-hot [rows, slots] matrix."""

    order: torch.Tensor
    segments: list[Segment]
    one_hot: torch.Tensor
    every_row_in_order: bool  # order is 0..rows-1: no gather or scatter needed


@dataclass
class LoRAStep:
    """The rows of each slot in the current step, for inputs of every row count the forward
    uses: all tokens, and the sampled rows the last layer's o_proj and MLP keep."""

    mappings: dict[int, RowMapping] = field(default_factory=dict)
    slots: frozenset[int] = frozenset()  # the slots some row uses

    @property
    def active(self) -> bool:
        return bool(self.slots)

    @classmethod
    def of(
        cls,
        token_slots: np.ndarray,
        sample_rows: np.ndarray | None,
        num_slots: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> LoRAStep:
        """token_slots: [T] the slot of each token's adapter, -1 for the base model."""
        used = frozenset(np.unique(token_slots[token_slots >= 0]).tolist())
        if not used:
            return cls()
        step = cls(slots=used)
        step.mappings[len(token_slots)] = _mapping(token_slots, num_slots, device, dtype)
        if sample_rows is not None:
            picked = token_slots[sample_rows]
            step.mappings[len(sample_rows)] = _mapping(picked, num_slots, device, dtype)
        return step

    def for_rows(self, num_rows: int) -> RowMapping:
        mapping = self.mappings.get(num_rows)
        if mapping is None:
            raise RuntimeError(f"no LoRA row mapping for an input of {num_rows} rows this step")
        return mapping


def _mapping(
    slots: np.ndarray, num_slots: int, device: torch.device, dtype: torch.dtype
) -> RowMapping:
    adapted = np.flatnonzero(slots >= 0)
    order = adapted[np.argsort(slots[adapted], kind="stable")]
    sorted_slots = slots[order]
    starts = np.flatnonzero(np.diff(sorted_slots, prepend=-2))
    ends = [*starts[1:].tolist(), len(order)]
    segments = [
        Segment(int(sorted_slots[start]), int(start), end)
        for start, end in zip(starts.tolist(), ends, strict=True)
    ]
    one_hot: np.ndarray = np.zeros((len(slots), num_slots), dtype=np.float32)
    one_hot[adapted, slots[adapted]] = 1.0
    in_order = len(order) == len(slots) and bool(np.all(order == np.arange(len(slots))))
    return RowMapping(
        torch.from_numpy(order).to(device),
        segments,
        torch.from_numpy(one_hot).to(device=device, dtype=dtype),
        in_order,
    )


# A layer computes every slot's term for every row and masks (two matmuls in all) while that
# costs fewer multiply-adds than this per slot present, else each slot's rows apart (one
# gather, two matmuls per slot, one scatter): per-op overhead against wasted arithmetic.
_MASKED_MACS_PER_SLOT = 1_500_000  # measured on Zen 4 (2 threads), SmolLM2-135M shapes, 8 slots


class LoRASlots:
    """One base layer's resident adapter weights and the step they are applied in.

    Slot s holds rows [s * columns, (s + 1) * columns) of a [slots * columns, in] and of
    b_t [slots * columns, out] (b transposed, so one slot's part is contiguous too), so all
    slots at once are one matmul each, and one slot's are two matmuls on contiguous views."""

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
        self.columns = columns
        self.num_slots = num_slots
        self.a = torch.zeros(num_slots * columns, in_features, device=device, dtype=dtype)
        self.b_t = torch.zeros(num_slots * columns, out_features, device=device, dtype=dtype)
        self.targeted = [False] * num_slots  # whether the slot's adapter adapts this layer
        self._step_of = step_of

    @property
    def nbytes(self) -> int:
        return int(self.a.nbytes + self.b_t.nbytes)

    @property
    def step(self) -> LoRAStep:
        return self._step_of.current

    @property
    def step_active(self) -> bool:
        """Whether any adapter runs in the current step."""
        return self._step_of.current.active

    def _columns(self, slot: int) -> slice:
        return slice(slot * self.columns, (slot + 1) * self.columns)

    def clear(self, slot: int) -> None:
        self.a[self._columns(slot)].zero_()
        self.b_t[self._columns(slot)].zero_()
        self.targeted[slot] = False

    def write(
        self, slot: int, first_column: int, rows: slice, a: torch.Tensor, b: torch.Tensor
    ) -> None:
        """a [rank, in] and b [rows, rank] into slot's columns from first_column on."""
        columns = slice(
            slot * self.columns + first_column, slot * self.columns + first_column + a.shape[0]
        )
        self.a[columns].copy_(a)
        self.b_t[columns, rows].copy_(b.T)
        self.targeted[slot] = True

    def active(self) -> bool:
        """Whether any adapter in this step adapts this layer (else it computes as the base)."""
        return any(self.targeted[slot] for slot in self._step_of.current.slots)

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the base layer's x @ W.T) plus each adapted row's LoRA term."""
        step = self._step_of.current
        present = [slot for slot in step.slots if self.targeted[slot]]
        if not present:
            return out
        mapping = step.for_rows(x.shape[0])
        macs = x.shape[0] * self.a.shape[0] * (self.a.shape[1] + self.b_t.shape[1])
        if macs <= _MASKED_MACS_PER_SLOT * len(present):
            hidden = (x @ self.a.T).view(x.shape[0], self.num_slots, self.columns)
            hidden = hidden * mapping.one_hot[:, :, None]
            return out + hidden.view(x.shape[0], -1) @ self.b_t
        rows = x if mapping.every_row_in_order else x.index_select(0, mapping.order)
        terms = out.new_zeros(rows.shape[0], out.shape[1])
        for segment in mapping.segments:
            if not self.targeted[segment.slot]:
                continue
            columns = self._columns(segment.slot)
            span = slice(segment.start, segment.end)
            torch.matmul(rows[span] @ self.a[columns].T, self.b_t[columns], out=terms[span])
        if mapping.every_row_in_order:
            return out + terms
        return out.index_add(0, mapping.order, terms)


class StepSource:
    """The step every layer's slots read: set by the runner around each forward."""

    def __init__(self) -> None:
        self.current = LoRAStep()
