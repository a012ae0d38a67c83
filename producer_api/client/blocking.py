"""Blocking clients for sync code: any async client, run on a private event-loop thread.

The loop lives on its own thread, so a blocking client works the same inside a program that
already runs an event loop (a notebook, an async test, a web app) as in plain scripts."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Generic, Self, TypeVar

from producer_api.client.base import AsyncJobClient, close_stream
from schemas import Job, JobRequest, TokenChunk

T = TypeVar("T")
C = TypeVar("C", bound=AsyncJobClient)


class ClosedError(RuntimeError):
    """The client was closed."""


class LoopThread:
    """An event loop running on a daemon thread; `call` runs a coroutine there and blocks.

    Once stopped, the thread cancels what still runs, closes the async generators left open
    (abandoned streams hold connections), awaits `on_exit()`, and closes the loop."""

    def __init__(self, name: str, on_exit: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._loop = asyncio.new_event_loop()
        self._on_exit = on_exit
        self._stopping = False
        self._exit_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
            self._loop.run_until_complete(self._wind_down())
        except BaseException as error:  # raised again by join(), in the thread that closes
            self._exit_error = error
        finally:
            self._loop.close()

    async def _wind_down(self) -> None:
        running = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await self._loop.shutdown_asyncgens()
        await self._on_exit()

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._stopping:
            coroutine.close()
            raise ClosedError("the client is closed")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: don't leave the call running on the loop
            raise

    def stop(self) -> None:
        """Stop the loop (its thread then winds down); safe from any thread, and twice."""
        self._stopping = True
        with contextlib.suppress(RuntimeError):  # the loop is closed already
            self._loop.call_soon_threadsafe(self._loop.stop)

    def join(self) -> None:
        """Wait for the thread to end; raises what winding down raised."""
        self._thread.join()
        if self._exit_error is not None:
            error, self._exit_error = self._exit_error, None
            raise error


async def _next(chunks: AsyncIterator[T]) -> T:
    return await anext(chunks)


class BlockingClient(Generic[C]):
    """The methods of `async_client`, blocking. Close it (or use it as a context
    manager) to close the client and end its thread; an unclosed one ends its thread once
    collected."""

    def __init__(self, async_client: C) -> None:
        self.async_client = async_client
        self._loop = LoopThread("inferq-client", async_client.aclose)
        self._finalizer = weakref.finalize(self, self._loop.stop)

    def enqueue(
        self, request: JobRequest | Mapping[str, Any] | None = None, /, **fields: Any
    ) -> Job:
        return self._loop.call(self.async_client.enqueue(request, **fields))

    def get(self, job_id: str) -> Job:
        return self._loop.call(self.async_client.get(job_id))

    def wait(self, job_id: str, timeout: float | None = None) -> Job:
        return self._loop.call(self.async_client.wait(job_id, timeout=timeout))

    def stream(self, job_id: str, last_index: int = -1) -> Iterator[TokenChunk]:
        """The async client's stream, chunk by chunk; closing the iterator (or dropping it)
        closes the stream."""
        chunks = self.async_client.stream(job_id, last_index)
        try:
            while True:
                try:
                    yield self._loop.call(_next(chunks))
                except StopAsyncIteration:
                    return
        finally:
            with contextlib.suppress(ClosedError):  # closing the client closed the stream
                self._loop.call(close_stream(chunks))

    def cancel(self, job_id: str) -> Job:
        return self._loop.call(self.async_client.cancel(job_id))

    def run(
        self,
        request: JobRequest | Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | None = None,
        **fields: Any,
    ) -> Job:
        return self._loop.call(self.async_client.run(request, timeout=timeout, **fields))

    def embed(
        self,
        model: str,
        inputs: str | Sequence[str] | Sequence[Sequence[int]],
        *,
        dimensions: int | None = None,
        timeout: float | None = None,
        **fields: Any,
    ) -> list[list[float]]:
        return self._loop.call(
            self.async_client.embed(model, inputs, dimensions=dimensions, timeout=timeout, **fields)
        )

    def close(self) -> None:
        """Close open streams and the async client, and end the thread."""
        if self._finalizer.alive:
            self._finalizer()
            self._loop.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
