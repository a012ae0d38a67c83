"""The LoRA adapters a worker serves, by name: those of `lora_modules` (given at start-up) and
those loaded at run time through the API (`POST /v1/load_lora_adapter`), which the API keeps in
the base model's adapter registry (`schemas.keys.RedisKeys.lora_registry`) and announces on the
control channel, so every worker of that model, and each one started later, knows them.

Each (name, path) gets an id of its own for the worker's life: the engine keeps an adapter's
slot and prefix-cache blocks under its id, so a name re-loaded from another path must not
reuse the old id."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from redis.asyncio import Redis

from engine.lora import LoRARequest
from schemas import RedisKeys
from schemas.jobs import decode_hash
from schemas.keys import LORA_UNLOADED

logger = logging.getLogger(__name__)


def parse_lora_modules(modules: list[str]) -> dict[str, str]:
    """`["name=path", ...]` (vLLM's `--lora-modules`) -> {name: path}; ValueError naming the
    entry that is not `name=path`."""
    out: dict[str, str] = {}
    for entry in modules:
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: {entry!r} is not name=path")
        out[name.strip()] = path.strip()
    return out


class AdapterRegistry:
    """Adapter name -> LoRARequest, with a stable id per (name, path)."""

    def __init__(self, modules: Mapping[str, str]) -> None:
        self._startup = dict(modules)
        self._runtime: dict[str, str] = {}  # from the registry hash; LORA_UNLOADED: unloaded
        self._ids: dict[tuple[str, str], int] = {}

    def paths(self) -> dict[str, str]:
        """Every adapter it serves now: name -> folder."""
        merged = {**self._startup, **self._runtime}
        return {name: path for name, path in merged.items() if path != LORA_UNLOADED}

    def names(self) -> list[str]:
        return sorted(self.paths())

    def request_for(self, name: str) -> LoRARequest | None:
        """The engine's request for adapter `name`; None when this worker does not know it."""
        path = self.paths().get(name)
        if path is None:
            return None
        lora_id = self._ids.setdefault((name, path), len(self._ids) + 1)
        return LoRARequest(name, lora_id, path)

    def names_of(self, lora_ids: Iterable[int]) -> list[str]:
        """The names of the engine's adapter ids that still stand for what the name serves now
        (an id of a name since re-loaded from another path is left out)."""
        current = {
            self._ids[(name, path)]: name
            for name, path in self.paths().items()
            if (name, path) in self._ids
        }
        return [current[lora_id] for lora_id in lora_ids if lora_id in current]

    def replace_runtime(self, registry: Mapping[str, str]) -> None:
        """Take the base model's run-time registry as it stands in Redis."""
        if registry != self._runtime:
            logger.info("LoRA adapters loaded at run time: %s", dict(registry))
        self._runtime = dict(registry)

    async def refresh(self, redis: Redis, keys: RedisKeys, model: str) -> None:
        """Re-read the run-time registry of `model` (after a broadcast, and every heartbeat)."""
        registry: dict[str, str] = await redis.hgetall(keys.lora_registry(model))  # type: ignore[misc]
        self.replace_runtime(decode_hash(registry))
