"""Published float8 checkpoints, read into the in-memory fp8 `QuantizedWeight`.

Two layouts, both with float8_e4m3fn `<prefix>.weight` [out, in] and the weight `q * scale`:

- quant_method "fp8" (transformers' FineGrainedFP8, DeepSeek-V3's release): `weight_scale_inv`
  float32 [ceil(out / bo), ceil(in / bi)], one scale per block of `weight_block_size` [bo, bi]
  (128x128); despite its name it multiplies. Without a block size: one scale per tensor.
- quant_method "compressed-tensors" (llm-compressor) with `format` "float-quantized" (or
  "naive-quantized") and float 8-bit weights in every config group: `weight_scale` per tensor
  ([1] or []), per channel ([out, 1]) or per block ([out / bo, in / bi], strategy "block" with
  its `block_structure`); `input_scale` [1] where activations are static, none where dynamic.

Blocks become groups of inputs (the largest size splitting both the block width and the input
size), each block's scale repeated over its rows: the same weights, exactly. Every other tensor
(embeddings, norms, an unquantized lm_head) is read as it is stored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.quantization.errors import QuantizationFormatError
from engine.quantization.safetensors_folder import QuantizedSafetensorsFolder
from engine.quantization.weights import FP8, QuantizedWeight

_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Fp8Format:
    """What a config.json `quantization_config` says about the fp8 tensors."""

    scale_suffix: str  # "weight_scale_inv" or "weight_scale"
    block: tuple[int, int] | None  # (rows, inputs) per scale of block-scaled weights

    @classmethod
    def from_config(cls, config: dict[str, object]) -> Fp8Format:
        method = str(config.get("quant_method", "")).lower()
        if method == "fp8":
            return cls("weight_scale_inv", _block_size("weight_block_size", config))
        if method != "compressed-tensors":
            raise QuantizationFormatError(f"quant_method {method!r} is not an fp8 checkpoint")
        layout = config.get("format")
        if layout not in _FLOAT_FORMATS:
            raise QuantizationFormatError(
                f"compressed-tensors format {layout!r} is not supported "
                f"(only {', '.join(_FLOAT_FORMATS)}: 8-bit float weights)"
            )
        groups = config.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise QuantizationFormatError("compressed-tensors config_groups is missing")
        blocks = set()
        for name, group in groups.items():
            weights = group.get("weights") if isinstance(group, dict) else None
            if not isinstance(weights, dict):
                raise QuantizationFormatError(f"config_groups.{name}.weights is missing")
            kind = (weights.get("type"), weights.get("num_bits"))
            if kind != ("float", 8):
                raise QuantizationFormatError(
                    f"config_groups.{name}.weights is {kind[1]}-bit {kind[0]}; "
                    "supported: 8-bit float"
                )
            if weights.get("strategy") == "block":
                blocks.add(_block_size(f"config_groups.{name}.weights.block_structure", weights))
        if len(blocks) > 1:
            raise QuantizationFormatError(f"config_groups use different blocks {sorted(blocks)}")
        return cls("weight_scale", blocks.pop() if blocks else None)


def _block_size(key: str, config: dict[str, object]) -> tuple[int, int] | None:
    value = config.get(key.rsplit(".", 1)[-1])
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        raise QuantizationFormatError(f"{key} {value!r} is not [rows, inputs]")
    return (value[0], value[1])


class Fp8Checkpoint(QuantizedSafetensorsFolder):
    """An fp8 safetensors folder, read like a checkpoint under the loader's names: each
    quantized linear appears as `<prefix>.weight` (`read_quantized`), its scales hidden."""

    def __init__(self, folder: Path, quantization_config: dict[str, object]) -> None:
        super().__init__(folder)
        self.format = Fp8Format.from_config(quantization_config)
        suffix = f".{self.format.scale_suffix}"
        self._prefixes = {
            name.removesuffix(suffix) for name in self._files if name.endswith(suffix)
        }

    def names(self) -> list[str]:
        hidden = {f"{p}.{part}" for p in self._prefixes for part in self._scale_parts()}
        return [name for name in self._files if name not in hidden]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice_shape(name))

    def read_quantized(self, name: str) -> QuantizedWeight:
        prefix = name.removesuffix(".weight")
        if prefix not in self._prefixes or name not in self._files:
            raise QuantizationFormatError(f"{name} is not an fp8 linear of {self.folder}")
        data = self._tensor(name)
        if data.dtype != FP8 or data.dim() != 2:
            raise QuantizationFormatError(
                f"{name} is {data.dtype} {tuple(data.shape)}, not a 2-D float8_e4m3fn tensor"
            )
        scale_name = f"{prefix}.{self.format.scale_suffix}"
        scales, group_size = self._row_scales(scale_name, self._tensor(scale_name).float(), data)
        input_scale = None
        if f"{prefix}.input_scale" in self._files:
            input_scale = self._tensor(f"{prefix}.input_scale").float().reshape(-1)
            if input_scale.numel() != 1:
                raise QuantizationFormatError(
                    f"{prefix}.input_scale has shape {tuple(input_scale.shape)}; "
                    "supported: one static scale per tensor"
                )
        out_features, in_features = data.shape
        return QuantizedWeight(
            8, out_features, in_features, group_size, data, scales, input_scale=input_scale
        )

    def _row_scales(
        self, name: str, scale: torch.Tensor, data: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """The scales as [out, in // group_size] and the group size."""
        out_features, in_features = data.shape
        if scale.numel() == 1:  # per tensor
            return scale.reshape(1, 1).expand(out_features, 1).contiguous(), in_features
        if tuple(scale.shape) in ((out_features, 1), (out_features,)):  # per channel
            return scale.reshape(out_features, 1).contiguous(), in_features
        if self.format.block is None:
            raise QuantizationFormatError(
                f"{name} has shape {tuple(scale.shape)}, not one scale per tensor or channel, "
                "and the config names no block size"
            )
        rows, inputs = self.format.block
        expected = (math.ceil(out_features / rows), math.ceil(in_features / inputs))
        if tuple(scale.shape) != expected:
            raise QuantizationFormatError(
                f"{name} has shape {tuple(scale.shape)}; blocks of {rows}x{inputs} over "
                f"{(out_features, in_features)} make {expected}"
            )
        group_size = math.gcd(in_features, inputs)
        block_of_group = torch.arange(0, in_features, group_size) // inputs
        per_row = scale.repeat_interleave(rows, dim=0)[:out_features]
        return per_row[:, block_of_group].contiguous(), group_size

    def _scale_parts(self) -> tuple[str, ...]:
        return (self.format.scale_suffix, "input_scale")
