"""The LoRA term of a step's rows, batched by adapter slot.

Each adapted base layer holds stacked slot weights: a [slots, parts * max_rank, in] and
b [slots, out, parts * max_rank] (`parts`: one block of rank columns per shard of a fused
layer; b is block-diagonal over them, so [q; k; v] or [gate; up] take their terms in one
matmul). A step sorts its adapted rows by slot once (`LoRAStep`). Where the slots' row counts
are alike (decode: a few rows per adapter) each layer gathers them into one padded
[slots present, longest, in] block and takes every slot's term in two batched matmuls (padding
masked out) and one scatter: a handful of ops per layer whatever the number of adapters. Where
they differ much (a long prompt beside short ones) the padding would cost more than it saves,
and each slot's contiguous segment takes its two matmuls apart instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels import cpu_ops


@dataclass(frozen=True)
class Segment:
    slot: int
    start: int  # its rows are order[start:end]
    end: int


@dataclass(frozen=True)
class PaddedRows:
    """The adapted rows as one [slots present, longest, ...] block: `rows` [slots * longest]
    row indices (a short slot's tail repeats its last row), `mask` [slots, longest, 1] zero on
    that padding (None: no slot is short), `slots` [slots] the slot of each block (None: they
    are 0, 1, ... in order, so a layer's slot stacks are narrowed rather than gathered)."""

    rows: torch.Tensor
    mask: torch.Tensor | None
    slots: torch.Tensor | None
    count: int
    longest: int


@dataclass(frozen=True)
class RowMapping:
    """The rows of one input size: the adapted ones sorted by slot (`order`, int64 row indices,
    in `segments` of one slot each), and as a padded block where that wastes little (`padded`)."""

    order: torch.Tensor
    segments: list[Segment]
    segment_slots: torch.Tensor  # [segments] int64, for the C++ kernel (kernels.cpu_ops.lora_add)
    segment_starts: torch.Tensor  # [segments + 1] int64
    every_row_in_order: bool  # order is 0..rows-1: no gather or scatter needed
    host_order: np.ndarray  # order, in host memory
    dtype: torch.dtype  # of the padded block's mask

    @functools.cached_property
    def padded(self) -> PaddedRows | None:
        """Built on first use: only the torch form on a CPU without the C++ kernels reads it
        (the C++ and Triton kernels read the segments), and every step pays for what it builds."""
        return _padded(self.host_order, self.segments, self.order.device, self.dtype)


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
        device: torch.device,
        dtype: torch.dtype,
    ) -> LoRAStep:
        """token_slots: [T] the slot of each token's adapter, -1 for the base model."""
        used = frozenset(np.unique(token_slots[token_slots >= 0]).tolist())
        if not used:
            return cls()
        step = cls(slots=used)
        step.mappings[len(token_slots)] = _mapping(token_slots, device, dtype)
        if sample_rows is not None:
            picked = token_slots[sample_rows]
            step.mappings[len(sample_rows)] = _mapping(picked, device, dtype)
        return step

    def for_rows(self, num_rows: int) -> RowMapping:
        mapping = self.mappings.get(num_rows)
        if mapping is None:
            raise RuntimeError(
                f"no LoRA row mapping for an input of {num_rows} rows this step "
                f"(rows mapped: {sorted(self.mappings)})"
            )
        return mapping


def _mapping(slots: np.ndarray, device: torch.device, dtype: torch.dtype) -> RowMapping:
    adapted = np.flatnonzero(slots >= 0)
    order = adapted[np.argsort(slots[adapted], kind="stable")]
    sorted_slots = slots[order]
    first_of_slot = np.ones(len(order), dtype=bool)
    np.not_equal(sorted_slots[1:], sorted_slots[:-1], out=first_of_slot[1:])
    starts = np.append(np.flatnonzero(first_of_slot), len(order))
    segment_slots = sorted_slots[starts[:-1]]
    bounds = starts.tolist()
    segments = [
        Segment(slot, start, end)
        for slot, start, end in zip(segment_slots.tolist(), bounds[:-1], bounds[1:], strict=True)
    ]
    in_order = len(order) == len(slots) and bool(np.all(order == np.arange(len(slots))))
    return RowMapping(
        torch.from_numpy(order).to(device),
        segments,
        torch.from_numpy(segment_slots).to(device),
        torch.from_numpy(starts).to(device),
        in_order,
        order,
        dtype,
    )


# On the CPU one C++ call adds every slot's terms (where the kernels are built); the torch forms
# below serve CUDA and a CPU without them.
_NATIVE_TERMS = True

# The padded block's wasted rows cost arithmetic; the per-slot form costs a few ops per slot
# (its matmuls launched apart). Padding is taken while it wastes at most this many rows per
# real row plus this many per slot: decode steps (a row or so per sequence) always pad, a
# step with one long prompt among short ones does not.
_PADDING_PER_ROW = 1.0
_PADDING_PER_SLOT = 16


def _padded(
    order: np.ndarray, segments: list[Segment], device: torch.device, dtype: torch.dtype
) -> PaddedRows | None:
    count = len(segments)
    if not count:
        return None
    longest = max(segment.end - segment.start for segment in segments)
    wasted = count * longest - len(order)
    if wasted > _PADDING_PER_ROW * len(order) + _PADDING_PER_SLOT * count:
        return None
    rows = np.empty((count, longest), dtype=np.int64)
    mask = np.zeros((count, longest, 1), dtype=np.float32)
    for index, segment in enumerate(segments):
        length = segment.end - segment.start
        rows[index, :length] = order[segment.start : segment.end]
        rows[index, length:] = order[segment.end - 1]
        mask[index, :length] = 1.0
    slots = np.array([segment.slot for segment in segments], dtype=np.int64)
    return PaddedRows(
        torch.from_numpy(rows.reshape(-1)).to(device),
        None if not wasted else torch.from_numpy(mask).to(device=device, dtype=dtype),
        None if np.array_equal(slots, np.arange(count)) else torch.from_numpy(slots).to(device),
        count,
        longest,
    )


class LoRASlots:
    """One base layer's resident adapter weights and the step they are applied in.

    Slot s holds rows [s * columns, (s + 1) * columns) of a [slots * columns, in] and of
    b_t [slots * columns, out] (b transposed, so one slot's part is contiguous too): viewed as
    [slots, columns, ...] stacks for the batched matmuls of a padded block, and one slot's
    part a contiguous view for its own two matmuls."""

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
        # The outputs [lo, hi) each slot's column reaches (b_t is zero elsewhere: a fused
        # layer's shards take their own columns), for the C++ kernel to skip the rest.
        self.spans = torch.zeros(num_slots * columns, 2, dtype=torch.int64, device=device)
        self.targeted = [False] * num_slots  # whether the slot's adapter adapts this layer
        self._step_of = step_of
        # Views of the stacks (written in place, so they stay valid), made once: a decode step
        # hands every layer's to the C++ stack.
        self._native = (
            self.a.view(num_slots, columns, -1),
            self.b_t.view(num_slots, columns, -1),
            self.spans.view(num_slots, columns, 2),
        )

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

    @property
    def current_step(self) -> LoRAStep:
        return self._step_of.current

    def _columns(self, slot: int) -> slice:
        return slice(slot * self.columns, (slot + 1) * self.columns)

    def clear(self, slot: int) -> None:
        self.a[self._columns(slot)].zero_()
        self.b_t[self._columns(slot)].zero_()
        self.spans[self._columns(slot)].zero_()
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
        self.spans[columns] = torch.tensor([rows.start, rows.stop], dtype=torch.int64)
        self.targeted[slot] = True

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """a and b_t as [slots, columns, in] and [slots, columns, out]: one slot a block."""
        return (
            self.a.view(self.num_slots, self.columns, -1),
            self.b_t.view(self.num_slots, self.columns, -1),
        )

    def native_stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacks and spans [slots, columns, 2] as the C++ kernel takes them."""
        return self._native

    def padded_terms(self, x: torch.Tensor, padded: PaddedRows) -> torch.Tensor:
        """The LoRA terms [slots * longest, out] of the padded block's rows (zero on padding);
        the C++ decode stack computes them with the same ops (kernels/cpu/decode_stack.cpp)."""
        a, b_t = self.stacks()
        if padded.slots is None:
            a, b_t = a[: padded.count], b_t[: padded.count]
        else:
            a, b_t = a.index_select(0, padded.slots), b_t.index_select(0, padded.slots)
        block = x.index_select(0, padded.rows).view(padded.count, padded.longest, -1)
        hidden = torch.bmm(block, a.transpose(1, 2))
        if padded.mask is not None:
            hidden.mul_(padded.mask)
        return torch.bmm(hidden, b_t).view(padded.count * padded.longest, -1)

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
        if _NATIVE_TERMS and x.device.type == "cpu" and cpu_ops.cpu_kernels_available():
            a, b_t, spans = self.native_stacks()
            return cpu_ops.lora_add(
                out, x, a, b_t, spans, mapping.order, mapping.segment_slots, mapping.segment_starts
            )
        if mapping.padded is not None:
            return out.index_add_(0, mapping.padded.rows, self.padded_terms(x, mapping.padded))
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
