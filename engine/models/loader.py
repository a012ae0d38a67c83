"""Build a model on its device and fill its weights: from an HF safetensors folder, or dummy.

The model is built on the meta device (no memory, no random init) and materialized empty on
the target device; every parameter is then written exactly once. Checkpoint tensors named after
separate projections (q/k/v_proj, gate/up_proj) are copied into their row range of the fused
parameter, following the model's `weight_mapping`. Only safetensors checkpoints are read.
A tensor-parallel rank reads only the slice of each tensor its layers hold (`checkpoint_slice`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionBackend
from engine.distributed.group import TensorParallel
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import Linear, MergedLinear
from engine.layers.moe import FusedExperts
from engine.layers.norm import RMSNorm
from engine.layers.parallel import ColumnParallelLinear, ShardedLayer, TensorSlice
from engine.models import meta_model
from engine.models.checkpoint import (
    Checkpoint,
    QuantizedCheckpoint,
    SafetensorsCheckpoint,
    WeightLoadError,
)
from engine.models.interface import CausalLM, ExpertTarget
from engine.quantization.base import QuantizedLinearMethod, WeightSource
from engine.quantization.methods import checkpoint_method, quantize_at_load
from engine.quantization.registry import method_class
from engine.quantization.weights import QuantizedWeight, concat_rows

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


def build_model(
    hf_config: PretrainedConfig,
    backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    *,
    model_path: Path | None = None,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    quantization_group_size: int = 32,
    tp: TensorParallel | None = None,
) -> CausalLM:
    """Build the model for hf_config on device/dtype, with checkpoint or dummy weights,
    quantized as `quantization` says (already checked by engine.quantization.resolve_method);
    tp: this rank's shard of a tensor-parallel model."""
    method = None if quantization is None else method_class(quantization)
    if tp is not None and method is not None:
        raise ValueError(
            f"quantization={quantization!r} with tensor_parallel_size={tp.size}: quantized "
            "weights are not sharded across ranks yet; use one of them alone"
        )
    with _default_dtype(dtype):
        model = meta_model(hf_config, backend, tp)
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
        if method is not None and method.reads_checkpoint_of(checkpoint_method(model_path)):
            load_weights(model, method.open_checkpoint(model_path), method)
            method = None  # the checkpoint's quantized tensors are the weights
        else:
            load_weights(model, SafetensorsCheckpoint(model_path))
    else:
        raise ValueError(f"unknown load_format {load_format!r} (expected auto or dummy)")
    if method is not None and method.source is WeightSource.QUANTIZE_AT_LOAD:
        quantize_at_load(model, method, quantization_group_size)
    return model.eval()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_weights(
    model: CausalLM, checkpoint: Checkpoint, method: type[QuantizedLinearMethod] | None = None
) -> None:
    """Copy checkpoint tensors into the model; raise if any parameter is left unfilled.

    Quantized tensors (a QuantizedCheckpoint's) replace their layer's plain weight with the
    scheme `method`'s; the shards of a fused projection are stacked once all are read.
    """
    params = dict(model.named_parameters())  # a tied lm_head is listed under the embedding
    mapping = model.weight_mapping
    quantized_names = (
        checkpoint.quantized_names() if isinstance(checkpoint, QuantizedCheckpoint) else set()
    )
    quantized: dict[str, dict[int, QuantizedWeight]] = {}
    # FusedExperts module -> (param, expert, shard) -> that projection's quantized weight.
    quantized_experts: dict[str, dict[tuple[str, int, int], QuantizedWeight]] = {}
    tied = model.tie_word_embeddings
    filled: dict[str, set[int]] = {name: set() for name in params}
    with torch.no_grad():
        for name in checkpoint.names():
            if (
                mapping.ignores(name)
                or (tied and name == "lm_head.weight")
                or model.skips_checkpoint_tensor(name)
            ):
                continue
            expert = mapping.expert_target(name)
            if expert is not None:
                if name in quantized_names:
                    slot = _read_quantized_expert(
                        model, checkpoint, name, expert, quantized_experts
                    )
                else:
                    slot = _read_expert(model, checkpoint, name, expert)
                filled[expert.param].add(slot)
                continue
            target, shard = mapping.target_of(name)
            param = params.get(target)
            if param is None:
                logger.warning("checkpoint tensor %s has no place in the model; skipped", name)
                continue
            shape = tuple(param.shape)
            module = model.get_submodule(target.rsplit(".", 1)[0]) if "." in target else model
            if shard is not None:
                assert isinstance(module, MergedLinear)
                shape = (module.shard_sizes[shard], *shape[1:])
            piece = (
                module.checkpoint_slice(target.rsplit(".", 1)[-1], shard)
                if isinstance(module, ShardedLayer)
                else None
            )
            if shard is None and isinstance(module, ColumnParallelLinear) and len(module.parts) > 1:
                # The checkpoint stores the fused projection whole (Phi-3's qkv_proj): this
                # rank's rows of each part.
                _read_fused_parts(checkpoint, name, param.data, module)
                filled[target].update(range(len(module.parts)))
                continue
            if piece is not None:  # the checkpoint holds every rank's slice
                shape = (*shape[: piece.dim], piece.full, *shape[piece.dim + 1 :])
            if name in quantized_names:
                weight = checkpoint.read_quantized(name)  # type: ignore[union-attr]
                stored_shape = weight.shape
            else:
                stored_shape = checkpoint.shape(name)
            if stored_shape != shape:
                raise WeightLoadError(
                    f"{name}: checkpoint shape {stored_shape} != model shape {shape}"
                )
            if name in quantized_names:
                quantized.setdefault(target, {})[shard or 0] = weight
            else:
                destination = param.data
                if shard is not None:
                    destination = destination.narrow(
                        0, module.shard_offset(shard), module.shard_sizes[shard]
                    )
                if piece is None:
                    checkpoint.read_into(name, destination)
                else:
                    _read_slice(checkpoint, name, destination, piece)
            if shard is not None:
                filled[target].add(shard)
            else:  # a whole tensor: every shard of a fused parameter stored fused (Phi-3)
                filled[target].update(range(_num_shards(model, target)))
    missing = [name for name, shards in filled.items() if len(shards) < _num_shards(model, name)]
    if missing:
        raise WeightLoadError(
            f"checkpoint lacks weights for {len(missing)} parameters, e.g. {missing[:5]}"
        )
    for target, shards in quantized.items():
        weight = concat_rows([shards[i] for i in sorted(shards)])
        _use_quantized(model, target, weight, tied, method)
    for module_name, pieces in quantized_experts.items():
        _use_quantized_experts(model, module_name, pieces)


