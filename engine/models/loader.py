"""Build a model on its device and fill its weights: from an HF safetensors folder, or dummy.

The model is built on the meta device (no memory, no random init) and materialized empty on
the target device; every parameter is then written exactly once. Checkpoint tensors named after
separate projections (q/k/v_proj, gate/up_proj) are copied into their row range of the fused
parameter, following the model's `packed_modules`. Only safetensors checkpoints are read.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.layers.linear import MergedLinear
from engine.layers.norm import RMSNorm
from engine.models import model_factory
from engine.models.checkpoint import Checkpoint, SafetensorsCheckpoint, WeightLoadError

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints store the rope table


def build_model(
    hf_config: Any,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    *,
    model_path: Path | None = None,
    load_format: str = "auto",
    seed: int = 0,
) -> nn.Module:
    """Build the model for hf_config on device/dtype, with checkpoint or dummy weights."""
    factory = model_factory(hf_config)
    with _default_dtype(dtype), torch.device("meta"):
        model = factory(hf_config, backend)
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
    model.tie_weights()
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "auto":
        if model_path is None:
            raise ValueError(
                'load_format="auto" needs a model folder; use "dummy" for random weights'
            )
        load_weights(model, SafetensorsCheckpoint(model_path))
    else:
        raise ValueError(f"unknown load_format {load_format!r} (expected auto or dummy)")
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_weights(model: nn.Module, checkpoint: Checkpoint) -> None:
    """Copy checkpoint tensors into the model; raise if any parameter is left unfilled."""
    params = dict(model.named_parameters())  # a tied lm_head is listed under the embedding
    shard_of = {
        checkpoint_name: (fused_name, shard)
        for fused_name, parts in getattr(model, "packed_modules", {}).items()
        for shard, checkpoint_name in enumerate(parts)
    }
    tied = getattr(model, "tie_word_embeddings", False)
    filled: dict[str, set[int]] = {name: set() for name in params}
    with torch.no_grad():
        for name in checkpoint.names():
            if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            target, shard = _target_of(name, shard_of)
            param = params.get(target)
            if param is None:
                logger.warning("checkpoint tensor %s has no place in the model; skipped", name)
                continue
            destination = param.data
            if shard is not None:
                module = model.get_submodule(target.rsplit(".", 1)[0])
                assert isinstance(module, MergedLinear)
                size = module.shard_sizes[shard]
                destination = destination.narrow(0, module.shard_offset(shard), size)
            if tuple(destination.shape) != checkpoint.shape(name):
                raise WeightLoadError(
                    f"{name}: checkpoint shape {checkpoint.shape(name)} != model shape "
                    f"{tuple(destination.shape)}"
                )
            checkpoint.read_into(name, destination)
            filled[target].add(0 if shard is None else shard)
    missing = [name for name, shards in filled.items() if len(shards) < _num_shards(model, name)]
    if missing:
        raise WeightLoadError(
            f"checkpoint lacks weights for {len(missing)} parameters, e.g. {missing[:5]}"
        )


def _target_of(name: str, shard_of: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """Map a checkpoint name to (model parameter name, shard index or None)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in shard_of:
            fused, shard = shard_of[part]
            return ".".join([*parts[:i], fused, *parts[i + 1 :]]), shard
    return name, None


def _num_shards(model: nn.Module, param_name: str) -> int:
    module = model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
    return len(module.shard_sizes) if isinstance(module, MergedLinear) else 1


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of a sane scale, deterministic for a seed on a given device.

    Matrices and biases ~ N(0, initializer_range); norm scales are 1, so activations keep the
    magnitude of a trained model's at init and logits stay finite at any depth.
    """
    std = float(getattr(getattr(model, "config", None), "initializer_range", 0.02) or 0.02)
    generators: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        for _, param in module.named_parameters(recurse=False):
            if isinstance(module, RMSNorm):
                param.data.fill_(1.0)
                continue
            generator = generators.get(param.device)
            if generator is None:
                generator = generators[param.device] = torch.Generator(param.device)
                generator.manual_seed(seed)
            param.data.normal_(0.0, std, generator=generator)
