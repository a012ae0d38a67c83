"""The step scheduler (vLLM v1 style): a token budget shared by decodes and prefill chunks.

Each step first lets the RUNNING sequences catch up (a decode needs one token, a partially
prefilled prompt continues with its next chunk), preempting the least urgent running
sequence by recomputation when KV blocks run out. Then, unless this step preempted, it
admits WAITING sequences in (priority, arrival) order while the token budget, the sequence
slots and the blocks allow. A waiting sequence that does not fit blocks admission: no
skipping ahead of the head of the line.

After the step, the scheduler takes in each sampled token and decides, by the token-based stop
conditions (engine.stop), which sequences it ends; their blocks are free at once.

A step's decision is a SchedulerOutput (engine.scheduler_output); the waiting sequences are
kept in a WaitingQueue (engine.waiting_queue).
"""

from __future__ import annotations

import logging

from engine.block_manager import BlockCopy, BlockManager
from engine.config import EngineConfig
from engine.scheduler_output import SchedulerOutput
from engine.sequence import ScheduledSeq, Sequence, SequenceStatus
from engine.stop import Stop, StopRules, check_stop
from engine.waiting_queue import WaitingQueue, after_siblings
from schemas.chunks import FinishReason

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        stop_rules: StopRules | None = None,
    ) -> None:
        """`stop_rules` None: no EOS token, and the whole cache as the context length."""
        self.config = config
        self.block_manager = block_manager
        self.stop_rules = stop_rules or StopRules(frozenset(), block_manager.token_capacity)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        # Under a sliding window one sequence's step is cut so that its blocks fit the cache.
        self.max_seq_step_tokens = min(
            self.max_num_batched_tokens,
            block_manager.step_token_limit or self.max_num_batched_tokens,
        )
        self._running: list[Sequence] = []
        self._waiting = WaitingQueue()
        # Per waiting sequence: (blocks its prompt will take + 1 reserve, seq slots it takes),
        # summed below so the worker's pull decision costs O(1).
        self._waiting_demand: dict[Sequence, tuple[int, int]] = {}
        self._waiting_blocks = 0
        self._waiting_slots = 0
        self._by_request: dict[str, list[Sequence]] = {}  # live sequences per request
        self.num_preemptions = 0  # over the scheduler's life

    # ---- queues ------------------------------------------------------------------------------

    @property
    def running(self) -> list[Sequence]:
        """Running sequences in scheduling order (read only)."""
        return self._running

    @property
    def waiting(self) -> list[Sequence]:
        """Waiting sequences in admission order (a copy)."""
        return list(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting_demand)

    def has_unfinished(self) -> bool:
        return bool(self._running) or bool(self._waiting_demand)

    def sequences(self, request_id: str) -> list[Sequence]:
        return list(self._by_request.get(request_id, ()))

    def _slots_needed(self, seq: Sequence) -> int:
        # A parent that has not sampled yet will fork n - 1 children into the running batch.
        if seq.choice_index == 0 and seq.num_output_tokens == 0:
            return min(seq.params.n, self.max_num_seqs)
        return 1

    def admission_blocks(self, num_tokens: int, max_new_tokens: int) -> int:
        """Blocks a sequence takes when admitted: its tokens plus one reserve block for output
        (none when all its remaining output fits the last block)."""
        bm = self.block_manager
        with_output = bm.blocks_for_tokens(num_tokens + max(max_new_tokens, 0))
        # Under a sliding window a sequence holds at most a step's and its window's blocks.
        held = bm.blocks_held(num_tokens + max(max_new_tokens, 0), self.max_seq_step_tokens)
        return min(with_output, bm.blocks_for_tokens(num_tokens) + 1, held + 1)

    def _track_waiting(self, seq: Sequence) -> None:
        remaining_output = seq.params.max_tokens - seq.num_output_tokens
        blocks = self.admission_blocks(seq.num_tokens, remaining_output)
        demand = (blocks, self._slots_needed(seq))
        self._waiting_demand[seq] = demand
        self._waiting_blocks += demand[0]
        self._waiting_slots += demand[1]

    def _untrack_waiting(self, seq: Sequence) -> None:
        blocks, slots = self._waiting_demand.pop(seq)
        self._waiting_blocks -= blocks
        self._waiting_slots -= slots

    def free_blocks_after_waiting(self) -> int:
        """Free blocks left once every waiting sequence got its prompt plus a reserve block."""
        return max(0, self.block_manager.num_free_blocks - self._waiting_blocks)

    def num_free_seq_slots(self) -> int:
        """Sequence slots not taken by running sequences nor promised to waiting ones."""
        return max(0, self.max_num_seqs - len(self._running) - self._waiting_slots)

    def admissible(self, num_prompt_tokens: int, max_tokens: int, n: int = 1) -> bool:
        """Whether one more request fits now: prompt plus reserve blocks, and n sequence slots.

        Whether a request could EVER fit (prompt + max_tokens <= block_manager.token_capacity)
        is the caller's check: such a request must be refused, not left queued.
        """
        blocks = self.admission_blocks(num_prompt_tokens, max_tokens)
        slots = min(n, self.max_num_seqs)
        return blocks <= self.free_blocks_after_waiting() and slots <= self.num_free_seq_slots()

    # ---- lifecycle -----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} must be new")
        seq.status = SequenceStatus.WAITING
        self._waiting.push(seq)
        self._track_waiting(seq)
        self._by_request.setdefault(seq.request_id, []).append(seq)

    def _forget(self, seq: Sequence) -> None:
        """Take seq off whichever queue holds it and free its blocks."""
        if seq in self._waiting_demand:
            self._waiting.remove(seq)
            self._untrack_waiting(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
        self.block_manager.free(seq)
        siblings = self._by_request.get(seq.request_id)
        if siblings is not None:
            siblings.remove(seq)
            if not siblings:
                del self._by_request[seq.request_id]

    def finish(
        self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None
    ) -> None:
        if seq.is_finished:
            return
        self._forget(seq)
        seq.mark_finished(reason, stop_reason)

    def abort(self, request_id: str) -> list[Sequence]:
        seqs = self.sequences(request_id)
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def fork(self, parent: Sequence, choice_index: int) -> Sequence:
        """A new choice of parent's request, starting from its prompt.

        The child shares the parent's prompt blocks and recomputes the last prompt token, so
        its next step samples its own first token. Fork before finishing the parent: a parent
        without blocks leaves the child waiting to recompute its prompt.
        """
        child = parent.new_choice(choice_index, with_output=False)
        self._by_request.setdefault(child.request_id, []).append(child)
        resume_at = min(parent.num_prompt_tokens - 1, parent.num_computed_tokens)
        if (
            parent.status is SequenceStatus.RUNNING
            and parent.block_table
            and self.block_manager.can_fork(parent, resume_at)
        ):
            child.num_computed_tokens = resume_at
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            self._running.insert(after_siblings(self._running, self._running.index(parent)), child)
        else:
            child.status = SequenceStatus.WAITING
            if parent in self._waiting_demand:
                self._waiting.insert_after(parent, child)
            else:
                self._waiting.push(child)
            self._track_waiting(child)
        return child

    def branch(self, parent: Sequence, choice_index: int) -> Sequence:
        """A running copy of a running parent with its whole history (a beam's fork): it
        shares every block of the parent (copy on write) and resumes where the parent is."""
        child = parent.new_choice(choice_index, with_output=True)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self._by_request.setdefault(child.request_id, []).append(child)
        self._running.insert(after_siblings(self._running, self._running.index(parent)), child)
        return child

    # ---- stepping ------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV blocks and queue the sequence at its level's front."""
        self._running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self._waiting.push_front(seq)
        self._track_waiting(seq)
        logger.debug(
            "preempted seq %d of %s (%d tokens, preemption #%d)",
            seq.seq_id,
            seq.request_id,
            seq.num_tokens,
            seq.num_preemptions,
        )

    def _pick_victim(self) -> Sequence:
        """The least urgent running sequence: highest priority number, then newest."""
        return max(self._running, key=lambda s: (s.priority, s.arrival_time, s.seq_id))

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, ScheduledSeq] = {}
        copies: dict[Sequence, list[BlockCopy]] = {}
        preempted: list[Sequence] = []

        index = 0
        while index < len(self._running) and budget > 0:
            seq = self._running[index]
            num_new = min(
                seq.num_tokens - seq.num_computed_tokens, budget, self.max_seq_step_tokens
            )
            if num_new <= 0:
                index += 1
                continue
            speculated = self._schedule_draft(seq, budget)
            if speculated is not None:
                draft_entry, draft_copies = speculated
                if draft_copies:
                    copies[seq] = draft_copies
                scheduled[seq] = draft_entry
                budget -= draft_entry.num_new_tokens
                index += 1
                continue
            while (block_copies := bm.try_allocate_slots(seq, num_new)) is None:
                victim = self._pick_victim()
                victim_index = self._running.index(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                if victim_index < index:  # it was scheduled earlier this step: undo that
                    index -= 1
                    budget += scheduled.pop(victim).num_new_tokens
                    copies.pop(victim, None)
            if seq.status is not SequenceStatus.RUNNING:
                # It was the least urgent itself; the more urgent ones after it (now shifted
                # to this index) still run this step, on the blocks it gave back.
                continue
            if block_copies:
                copies[seq] = block_copies
            scheduled[seq] = ScheduledSeq(seq, num_new)
            budget -= num_new
            index += 1

        if not preempted:
            self._admit(scheduled, budget)

        self.num_preemptions += len(preempted)
        return SchedulerOutput(
            scheduled=list(scheduled.values()),
            block_copies=[c for seq in scheduled for c in copies.get(seq, ())],
            preempted=preempted,
            num_batched_tokens=sum(s.num_new_tokens for s in scheduled.values()),
        )

    def _schedule_draft(
        self, seq: Sequence, budget: int
    ) -> tuple[ScheduledSeq, list[BlockCopy]] | None:
        """A decoding sequence's last token and its draft tokens, when the budget and the free
        blocks take them all; None: schedule it plainly (a plain decode may still preempt)."""
        draft = seq.spec_state.draft_token_ids[: budget - 1]
        if not draft or seq.num_tokens - seq.num_computed_tokens != 1:
            return None
        block_copies = self.block_manager.try_allocate_slots(seq, 1 + len(draft))
        if block_copies is None:
            return None
        return ScheduledSeq(seq, 1 + len(draft), draft), block_copies

    def _admit(self, scheduled: dict[Sequence, ScheduledSeq], budget: int) -> None:
        bm = self.block_manager
        # Every running sequence runs each step, so the adapters they use fit max_loras slots;
        # a sequence whose adapter finds no slot waits, and the ones behind it go ahead.
        adapters = {s.lora_id for s in self._running if s.lora_id}
        no_slot: list[Sequence] = []
        while budget > 0 and self._waiting:
            seq = self._waiting.peek()
            assert seq is not None
            if len(self._running) + self._slots_needed(seq) > self.max_num_seqs:
                break
            new_adapter = seq.lora_id and seq.lora_id not in adapters
            if new_adapter and len(adapters) >= self.config.max_loras:
                no_slot.append(self._waiting.pop())
                continue
            hits = bm.find_prefix_hits(seq)
            num_new = min(
                seq.num_tokens - len(hits) * bm.block_size, budget, self.max_seq_step_tokens
            )
            if not bm.can_allocate(seq, num_new, hits):
                break
            self._waiting.pop()
            self._untrack_waiting(seq)
            if seq.lora_id:
                adapters.add(seq.lora_id)
            bm.allocate_prompt(seq, hits)
            # Writes start after the hit blocks, so a fresh table never needs copies.
            bm.allocate_slots(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            scheduled[seq] = ScheduledSeq(seq, num_new)
            budget -= num_new
        for seq in reversed(no_slot):  # back where they were, first in line
            self._waiting.push_front(seq)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Account the computed tokens of a finished step and offer new full blocks to the cache."""
        bm = self.block_manager
        for sched in output.scheduled:
            seq = sched.seq
            if seq.status is not SequenceStatus.RUNNING:  # finished or aborted meanwhile
                continue
            seq.num_computed_tokens += sched.num_new_tokens
            bm.cache_full_blocks(seq)

    def append_token(self, seq: Sequence, token_id: int) -> Stop | None:
        """Append one token of a verified run and finish seq if it stops there."""
        seq.append_token(token_id)
        stop = check_stop(seq, self.stop_rules)
        if stop is not None:
            self.finish(seq, stop.finish_reason, stop.stop_reason)
        return stop

    def settle_draft(self, seq: Sequence) -> None:
        """After a verified step: only the accepted tokens' K/V count as computed, and the
        blocks past the sequence's tokens (rejected drafts' slots) go back."""
        if seq.status is not SequenceStatus.RUNNING:
            return
        if seq.num_computed_tokens >= seq.num_tokens:
            seq.num_computed_tokens = seq.num_tokens - 1
        self.block_manager.trim(seq, seq.num_tokens)

    def append_sampled(self, seqs: list[Sequence], token_ids: list[int]) -> list[Stop | None]:
        """Append each sequence's sampled token and finish those it stops (check_stop), freeing
        their blocks now. Returns how each token ended its sequence (None: it goes on)."""
        stops = []
        for seq, token_id in zip(seqs, token_ids, strict=True):
            seq.append_token(token_id)
            stop = check_stop(seq, self.stop_rules)
            if stop is not None:
                self.finish(seq, stop.finish_reason, stop.stop_reason)
            stops.append(stop)
        return stops
