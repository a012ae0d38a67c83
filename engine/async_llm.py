"""vLLM's asynchronous engine API: `AsyncLLMEngine.from_engine_args(AsyncEngineArgs(...))`,
then `async for output in engine.generate(prompt, params, request_id): ...` from as many
callers on one event loop as there are requests.

The engine is not thread-safe and runs on one thread of its own, which builds it and runs every
step (one OpenMP team, as the worker's engine thread keeps it). A driver task on the event loop
hands that thread the requests added and aborted since its last round, has it run one step,
and sorts the step's deltas into each request's stream (engine.request_stream). A request id is
refused while a request with that id is still streaming.

A pooling model (runner "pooling", or a folder detected as one) gets a PoolingEngine on the same
thread instead: `encode()` queues a request there, and the round that pools it resolves the
caller's future with one finished PoolingRequestOutput.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.engine import Engine
from engine.engine_args import EngineArgs
from engine.errors import DuplicateRequestError, RequestRejectedError
from engine.llm import start_engine
from engine.lora.request import LoRARequest
from engine.outputs import EngineRequest, RequestDelta, RequestMetrics, RequestOutput
from engine.pooling.engine import PoolingEngine
from engine.pooling.outputs import PooledResult, PoolingOutput, PoolingRequest, PoolingRequestOutput
from engine.pooling_llm import PoolingPrompt, pooling_config
from engine.prompts import PromptType, parse_prompt
from engine.request_stream import RequestStream
from engine.sampling_params import output_kind_of
from schemas.pooling import PoolingParams
from schemas.sampling import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine failed or was shut down; no request can run on it any more."""


@dataclass
class _Add:
    request: EngineRequest
    stream: RequestStream


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Encode:
    request: PoolingRequest
    result: asyncio.Future[PoolingRequestOutput]


_Op = _Add | _Abort | _Encode


@dataclass
class _Started:
    stream: RequestStream
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    choices: int


@dataclass
class _Round:
    """What one round on the engine thread did."""

    started: list[_Started] = field(default_factory=list)
    rejected: list[tuple[RequestStream, RequestRejectedError]] = field(default_factory=list)
    deltas: list[RequestDelta] = field(default_factory=list)
    pooled: list[PooledResult] = field(default_factory=list)
    pool_rejected: list[tuple[_Encode, RequestRejectedError]] = field(default_factory=list)
    busy: bool = False  # requests remain in the engine


