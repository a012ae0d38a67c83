"""Beam search inside the continuous batch: one request owns up to beam_width sequences.

Each time every live beam of a request has its next-token logits, the request takes the top
(1 + the number of ending token ids, at least 2) x beam_width continuations over all its beams
by cumulative log-probability (log-softmax of the logits, divided by the temperature when one
is set), as transformers does, so that beam_width continuations that do not end are among them
even when each beam's best ones end. Continuations that finish (EOS unless ignore_eos, a stop
token id, a stop string, max_tokens or the context length) become finished hypotheses when they
rank within the first beam_width, scored cumulative logprob divided by output length (the
ending token included) ** length_penalty; the best beam_width unfinished ones become the next
beams. A beam chosen once keeps its sequence; a beam chosen again is branched through the block
manager (its blocks shared, copied on write); a beam not chosen is freed. The search ends, as
transformers' early_stopping=True does, once beam_width hypotheses finished.

Exact beam search needs every live beam's row before a step: a running beam left out of a
model step (past the step's token budget) is waited for while the others keep their rows and
sit idle (nothing left to compute, so the scheduler passes them over). A beam preempted for
memory is dropped instead, unless every live beam was: waiting for its recompute while its
siblings hold their blocks could wait forever. Beams that all recompute give their rows again
once recomputed. Under such memory pressure the search is not exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.stop import Stop
from schemas.chunks import FinishReason
from schemas.sampling import SamplingParams

Decode = Callable[[list[int]], str]


@dataclass(frozen=True)
class BeamSearchParams:
    """Offline beam search parameters, as vLLM names them."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)

    def to_sampling_params(self) -> SamplingParams:
        """The engine's one parameter type: n is the beam width."""
        return SamplingParams(
            n=self.beam_width,
            use_beam_search=True,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            length_penalty=self.length_penalty,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
        )


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its output tokens (a finishing EOS or stop token id included)."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason
    stop_reason: str | int | None = None


@dataclass(eq=False)
class _Beam:
    seq: Sequence
    cumulative_logprob: float = 0.0


