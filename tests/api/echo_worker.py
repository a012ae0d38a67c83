"""A contract-following fake worker for the API tests, built on tests/api/fake_worker.py.

It serves jobs one after another until stopped, beats a heartbeat (optionally advertising
`max_model_len`, its vocabulary size and optionally a tokenizer.json that counts words as it
does), and "generates" by echoing the input's words: `echo_output(request)` computes what any
job must produce, so tests compare against it instead of hard-coded text. Inputs of
`max_model_len` words or more fail with context_length_exceeded, and token ids outside its
vocabulary with invalid_token_id, as a real worker's would.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis
from tokenizers import Tokenizer, models, pre_tokenizers

from schemas import (
    TRANSITION_SCRIPT,
    ChoiceResult,
    ErrorBody,
    ErrorCode,
    JobRequest,
    JobResult,
    JobStatus,
    RedisKeys,
    Timings,
    TokenChunk,
    TokenLogprob,
    Usage,
    WorkerInfo,
    transition_applied,
    transition_call,
    utc_now,
)
from schemas.chunks import Logprob
from tests.api.fake_worker import Claimed, FakeWorker


def input_words(request: JobRequest) -> list[str]:
    if request.prompt is not None:
        text = request.prompt
    elif request.messages is not None:
        text = " ".join(m.content for m in request.messages)
    else:
        text = " ".join(str(t) for t in request.prompt_token_ids or [])
    return text.split()


ECHO_VOCAB = 49152


def token_id(piece: str) -> int:
    return sum(piece.encode()) % ECHO_VOCAB


def write_echo_tokenizer(folder: Path) -> Path:
    """A tokenizer.json that counts tokens as the echo worker does (one per whitespace-separated
    word), for the API to load as it loads a real model's."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def logprob_of(piece: str) -> float:
    return -round(len(piece) / 10, 3)


@dataclass(frozen=True)
class EchoOutput:
    pieces: list[str]  # text delta of each step (the same for every choice)
    finish_reason: str
    prompt_tokens: int

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def token_ids(self) -> list[int]:
        return [token_id(p) for p in self.pieces]


def echo_output(request: JobRequest) -> EchoOutput:
    """What the echo worker produces for `request` (per choice)."""
    words = input_words(request)
    pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
    limit = request.sampling.max_tokens
    finish = "length" if len(pieces) > limit else "stop"
    return EchoOutput(pieces[:limit], finish, len(words))


def _logprobs(piece: str, top: int) -> TokenLogprob:
    alternatives = [Logprob(token_id=token_id(piece), logprob=logprob_of(piece), token=piece)]
    alternatives += [
        Logprob(token_id=k, logprob=logprob_of(piece) - k, token=f"<alt{k}>") for k in range(1, top)
    ]
    return TokenLogprob(
        token_id=token_id(piece),
        logprob=logprob_of(piece),
        token=piece,
        top_logprobs=alternatives[:top],
    )


def _prompt_logprobs(request: JobRequest) -> list[TokenLogprob | None] | None:
    """Each prompt word's logprob as the echo model scores it; none for the first (vLLM's)."""
    top = request.sampling.prompt_logprobs
    if top is None:
        return None
    pieces = [" " + word for word in input_words(request)[1:]]
    return [None, *(_logprobs(piece, top) for piece in pieces)]


