"""The one in-memory form of a quantized linear weight, whatever checkpoint it came from.

Every scheme (int8 and int4 quantized at load, GGUF blocks, GPTQ, AWQ) converts its tensors into
a `QuantizedWeight` once, at load; the CPU kernels (kernels.quant_ops) and the plain-torch
reference below read only this form.

Layout, for a weight of `out_features` rows and `in_features` inputs, groups of `group_size`
consecutive inputs sharing one scale (and, for 4 bits, one minimum):

- 8 bits: `data` int8 [out, in]; the weight is `q * scale` (q in -128..127).
- 4 bits: `data` uint8 [out, in // 2]; each run of 32 inputs is 16 bytes whose low nibbles hold
  inputs 0..15 and high nibbles inputs 16..31 (GGUF's Q4 block order, so GGUF blocks are used
  as they are); the weight is `q * scale + min` (q in 0..15). Symmetric 4-bit formats (Q4_0,
  GPTQ's zero point) become a minimum: `scale * (q - z) = q * scale + (-z * scale)`.
- `scales` (and `mins`) float16 [out, in // group_size]: half the bytes of fp32 where they are a
  fifth of a 4-bit weight's bytes, and exactly what GGUF, GPTQ and AWQ store.
- fp8: `data` float8_e4m3fn [out, in] and `scales` float32 [out, in // group_size]; the weight
  is `q * scale`, `bits` 8. Quantized at load: one scale per output channel. Read from fp8
  checkpoints: per tensor and per channel become one scale per row; 128x128 blocks become
  groups of inputs with each block's scale repeated over its rows. `input_scale` (float32 [1]):
  a checkpoint's static activation scale (else activations are scaled per row at run time,
  where the kernel quantizes them; engine.quantization.fp8_matmul).
- `int8_activations` (8 bits, one group per row): calls with many rows quantize the activations
  to int8 per row too and multiply integers (W8A8); see engine.quantization.matmul.
- `input_order`: GPTQ's act-order checkpoints group inputs out of order; the loader sorts the
  inputs by group so groups are contiguous, and the activations are gathered in that order
  before the matmul (None: natural order).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

Q4_BLOCK = 32  # inputs per packed 4-bit run: 16 bytes, low nibbles first
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@dataclass
class QuantizedWeight:
    bits: Literal[4, 8]
    out_features: int
    in_features: int
    group_size: int
    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None
    input_order: torch.Tensor | None = None
    int8_activations: bool = False
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        groups = self.in_features // self.group_size
        if self.in_features % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide {self.in_features}")
        if self.int8_activations and (
            self.bits != 8 or self.group_size != self.in_features or self.data.dtype != torch.int8
        ):
            raise ValueError("int8 activations need int8 weights with one scale per row")
        if self.bits == 4:
            if self.group_size % Q4_BLOCK or self.mins is None:
                raise ValueError("4-bit weights need groups of a multiple of 32 and mins")
            expected_data = (self.out_features, self.in_features // 2)
        else:
            expected_data = (self.out_features, self.in_features)
        if tuple(self.data.shape) != expected_data:
            raise ValueError(f"{self.bits}-bit data has shape {tuple(self.data.shape)}")
        for name, part in (("scales", self.scales), ("mins", self.mins)):
            if part is not None and tuple(part.shape) != (self.out_features, groups):
                raise ValueError(
                    f"{name} has shape {tuple(part.shape)}, not {(self.out_features, groups)}"
                )

    @property
    def is_fp8(self) -> bool:
        return self.data.dtype == FP8

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def tensors(self) -> list[torch.Tensor]:
        parts = (self.data, self.scales, self.mins, self.input_order, self.input_scale)
        return [part for part in parts if part is not None]

    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.tensors())

    def to(self, device: torch.device) -> QuantizedWeight:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self, data=self.data.to(device), scales=self.scales.to(device),
            mins=move(self.mins), input_order=move(self.input_order),
            input_scale=move(self.input_scale),
        )  # fmt: skip

    def select_rows(self, start: int, stop: int) -> QuantizedWeight:
        """The weight of output rows start..stop (a shard of a fused projection)."""

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[start:stop].contiguous()

        return replace(
            self, out_features=stop - start, data=self.data[start:stop].contiguous(),
            scales=self.scales[start:stop].contiguous(), mins=rows(self.mins),
        )  # fmt: skip


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8-valued 0..15 [out, in] -> uint8 [out, in // 2] in the 32-input block order."""
    out, inputs = q.shape
    blocks = q.to(torch.uint8).reshape(out, inputs // Q4_BLOCK, 2, Q4_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(out, inputs // 2)


def unpack_int4(data: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [out, in // 2] -> uint8 0..15 [out, in]."""
    out, half = data.shape
    blocks = data.reshape(out, half // (Q4_BLOCK // 2), 1, Q4_BLOCK // 2)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=2).reshape(out, half * 2)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full-precision [out, in] weight, in the natural input order (the reference)."""
    groups = weight.in_features // weight.group_size
    q = unpack_int4(weight.data).float() if weight.bits == 4 else weight.data.float()
    q = q.reshape(weight.out_features, groups, weight.group_size)
    full = q * weight.scales.float()[..., None]
    if weight.mins is not None:
        full = full + weight.mins.float()[..., None]
    full = full.reshape(weight.out_features, weight.in_features)
    if weight.input_order is not None:
        natural = torch.empty_like(full)
        natural[:, weight.input_order] = full
        full = natural
    return full.to(dtype)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8, rounding to nearest."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12).half().float()
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    out, inputs = w.shape
    return QuantizedWeight(8, out, inputs, inputs, q, scale.half())


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> QuantizedWeight:
    """Asymmetric group-wise int4 (min and scale per group of inputs), rounding to nearest."""
    w = weight.detach().float()
    out, inputs = w.shape
    grouped = w.reshape(out, inputs // group_size, group_size)
    low = grouped.amin(dim=-1).half().float()
    scale = ((grouped.amax(dim=-1) - low) / 15).clamp(min=1e-8).half().float()
    q = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15)
    return QuantizedWeight(
        4, out, inputs, group_size, pack_int4(q.reshape(out, inputs)), scale.half(), low.half()
    )


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight of the parts' output rows stacked in order (a fused projection's shards)."""
    first = parts[0]
    for part in parts[1:]:
        if (part.bits, part.group_size) != (first.bits, first.group_size):
            raise ValueError(
                "the projections of one fused layer are quantized differently: "
                f"{first.bits} bits in groups of {first.group_size} and "
                f"{part.bits} bits in groups of {part.group_size}"
            )
        if (
            part.in_features != first.in_features
            or (part.mins is None) != (first.mins is None)
            or part.data.dtype != first.data.dtype
        ):
            raise ValueError("the projections of one fused layer have different layouts")
        same_order = (part.input_order is None and first.input_order is None) or (
            part.input_order is not None
            and first.input_order is not None
            and torch.equal(part.input_order, first.input_order)
        )
        if not same_order:
            raise ValueError(
                "the projections of one fused layer (q/k/v or gate/up) order their inputs "
                "differently (GPTQ act-order g_idx); they read the same input, so their orders "
                "must agree"
            )
    mins = None if first.mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
    # The parts read one input: its static fp8 scale must cover every part's (the largest).
    input_scales = [p.input_scale.reshape(1) for p in parts if p.input_scale is not None]
    input_scale = torch.cat(input_scales).amax().reshape(1) if input_scales else None
    return QuantizedWeight(
        first.bits,
        sum(p.out_features for p in parts),
        first.in_features,
        first.group_size,
        torch.cat([p.data for p in parts]),
        torch.cat([p.scales for p in parts]),
        mins,
        first.input_order,
        input_scale=input_scale,
    )


def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
    """float8_e4m3fn with one float32 scale per output channel (for torch._scaled_mm)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    out, inputs = w.shape
    return QuantizedWeight(8, out, inputs, inputs, (w / scale).to(FP8), scale)
