"""Writers of GPTQ and AWQ checkpoint folders for tests, from an fp32 HF folder.

Each writer quantizes the attention and MLP linears by round-to-nearest (no calibration: the
point is the on-disk layout, not the accuracy), packs them exactly as the quantizers' exporters
do, writes fp16 copies of every other tensor, a config.json with `quantization_config`, and the
tokenizer files; it returns the weights it meant to store, dequantized by itself from its own
q, scale and zero *before* packing, so a reader is checked against the format's arithmetic and
not against its own unpacking.

- `write_gptq_checkpoint`: AutoGPTQ's "gptq" (v1) layout: `qweight` int32 [in * bits / 32, out]
  (inputs packed, lowest bits first), `qzeros` int32 [groups, out * bits / 32] holding zero - 1,
  `scales` fp16 [groups, out], `g_idx` int32 [in]; with `desc_act=True` the inputs are grouped
  in a random order (the act-order permutation), as `g_idx` then records.
- `write_awq_checkpoint`: AutoAWQ's "gemm" layout: `qweight` int32 [in, out / 8] and `qzeros`
  int32 [groups, out / 8], outputs packed in the order 0, 2, 4, 6, 1, 3, 5, 7; asymmetric.

`num_layers` keeps only the first layers (and says so in config.json): a small, still loadable
model for fast tests.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# AutoAWQ's pack order: nibble k of a word holds output 8c + AWQ_PACK_ORDER[k]. Written out
# here from the AutoAWQ exporter, independently of the reader's constant.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_LINEAR = re.compile(
    r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# q/k/v_proj read one input, gate/up_proj another: the name up to the projection kind.
_SHARED_INPUT = re.compile(r"(.*\.(self_attn\.|mlp\.))(q|k|v|gate|up)_proj$")


@dataclass
class WrittenCheckpoint:
    folder: Path
    quantization_config: dict[str, object]
    # HF weight name -> the fp32 weight the writer stored (scale * (q - zero), natural order).
    references: dict[str, torch.Tensor] = field(default_factory=dict)
    # HF weight name -> the largest |zero * scale| of the tensor: the in-memory form rounds the
    # minimum -zero * scale to fp16 once, so readers may differ by half an fp16 ulp of it.
    largest_offsets: dict[str, float] = field(default_factory=dict)


def write_gptq_checkpoint(
    source: Path,
    destination: Path,
    *,
    bits: int = 4,
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    num_layers: int | None = None,
    seed: int = 0,
) -> WrittenCheckpoint:
    """A GPTQ (v1) folder quantized from the fp32 folder `source` (see the module doc)."""
    config = {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
        "sym": sym, "checkpoint_format": "gptq", "damp_percent": 0.01, "true_sequential": True,
    }  # fmt: skip
    written = WrittenCheckpoint(destination, config)
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in _source_tensors(source, num_layers):
        if not _LINEAR.match(name):
            tensors[name] = weight.half()
            continue
        prefix = name.removesuffix(".weight")
        # Act-order sorts inputs by their Hessian, which projections reading the same input
        # (q/k/v, gate/up) share: one permutation per layer and input.
        layer_input = _SHARED_INPUT.sub(r"\1", name.removesuffix(".weight"))
        packed, reference, offset = _gptq_pack(
            weight, bits, group_size, desc_act, sym, seed + zlib.crc32(layer_input.encode())
        )
        tensors.update({f"{prefix}.{part}": value for part, value in packed.items()})
        written.references[name], written.largest_offsets[name] = reference, offset
    _write_folder(source, destination, tensors, config, num_layers)
    return written


def write_awq_checkpoint(
    source: Path, destination: Path, *, group_size: int = 64, num_layers: int | None = None
) -> WrittenCheckpoint:
    """An AWQ "gemm" folder quantized from the fp32 folder `source` (see the module doc)."""
    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
    }
    written = WrittenCheckpoint(destination, config)
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in _source_tensors(source, num_layers):
        if not _LINEAR.match(name):
            tensors[name] = weight.half()
            continue
        prefix = name.removesuffix(".weight")
        out_features, in_features = weight.shape
        g_idx = torch.arange(in_features) // group_size
        q, scales, zeros = _round_to_nearest(weight, g_idx, 4, sym=False)
        # q [in, out] and zeros [groups, out], outputs in AWQ's interleaved order within a word.
        tensors[f"{prefix}.qweight"] = _pack_last(q.T[:, _awq_columns(out_features)], 4)
        tensors[f"{prefix}.qzeros"] = _pack_last(zeros[:, _awq_columns(out_features)], 4)
        tensors[f"{prefix}.scales"] = scales.half()
        written.references[name] = _reference(q, scales, zeros, g_idx)
        written.largest_offsets[name] = float((zeros.float() * scales.float()).abs().max())
    _write_folder(source, destination, tensors, config, num_layers)
    return written


def _gptq_pack(
    weight: torch.Tensor,
    bits: int,
    group_size: int,
    desc_act: bool,
    sym: bool,
    seed: int,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, float]:
    in_features = weight.shape[1]
    size = in_features if group_size == -1 else group_size
    if desc_act:  # input perm[k] is the k-th quantized: its group is k // size
        perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(in_features, dtype=torch.int64)
        g_idx[perm] = torch.arange(in_features) // size
    else:
        g_idx = torch.arange(in_features) // size
    # v1 stores zero - 1, so a zero point of 0 cannot be written (AutoGPTQ's known wrap).
    q, scales, zeros = _round_to_nearest(weight, g_idx, bits, sym, lowest_zero=1)
    packed = {
        "qweight": _pack_last(q, bits).T.contiguous(),  # inputs packed: [in*bits/32, out]
        "qzeros": _pack_last(zeros - 1, bits),  # v1 stores zero - 1
        "scales": scales.half(),
        "g_idx": g_idx.to(torch.int32),
    }
    offset = float((zeros.float() * scales.float()).abs().max())
    return packed, _reference(q, scales, zeros, g_idx), offset


def _round_to_nearest(
    weight: torch.Tensor, g_idx: torch.Tensor, bits: int, sym: bool, lowest_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q int64 [out, in], scales fp32 (fp16-exact) [groups, out], zeros int64 [groups, out].

    AutoGPTQ's rule: the range always spans 0; symmetric ranges are [-amax, amax] with the zero
    point in the middle (8 for 4 bits, 128 for 8).
    """
    w = weight.float().T  # [in, out]: groups gather rows
    groups = int(g_idx.max()) + 1
    index = g_idx[:, None].expand_as(w)
    high = torch.zeros(groups, w.shape[1]).scatter_reduce(0, index, w, "amax")
    low = torch.zeros(groups, w.shape[1]).scatter_reduce(0, index, w, "amin")
    top = (1 << bits) - 1
    if sym:
        amax = torch.maximum(high, -low)
        scales = (2 * amax / top).clamp(min=1e-5).half().float()
        zeros = torch.full_like(scales, (top + 1) // 2, dtype=torch.int64)
    else:
        scales = ((high - low) / top).clamp(min=1e-5).half().float()
        zeros = torch.round(-low / scales).clamp(lowest_zero, top).to(torch.int64)
    q = torch.round(w / scales[g_idx]) + zeros[g_idx]
    return q.clamp(0, top).to(torch.int64).T.contiguous(), scales, zeros


def _reference(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """scale * (q - zero), per input's group: [out, in] fp32."""
    return (scales[g_idx].T * (q - zeros[g_idx].T).float()).contiguous()


def _pack_last(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers [rows, n] -> int32 [rows, n * bits / 32]: value k of a word at bit k * bits."""
    per_word = 32 // bits
    grouped = values.to(torch.int64).reshape(values.shape[0], -1, per_word)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (grouped << shifts).sum(dim=-1)
    return (((words + 2**31) % 2**32) - 2**31).to(torch.int32)  # two's complement int32


def _awq_columns(out_features: int) -> torch.Tensor:
    """Output columns in AWQ's stored order: word c, nibble k holds output 8c + order[k]."""
    base = torch.arange(0, out_features, 8)[:, None]
    return (base + torch.tensor(AWQ_PACK_ORDER)).reshape(-1)


def _source_tensors(source: Path, num_layers: int | None) -> list[tuple[str, torch.Tensor]]:
    kept = []
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            layer = _LAYER.match(name)
            if num_layers is not None and layer and int(layer.group(1)) >= num_layers:
                continue
            kept.append((name, f.get_tensor(name)))
    return kept


def _write_folder(
    source: Path,
    destination: Path,
    tensors: dict[str, torch.Tensor],
    quantization_config: dict[str, object],
    num_layers: int | None,
) -> None:
    destination.mkdir(parents=True, exist_ok=True)
    save_file(tensors, destination / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    config["torch_dtype"] = "float16"
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    (destination / "config.json").write_text(json.dumps(config, indent=2))
    for file in source.iterdir():
        copied = (
            file.suffix not in (".safetensors", ".gguf")
            and file.name != "config.json"
            and not file.name.startswith(".")
        )
        if file.is_file() and copied:  # tokenizer, chat template, generation config
            shutil.copy2(file, destination / file.name)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def write_fp8_checkpoint(
    source: Path,
    destination: Path,
    *,
    layout: str,
    block: tuple[int, int] = (128, 128),
    input_scale: float = 0.05,
    num_layers: int | None = None,
    linears: re.Pattern[str] = _LINEAR,
) -> WrittenCheckpoint:
    """An fp8 folder quantized from the fp32 folder `source`, as the published exporters lay it
    out; `layout` is one of:

    - "fp8-block": transformers' FineGrainedFP8 / DeepSeek-V3: quant_method "fp8",
      `weight_block_size` `block`, `weight_scale_inv` float32 [ceil(out/bo), ceil(in/bi)].
    - "ct-channel": compressed-tensors "float-quantized", per-channel `weight_scale` [out, 1],
      dynamic per-token input activations (no input_scale).
    - "ct-tensor-static": compressed-tensors, per-tensor `weight_scale` [1] and a static
      `input_scale` [1] of `input_scale`.

    References are q * scale in fp32 with the scale each element's block, channel or tensor has.
    `linears`: the names of the 2-D weights to quantize (default: attention and MLP projections).
    """
    layouts = {
        "fp8-block": _fp8_block_config(block),
        "ct-channel": _compressed_tensors_config("channel", dynamic=True),
        "ct-tensor-static": _compressed_tensors_config("tensor", dynamic=False),
    }
    config = layouts[layout]
    written = WrittenCheckpoint(destination, config)
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in _linears_keeping_the_rest(source, num_layers, tensors, linears):
        prefix = name.removesuffix(".weight")
        w = weight.float()
        if layout == "fp8-block":
            scale = _block_scales(w, block)
            per_element = scale.repeat_interleave(block[0], 0)[: w.shape[0]]
            per_element = per_element.repeat_interleave(block[1], 1)[:, : w.shape[1]]
            tensors[f"{prefix}.weight_scale_inv"] = scale
        elif layout == "ct-channel":
            scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            per_element = scale.expand_as(w)
            tensors[f"{prefix}.weight_scale"] = scale
        else:
            scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12).reshape(1)
            per_element = scale.expand_as(w)
            tensors[f"{prefix}.weight_scale"] = scale
            tensors[f"{prefix}.input_scale"] = torch.tensor([input_scale])
        q = (w / per_element).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        tensors[name] = q
        written.references[name] = q.float() * per_element
    _write_folder(source, destination, tensors, config, num_layers)
    return written


def _linears_keeping_the_rest(
    source: Path,
    num_layers: int | None,
    kept: dict[str, torch.Tensor],
    pattern: re.Pattern[str] = _LINEAR,
) -> list[tuple[str, torch.Tensor]]:
    """The 2-D weights of `source` that `pattern` names; every other tensor goes into `kept`
    as fp16."""
    linears = []
    for name, weight in _source_tensors(source, num_layers):
        if pattern.match(name) and weight.dim() == 2:
            linears.append((name, weight))
        else:
            kept[name] = weight.half()
    return linears


def _block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """One scale per block of w, partial blocks at the ends: amax / 448, float32."""
    rows, inputs = block
    out_features, in_features = w.shape
    padded = torch.zeros(-(-out_features // rows) * rows, -(-in_features // inputs) * inputs)
    padded[:out_features, :in_features] = w.abs()
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // inputs, inputs)
    return (blocks.amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)


def _fp8_block_config(block: tuple[int, int]) -> dict[str, object]:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": ["lm_head"],
    }


def _compressed_tensors_config(weight_strategy: str, *, dynamic: bool) -> dict[str, object]:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**weights, "strategy": weight_strategy},
                "input_activations": {**activations, "strategy": "token" if dynamic else "tensor"},
            }
        },
        "ignore": ["lm_head"],
    }
