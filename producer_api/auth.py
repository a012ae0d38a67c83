"""API keys: only their SHA-256 hashes are kept; a request's `Authorization: Bearer <key>`
names an owner, and an owner sees only its own jobs.

    python -m producer_api.auth MY-SECRET-KEY     # prints sha256:... for INFERQ_API_KEYS
"""

from __future__ import annotations

import hashlib
import hmac
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def hash_api_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def is_key_hash(value: str) -> bool:
    return bool(_HASH_RE.match(value))


@dataclass(frozen=True)
class Principal:
    """Who is calling: `owner` is None only when authentication is disabled."""

    owner: str | None


ANONYMOUS = Principal(owner=None)


@dataclass(frozen=True)
class KeyTable:
    """Key hash -> owner."""

    owners_by_hash: Mapping[str, str]

    @classmethod
    def from_hashes(cls, hashes_by_owner: Mapping[str, str]) -> KeyTable:
        return cls({digest: owner for owner, digest in hashes_by_owner.items()})

    def owner_of(self, key: str) -> str | None:
        """The owner of `key`, or None. Every stored hash is compared in constant time, so the
        answer time does not tell how close a guess was."""
        digest = hash_api_key(key)
        found = None
        for stored, owner in self.owners_by_hash.items():
            if hmac.compare_digest(stored, digest):
                found = owner
        return found


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer <key>` header value (None if absent or malformed)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


class Unauthenticated(Exception):
    """No key, or a key nobody owns, while authentication is on (the message says which)."""


def authenticate(key_table: KeyTable, key: str | None, *, auth_disabled: bool) -> Principal:
    """The caller a request's API key names, for every interface (HTTP, gRPC). Without
    authentication any key is anonymous: SDKs always send some key."""
    if key:
        owner = key_table.owner_of(key)
        if owner is not None:
            return Principal(owner)
        if auth_disabled:
            return ANONYMOUS
        raise Unauthenticated("Incorrect API key provided")
    if auth_disabled:
        return ANONYMOUS
    raise Unauthenticated("Missing API key: send `Authorization: Bearer <key>`")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m producer_api.auth KEY", file=sys.stderr)
        return 2
    print(hash_api_key(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
