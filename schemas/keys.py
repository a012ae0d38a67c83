"""Every Redis name inferq uses, built in one place from a configurable prefix.

Layout (prefix `p`, default "inferq"; one Redis instance or Sentinel master)
=============================================================================

Redis Cluster (`RedisKeys(cluster=True)`) changes only how some names are spelled: a job's
keys and channel carry its id as a hash tag (`{p}:job:{<id>}`, `{p}:out:{<id>}`,
`{p}:chan:{<id>}`, a sharded pub/sub channel), a batch's keys its id (`{p}:batch:{<id>}...`),
and partition k of a model's queue `{p}:jobs:{<model>:<k>:<n>}` / `{p}:bulk:{<model>:<k>:<n>}`
(n: the first number that puts the name's slot in partition k's slot range, see
schemas.cluster_slots; there a job is queued on the partition whose range holds its slot).
With `partitions` > 1 on a single node, partition k >= 1 is `{p}:jobs:{model}:<k>`; partition
0 is always the name below. A job's partition is `RedisKeys.job_partition(job id)`.

    key / channel                     type              written by          read by
    {p}:jobs:{model}                  stream, group     enqueue (XADD)      workers (XREADGROUP)
                                      "workers"
    {p}:job:{id}                      hash              enqueue, workers,   everyone
                                                        cancel
    {p}:out:{id}                      stream (replay)   the running worker  stream readers
    {p}:chan:{id}                     pub/sub channel   worker, cancel,     live listeners
                                                        whoever ends a job
    {p}:dead:{model}                  stream            workers             operators, API
    {p}:worker:{name}                 hash, TTL         that worker         API (health)
    {p}:first-step:{name}             set, TTL          that worker         workers taking over
                                                                            its jobs
    {p}:control                       pub/sub channel   cancel, LoRA        workers
                                                        load/unload
    {p}:lora:{model}                  hash              LoRA load/unload    workers
    {p}:lora-offers:{model}           sorted set, TTL   workers (an entry   workers holding
                                                        held for another)   the adapter
    {p}:arrivals:{model}              pub/sub channel   enqueue, hand-back  workers
    {p}:idem:{owner}:{key}            string, TTL       enqueue             enqueue
    {p}:workers-of:{model}            sorted set, TTL   workers (heartbeat, workers of the model
                                                        on a cluster)       (shard homes)
    {p}:ttft:{model}                  sorted set, TTL   workers (heartbeat) status, dashboard
    {p}:tokens:{model}                sorted set, TTL   workers (heartbeat) status, dashboard
    {p}:bulk:{model}                  stream, group     enqueue (priority   workers, after the
                                      "workers"         >= PRIORITY_BULK)   jobs stream
    {p}:file:{id}                     hash, TTL         Files API, batch    Files API, batch
                                                        controller          controller
    {p}:file-parts:{id}               list, TTL         batch controller    Files API, batch
                                                        (output files)      controller
    {p}:files:{owner}                 sorted set        Files API           Files API (list)
    {p}:batch:{id}                    hash, TTL         Batch API,          Batch API, CLI
                                                        controller
    {p}:batch:{id}:lines              hash, TTL         controller          controller
    {p}:batch:{id}:out / :err         hash, TTL         controller          controller
    {p}:batch:{id}:lease              string, PX TTL    controller          controller
    {p}:batch:{id}:ended              list, TTL         workers             controller
    {p}:batches:{owner}               sorted set        Batch API           Batch API (list)
    {p}:batches:active                set               Batch API,          controller
                                                        controller          (reconciler)

Variable parts (model, worker name, owner, idempotency key) are percent-encoded (RFC 3986:
only A-Z a-z 0-9 - . _ ~ stay as they are), so a model named "org/My Model:v2" gives
`inferq:jobs:org%2FMy%20Model%3Av2`: no ":" or glob character can leak into a key, and
`decode_segment` gives the name back. Job ids are URL-safe already, so they appear unchanged.

Jobs stream `{p}:jobs:{model}`: one entry per job, fields `{"job": <job id>}` only; the job's
request and status live in the hash, which is the single source of truth. The consumer group is
`WORKER_GROUP` ("workers"), created by workers with `XGROUP CREATE {stream} workers 0 MKSTREAM`
(id 0, so jobs enqueued before the first worker started are served; ignore BUSYGROUP). A worker
that is done with an entry (result stored, or job found cancelled/expired/dead-lettered) sends
`XACK` then `XDEL` for it, so `XLEN` is the backlog (queued + in flight) that the enqueue
queue-limit compares with. `tests/api/fake_worker.py` is a minimal worker following
this contract.

Job hash `{p}:job:{id}`: fields in `schemas.jobs.JobField`, string forms in
`schemas.jobs.encode_hash_value`; no TTL while queued or running, `RESULT_TTL_S` once terminal.

The Lua scripts that change these keys atomically (status compare-and-set, enqueue, chunk
writes, hand-back, batch status, batch lease) are in `schemas.redis_scripts`.

Replay stream `{p}:out:{id}` and channel `{p}:chan:{id}`: see `schemas.chunks` and
`schemas.events`. Replay stream capped with `MAXLEN ~ OUT_STREAM_MAXLEN`, TTL `OUT_STREAM_TTL_S`.

Dead letters `{p}:dead:{model}`: `XADD ... MAXLEN ~ DEAD_LETTER_MAXLEN *` with fields
`job` (job id, "" if unknown), `reason` (an ErrorCode value), `message` (human text), `entry`
(the original jobs-stream entry as JSON object), `worker` (name), `at` (ISO 8601 UTC),
`attempts` (decimal). The job, when it exists, is also moved to `failed` with that error.

Worker heartbeat `{p}:worker:{name}`: see `schemas.workers.WorkerInfo`; refreshed every
HEARTBEAT_INTERVAL_S with TTL HEARTBEAT_TTL_S, so a dead worker's hash disappears.

First-step marker `{p}:first-step:{name}`: the ids of the jobs whose first engine step of
their current start is running in that worker now. The worker adds them (SADD, EXPIRE
`FIRST_STEP_TTL_S`) and sends that before the step, and deletes the key with the round trip
after it, so the set costs two writes per admission turn and none per token. Whoever takes
over a dead worker's job reads it (SISMEMBER) to tell whether the job was in the step that the
worker died in (see worker.crashes).

Control channel `{p}:control`: `schemas.events.ControlMessage` JSON (cancel broadcasts).

Arrivals channel `{p}:arrivals:{model}`: the new entry's id, published in the same script as
each XADD of a job entry to the model's jobs or bulk stream (enqueue, hand-back). A busy worker
reads its streams between two steps only when something arrived, instead of at every step; it
still reads now and then without a notice, so an entry added by a producer that does not
publish waits a little longer but is never stranded.

LoRA offers `{p}:lora-offers:{model}` (one per queue partition, in the partition's hash slot):
entries a worker read for a LoRA adapter it does not hold, left for a live worker of the model
that holds it resident (see worker.lora_affinity); member `adapter NUL stream NUL entry id NUL
offering worker`, scored by the unix time (Redis TIME) after which the offerer runs it itself.

Bulk stream `{p}:bulk:{model}`: the same entries and group as the jobs stream, for jobs whose
priority is PRIORITY_BULK or more (`RedisKeys.queue_stream` picks). Workers read it only with the
admission capacity the jobs stream left over, so a bulk backlog never delays interactive jobs;
enqueue, cancel, the janitor and dead letters treat it like the jobs stream of the same model.

Files `{p}:file:{id}`: fields id, filename, purpose, bytes, created_at (unix s), owner, content
(the raw bytes; absent for a file written in parts: its content is the list
`{p}:file-parts:{id}`, in order, so no one value holds a large batch output).
`{p}:files:{owner}` scores file ids by created_at for listing.

Batches `{p}:batch:{id}`: the fields of `schemas.batches.BatchField`. Controller bookkeeping:
`:lines` maps input line number -> job id (set as each line is enqueued); `:out` and `:err` map
line number -> the output / error file line (JSON) once the line's job ended, so re-running the
controller never writes a line twice; `:lease` (SET NX PX) is held by the one controller run
advancing the batch; `:ended` lists the ids of the batch's jobs a worker ended (pushed after the
job's final status), so the controller reads those jobs instead of polling every unfinished one.
`{p}:batches:{owner}` scores batch ids by created_at; `{p}:batches:active`
holds batches not yet in a terminal status (what a restarted controller resumes).

Live-stats samples `{p}:ttft:{model}` and `{p}:tokens:{model}`: sorted sets scored by unix
time, written by workers in their heartbeat pipeline (finished jobs' TTFTs; each worker's
cumulative token counts per beat), trimmed to the last `schemas.workers.LIVE_STATS_WINDOW_S`,
read by `inferq status` and the API's dashboard to compute tokens/s and TTFT percentiles. Member
formats: `schemas.workers.TtftSample` and `TokenSample`.

Idempotency `{p}:idem:{owner}:{key}` -> job id, set together with the job (atomically, see
the API's enqueue script) with TTL IDEMPOTENCY_TTL_S; the owner part is "" for anonymous.
"""

