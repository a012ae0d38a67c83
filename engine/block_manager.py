"""Paged KV-cache block accounting: reference counts, an LRU free queue and the prefix cache
(the blocks, their counts and the queue themselves: engine.block_pool).

A sequence's block table maps its token positions to fixed-size blocks of the KV cache
(position p lives in block_table[p // block_size] at offset p % block_size). Blocks are shared
between sequences in two ways, both counted by reference counts:

- prefix caching: a FULL, fully computed block is registered under a chained hash of its
  tokens (parent block hash + token ids + salt); a later sequence with the same prefix takes
  the block instead of recomputing it. Hits are verified against the stored tokens and
  parent hash, so a hash collision costs a miss, never wrong K/V.
- forks (n > 1): a child shares all its parent's blocks; a shared block about to be written
  is copied first (copy-on-write) and the (src, dst) pair goes to the model runner.

Freed blocks keep their cached content until reallocated: the free queue is in LRU order, so
recently freed prefixes survive longest (freed blocks holding no cached prefix go to its
head: nothing is lost by reusing them first). Every operation costs O(blocks touched).

Where every layer of the model attends over a sliding window (`kv_window`: the largest), a
running sequence gives back the blocks wholly before the window of its next step's first
query: no layer reads them again. Their table entries become FREED (positions keep their
index), and their cached content stays in the prefix cache like any freed block's. A prefix
hit then needs only the blocks inside the window of the hit's end: the blocks before it may be
missing from the cache (their tokens' hashes still chain), and the new sequence's table holds
FREED there. A sequence never registers a FREED entry, so it publishes hashes only for blocks
it holds.
"""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.sequence import Sequence

BlockCopy = tuple[int, int]  # (src block, dst block): copy the KV data before the step runs
FREED = -1  # a block table entry whose block was given back (before every layer's window)


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...], salt: str | None) -> int:
    """Chained hash of one full block; stable within a process (hits are verified anyway)."""
    return hash((parent_hash, token_ids, salt))


