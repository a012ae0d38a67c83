"""ModelRunner: owns the model and the paged KV cache, and runs one scheduled step at a time.

A step is a flat batch of sequences, each computing its next chunk of tokens (a prefill chunk
or a single decode token) against the context already in its cache blocks. The runner turns the
batch into flat input ids, positions, cache slots and block tables (vectorized, once per step),
runs the model, and returns logits only for the sequences that are caught up and so sample.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.selector import get_attention_backend
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, cuda_graph_capture
from engine.distributed import tensor_parallel
from engine.distributed.step_channel import StepSender
from engine.kv_cache import KVCache, KVCacheSpec, num_blocks_for_budget
from engine.layers import cpu_glue, matmul_tuning, screened_lm_head
from engine.layers.screened_lm_head import ScreenedLMHead
from engine.machine_cache import cached, machine_key
from engine.models.loader import build_model
from engine.quantization.methods import resolve_method, weight_bytes
from engine.sequence import ScheduledSeq, Sequence
from schemas.sampling import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_meta: AttentionMetadata
    sample_rows: torch.Tensor | None  # rows of the hidden states to turn into logits; None: all


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


def _logit_rows(end: int, entry: ScheduledSeq) -> range:
    return range(end - entry.num_logits, end)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_path: Path | None, hf_config: Any | None = None
    ) -> None:
        """Load the HF config (or take hf_config) and the model, then allocate the KV cache."""
        self.config = config
        self.device = resolve_device(config.device)
        threads = tensor_parallel.threads_per_rank(config, self.device)
        if threads:
            torch.set_num_threads(threads)
        if hf_config is None:
            if model_path is None:
                raise ValueError("ModelRunner needs a model folder or an hf_config")
            from transformers import AutoConfig

            hf_config = AutoConfig.from_pretrained(str(model_path))
        self.hf_config = hf_config
        self.block_size = config.block_size
        self.attn_backend = get_attention_backend(config.attention_backend, self.device)
        # Under tensor parallelism: this rank's place, and the executors a driver started.
        self.tp, self.tp_ranks = tensor_parallel.join(
            config, model_path, self.device, hf_config, self.attn_backend
        )
        shapes = matmul_tuning.linear_shapes(hf_config, self.attn_backend, self.tp)
        self.dtype = resolve_dtype(
            config.dtype, self.device, lambda: matmul_tuning.auto_dtype(shapes, config.cpu_matmul)
        )
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
        self.max_model_len = self._resolve_max_model_len()
        self.weight_bytes = weight_bytes(self.model)
        self.greedy_screen: ScreenedLMHead | None = None
        if self.device.type == "cpu":
            matmul_tuning.tune_model(self.model, shapes, self.dtype, config.cpu_matmul)
            if self.tp is None and self.dtype == torch.float32:
                self.greedy_screen = screened_lm_head.build(
                    self.model.lm_head, self.vocab_size, config.cpu_greedy_screen
                )
            if self.greedy_screen is not None:  # its bf16 copy counts against memory_budget
                self.weight_bytes += self.greedy_screen.nbytes
        self.kv_spec = KVCacheSpec.for_model(self.model, self.block_size, self.dtype)
        # Sizing the KV cache on CUDA runs a profiling step, on every rank at once: the driver
        # sends steps to its executors only after it.
        self.step_sender: StepSender | None = None
        self.decode_graphs: DecodeGraphs | None = None
        # Steps of at least this many tokens run the compiled glue; None: never.
        self.compiled_glue_min_tokens: int | None = None
        self.num_kv_blocks = tensor_parallel.agree_on_blocks(
            self.tp, self._decide_num_kv_blocks(), self.device
        )
        self.kv_cache = KVCache(self.kv_spec, self.num_kv_blocks, self.device)
        if self._wants_cuda_graphs():
            self.decode_graphs = self._capture_decode_graphs()
        if self.device.type == "cpu" and not config.enforce_eager:
            self._compile_cpu_forward()
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
        window = self.model.sliding_window()
        if window is not None and window < limit:
            logger.warning(
                "model uses sliding-window attention (%d); full attention is exact only up to "
                "that length, so max_model_len is capped there",
                window,
            )
            limit = window
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

    def _compile_cpu_forward(self) -> None:
        """Compile the forward's glue now, not in the first request, and measure from how many
        tokens per step it pays; the answer is kept per machine (engine.machine_cache), and
        where it is "never" later starts skip compiling. A failure leaves the forward eager,
        never the worker down."""
        started = time.perf_counter()
        local = tensor_parallel.local_sizes(self.model)
        shapes = cpu_glue.GlueShapes(
            hidden_size=self.model.hidden_size,
            intermediate_size=local.intermediate_size,
            num_heads=local.num_heads,
            num_kv_heads=self.kv_spec.num_kv_heads,
            head_dim=self.kv_spec.head_dim,
            dtype=self.dtype,
        )
        budget = self.config.max_num_batched_tokens
        candidates = tuple(n for n in (8, 32, 128, 512, 2048) if n <= budget) or (budget,)
        key = machine_key(
            shapes={**asdict(shapes), "dtype": str(self.dtype).removeprefix("torch.")},
            candidates=list(candidates),
            baseline="native" if cpu_glue.native() is cpu_glue.NATIVE else "eager",
        )

        def read(stored: Any) -> int | None:
            return None if stored is None else int(stored)

        try:
            threshold = cached(
                "cpu_glue",
                key,
                lambda: cpu_glue.min_tokens_for_compiled(shapes, candidates),
                read,
            )
            if threshold is not None:
                cpu_glue.compile_now(shapes)  # a cached answer: compile before any request
        except Exception as error:  # no compiler, an inductor bug: stay eager
            logger.warning(
                "compiling the CPU forward failed (%s); it runs eagerly", cpu_glue.first_line(error)
            )
            return
        self.compiled_glue_min_tokens = threshold
        logger.info(
            "CPU forward glue: %s (%.1f s)",
            "eager, measured faster than compiled at every step size"
            if threshold is None
            else f"compiled for steps of {threshold} tokens or more (measured faster from there)",
            time.perf_counter() - started,
        )

    def _glue_for_step(self, inputs: StepInputs) -> cpu_glue.Glue:
        # A decode-only step keeps the native glue whatever its size: with it the whole step
        # runs as one C++ call (engine.models.cpu_decode_stack), which saves more than the
        # compiled glue does; the glue alone is what the start-up measurement compared.
        threshold = self.compiled_glue_min_tokens
        if (
            threshold is None
            or inputs.input_ids.shape[0] < threshold
            or inputs.attn_meta.is_decode_only
        ):
            return cpu_glue.native()
        return cpu_glue.compiled()

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
        seq = Sequence(
            request_id="profile",
            token_ids=[0] * num_tokens,
            num_prompt_tokens=num_tokens,
            params=SamplingParams(),
            block_table=list(range(num_blocks)),
        )
        self.kv_cache = KVCache(self.kv_spec, num_blocks, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        logits = self.execute([ScheduledSeq(seq, num_tokens)])
        # The sampler works on up to max_num_seqs rows of logits and a softmax of them.
        with torch.inference_mode():
            rows = logits.expand(self.config.max_num_seqs, -1).contiguous()
            rows.softmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del self.kv_cache, logits, rows
        return peak

    # ------------------------------------------------------------------ steps

    @torch.inference_mode()
    def execute(
        self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]] = ()
    ) -> torch.Tensor:
        """Run one step; first perform the copy-on-write block copies (src->dst, all layers).

        Returns float32 logits [rows, vocab] for the entries of `batch` whose `samples` is
        True, in batch order: one row each, 1 + k for an entry verifying k draft tokens.
        """
        if self.step_sender is not None:
            inputs = self.prepare_inputs(batch) if batch else None
            with tensor_parallel.fatal_step_errors(self.tp_ranks):
                self.step_sender.send(tensor_parallel.message_of(inputs, block_copies))
                return self.execute_inputs(inputs, block_copies)
        return self._logits(self._local_hidden(batch, block_copies))

    @torch.inference_mode()
    def execute_greedy(
        self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]] = ()
    ) -> torch.Tensor:
        """`execute` for a batch whose every sampling entry takes the plain argmax of its one
        logits row: those tokens, [rows] int64 in batch order, through the greedy screen (only
        a runner with one, which is never a tensor-parallel one)."""
        screen = self.greedy_screen
        assert screen is not None, "execute_greedy needs the runner's greedy screen"
        hidden = self._local_hidden(batch, block_copies)
        if hidden is None:
            return torch.empty(0, dtype=torch.long, device=self.device)
        return screen.argmax(hidden)

    def _local_hidden(
        self, batch: list[ScheduledSeq], block_copies: list[tuple[int, int]]
    ) -> torch.Tensor | None:
        """Run a step on this rank alone: the final hidden states of its sampling rows (None
        where none samples)."""
        self.kv_cache.copy_blocks(block_copies)
        if not batch:
            return None
        inputs = self.prepare_inputs(batch)
        with cpu_glue.using(self._glue_for_step(inputs)):
            return self._final_hidden(inputs)

    @torch.inference_mode()
    def execute_inputs(
        self, inputs: StepInputs | None, block_copies: list[tuple[int, int]] = ()
    ) -> torch.Tensor:
        """`execute` from prepared inputs (None: no sequences); executor ranks run this."""
        self.kv_cache.copy_blocks(block_copies)
        if inputs is None:
            return self._logits(None)
        with cpu_glue.using(self._glue_for_step(inputs)):
            return self._logits(self._final_hidden(inputs))

    def execute_message(self, message: tensor_parallel.StepMessage) -> None:
        """Run the step a driver sent (on an executor rank)."""
        self.execute_inputs(tensor_parallel.inputs_of(message, self.device), message.block_copies)

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

    def _logits(self, hidden: torch.Tensor | None) -> torch.Tensor:
        """float32 logits of the sampling rows' hidden states; [0, vocab] for none."""
        if hidden is None:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden)

    def _final_hidden(self, inputs: StepInputs) -> torch.Tensor | None:
        """The final hidden states of the rows that sample; None where none does (only partial
        prefill chunks: their K/V matter, no logits are needed)."""
        if inputs.sample_rows is not None and inputs.sample_rows.numel() == 0:
            self.model(inputs.input_ids, inputs.positions, self.kv_cache.layers, inputs.attn_meta)
            return None
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(inputs.input_ids, inputs.attn_meta):
            hidden = graphs.run(inputs.input_ids, inputs.positions, inputs.attn_meta)
            if inputs.sample_rows is not None:
                hidden = hidden.index_select(0, inputs.sample_rows)
            return hidden
        return self.model(
            inputs.input_ids,
            inputs.positions,
            self.kv_cache.layers,
            inputs.attn_meta,
            inputs.sample_rows,
        )

    def prepare_inputs(self, batch: list[ScheduledSeq]) -> StepInputs:
        """Flatten a step's sequences into model inputs and attention metadata (no mutation)."""
        block_size = self.block_size
        query_lens = [s.num_new_tokens for s in batch]
        starts = [s.seq.num_computed_tokens for s in batch]
        seq_lens = [start + n for start, n in zip(starts, query_lens, strict=True)]
        token_ids: list[int] = []
        for s in batch:
            token_ids.extend(s.input_token_ids())
        if len(token_ids) != sum(query_lens):
            raise ValueError("a scheduled sequence asks for tokens it does not have")

        num_seqs = len(batch)
        query_lens_np = np.asarray(query_lens, dtype=np.int64)
        cu_query = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens_np, out=cu_query[1:])
        seq_index = np.repeat(np.arange(num_seqs), query_lens_np)
        positions = np.arange(cu_query[-1]) - cu_query[seq_index] + np.asarray(starts)[seq_index]

        blocks_needed = [-(-n // block_size) for n in seq_lens]
        block_tables = np.zeros((num_seqs, max(blocks_needed)), dtype=np.int32)
        for i, (s, needed) in enumerate(zip(batch, blocks_needed, strict=True)):
            table = s.seq.block_table
            if len(table) < needed:
                raise ValueError(
                    f"sequence {s.seq.seq_id} needs {needed} KV blocks for {seq_lens[i]} tokens "
                    f"but its block table has {len(table)}"
                )
            block_tables[i, :needed] = table[:needed]
        slots = (
            block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
            + positions % block_size
        )

        samples = [s.samples for s in batch]
        sample_rows = None
        if not all(samples) or len(token_ids) != num_seqs:
            # The last row of each sampling entry; the last 1 + k rows of a speculating one.
            rows = [row for i, s in enumerate(batch) for row in _logit_rows(cu_query[i + 1], s)]
            sample_rows = self._to_device(np.asarray(rows, dtype=np.int64))

        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            query_start_loc=self._to_device(cu_query.astype(np.int32)),
            seq_lens=self._to_device(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=self._to_device(block_tables),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        return StepInputs(
            input_ids=self._to_device(np.asarray(token_ids, dtype=np.int64)),
            positions=self._to_device(positions),
            attn_meta=meta,
            sample_rows=sample_rows,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)