from __future__ import annotations

import re
import zlib
from urllib.parse import quote, unquote

from schemas.cluster_slots import hash_slot, partition_of_slot, tag_in_partition
from schemas.jobs import PRIORITY_BULK, as_text

DEFAULT_PREFIX = "inferq"
WORKER_GROUP = "workers"

OUT_STREAM_MAXLEN = 100_000  # chunks kept per job for replay (approximate trim)
OUT_STREAM_TTL_S = 24 * 3600
RESULT_TTL_S = 24 * 3600  # job hash lifetime after it reached a terminal status
LORA_UNLOADED = ""  # a run-time LoRA registry value: the adapter was unloaded
IDEMPOTENCY_TTL_S = 24 * 3600
DEAD_LETTER_MAXLEN = 100_000
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TTL_S = 10
# how long a dead worker's first-step marker stays readable for whoever takes its jobs over
FIRST_STEP_TTL_S = 24 * 3600
JOB_ENTRY_FIELD = "job"  # the one field of a jobs-stream entry
# Worker policy defaults (a worker's config may override them):
# starts held against a job (its worker died during the job's first step in them, see
# worker.crashes) before it is dead-lettered with max_attempts_exceeded
DEFAULT_MAX_ATTEMPTS = 3
# starts cut off by worker deaths the job is not charged with, before it is dead-lettered all
# the same: the bound that keeps a job from cycling forever
DEFAULT_MAX_CRASH_RESUMES = 20
DEFAULT_CLAIM_MIN_IDLE_MS = 30_000  # XAUTOCLAIM min-idle: a job's lease if not renewed

