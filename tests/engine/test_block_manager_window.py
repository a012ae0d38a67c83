"""BlockManager under a sliding window (every layer windowed): a running sequence gives back the
blocks before its window, keeps what the window reads, and prefix hits stay correct."""

from __future__ import annotations

import random

from engine.block_manager import FREED, BlockManager
from engine.sequence import Sequence
from schemas.sampling import SamplingParams

BS = 4
WINDOW = 10


def _seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(tokens), len(tokens), SamplingParams())


def _step(bm: BlockManager, seq: Sequence, n: int) -> None:
    """One scheduled step of n new tokens, then what the scheduler does after it."""
    assert bm.try_allocate_slots(seq, n) is not None
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def _decode_to(bm: BlockManager, seq: Sequence, length: int, rng: random.Random) -> None:
    while seq.num_tokens < length:
        seq.append_token(rng.randrange(1000))
        _step(bm, seq, 1)


def _needed_blocks(seq: Sequence) -> range:
    """The blocks the next step's first query reads (position num_computed_tokens)."""
    first_key = max(0, seq.num_computed_tokens - WINDOW + 1)
    return range(first_key // BS, len(seq.block_table))


def test_a_decoding_sequence_holds_its_window_only() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=12, block_size=BS, kv_window=WINDOW)
    seq = _seq([rng.randrange(1000) for _ in range(20)])
    bm.allocate_prompt(seq)
    _step(bm, seq, 20)
    # 12 blocks hold 48 tokens; the sequence runs to 400 on them
    for length in range(21, 400, 7):
        _decode_to(bm, seq, length, rng)
        table = seq.block_table
        assert all(table[i] != FREED for i in _needed_blocks(seq))
        assert bm.held_blocks(seq) <= bm.blocks_held(seq.num_tokens, 1)
        assert bm.num_free_blocks == 12 - bm.held_blocks(seq)
    first = table.index(next(b for b in table if b != FREED))
    assert table[:first] == [FREED] * first and first > 90


def test_every_layer_full_keeps_every_block() -> None:
    rng = random.Random(1)
    bm = BlockManager(num_blocks=40, block_size=BS)
    seq = _seq([rng.randrange(1000) for _ in range(20)])
    bm.allocate_prompt(seq)
    _step(bm, seq, 20)
    _decode_to(bm, seq, 100, rng)
    assert FREED not in seq.block_table and bm.held_blocks(seq) == 25


def test_freed_blocks_are_never_registered_and_hits_need_only_the_window() -> None:
    rng = random.Random(2)
    bm = BlockManager(num_blocks=64, block_size=BS, kv_window=WINDOW)
    prompt = [rng.randrange(1000) for _ in range(60)]
    first = _seq(prompt, "a")
    bm.allocate_prompt(first)
    for _ in range(6):  # chunks of 10: each frees the blocks before its window
        _step(bm, first, 10)
    assert first.block_table[0] == FREED
    held = [b for b in first.block_table if b != FREED]
    assert all(bm.is_cached(b) for b in held[:-1])

    bm.free(first)
    second = _seq([*prompt, 1, 2, 3], "b")
    hits = bm.find_prefix_hits(second)
    # the whole 60-token prefix, of which only the blocks inside its end's window are taken
    assert len(hits) == 15
    window_start = (15 * BS - WINDOW + 1) // BS
    assert hits[:window_start] == [FREED] * window_start
    assert all(b != FREED and bm.cached_tokens(b) is not None for b in hits[window_start:])
    bm.allocate_prompt(second, hits)
    assert second.num_computed_tokens == 60
    _step(bm, second, 3)
    assert all(second.block_table[i] != FREED for i in _needed_blocks(second))


def test_a_hit_whose_window_lost_a_block_is_shortened() -> None:
    rng = random.Random(3)
    bm = BlockManager(num_blocks=64, block_size=BS, kv_window=WINDOW)
    prompt = [rng.randrange(1000) for _ in range(40)]
    first = _seq(prompt, "a")
    bm.allocate_prompt(first)
    _step(bm, first, 40)
    table = list(first.block_table)
    bm.free(first)
    # Reuse block 8 (tokens 32..35) for other content: it leaves the cache.
    other = _seq([rng.randrange(1000) for _ in range(4 * 64)], "x")
    victim = table[8]
    while bm.is_cached(victim):
        other.block_table = []
        other.num_computed_tokens = 0
        bm.allocate_prompt(other, [])
        _step(bm, other, 4)
    second = _seq([*prompt, 7], "b")
    hits = bm.find_prefix_hits(second)
    # a hit ending at block 8 or later needs it (it is inside that hit's window)
    assert len(hits) == 8
    assert all(b != FREED for b in hits[(8 * BS - WINDOW + 1) // BS :])


def test_a_fork_needing_given_back_blocks_is_refused() -> None:
    rng = random.Random(4)
    bm = BlockManager(num_blocks=64, block_size=BS, kv_window=WINDOW)
    parent = _seq([rng.randrange(1000) for _ in range(12)])
    bm.allocate_prompt(parent)
    _step(bm, parent, 12)
    assert bm.can_fork(parent, 11)
    _decode_to(bm, parent, 60, rng)
    assert not bm.can_fork(parent, 11)
