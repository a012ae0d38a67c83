"""A batch's output and error files, written from the hashes the controller fills (line number
-> output or error line) a chunk of lines at a time, as parts of one file (FileStore.save_parts):
neither the controller nor one Redis value holds a whole file (an embedding batch's output runs
to kilobytes a line)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from producer_api.batches.files import OUTPUT_PURPOSE, FileStore

CHUNK_LINES = 500  # lines read from the hash, and written as one part, at a time


@dataclass
class WrittenFile:
    lines: int
    counted: int = 0  # the lines `count` was true of


async def write_lines_file(
    redis: Redis,
    files: FileStore,
    key: str,
    *,
    file_id: str,
    owner: str | None,
    filename: str,
    created_at: int,
    ttl_s: int,
    last_line: int | None,
    count: Callable[[str], bool] | None = None,
) -> WrittenFile:
    """Write the lines of the hash `key` (fields: line numbers 1 to `last_line`), in line
        order, as the file `file_id` (none when the hash is empty); `count`: the lines counted as
        they go by. Read by ranges of line numbers: no reply lists every line. `last_line` None
    (the input file is gone): found by scanning the hash."""
    written = WrittenFile(0)
    if last_line is None:
        last_line = 0
        async for number, _ in redis.hscan_iter(key):
            last_line = max(last_line, int(number))

    async def parts() -> AsyncIterator[bytes]:
        for start in range(1, last_line + 1, CHUNK_LINES):
            numbers = range(start, min(start + CHUNK_LINES, last_line + 1))
            present = [text for text in await redis.hmget(key, list(numbers)) if text is not None]
            if not present:
                continue
            written.lines += len(present)
            if count is not None:
                written.counted += sum(1 for text in present if count(text))
            yield "".join(text + "\n" for text in present).encode()

    if await redis.hlen(key):
        await files.save_parts(
            owner=owner,
            filename=filename,
            purpose=OUTPUT_PURPOSE,
            parts=parts(),
            created_at=created_at,
            ttl_s=ttl_s,
            file_id=file_id,
        )
    return written
