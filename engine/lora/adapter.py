"""Reading and checking a PEFT LoRA adapter against the base model, before it may serve.

PEFT saves `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors` with, per adapted projection, lora_A [r, in] and lora_B [out, r]
under names like `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`. The
adapted projection computes base(x) + scaling * B(A(x)), scaling = lora_alpha / r
(lora_alpha / sqrt(r) with rsLoRA); the scaling is folded into B here.

Every failure is a LoRAAdapterError that names the adapter and the problem.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.lora.request import LoRAAdapterError, LoRARequest
from engine.lora.targets import SUPPORTED_TARGETS, Target, find_target
from engine.models.interface import CausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_TENSOR_NAME = re.compile(
    r"(?:^|\.)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+?)\.lora_(?P<ab>[AB])\.weight$"
)
# Config values PEFT writes that change the math in ways not implemented here.
_UNSUPPORTED_CONFIG: dict[str, object] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
}


@dataclass(frozen=True)
class AdaptedProjection:
    """One projection's LoRA weights: a [rank, in], b [out, rank] with the scaling folded in."""

    target: Target
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoRAAdapter:
    request: LoRARequest
    rank: int
    projections: tuple[AdaptedProjection, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.projections)


def load_adapter(request: LoRARequest, model: CausalLM, max_rank: int) -> LoRAAdapter:
    """The adapter at request.lora_path, checked against `model` (float32 on the CPU)."""
    folder = Path(request.lora_path)
    fail = _failer(request)
    if not folder.is_dir():
        raise fail(f"no adapter folder at {folder}")
    config = _read_config(folder / CONFIG_FILE, fail)
    rank = _int_field(config, "r", fail)
    if rank < 1:
        raise fail(f"rank r={rank} must be at least 1")
    if rank > max_rank:
        raise fail(f"rank {rank} exceeds max_lora_rank {max_rank}")
    # 8 is PEFT's default; save_pretrained writes the value anyway.
    alpha = _number_field(config, "lora_alpha", 8.0, fail)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    for key, plain in _UNSUPPORTED_CONFIG.items():
        if config.get(key, plain) != plain:
            raise fail(f"{key}={config[key]!r} is not supported (only {plain!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise fail(f"per-module {key} is not supported")
    if config.get("modules_to_save"):
        raise fail(f"modules_to_save {config['modules_to_save']} is not supported")
    tensors = _read_tensors(folder / WEIGHTS_FILE, fail)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.search(name)
        if match is None or match["proj"] not in SUPPORTED_TARGETS:
            raise fail(
                f"unsupported target {name!r}: only the decoder layers' "
                f"{', '.join(SUPPORTED_TARGETS)} are adapted"
            )
        pairs.setdefault((int(match["layer"]), match["proj"]), {})[match["ab"]] = tensor
    projections = []
    for (layer, proj), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{proj}"
        target = find_target(model, layer, proj)
        if target is None:
            raise fail(f"unsupported target {where}: the base model has no such dense layer")
        if set(ab) != {"A", "B"}:
            raise fail(f"{where} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        _check_shape(fail, where, "lora_A", a, (rank, target.in_features))
        _check_shape(fail, where, "lora_B", b, (target.out_features, rank))
        for part, tensor in (("lora_A", a), ("lora_B", b)):
            if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
                raise fail(f"bad tensor {where}.{part}: not finite floating-point values")
        projections.append(AdaptedProjection(target, a.float(), b.float() * scaling))
    if not projections:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(request, rank, tuple(projections))


def _failer(request: LoRARequest) -> type[LoRAAdapterError]:
    prefix = f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}): "

    class _Failure(LoRAAdapterError):
        def __init__(self, message: str) -> None:
            super().__init__(prefix + message)

    return _Failure


def _read_config(path: Path, fail: type[LoRAAdapterError]) -> dict[str, object]:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise fail(f"missing {path.name} in {path.parent}") from None
    except (OSError, ValueError) as exc:
        raise fail(f"unreadable {path.name}: {exc}") from None
    if not isinstance(config, dict):
        raise fail(f"{path.name} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type {peft_type!r} is not LORA")
    return config


def _int_field(config: dict[str, object], key: str, fail: type[LoRAAdapterError]) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise fail(f"{CONFIG_FILE} needs an integer {key!r}, got {value!r}")
    return value


def _number_field(
    config: dict[str, object], key: str, default: float, fail: type[LoRAAdapterError]
) -> float:
    value = config.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise fail(f"{CONFIG_FILE} needs a number {key!r}, got {value!r}")
    return float(value)


def _read_tensors(path: Path, fail: type[LoRAAdapterError]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise fail(f"missing {path.name} in {path.parent}")
    try:
        return load_file(str(path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise fail(f"bad tensors in {path.name}: {exc}") from None


def _check_shape(
    fail: type[LoRAAdapterError],
    where: str,
    part: str,
    tensor: torch.Tensor,
    expected: tuple[int, int],
) -> None:
    if tuple(tensor.shape) != expected:
        raise fail(
            f"wrong base shape: {where}.{part} is {list(tensor.shape)} but the base model needs "
            f"{list(expected)} (an adapter for another model?)"
        )
