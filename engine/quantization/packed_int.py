"""The gptq and awq schemes: int32-packed integer weights, read into `QuantizedWeight`.

Both store, per quantized linear `<prefix>`, `qweight` and `qzeros` (int32 words of packed
integers), `scales` (fp16 [groups, out]) and the weight is `scale * (q - zero)` per group:

- GPTQ (AutoGPTQ / GPTQModel "gptq" format, the one vLLM reads): `qweight` [in * bits / 32, out]
  packed along the inputs, lowest bits first; `qzeros` [groups, out * bits / 32] packed along the
  outputs; `g_idx` [in] the group of each input (unsorted with act-order, `desc_act`). The
  classic format ("gptq", v1) stores `zero - 1`, as AutoGPTQ wrote it and vLLM's and GPTQModel's
  kernels read it (they add the 1 back); GPTQModel's `checkpoint_format: "gptq_v2"` stores the
  zero itself.
- AWQ (AutoAWQ "gemm"): `qweight` [in, out / 8] and `qzeros` [groups, out / 8] both packed along
  the outputs, eight 4-bit values per word in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7
  (AutoAWQ's pack order for its GEMM kernel); groups are consecutive inputs.

Into the in-memory form: inputs are sorted by group (act-order gives an `input_order`), 4-bit
zero points become minimums `-zero * scale` (rounded to fp16 once: exact for the symmetric zero
8), and 8-bit weights must be symmetric (zero 128) since 8-bit `QuantizedWeight` has no mins.
GPTQ's last group may be partial (group 128 over 576 inputs); the in-memory group size is the
largest that splits every checkpoint group evenly, with scales repeated.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from engine.quantization.base import WeightSource
from engine.quantization.errors import QuantizationFormatError
from engine.quantization.safetensors_folder import QuantizedSafetensorsFolder
from engine.quantization.weight_linear import QuantizedWeightLinear
from engine.quantization.weights import Q4_BLOCK, QuantizedWeight, pack_int4

_PACKED_PARTS = ("qweight", "qzeros", "scales", "g_idx")
# AWQ word nibble k holds output 8c + _AWQ_PACK_ORDER[k]; reading nibbles in the inverse order
# gives the outputs in natural order.
_AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNPACK_ORDER = tuple(sorted(range(8), key=_AWQ_PACK_ORDER.__getitem__))  # 0, 4, 1, 5, ...
_GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> amount added to stored zeros


@dataclass(frozen=True)
class PackedIntFormat:
    """What a config.json `quantization_config` says about the packed tensors."""

    method: Literal["gptq", "awq"]
    bits: int
    group_size: int  # -1: one group over all inputs (per output channel)
    zero_offset: int  # added to every stored zero point (GPTQ v1 stores zero - 1)

    @classmethod
    def from_config(cls, config: dict[str, object]) -> PackedIntFormat:
        method = str(config.get("quant_method", "")).lower()
        bits = config.get("bits", config.get("w_bit"))
        group_size = config.get("group_size", config.get("q_group_size", -1))
        if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
            raise QuantizationFormatError(
                f"quantization_config group_size {group_size!r} is not supported"
            )
        if method == "gptq":
            if bits not in (4, 8):
                raise QuantizationFormatError(
                    f"GPTQ bits {bits!r} are not supported (only 4 and 8)"
                )
            checkpoint_format = str(config.get("checkpoint_format", "gptq")).lower()
            if checkpoint_format not in _GPTQ_FORMATS:
                raise QuantizationFormatError(
                    f"GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                    f"(only {', '.join(_GPTQ_FORMATS)})"
                )
            return cls("gptq", bits, group_size, _GPTQ_FORMATS[checkpoint_format])
        if method == "awq":
            if bits != 4:
                raise QuantizationFormatError(f"AWQ bits {bits!r} are not supported (only 4)")
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise QuantizationFormatError(
                    f"AWQ version {version!r} is not supported (only 'gemm')"
                )
            if config.get("zero_point", True) is not True:
                raise QuantizationFormatError("AWQ zero_point false is not supported (only true)")
            return cls("awq", 4, group_size, 0)
        raise QuantizationFormatError(f"quant_method {method!r} is not GPTQ or AWQ")


class PackedIntCheckpoint(QuantizedSafetensorsFolder):
    """A GPTQ or AWQ safetensors folder, read like a checkpoint under the loader's names.

    Each quantized linear appears as `<prefix>.weight` (in `quantized_names()`, read with
    `read_quantized`); every other tensor (embeddings, norms, biases, an unquantized lm_head)
    keeps its own name and is read with `shape`/`read_into`.
    """

    def __init__(self, folder: Path, quantization_config: dict[str, object]) -> None:
        super().__init__(folder)
        self.format = PackedIntFormat.from_config(quantization_config)
        self._prefixes = {
            name.removesuffix(".qweight") for name in self._files if name.endswith(".qweight")
        }

    def names(self) -> list[str]:
        names = []
        for name in self._files:
            prefix, _, part = name.rpartition(".")
            if prefix not in self._prefixes:
                names.append(name)
            elif part == "qweight":
                names.append(f"{prefix}.weight")
        return names

    def shape(self, name: str) -> tuple[int, ...]:
        prefix = name.removesuffix(".weight")
        if prefix not in self._prefixes:
            return tuple(self._slice_shape(name))
        rows, columns = self._slice_shape(f"{prefix}.qweight")
        if self.format.method == "gptq":
            return (columns, rows * 32 // self.format.bits)
        return (columns * 32 // self.format.bits, rows)

    def read_quantized(self, name: str) -> QuantizedWeight:
        prefix = name.removesuffix(".weight")
        if prefix not in self._prefixes:
            raise QuantizationFormatError(f"{name} is not a quantized linear of {self.folder}")
        if self.format.method == "gptq":
            return self._read_gptq(prefix)
        return self._read_awq(prefix)

    def _read_gptq(self, prefix: str) -> QuantizedWeight:
        bits = self.format.bits
        qweight, qzeros, scales = (
            self._packed(prefix, part) for part in ("qweight", "qzeros", "scales")
        )
        groups, out_features = scales.shape
        _expect_shape(f"{prefix}.qweight", qweight, (qweight.shape[0], out_features))
        q = _unpack_words(qweight.T.contiguous(), bits).reshape(out_features, -1)
        in_features = q.shape[1]
        _expect_shape(f"{prefix}.qzeros", qzeros, (groups, out_features * bits // 32))
        zeros = _unpack_words(qzeros, bits).reshape(groups, out_features).to(torch.int32)
        zeros += self.format.zero_offset
        g_idx_name = f"{prefix}.g_idx"
        if g_idx_name in self._files:
            g_idx = self._tensor(g_idx_name).to(torch.int64)
            _expect_shape(g_idx_name, g_idx, (in_features,))
        else:  # checkpoints without act-order may leave it out: consecutive groups
            g_idx = torch.arange(in_features) // self._group_size(in_features)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
            raise QuantizationFormatError(f"{g_idx_name} names groups outside 0..{groups - 1}")
        return _to_quantized(prefix, bits, q, zeros, scales, g_idx)

    def _read_awq(self, prefix: str) -> QuantizedWeight:
        qweight, qzeros, scales = (
            self._packed(prefix, part) for part in ("qweight", "qzeros", "scales")
        )
        groups, out_features = scales.shape
        in_features = qweight.shape[0]
        _expect_shape(f"{prefix}.qweight", qweight, (in_features, out_features // 8))
        _expect_shape(f"{prefix}.qzeros", qzeros, (groups, out_features // 8))
        group_size = self._group_size(in_features)
        if in_features % group_size or in_features // group_size != groups:
            raise QuantizationFormatError(
                f"{prefix}.scales has {groups} groups; {in_features} inputs in groups of {group_size} make "
                f"{in_features / group_size:g}"
            )
        unpack_order = torch.tensor(_AWQ_UNPACK_ORDER)
        q = _unpack_words(qweight, 4)[..., unpack_order].reshape(in_features, out_features).T
        zeros = _unpack_words(qzeros, 4)[..., unpack_order].reshape(groups, out_features)
        g_idx = torch.arange(in_features) // group_size
        return _to_quantized(prefix, 4, q, zeros.to(torch.int32), scales, g_idx)

    def _group_size(self, in_features: int) -> int:
        return in_features if self.format.group_size == -1 else self.format.group_size

    def _packed(self, prefix: str, part: str) -> torch.Tensor:
        name = f"{prefix}.{part}"
        if name not in self._files:
            raise QuantizationFormatError(
                f"{self.format.method.upper()} tensor {name} is missing from {self.folder}"
            )
        tensor = self._tensor(name)
        expected = torch.float16 if part == "scales" else torch.int32
        if tensor.dtype != expected or tensor.dim() != 2:
            raise QuantizationFormatError(
                f"{name} is {tensor.dtype} {tuple(tensor.shape)}, not a 2-D {expected} tensor"
            )
        return tensor


class PackedIntLinear(QuantizedWeightLinear):
    """The gptq and awq schemes: a checkpoint whose config.json's quantization_config names
    its format, read as above."""

    source = WeightSource.QUANTIZED_CHECKPOINT

    @classmethod
    def open_checkpoint(cls, model_path: Path) -> PackedIntCheckpoint:
        config = json.loads((model_path / "config.json").read_text())
        return PackedIntCheckpoint(model_path, config["quantization_config"])


def _unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, columns] -> uint8 [rows, columns, 32 / bits]: value k from bit k * bits."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def _expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise QuantizationFormatError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")


def _to_quantized(
    prefix: str,
    bits: int,
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
) -> QuantizedWeight:
    """q [out, in] (0..2^bits-1), zeros/scales [groups, out], g_idx [in] -> QuantizedWeight."""
    out_features, in_features = q.shape
    order = torch.argsort(g_idx, stable=True)
    sorted_groups = g_idx[order]
    boundaries = (torch.nonzero(sorted_groups[1:] != sorted_groups[:-1]).flatten() + 1).tolist()
    group_size = math.gcd(in_features, *boundaries)
    if bits == 4 and group_size % Q4_BLOCK:
        raise QuantizationFormatError(
            f"{prefix}: its groups split the inputs in runs of {group_size}; 4-bit weights need "
            f"runs of a multiple of {Q4_BLOCK}"
        )
    group_of_run = sorted_groups[torch.arange(0, in_features, group_size)]
    run_scales = scales[group_of_run].T.contiguous()  # [out, in / group_size]
    run_zeros = zeros[group_of_run].T
    natural = bool(torch.equal(order, torch.arange(in_features)))
    input_order = None if natural else order
    q_sorted = q.contiguous() if natural else q[:, order].contiguous()  # inputs grouped
    if bits == 4:
        mins = (-(run_zeros.float() * run_scales.float())).half()
        return QuantizedWeight(
            4,
            out_features,
            in_features,
            group_size,
            pack_int4(q_sorted),
            run_scales,
            mins,
            input_order,
        )
    symmetric_zero = 1 << (bits - 1)
    if not bool((run_zeros == symmetric_zero).all()):
        found = int(run_zeros[run_zeros != symmetric_zero][0])
        raise QuantizationFormatError(
            f"{prefix}: 8-bit weights must be symmetric (zero point {symmetric_zero}); found zero point {found}"
        )
    data = (q_sorted.to(torch.int16) - symmetric_zero).to(torch.int8)
    return QuantizedWeight(
        8, out_features, in_features, group_size, data, run_scales, None, input_order
    )
