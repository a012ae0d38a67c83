"""A step that raised: its jobs leave the engine and are searched for the one at fault
(worker.step_failures' Bisect), which fails alone while the others run on; after running out of
memory the jobs rejoin fewer at a time (`engine_cap`).

Every method here touches the engine and must run while no step is in flight."""

from __future__ import annotations

import logging

from schemas import (
    ErrorBody,
    ErrorCode,
)
from worker.batch_jobs import HeldJobs
from worker.held import HeldJob
from worker.logs import log_event
from worker.step_failures import MAX_UNEXPLAINED_FAILURES, Bisect, is_out_of_memory

logger = logging.getLogger(__name__)


class FailedSteps(HeldJobs):
    """The search for the job at fault in a failed step (see the module's docstring)."""

    def _step_passed(self) -> None:
        bisect = self._bisect
        if bisect is None:
            if all(h.in_engine for h in self.held.values()):
                self._unexplained = 0
            return
        probe = [self.held[j] for j in bisect.probe if j in self.held]
        if bisect.probe_passed():
            self._unexplained += 1
            self._bisect = None
            log_event(
                logger,
                logging.WARNING,
                "engine_error_not_reproduced",
                steps=bisect.steps,
                error=bisect.error,
            )
            return
        for held in probe:
            self._park(held)

    def _step_failed(self, error: BaseException) -> None:
        """A step raised (see worker.step_failures): its jobs leave the engine and are searched
        for the one at fault, or rejoin fewer at a time after running out of memory."""
        stepped = [h for h in self.held.values() if h.in_engine]
        for held in stepped:
            self._park(held)
        text = f"{type(error).__name__}: {error}"
        if is_out_of_memory(error):
            self._out_of_memory(stepped, text)
            return
        bisect = self._bisect
        if bisect is None:
            if self._unexplained >= MAX_UNEXPLAINED_FAILURES:
                self._unexplained = 0
                logger.error(
                    "engine step failed again after %d searches found no job at fault; "
                    "failing its %d jobs",
                    MAX_UNEXPLAINED_FAILURES,
                    len(stepped),
                    exc_info=error,
                )
                body = ErrorBody.of(ErrorCode.ENGINE_ERROR, f"the engine failed: {text}")
                for held in stepped:
                    del self.held[held.job_id]
                    self._fail_with_final_chunk(held, body)
                return
            self._bisect = Bisect(text, [h.job_id for h in stepped])
            logger.warning(
                "engine step failed; searching its %d jobs for the one at fault",
                len(stepped),
                exc_info=error,
            )
            return
        culprit = bisect.probe_failed()
        if culprit is None:
            return
        self._bisect = None
        held = self.held.pop(culprit)
        log_event(
            logger, logging.WARNING, "engine_error_reproduced", job=culprit, steps=bisect.steps
        )
        body = ErrorBody.of(ErrorCode.ENGINE_ERROR, f"the engine failed on this job: {text}")
        self._fail_with_final_chunk(held, body)

    def _out_of_memory(self, stepped: list[HeldJob], text: str) -> None:
        if len(stepped) == 1:
            held = stepped[0]
            del self.held[held.job_id]
            body = ErrorBody.of(
                ErrorCode.ENGINE_ERROR, f"the engine ran out of memory with this job alone: {text}"
            )
            self._fail_with_final_chunk(held, body)
            return
        self.engine_cap = max(1, len(stepped) // 2)
        if self._bisect is not None:
            self._bisect.probe = []  # a smaller probe group next
        log_event(
            logger,
            logging.WARNING,
            "engine_out_of_memory",
            jobs=len(stepped),
            engine_cap=self.engine_cap,
            error=text,
        )
