"""The worker's heartbeat: its hash `{p}:worker:{name}` (capacity and load, refreshed with a TTL)
and, in the same pipeline, the live-stats samples of its model (see `schemas.workers`): its
cumulative token counts, and the latencies (TTFT, end to end, inter-token) of the jobs it
finished since the last beat. Batching the samples here keeps the engine's step path at one round
trip per step."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from datetime import datetime
from functools import cache
from importlib import metadata
from pathlib import Path

from redis.asyncio import Redis

from engine.outputs import EngineStats
from redis_io.clients import pipeline
from schemas import JobKind, RedisKeys, WorkerInfo, utc_now
from schemas.workers import LIVE_STATS_MAXLEN, LIVE_STATS_WINDOW_S, TokenSample, TtftSample

MAX_BUFFERED_TTFTS = 10_000  # TTFTs kept while Redis is away (the oldest are dropped)


@cache  # reading package metadata takes milliseconds, and every heartbeat names the version
def worker_version() -> str:
    try:
        return metadata.version("inferq")
    except metadata.PackageNotFoundError:
        return "0.1.0+source"


class TtftBuffer:
    """Latency samples of jobs finished since the last heartbeat; the heartbeat writes them in
    one go."""

    def __init__(self, maxlen: int = MAX_BUFFERED_TTFTS) -> None:
        self._samples: deque[TtftSample] = deque(maxlen=maxlen)

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, sample: TtftSample) -> None:
        self._samples.append(sample)

    def take(self) -> list[TtftSample]:
        samples = list(self._samples)
        self._samples.clear()
        return samples

    def put_back(self, samples: Iterable[TtftSample]) -> None:
        """Return samples a failed heartbeat did not write (they go out with the next one)."""
        self._samples.extendleft(reversed(list(samples)))


async def beat(
    redis: Redis,
    keys: RedisKeys,
    *,
    name: str,
    model: str,
    stats: EngineStats,
    started_at: datetime,
    ttl_s: int,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
    tokenizer_file: Path | None = None,
    quantization: str | None = None,
    weight_bytes: int | None = None,
    architecture: str | None = None,
    task: JobKind = JobKind.GENERATION,
    embedding_size: int | None = None,
    lora_adapters: list[str] | None = None,
    lora_resident: list[str] | None = None,
    lora_cached: list[str] | None = None,
    ttfts: Iterable[TtftSample] = (),
) -> WorkerInfo:
    """Write one heartbeat from an EngineStats snapshot, with the model's live-stats samples, in
    one round trip (a MULTI/EXEC transaction). `max_model_len` (the context length), `vocab_size`
    and `tokenizer_file` let the API refuse over-long prompts and unknown token ids at the door;
    `quantization` (None: full precision), `weight_bytes` and `architecture` (e.g.
    "Qwen3ForCausalLM") tell operators what the worker runs; `task` and `embedding_size` which
    kind of job it takes (and how many dimensions); `lora_adapters` the LoRA adapters it
    serves (by name, on its model), `lora_resident` those of them in its engine's slots and
    `lora_cached` those in its host memory only."""
    info = WorkerInfo(
        name=name,
        model=model,
        kv_blocks_free=max(0, stats.num_blocks_free),
        kv_blocks_total=stats.num_blocks_total,
        running=stats.num_running,
        waiting=stats.num_waiting,
        version=worker_version(),
        max_model_len=max_model_len or None,
        vocab_size=vocab_size or None,
        tokenizer_file=str(tokenizer_file) if tokenizer_file is not None else None,
        quantization=quantization,
        weight_bytes=weight_bytes,
        architecture=architecture,
        task=task,
        embedding_size=embedding_size,
        lora_adapters=lora_adapters or [],
        lora_resident=lora_resident or [],
        lora_cached=lora_cached or [],
        prompt_tokens=max(0, stats.num_prompt_tokens_computed),
        generated_tokens=max(0, stats.num_generation_tokens),
        started_at=started_at,
        updated_at=utc_now(),
    )
    now = info.updated_at.timestamp()
    key = keys.worker(name)
    tokens = TokenSample(now, name, info.generated_tokens, info.prompt_tokens)
    samples = {keys.token_samples(model): {tokens.member(): tokens.at}}
    ttft_members = {sample.member(): sample.finished_at for sample in ttfts}
    if ttft_members:
        samples[keys.ttft_samples(model)] = ttft_members
    async with pipeline(redis, atomic=True) as pipe:
        pipe.hset(key, mapping=info.to_redis_hash())
        pipe.expire(key, ttl_s)
        for sample_key, members in samples.items():
            pipe.zadd(sample_key, members)
            # Keep the window: drop old samples, cap the count, expire when no worker writes.
            pipe.zremrangebyscore(sample_key, "-inf", f"({now - LIVE_STATS_WINDOW_S}")
            pipe.zremrangebyrank(sample_key, 0, -LIVE_STATS_MAXLEN - 1)
            pipe.expire(sample_key, LIVE_STATS_WINDOW_S)
        await pipe.execute()
    return info
