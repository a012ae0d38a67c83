"""The engine: requests in, one scheduled model step at a time, per-request deltas out."""

from __future__ import annotations

import logging
import time

import torch

from engine.async_step import AsyncScheduling
from engine.beam_search import BeamSearch
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    InvalidTokenIdError,
    RequestRejectedError,
)
from engine.lora.request import LoRAAdapterError, LoRARequest
from engine.model_files import resolve_model_path
from engine.model_runner import ModelRunner, load_hf_config
from engine.models import served_architecture
from engine.output_processor import OutputProcessor
from engine.outputs import EngineRequest, EngineStats, RequestDelta, RequestMetrics
from engine.request_state import ChoiceState, RequestState
from engine.runner_io import LogitsProcessor
from engine.sampling.logit_bias import LogitBias
from engine.sampling.token_bans import AllowedTokens, BadWords
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.speculative.factory import make_speculator
from engine.speculative.speculator import SpeculationCounts
from engine.stop import StopRules
from engine.structured import StructuredDecoding
from engine.tokenizer import load_tokenizer, read_eos_token_ids
from schemas.jobs import JobKind
from schemas.sampling import SamplingParams

logger = logging.getLogger(__name__)


class Engine:
    """Continuous-batching engine over a paged KV cache. Not thread-safe: drive it from one loop."""

    task = JobKind.GENERATION  # what a worker serving it advertises (engine.pooling: embeddings)
    embedding_size: int | None = None

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_path = resolve_model_path(config.model)
        self.model_path = model_path
        self.tokenizer = load_tokenizer(model_path)
        hf_config = load_hf_config(model_path)
        self.eos_token_ids = read_eos_token_ids(model_path, self.tokenizer, hf_config)
        self.runner = ModelRunner(config, model_path, hf_config, frozenset(self.eos_token_ids))
        self.vocab_size: int = self.runner.vocab_size
        self.quantization: str | None = self.runner.quantization
        self.weight_bytes: int = self.runner.weight_bytes
        # The family it serves the model as (e.g. "Qwen3ForCausalLM"), for the heartbeat.
        self.architecture: str | None = served_architecture(hf_config)
        # Advertised in the worker's heartbeat, so an API on the same host counts prompt tokens.
        tokenizer_json = model_path / "tokenizer.json"
        self.tokenizer_file = (
            tokenizer_json.resolve()
            if self.tokenizer is not None and tokenizer_json.exists()
            else None
        )
        self.block_size = self.runner.block_size
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks,
            self.block_size,
            config.enable_prefix_caching,
            kv_window=self.runner.model.kv_window(),
        )
        # A sequence longer than the whole cache would preempt itself forever (unless only a
        # sliding window of it is kept).
        longest = self.block_manager.longest_sequence(config.max_num_batched_tokens)
        self.max_model_len = min(self.runner.max_model_len, longest or self.runner.max_model_len)
        self.stop_rules = StopRules.of(self.eos_token_ids, self.max_model_len)
        self.scheduler = Scheduler(config, self.block_manager, self.stop_rules)
        self.speculator = make_speculator(config, self.max_model_len, self.vocab_size)
        self.structured = StructuredDecoding(
            self.tokenizer, self.runner.vocab_size, sorted(self.eos_token_ids)
        )
        processors: list[LogitsProcessor] = [
            LogitBias(self.vocab_size),
            BadWords(self.tokenizer, self.vocab_size),
            AllowedTokens(self.vocab_size),
            self.structured,
        ]
        self.outputs = OutputProcessor(
            self.scheduler,
            self.tokenizer,
            self.structured,
            processors,
            self.speculator,
            self.vocab_size,
        )
        self._awaiting_grammar: list[Sequence] = []  # held out of the scheduler until compiled
        self.async_steps: AsyncScheduling | None = None
        self.set_async_scheduling(config.async_scheduling)
        logger.info(
            "engine ready: model=%s device=%s dtype=%s kv_blocks=%d block_size=%d max_model_len=%d",
            config.model,
            self.runner.device,
            self.runner.dtype,
            self.runner.num_kv_blocks,
            self.block_size,
            self.max_model_len,
        )

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestRejectedError("this model has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt)

    def tokenize_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        raise RequestRejectedError("text pairs are scored by cross-encoders, not generated from")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestRejectedError("this model has no chat template")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        # The template already holds the special tokens: don't add a second BOS.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def add_request(self, new: EngineRequest) -> None:
        """Queue a request (or refuse it with a RequestRejectedError)."""
        if new.pooling is not None:
            raise RequestRejectedError(
                "this model generates text; embedding requests need an embedding model"
            )
        requests = self.outputs.requests
        if new.request_id in requests:
            raise DuplicateRequestError(f"request {new.request_id!r} is already running")
        prompt_text = new.prompt if isinstance(new.prompt, str) else None
        prompt_ids = self.tokenize(new.prompt) if isinstance(new.prompt, str) else list(new.prompt)
        if new.params.truncate_prompt_tokens is not None:
            prompt_ids = prompt_ids[-new.params.truncate_prompt_tokens :]
        self._validate(prompt_ids)
        self._check_supported(new.params)
        params, priors = new.params, new.prior_output_token_ids
        best_of = params.num_candidates if params.num_candidates > params.n else None
        if best_of is not None:
            # best_of > n: every candidate runs with logprobs (they rank it), and only the
            # n best leave the engine, once all have finished; a resumed job starts over, as
            # nothing of it was published.
            params = params.model_copy(update={"n": best_of, "logprobs": True})
            priors = None
        metrics = RequestMetrics(arrival_time=new.arrival_time or time.monotonic())
        request = RequestState(
            new.request_id,
            prompt_text,
            prompt_ids,
            params,
            metrics,
            priority=new.priority,
            lora=new.lora_request,
        )
        if best_of is not None:
            request.returned = new.params
        if priors and len(priors) != params.n:
            raise RequestRejectedError("prior_output_token_ids needs one list per choice")
        adapter_failure = self._add_adapter(new.lora_request)
        if adapter_failure is not None:  # fails this request only, as a finished output
            logger.error("request %s: %s", new.request_id, adapter_failure)
            requests[new.request_id] = request
            request.fail(adapter_failure, self.tokenizer)
            self.outputs.finished_on_arrival.append(request)
            return
        self.structured.add(new.request_id, params)
        request.forked = params.n == 1 or priors is not None
        requests[new.request_id] = request
        if params.use_beam_search:
            # Beams restart from the prompt, even on a resumed job: only final beams go out.
            decode = self.tokenizer.decode if self.tokenizer is not None else None
            seq = request.new_sequence()
            eos = self.stop_rules.eos_token_ids
            request.beam = BeamSearch(seq, eos, self.max_model_len, decode)
            request.forked = True
            self.scheduler.add(seq)
            return
        for index, prior in enumerate(priors or [[]]):
            choice = ChoiceState.start(request.new_sequence(index), self.tokenizer)
            if prior:
                choice.replay(list(prior), self.stop_rules)
            request.choices.append(choice)
            if not choice.finished:
                self._awaiting_grammar.append(choice.seq)
        if request.finished:  # resumed with every choice already complete
            self.outputs.finished_on_arrival.append(request)
        self._admit_compiled(may_wait=False)

    def _check_supported(self, params: SamplingParams) -> None:
        outside = params.token_outside_vocabulary(self.vocab_size)
        if outside is not None:
            field, token = outside
            raise InvalidTokenIdError(f"{field}: token id {token} is not in [0, {self.vocab_size})")
        if params.bad_words and self.tokenizer is None:
            raise RequestRejectedError("bad_words need a model with a tokenizer")
        if params.prompt_logprobs is not None and self.runner.tp is not None:
            raise RequestRejectedError(
                "prompt_logprobs are not available with tensor_parallel_size > 1"
            )

    def _add_adapter(self, lora: LoRARequest | None) -> str | None:
        """Load and check a request's LoRA adapter; what is wrong with it, or None."""
        if lora is None:
            return None
        if self.runner.lora is None:
            raise RequestRejectedError(
                "this engine serves no LoRA adapters: start it with enable_lora"
            )
        try:
            self.runner.lora.add(lora)
        except LoRAAdapterError as exc:
            return str(exc)
        return None

    def _validate(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise RequestRejectedError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ContextLengthExceededError(
                f"the prompt has {len(prompt_ids)} tokens but this model's context is "
                f"{self.max_model_len} tokens, leaving no room to generate"
            )
        vocab = self.runner.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidTokenIdError(f"prompt token ids must be in [0, {vocab})")

    def token_logprobs(self, token_ids: list[int]) -> torch.Tensor:
        """float32 [len - 1]: each token's log-probability after its prefix (perplexity), from
        one prefill on an idle engine. The blocks come from the block manager like a prompt's,
        so cached prefixes are evicted, never overwritten behind the cache's back."""
        if self.has_unfinished():
            raise RuntimeError("scoring a text needs an idle engine: finish the requests first")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"{len(token_ids)} tokens exceed the engine's max_model_len {self.max_model_len}"
            )
        seq = Sequence.from_prompt("score", token_ids, SamplingParams())
        self.block_manager.allocate_prompt(seq, prefix_hits=[])  # every position is computed
        try:
            if self.block_manager.try_allocate_slots(seq, len(token_ids)) is None:
                raise ValueError(f"{len(token_ids)} tokens do not fit the free KV-cache blocks")
            return self.runner.token_logprobs(seq)
        finally:
            self.block_manager.free(seq)

    def _admit_compiled(self, may_wait: bool) -> None:
        """Hand the scheduler the sequences whose grammar is ready; a grammar that failed to
        compile finishes its request with "error"."""
        if not self._awaiting_grammar:
            return
        if may_wait and self.scheduler.num_running + self.scheduler.num_waiting == 0:
            # Nothing else to run: waiting here stalls no one.
            waiting_ids = [seq.request_id for seq in self._awaiting_grammar]
            self.structured.wait_for_any(waiting_ids, timeout_s=0.05)
        still_waiting = []
        for seq in self._awaiting_grammar:
            if not self.structured.is_ready(seq.request_id):
                still_waiting.append(seq)
                continue
            failure = self.structured.failure(seq.request_id)
            if failure is None:
                self.scheduler.add(seq)
                continue
            logger.error("request %s: %s", seq.request_id, failure)
            request = self.outputs.requests[seq.request_id]
            request.fail(failure, self.tokenizer)
            if request not in self.outputs.finished_on_arrival:
                self.outputs.finished_on_arrival.append(request)
        self._awaiting_grammar = still_waiting

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks now. Returns False if it was unknown or done."""
        if self.outputs.requests.pop(request_id, None) is None:
            return False
        self._awaiting_grammar = [s for s in self._awaiting_grammar if s.request_id != request_id]
        self.structured.release(request_id)
        self.scheduler.abort(request_id)
        return True

    def set_async_scheduling(self, enabled: bool) -> None:
        """Run steps one ahead of the host, or not, from the next step on (a benchmark compares
        both on one loaded model). Speculation proposes from the tokens themselves and
        tensor-parallel ranks follow the driver step by step: both keep synchronous steps."""
        if self.has_unfinished():
            raise RuntimeError("switch asynchronous scheduling on an idle engine")
        wanted = enabled and self.speculator is None and self.runner.tp is None
        if not wanted and self.async_steps is not None:
            self.async_steps.close()
            self.async_steps = None
        elif wanted and self.async_steps is None:
            self.async_steps = AsyncScheduling(
                self.scheduler, self.runner, self.outputs, self.stop_rules
            )

    def has_unfinished(self) -> bool:
        """Requests still running, or a launched step whose outputs are still to be taken."""
        return bool(self.outputs.requests) or (
            self.async_steps is not None and self.async_steps.busy
        )

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestDelta]:
        """Run one scheduled model step; return what each touched choice produced (under
        asynchronous scheduling: launch the next step, return what the previous one made)."""
        self._admit_compiled(may_wait=True)
        deltas = self.outputs.take_finished_on_arrival()
        if self.async_steps is not None:
            return deltas + self.async_steps.step()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return deltas
        out = self.runner.execute(sched, self.outputs.plan(sched))
        self.scheduler.update_after_step(sched)
        return deltas + self.outputs.process(sched, out)

    # ------------------------------------------------------------------ capacity and stats

    def admissible(self, prompt_len: int, max_tokens: int, n: int = 1) -> bool:
        """Whether a request of this size could start now without waiting for blocks or slots."""
        if prompt_len >= self.max_model_len:
            return False
        return self.scheduler.admissible(prompt_len, max_tokens, n)

    def num_admissible(self, prompt_len: int, max_tokens: int = 16) -> int:
        """How many more requests of about this size the free KV blocks and seq slots admit now,
        after what requests already waiting will take."""
        if prompt_len >= self.max_model_len:
            return 0
        per_request = self.scheduler.admission_blocks(prompt_len, max_tokens)
        by_blocks = self.scheduler.free_blocks_after_waiting() // max(1, per_request)
        return min(by_blocks, self.scheduler.num_free_seq_slots())

    def stats(self) -> EngineStats:
        manager = self.block_manager
        lora = self.runner.lora
        spec = self.speculator.counts if self.speculator is not None else SpeculationCounts()
        return EngineStats(
            num_blocks_total=manager.num_total_blocks,
            num_blocks_free=manager.num_free_blocks,
            num_blocks_cached=manager.num_cached_blocks,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            num_prompt_tokens_computed=self.outputs.num_prompt_tokens_computed,
            num_generation_tokens=self.outputs.num_generation_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.outputs.num_steps,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            lora_resident=tuple(lora.resident_ids) if lora is not None else (),
            lora_cached=tuple(lora.cached_ids) if lora is not None else (),
        )
