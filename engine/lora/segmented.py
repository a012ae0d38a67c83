"""Where a layer's batched LoRA term is computed: on CUDA by the Triton kernel (kernels.lora),
elsewhere by the slots' own torch path (engine.lora.batched).

A step's row mapping already sorts the adapted rows by slot into segments; the kernel reads
them as three small device tensors, built once per mapping (a step has one or two mappings,
shared by every layer) rather than once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.lora.batched import LoRASlots, RowMapping


@dataclass(frozen=True)
class SegmentTensors:
    slots: torch.Tensor  # int32 [segments]
    starts: torch.Tensor  # int32 [segments]: where each begins in the mapping's order
    lengths: torch.Tensor  # int32 [segments]
    longest: int


class _SegmentCache:
    """The segment tensors of the last few mappings, by identity (a held mapping's id cannot
    be reused by another object while it is held here)."""

    def __init__(self, size: int = 4) -> None:
        self._size = size
        self._entries: dict[int, tuple[RowMapping, SegmentTensors]] = {}

    def of(self, mapping: RowMapping) -> SegmentTensors:
        entry = self._entries.get(id(mapping))
        if entry is not None and entry[0] is mapping:
            return entry[1]
        segments = mapping.segments
        table = torch.tensor(
            [
                [s.slot for s in segments],
                [s.start for s in segments],
                [s.end - s.start for s in segments],
            ],
            dtype=torch.int32,
        ).to(mapping.order.device)
        tensors = SegmentTensors(
            table[0], table[1], table[2], max((s.end - s.start for s in segments), default=0)
        )
        if len(self._entries) >= self._size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[id(mapping)] = (mapping, tensors)
        return tensors


_segments = _SegmentCache()


def add_lora_terms(slots: LoRASlots, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (the base layer's x @ W.T) plus each adapted row's LoRA term."""
    if not x.is_cuda:
        return slots.add_to(x, out)
    if not slots.active():
        return out
    return add_segmented(slots, slots.step.for_rows(x.shape[0]), x, out)


def add_segmented(
    slots: LoRASlots, mapping: RowMapping, x: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """out (the base layer's output) plus each adapted row's LoRA term, added in place by the
    Triton kernel. A slot whose adapter leaves this layer alone holds zeros: its rows get a
    zero term."""
    from kernels.lora import lora_shrink_expand

    tensors = _segments.of(mapping)
    return lora_shrink_expand(
        x.reshape(-1, x.shape[-1]),
        slots.a,
        slots.b_t,
        out.view(-1, out.shape[-1]),
        mapping.order,
        tensors.slots,
        tensors.starts,
        tensors.lengths,
        tensors.longest,
        slots.columns,
    ).view(out.shape)
