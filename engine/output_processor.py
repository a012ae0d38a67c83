"""After a model step: what each request kind does with its rows. Plain requests append their
picked tokens through the stop checks and the detokenizer (forking n > 1 choices first, settling
verified drafts); beam search requests advance their search from the logits rows; a request
whose last choice finished hands out its whole output. Also plans each step's rows: what each
request kind asks of the runner."""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.beam_search import beam_logprobs
from engine.outputs import CompletionOutput, RequestDelta, RequestOutput, TokenLogprob
from engine.prompt_logprobs import PromptLogprobsChunk
from engine.request_state import ChoiceState, RequestState
from engine.runner_io import (
    LogitsProcessor,
    ModelRunnerOutput,
    RowMode,
    SamplingBatch,
    SamplingRow,
    TokenPick,
    sampling_mode,
)
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import ScheduledSeq, Sequence
from engine.speculative.speculator import Speculator
from engine.structured import StructuredDecoding
from engine.token_text import TokenTexts


class OutputProcessor:
    """The engine's running requests and what each step's output does to them."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Any | None,
        structured: StructuredDecoding,
        processors: list[LogitsProcessor],
        speculator: Speculator | None,
        vocab_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.structured = structured
        self.processors = processors
        self.speculator = speculator
        self.vocab_size = vocab_size
        self.requests: dict[str, RequestState] = {}
        self.finished_on_arrival: list[RequestState] = []
        self.num_prompt_tokens_computed = 0
        self.num_generation_tokens = 0
        self.num_steps = 0

    # ------------------------------------------------------------------ before the step

    def plan(self, sched: SchedulerOutput) -> SamplingBatch:
        """What each sampling entry of the step asks of the runner: beams their logits rows,
        the others a plain argmax where nothing more is needed, else a draw."""
        rows = [
            SamplingRow(
                entry,
                RowMode.LOGITS
                if entry.seq.params.use_beam_search
                else sampling_mode(entry, self.processors),
            )
            for entry in sched.scheduled
            if entry.samples
        ]
        return SamplingBatch(rows, self.processors)

    def take_finished_on_arrival(self) -> list[RequestDelta]:
        """Deltas of requests resumed with every choice already complete."""
        deltas = []
        for request in self.finished_on_arrival:
            if request.returned is not None:
                output = self._take_output(request)
                deltas += [] if output is None else _whole_output_deltas(request.request_id, output)
                continue
            *earlier, last = request.choices
            deltas += [choice.delta([], "", None) for choice in earlier]
            deltas.append(last.delta([], "", None, self._take_output(request)))
        self.finished_on_arrival.clear()
        return deltas

    # ------------------------------------------------------------------ after the step

    def process(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestDelta]:
        """What each request touched by the step produced (after update_after_step)."""
        self.num_steps += 1
        now = time.monotonic()
        self._account_scheduled(sched.scheduled, now)
        if out.prompt_logprobs:
            self._record_prompt_logprobs(out.prompt_logprobs)
        if not (out.picks or out.logits):
            return []
        preempted_beams = [s for s in sched.preempted if s.params.use_beam_search]
        deltas = []
        if out.logits or preempted_beams:
            deltas += self._advance_beams(out.logits, preempted_beams, now)
        if out.picks:
            deltas += self._advance_choices(out.picks, now)
        return deltas

    def _account_scheduled(self, scheduled: list[ScheduledSeq], now: float) -> None:
        for item in scheduled:
            end = item.seq.num_computed_tokens
            start = end - item.num_new_tokens
            self.num_prompt_tokens_computed += max(0, min(end, item.seq.num_prompt_tokens) - start)
            request = self.requests.get(item.seq.request_id)
            if request is not None and request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
                request.metrics.num_cached_prompt_tokens = item.seq.num_cached_tokens

    def _advance_choices(
        self, picks: list[tuple[ScheduledSeq, TokenPick]], now: float
    ) -> list[RequestDelta]:
        for entry, _ in picks:  # before the sampled token may finish (and free) the parent
            request = self.requests[entry.seq.request_id]
            if not request.forked:
                self._fork_choices(request)
        # Constrained sequences never speculate: one token advances a grammar.
        self.structured.accept([e.seq for e, _ in picks], [p.token_ids[0] for _, p in picks])
        deltas = []
        for entry, pick in picks:
            seq = entry.seq
            request = self.requests[seq.request_id]
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            choice = request.choices[seq.choice_index]
            delta = self._advance_choice(request, choice, pick)
            if request.returned is None:
                deltas.append(delta)
            elif delta.output is not None:  # best_of: the chosen choices, once all finished
                deltas += _whole_output_deltas(request.request_id, delta.output)
            if entry.draft_token_ids:
                self.scheduler.settle_draft(seq)
                if self.speculator is not None:
                    self.speculator.record(seq, pick.num_draft_tokens, pick.num_accepted_tokens)
        return deltas

    def _record_prompt_logprobs(
        self, scored: list[tuple[ScheduledSeq, PromptLogprobsChunk]]
    ) -> None:
        for entry, chunk in scored:
            request = self.requests.get(entry.seq.request_id)
            if request is None or request.prompt_logprobs is None:
                continue
            for offset, (token_id, value, top) in enumerate(
                zip(chunk.token_ids, chunk.logprobs, chunk.top_logprobs, strict=True)
            ):
                texts = self.token_texts([token_id, *(top_id for top_id, _ in top)])
                token = TokenLogprob(token_id, value, top, texts)
                request.prompt_logprobs[chunk.first_position + offset] = token

    def _fork_choices(self, request: RequestState) -> None:
        parent = request.choices[0].seq
        for index in range(1, request.params.n):
            child = self.scheduler.fork(parent, index)
            request.choices.append(ChoiceState.start(child, self.tokenizer))
        request.forked = True

    def _advance_choice(
        self, request: RequestState, choice: ChoiceState, pick: TokenPick
    ) -> RequestDelta:
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
            self.num_generation_tokens += 1
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
        return choice.delta(token_ids, text, logprobs or None, self._take_output(request))

    def _take_output(self, request: RequestState) -> RequestOutput | None:
        """The request's whole output, once: when its last choice has just finished."""
        if not (request.finished and request.request_id in self.requests):
            return None
        del self.requests[request.request_id]
        self.structured.release(request.request_id)
        return request.output()

    # ------------------------------------------------------------------ beam search

    def _advance_beams(
        self,
        rows: list[tuple[ScheduledSeq, torch.Tensor]],
        preempted: list[Sequence],
        now: float,
    ) -> list[RequestDelta]:
        """One search step for each beam request whose beams yielded logits (or lost one to
        preemption); a finished request's beams go out at once, one delta per beam, best first."""
        rows_by_request: dict[str, dict[Sequence, torch.Tensor]] = {
            seq.request_id: {} for seq in preempted if seq.request_id in self.requests
        }
        for entry, logits in rows:  # a beam entry never carries drafts: one row each
            rows_by_request.setdefault(entry.seq.request_id, {})[entry.seq] = logits[0]
        deltas: list[RequestDelta] = []
        for request_id, beam_rows in rows_by_request.items():
            request = self.requests[request_id]
            search = request.beam
            assert search is not None
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            seqs = list(beam_rows)
            scaled: dict[Sequence, torch.Tensor] = {}
            if seqs:
                stacked = torch.stack([beam_rows[seq] for seq in seqs])
                temperature = request.params.temperature
                logprobs = beam_logprobs(stacked, self.vocab_size, temperature)
                scaled = dict(zip(seqs, logprobs, strict=True))
            self.num_generation_tokens += search.advance(scaled, self.scheduler)
            if search.done:
                deltas += self._beam_deltas(request)
        return deltas

    def _beam_deltas(self, request: RequestState) -> list[RequestDelta]:
        assert request.beam is not None
        del self.requests[request.request_id]
        request.metrics.finished_time = time.monotonic()
        outputs = request.beam.best(self.tokenizer, request.prompt_token_ids)
        if not outputs:  # every beam was lost before one finished
            outputs = [CompletionOutput(0, "", [], "abort")]
        return _whole_output_deltas(request.request_id, request.output_of(outputs))


def _whole_output_deltas(request_id: str, result: RequestOutput) -> list[RequestDelta]:
    """One delta per output holding all of it, the last carrying the request's whole output:
    how requests whose outputs are only known at the end (beams, best_of) leave the engine."""
    outputs = result.outputs
    return [
        RequestDelta(
            request_id=request_id,
            choice_index=out.index,
            token_ids=out.token_ids,
            text=out.text,
            logprobs=out.logprobs,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            output=result if out is outputs[-1] else None,
        )
        for out in outputs
    ]
