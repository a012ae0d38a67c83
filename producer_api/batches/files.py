"""Files in Redis: batch inputs uploaded by clients and the output / error files batches write.

Redis rather than a disk: the API and the controller may run on different machines that share
nothing but Redis, and a file lives exactly as long as its batch needs it (TTL). That is also
why sizes are capped (ApiSettings.max_file_bytes, max_batch_lines): every byte sits in Redis
memory, so a file is bounded like any other queued work."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

from redis.asyncio import Redis

from producer_api.batches.lines import ParsedLine, iter_lines
from redis_io.clients import pipeline
from schemas import FileObject, RedisKeys
from schemas.batches import is_valid_file_id, new_file_id

BATCH_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"
_META_FIELDS = ("id", "filename", "purpose", "bytes", "created_at", "owner")


_LIST_PAGE = 100  # metadata reads per round trip when listing


def _file_object(meta: dict) -> FileObject:
    return FileObject(
        id=meta["id"],
        bytes=int(meta["bytes"]),
        created_at=int(meta["created_at"]),
        filename=meta["filename"],
        purpose=meta["purpose"],
    )


class UploadError(ValueError):
    """Why an upload was refused (the API answers 400 with this message)."""


@dataclass
class StoredFile:
    info: FileObject
    owner: str | None


class FileStore:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self.redis = redis
        self.keys = keys

    async def save(
        self,
        *,
        owner: str | None,
        filename: str,
        purpose: str,
        content: str | bytes,
        created_at: int,
        ttl_s: int,
        file_id: str | None = None,
    ) -> FileObject:
        """Store a file (overwriting `file_id` when given: writing the same output twice is
        harmless) and list it under its owner. `content` as bytes (UTF-8) is stored as it is,
        without another copy of a large upload."""
        file_id = file_id or new_file_id()
        size = len(content) if isinstance(content, bytes) else len(content.encode())
        key = self.keys.file(file_id)
        async with pipeline(self.redis, atomic=True) as pipe:
            pipe.hset(
                key,
                mapping={
                    "id": file_id,
                    "filename": filename,
                    "purpose": purpose,
                    "bytes": size,
                    "created_at": created_at,
                    "owner": owner or "",
                    "content": content,
                },
            )
            pipe.expire(key, ttl_s)
            pipe.zadd(self.keys.files_of(owner), {file_id: created_at})
            await pipe.execute()
        return FileObject(
            id=file_id, bytes=size, created_at=created_at, filename=filename, purpose=purpose
        )

    async def get(self, file_id: str) -> StoredFile | None:
        if not is_valid_file_id(file_id):
            return None
        values = await self.redis.hmget(self.keys.file(file_id), _META_FIELDS)
        meta = dict(zip(_META_FIELDS, values, strict=True))
        if meta["id"] is None:
            return None
        return StoredFile(_file_object(meta), meta["owner"] or None)

    async def list(
        self,
        owner: str | None,
        *,
        limit: int,
        purpose: str | None = None,
        after: str | None = None,
        newest_first: bool = True,
    ) -> tuple[list[FileObject], bool]:
        """The owner's live files in created_at order; `after`: the last id of the previous
        page. Ids whose file expired are dropped from the listing index on the way."""
        key = self.keys.files_of(owner)
        ids = await (self.redis.zrevrange if newest_first else self.redis.zrange)(key, 0, -1)
        if after is not None:
            ids = ids[ids.index(after) + 1 :] if after in ids else []
        found: list[FileObject] = []
        expired: list[str] = []
        for start in range(0, len(ids), _LIST_PAGE):
            page = ids[start : start + _LIST_PAGE]
            async with self.redis.pipeline(transaction=False) as pipe:
                for file_id in page:
                    pipe.hmget(self.keys.file(file_id), _META_FIELDS)
                rows = await pipe.execute()
            for file_id, values in zip(page, rows, strict=True):
                meta = dict(zip(_META_FIELDS, values, strict=True))
                if meta["id"] is None:
                    expired.append(file_id)
                elif purpose is None or meta["purpose"] == purpose:
                    found.append(_file_object(meta))
            if len(found) > limit:
                break
        if expired:
            await self.redis.zrem(key, *expired)
        return found[:limit], len(found) > limit

    async def save_parts(
        self,
        *,
        owner: str | None,
        filename: str,
        purpose: str,
        parts: AsyncIterable[bytes],
        created_at: int,
        ttl_s: int,
        file_id: str,
    ) -> FileObject:
        """Store a file given in parts (UTF-8), each pushed as it comes, so the writer never
        holds the whole file and no one Redis value holds it either. Writing it again replaces
        it: the parts start over, and the file's record comes last."""
        parts_key = self.keys.file_parts(file_id)
        await self.redis.delete(parts_key)
        size = 0
        async for part in parts:
            size += len(part)
            await self.redis.rpush(parts_key, part)
        await self.redis.expire(parts_key, ttl_s)
        key = self.keys.file(file_id)
        meta = {
            "id": file_id,
            "filename": filename,
            "purpose": purpose,
            "bytes": size,
            "created_at": created_at,
            "owner": owner or "",
        }
        async with pipeline(self.redis, atomic=True) as pipe:
            pipe.hset(key, mapping=meta)
            pipe.hdel(key, "content")  # an earlier save of the same id, in one piece
            pipe.expire(key, ttl_s)
            pipe.zadd(self.keys.files_of(owner), {file_id: created_at})
            await pipe.execute()
        return FileObject(
            id=file_id, bytes=size, created_at=created_at, filename=filename, purpose=purpose
        )

    async def delete(self, file_id: str, owner: str | None) -> bool:
        """Remove a file and its listing entry; False when there was none."""
        async with pipeline(self.redis, atomic=True) as pipe:
            pipe.delete(self.keys.file(file_id))
            pipe.delete(self.keys.file_parts(file_id))
            pipe.zrem(self.keys.files_of(owner), file_id)
            deleted, _, _ = await pipe.execute()
        return bool(deleted)

    async def content(self, file_id: str) -> str | None:
        """The whole file as text (None when there is none)."""
        pieces = [piece async for piece in self.content_parts(file_id)]
        return None if not pieces else "".join(pieces)

    async def content_parts(self, file_id: str) -> AsyncIterator[str]:
        """The file's text a part at a time (one part for a file saved whole); nothing when
        there is no such file."""
        if not is_valid_file_id(file_id):
            return
        whole = await self.redis.hget(self.keys.file(file_id), "content")
        if whole is not None:
            yield whole
            return
        parts_key = self.keys.file_parts(file_id)
        for index in range(await self.redis.llen(parts_key)):
            part = await self.redis.lindex(parts_key, index)
            if part is not None:
                yield part


