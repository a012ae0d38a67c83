"""Engine configuration: one dataclass that every engine part reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class EngineConfig:
    model: str  # registry name, local HF folder, or HF hub id
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 CPU, bf16 CUDA
    device: Literal["auto", "cpu", "cuda"] = "auto"
    load_format: Literal["auto", "dummy"] = "auto"  # dummy: random weights of the config
    seed: int = 0
    # KV cache
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit count wins over the memory budget
    kv_cache_memory: int = 1 << 30  # bytes of KV cache on the CPU
    gpu_memory_utilization: float = 0.90  # fraction of GPU memory for weights + activations + KV
    enable_prefix_caching: bool = True
    # Scheduler
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    # Execution
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    enforce_eager: bool = False  # disable CUDA graphs / torch.compile
    num_threads: int | None = None  # torch intra-op threads on the CPU
