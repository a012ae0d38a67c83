"""ModelRunner: owns the model and the paged KV cache, and runs one scheduled step at a time.

This module builds the runner: the model, the KV cache sized to the memory left, the CUDA
graphs; the steps themselves are engine.runner_steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.selector import get_attention_backend
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, cuda_graph_capture
from engine.distributed import tensor_parallel
from engine.distributed.step_channel import StepSender
from engine.kv_cache import KVCache, KVCacheSpec, num_blocks_for_budget
from engine.lora.manager import LoRAManager
from engine.models.loader import build_model
from engine.piecewise_graphs import PiecewiseGraphs, token_sizes
from engine.platforms.cpu.greedy_screen import ScreenedLMHead
from engine.platforms.select import platform_for
from engine.quantization.methods import resolve_method, weight_bytes
from engine.runner_steps import RunnerSteps
from engine.sampler import Sampler
from engine.sequence import ScheduledSeq, Sequence
from schemas.sampling import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_hf_config(model_path: Path) -> Any:
    """The model folder's HF config (transformers' own reading of config.json)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_path))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(
    name: str, device: torch.device, cpu_auto: Callable[[], torch.dtype] = lambda: torch.float32
) -> torch.dtype:
    """The dtype named; for "auto" bfloat16 on CUDA and cpu_auto() (a measurement) on the CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else cpu_auto()
    return _DTYPES[name]


class ModelRunner(RunnerSteps):
    def __init__(
        self,
        config: EngineConfig,
        model_path: Path | None,
        hf_config: Any | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        """Load the HF config (or take hf_config) and the model, then allocate the KV cache.
        eos_token_ids: what min_tokens keeps the sampler from picking."""
        self.config = config
        self.device = resolve_device(config.device)
        threads = tensor_parallel.threads_per_rank(config, self.device)
        if threads:
            torch.set_num_threads(threads)
        if hf_config is None:
            if model_path is None:
                raise ValueError("ModelRunner needs a model folder or an hf_config")
            hf_config = load_hf_config(model_path)
        self.hf_config = hf_config
        self.block_size = config.block_size
        self.attn_backend = get_attention_backend(config.attention_backend, self.device)
        # Under tensor parallelism: this rank's place, and the executors a driver started.
        self.tp, self.tp_ranks = tensor_parallel.join(
            config, model_path, self.device, hf_config, self.attn_backend
        )
        self.platform = platform_for(self.device, config, hf_config, self.attn_backend, self.tp)
        self.dtype = resolve_dtype(config.dtype, self.device, self.platform.auto_dtype)
        self.quantization = resolve_method(
            config.quantization, model_path, self.device, self.dtype, config.load_format
        )
        self.model = build_model(
            hf_config,
            self.attn_backend,
            self.device,
            self.dtype,
            model_path=model_path,
            load_format=config.load_format,
            seed=config.seed,
            quantization=self.quantization,
            quantization_group_size=config.quantization_group_size,
            tp=self.tp,
        )
        self.vocab_size = self.model.vocab_size
        self.sampler = Sampler(self.vocab_size, eos_token_ids, self.device)
        self.max_model_len = self._resolve_max_model_len()
        self.weight_bytes = weight_bytes(self.model)
        self.platform.prepare(self.model, self.dtype)
        self.weight_bytes += self.platform.extra_weight_bytes  # e.g. the greedy screen's copy
        self.lora = (
            LoRAManager(self.model, config, self.device, self.dtype) if config.enable_lora else None
        )
        if self.lora is not None:
            self.weight_bytes += self.lora.slot_bytes
        self.greedy_screen: ScreenedLMHead | None = self.platform.greedy_screen
        self.kv_spec = KVCacheSpec.for_model(self.model, self.block_size, self.dtype)
        # Sizing the KV cache on CUDA runs a profiling step, on every rank at once: the driver
        # sends steps to its executors only after it.
        self.step_sender: StepSender | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.piecewise_graphs: PiecewiseGraphs | None = None
        self.num_kv_blocks = tensor_parallel.agree_on_blocks(
            self.tp, self._decide_num_kv_blocks(), self.device
        )
        self.kv_cache = KVCache(self.kv_spec, self.num_kv_blocks, self.device)
        if self._wants_cuda_graphs():
            self.decode_graphs = self._capture_decode_graphs()
            self.piecewise_graphs = self._capture_piecewise_graphs()
        self.step_sender = tensor_parallel.driver_sender(self.tp, self.tp_ranks)
        logger.info(
            "model runner: %s on %s (%s, weights %s, %.1f MiB), %d KV blocks of %d tokens "
            "(%.1f MiB), backend %s",
            type(self.model).__name__,
            self.device,
            self.dtype,
            self.quantization or "full precision",
            self.weight_bytes / 2**20,
            self.num_kv_blocks,
            self.block_size,
            self.num_kv_blocks * self.kv_spec.bytes_per_block / 2**20,
            type(self.attn_backend).__name__,
        )

    # ------------------------------------------------------------------ setup

    def _resolve_max_model_len(self) -> int:
        limit = self.model.dims.max_position_embeddings
        requested = self.config.max_model_len
        if requested is None:
            return limit
        if requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds what the model supports ({limit})")
        return requested

    def _wants_cuda_graphs(self) -> bool:
        # Only the Triton backend reads every length from device memory; the torch backend
        # plans each step on the host, which a replayed graph would not redo.
        from engine.attention.triton_backend import TritonAttentionBackend

        return (
            self.device.type == "cuda"
            and not self.config.enforce_eager
            and isinstance(self.attn_backend, TritonAttentionBackend)
            and self.tp is None  # a captured all-reduce would need every rank to replay alike
            and self.model.cuda_graphs
        )

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """Graphs are an optimisation: a capture that fails (a driver or Triton limitation)
        leaves the runner eager, loudly, rather than taking the worker down."""
        graphs = self.make_decode_graphs()
        try:
            graphs.capture(cuda_graph_capture(torch.cuda.graph_pool_handle()))
        except Exception:
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            return None
        return graphs

    def _capture_piecewise_graphs(self) -> PiecewiseGraphs | None:
        """As for decode graphs, a failed capture leaves steps with prefills eager. Their own
        pool: a piece's scratch memory must not overlap a decode graph's output."""
        graphs = self.make_piecewise_graphs()
        if graphs is None:
            return None
        try:
            with torch.inference_mode():
                graphs.capture(cuda_graph_capture(torch.cuda.graph_pool_handle()))
        except Exception:
            logger.exception("piecewise CUDA graph capture failed; steps with prefills run eagerly")
            return None
        return graphs

    def make_piecewise_graphs(self) -> PiecewiseGraphs | None:
        """Static buffers for steps of up to cuda_graph_max_tokens tokens (not yet captured);
        None where the setting is 0 or the model cannot be cut at its attention calls."""
        limit = min(self.config.cuda_graph_max_tokens, self.config.max_num_batched_tokens)
        split = self.model.split_forward()
        if split is None or limit <= 0:
            return None
        return PiecewiseGraphs(split, token_sizes(limit), self.device)

    def make_decode_graphs(self) -> DecodeGraphs:
        """Static buffers for decode steps of up to max_num_seqs sequences (not yet captured)."""

        def model_fn(
            input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
        ) -> torch.Tensor:
            with torch.inference_mode():
                return self.model(input_ids, positions, self.kv_cache.layers, meta)

        return DecodeGraphs(
            model_fn, self.config.max_num_seqs, self.max_model_len, self.block_size, self.device
        )

    def _decide_num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.device.type != "cuda":
            budget = self.config.kv_cache_memory
            if self.config.memory_budget is not None:
                budget = self.config.memory_budget - self.weight_bytes
                if budget < self.kv_spec.bytes_per_block:
                    raise RuntimeError(
                        f"memory_budget {self.config.memory_budget} bytes leaves no room for the "
                        f"KV cache after {self.weight_bytes} bytes of weights"
                    )
            return num_blocks_for_budget(self.kv_spec, budget)
        budget = self._cuda_kv_budget()
        num_blocks = num_blocks_for_budget(self.kv_spec, budget)
        if num_blocks <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization="
                f"{self.config.gpu_memory_utilization}; raise it or lower max_num_batched_tokens"
            )
        return num_blocks

    def _cuda_kv_budget(self) -> int:
        """Bytes left for the KV cache after weights and a worst-case step's activations."""
        peak = self._profile_peak_memory()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory in use that torch did not allocate: the CUDA context, other processes.
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak - outside_torch
        logger.info(
            "GPU memory: total %.2f GiB, torch peak %.2f GiB, outside torch %.2f GiB -> KV %.2f GiB",
            total / 2**30,
            peak / 2**30,
            outside_torch / 2**30,
            budget / 2**30,
        )
        return budget

    def _profile_peak_memory(self) -> int:
        """Run the largest step the scheduler may send (one prefill of the token budget)."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        seq = Sequence.from_prompt("profile", [0] * num_tokens, SamplingParams())
        seq.block_table = list(range(num_blocks))
        self.kv_cache = KVCache(self.kv_spec, num_blocks, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            hidden = self._run_forward(self.prepare_inputs([ScheduledSeq(seq, num_tokens)]), [])
            assert hidden is not None  # the whole prompt in one step: its last row samples
            logits = self.model.compute_logits(hidden)
            # The sampler works on up to max_num_seqs rows of logits and a softmax of them.
            rows = logits.expand(self.config.max_num_seqs, -1).contiguous()
            rows.softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del self.kv_cache, hidden, logits, rows
        return peak
