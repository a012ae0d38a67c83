"""Which worker deaths a job is held responsible for.

A start of a job that never ended (no result, no graceful hand-back) was cut off: its worker
died, or lost its lease. With continuous batching any request in the step that killed a worker
may have caused it, and most deaths (OOM kills, redeploys, a lost host) are caused by none, so a
cut-off start is charged to a job only on evidence that the job was in the step its worker
died in, and was new to that start there:

- Before the engine step that first runs a job in a start (its prefill, or the re-prefill of a
  resumed job), the worker adds the job to its first-step marker (`RedisKeys.first_step`) and
  sends that before the step begins; the round trip after the step deletes the marker. That is
  two writes per admission turn, none per token.
- A cut-off start whose job is in its dead worker's marker (`run_state: started`, and the id
  in the set) died in the job's first step. If the job was the only one in the marker, it was
  the only newcomer of the fatal step: it is charged. If others shared that first step, any of
  them may have caused the death, and most deaths are caused by none: each is a suspect, not
  charged (the start counts in `crash_resumes`). Charged jobs and suspects run next in
  quarantine: one joins the engine only when every job there has already made progress in its
  own run, nothing else joins until it has made progress, and the least-charged waits least,
  so a death during its next first step is its own alone.
- Any other cut-off start is forgiven and counts in `crash_resumes`: the job had made progress
  (`run_state: progressed`), or it was admitted but its first step had not begun, had already
  ended, or it waited behind other work. `max_crash_resumes` bounds these, so nothing cycles
  forever.

The bound. Each start is charged at most once, and only when the death fell inside its first
step while it was that step's only newcomer (a quarantined run, or a job that arrived alone).
An innocent job is charged only when an unrelated death lands in such a step: with deaths every
`T` seconds at random and a solo first step of `t` seconds, an innocent job is dead-lettered
with a chance of about `(t/T) ** max_attempts`, and the quarantine's least-charged-first order
spreads unlucky deaths over the suspects rather than letting one job collect them. Charging
every start without output (the rule this replaces) took any death before its first token,
and charging every newcomer of the fatal step charged whole admissions at once.

Why a job that kills its worker is still caught: it kills in the step that runs its deadly
work, and a job resumed after a forgiven death is resumed from its published output, so its
deadly work is its next start's first step (its prefill, or the re-prefill and the token that
kills). The first such death may be shared with other newcomers (a suspect, not charged); from
then on it runs in quarantine, the only newcomer of its first step, and each death is charged:
it is dead-lettered after `max_attempts` deaths it alone can explain, at most one shared death
later. Deadly work that lies further than a start's first step (a prompt whose prefill is cut
into several steps and that kills in a later one) is forgiven and stopped by
`max_crash_resumes` instead.

A start whose worker died before the start was stored (reclaimed, `run_state` absent) runs in
quarantine without a charge: the worker stores a start before its first step, so only a worker
that lost Redis meanwhile leaves that.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from schemas import ErrorBody, ErrorCode, RunState
from worker.held import HeldJob


class FirstStep(enum.Enum):
    """Where a cut-off start stood in its dead worker's first-step marker."""

    OUTSIDE = "outside"  # not in it: the death fell outside the job's first step
    SHARED = "shared"  # in it with other newcomers of the same step
    ALONE = "alone"  # the only newcomer of the step its worker died in


@dataclass(frozen=True)
class CrashPolicy:
    max_attempts: int  # charged starts before the job is dead-lettered
    max_crash_resumes: int  # forgiven cut-off starts before the job is dead-lettered anyway


def settle_cut_off_start(
    held: HeldJob, reclaimed: bool, first_step: FirstStep, policy: CrashPolicy
) -> ErrorBody | None:
    """Account for the job's previous start if it was cut off. Returns the error to dead-letter the job with, or None to
    run it (`held.quarantined` set when it must run in quarantine). `reclaimed`: the entry was
    taken over from a worker that held it (XAUTOCLAIM, or this worker's own pending entries).
    `first_step`: how the job stood in the first-step marker of the worker that started it.

    Only `held` changes: what is decided here is stored with the job's next start, so a worker
    that dies before starting it leaves the same evidence to the next one."""
    job = held.job
    if job.run_state is not None:  # a start that never ended
        died_in_first_step = first_step is not FirstStep.OUTSIDE
        if job.run_state is RunState.STARTED and died_in_first_step:
            held.quarantined = True
        if job.run_state is not RunState.STARTED or first_step is not FirstStep.ALONE:
            held.crash_resumes = job.crash_resumes + 1
            if held.crash_resumes > policy.max_crash_resumes:
                return ErrorBody.of(
                    ErrorCode.MAX_ATTEMPTS_EXCEEDED,
                    f"the job's worker died {held.crash_resumes} times while it ran "
                    f"(limit {policy.max_crash_resumes})",
                )
    elif reclaimed:
        # Its worker died before the start was stored (it lost Redis meanwhile): run it where
        # its next start is stored before its first step.
        held.quarantined = True
    charged = job.attempts - held.crash_resumes
    if charged >= policy.max_attempts:
        return ErrorBody.of(
            ErrorCode.MAX_ATTEMPTS_EXCEEDED,
            f"the job was started {charged} times (limit {policy.max_attempts}) and its worker "
            "died during its first engine step in each",
        )
    return None
