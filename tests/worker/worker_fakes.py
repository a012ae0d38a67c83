"""A fake engine with the worker-facing interface of `engine.Engine`, for fast worker tests.

Tokens are a pure function of (prompt, position), so a job resumed from any prefix of its output
ends with the same text as an uninterrupted run, like greedy decoding. A sequence holds the KV
blocks of its prompt + max_tokens from its first step (no preemption needed); `num_admissible`
follows the real engine's formula, so admission by free blocks can be tested in milliseconds.
`step_seconds` makes a step take time (sleeping, so other threads run), to kill or cancel a
worker mid-generation; `kill_on_prompt_token` makes a step that runs a prompt holding that id
SIGKILL its own process at the end of the step (a job that crashes its worker).

Used in-process (`FakeEngine(...)`) and by worker subprocesses through
`INFERQ_ENGINE_FACTORY=worker_fakes:build_engine` (with this folder on PYTHONPATH); the
factory reads `INFERQ_FAKE_STEP_SECONDS`, `INFERQ_FAKE_KILL_ON_TOKEN` and the worker settings'
block / seq counts.
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine import outputs
from engine.errors import ContextLengthExceededError, InvalidTokenIdError, RequestRejectedError
from schemas.jobs import JobKind
from schemas.sampling import SamplingParams

VOCAB = 1000
EOS = 0


def fake_token(prompt_ids: list[int], choice: int, position: int) -> int:
    """The output token at `position`: deterministic, never EOS, never below 10."""
    digest = hashlib.blake2b(f"{prompt_ids}|{choice}|{position}".encode(), digest_size=4)
    return 10 + int.from_bytes(digest.digest(), "little") % (VOCAB - 10)


def fake_text(token_id: int) -> str:
    return f" t{token_id}"


def expected_output(
    prompt_ids: list[int], max_tokens: int, choice: int = 0
) -> tuple[list[int], str]:
    ids = [fake_token(prompt_ids, choice, i) for i in range(max_tokens)]
    return ids, "".join(fake_text(t) for t in ids)


@dataclass
class _Seq:
    request_id: str
    choice: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int]
    blocks: int = 0
    finish_reason: str | None = None
    running: bool = False


@dataclass
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[_Seq]
    metrics: outputs.RequestMetrics
    emitted_on_arrival: bool = False


@dataclass
class FakeEngine:
    num_kv_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 64
    max_model_len: int = 512
    vocab_size: int = VOCAB
    tokenizer_file: Path | None = None  # its tokenizer is a function, with no tokenizer.json
    quantization: str | None = None  # what it says it runs (the heartbeat carries it)
    weight_bytes: int = 0
    architecture: str | None = None  # the architecture it says it serves the model as
    task: JobKind = JobKind.GENERATION
    embedding_size: int | None = None
    step_seconds: float = 0.0
    fail_on_prompt_token: int | None = None  # a prompt holding this id makes step() raise
    fail_after_tokens: int = 0  # ... once its sequence has generated this many tokens
    kill_on_prompt_token: int | None = None  # ... makes step() SIGKILL this process
    steps: int = 0
    _requests: dict[str, _Request] = field(default_factory=dict)
    _waiting: list[_Seq] = field(default_factory=list)
    _running: list[_Seq] = field(default_factory=list)
    _generated: int = 0
    _prompt_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- requests
    def tokenize_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        raise RequestRejectedError("the fake engine scores no text pairs")

    def tokenize(self, text: str) -> list[int]:
        return [10 + (ord(ch) % (VOCAB - 10)) for ch in text]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.tokenize("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>")

    def add_request(self, new: outputs.EngineRequest) -> None:
        assert self._lock.acquire(blocking=False), "two threads inside the engine"
        try:
            request_id, params = new.request_id, new.params
            ids = self.tokenize(new.prompt) if isinstance(new.prompt, str) else list(new.prompt)
            if request_id in self._requests:
                raise RequestRejectedError(f"duplicate {request_id}")
            if not ids:
                raise RequestRejectedError("the prompt is empty")
            if len(ids) >= self.max_model_len:
                raise ContextLengthExceededError(
                    f"prompt of {len(ids)} tokens, context {self.max_model_len}"
                )
            if min(ids) < 0 or max(ids) >= VOCAB:
                raise InvalidTokenIdError(f"prompt token ids must be in [0, {VOCAB})")
            priors = new.prior_output_token_ids or [[] for _ in range(params.n)]
            seqs = [_Seq(request_id, i, ids, params, list(prior)) for i, prior in enumerate(priors)]
            for seq in seqs:
                if len(seq.output_ids) >= params.max_tokens:
                    seq.finish_reason = "length"
                else:
                    self._waiting.append(seq)
            metrics = outputs.RequestMetrics(arrival_time=new.arrival_time or time.monotonic())
            self._requests[request_id] = _Request(request_id, ids, params, seqs, metrics)
        finally:
            self._lock.release()

    def abort(self, request_id: str) -> bool:
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            self._release(seq)
        return True

    def _release(self, seq: _Seq) -> None:
        if seq in self._waiting:
            self._waiting.remove(seq)
        if seq in self._running:
            self._running.remove(seq)
        seq.blocks = 0

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # -- capacity
    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _free_blocks(self) -> int:
        return self.num_kv_blocks - sum(s.blocks for s in self._running)

    def _blocks_needed(self, seq: _Seq) -> int:
        return self._blocks_for(len(seq.prompt_ids) + seq.params.max_tokens)

    def free_blocks_after_waiting(self) -> int:
        return self._free_blocks() - sum(self._blocks_needed(s) for s in self._waiting)

    def num_admissible(self, prompt_len: int, max_tokens: int = 16) -> int:
        if prompt_len + 1 > self.max_model_len:
            return 0
        per_request = (
            math.ceil((prompt_len + min(max_tokens, self.block_size)) / self.block_size) + 1
        )
        slots = self.max_num_seqs - len(self._running) - len(self._waiting)
        return max(0, min(max(0, self.free_blocks_after_waiting()) // per_request, slots))

    def admissible(self, prompt_len: int, max_tokens: int) -> bool:
        return self.num_admissible(prompt_len, max_tokens) > 0

    # -- the step
    def step(self) -> list[outputs.RequestDelta]:
        assert self._lock.acquire(blocking=False), "two threads inside the engine"
        try:
            return self._step()
        finally:
            self._lock.release()

    def _step(self) -> list[outputs.RequestDelta]:
        deltas: list[outputs.RequestDelta] = []
        for request in list(self._requests.values()):
            if not request.emitted_on_arrival and all(s.finish_reason for s in request.seqs):
                request.emitted_on_arrival = True
                for seq in request.seqs:
                    deltas.append(self._delta(request, seq, []))
        while self._waiting and len(self._running) < self.max_num_seqs:
            seq = self._waiting[0]
            need = self._blocks_needed(seq)
            if need > self._free_blocks():
                break
            self._waiting.pop(0)
            seq.blocks = need
            seq.running = True
            self._running.append(seq)
            self._prompt_tokens += len(seq.prompt_ids) + len(seq.output_ids)
        if not self._running:
            return deltas
        if self.fail_on_prompt_token is not None and any(
            self.fail_on_prompt_token in s.prompt_ids
            and len(s.output_ids) >= self.fail_after_tokens
            for s in self._running
        ):
            raise RuntimeError("fake engine failure")
        if self.step_seconds:
            time.sleep(self.step_seconds)
        if self.kill_on_prompt_token is not None and any(
            self.kill_on_prompt_token in s.prompt_ids for s in self._running
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        self.steps += 1
        now = time.monotonic()
        for seq in list(self._running):
            request = self._requests[seq.request_id]
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            token = fake_token(seq.prompt_ids, seq.choice, len(seq.output_ids))
            seq.output_ids.append(token)
            self._generated += 1
            if len(seq.output_ids) >= seq.params.max_tokens:
                seq.finish_reason = "length"
                self._release(seq)
            deltas.append(self._delta(request, seq, [token]))
        return deltas

    def _delta(self, request: _Request, seq: _Seq, tokens: list[int]) -> outputs.RequestDelta:
        output = None
        if all(s.finish_reason for s in request.seqs) and request.request_id in self._requests:
            request.metrics.finished_time = time.monotonic()
            del self._requests[request.request_id]
            output = outputs.RequestOutput(
                request_id=request.request_id,
                prompt=None,
                prompt_token_ids=request.prompt_ids,
                outputs=[
                    outputs.CompletionOutput(
                        index=s.choice,
                        text="".join(fake_text(t) for t in s.output_ids),
                        token_ids=list(s.output_ids),
                        finish_reason=s.finish_reason,
                    )
                    for s in request.seqs
                ],
                metrics=request.metrics,
                finished=True,
            )
        return outputs.RequestDelta(
            request_id=request.request_id,
            choice_index=seq.choice,
            token_ids=tokens,
            text="".join(fake_text(t) for t in tokens),
            finish_reason=seq.finish_reason,
            output=output,
        )

    def stats(self) -> outputs.EngineStats:
        return outputs.EngineStats(
            num_blocks_total=self.num_kv_blocks,
            num_blocks_free=self._free_blocks(),
            num_blocks_cached=0,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_prompt_tokens_computed=self._prompt_tokens,
            num_generation_tokens=self._generated,
            num_preemptions=0,
            num_steps=self.steps,
        )


def build_engine(settings) -> FakeEngine:
    """Engine factory for worker subprocesses (`INFERQ_ENGINE_FACTORY=worker_fakes:build_engine`)."""
    return FakeEngine(
        num_kv_blocks=settings.num_kv_blocks or 256,
        max_num_seqs=settings.max_num_seqs or 64,
        step_seconds=float(os.environ.get("INFERQ_FAKE_STEP_SECONDS", "0")),
        kill_on_prompt_token=int(kill)
        if (kill := os.environ.get("INFERQ_FAKE_KILL_ON_TOKEN"))
        else None,
    )