@dataclass
class UploadSummary:
    """What validating an upload found: its request lines, the invalid ones, the first."""

    lines: int = 0
    invalid: int = 0
    first_invalid: ParsedLine | None = None


def validate_upload(
    raw: bytes, *, max_bytes: int, max_lines: int, default_max_tokens: int
) -> UploadSummary:
    """What the lines of an uploaded batch input file hold. Refuses (UploadError)
    files that are too big, not UTF-8, empty, too long, or without a single valid line; single
    bad lines are kept: the batch writes them to its error file. Lines are parsed one at a
    time and not kept, so validating holds the file's text, not every parsed request."""
    if len(raw) > max_bytes:
        raise UploadError(f"file: {len(raw)} bytes is more than the limit of {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UploadError(f"file: not UTF-8 text ({exc})") from exc
    summary = UploadSummary()
    first: ParsedLine | None = None
    raw_lines = text.splitlines()
    del text  # the lines hold it (their copy is the one parsed)
    for line in iter_lines(raw_lines, None, default_max_tokens):
        summary.lines += 1
        first = first or line
        if summary.lines > max_lines:
            raise UploadError(f"file: more than the limit of {max_lines} request lines")
        if not line.ok:
            summary.invalid += 1
            summary.first_invalid = summary.first_invalid or line
    if first is None:
        raise UploadError("file: holds no request lines")
    if summary.invalid == summary.lines:
        reason = first.error.message if first.error is not None else "invalid"
        raise UploadError(f"file: no valid request line (line {first.number}: {reason})")
    return summary