def _read_quantized_expert(
    model: CausalLM,
    checkpoint: Checkpoint,
    name: str,
    target: ExpertTarget,
    pieces: dict[str, dict[tuple[str, int, int], QuantizedWeight]],
) -> int:
    """Keep one expert's quantized projection for its module; returns the slot it fills."""
    module_name, param = target.param.rsplit(".", 1)
    module = model.get_submodule(module_name)
    if not isinstance(module, FusedExperts) or not 0 <= target.expert < module.num_experts:
        raise WeightLoadError(f"checkpoint tensor {name} has no expert slot in the model")
    if module.checkpoint_slice(param) is not None:
        raise WeightLoadError(f"{name}: quantized experts are not tensor-parallel")
    weight = checkpoint.read_quantized(name)  # type: ignore[union-attr]
    shape = tuple(module.expert_slot(param, target.expert, target.shard).shape)
    if weight.shape != shape:
        raise WeightLoadError(f"{name}: checkpoint shape {weight.shape} != {shape}")
    shard = target.shard or 0
    pieces.setdefault(module_name, {})[(param, target.expert, shard)] = weight
    return target.expert * (module.slots(param) // module.num_experts) + shard


def _use_quantized_experts(
    model: CausalLM, module_name: str, pieces: dict[tuple[str, int, int], QuantizedWeight]
) -> None:
    """Every expert's projections of one FusedExperts, stacked as its kernels read them."""
    module = model.get_submodule(module_name)
    assert isinstance(module, FusedExperts)
    w13_shards = module.slots("w13") // module.num_experts
    expected = {("w13", e, s) for e in range(module.num_experts) for s in range(w13_shards)}
    expected |= {("w2", e, 0) for e in range(module.num_experts)}
    if set(pieces) != expected:
        missing = sorted(expected - set(pieces))[:3]
        raise WeightLoadError(
            f"{module_name}: some expert projections are quantized and others not, e.g. {missing}"
        )
    w13 = [
        concat_rows([pieces[("w13", e, s)] for s in range(w13_shards)])
        for e in range(module.num_experts)
    ]
    module.use_quantized(w13, [pieces[("w2", e, 0)] for e in range(module.num_experts)])


def _read_expert(model: CausalLM, checkpoint: Checkpoint, name: str, target: ExpertTarget) -> int:
    """Copy one expert's projection into its place in the stacked expert weights (this rank's
    slice of it under tensor parallelism); returns the slot it filled."""
    module_name, param = target.param.rsplit(".", 1)
    module = model.get_submodule(module_name)
    if not isinstance(module, FusedExperts) or not 0 <= target.expert < module.num_experts:
        raise WeightLoadError(f"checkpoint tensor {name} has no expert slot in the model")
    destination = module.expert_slot(param, target.expert, target.shard)
    piece = module.checkpoint_slice(param)
    shape = tuple(destination.shape)
    if piece is not None:
        shape = (*shape[: piece.dim], piece.full, *shape[piece.dim + 1 :])
    if checkpoint.shape(name) != shape:
        raise WeightLoadError(f"{name}: checkpoint shape {checkpoint.shape(name)} != {shape}")
    if piece is None:
        checkpoint.read_into(name, destination)
    else:
        _read_slice(checkpoint, name, destination, piece)
    shards = module.slots(param) // module.num_experts
    return target.expert * shards + (target.shard or 0)


def _read_fused_parts(
    checkpoint: Checkpoint, name: str, destination: torch.Tensor, module: ColumnParallelLinear
) -> None:
    full = sum(part.full for part in module.parts)
    if checkpoint.shape(name)[0] != full:
        raise WeightLoadError(
            f"{name}: checkpoint rows {checkpoint.shape(name)[0]} != the fused parts' {full}"
        )
    offset = 0
    for index, part in enumerate(module.parts):
        rows = TensorSlice(0, offset + part.start, part.length, full)
        _read_slice(
            checkpoint, name, destination.narrow(0, module.shard_offset(index), part.length), rows
        )
        offset += part.full


def _read_slice(
    checkpoint: Checkpoint, name: str, destination: torch.Tensor, piece: TensorSlice
) -> None:
    """Read the slice into the first rows of destination; zero what it leaves (the padding of
    the last rank's vocabulary rows)."""
    if isinstance(checkpoint, QuantizedCheckpoint):
        raise WeightLoadError(f"{name}: quantized checkpoints are not tensor-parallel")
    checkpoint.read_slice_into(name, destination.narrow(piece.dim, 0, piece.length), piece)
    padding = destination.shape[piece.dim] - piece.length
    if padding:
        destination.narrow(piece.dim, piece.length, padding).zero_()


def _use_quantized(
    model: CausalLM,
    target: str,
    weight: QuantizedWeight,
    tied: bool,
    method: type[QuantizedLinearMethod] | None,
) -> None:
    module = model.get_submodule(target.rsplit(".", 1)[0])
    if not isinstance(module, (Linear, VocabEmbedding)):
        raise WeightLoadError(f"{target} is quantized, but a {type(module).__name__} reads it")
    if method is None:
        raise WeightLoadError(f"{target} is quantized, but no quantization scheme reads it")
    if isinstance(module, VocabEmbedding):
        if tied:  # the lm_head reads the same quantized table
            lm_head = model.get_submodule("lm_head")
            assert isinstance(lm_head, Linear)
            lm_head.use_method(method.from_checkpoint(weight))
        module.use_quantized(weight)
    else:
        module.use_method(method.from_checkpoint(weight))


def _num_shards(model: CausalLM, param_name: str) -> int:
    module = model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model
    if isinstance(module, FusedExperts):
        return module.slots(param_name.rsplit(".", 1)[-1])
    return len(module.shard_sizes) if isinstance(module, MergedLinear) else 1


def init_dummy_weights(model: CausalLM, seed: int) -> None:
    """Random weights of a sane scale, deterministic for a seed on a given device.

    Matrices and biases ~ N(0, initializer_range); norm scales are 1, so activations keep the
    magnitude of a trained model's at init and logits stay finite at any depth.
    """
    std = model.dims.initializer_range
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
