"""Random add / step / abort / finish / fork traffic against small block pools.

After every operation the block accounting must be exact (reference counts, the free queue)
and a simulated KV cache must hold, for every computed position of every running sequence,
the K/V of exactly that sequence's prefix: this catches wrong prefix hits, missing or wrong
copy-on-write, and blocks written while someone else still reads them.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from schemas.sampling import SamplingParams

VOCAB = 3  # a tiny vocabulary makes equal blocks, and so prefix hits, common
SHARED_PREFIXES = [[0] * 12, [1, 2] * 6, [2, 1, 0, 0] * 3]


class BlockAccounting(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(3, 16),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6),
        seed=st.integers(0, 2**32 - 1),
    )
    def setup(self, block_size, num_blocks, budget, max_num_seqs, seed):
        config = EngineConfig(
            model="dummy",
            block_size=block_size,
            num_kv_blocks=num_blocks,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
        )
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.sched = Scheduler(config, self.bm)
        self.block_size = block_size
        self.capacity = num_blocks * block_size  # one sequence must fit the whole pool
        # Simulated KV cache: each slot holds the prefix (token ids) whose K/V it stores.
        self.kv: list[tuple[int, ...] | None] = [None] * self.capacity
        self.rng = random.Random(seed)
        self.requests: list[str] = []

    def live(self) -> list[Sequence]:
        return self.sched.running + self.sched.waiting

    # ---- operations ----------------------------------------------------------------------

    @rule(
        requests=st.lists(
            st.tuples(
                st.sampled_from(SHARED_PREFIXES),
                st.integers(0, 12),  # how much of the shared prefix
                st.lists(st.integers(0, VOCAB - 1), max_size=10),  # own tail
                st.integers(0, 2),  # priority
                st.integers(1, 3),  # n
                st.integers(1, 12),  # max_tokens
            ),
            min_size=1,
            max_size=4,
        )
    )
    def add(self, requests):
        for prefix, prefix_len, tail, priority, n, max_tokens in requests:
            tokens = (prefix[:prefix_len] + tail)[: self.capacity - 1] or [0]
            max_tokens = min(max_tokens, self.capacity - len(tokens))
            request_id = f"req{len(self.requests)}"
            self.requests.append(request_id)
            params = SamplingParams(n=n, max_tokens=max_tokens)
            self.sched.add(Sequence(request_id, tokens, len(tokens), params, priority))

    @rule()
    def step(self):
        self._step()

    def _step(self) -> None:
        out = self.sched.schedule()
        assert out.num_batched_tokens <= self.sched.max_num_batched_tokens
        self._run_model(out)
        # Coverage of the interesting paths (see --hypothesis-show-statistics).
        if out.preempted:
            event("preemption")
        if out.block_copies:
            event("copy-on-write")
        if any(s.seq.num_cached_tokens and not s.seq.num_output_tokens for s in out.scheduled):
            event("prefix hit")
        self.sched.update_after_step(out)
        for item in out.scheduled:
            seq = item.seq
            if not item.samples or seq.is_finished:
                continue
            seq.append_token(self.rng.randrange(VOCAB))
            if seq.num_output_tokens == 1 and seq.choice_index == 0:
                for choice in range(1, seq.params.n):  # fork before the parent may finish
                    self.sched.fork(seq, choice)
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, "length")

    def _run_model(self, out) -> None:
        """What the model runner does to the cache: copies first, then this step's writes."""
        bs = self.block_size
        for src, dst in out.block_copies:
            self.kv[dst * bs : (dst + 1) * bs] = self.kv[src * bs : (src + 1) * bs]
        written: set[int] = set()
        for item in out.scheduled:
            seq = item.seq
            for pos in range(
                seq.num_computed_tokens, seq.num_computed_tokens + item.num_new_tokens
            ):
                slot = seq.block_table[pos // bs] * bs + pos % bs
                assert slot not in written, "two sequences write one slot in a step"
                written.add(slot)
                self.kv[slot] = tuple(seq.token_ids[: pos + 1])

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted({s.request_id for s in self.live()})))
        aborted = self.sched.abort(request_id)
        assert aborted and all(s.finish_reason == "abort" and not s.block_table for s in aborted)
        assert self.sched.sequences(request_id) == []

    @precondition(lambda self: self.sched.num_running > 0)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.sched.running))
        self.sched.finish(seq, "stop")
        assert seq.is_finished and not seq.block_table

    @rule()
    def drain(self):
        """Everything admitted eventually finishes: no livelock between preemptions."""
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            self._step()
            self.check_blocks()
        assert not self.sched.has_unfinished()

    # ---- invariants ----------------------------------------------------------------------

    @invariant()
    def check_blocks(self):
        bm, bs = self.bm, self.block_size
        live = self.live()
        refs = Counter(b for seq in live for b in seq.block_table)
        assert all(len(set(seq.block_table)) == len(seq.block_table) for seq in live)
        for block_id in range(bm.num_total_blocks):
            assert bm.ref_count(block_id) == refs[block_id]
        free = bm.free_block_ids()
        assert len(free) == len(set(free)) == bm.num_free_blocks
        assert set(free) == {b for b in range(bm.num_total_blocks) if refs[b] == 0}
        assert 0.0 <= bm.prefix_cache_hit_rate <= 1.0

        for seq in self.sched.waiting:
            assert seq.status is SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        for seq in self.sched.running:
            assert seq.status is SequenceStatus.RUNNING
            assert seq.num_cached_tokens <= seq.num_computed_tokens < seq.num_tokens
            assert len(seq.block_table) * bs >= seq.num_computed_tokens
            for pos in range(seq.num_computed_tokens):
                slot = seq.block_table[pos // bs] * bs + pos % bs
                assert self.kv[slot] == tuple(seq.token_ids[: pos + 1]), (seq, pos)
        # A registered block holds the K/V of the tokens it is registered under.
        for block_id in range(bm.num_total_blocks):
            tokens = bm.cached_tokens(block_id)
            if tokens is not None:
                stored = self.kv[block_id * bs : (block_id + 1) * bs]
                assert all(p is not None for p in stored)
                assert tuple(p[-1] for p in stored) == tokens
                assert (len(stored[0]) - 1) % bs == 0  # starts at a block-aligned position

        assert self.sched.num_running + self.sched.num_waiting == len(live)
        assert self.sched.free_blocks_after_waiting() <= bm.num_free_blocks

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for request_id in self.requests:
            self.sched.abort(request_id)
        assert not self.sched.has_unfinished()
        assert self.bm.num_free_blocks == self.bm.num_total_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_total_blocks))


_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

BlockAccounting.TestCase.settings = settings(max_examples=200, stateful_step_count=40, **_common)
TestBlockAccounting = BlockAccounting.TestCase


class SlowBlockAccounting(BlockAccounting):
    pass


SlowBlockAccounting.TestCase.settings = settings(
    max_examples=1500, stateful_step_count=80, **_common
)
TestBlockAccountingSlow = pytest.mark.slow(SlowBlockAccounting.TestCase)
