"""The step half of ModelRunner: running one scheduled step on the model and its paged KV cache.

A step is a flat batch of sequences, each computing its next chunk of tokens (a prefill chunk
or a single decode token) against the context already in its cache blocks. The runner turns the
batch into flat input ids, positions, cache slots and block tables (vectorized, once per step),
runs the model, and returns logits only for the sequences that are caught up and so sample.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from engine.cuda_graphs import DecodeGraphs
from engine.distributed import tensor_parallel
from engine.distributed.group import TensorParallel
from engine.distributed.launcher import RankProcesses
from engine.distributed.step_channel import StepMessage, StepReceiver, StepSender
from engine.kv_cache import KVCache
from engine.lora.manager import LoRAManager
from engine.models.interface import CausalLM
from engine.picking import pick_tokens
from engine.piecewise_graphs import PiecewiseGraphs
from engine.platforms.base import Platform
from engine.platforms.cpu.greedy_screen import ScreenedLMHead
from engine.prompt_logprobs import PromptSpan, prompt_spans, score_prompts
from engine.runner_io import ModelRunnerOutput, SamplingBatch, TokenPick
from engine.sampler import Sampler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import ScheduledSeq, Sequence
from engine.step_inputs import StepInputs, prepare_inputs, sample_rows_of


class RunnerSteps:
    """The steps of a built runner; ModelRunner (engine.model_runner) loads the model, sizes
    and allocates the KV cache and captures the graphs these read."""

    device: torch.device
    block_size: int
    model: CausalLM
    vocab_size: int
    sampler: Sampler
    platform: Platform
    lora: LoRAManager | None
    greedy_screen: ScreenedLMHead | None
    kv_cache: KVCache
    tp: TensorParallel | None
    tp_ranks: RankProcesses | None
    step_sender: StepSender | None
    decode_graphs: DecodeGraphs | None
    piecewise_graphs: PiecewiseGraphs | None

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
