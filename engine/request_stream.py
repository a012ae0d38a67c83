"""One request's output stream inside `AsyncLLM`: the engine's per-step deltas in, the
`RequestOutput`s vLLM's `generate()` yields out (cumulative, delta or final only).

The stream keeps the request's output so far and what it already handed out; an output is
built when the consumer asks for it, so a consumer slower than the engine gets one output that
covers every step it missed (as vLLM's collector merges them) and memory stays one output.
Lives on the event loop's thread only.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from engine.outputs import CompletionOutput, RequestDelta, RequestMetrics, RequestOutput
from engine.sampling_params import RequestOutputKind


@dataclass
class _Sent:
    """How much of one choice the consumer has had (delta mode)."""

    text: int = 0
    tokens: int = 0
    logprobs: int = 0
    finished: bool = False


class RequestStream:
    def __init__(
        self, request_id: str, prompt: str | None, kind: RequestOutputKind, metrics: RequestMetrics
    ) -> None:
        self.request_id = request_id
        self.kind = kind
        self.started = False  # the engine has taken the request: deltas for this id are ours
        self.finished = False
        self._prompt = prompt
        self._prompt_token_ids: list[int] = []
        self._metrics = metrics
        self._choices: dict[int, CompletionOutput] = {}
        self._sent: dict[int, _Sent] = {}
        self._error: BaseException | None = None
        self._fresh = False  # something the consumer has not had yet
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ engine side

    def start(self, prompt_token_ids: list[int], metrics: RequestMetrics, choices: int) -> None:
        """The engine took the request; `choices` is how many sampled choices it has (0 for a
        beam search, whose beams arrive only when it ends)."""
        self.started = True
        self._prompt_token_ids = prompt_token_ids
        self._metrics = metrics
        for index in range(choices):
            self._choices[index] = CompletionOutput(index, "", [])

    def add(self, deltas: list[RequestDelta]) -> None:
        """One engine step's deltas for this request."""
        final: RequestOutput | None = None
        for delta in deltas:
            choice = self._choices.setdefault(
                delta.choice_index, CompletionOutput(delta.choice_index, "", [])
            )
            choice.text += delta.text
            choice.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                if choice.logprobs is None:
                    choice.logprobs = []
                choice.logprobs.extend(delta.logprobs)
            if delta.finish_reason is not None:
                choice.finish_reason = delta.finish_reason
                choice.stop_reason = delta.stop_reason
            if delta.output is not None:
                final = delta.output
        if final is not None:  # the engine's whole output is the one source of the final text
            self._choices = {choice.index: choice for choice in final.outputs}
            self._prompt = final.prompt
            self._prompt_token_ids = final.prompt_token_ids
            self._metrics = final.metrics
            self.finished = True
        self._notify()

    def abort(self) -> None:
        """End the stream now: unfinished choices finish with "abort"."""
        if self.finished:
            return
        for choice in self._choices.values():
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
        self.finished = True
        self._notify()

    def fail(self, error: BaseException) -> None:
        """End the stream with an error its consumer gets raised."""
        self._error = error
        self.finished = True
        self._changed.set()

    def _notify(self) -> None:
        self._fresh = True
        self._changed.set()

    # ------------------------------------------------------------------ consumer side

    async def next_output(self) -> RequestOutput:
        """The next output (waits for one); raises the error the request failed with."""
        while True:
            if self._error is not None:
                raise self._error
            if self._fresh and (self.finished or self.kind is not RequestOutputKind.FINAL_ONLY):
                self._fresh = False
                return self._build()
            self._changed.clear()
            await self._changed.wait()

    def _build(self) -> RequestOutput:
        completions = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            if self.kind is RequestOutputKind.DELTA:
                piece = self._new_part(choice)
                if piece is not None:
                    completions.append(piece)
            else:
                completions.append(_copy(choice))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self._prompt,
            prompt_token_ids=list(self._prompt_token_ids),
            outputs=completions,
            metrics=replace(self._metrics),
            finished=self.finished,
        )

    def _new_part(self, choice: CompletionOutput) -> CompletionOutput | None:
        """What of the choice the consumer has not had; None when nothing changed."""
        sent = self._sent.setdefault(choice.index, _Sent())
        logprobs = choice.logprobs[sent.logprobs :] if choice.logprobs is not None else None
        finished = choice.finish_reason is not None
        unchanged = len(choice.token_ids) == sent.tokens and len(choice.text) == sent.text
        if unchanged and finished == sent.finished:
            return None
        piece = CompletionOutput(
            index=choice.index,
            text=choice.text[sent.text :],
            token_ids=choice.token_ids[sent.tokens :],
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=choice.cumulative_logprob,
        )
        self._sent[choice.index] = _Sent(
            len(choice.text),
            len(choice.token_ids),
            len(choice.logprobs) if choice.logprobs is not None else 0,
            finished,
        )
        return piece


def _copy(choice: CompletionOutput) -> CompletionOutput:
    """A snapshot the stream's later steps do not change under the consumer."""
    logprobs = list(choice.logprobs) if choice.logprobs is not None else None
    return replace(choice, token_ids=list(choice.token_ids), logprobs=logprobs)