class AsyncLLM:
    """Streams requests through one engine stepping on a thread of its own."""

    def __init__(self, config: EngineConfig) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="async-engine")
        try:
            started = self._thread.submit(_start_engine, config).result()
        except BaseException:
            self._thread.shutdown(wait=False)
            raise
        self._engine, self.pooling_engine = started
        self._streams: dict[str, RequestStream] = {}
        self._encodes: dict[str, asyncio.Future[PoolingRequestOutput]] = {}
        self._pending: list[_Op] = []
        self._busy = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig) -> AsyncLLM:
        """The engine the arguments describe (EngineArgs maps vLLM's names onto ours)."""
        if isinstance(engine_args, EngineArgs):
            return cls(engine_args.create_engine_config())
        return cls(engine_args)

    @property
    def engine(self) -> Engine:
        """The generating engine (a pooling model has none: see pooling_engine)."""
        if self._engine is None:
            raise ValueError("this engine pools: use encode(), not generate()")
        return self._engine

    # ------------------------------------------------------------------ the API

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as it runs (see RequestOutputKind); the last is `finished`.
        Leaving the loop early aborts the request. lora_request: run with this adapter."""
        self._check_alive()
        self._check_new_id(request_id)
        if self._engine is None:
            raise ValueError("this engine pools: use encode(), not generate()")
        params = sampling_params if sampling_params is not None else SamplingParams()
        engine_prompt = parse_prompt(prompt)
        text = engine_prompt if isinstance(engine_prompt, str) else None
        stream = RequestStream(request_id, text, output_kind_of(params), RequestMetrics(0.0))
        self._streams[request_id] = stream
        new = EngineRequest(request_id, engine_prompt, params, priority, lora_request=lora_request)
        self._submit(_Add(new, stream))
        try:
            while True:
                output = await stream.next_output()
                yield output
                if output.finished:
                    return
        finally:
            if not stream.finished:  # the caller stopped listening (break, cancel)
                self._abort_stream(request_id, stream)

    async def encode(
        self,
        prompt: PoolingPrompt | PromptType,
        pooling_params: PoolingParams | None,
        request_id: str,
        priority: int = 0,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling model's vector for the prompt: one output, `finished`, whose
        `.outputs.data` is the pooled float32 tensor (`.outputs.embedding` as a list).
        `priority` is accepted as vLLM's signature has it; pooling runs in arrival order."""
        self._check_alive()
        self._check_new_id(request_id)
        if self.pooling_engine is None:
            raise ValueError(
                "this engine generates: load an embedding model with runner='pooling' to encode"
            )
        params = pooling_params if pooling_params is not None else PoolingParams()
        result: asyncio.Future[PoolingRequestOutput] = asyncio.get_running_loop().create_future()
        self._encodes[request_id] = result
        self._submit(_Encode(PoolingRequest(request_id, _pooling_prompt(prompt), params), result))
        try:
            output = await asyncio.shield(result)
        finally:
            if not result.done():  # the caller stopped waiting (cancelled)
                self._abort_encode(request_id, result)
        yield output

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop requests now: each stream's last output is finished, reason "abort"; an
        encode() still waiting raises asyncio.CancelledError."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for one_id in ids:
            stream = self._streams.get(one_id)
            if stream is not None:
                self._abort_stream(one_id, stream)
            result = self._encodes.get(one_id)
            if result is not None:
                self._abort_encode(one_id, result)

    async def get_tokenizer(self) -> Any:
        """The model's HF tokenizer (None for a model without one)."""
        if self.pooling_engine is not None:
            return self.pooling_engine.tokenizer
        return self.engine.tokenizer

    async def check_health(self) -> None:
        self._check_alive()

    @property
    def is_running(self) -> bool:
        return self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    def shutdown(self) -> None:
        """End every stream, wait for a step still running, stop the engine thread (and the
        other ranks of a tensor-parallel replica)."""
        if self._dead is None:
            self._die(EngineDeadError("the engine was shut down"))
        if self._driver is not None and not self._driver.done():
            self._driver.cancel()
        self._thread.shutdown(wait=True)
        if self._engine is None:
            return  # a pooling model runs on this process alone
        ranks = self._engine.runner.tp_ranks
        if ranks is not None:
            ranks.stop()

    # ------------------------------------------------------------------ the driver

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._streams or request_id in self._encodes:
            raise DuplicateRequestError(
                f"request id {request_id!r} is already running: request ids must be unique "
                "among running requests"
            )

    def _abort_encode(self, request_id: str, result: asyncio.Future[PoolingRequestOutput]) -> None:
        if self._encodes.get(request_id) is result:
            del self._encodes[request_id]
        queued = any(isinstance(op, _Encode) and op.result is result for op in self._pending)
        if queued:  # never handed to the engine
            self._pending = [
                op for op in self._pending if not (isinstance(op, _Encode) and op.result is result)
            ]
        else:
            self._submit(_Abort(request_id))
        result.cancel()

    def _abort_stream(self, request_id: str, stream: RequestStream) -> None:
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]
        stream.abort()
        if stream.started:
            self._submit(_Abort(request_id))
        else:  # still queued for the engine: never hand it over
            self._pending = [
                op for op in self._pending if not (isinstance(op, _Add) and op.stream is stream)
            ]

    def _submit(self, op: _Op) -> None:
        self._pending.append(op)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a stream closed outside any loop: the next round applies it
            return
        if self._driver is None or self._driver.done() or self._loop is not loop:
            # First use, or a new event loop (asyncio.run called again): a driver of its own.
            self._loop, self._wake = loop, asyncio.Event()
            self._driver = loop.create_task(self._drive(), name="async-engine-driver")
        assert self._wake is not None
        self._wake.set()

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        assert wake is not None
        while self._dead is None:
            if not self._pending and not self._busy:
                wake.clear()
                await wake.wait()
                continue
            ops, self._pending = self._pending, []
            try:
                done = await loop.run_in_executor(self._thread, self._round, ops)
            except Exception as exc:
                logger.exception("the engine failed; every running request fails with it")
                self._die(EngineDeadError(f"the engine failed: {exc!r}"))
                return
            self._busy = done.busy
            self._deliver(done)

    def _round(self, ops: list[_Op]) -> _Round:
        """On the engine thread: apply the queued adds and aborts, in order, then one step."""
        if self.pooling_engine is not None:
            return self._pooling_round(self.pooling_engine, ops)
        done = _Round()
        for op in ops:
            if isinstance(op, _Abort):
                self.engine.abort(op.request_id)
                continue
            assert isinstance(op, _Add)  # encode() refuses a generating engine
            try:
                self.engine.add_request(op.request)
            except RequestRejectedError as exc:
                done.rejected.append((op.stream, exc))
                continue
            state = self.engine.outputs.requests[op.request.request_id]
            choices = 0 if op.request.params.use_beam_search else op.request.params.n
            done.started.append(
                _Started(op.stream, list(state.prompt_token_ids), state.metrics, choices)
            )
        if self.engine.has_unfinished():
            done.deltas = self.engine.step()
        done.busy = self.engine.has_unfinished()
        return done

    def _pooling_round(self, engine: PoolingEngine, ops: list[_Op]) -> _Round:
        """On the engine thread: queue and abort pooling requests, then pool one batch."""
        done = _Round()
        for op in ops:
            if isinstance(op, _Abort):
                engine.abort(op.request_id)
                continue
            assert isinstance(op, _Encode)  # generate() refuses a pooling engine
            try:
                engine.add_request(op.request)
            except RequestRejectedError as exc:
                done.pool_rejected.append((op, exc))
        if engine.has_unfinished():
            done.pooled = engine.step()
        done.busy = engine.has_unfinished()
        return done

    def _deliver(self, done: _Round) -> None:
        for encode, error in done.pool_rejected:
            self._settle(encode.request.request_id, encode.result, error)
        for pooled in done.pooled:
            result = self._encodes.get(pooled.request_id)
            if result is not None:
                output = PoolingRequestOutput(
                    pooled.request_id, pooled.prompt_token_ids, PoolingOutput(pooled.data)
                )
                self._settle(pooled.request_id, result, output)
        for refused, error in done.rejected:
            self._end(refused)
            refused.fail(error)
        for started in done.started:
            if started.stream.finished:
                # Aborted while the round that added it ran: abort it in the engine before
                # anything queued since (a new request may reuse its id).
                self._pending.insert(0, _Abort(started.stream.request_id))
                continue
            started.stream.start(started.prompt_token_ids, started.metrics, started.choices)
        by_request: dict[str, list[RequestDelta]] = {}
        for delta in done.deltas:
            by_request.setdefault(delta.request_id, []).append(delta)
        for request_id, deltas in by_request.items():
            stream = self._streams.get(request_id)
            if stream is None or not stream.started:  # aborted, or a new request of that id
                continue
            stream.add(deltas)
            if stream.finished:
                self._end(stream)

    def _settle(
        self,
        request_id: str,
        result: asyncio.Future[PoolingRequestOutput],
        outcome: PoolingRequestOutput | Exception,
    ) -> None:
        if self._encodes.get(request_id) is result:
            del self._encodes[request_id]
        if result.done():  # cancelled meanwhile
            return
        if isinstance(outcome, Exception):
            result.set_exception(outcome)
        else:
            result.set_result(outcome)

    def _end(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def _die(self, error: EngineDeadError) -> None:
        self._dead = error
        for stream in list(self._streams.values()):
            stream.fail(error)
        self._streams.clear()
        for result in self._encodes.values():
            if not result.done():
                result.set_exception(error)
        self._encodes.clear()
        self._pending.clear()


def _start_engine(config: EngineConfig) -> tuple[Engine | None, PoolingEngine | None]:
    """On the engine thread: the pooling engine for a pooling model, else the generating one."""
    if pooling_config(config, None):
        return None, PoolingEngine(config)
    return start_engine(config), None


def _pooling_prompt(prompt: PoolingPrompt | PromptType) -> PoolingPrompt:
    """Text or token ids from any of vLLM's single-prompt forms."""
    parsed = parse_prompt(prompt)
    return parsed if isinstance(parsed, str) else list(parsed)


# vLLM's names: AsyncLLMEngine (its first async engine) and AsyncLLM (its V1 engine).
AsyncLLMEngine = AsyncLLM