class NoFreeBlocksError(RuntimeError):
    """allocate_slots was called without can_allocate room; the caller must preempt first."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager(BlockPool):
    """Sequences' block tables over the pool (engine.block_pool): prefix hits, allocation with
    copy-on-write, giving back blocks outside the window, trims and forks."""

    # ---- sequence sizes ----------------------------------------------------------------

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return _cdiv(num_tokens, self.block_size)

    def blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a sequence of num_tokens holds while a step computes up to
        step_tokens of them: all of them, or under kv_window those of the step and the window
        before it."""
        every = self.blocks_for_tokens(num_tokens)
        if self.kv_window is None:
            return every
        # keys start - window + 1 .. start + step - 1, starting anywhere in a block
        return min(every, self.blocks_for_tokens(self.kv_window - 1 + step_tokens) + 1)

    @property
    def step_token_limit(self) -> int | None:
        """Under kv_window: the most new tokens one sequence's step may take so that the step's
        blocks and its window's fit the whole cache (None: no such limit, or no window fits)."""
        if self.kv_window is None:
            return None
        limit = (len(self._blocks) - 1) * self.block_size - self.kv_window + 1
        return limit if limit > 0 else None

    def longest_sequence(self, step_tokens: int) -> int | None:
        """The most tokens one sequence can ever reach in this cache (steps of up to
        step_tokens, cut to step_token_limit); None: no bound (its window's blocks always fit)."""
        limit = self.step_token_limit
        if limit is not None and self.blocks_held(2**62, min(step_tokens, limit)) <= len(
            self._blocks
        ):
            return None
        return self.token_capacity

    def held_blocks(self, seq: Sequence) -> int:
        """Blocks seq's table still holds (FREED entries left out)."""
        return sum(1 for block_id in seq.block_table if block_id != FREED)

    # ---- prefix cache ----------------------------------------------------------------------

    def _ensure_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        hashes = seq.block_hashes
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[i - 1] if i else None
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(hash_block_tokens(parent, tokens, seq.cache_salt))
        return hashes

    def find_prefix_hits(self, seq: Sequence) -> list[int]:
        """Block ids of the longest verified cached prefix of seq; takes nothing.

        At most num_tokens - 1 tokens are served from the cache: the last token is always
        computed, so the step that catches the sequence up yields logits.
        """
        # A prompt to score is computed in full: cached positions would have no logits.
        if (
            not self.enable_prefix_caching
            or seq.block_table
            or seq.params.prompt_logprobs is not None
        ):
            return []
        num_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._ensure_hashes(seq, num_blocks)
        hits: list[int] = []
        bs = self.block_size
        parent: int | None = None
        for i in range(num_blocks):
            block_id = self._cached.get(hashes[i])
            block = None if block_id is None else self._blocks[block_id]
            # Guards against hash collisions: same parent chain and same tokens.
            if block is None or (
                block.parent_hash != parent
                or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs])
            ):
                if self.kv_window is None:
                    break
                hits.append(FREED)  # usable only where it ends up before the hit's window
            else:
                hits.append(block.block_id)
            parent = hashes[i]
        if self.kv_window is None:
            return hits
        return self._windowed_hits(hits)

    def _windowed_hits(self, chain: list[int]) -> list[int]:
        """The longest prefix of chain (block ids, FREED where missing) whose blocks inside
        the window of its end are all there, with FREED for every block before that window."""
        for length in range(len(chain), 0, -1):
            first = self._first_needed_block(length * self.block_size)
            if all(block_id != FREED for block_id in chain[first:length]):
                return [FREED] * first + chain[first:length]
        return []

    def _first_needed_block(self, start: int) -> int:
        """Under kv_window: the first block a step whose first query sits at `start` reads."""
        assert self.kv_window is not None
        return max(0, start - self.kv_window + 1) // self.block_size

    def _release_outside_window(self, seq: Sequence) -> None:
        """Give back seq's blocks wholly before the window of its next step (FREED entries
        always form a prefix of the table, so this walks back from the window only over the
        blocks it frees)."""
        if self.kv_window is None:
            return
        table = seq.block_table
        end = min(self._first_needed_block(seq.num_computed_tokens), len(table))
        for i in range(end - 1, -1, -1):
            if table[i] == FREED:
                break
            self._release(table[i])
            table[i] = FREED

    def allocate_prompt(self, seq: Sequence, prefix_hits: list[int] | None = None) -> None:
        """Start a sequence that holds no blocks: take its cached prefix blocks.

        prefix_hits: the result of find_prefix_hits(seq) if the caller already looked.
        Sets num_computed_tokens = num_cached_tokens = the cached token count.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        hits = self.find_prefix_hits(seq) if prefix_hits is None else prefix_hits
        for block_id in hits:
            if block_id != FREED:
                self._take(block_id)
        seq.block_table = list(hits)
        seq.num_registered_blocks = len(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full and fully computed since the last call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, seq.num_tokens, len(seq.block_table) * bs) // bs
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._ensure_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            if seq.block_table[i] == FREED:  # given back: its content is not ours to publish
                continue
            block = self._blocks[seq.block_table[i]]
            # A block already registered (a hit), or a hash another block holds (the same
            # prefix computed twice, or a collision), stays as it is.
            if block.hash is not None or hashes[i] in self._cached:
                continue
            block.hash = hashes[i]
            block.parent_hash = hashes[i - 1] if i else None
            block.token_ids = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            self._cached[block.hash] = block.block_id
        seq.num_registered_blocks = num_full

    # ---- allocation ------------------------------------------------------------------------

    def num_blocks_needed(
        self, seq: Sequence, num_new_tokens: int, prefix_hits: list[int] | None = None
    ) -> int:
        """Free blocks that allocate_slots (after allocate_prompt with prefix_hits) would use."""
        if not prefix_hits:
            return self._num_blocks_needed(seq.block_table, seq.num_computed_tokens, num_new_tokens)
        computed = len(prefix_hits) * self.block_size
        # Hit blocks sitting in the free queue leave it.
        idle_hits = sum(1 for b in prefix_hits if b != FREED and self._blocks[b].ref_count == 0)
        return idle_hits + self._num_blocks_needed(prefix_hits, computed, num_new_tokens)

    def _num_blocks_needed(self, table: list[int], start: int, num_new_tokens: int) -> int:
        """New blocks to extend table over [start, start + n), plus copies of shared blocks
        among the existing ones written (table[start // block_size : end block])."""
        end_block = _cdiv(start + num_new_tokens, self.block_size)
        needed = max(0, end_block - len(table))
        blocks = self._blocks
        for i in range(start // self.block_size, min(end_block, len(table))):
            if blocks[table[i]].ref_count > 1:
                needed += 1
        return needed

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, prefix_hits: list[int] | None = None
    ) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, prefix_hits) <= len(self._free)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy]:
        """Make seq's table cover num_computed_tokens + num_new_tokens tokens.

        Returns the copy-on-write pairs for shared blocks this step writes into. All or
        nothing: raises NoFreeBlocksError (and changes nothing) when blocks run short.
        """
        copies = self.try_allocate_slots(seq, num_new_tokens)
        if copies is None:
            raise NoFreeBlocksError(f"sequence {seq.seq_id} needs more blocks than are free")
        return copies

    def try_allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[BlockCopy] | None:
        """allocate_slots in one pass (the scheduler's hot path); None when blocks run short."""
        self._release_outside_window(seq)
        table = seq.block_table
        start = seq.num_computed_tokens
        first_written = start // self.block_size
        # Fast path (most decodes): only the private, uncached last block is written.
        if (
            first_written == len(table) - 1
            and start + num_new_tokens <= len(table) * self.block_size
        ):
            last = self._blocks[table[-1]]
            if last.ref_count == 1 and last.hash is None:
                return []
        if self._num_blocks_needed(table, start, num_new_tokens) > len(self._free):
            return None
        end_block = _cdiv(start + num_new_tokens, self.block_size)
        copies: list[BlockCopy] = []
        for i in range(first_written, min(end_block, len(table))):
            block = self._blocks[table[i]]
            if block.ref_count > 1:
                dst = self._take_free()
                copies.append((block.block_id, dst))
                block.ref_count -= 1  # still referenced by the others
                table[i] = dst
            elif block.hash is not None:
                # Only ours, but about to be rewritten: it must not serve as a cached prefix.
                self._uncache(block)
        while len(table) < end_block:
            table.append(self._take_free())
        # Blocks written from here on are offered to the cache again once full.
        if seq.num_registered_blocks > first_written:
            seq.num_registered_blocks = first_written
        return copies

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past those that hold seq's first num_tokens tokens (the slots
        of rejected draft tokens); the tokens they held were never offered to the cache."""
        keep = self.blocks_for_tokens(num_tokens)
        table = seq.block_table
        while len(table) > keep:
            self._release(table.pop())
        seq.num_registered_blocks = min(seq.num_registered_blocks, keep)

    def free(self, seq: Sequence) -> None:
        """Drop seq's blocks, tail first, so its last blocks are evicted first."""
        for block_id in reversed(seq.block_table):
            if block_id != FREED:
                self._release(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def can_fork(self, parent: Sequence, num_computed_tokens: int) -> bool:
        """Whether parent still holds every block a child resuming at num_computed_tokens
        reads (under kv_window the parent may have given back the ones it needs)."""
        if self.kv_window is None:
            return True
        first = self._first_needed_block(num_computed_tokens)
        end = self.blocks_for_tokens(num_computed_tokens)
        return all(block_id != FREED for block_id in parent.block_table[first:end])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares the parent's blocks that cover its tokens (a prefix of the parent's).

        Set child.num_computed_tokens first; the child's table must cover it.
        """
        if child.block_table:
            raise ValueError(f"sequence {child.seq_id} already holds blocks")
        num_shared = min(len(parent.block_table), self.blocks_for_tokens(child.num_tokens))
        child.block_table = parent.block_table[:num_shared]
        for block_id in child.block_table:
            if block_id != FREED:
                self._blocks[block_id].ref_count += 1
        child.block_hashes = parent.block_hashes[: child.num_tokens // self.block_size]
        child.num_registered_blocks = min(
            parent.num_registered_blocks, child.num_computed_tokens // self.block_size, num_shared
        )