_PREFIX_RE = re.compile(r"^[A-Za-z0-9._~-]+(:[A-Za-z0-9._~-]+)*$")


_UNRESERVED_RE = re.compile(r"[A-Za-z0-9._~-]*")


def encode_segment(name: str) -> str:
    """Percent-encode a variable key part (everything but RFC 3986 unreserved characters)."""
    if _UNRESERVED_RE.fullmatch(name):
        return name  # job ids and most names: a worker builds two keys per chunk
    return quote(name, safe="")


def decode_segment(segment: str) -> str:
    return unquote(segment)


class RedisKeys:
    """Key and channel names under one prefix. Cheap to build; build one per app and pass it.

    `cluster`: names for Redis Cluster, where a multi-key command or script must stay in one
    hash slot: a job's own keys carry its id as a hash tag (`{p}:job:{<id>}`, `{p}:out:{<id>}`,
    `{p}:chan:{<id>}`, so its status script and chunk writes touch one slot), a batch's keys its
    id, and partition k of a model's jobs and bulk streams share the tag `{<model>:<k>:<n>}`
    (the worker reads both in one script), whose slot lies in partition k's slot range.
    `partitions`: how many streams a model's queue (and its bulk queue) is split into; a job's
    partition follows from its id (`job_partition`); on a cluster, best a multiple of the
    number of primaries (schemas.cluster_slots: then a job and its partition share a shard).
    Without `cluster` and with one partition every name is exactly the single-node one."""

    group = WORKER_GROUP

    def __init__(
        self, prefix: str = DEFAULT_PREFIX, *, cluster: bool = False, partitions: int = 1
    ) -> None:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(
                f"prefix {prefix!r} must be non-empty words of A-Z a-z 0-9 - . _ ~ joined by ':'"
            )
        if partitions < 1:
            raise ValueError(f"partitions must be at least 1, not {partitions}")
        self.prefix = prefix
        self.cluster = cluster
        self.partitions = partitions

    def __repr__(self) -> str:
        return f"RedisKeys({self.prefix!r}, cluster={self.cluster}, partitions={self.partitions})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, RedisKeys)
            and other.prefix == self.prefix
            and other.cluster == self.cluster
            and other.partitions == self.partitions
        )

    def __hash__(self) -> int:
        return hash((self.prefix, self.cluster, self.partitions))

    def _tagged(self, part: str) -> str:
        """`part` as a Redis Cluster hash tag (`{part}`) in cluster mode, else as it is."""
        return f"{{{part}}}" if self.cluster else part

    # queue
    def job_partition(self, job_id: str) -> int:
        """Which of the model's partition streams a job is queued on (0 with one partition):
        a hash of its random id, so jobs spread evenly and anyone holding the id finds it. On a
        cluster, the partition whose slot range holds the job's own slot (see
        schemas.cluster_slots: the job's keys and its partition then share a shard)."""
        if self.partitions == 1:
            return 0
        if self.cluster:
            return partition_of_slot(hash_slot(self.job(job_id)), self.partitions)
        return zlib.crc32(job_id.encode()) % self.partitions

    def _queue_name(self, kind: str, model: str, partition: int) -> str:
        model_part = encode_segment(model)
        if self.cluster:
            tag = tag_in_partition(model_part, partition, self.partitions)
            return f"{self.prefix}:{kind}:{{{tag}}}"
        suffix = f":{partition}" if partition else ""
        return f"{self.prefix}:{kind}:{model_part}{suffix}"

    def jobs_stream(self, model: str, partition: int = 0) -> str:
        """Partition `partition` of the model's jobs stream (the only one by default)."""
        return self._queue_name("jobs", model, partition)

    def jobs_streams(self, model: str) -> list[str]:
        """Every partition of the model's jobs stream."""
        return [self.jobs_stream(model, k) for k in range(self.partitions)]

    def bulk_streams(self, model: str) -> list[str]:
        """Every partition of the model's bulk stream."""
        return [self.bulk_stream(model, k) for k in range(self.partitions)]

    def queue_stream_patterns(self) -> dict[str, str]:
        """SCAN patterns of every model's jobs ("jobs") and bulk ("bulk") streams, partitions
        included (`model_of_jobs_stream` names the model of each)."""
        return {"jobs": f"{self.prefix}:jobs:*", "bulk": f"{self.prefix}:bulk:*"}

    def jobs_stream_pattern(self) -> str:
        """SCAN pattern matching every model's jobs stream."""
        return f"{self.prefix}:jobs:*"

    def model_of_jobs_stream(self, key: str | bytes) -> str:
        """The model name of a key returned by `jobs_stream` or `bulk_stream` (inverse)."""
        text = as_text(key)
        for head in (f"{self.prefix}:jobs:", f"{self.prefix}:bulk:"):
            if text.startswith(head):
                # an encoded model holds no ':' or '{', so what follows it is the partition
                model_part = text[len(head) :].strip("{}").split(":", 1)[0]
                return decode_segment(model_part)
        raise ValueError(f"{text!r} is not a jobs stream of prefix {self.prefix!r}")

    def dead_letters(self, model: str) -> str:
        return f"{self.prefix}:dead:{encode_segment(model)}"

    # one job
    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{self._tagged(encode_segment(job_id))}"

    def job_key_prefix(self) -> str:
        """`job(id) == job_key_prefix() + id` for every valid job id (used inside Lua; single
        node only: cluster mode does not look keys up by a built name)."""
        return f"{self.prefix}:job:"

    def out_stream(self, job_id: str) -> str:
        return f"{self.prefix}:out:{self._tagged(encode_segment(job_id))}"

    def channel(self, job_id: str) -> str:
        return f"{self.prefix}:chan:{self._tagged(encode_segment(job_id))}"

    def idempotency(self, key: str, owner: str | None = None) -> str:
        return f"{self.prefix}:idem:{encode_segment(owner or '')}:{encode_segment(key)}"

    # workers
    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{encode_segment(name)}"

    def first_step(self, name: str) -> str:
        """Set of the job ids whose first engine step in this start that worker runs now."""
        return f"{self.prefix}:first-step:{encode_segment(name)}"

    def model_workers(self, model: str) -> str:
        """Sorted set: the names of the model's live workers, scored by their last heartbeat
        (unix s); on a cluster, where they split the shards between them (worker.shard_homes)."""
        return f"{self.prefix}:workers-of:{encode_segment(model)}"

    def workers_pattern(self) -> str:
        """SCAN pattern matching every live worker's heartbeat hash."""
        return f"{self.prefix}:worker:*"

    def control_channel(self) -> str:
        return f"{self.prefix}:control"

    def lora_registry(self, model: str) -> str:
        """Hash adapter name -> folder of the LoRA adapters loaded at run time on `model`
        (an unloaded one keeps its name with the LORA_UNLOADED value, so it also leaves the
        workers that were started with it in `lora_modules`)."""
        return f"{self.prefix}:lora:{encode_segment(model)}"

    def lora_offers(self, model: str, partition: int = 0) -> str:
        """Sorted set of the entries of partition `partition` of `model`'s jobs and bulk streams
        held for a worker that holds their LoRA adapter (in the partition's hash slot)."""
        return self._queue_name("lora-offers", model, partition)

    def arrivals_channel(self, model: str) -> str:
        return f"{self.prefix}:arrivals:{encode_segment(model)}"

    # bulk work: priority streams, files and batches
    def bulk_stream(self, model: str, partition: int = 0) -> str:
        return self._queue_name("bulk", model, partition)

    def queue_stream(self, model: str, priority: int, job_id: str = "") -> str:
        """The stream a job of `priority` is queued on: bulk work has its own stream; with
        partitions, the job's partition of it (`job_id` names the job)."""
        partition = self.job_partition(job_id) if job_id else 0
        if priority >= PRIORITY_BULK:
            return self.bulk_stream(model, partition)
        return self.jobs_stream(model, partition)

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{encode_segment(file_id)}"

    def file_parts(self, file_id: str) -> str:
        """A list: the content of a file written in parts (a batch's output), in order."""
        return f"{self.prefix}:file-parts:{encode_segment(file_id)}"

    def files_of(self, owner: str | None) -> str:
        return f"{self.prefix}:files:{encode_segment(owner or '')}"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{self._tagged(encode_segment(batch_id))}"

    def batch_lines(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:lines"

    def batch_outputs(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:out"

    def batch_errors(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:err"

    def batch_lease(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:lease"

    def batch_ended(self, batch_id: str) -> str:
        return f"{self.batch(batch_id)}:ended"

    def batches_of(self, owner: str | None) -> str:
        return f"{self.prefix}:batches:{encode_segment(owner or '')}"

    def active_batches(self) -> str:
        return f"{self.prefix}:batches:active"

    def arq_queue(self) -> str:
        """The arq queue the batch controller serves."""
        return f"{self.prefix}:arq:batches"

    # live stats (recent samples, see schemas.workers)
    def ttft_samples(self, model: str) -> str:
        """Sorted set of finished jobs' TTFTs, scored by finish time."""
        return f"{self.prefix}:ttft:{encode_segment(model)}"

    def token_samples(self, model: str) -> str:
        """Sorted set of workers' cumulative token counts per heartbeat, scored by time."""
        return f"{self.prefix}:tokens:{encode_segment(model)}"
