"""Engine configuration: one dataclass that every engine part reads.

Each field is one engine argument, declared here only: `LLM(model, **kwargs)` takes it as a
keyword, and a worker derives its `INFERQ_<FIELD>` setting and `inferq worker --<field>` flag
from it (see worker.engine_settings). The `Field(...)` inside `Annotated` gives the setting its
bounds and help text; pydantic reads it, the dataclass ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from engine.quantization.registry import QUANTIZATION_SCHEMES, scheme_help
from engine.speculative.config import SpeculativeConfig, parse_speculative_config

# The registered quantization schemes' names: the `quantization` argument's choices (flags,
# settings). Made from the table at run time, so to a type checker it is a plain string.
if TYPE_CHECKING:
    QuantizationName = str
else:
    QuantizationName = Literal[tuple(QUANTIZATION_SCHEMES)]


@dataclass
class EngineConfig:
    model: Annotated[str, Field(description="model to load: registry name, HF folder or hub id")]
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Field(
            description="weights and activations; auto: bfloat16 on CUDA; on the CPU bfloat16 "
            "where it computes bf16 natively (AVX512-BF16, AMX) and its matmuls measure faster "
            "than float32's over the model's shapes, else float32"
        ),
    ] = "auto"
    device: Annotated[Literal["auto", "cpu", "cuda"], Field(description="where the model runs")] = (
        "auto"
    )
    load_format: Annotated[
        Literal["auto", "dummy"],
        Field(description="dummy: random weights of the model's config (benchmarks)"),
    ] = "auto"
    seed: Annotated[int, Field(description="seed of the random weights of load_format dummy")] = 0
    runner: Annotated[
        Literal["auto", "generate", "pooling"],
        Field(
            description="generate: text generation; pooling: embeddings (one pooled vector "
            "per input, no KV cache kept); auto: pooling for sentence-transformers folders, "
            "encoders (BERT family) and bare transformers, else generate"
        ),
    ] = "auto"
    quantization: Annotated[QuantizationName | None, Field(description=scheme_help())] = None
    quantization_group_size: Annotated[
        int,
        Field(
            ge=32,
            description="inputs sharing one scale and minimum in int4 quantized at load: a "
            "multiple of 32 (32, 64, 128, ...) that divides every linear layer's input size",
        ),
    ] = 32
    # KV cache
    block_size: Annotated[int, Field(ge=1, description="tokens per KV-cache block")] = 16
    num_kv_blocks: Annotated[
        int | None,
        Field(ge=1, description="KV-cache blocks; an explicit count wins over the memory budget"),
    ] = None
    kv_cache_memory: Annotated[int, Field(ge=1, description="bytes of KV cache on the CPU")] = (
        1 << 30
    )
    memory_budget: Annotated[
        int | None,
        Field(
            ge=1,
            description="bytes for weights plus KV cache on the CPU: the KV cache gets what the "
            "loaded weights leave (so quantized weights admit more sequences); replaces "
            "kv_cache_memory when set",
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        float,
        Field(gt=0, le=1, description="fraction of GPU memory for weights, activations and KV"),
    ] = 0.90
    enable_prefix_caching: Annotated[
        bool, Field(description="reuse the KV blocks of prompt prefixes seen before")
    ] = True
    # Scheduler
    max_num_seqs: Annotated[int, Field(ge=1, description="most sequences in one step")] = 256
    max_num_batched_tokens: Annotated[
        int, Field(ge=1, description="token budget of one step (decodes and prefill chunks)")
    ] = 2048
    max_model_len: Annotated[
        int | None,
        Field(ge=2, description="longest prompt + output; default: the model's context length"),
    ] = None
    # Execution
    attention_backend: Annotated[
        Literal["auto", "torch", "triton"],
        Field(description="auto: triton on CUDA, torch elsewhere"),
    ] = "auto"
    enforce_eager: Annotated[
        bool,
        Field(description="no CUDA graphs and no compiled CPU forward (debugging, quick starts)"),
    ] = False
    cuda_graph_max_tokens: Annotated[
        int,
        Field(
            ge=0,
            description="steps with prefills (mixed, speculative verification) of up to this "
            "many tokens replay piecewise CUDA graphs, attention running eagerly between them; "
            "0: such steps run eagerly (decode-only steps replay whole-step graphs either way)",
        ),
    ] = 512
    async_scheduling: Annotated[
        bool,
        Field(
            description="run each model step on a device thread while the host schedules the "
            "next step and processes the previous one's outputs (stop checks, detokenizing); "
            "steps with beams, grammars, logits processors, penalties, prompt logprobs or "
            "speculation run synchronously. Off by default: the CPU has no separate device"
        ),
    ] = False
    num_threads: Annotated[int | None, Field(ge=1, description="torch threads on the CPU")] = None
    cpu_matmul: Annotated[
        Literal["auto", "aten", "onednn", "onednn_packed", "mkl_packed", "panels"],
        Field(
            description="CPU matmul backend of the linear layers; auto: the fastest measured at "
            "start-up over the model's shapes (cached per CPU), per decode/prefill row count"
        ),
    ] = "auto"
    cpu_greedy_screen: Annotated[
        Literal["auto", "on", "off"],
        Field(
            description="float32 on the CPU: greedy tokens from a bfloat16 pass of the LM head, "
            "only the near-best tokens recomputed in float32 (the same tokens); auto: where "
            "the CPU has bfloat16 panel kernels and the screen measures faster at start-up "
            "(cached per CPU); on: wherever the CPU has them"
        ),
    ] = "auto"
    tensor_parallel_size: Annotated[
        int,
        Field(
            ge=1,
            description="devices (ranks) one model replica is split across: attention heads, "
            "MLP and vocabulary sharded, one all-reduce per projection pair; ranks are started "
            "by this process, or taken from torchrun's RANK/WORLD_SIZE when those are set. On "
            "the CPU each rank uses num_threads threads (default 1)",
        ),
    ] = 1
    # LoRA adapters
    enable_lora: Annotated[
        bool,
        Field(
            description="serve LoRA adapters (PEFT format) over the base model: a request names "
            "one (offline: LLM.generate(..., lora_request=LoRARequest(name, id, path)))"
        ),
    ] = False
    max_loras: Annotated[
        int, Field(ge=1, description="most distinct LoRA adapters in one step (resident slots)")
    ] = 1
    max_lora_rank: Annotated[
        int, Field(ge=1, description="largest LoRA rank accepted; sizes the resident slots")
    ] = 16
    max_cpu_loras: Annotated[
        int | None,
        Field(
            ge=1,
            description="LoRA adapters kept loaded in host memory (least recently used evicted, "
            "reloaded from their folder when needed again); default: max_loras",
        ),
    ] = None
    # Speculative decoding
    speculative_config: Annotated[
        SpeculativeConfig | None,
        Field(
            description='JSON, as vLLM names it: {"method": "ngram", "num_speculative_tokens": '
            'k, "prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft_model", '
            '"model": PATH_OR_NAME, "num_speculative_tokens": k}; optional '
            '"disable_by_batch_size" and "min_acceptance_rate" turn it off where it does not pay'
        ),
    ] = None

    def __post_init__(self) -> None:
        # LLM(...) and the worker's settings pass a dict or JSON text; one validated model after.
        self.speculative_config = parse_speculative_config(self.speculative_config)
