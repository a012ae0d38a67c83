"""Which worker deaths a job is held responsible for.

A start of a job that never ended (no result, no graceful hand-back) was cut off: its worker
died, or lost its lease. With continuous batching any request in the step that killed a worker
may have caused it, and most deaths (OOM kills, redeploys, a lost host) are caused by none, so a
cut-off start is charged to a job only on evidence:

- The start made progress (the engine produced output for the job, which the worker records in
  the job hash as `run_state: progressed`): the job is not suspected. A job that kills the
  worker at some point of its generation is resumed at that point (from its published chunks)
  and kills the next one before any progress, so forgiving a start that progressed frees no
  poison job. Such a start counts in `crash_resumes`, up to `max_crash_resumes` (then the job
  is dead-lettered all the same, so nothing cycles forever).
- The start made no progress (`run_state: started`): the job was at its first step when the
  worker died. It is
  charged, and it runs next in quarantine: it joins the engine only when every job there has
  already made progress in its own run, and nothing else joins until it has made progress. A
  worker that dies then died at the one job that had not made progress yet.

`max_attempts` limits the charged starts (`attempts - crash_resumes`); a job that keeps killing
its workers is dead-lettered within `max_attempts` deaths, while a job that merely rode along
with others keeps resuming.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import ErrorBody, ErrorCode, RunState
from worker.held import HeldJob


@dataclass(frozen=True)
class CrashPolicy:
    max_attempts: int  # charged starts before the job is dead-lettered
    max_crash_resumes: int  # forgiven cut-off starts before the job is dead-lettered anyway


def settle_cut_off_start(held: HeldJob, reclaimed: bool, policy: CrashPolicy) -> ErrorBody | None:
    """Account for the job's previous start if it was cut off. Returns the error to dead-letter the job with, or None to
    run it (`held.quarantined` set when it must run in quarantine). `reclaimed`: the entry was
    taken over from a worker that held it (XAUTOCLAIM, or this worker's own pending entries).

    Only `held` changes: what is decided here is stored with the job's next start, so a worker
    that dies before starting it leaves the same evidence to the next one."""
    job = held.job
    if job.run_state is not None:  # a start that never ended
        if job.run_state is RunState.PROGRESSED:
            held.crash_resumes = job.crash_resumes + 1
            if held.crash_resumes > policy.max_crash_resumes:
                return ErrorBody.of(
                    ErrorCode.MAX_ATTEMPTS_EXCEEDED,
                    f"the job's worker died {held.crash_resumes} times while it ran "
                    f"(limit {policy.max_crash_resumes})",
                )
        else:
            held.quarantined = True
    elif reclaimed:
        # Its worker died before the start was stored (the start and the engine's first step
        # run concurrently): run it where its next start is stored before its first step.
        held.quarantined = True
    charged = job.attempts - held.crash_resumes
    if charged >= policy.max_attempts:
        return ErrorBody.of(
            ErrorCode.MAX_ATTEMPTS_EXCEEDED,
            f"the job was started {charged} times (limit {policy.max_attempts}) without "
            "finishing or making progress",
        )
    return None
