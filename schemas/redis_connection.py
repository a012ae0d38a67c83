"""Where every inferq process finds its Redis, declared once: a plain URL, or a set of Sentinels
that name the current master (high availability), and how many replicas must have a write that
would lose a job if it were lost (enqueue, a result before its ack).

The settings classes of the API, the worker, the batch controller and the CLI inherit these
fields, so `INFERQ_REDIS_SENTINELS`, `--redis-sentinels` and friends mean the same everywhere.
Clients are built from them by `redis_io.clients` (this package knows no Redis client)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, Field, field_validator, model_validator

from schemas.defaults import DEFAULT_REDIS_URL, REDIS_URL_HELP
from schemas.keys import RedisKeys

DEFAULT_MASTER_NAME = "inferq"
DEFAULT_WAIT_TIMEOUT_MS = 1000
# Partition streams per model queue in cluster mode unless set: enough to spread a model's
# queue over the shards of a small cluster (each worker reads every partition).
DEFAULT_CLUSTER_PARTITIONS = 6


@dataclass(frozen=True)
class ReplicaWait:
    """`WAIT replicas timeout_ms` after a write that must survive a failover."""

    replicas: int
    timeout_ms: int


@dataclass(frozen=True)
class MasterLogin:
    """What a connection to the master needs besides its address (from `redis_url`)."""

    db: int = 0
    username: str | None = None
    password: str | None = None


def parse_sentinels(text: str) -> list[tuple[str, int]]:
    """`"host:port,host:port"` -> [(host, port), ...]; `[::1]:26379` for IPv6 hosts. Raises
    ValueError naming the item that is not `host:port`."""
    addresses = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{item!r} is not host:port")
        addresses.append((host, int(port)))
    if not addresses:
        raise ValueError("no host:port given")
    return addresses


class RedisConnectionSettings(BaseModel):
    """Where Redis answers: `redis_url`, or with `redis_sentinels` set, the master the Sentinels
    name (`redis_url` then gives only the database number and the password); and how many
    replicas must acknowledge a job or a result before it counts as accepted or stored."""

    redis_url: str = Field(DEFAULT_REDIS_URL, description=REDIS_URL_HELP)
    redis_sentinels: str | None = Field(
        None,
        description="'host:port,host:port,...' of Redis Sentinels: connect to the master they "
        "name and follow its failovers (unset: redis_url's server)",
    )
    redis_master_name: str = Field(
        DEFAULT_MASTER_NAME, min_length=1, description="the master's name in the Sentinels"
    )
    redis_cluster: bool = Field(
        False,
        description="Redis Cluster: redis_url names any one node (the client finds the rest "
        "and follows MOVED and failovers); job keys carry hash tags, job channels use sharded "
        "pub/sub",
    )
    redis_queue_partitions: int | None = Field(
        None,
        ge=1,
        description="streams each model's queue is split into (enqueue picks one by job id; "
        "workers read all); must be the same for the API and the workers; with redis_cluster "
        "best a multiple of the number of primaries (each partition then lies on one shard with "
        f"its jobs' keys). Unset: 1 on a single node or Sentinel, {DEFAULT_CLUSTER_PARTITIONS} "
        "with redis_cluster",
    )
    redis_batch_queue_url: str | None = Field(
        None,
        description="a plain Redis (URL) for the batch controller's own scheduling queue (arq); "
        "unset: redis_url's server. Needed with redis_cluster, whose shards refuse arq's "
        "multi-key transactions (the batches and their jobs stay on the cluster)",
    )
    redis_wait_replicas: int = Field(
        0,
        ge=0,
        description="replicas that must have an enqueued job, and a result before its ack "
        "(WAIT); 0: no wait (a failover may lose the last writes)",
    )
    redis_wait_timeout_ms: int = Field(
        DEFAULT_WAIT_TIMEOUT_MS,
        ge=1,
        description="longest WAIT for those replicas; past it the write is answered and logged "
        "as not replicated",
    )

    @model_validator(mode="after")
    def _one_topology(self) -> RedisConnectionSettings:
        if self.redis_cluster and self.redis_sentinels is not None:
            raise ValueError("redis_cluster: a cluster has no Sentinels; set one or the other")
        if self.redis_cluster and self.redis_wait_replicas:
            # WAIT answers for the one node it runs on, and a job's writes span several
            raise ValueError("redis_wait_replicas: not supported with redis_cluster yet (set 0)")
        return self

    @field_validator("redis_sentinels")
    @classmethod
    def _valid_sentinels(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        parse_sentinels(value)
        return value

    @model_validator(mode="after")
    def _valid_url(self) -> RedisConnectionSettings:
        scheme = urlsplit(self.redis_url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"redis_url: scheme {scheme!r} is not redis://, rediss:// or unix://")
        return self

    def queue_partitions(self) -> int:
        """How many partition streams each model's queue has."""
        if self.redis_queue_partitions is not None:
            return self.redis_queue_partitions
        return DEFAULT_CLUSTER_PARTITIONS if self.redis_cluster else 1

    def redis_keys(self, prefix: str) -> RedisKeys:
        """The Redis names under `prefix` for this deployment (cluster tags, partitions)."""
        return RedisKeys(prefix, cluster=self.redis_cluster, partitions=self.queue_partitions())

    @property
    def uses_sentinel(self) -> bool:
        return self.redis_sentinels is not None

    def sentinel_addresses(self) -> list[tuple[str, int]]:
        return parse_sentinels(self.redis_sentinels) if self.redis_sentinels else []

    def master_login(self) -> MasterLogin:
        """Database, user and password of `redis_url`, for the master the Sentinels name."""
        parts = urlsplit(self.redis_url)
        db_text = parts.path.lstrip("/")
        return MasterLogin(
            db=int(db_text) if db_text.isdigit() else 0,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
        )

    def replica_wait(self) -> ReplicaWait | None:
        """The WAIT after durable writes, or None when no replica is waited for."""
        if self.redis_wait_replicas <= 0:
            return None
        return ReplicaWait(self.redis_wait_replicas, self.redis_wait_timeout_ms)

    def describe(self) -> str:
        """Where Redis is, for logs and messages (never the password)."""
        if self.redis_cluster:
            return (
                f"cluster via {urlsplit(self.redis_url).hostname}:{urlsplit(self.redis_url).port}"
            )
        if self.redis_sentinels:
            return f"sentinels {self.redis_sentinels} master {self.redis_master_name!r}"
        parts = urlsplit(self.redis_url)
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        return f"{parts.scheme}://{netloc}{parts.path}"
