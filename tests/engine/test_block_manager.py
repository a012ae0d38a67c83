"""BlockManager: prefix-cache hits and their verification, LRU eviction, forks and copy-on-write."""

from __future__ import annotations

import random

import pytest

from engine import block_manager as bm_module
from engine.block_manager import BlockManager, NoFreeBlocksError
from engine.sequence import Sequence
from schemas.sampling import SamplingParams


def make_seq(tokens: list[int], request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(tokens), len(tokens), SamplingParams())


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """What one scheduled step does for a new sequence: take hits, compute the rest, cache."""
    bm.allocate_prompt(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens) == []
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_shared_prefix_is_served_from_cache():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=16)
    prefix = random_tokens(rng, 256)
    first = make_seq(prefix + random_tokens(rng, 10), "a")
    prefill(bm, first)
    assert first.num_cached_tokens == 0

    second = make_seq(prefix + random_tokens(rng, 20), "b")
    prefill(bm, second)
    shared_blocks = len(prefix) // bm.block_size
    assert second.num_cached_tokens == len(prefix)
    assert second.block_table[:shared_blocks] == first.block_table[:shared_blocks]
    assert all(bm.ref_count(b) == 2 for b in first.block_table[:shared_blocks])
    # The differing tails live in separate blocks.
    assert not set(second.block_table[shared_blocks:]) & set(first.block_table)
    assert bm.prefix_cache_queries == first.num_tokens + second.num_tokens
    assert bm.prefix_cache_hits == len(prefix)
    assert bm.prefix_cache_hit_rate == len(prefix) / (first.num_tokens + second.num_tokens)


@pytest.mark.parametrize("extra_tokens", [0, 1])
def test_last_prompt_token_is_always_recomputed(extra_tokens):
    rng = random.Random(1)
    bm = BlockManager(num_blocks=64, block_size=16)
    prompt = random_tokens(rng, 256)
    prefill(bm, make_seq(prompt))
    again = make_seq(prompt + random_tokens(rng, extra_tokens))
    bm.allocate_prompt(again)
    # At least one token is left to compute, and everything before it that is cached is used.
    cacheable = (again.num_tokens - 1) // bm.block_size * bm.block_size
    assert again.num_computed_tokens == again.num_cached_tokens == cacheable
    assert again.num_tokens - again.num_computed_tokens >= 1
    bm.allocate_slots(again, again.num_tokens - again.num_computed_tokens)
    # The recomputed token is written into a block of its own, not into the cached one.
    written = again.block_table[(again.num_tokens - 1) // bm.block_size]
    assert bm.ref_count(written) == 1 and not bm.is_cached(written)


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens, salt: 7)
    bm = BlockManager(num_blocks=16, block_size=4)
    prefill(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert bm.num_cached_blocks == 1  # every block hashes alike; only the first got the slot

    other = make_seq([9, 9, 9, 9, 9, 9, 9, 9, 9])
    assert bm.find_prefix_hits(other) == []
    same = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    # The first block really matches; the second collides with it but holds other tokens.
    assert len(bm.find_prefix_hits(same)) == 1


def test_hit_needs_the_same_parent_chain(monkeypatch):
    # A hash that ignores the parent: the same block of tokens after another prefix collides.
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens, salt: hash(tokens))
    bm = BlockManager(num_blocks=16, block_size=2)
    prefill(bm, make_seq([1, 2, 3, 4, 0]))
    repeated = make_seq([1, 2, 1, 2, 3, 4, 0])
    hits = bm.find_prefix_hits(repeated)
    assert len(hits) == 1  # [1, 2] at position 0 only; [1, 2] after [1, 2] is another KV


def test_salt_separates_caches():
    bm = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(9))
    owner = make_seq(tokens)
    owner.cache_salt = "tenant-a"
    prefill(bm, owner)
    stranger = make_seq(tokens)
    stranger.cache_salt = "tenant-b"
    assert bm.find_prefix_hits(stranger) == []
    friend = make_seq(tokens)
    friend.cache_salt = "tenant-a"
    assert len(bm.find_prefix_hits(friend)) == 2


