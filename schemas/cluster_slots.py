"""Redis Cluster hash slots, computed as a cluster node does, and how a model's queue partitions
map onto them.

A cluster splits its 16,384 slots into contiguous ranges, one per primary (evenly, as
`redis-cli --cluster create` does, until someone reshards). Partition k of P owns the k-th of
P equal slot ranges: a job is queued on the partition whose range holds its own slot, and the
partition's streams are named so that their slot lies inside that range too. With P a multiple
of the number of primaries, a partition's range lies on one primary, so a job's own keys (its
hash, replay stream and channel) and the stream it is queued on are on the same shard, and a
worker that takes its jobs from one shard's partitions writes their chunks to that shard alone.
On any other slot map nothing breaks: some jobs' keys are just on another shard than their
partition."""

from __future__ import annotations

from binascii import crc_hqx
from functools import cache

CLUSTER_SLOTS = 16384


def hash_slot(key: str) -> int:
    """The slot of `key`: CRC16 (XMODEM) of its hash tag (the part between the first `{` and
    the next `}`, when not empty) or of the whole key, modulo 16,384."""
    data = key.encode()
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc_hqx(data, 0) % CLUSTER_SLOTS


def partition_of_slot(slot: int, partitions: int) -> int:
    """The partition whose slot range holds `slot`."""
    return slot * partitions // CLUSTER_SLOTS


@cache
def tag_in_partition(base: str, partition: int, partitions: int) -> str:
    """`base:<partition>:<n>` for the smallest n whose slot lies in the middle half of the
    partition's slot range (the middle: a slot map split a little off the even ranges still
    puts it with most of the range)."""
    width = CLUSTER_SLOTS / partitions
    low = int(partition * width + width / 4)
    high = max(low + 1, int(partition * width + 3 * width / 4))
    n = 0
    while True:
        tag = f"{base}:{partition}:{n}"
        if low <= crc_hqx(tag.encode(), 0) % CLUSTER_SLOTS < high:
            return tag
        n += 1
