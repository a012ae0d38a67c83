"""The scheduler's waiting sequences: by priority level (lower first), in arrival order within a
level, preempted sequences back at the front of theirs; and `after_siblings`, which keeps the
sequences of one request (its choices) together in the waiting and the running order.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator
from collections.abc import Sequence as Sequence_

from engine.sequence import Sequence


def after_siblings(seqs: Sequence_[Sequence], index: int) -> int:
    """The index just past seqs[index] and the same request's sequences right after it."""
    request_id = seqs[index].request_id
    index += 1
    while index < len(seqs) and seqs[index].request_id == request_id:
        index += 1
    return index


class WaitingQueue:
    """Waiting sequences by priority level (lower first); arrival order within a level.

    Preempted sequences go back to the front of their level. Levels are kept non-empty.
    """

    def __init__(self) -> None:
        self._levels: dict[int, deque[Sequence]] = {}
        self._priorities: list[int] = []  # sorted keys of _levels

    def __len__(self) -> int:
        return sum(len(level) for level in self._levels.values())

    def __bool__(self) -> bool:
        return bool(self._priorities)

    def __iter__(self) -> Iterator[Sequence]:
        for priority in self._priorities:
            yield from self._levels[priority]

    def _level(self, priority: int) -> deque[Sequence]:
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = deque()
            bisect.insort(self._priorities, priority)
        return level

    def _drop_if_empty(self, priority: int) -> None:
        if not self._levels[priority]:
            del self._levels[priority]
            self._priorities.remove(priority)

    def push(self, seq: Sequence) -> None:
        """Insert by arrival time within the level (an append in the usual case)."""
        level = self._level(seq.priority)
        index = len(level)
        while index and level[index - 1].arrival_time > seq.arrival_time:
            index -= 1
        level.insert(index, seq)

    def push_front(self, seq: Sequence) -> None:
        self._level(seq.priority).appendleft(seq)

    def insert_after(self, anchor: Sequence, seq: Sequence) -> None:
        """Insert after anchor and the siblings (same request) already following it."""
        level = self._levels[anchor.priority]
        level.insert(after_siblings(level, level.index(anchor)), seq)

    def peek(self) -> Sequence | None:
        return self._levels[self._priorities[0]][0] if self._priorities else None

    def pop(self) -> Sequence:
        priority = self._priorities[0]
        seq = self._levels[priority].popleft()
        self._drop_if_empty(priority)
        return seq

    def remove(self, seq: Sequence) -> None:
        self._levels[seq.priority].remove(seq)
        self._drop_if_empty(seq.priority)