def beam_logprobs(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """float32 log-softmax rows over the vocabulary (LM-head padding columns cut off)."""
    raw = logits[:, :vocab_size].float()
    if temperature > 0:
        raw = raw / temperature
    return raw.log_softmax(dim=-1)


class BeamSearch:
    """The beam bookkeeping of one request; its sequences live in the scheduler."""

    def __init__(
        self,
        first: Sequence,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        decode: Decode | None,
    ) -> None:
        self.params = first.params
        self.width = first.params.n
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        ending_ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            ending_ids |= eos_token_ids
        self._num_candidates = max(2, 1 + len(ending_ids)) * self.width
        self._decode = decode
        self.live: list[_Beam] = [_Beam(first)]
        self.finished: list[Hypothesis] = []
        self.done = False
        self._rows: dict[Sequence, torch.Tensor] = {}  # this step's logprob rows so far

    def has_row(self, seq: Sequence) -> bool:
        """Whether seq's logprob row for this step is in, waiting for its siblings' rows."""
        return seq in self._rows

    def advance(self, rows: dict[Sequence, torch.Tensor], scheduler: Scheduler) -> int:
        """Take beams' logprob rows; once every live beam has one, run one search step.
        Returns the tokens appended."""
        self._rows.update(rows)
        self._drop_preempted(scheduler)
        if any(beam.seq not in self._rows for beam in self.live):
            return 0
        present, rows = self.live, self._rows
        self._rows = {}
        logprobs = torch.stack([rows[beam.seq] for beam in present])
        cumulative = torch.tensor(
            [beam.cumulative_logprob for beam in present], device=logprobs.device
        )
        totals = (logprobs + cumulative[:, None]).flatten()
        values, indices = totals.topk(min(self._num_candidates, totals.numel()))
        vocab = logprobs.shape[1]
        chosen: list[tuple[_Beam, int, float]] = []
        new_finished: list[Hypothesis] = []
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist(), strict=True)):
            parent, token_id = present[index // vocab], index % vocab
            ending = self._ending(parent.seq, token_id)
            if ending is not None:
                if rank < self.width:
                    num_output = parent.seq.num_output_tokens + 1
                    score = value / (num_output**self.params.length_penalty)
                    tokens = [*parent.seq.output_token_ids, token_id]
                    new_finished.append(Hypothesis(tokens, value, score, *ending))
            elif len(chosen) < self.width:
                chosen.append((parent, token_id, value))
        if len(self.finished) < self.width:  # full: no more hypotheses are taken
            merged = sorted(self.finished + new_finished, key=lambda h: h.score, reverse=True)
            self.finished = merged[: self.width]
        if len(self.finished) >= self.width or not chosen:
            for beam in present:
                scheduler.finish(beam.seq, "abort")
            self.live = []
            self.done = True
            return 0
        self.live = self._continue(present, chosen, scheduler)
        return len(self.live)

    def _drop_preempted(self, scheduler: Scheduler) -> None:
        preempted = [b for b in self.live if b.seq.status is SequenceStatus.WAITING]
        for beam in preempted:
            # Its recompute samples the row again; a row kept meanwhile would let the step
            # run and append a token to a beam still recomputing its prefix.
            self._rows.pop(beam.seq, None)
        if not preempted or len(preempted) == len(self.live):
            return
        for beam in preempted:
            scheduler.finish(beam.seq, "abort")
        self.live = [beam for beam in self.live if beam not in preempted]

    def _continue(
        self,
        present: list[_Beam],
        chosen: list[tuple[_Beam, int, float]],
        scheduler: Scheduler,
    ) -> list[_Beam]:
        """The next beams' sequences: every branch is made before any parent takes its token."""
        taken: set[_Beam] = set()
        seqs: list[Sequence] = []
        for index, (parent, _, _) in enumerate(chosen):
            if parent in taken:
                seqs.append(scheduler.branch(parent.seq, index))
            else:
                taken.add(parent)
                seqs.append(parent.seq)
        for seq, (_, token_id, _) in zip(seqs, chosen, strict=True):
            seq.append_token(token_id)
        for beam in present:
            if beam not in taken:
                scheduler.finish(beam.seq, "abort")
        return [_Beam(seq, value) for seq, (_, _, value) in zip(seqs, chosen, strict=True)]

    def _ending(self, seq: Sequence, token_id: int) -> tuple[FinishReason, str | int | None] | None:
        """How appending token_id would finish a beam (reason, stop reason), or None."""
        params = self.params
        if token_id in params.stop_token_ids:
            return "stop", token_id
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop", None
        if params.stop and self._decode is not None:
            text = self._decode([*seq.output_token_ids, token_id])
            for stop in params.stop:
                if stop in text:
                    return "stop", stop
        if seq.num_output_tokens + 1 >= params.max_tokens or seq.num_tokens + 1 >= (
            self.max_model_len
        ):
            return "length", None
        return None

    def best(self, tokenizer: object, prompt_token_ids: list[int]) -> list[CompletionOutput]:
        """The finished hypotheses, best first, with their text (cut at a stop string)."""
        outputs = []
        for index, hypothesis in enumerate(self.finished[: self.width]):
            detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, self.params)
            reason = hypothesis.stop_reason
            stop = None  # a stop string: the detokenizer finds it and cuts the text there
            if hypothesis.finish_reason == "length":
                stop = Stop("length")
            elif reason is None or isinstance(reason, int):
                stop = Stop("stop", reason)
            detokenizer.add_tokens(hypothesis.token_ids, stop)
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=detokenizer.output_text,
                    token_ids=hypothesis.token_ids,
                    finish_reason=hypothesis.finish_reason,
                    stop_reason=hypothesis.stop_reason,
                    cumulative_logprob=hypothesis.cumulative_logprob,
                )
            )
        return outputs
