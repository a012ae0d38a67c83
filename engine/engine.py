"""The engine: requests in, one scheduled model step at a time, per-request deltas out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.beam_search import BeamSearch, beam_logprobs, split_beam_rows
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    InvalidTokenIdError,
    RequestRejectedError,
)
from engine.model_files import resolve_model_path
from engine.model_runner import ModelRunner
from engine.outputs import (
    CompletionOutput,
    EngineRequest,
    EngineStats,
    RequestDelta,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from engine.sampler import Sampler, takes_only_argmax
from engine.sampling.logit_bias import apply_logit_bias
from engine.scheduler import Scheduler
from engine.sequence import ScheduledSeq, Sequence
from engine.speculative.factory import make_speculator
from engine.speculative.speculator import SpeculationCounts
from engine.speculative.verify import Verified, verify
from engine.stop import StopRules, append_until_stop
from engine.structured import StructuredDecoding
from engine.token_text import TokenTexts
from engine.tokenizer import load_tokenizer, read_eos_token_ids
from schemas.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Choice:
    seq: Sequence  # holds how the choice finished
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    # Its last delta is out. The scheduler may have finished the sequence a moment earlier in
    # the same step, before its text was made.
    finished: bool = False


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    choices: list[_Choice] = field(default_factory=list)
    forked: bool = False  # n > 1: children are forked from choice 0 once its prompt is computed
    beam: BeamSearch | None = None  # a beam search request: its beams replace the choices

    @property
    def finished(self) -> bool:
        return len(self.choices) == self.params.n and all(c.finished for c in self.choices)


class Engine:
    """Continuous-batching engine over a paged KV cache. Not thread-safe: drive it from one loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_path = resolve_model_path(config.model)
        self.model_path = model_path
        self.runner = ModelRunner(config, model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.vocab_size: int = self.runner.vocab_size
        self.quantization: str | None = self.runner.quantization
        self.weight_bytes: int = self.runner.weight_bytes
        # Advertised in the worker's heartbeat, so an API on the same host counts prompt tokens.
        tokenizer_json = model_path / "tokenizer.json"
        self.tokenizer_file = (
            tokenizer_json.resolve()
            if self.tokenizer is not None and tokenizer_json.exists()
            else None
        )
        self.eos_token_ids = read_eos_token_ids(model_path, self.tokenizer, self.runner.hf_config)
        self.token_texts = TokenTexts(self.tokenizer)
        self.block_size = self.runner.block_size
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, self.block_size, config.enable_prefix_caching
        )
        # A sequence longer than the whole cache would preempt itself forever.
        self.max_model_len = min(self.runner.max_model_len, self.block_manager.token_capacity)
        self.stop_rules = StopRules.of(self.eos_token_ids, self.max_model_len)
        self.scheduler = Scheduler(config, self.block_manager, self.stop_rules)
        self.sampler = Sampler(self.runner.vocab_size, self.eos_token_ids, self.runner.device)
        self.speculator = make_speculator(config, self.max_model_len, self.vocab_size)
        self.structured = StructuredDecoding(
            self.tokenizer, self.runner.vocab_size, sorted(self.eos_token_ids)
        )
        self._awaiting_grammar: list[Sequence] = []  # held out of the scheduler until compiled
        self._requests: dict[str, _Request] = {}
        self._finished_on_arrival: list[_Request] = []
        self._num_prompt_tokens_computed = 0
        self._num_generation_tokens = 0
        self._num_preemptions = 0
        self._num_steps = 0
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
        if new.request_id in self._requests:
            raise DuplicateRequestError(f"request {new.request_id!r} is already running")
        prompt_text = new.prompt if isinstance(new.prompt, str) else None
        prompt_ids = self.tokenize(new.prompt) if isinstance(new.prompt, str) else list(new.prompt)
        self._validate(prompt_ids)
        params, priors = new.params, new.prior_output_token_ids
        metrics = RequestMetrics(arrival_time=new.arrival_time or time.monotonic())
        request = _Request(new.request_id, prompt_text, prompt_ids, params, metrics)
        if priors and len(priors) != params.n:
            raise RequestRejectedError("prior_output_token_ids needs one list per choice")
        self.structured.add(new.request_id, params)
        request.forked = params.n == 1 or priors is not None
        if params.use_beam_search:
            self._add_beam_request(request, new.priority)
            return
        for index, prior in enumerate(priors or [[]]):
            seq = Sequence(
                request_id=new.request_id,
                token_ids=list(prompt_ids),
                num_prompt_tokens=len(prompt_ids),
                params=params,
                priority=new.priority,
                choice_index=index,
                arrival_time=metrics.arrival_time,
            )
            choice = self._new_choice(seq)
            if prior:
                self._replay(choice, list(prior))
            request.choices.append(choice)
            if not choice.finished:
                self._awaiting_grammar.append(seq)
        self._requests[new.request_id] = request
        if request.finished:  # resumed with every choice already complete
            self._finished_on_arrival.append(request)
        self._admit_compiled(may_wait=False)

    def _add_beam_request(self, request: _Request, priority: int) -> None:
        """Beams restart from the prompt, even on a resumed job: only final beams go out."""
        seq = Sequence(
            request_id=request.request_id,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            params=request.params,
            priority=priority,
            arrival_time=request.metrics.arrival_time,
        )
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        request.beam = BeamSearch(seq, self.stop_rules.eos_token_ids, self.max_model_len, decode)
        request.forked = True
        self.scheduler.add(seq)
        self._requests[request.request_id] = request

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

    def _new_choice(self, seq: Sequence) -> _Choice:
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params)
        return _Choice(
            seq=seq, detokenizer=detokenizer, logprobs=[] if seq.params.logprobs else None
        )

    def _replay(self, choice: _Choice, prior: list[int]) -> None:
        """Take in the tokens an earlier attempt produced, through the same stop checks."""
        seq = choice.seq
        stop = append_until_stop(seq, prior, self.stop_rules)
        replayed = seq.num_output_tokens
        delta = choice.detokenizer.add_tokens(prior[:replayed], stop)
        seq.token_ids.extend(prior[replayed:])  # past its stop: kept, though never output as text
        choice.text = choice.detokenizer.output_text
        if delta.finish_reason is not None:
            seq.mark_finished(delta.finish_reason, delta.stop_reason)
            choice.finished = True

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
        seq = Sequence(
            request_id="score",
            token_ids=list(token_ids),
            num_prompt_tokens=len(token_ids),
            params=SamplingParams(),
        )
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
            self._fail_request(self._requests[seq.request_id], failure)
        self._awaiting_grammar = still_waiting

    def _fail_request(self, request: _Request, reason: str) -> None:
        """Finish every choice of a request that has not started with "error"."""
        for index in range(len(request.choices), request.params.n):  # choices not forked yet
            seq = Sequence(
                request_id=request.request_id,
                token_ids=list(request.prompt_token_ids),
                num_prompt_tokens=len(request.prompt_token_ids),
                params=request.params,
                choice_index=index,
            )
            request.choices.append(self._new_choice(seq))
        request.forked = True
        for choice in request.choices:
            if not choice.finished:
                choice.seq.mark_finished("error", reason)
                choice.finished = True
        if request not in self._finished_on_arrival:
            self._finished_on_arrival.append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks now. Returns False if it was unknown or done."""
        if self._requests.pop(request_id, None) is None:
            return False
        self._awaiting_grammar = [s for s in self._awaiting_grammar if s.request_id != request_id]
        self.structured.release(request_id)
        self.scheduler.abort(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestDelta]:
        """Run one scheduled model step; return what each touched choice produced."""
        deltas = []
        self._admit_compiled(may_wait=True)
        for request in self._finished_on_arrival:  # resumed with every choice complete
            *earlier, last = request.choices
            deltas += [self._delta(choice, [], "", None) for choice in earlier]
            deltas.append(self._delta(last, [], "", None, self._take_output(request)))
        self._finished_on_arrival.clear()
        if self.speculator is not None:
            running = self.scheduler.running
            self.speculator.propose([s for s in running if _may_speculate(s.params)])
        output = self.scheduler.schedule()
        self._num_preemptions += len(output.preempted)
        if not output.scheduled:
            return deltas
        entries = [item for item in output.scheduled if item.samples]
        greedy = self._screens_greedy(entries, output.preempted)
        if greedy:
            greedy_token_ids = self.runner.execute_greedy(output.scheduled, output.block_copies)
        else:
            logits = self.runner.execute(output.scheduled, output.block_copies)
        self.scheduler.update_after_step(output)
        self._num_steps += 1
        now = time.monotonic()
        for item in output.scheduled:
            end = item.seq.num_computed_tokens
            start = end - item.num_new_tokens
            self._num_prompt_tokens_computed += max(0, min(end, item.seq.num_prompt_tokens) - start)
            request = self._requests.get(item.seq.request_id)
            if request is not None and request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.metrics.num_cached_prompt_tokens = item.seq.num_cached_tokens
        if not entries:
            return deltas
        if greedy:
            picks = [
                Verified([token_id], [None], [None], 0, 0) for token_id in greedy_token_ids.tolist()
            ]
        else:
            beams, sampled = split_beam_rows(logits, entries)
            preempted_beams = [s for s in output.preempted if s.params.use_beam_search]
            if beams.entries or preempted_beams:
                deltas += self._advance_beams(beams.entries, beams.logits, preempted_beams, now)
            entries = sampled.entries
            if not entries:
                return deltas
            # One logits row per sampled token position: 1 + k for a sequence verifying k drafts.
            row_seqs = [e.seq for e in entries for _ in range(1 + len(e.draft_token_ids))]
            apply_logit_bias(sampled.logits, row_seqs, self.vocab_size)
            self.structured.mask_logits(sampled.logits, row_seqs)
            picks = self._pick(sampled.logits, entries)
        for entry in entries:  # before the sampled token may finish (and free) the parent
            request = self._requests[entry.seq.request_id]
            if not request.forked:
                self._fork_choices(request)
        # Constrained sequences never speculate (_may_speculate): one token advances a grammar.
        self.structured.accept([e.seq for e in entries], [pick.token_ids[0] for pick in picks])
        for entry, pick in zip(entries, picks, strict=True):
            seq = entry.seq
            request = self._requests[seq.request_id]
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            choice = request.choices[seq.choice_index]
            deltas.append(self._advance_choice(request, choice, pick))
            if entry.draft_token_ids:
                self.scheduler.settle_draft(seq)
                if self.speculator is not None:
                    self.speculator.record(seq, pick.num_draft_tokens, pick.num_accepted_tokens)
        return deltas

    def _screens_greedy(self, entries: list[ScheduledSeq], preempted: list[Sequence]) -> bool:
        """Whether the step's tokens are all plain argmaxes, which the runner's greedy screen
        finds for less than the full logits cost (ModelRunner.execute_greedy); beams lost to
        preemption still need their search advanced from logits."""
        return (
            self.runner.greedy_screen is not None
            and bool(entries)
            and all(_argmax_only(entry) for entry in entries)
            and not any(seq.params.use_beam_search for seq in preempted)
        )

    def _advance_beams(
        self,
        entries: list[ScheduledSeq],
        logits: torch.Tensor,
        preempted: list[Sequence],
        now: float,
    ) -> list[RequestDelta]:
        """One search step for each beam request whose beams yielded logits (or lost one to
        preemption); a finished request's beams go out at once, one delta per beam, best first."""
        rows_by_request: dict[str, dict[Sequence, torch.Tensor]] = {
            seq.request_id: {} for seq in preempted if seq.request_id in self._requests
        }
        for entry, row in zip(entries, logits, strict=True):
            rows_by_request.setdefault(entry.seq.request_id, {})[entry.seq] = row
        deltas: list[RequestDelta] = []
        for request_id, rows in rows_by_request.items():
            request = self._requests[request_id]
            search = request.beam
            assert search is not None
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            seqs = list(rows)
            scaled: dict[Sequence, torch.Tensor] = {}
            if seqs:
                stacked = torch.stack([rows[seq] for seq in seqs])
                temperature = request.params.temperature
                logprobs = beam_logprobs(stacked, self.vocab_size, temperature)
                scaled = dict(zip(seqs, logprobs, strict=True))
            advanced = search.advance(scaled, self.scheduler)
            self._num_generation_tokens += advanced
            if search.done:
                deltas += self._beam_deltas(request, search)
        return deltas

    def _beam_deltas(self, request: _Request, search: BeamSearch) -> list[RequestDelta]:
        del self._requests[request.request_id]
        request.metrics.finished_time = time.monotonic()
        outputs = search.best(self.tokenizer, request.prompt_token_ids)
        if not outputs:  # every beam was lost before one finished
            outputs = [CompletionOutput(0, "", [], "abort")]
        result = RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            metrics=request.metrics,
            finished=True,
        )
        return [
            RequestDelta(
                request_id=request.request_id,
                choice_index=out.index,
                token_ids=out.token_ids,
                text=out.text,
                logprobs=None,
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                output=result if out is outputs[-1] else None,
            )
            for out in outputs
        ]

    def _pick(self, logits: torch.Tensor, entries: list[ScheduledSeq]) -> list[Verified]:
        """Each sampling entry's tokens: one sampled token, or a verified run of drafts."""
        if any(entry.draft_token_ids for entry in entries):
            return verify(self.sampler, logits, entries)
        sampled = self.sampler(logits, [entry.seq for entry in entries])
        return [
            Verified([token_id], [logprob], [top], 0, 0)
            for token_id, logprob, top in zip(
                sampled.token_ids, sampled.logprobs, sampled.top_logprobs, strict=True
            )
        ]

    def _fork_choices(self, request: _Request) -> None:
        parent = request.choices[0].seq
        for index in range(1, request.params.n):
            child = self.scheduler.fork(parent, index)
            request.choices.append(self._new_choice(child))
        request.forked = True

    def _advance_choice(self, request: _Request, choice: _Choice, pick: Verified) -> RequestDelta:
        """Append the choice's new tokens one by one, through the token stop checks and the
        detokenizer's stop strings; tokens after a stop are dropped."""
        seq = choice.seq
        token_ids: list[int] = []
        texts: list[str] = []
        logprobs: list[TokenLogprob] = []
        for token_id, value, top in zip(
            pick.token_ids, pick.logprobs, pick.top_logprobs, strict=True
        ):
            stop = self.scheduler.append_token(seq, token_id)
            self._num_generation_tokens += 1
            token_ids.append(token_id)
            if value is not None:
                top = top or []
                texts_by_id = self.token_texts([token_id, *(top_id for top_id, _ in top)])
                logprobs.append(TokenLogprob(token_id, value, top, texts_by_id))
            text_delta = choice.detokenizer.add_tokens([token_id], stop)
            texts.append(text_delta.text)
            if text_delta.finish_reason is not None:
                if stop is None:  # a stop string
                    self.scheduler.finish(seq, text_delta.finish_reason, text_delta.stop_reason)
                else:  # finished already; a stop string in the text it flushed names the stop
                    seq.mark_finished(text_delta.finish_reason, text_delta.stop_reason)
                choice.finished = True
                break
        text = "".join(texts)
        choice.text += text
        if choice.finished:
            choice.text = choice.detokenizer.output_text
        if choice.logprobs is not None:
            choice.logprobs.extend(logprobs)
        return self._delta(choice, token_ids, text, logprobs or None, self._take_output(request))

    def _delta(
        self,
        choice: _Choice,
        token_ids: list[int],
        text: str,
        logprobs: list[TokenLogprob] | None,
        output: RequestOutput | None = None,
    ) -> RequestDelta:
        return RequestDelta(
            request_id=choice.seq.request_id,
            choice_index=choice.seq.choice_index,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
            finish_reason=choice.seq.finish_reason,
            stop_reason=choice.seq.stop_reason,
            output=output,
        )

    def _take_output(self, request: _Request) -> RequestOutput | None:
        """The request's whole output, once: when its last choice has just finished."""
        if not (request.finished and request.request_id in self._requests):
            return None
        request.metrics.finished_time = time.monotonic()
        del self._requests[request.request_id]
        self.structured.release(request.request_id)
        return self._output(request)

    def _output(self, request: _Request) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=c.seq.choice_index,
                text=c.text,
                token_ids=c.seq.output_token_ids,
                finish_reason=c.seq.finish_reason,
                stop_reason=c.seq.stop_reason,
                logprobs=c.logprobs,
            )
            for c in request.choices
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            metrics=request.metrics,
            finished=True,
        )

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
        spec = self.speculator.counts if self.speculator is not None else SpeculationCounts()
        return EngineStats(
            num_blocks_total=manager.num_total_blocks,
            num_blocks_free=manager.num_free_blocks,
            num_blocks_cached=manager.num_cached_blocks,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            num_prompt_tokens_computed=self._num_prompt_tokens_computed,
            num_generation_tokens=self._num_generation_tokens,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
        )


def _argmax_only(entry: ScheduledSeq) -> bool:
    """Whether the entry's one token is its raw logits' argmax and nothing else is asked of
    them: no drafts to verify, no beams, no bias or grammar on the logits, and a sampler that
    takes the plain argmax (greedy, no penalties, no logprobs, min_tokens reached)."""
    params = entry.seq.params
    return (
        not entry.draft_token_ids
        and not params.use_beam_search
        and not params.logit_bias
        and params.structured_output is None
        and takes_only_argmax(entry.seq)
    )


def _may_speculate(params: SamplingParams) -> bool:
    """Beams are ranked, not verified; a grammar's mask at each draft position would depend
    on drafts its matcher has not accepted yet."""
    return not (params.use_beam_search or params.structured_output)
