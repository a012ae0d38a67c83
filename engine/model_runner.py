"""ModelRunner: owns the model and the paged KV cache, and runs one scheduled step at a time.

A step is a flat batch of sequences, each computing its next chunk of tokens (a prefill chunk
or a single decode token) against the context already in its cache blocks. The runner turns the
batch into flat input ids, positions, cache slots and block tables (vectorized, once per step),
runs the model, and returns logits only for the sequences that are caught up and so sample.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.selector import get_attention_backend
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, cuda_graph_capture
from engine.distributed import tensor_parallel
from engine.distributed.step_channel import StepMessage, StepReceiver, StepSender
from engine.kv_cache import KVCache, KVCacheSpec, num_blocks_for_budget
from engine.lora.manager import LoRAManager
from engine.models.loader import build_model
from engine.picking import pick_tokens
from engine.piecewise_graphs import PiecewiseGraphs, token_sizes
from engine.platforms.cpu.greedy_screen import ScreenedLMHead
from engine.platforms.select import platform_for
from engine.prompt_logprobs import PromptSpan, prompt_spans, score_prompts
from engine.quantization.methods import resolve_method, weight_bytes
from engine.runner_io import ModelRunnerOutput, SamplingBatch, TokenPick
from engine.sampler import Sampler
from engine.scheduler import SchedulerOutput
from engine.sequence import ScheduledSeq, Sequence
from engine.step_inputs import StepInputs, prepare_inputs, sample_rows_of
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


class ModelRunner:
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

    # ------------------------------------------------------------------ steps

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, batch: SamplingBatch, inputs: StepInputs | None = None
    ) -> ModelRunnerOutput:
        """Run one scheduled step (its copy-on-write block copies first, on every layer) and
        give each sampling row of `batch` what it asks for. Greedy rows of a step that asks
        nothing else go through the greedy screen where the platform has one: the same
        tokens, for less than the LM head's full cost. `inputs`: the step's model inputs when
        the caller prepared them already (asynchronous scheduling)."""
        if inputs is None and sched.scheduled:
            inputs = self.prepare_inputs(sched.scheduled)
        if self.step_sender is None:
            with self._adapters(sched, inputs):
                spans = prompt_spans(sched.scheduled) if inputs is not None else []
                if inputs is not None and spans:
                    return self._execute_scoring_prompts(inputs, sched, batch, spans)
                return self._outputs(self._run_forward(inputs, sched.block_copies), batch)
        # Under tensor parallelism the greedy screen is off: every rank takes part in the logits.
        with tensor_parallel.fatal_step_errors(self.tp_ranks):
            message = tensor_parallel.message_of(inputs, sched.block_copies)
            if self.lora is not None:
                message.new_adapters = self.lora.take_new_adapters()
                lora_ids = [entry.seq.lora_id for entry in sched.scheduled]
                if inputs is not None and any(lora_ids):
                    message.lora_ids = torch.tensor(lora_ids, dtype=torch.int64)
            self.step_sender.send(message)
            with self._adapters(sched, inputs):
                hidden = self._run_forward(inputs, sched.block_copies)
                logits = None if hidden is None else self.model.compute_logits(hidden)
        return ModelRunnerOutput() if logits is None else pick_tokens(logits, batch, self.sampler)

    def _adapters(
        self, sched: SchedulerOutput, inputs: StepInputs | None
    ) -> contextlib.AbstractContextManager[object]:
        """The step's LoRA adapters, applied by the layers while this is open; a step without
        any runs exactly as without LoRA (the C++ decode stack, CUDA graphs)."""
        if self.lora is None or inputs is None:
            return contextlib.nullcontext()
        lora_ids = [entry.seq.lora_id for entry in sched.scheduled]
        if not any(lora_ids):
            return contextlib.nullcontext()
        query_lens = [entry.num_new_tokens for entry in sched.scheduled]
        return self.lora.step(lora_ids, query_lens, sample_rows_of(sched.scheduled))

    def follow_driver(self, receiver: StepReceiver) -> None:
        """An executor rank's life: run each step the driver sends until it says stop. The
        LM head's vocabulary shards are gathered across ranks, so every rank computes the
        logits; only the driver samples."""
        while (message := receiver.receive()) is not None:
            with torch.inference_mode():
                inputs = tensor_parallel.inputs_of(message, self.device)
                with self._followed_adapters(message, inputs):
                    hidden = self._run_forward(inputs, message.block_copies)
                    if hidden is not None:
                        self.model.compute_logits(hidden)

    def _followed_adapters(
        self, message: StepMessage, inputs: StepInputs | None
    ) -> contextlib.AbstractContextManager[object]:
        """The driver's step's adapters on an executor: the same calls as the driver's, in
        the same order, so every rank puts each adapter in the same slot."""
        if self.lora is None:
            return contextlib.nullcontext()
        if message.new_adapters:
            self.lora.add_encoded(message.new_adapters)
        if message.lora_ids is None or inputs is None:
            return contextlib.nullcontext()
        rows = message.sample_rows
        return self.lora.step(
            message.lora_ids.tolist(),
            inputs.attn_meta.query_lens_cpu,
            None if rows is None else rows.numpy(),
        )

    def _execute_scoring_prompts(
        self,
        inputs: StepInputs,
        sched: SchedulerOutput,
        batch: SamplingBatch,
        spans: list[PromptSpan],
    ) -> ModelRunnerOutput:
        """A step in which some prompts are scored: the hidden states of every row, the
        prompt logprobs from those, then the sampling rows as in any step."""
        self.kv_cache.copy_blocks(sched.block_copies)
        with self.platform.step(inputs.input_ids.shape[0], inputs.attn_meta.is_decode_only):
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.attn_meta
            )
        scored = score_prompts(hidden, spans, self.model.compute_logits, self.vocab_size)
        rows = inputs.sample_rows
        sampling = hidden if rows is None else hidden.index_select(0, rows)
        out = self._outputs(sampling if sampling.shape[0] else None, batch)
        out.prompt_logprobs = scored
        return out

    def _outputs(self, hidden: torch.Tensor | None, batch: SamplingBatch) -> ModelRunnerOutput:
        if hidden is None:
            return ModelRunnerOutput()
        screen = self.greedy_screen
        head_lora = self.model.lm_head.lora
        # The screen reads the base head's weight alone: an adapted head's logits differ.
        adapted_head = head_lora is not None and head_lora.active()
        if screen is not None and batch.all_argmax and not adapted_head:
            token_ids = screen.argmax(hidden).tolist()
            picks = [TokenPick.single(token_id) for token_id in token_ids]
            entries = [row.entry for row in batch.rows]
            return ModelRunnerOutput(list(zip(entries, picks, strict=True)))
        return pick_tokens(self.model.compute_logits(hidden), batch, self.sampler)

    def _run_forward(
        self, inputs: StepInputs | None, block_copies: list[tuple[int, int]]
    ) -> torch.Tensor | None:
        self.kv_cache.copy_blocks(block_copies)
        if inputs is None:
            return None
        with self.platform.step(inputs.input_ids.shape[0], inputs.attn_meta.is_decode_only):
            return self._final_hidden(inputs)

    @torch.inference_mode()
    def token_logprobs(self, seq: Sequence, chunk: int = 256) -> torch.Tensor:
        """float32 [len - 1]: the model's log-probability of each of seq's tokens after its
        prefix, from one prefill of all of them (perplexity). seq's blocks cover its tokens."""
        if self.tp is not None:
            raise NotImplementedError("perplexity is not available with tensor_parallel_size > 1")
        inputs = self.prepare_inputs([ScheduledSeq(seq, seq.num_tokens)])
        hidden = self.model(
            inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.attn_meta
        )[:-1]
        targets = inputs.input_ids[1:]
        parts = []
        for start in range(0, hidden.shape[0], chunk):  # logits of a few rows at a time
            logits = self.model.compute_logits(hidden[start : start + chunk])
            picked = targets[start : start + chunk, None]
            parts.append(logits.log_softmax(-1).gather(-1, picked).squeeze(-1))
        return torch.cat(parts)

    def _final_hidden(self, inputs: StepInputs) -> torch.Tensor | None:
        """The final hidden states of the rows that sample; None where none does (only partial
        prefill chunks: their K/V matter, no logits are needed)."""
        if inputs.sample_rows is not None and inputs.sample_rows.numel() == 0:
            self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.attn_meta)
            return None
        hidden = self._graph_hidden(inputs)
        if hidden is not None:
            return (
                hidden if inputs.sample_rows is None else hidden.index_select(0, inputs.sample_rows)
            )
        return self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_cache.layers,
            inputs.attn_meta,
            inputs.sample_rows,
        )

    def _graph_hidden(self, inputs: StepInputs) -> torch.Tensor | None:
        """Every row's final hidden states from captured graphs: whole-step ones for a decode
        step that fits them, else piecewise ones; None where neither serves the step."""
        if self.lora is not None and self.lora.steps.current.active:  # not in the graphs
            return None
        ids, meta = inputs.input_ids, inputs.attn_meta
        decode = self.decode_graphs
        if decode is not None and decode.fits(ids, meta):
            return decode.run(ids, inputs.positions, meta)
        pieces = self.piecewise_graphs
        if pieces is not None and pieces.fits(ids):
            return pieces.run(ids, inputs.positions, self.kv_cache.layers, meta)
        return None

    def prepare_inputs(self, batch: list[ScheduledSeq]) -> StepInputs:
        """Flatten a step's sequences into model inputs and attention metadata (no mutation)."""
        return prepare_inputs(batch, self.block_size, self._to_device)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)
