"""Engine deltas -> numbered TokenChunks, with optional coalescing (every k tokens / t ms)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import overload

from engine import outputs
from schemas import Logprob, TokenChunk, TokenLogprob
from worker.held import ChoiceState, HeldJob


@dataclass(frozen=True)
class ChunkPolicy:
    """When a streaming choice's buffered output goes out: once it holds `tokens` tokens or its
    oldest token waited `interval_s` (a token counts from when the step that made it began, so
    steps longer than the interval publish every step). A job whose channel had no subscriber
    at the worker's last look (`watched` false) waits `unwatched_interval_s` instead, whatever
    its token count: nobody waits for it live, and once a listener subscribes the next look
    makes the job watched again (see worker.chunk_relay). A finish always goes out at once;
    jobs with stream=false publish only at the end (or when handed back)."""

    tokens: int = 1
    interval_s: float = 0.0
    unwatched_interval_s: float = 0.0

    @property
    def every_step(self) -> bool:
        return self.tokens <= 1 and self.interval_s <= 0 and self.unwatched_interval_s <= 0

    def due(self, choice: ChoiceState, now: float, *, watched: bool = True) -> bool:
        since = choice.pending_since
        if not watched and self.unwatched_interval_s > 0:
            return since is not None and now - since >= self.unwatched_interval_s
        if len(choice.pending_token_ids) >= self.tokens:
            return True
        return self.interval_s > 0 and since is not None and now - since >= self.interval_s


@overload
def convert_logprobs(items: Iterable[outputs.TokenLogprob]) -> list[TokenLogprob]: ...


@overload
def convert_logprobs(items: None) -> None: ...


def convert_logprobs(items: Iterable[outputs.TokenLogprob] | None) -> list[TokenLogprob] | None:
    """Engine TokenLogprob(token_id, logprob, top_logprobs=[(id, lp)], token_texts) -> wire
    TokenLogprob, each token with its text where the engine decoded it."""
    if items is None:
        return None
    return [
        TokenLogprob(
            token_id=item.token_id,
            logprob=float(item.logprob),
            token=item.token_texts.get(item.token_id),
            top_logprobs=[
                Logprob(token_id=int(tid), logprob=float(lp), token=item.token_texts.get(int(tid)))
                for tid, lp in item.top_logprobs
            ],
        )
        for item in items
    ]


def absorb(held: HeldJob, delta: outputs.RequestDelta, now: float) -> None:
    """Add one engine RequestDelta to its choice's unpublished output; `now`: when its tokens
    were made."""
    choice = held.choices[delta.choice_index]
    if delta.token_ids:
        if choice.pending_since is None:
            choice.pending_since = now
        choice.pending_token_ids.extend(delta.token_ids)
        choice.run_token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            logprobs = convert_logprobs(delta.logprobs)
            choice.pending_logprobs = (choice.pending_logprobs or []) + logprobs
            choice.run_logprobs = (choice.run_logprobs or []) + logprobs
    choice.pending_text += delta.text
    if delta.finish_reason is not None and choice.finish_reason is None:
        choice.finish_reason = delta.finish_reason
        choice.stop_reason = delta.stop_reason


def take_chunks(
    held: HeldJob, policy: ChunkPolicy, now: float, *, force: bool = False, watched: bool = True
) -> list[TokenChunk]:
    """The chunks due now, numbered on from `held.next_index`; the last one is `final` when the
    job's every choice has finished and nothing else is left unpublished. `force` publishes all
    buffered output (used before handing a job back); `watched`: see ChunkPolicy."""
    ready = []
    for choice in held.choices:
        if not choice.has_pending:
            continue
        finishing = choice.finish_reason is not None
        if force or finishing or (held.stream and policy.due(choice, now, watched=watched)):
            ready.append(choice)
    if not ready:
        return []
    job_done = held.all_finished and all(
        choice.finish_published or choice in ready for choice in held.choices
    )
    chunks = []
    for position, choice in enumerate(ready):
        finishing = choice.finish_reason is not None
        chunks.append(
            TokenChunk(
                job_id=held.job_id,
                index=held.next_index,
                choice=choice.index,
                text=choice.pending_text,
                token_ids=choice.pending_token_ids,
                logprobs=choice.pending_logprobs,
                finish_reason=choice.finish_reason if finishing else None,
                stop_reason=choice.stop_reason if finishing else None,
                final=job_done and position == len(ready) - 1,
                prompt_tokens=held.prompt_len if held.next_index == 0 else None,
            )
        )
        held.next_index += 1
        choice.pending_token_ids = []
        choice.pending_text = ""
        choice.pending_logprobs = None
        choice.pending_since = None
        choice.finish_published = finishing
    return chunks