class EchoWorker(FakeWorker):
    def __init__(
        self,
        redis: Redis,
        keys: RedisKeys,
        model: str,
        *,
        name: str = "echo-1",
        max_model_len: int | None = None,
        step_delay_s: float = 0.0,
        tokenizer_file: Path | None = None,
        quantization: str | None = None,
        architecture: str | None = None,
        lora_adapters: list[str] | None = None,
    ) -> None:
        super().__init__(redis, keys, model, name)
        self.lora_adapters = lora_adapters or []
        self.loras: list[str | None] = []  # each served job's adapter
        self.quantization = quantization
        self.architecture = architecture
        self.max_model_len = max_model_len
        self.tokenizer_file = tokenizer_file
        self.step_delay_s = step_delay_s
        self.served: list[str] = []

    async def beat(self) -> None:
        now = utc_now()
        info = WorkerInfo(
            name=self.name,
            model=self.model,
            kv_blocks_free=100,
            kv_blocks_total=100,
            vocab_size=ECHO_VOCAB,
            tokenizer_file=str(self.tokenizer_file) if self.tokenizer_file else None,
            quantization=self.quantization,
            architecture=self.architecture,
            lora_adapters=self.lora_adapters,
            started_at=now,
            updated_at=now,
        ).to_redis_hash()
        if self.max_model_len is not None:
            info["max_model_len"] = str(self.max_model_len)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.worker(self.name), mapping=info)
            pipe.expire(self.keys.worker(self.name), 10)
            await pipe.execute()

    async def run(self, stop: asyncio.Event) -> None:
        await self.create_group()
        await self.beat()
        beating = asyncio.create_task(self._beat_forever())
        try:
            while not stop.is_set():
                claimed = await self.claim(block_ms=100)
                if claimed is not None:
                    await self.serve(claimed)
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
            await self.redis.delete(self.keys.worker(self.name))

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self.beat()

    async def _end(self, claimed: Claimed, status: JobStatus, fields: dict) -> None:
        keys_, args = transition_call(self.keys, claimed.job.id, status, fields)
        transition_applied(await self.redis.eval(TRANSITION_SCRIPT, 2, *keys_, *args))
        await self._done(claimed.entry_id, claimed.stream)

    async def serve(self, claimed: Claimed) -> None:
        job = claimed.job
        self.served.append(job.id)
        self.loras.append(job.request.lora)
        request = job.request
        ids = request.prompt_token_ids or []
        if any(not 0 <= t < ECHO_VOCAB for t in ids):
            error = ErrorBody.of(ErrorCode.INVALID_TOKEN_ID, f"ids must be below {ECHO_VOCAB}")
            await self._end(claimed, JobStatus.FAILED, {"error": error, "finished_at": utc_now()})
            return
        if self.max_model_len is not None and len(input_words(request)) >= self.max_model_len:
            error = ErrorBody.of(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt has {len(input_words(request))} tokens, the context "
                f"{self.max_model_len}",
            )
            await self._end(claimed, JobStatus.FAILED, {"error": error, "finished_at": utc_now()})
            return
        output = echo_output(request)
        sampling = request.sampling
        index = 0
        first_token_at = None
        for step, piece in enumerate(output.pieces):
            if await self.redis.hget(self.keys.job(job.id), "status") != JobStatus.RUNNING:
                await self._done(
                    claimed.entry_id, claimed.stream
                )  # cancelled meanwhile: drop the work
                return
            last = step == len(output.pieces) - 1
            chunks = []
            for choice in range(sampling.n):
                chunks.append(
                    TokenChunk(
                        job_id=job.id,
                        index=index,
                        choice=choice,
                        text=piece,
                        token_ids=[token_id(piece)],
                        logprobs=[_logprobs(piece, sampling.top_logprobs)]
                        if sampling.logprobs
                        else None,
                        finish_reason=output.finish_reason if last else None,
                        final=last and choice == sampling.n - 1,
                        prompt_tokens=output.prompt_tokens if index == 0 else None,
                    )
                )
                index += 1
            await self.publish(chunks)
            first_token_at = first_token_at or utc_now()
            if self.step_delay_s:
                await asyncio.sleep(self.step_delay_s)
        choices = [
            ChoiceResult(
                index=c,
                text=output.text,
                token_ids=output.token_ids,
                finish_reason=output.finish_reason,
                logprobs=[_logprobs(p, sampling.top_logprobs) for p in output.pieces]
                if sampling.logprobs
                else None,
            )
            for c in range(sampling.n)
        ]
        result = JobResult(
            choices=choices,
            usage=Usage.of(output.prompt_tokens, len(output.pieces) * sampling.n),
            timings=Timings.from_times(job.created_at, job.started_at, first_token_at, utc_now()),
            prompt_logprobs=_prompt_logprobs(request),
        )
        await self._end(claimed, JobStatus.SUCCEEDED, {"result": result, "finished_at": utc_now()})
