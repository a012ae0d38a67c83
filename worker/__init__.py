"""The worker: joins a model's Redis job stream to an engine (see worker.worker).

`from worker import Worker, WorkerSettings`; heavy modules load on first use, so the `inferq`
command line stays cheap to start."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.settings import WorkerSettings
    from worker.worker import Worker

__all__ = ["Worker", "WorkerSettings"]


def __getattr__(name: str) -> Any:
    if name == "Worker":
        from worker.worker import Worker

        return Worker
    if name == "WorkerSettings":
        from worker.settings import WorkerSettings

        return WorkerSettings
    raise AttributeError(name)
