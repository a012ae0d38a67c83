"""The KV cache's physical blocks: their reference counts, the LRU free queue and the index
of blocks registered in the prefix cache. engine.block_manager builds the sequences' block
tables on it (prefix hits, allocation, copy-on-write, forks); this module only counts and
hands out blocks."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is registered in the prefix cache; kept to verify hits.
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """The blocks and who references them; BlockManager (engine.block_manager) extends it with
    the sequences' block tables."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kv_window: int | None = None,
    ):
        """kv_window: where every layer attends over a sliding window, the largest window (a
        running sequence then gives back the blocks before it); None: keep every block."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if kv_window is not None and kv_window <= 0:
            raise ValueError(f"kv_window must be positive (got {kv_window})")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.kv_window = kv_window
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # Ref-count-0 blocks; allocation pops the head (least recently freed).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Prefix-cache statistics in tokens, counted when a prompt is allocated.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- sizes -------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        return len(self._blocks)

    @property
    def token_capacity(self) -> int:
        """Tokens the whole cache holds: the longest sequence that can ever run."""
        return len(self._blocks) * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, cached-but-evictable ones included."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / len(self._blocks)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    # ---- introspection (tests, metrics) ----------------------------------------------------

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def is_cached(self, block_id: int) -> bool:
        return self._blocks[block_id].hash is not None

    def cached_tokens(self, block_id: int) -> tuple[int, ...] | None:
        """The token ids a registered block was cached under, None if it is not registered."""
        return self._blocks[block_id].token_ids

    def free_block_ids(self) -> list[int]:
        """The free queue from head (evicted next) to tail; O(num free blocks)."""
        return list(self._free)

    # ---- references ------------------------------------------------------------------------

    def _take(self, block_id: int) -> None:
        """Reference a block that holds content we want (a prefix hit)."""
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        """Pop the least recently freed block for new content; its old hash is dropped."""
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        self._uncache(block)
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.hash is None:
                # Nothing reusable inside: evict it before any cached block.
                self._free.move_to_end(block_id, last=False)

    def _uncache(self, block: _Block) -> None:
        if block.hash is None:
            return
        if self._cached.get(block.hash) == block.block_id:
            del self._cached[block.hash]
        block.hash = block.parent_hash = block.token_ids = None
