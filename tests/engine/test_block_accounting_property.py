"""Random add / step / abort / finish / fork / beam search traffic against small block pools.

After every operation the block accounting must be exact (reference counts, the free queue)
and a simulated KV cache must hold, for every computed position of every running sequence,
the K/V of exactly that sequence's prefix: this catches wrong prefix hits, missing or wrong
copy-on-write, and blocks written while someone else still reads them. Beam search requests
run in the same batch, driven as the engine drives them (random logprob rows in place of the
model's): their beams branch, get pruned and finish through the scheduler, and a search's live
beams must always be exactly its request's sequences, so a pruned beam can hold no block.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.beam_search import BeamSearch, BeamSearchParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from schemas.sampling import SamplingParams

VOCAB = 3  # a tiny vocabulary makes equal blocks, and so prefix hits, common
SHARED_PREFIXES = [[0] * 12, [1, 2] * 6, [2, 1, 0, 0] * 3]
LETTERS = "abc"  # the text of token i, for stop strings


def decode(token_ids: list[int]) -> str:
    return "".join(LETTERS[t] for t in token_ids)


class BlockAccounting(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(3, 16),
        budget=st.integers(1, 24),
        max_num_seqs=st.integers(1, 6),
        seed=st.integers(0, 2**32 - 1),
        eos_token_ids=st.sampled_from([frozenset(), frozenset({2}), frozenset({1, 2})]),
    )
    def setup(self, block_size, num_blocks, budget, max_num_seqs, seed, eos_token_ids):
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
        self.eos_token_ids = eos_token_ids
        self.searches: dict[str, BeamSearch] = {}  # the beam search requests not done yet

    def live(self) -> list[Sequence]:
        return self.sched.running + self.sched.waiting

    def fit(self, prefix: list[int], prefix_len: int, tail: list[int], max_tokens: int):
        """A prompt and max_tokens that fit the whole pool."""
        tokens = (prefix[:prefix_len] + tail)[: self.capacity - 1] or [0]
        return tokens, min(max_tokens, self.capacity - len(tokens))

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
            tokens, max_tokens = self.fit(prefix, prefix_len, tail, max_tokens)
            request_id = f"req{len(self.requests)}"
            self.requests.append(request_id)
            params = SamplingParams(n=n, max_tokens=max_tokens)
            self.sched.add(Sequence(request_id, tokens, len(tokens), params, priority))

    @rule(
        requests=st.lists(
            st.tuples(
                st.sampled_from(SHARED_PREFIXES),
                st.integers(0, 12),  # how much of the shared prefix
                st.lists(st.integers(0, VOCAB - 1), max_size=10),  # own tail
                st.integers(0, 2),  # priority
                st.integers(1, 4),  # beam width
                st.integers(1, 12),  # max_tokens
                st.booleans(),  # ignore_eos
                st.sampled_from([[], [0], [1]]),  # stop token ids
                st.sampled_from([[], ["ca"], ["bb", "ac"]]),  # stop strings
                st.sampled_from([1.0, 0.5, 2.0]),  # length penalty
            ),
            min_size=1,
            max_size=3,
        )
    )
    def add_beam_searches(self, requests):
        for prefix, prefix_len, tail, priority, width, max_tokens, *rest in requests:
            ignore_eos, stop_token_ids, stop, length_penalty = rest
            tokens, max_tokens = self.fit(prefix, prefix_len, tail, max_tokens)
            request_id = f"beams{len(self.requests)}"
            self.requests.append(request_id)
            params = BeamSearchParams(
                beam_width=width,
                max_tokens=max_tokens,
                ignore_eos=ignore_eos,
                length_penalty=length_penalty,
                stop=stop,
                stop_token_ids=stop_token_ids,
            ).to_sampling_params()
            seq = Sequence(request_id, tokens, len(tokens), params, priority)
            self.sched.add(seq)
            self.searches[request_id] = BeamSearch(seq, self.eos_token_ids, self.capacity, decode)

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
        self._advance_beams(out)
        for item in out.scheduled:
            seq = item.seq
            if not item.samples or seq.is_finished or seq.params.use_beam_search:
                continue
            seq.append_token(self.rng.randrange(VOCAB))
            if seq.num_output_tokens == 1 and seq.choice_index == 0:
                for choice in range(1, seq.params.n):  # fork before the parent may finish
                    self.sched.fork(seq, choice)
            if seq.num_output_tokens >= seq.params.max_tokens:
                self.sched.finish(seq, "length")

    def _advance_beams(self, out) -> None:
        """As the engine does: each search with a new row (or a beam lost to preemption) takes
        them; a search that is done has finished all its beams."""
        rows: dict[str, dict[Sequence, torch.Tensor]] = {
            seq.request_id: {} for seq in out.preempted if seq.request_id in self.searches
        }
        if rows:
            event("beam preempted")
        for item in out.scheduled:
            seq = item.seq
            if item.samples and seq.params.use_beam_search and not seq.is_finished:
                logits = torch.tensor([self.rng.gauss(0.0, 2.0) for _ in range(VOCAB)])
                rows.setdefault(seq.request_id, {})[seq] = logits.log_softmax(-1)
        for request_id, beam_rows in rows.items():
            search = self.searches[request_id]
            search.advance(beam_rows, self.sched)
            if len(search.live) > 1:
                event("beams branched")
            if search.done:
                del self.searches[request_id]
                self.check_hypotheses(search)
                assert self.sched.sequences(request_id) == []
                event("beam search done")

    def check_hypotheses(self, search: BeamSearch) -> None:
        params = search.params
        assert 1 <= len(search.finished) <= search.width
        scores = [h.score for h in search.finished]
        assert scores == sorted(scores, reverse=True)
        for hypothesis in search.finished:
            assert 1 <= len(hypothesis.token_ids) <= params.max_tokens
            if isinstance(hypothesis.stop_reason, int):
                assert hypothesis.token_ids[-1] == hypothesis.stop_reason
            if hypothesis.finish_reason == "length":
                assert len(hypothesis.token_ids) == params.max_tokens
        if any(h.finish_reason == "stop" and h.stop_reason is None for h in search.finished):
            event("beam finished on EOS")

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
        self.searches.pop(request_id, None)
        assert aborted and all(s.finish_reason == "abort" and not s.block_table for s in aborted)
        assert self.sched.sequences(request_id) == []

    def ordinary_running(self) -> list[Sequence]:
        """Running sequences that are no beams (only their search finishes beams)."""
        return [s for s in self.sched.running if not s.params.use_beam_search]

    @precondition(lambda self: self.ordinary_running())
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(self.ordinary_running()))
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
            search = self.searches.get(seq.request_id)
            if search is not None and search.has_row(seq):  # it waits for its siblings' rows
                assert seq.num_cached_tokens <= seq.num_computed_tokens == seq.num_tokens
            else:
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

        # A search's live beams are its request's sequences: pruned ones are gone, blocks too.
        for request_id, search in self.searches.items():
            beams = [beam.seq for beam in search.live]
            assert 1 <= len(beams) <= search.width and not search.done
            assert sorted(s.seq_id for s in beams) == sorted(
                s.seq_id for s in self.sched.sequences(request_id)
            )
            assert all(not s.is_finished for s in beams)

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
