"""Scheduler: token budget, chunked prefill, decode-first order, preemption, priority, abort, fork."""

from __future__ import annotations

import itertools

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from schemas.sampling import SamplingParams

_clock = itertools.count()
_token = itertools.count(1000)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 2048,
    max_num_seqs: int = 256,
    prefix_caching: bool = True,
) -> Scheduler:
    config = EngineConfig(
        model="dummy",
        block_size=block_size,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching))


def make_seq(
    num_prompt_tokens: int,
    request_id: str,
    priority: int = 0,
    max_tokens: int = 16,
    n: int = 1,
    first_token: int = 0,
) -> Sequence:
    tokens = list(range(first_token, first_token + num_prompt_tokens))
    params = SamplingParams(max_tokens=max_tokens, n=n)
    # Explicit, increasing arrival times: the tests do not depend on the clock's resolution.
    return Sequence(
        request_id, tokens, num_prompt_tokens, params, priority, arrival_time=next(_clock)
    )


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step without a model: schedule, account, sample a token, finish at max_tokens."""
    out = sched.schedule()
    sched.update_after_step(out)
    for item in out.scheduled:
        if item.samples:
            seq = item.seq
            seq.append_token(next(_token))
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outputs = []
    while sched.has_unfinished():
        outputs.append(step(sched))
        assert len(outputs) < max_steps, "scheduler made no progress"
    return outputs


def test_token_budget_is_respected_and_all_work_completes():
    sched = make_scheduler(num_blocks=256, budget=32, max_num_seqs=8)
    seqs = [make_seq(5 + 7 * i, f"r{i}", max_tokens=3 + i % 4) for i in range(12)]
    for seq in seqs:
        sched.add(seq)
    for out in run_to_completion(sched):
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        assert 0 < out.num_batched_tokens <= 32
        assert len(out.scheduled) <= 8
    assert all(s.finish_reason == "length" for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks


def test_chunked_prefill_splits_a_long_prompt():
    sched = make_scheduler(budget=32)
    seq = make_seq(100, "long", max_tokens=2)
    sched.add(seq)
    chunks, samples = [], []
    while seq.num_output_tokens == 0:
        out = step(sched)
        (item,) = out.scheduled
        chunks.append(item.num_new_tokens)
        samples.append(item.samples)
    expected = [min(32, 100 - start) for start in range(0, 100, 32)]
    assert chunks == expected
    assert samples == [False] * (len(expected) - 1) + [True]  # logits only once caught up
    assert seq.num_computed_tokens == 100


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(budget=16)
    decoding = make_seq(6, "decoding")
    sched.add(decoding)
    step(sched)  # prefill; it now has one token to decode
    newcomer = make_seq(40, "newcomer", first_token=500)
    sched.add(newcomer)
    out = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [
        (decoding, 1),
        (newcomer, 16 - 1),
    ]


def _fill_cache() -> tuple[Scheduler, list[Sequence]]:
    """8 blocks of 4: two 1-block prompts and a 6-block prompt use every block."""
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64)
    seqs = [
        make_seq(4, "a", max_tokens=3),
        make_seq(4, "b", max_tokens=3, first_token=100),
        make_seq(24, "c", max_tokens=3, first_token=200),
    ]
    for seq in seqs:
        sched.add(seq)
    out = step(sched)
    assert [s.seq for s in out.scheduled] == seqs
    assert sched.block_manager.num_free_blocks == 0
    return sched, seqs


def test_preemption_evicts_the_newest_and_admits_nothing_that_step():
    sched, (a, b, c) = _fill_cache()
    urgent = make_seq(2, "urgent", priority=-1, max_tokens=1, first_token=300)
    sched.add(urgent)
    out = step(sched)  # a and b each need a new block for their second token
    assert out.preempted == [c]
    assert c.status is SequenceStatus.WAITING and c.num_preemptions == 1
    assert c.num_computed_tokens == c.num_cached_tokens == 0 and c.block_table == []
    assert [s.seq for s in out.scheduled] == [a, b]  # room was left, yet nothing admitted
    assert sched.waiting == [urgent, c]
    assert urgent in [s.seq for s in step(sched).scheduled]  # admitted on the next step


def test_preempted_sequence_recomputes_and_finishes():
    sched, (a, b, c) = _fill_cache()
    tokens_before = list(c.token_ids)
    out = step(sched)
    assert out.preempted == [c]
    readmitted = None
    for out in run_to_completion(sched):
        for item in out.scheduled:
            if item.seq is c and readmitted is None:
                readmitted = item
    assert readmitted is not None
    # Recomputation resumes from what the prefix cache still holds and catches up fully.
    assert readmitted.num_new_tokens == len(tokens_before) - c.num_cached_tokens
    assert c.token_ids[: len(tokens_before)] == tokens_before
    assert c.num_output_tokens == c.params.max_tokens and c.finish_reason == "length"
    assert all(s.finish_reason == "length" for s in (a, b))
    assert sched.block_manager.num_free_blocks == 8


def test_victim_is_the_least_urgent_even_when_it_runs_first():
    sched = make_scheduler(num_blocks=2, block_size=4, budget=64)
    low = make_seq(3, "low", priority=5, max_tokens=8)
    sched.add(low)
    step(sched)  # low's one block fills up with its first sampled token
    high = make_seq(4, "high", priority=0, max_tokens=8, first_token=100)
    sched.add(high)
    step(sched)
    assert sched.running == [low, high]  # low is scheduled first, and both need a new block
    out = step(sched)
    # low is evicted by its own turn; high still runs this step on the freed block.
    assert out.preempted == [low]
    assert [s.seq for s in out.scheduled] == [high]
    assert low.status is SequenceStatus.WAITING and low.num_preemptions == 1


def test_waiting_sequences_are_admitted_by_priority_then_arrival():
    sched = make_scheduler(budget=4)  # one 4-token prompt per step
    late_low = make_seq(4, "late-low", priority=2)
    first_high = make_seq(4, "first-high", priority=0, first_token=10)
    mid = make_seq(4, "mid", priority=1, first_token=20)
    second_high = make_seq(4, "second-high", priority=0, first_token=30)
    for seq in (late_low, first_high, mid, second_high):
        sched.add(seq)
    admitted = []
    for _ in range(4):
        out = sched.schedule()
        admitted += [s.seq for s in out.scheduled if s.seq not in admitted]
        sched.update_after_step(out)
    assert admitted == sorted(admitted, key=lambda s: (s.priority, s.arrival_time))
    assert admitted == [first_high, second_high, mid, late_low]


def test_head_of_line_blocks_smaller_later_requests():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    running = make_seq(8, "running", max_tokens=8)
    sched.add(running)
    step(sched)
    too_big = make_seq(12, "too-big", first_token=100)  # needs 3 blocks, 2 are free
    small = make_seq(2, "small", first_token=200)
    sched.add(too_big)
    sched.add(small)
    out = step(sched)
    assert [s.seq for s in out.scheduled] == [running]
    assert sched.waiting == [too_big, small]


def test_max_num_seqs_caps_the_running_batch():
    sched = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(3, f"r{i}", first_token=10 * i) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    out = step(sched)
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 2
    assert sched.num_free_seq_slots() == 0


def test_abort_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=32, budget=8)
    keep = make_seq(6, "keep")
    doomed = make_seq(20, "doomed", n=3, first_token=100)
    queued = make_seq(6, "queued", first_token=200)
    for seq in (keep, doomed, queued):
        sched.add(seq)
    step(sched)  # keep prefilled, doomed half way, queued waiting
    assert doomed.block_table and queued.status is SequenceStatus.WAITING
    held_by_keep = len(keep.block_table)
    aborted = sched.abort("doomed") + sched.abort("queued")
    assert aborted == [doomed, queued]
    assert all(s.status is SequenceStatus.FINISHED and s.finish_reason == "abort" for s in aborted)
    assert all(s.block_table == [] for s in aborted)
    assert sched.block_manager.num_free_blocks == 32 - held_by_keep
    assert sched.running == [keep] and sched.waiting == []
    assert sched.abort("unknown") == []


def test_fork_children_share_the_prompt_and_sample_their_own_tokens():
    sched = make_scheduler(num_blocks=32, block_size=4)
    parent = make_seq(10, "req", n=3, max_tokens=4)
    other = make_seq(5, "other", first_token=100)
    sched.add(parent)
    sched.add(other)
    step(sched)
    assert parent.num_output_tokens == 1
    children = [sched.fork(parent, i) for i in (1, 2)]
    assert sched.running == [parent, *children, other]
    for child in children:
        assert child.token_ids == parent.prompt_token_ids and child.request_id == "req"
        assert child.block_table == parent.block_table
    assert all(sched.block_manager.ref_count(b) == 3 for b in parent.block_table)

    out = step(sched)
    by_seq = {s.seq: s for s in out.scheduled}
    assert all(by_seq[c].num_new_tokens == 1 and by_seq[c].samples for c in children)
    # The last prompt block holds 2 tokens and is written by the parent and one child: copies.
    assert len(out.block_copies) == 2
    assert all(c.num_output_tokens == 1 for c in children)
    run_to_completion(sched)
    assert sched.block_manager.num_free_blocks == 32
    assert sched.sequences("req") == []


def test_update_skips_sequences_finished_before_it():
    sched = make_scheduler()
    seq = make_seq(5, "r")
    sched.add(seq)
    out = sched.schedule()
    sched.finish(seq, "stop")
    sched.update_after_step(out)
    assert seq.num_computed_tokens == 0 and seq.block_table == []
    assert not sched.has_unfinished()


def test_admission_support_accounts_for_waiting_prompts():
    sched = make_scheduler(num_blocks=20, block_size=4, max_num_seqs=4)
    assert sched.free_blocks_after_waiting() == 20 and sched.num_free_seq_slots() == 4
    queued = make_seq(9, "queued", n=2, max_tokens=16)  # 3 blocks + 1 reserve; 2 choices
    sched.add(queued)
    assert sched.free_blocks_after_waiting() == 20 - (3 + 1)
    assert sched.num_free_seq_slots() == 4 - 2
    # 16 blocks are left for new requests.
    assert sched.admissible(num_prompt_tokens=60, max_tokens=100)  # 15 blocks + 1 reserve
    assert sched.admissible(num_prompt_tokens=61, max_tokens=3)  # its output fits block 16
    assert not sched.admissible(num_prompt_tokens=61, max_tokens=4)  # 16 + 1 reserve
    assert not sched.admissible(num_prompt_tokens=4, max_tokens=1, n=3)  # 2 slots left
    step(sched)  # admitted: its demand is now real block usage
    assert sched.free_blocks_after_waiting() == 20 - len(queued.block_table)
    assert sched.block_manager.token_capacity == 20 * 4