def test_eviction_is_lru_tail_blocks_first():
    bm = BlockManager(num_blocks=8, block_size=4)
    a_tokens, b_tokens = list(range(100, 109)), list(range(200, 209))  # 2 full blocks + 1 token
    a, b = make_seq(a_tokens, "a"), make_seq(b_tokens, "b")
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 4

    def hits(tokens: list[int]) -> int:
        return len(bm.find_prefix_hits(make_seq(tokens)))

    # Uncached blocks go first; then the least recently freed cached blocks, tail first.
    filler = make_seq(list(range(5 * 4)), "filler")  # 5 blocks: evicts 1 cached block
    bm.allocate_prompt(filler)
    bm.allocate_slots(filler, filler.num_tokens)
    assert (hits(a_tokens), hits(b_tokens)) == (1, 2)
    more = make_seq([7] * 4, "more")
    bm.allocate_prompt(more)
    bm.allocate_slots(more, more.num_tokens)
    assert (hits(a_tokens), hits(b_tokens)) == (0, 2)

    # A hit on a free cached block takes it out of the free queue.
    b_again = make_seq(b_tokens, "b2")
    bm.allocate_prompt(b_again)
    assert b_again.num_cached_tokens == 8
    free = bm.free_block_ids()
    assert not set(b_again.block_table) & set(free)
    held = filler.block_table + more.block_table + b_again.block_table
    assert bm.num_free_blocks == bm.num_total_blocks - len(held)


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(num_blocks=16, block_size=4)
    parent = make_seq(list(range(10)))  # 3 blocks, the last holding 2 tokens
    prefill(bm, parent)
    parent.append_token(42)  # its first sampled token
    original = list(parent.block_table)

    child = make_seq(parent.prompt_token_ids)
    child.num_computed_tokens = parent.num_prompt_tokens - 1
    bm.fork(parent, child)
    assert child.block_table == original
    assert [bm.ref_count(b) for b in original] == [2, 2, 2]

    # The parent writes position 10 into the shared last block: it gets a private copy.
    copies = bm.allocate_slots(parent, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == original[2] and parent.block_table == [*original[:2], dst]
    assert [bm.ref_count(b) for b in original] == [2, 2, 1]
    assert bm.ref_count(dst) == 1

    # The child now owns the old last block alone and writes position 9 in place.
    assert bm.allocate_slots(child, 1) == []
    assert child.block_table == original

    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_child_copies_a_full_cached_block_before_rewriting_it():
    bm = BlockManager(num_blocks=16, block_size=4)
    parent = make_seq(list(range(8)))  # exactly 2 full blocks, both cached
    prefill(bm, parent)
    parent.append_token(99)
    child = make_seq(parent.prompt_token_ids)
    child.num_computed_tokens = 7
    bm.fork(parent, child)
    copies = bm.allocate_slots(child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert bm.is_cached(parent.block_table[1]) and not bm.is_cached(child.block_table[1])
    assert bm.ref_count(parent.block_table[1]) == 1


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    big = make_seq(list(range(20)))  # needs 5 blocks
    bm.allocate_prompt(big)
    assert not bm.can_allocate(big, big.num_tokens)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_slots(big, big.num_tokens)
    assert big.block_table == [] and bm.num_free_blocks == 4
    assert bm.can_allocate(big, 16)
    bm.allocate_slots(big, 16)
    assert bm.usage == 1.0


def test_free_returns_every_block_and_keeps_cached_content():
    rng = random.Random(3)
    bm = BlockManager(num_blocks=32, block_size=8)
    seqs = [make_seq(random_tokens(rng, rng.randrange(1, 60)), str(i)) for i in range(3)]
    for seq in seqs:
        prefill(bm, seq)
    full_blocks = sum(s.num_tokens // bm.block_size for s in seqs)
    assert bm.num_cached_blocks == full_blocks
    for seq in seqs:
        bm.free(seq)
        assert seq.block_table == []
    assert bm.num_free_blocks == bm.num_total_blocks and bm.usage == 0.0
    assert bm.num_cached_blocks == full_blocks
    assert sorted(bm.free_block_ids()) == list(range(bm.num_total_blocks))


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    tokens = list(range(20))
    prefill(bm, make_seq(tokens))
    again = make_seq(tokens)
    bm.allocate_prompt(again)
    assert again.num_cached_tokens == 0 and bm.num_cached_blocks == 0
