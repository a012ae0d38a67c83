"""What the model runner calls for tensor parallelism; with tensor_parallel_size 1 every entry
here returns at once (no process group, nothing sent), so a single device runs as before."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention.base import AttentionMetadata
from engine.config import EngineConfig
from engine.distributed.group import TensorParallel
from engine.distributed.launcher import (
    RankProcesses,
    fatal_step_errors,
    join_replica,
    threads_per_rank,
)
from engine.distributed.step_channel import StepMessage, StepSender
from engine.layers.moe import BiasedExperts, FusedExperts
from engine.models import meta_model
from engine.models.interface import CausalLM
from engine.step_inputs import StepInputs

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from engine.attention.base import AttentionBackend

__all__ = [
    "StepMessage",
    "agree_on_blocks",
    "driver_sender",
    "fatal_step_errors",
    "inputs_of",
    "join",
    "local_sizes",
    "message_of",
    "threads_per_rank",
]


def join(
    config: EngineConfig,
    model_path: Path | None,
    device: torch.device,
    hf_config: PretrainedConfig,
    backend: AttentionBackend,
) -> tuple[TensorParallel | None, RankProcesses | None]:
    """(this rank's TensorParallel, the executors this driver started); (None, None) for 1.

    What the driver can refuse is refused before any rank starts."""
    size = config.tensor_parallel_size
    if size == 1:
        return None, None
    if config.quantization is not None:
        raise ValueError(
            f"quantization={config.quantization!r} with tensor_parallel_size={size}: quantized "
            "weights are not sharded across ranks yet"
        )
    if config.speculative_config is not None:
        raise ValueError(
            f"speculative_config with tensor_parallel_size={size}: speculative decoding runs on "
            "a single device only so far"
        )
    for rank in range(size):  # the family refuses a split its layers cannot take
        meta_model(hf_config, backend, TensorParallel(rank, size))
    return join_replica(config, model_path, device)


@dataclass(frozen=True)
class LocalSizes:
    """The sizes of this rank's share of each layer."""

    num_heads: int
    num_kv_heads: int
    intermediate_size: int


def local_sizes(model: CausalLM) -> LocalSizes:
    """This rank's share of the first layer, as the built model (or shard) holds it."""
    attention = model.attention_spec(0)
    down = model.projections(0).down
    if down is not None:
        mlp_size = down.in_features
    else:  # a mixture-of-experts layer: one expert's share
        mlp_size = next(
            m.local_intermediate_size
            for m in model.modules()
            if isinstance(m, (FusedExperts, BiasedExperts))
        )
    return LocalSizes(attention.num_heads, attention.num_kv_heads, mlp_size)


def agree_on_blocks(tp: TensorParallel | None, num_blocks: int, device: torch.device) -> int:
    """The KV-block count every rank can hold: the minimum over ranks."""
    return num_blocks if tp is None else tp.min_over_ranks(num_blocks, device)


def driver_sender(tp: TensorParallel | None, ranks: RankProcesses | None) -> StepSender | None:
    """The step sender of a driver rank (None on a single device and on executors)."""
    if tp is None or not tp.is_driver:
        return None
    sender = StepSender(tp)
    if ranks is not None:
        ranks.sender = sender  # it also says "stop" at exit
    return sender


def message_of(inputs: StepInputs | None, block_copies: list[tuple[int, int]]) -> StepMessage:
    """What the executors need of a step's inputs (None: a step of block copies only)."""
    copies = [(int(src), int(dst)) for src, dst in block_copies]
    if inputs is None:
        empty = torch.empty(0, dtype=torch.int64)
        return StepMessage(empty, empty, empty, empty, empty, empty.view(0, 0), None, copies)
    meta = inputs.attn_meta
    return StepMessage(
        input_ids=inputs.input_ids,
        positions=inputs.positions,
        slot_mapping=meta.slot_mapping,
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        block_tables=meta.block_tables,
        sample_rows=inputs.sample_rows,
        block_copies=copies,
    )


def inputs_of(message: StepMessage, device: torch.device) -> StepInputs | None:
    """The step inputs the driver built, rebuilt on an executor (None: no sequences)."""
    if message.num_seqs == 0:
        return None
    query_starts = message.query_start_loc.tolist()
    query_lens = [end - start for start, end in itertools.pairwise(query_starts)]
    seq_lens = message.seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=message.slot_mapping.to(device),
        query_start_loc=message.query_start_loc.to(device),
        seq_lens=message.seq_lens.to(device),
        block_tables=message.block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return StepInputs(
        input_ids=message.input_ids.to(device),
        positions=message.positions.to(device),
        attn_meta=meta,
        sample_rows=None if message.sample_rows is None else message.sample_rows.to(device),
    )
