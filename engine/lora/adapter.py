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
from engine.lora.targets import (
    EMBED_TOKENS,
    LM_HEAD,
    SUPPORTED_TARGETS,
    EmbeddingTarget,
    Target,
    embedding_target,
    find_target,
    lm_head_target,
)
from engine.models.interface import CausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_TENSOR_NAME = re.compile(
    r"(?:^|\.)layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+?)\.lora_(?P<ab>[AB])\.weight$"
)
_LM_HEAD_NAME = re.compile(r"(?:^|\.)lm_head\.lora_(?P<ab>[AB])\.weight$")
_EMBEDDING_NAME = re.compile(r"(?:^|\.)embed_tokens\.lora_embedding_(?P<ab>[AB])$")
# PEFT saves the base table beside an adapted embedding or lm_head (save_embedding_layers).
_BASE_LAYER_NAME = re.compile(r"(?:^|\.)(?P<module>embed_tokens|lm_head)\.base_layer\.weight$")
_EXPERT_NAME = re.compile(r"\.(?:experts|shared_expert|block_sparse_moe)\.")
# Config values PEFT writes that change the math in ways not implemented here.
_UNSUPPORTED_CONFIG: dict[str, object] = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
}


@dataclass(frozen=True)
class AdaptedProjection:
    """One projection's LoRA weights: a [rank, in], b [out, rank] with the scaling folded in
    (an embedding's: a [rank, vocab], b [hidden, rank])."""

    target: Target | EmbeddingTarget
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
        place = _place_of(name, fail)
        if place is None:
            _check_saved_base_layer(model, name, tensor, fail)
            continue
        layer, proj, part = place
        pairs.setdefault((layer, proj), {})[part] = tensor
    projections = []
    for (layer, proj), ab in sorted(pairs.items()):
        where = proj if layer < 0 else f"layers.{layer}.{proj}"
        target = _target_of(model, layer, proj)
        if target is None:
            raise fail(f"unsupported target {where}: the base model has no such dense layer")
        if set(ab) != {"A", "B"}:
            raise fail(f"{where} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if isinstance(target, EmbeddingTarget):
            a_shape, b_shape = (rank, target.vocab_size), (target.embedding_dim, rank)
        else:
            a_shape, b_shape = (rank, target.in_features), (target.out_features, rank)
        _check_shape(fail, where, "lora_A", a, a_shape)
        _check_shape(fail, where, "lora_B", b, b_shape)
        for part, tensor in (("lora_A", a), ("lora_B", b)):
            if not tensor.is_floating_point() or not torch.isfinite(tensor).all():
                raise fail(f"bad tensor {where}.{part}: not finite floating-point values")
        if isinstance(target, Target):
            a, b = target.local(a, b)
        projections.append(AdaptedProjection(target, a.float(), b.float() * scaling))
    if not projections:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(request, rank, tuple(projections))


def _place_of(name: str, fail: type[LoRAAdapterError]) -> tuple[int, str, str] | None:
    """(decoder layer, projection, "A" or "B") of a LoRA tensor, layer -1 for lm_head and
    embed_tokens; None for a saved base table."""
    if _BASE_LAYER_NAME.search(name):
        return None
    if _EXPERT_NAME.search(name):
        raise fail(
            f"unsupported target {name!r}: mixture-of-experts experts are not adapted (only "
            "the attention projections and dense MLPs of such a model)"
        )
    match = _TENSOR_NAME.search(name)
    if match is not None and match["proj"] in SUPPORTED_TARGETS:
        return int(match["layer"]), match["proj"], match["ab"]
    for pattern, module in ((_LM_HEAD_NAME, LM_HEAD), (_EMBEDDING_NAME, EMBED_TOKENS)):
        found = pattern.search(name)
        if found is not None:
            return -1, module, found["ab"]
    raise fail(
        f"unsupported target {name!r}: only the decoder layers' "
        f"{', '.join(SUPPORTED_TARGETS)}, {LM_HEAD} and {EMBED_TOKENS} are adapted"
    )


def _target_of(model: CausalLM, layer: int, projection: str) -> Target | EmbeddingTarget | None:
    if projection == LM_HEAD:
        return lm_head_target(model)
    if projection == EMBED_TOKENS:
        return embedding_target(model)
    return find_target(model, layer, projection)


def _check_saved_base_layer(
    model: CausalLM, name: str, tensor: torch.Tensor, fail: type[LoRAAdapterError]
) -> None:
    """A base table PEFT saved beside the adapter must be the base model's own (an adapter
    trained with a resized vocabulary changes it: that is not served)."""
    match = _BASE_LAYER_NAME.search(name)
    assert match is not None
    expected = (model.vocab_size, model.hidden_size)
    if tuple(tensor.shape) != expected:
        raise fail(
            f"wrong base shape: {name} is {list(tensor.shape)} but the base model's "
            f"{match['module']} is {list(expected)} (a resized vocabulary?)"
        )


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
