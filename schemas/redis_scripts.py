"""The Lua scripts inferq runs inside Redis, as plain text: `schemas` holds no Redis client, so
each caller registers the script it needs (`redis.register_script(TEXT)`, `EVAL TEXT ...`).

Scripts are written with `$NAME` placeholders for every hash field name, status and reply tag
(`PLACEHOLDERS` fills them in from the enums the Python code uses), so each is spelled once. The
text is built once at import; only these constants are ever formatted into Lua, never user data,
which travels in KEYS and ARGV.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from functools import cache
from string import Template

from schemas.batches import BatchField
from schemas.jobs import JobField, JobStatus
from schemas.keys import JOB_ENTRY_FIELD, RedisKeys
from schemas.transitions import UNKNOWN_STATUS_SOURCE


class EnqueueOutcome(StrEnum):
    """The tag `ENQUEUE_SCRIPT` replies with, first of its pair."""

    CREATED = "created"  # with the new stream entry id
    EXISTING = "existing"  # with the job id already stored under the idempotency key
    FULL = "full"  # with the backlog that reached the limit


BATCH_STATUS_ARGS_END = "--"
"""Ends the allowed statuses in `BATCH_SET_STATUS_SCRIPT`'s ARGV; extra field/value pairs follow."""

PLACEHOLDERS: Mapping[str, str] = {
    **{f"JOB_{field.name}": field.value for field in JobField},
    **{f"STATUS_{status.name}": status.value for status in JobStatus},
    **{f"BATCH_{field.name}": field.value for field in BatchField},
    **{f"ENQUEUE_{outcome.name}": outcome.value for outcome in EnqueueOutcome},
    "ENTRY_FIELD": JOB_ENTRY_FIELD,
    "BATCH_STATUS_ARGS_END": BATCH_STATUS_ARGS_END,
    "UNKNOWN_STATUS_SOURCE": UNKNOWN_STATUS_SOURCE,
}
"""`$NAME` -> text, for every name a script may use."""


def _render(template: str, **snippets: str) -> str:
    return Template(template).substitute(PLACEHOLDERS, **snippets)


def _hset_argv_pairs(first: str) -> str:
    """Lua: HSET on KEYS[1] each field, value pair of ARGV from index `first` (a Lua expression)."""
    return (
        f"for n = {first}, #ARGV - 1, 2 do\n"
        "  redis.call('HSET', KEYS[1], ARGV[n], ARGV[n + 1])\n"
        "end"
    )


def _if_lease_holder(command: str) -> str:
    """Lua: run `command` on the lease KEYS[1] only while it holds the token ARGV[1]."""
    return f"if redis.call('GET', KEYS[1]) == ARGV[1] then return {command} end return 0"


# Compare-and-set of a job's status (see schemas.transitions, which builds KEYS and ARGV).
# KEYS[1] job hash, KEYS[2] job channel
# ARGV[1] new status
# ARGV[2] statuses the job may be in now, separated by spaces; $UNKNOWN_STATUS_SOURCE among them
#         also allows any stored status that is no JobStatus (a corrupt writer's)
# ARGV[3] TTL in seconds to set on the hash when applied (0: leave as is)
# ARGV[4] message to PUBLISH on KEYS[2] when applied ('': none)
# ARGV[5..] field, value pairs written together with the status
# returns {1, previous status} when applied, else {0, current status or '' if no such job}
TRANSITION_SCRIPT = _render(
    """
local current = redis.call('HGET', KEYS[1], '$JOB_STATUS')
if not current then return {0, ''} end
local known = ($KNOWN_STATUSES)[current] or false
local allowed = false
for s in string.gmatch(ARGV[2], '%S+') do
  if s == current or (s == '$UNKNOWN_STATUS_SOURCE' and not known) then allowed = true break end
end
if not allowed then return {0, current} end
redis.call('HSET', KEYS[1], '$JOB_STATUS', ARGV[1])
$SET_FIELDS
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], ARGV[3]) end
if ARGV[4] ~= '' then redis.call('PUBLISH', KEYS[2], ARGV[4]) end
return {1, current}
""",
    SET_FIELDS=_hset_argv_pairs("5"),
    KNOWN_STATUSES="{" + ", ".join(f"['{status.value}'] = true" for status in JobStatus) + "}",
)

# Enqueue: idempotency lookup, backlog limit, stream entry, job hash and idempotency key in one
# atomic step (the API's enqueue).
# KEYS[1] job hash, KEYS[2] jobs stream, KEYS[3] idempotency key (only when one is given)
# ARGV[1] job id, ARGV[2] backlog limit (0: none), ARGV[3] idempotency TTL seconds,
# ARGV[4] job key prefix, ARGV[5] the model's arrivals channel, ARGV[6..] job hash field, value
# pairs
# returns an EnqueueOutcome and its value: {existing, job id} | {full, backlog} |
# {created, stream entry id}
ENQUEUE_SCRIPT = _render(
    """
if #KEYS >= 3 then
  local existing = redis.call('GET', KEYS[3])
  if existing and redis.call('EXISTS', ARGV[4] .. existing) == 1 then
    return {'$ENQUEUE_EXISTING', existing}
  end
end
local limit = tonumber(ARGV[2])
if limit > 0 then
  local backlog = redis.call('XLEN', KEYS[2])
  if backlog >= limit then return {'$ENQUEUE_FULL', tostring(backlog)} end
end
local entry = redis.call('XADD', KEYS[2], '*', '$ENTRY_FIELD', ARGV[1])
$SET_FIELDS
redis.call('HSET', KEYS[1], '$JOB_ENTRY_ID', entry)
if #KEYS >= 3 then redis.call('SET', KEYS[3], ARGV[1], 'EX', ARGV[3]) end
redis.call('PUBLISH', ARGV[5], entry)
return {'$ENQUEUE_CREATED', entry}
""",
    SET_FIELDS=_hset_argv_pairs("6"),
)

# A worker's read of new jobs, interactive first: up to ARGV[3] entries of the jobs stream,
# then of the bulk stream as many as are left, at most ARGV[4]; one round trip for both.
# Never waits (a blocked read has to be the client's own XREADGROUP BLOCK).
# KEYS[1] jobs stream, KEYS[2] bulk stream
# ARGV[1] group, ARGV[2] consumer, ARGV[3] count (at least 1), ARGV[4] most bulk entries
# returns {jobs-stream entries, bulk entries}, each entry {id, {field, value, ...}}
READ_NEW_JOBS_SCRIPT = """
local function read(stream, count)
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count,
    'STREAMS', stream, '>')
  if reply then return reply[1][2] end
  return {}
end
local interactive = read(KEYS[1], ARGV[3])
local room = math.min(tonumber(ARGV[3]) - #interactive, tonumber(ARGV[4]))
local bulk = {}
if room > 0 then bulk = read(KEYS[2], room) end
return {interactive, bulk}
"""

# LoRA affinity (worker.lora_affinity): an entry read by a worker that does not hold the job's
# adapter, offered to a live worker of the model that does. Members are
# `kind|entry id|adapter (encode_segment)|offering worker`, kind `j` (the partition's jobs stream)
# or `b` (its bulk stream); scores are unix milliseconds by Redis TIME, so no worker's clock
# matters. Only an entry still pending under its offering worker changes hands: one whose
# offerer died and whose entries were claimed over by the janitor is never taken twice.
#
# LORA_OFFER: offer one entry until ARGV[2] ms from now.
# KEYS[1] offers; ARGV[1] member, ARGV[2] wait ms, ARGV[3] TTL ms of the set
# returns the deadline (unix ms)
LORA_OFFER_SCRIPT = """
local t = redis.call('TIME')
local deadline = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], deadline, ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return deadline
"""

# LORA_TAKE: claim up to ARGV[3] offers not yet past their deadline, for the adapters ARGV[5..]
# (encoded), into consumer ARGV[2]; offers past their deadline by more than ARGV[4] ms are
# dropped (their offerer runs them, or is gone).
# KEYS[1] offers, KEYS[2] jobs stream, KEYS[3] bulk stream of the partition; ARGV[1] group
# returns {jobs-stream entries, bulk entries}, each entry {id, {field, value, ...}}
LORA_TAKE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[4]))
local wanted = {}
for i = 5, #ARGV do wanted[ARGV[i]] = true end
local streams = {j = KEYS[2], b = KEYS[3]}
local taken = {j = {}, b = {}}
local count = 0
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')) do
  if count >= tonumber(ARGV[3]) then break end
  local kind, entry, adapter, owner = string.match(member, '^([jb])|([^|]+)|([^|]+)|(.*)')  -- (.*) runs to the member's end
  if not kind then
    redis.call('ZREM', KEYS[1], member)
  elseif wanted[adapter] and owner ~= ARGV[2] then
    redis.call('ZREM', KEYS[1], member)
    local pending = redis.call('XPENDING', streams[kind], ARGV[1], entry, entry, 1)
    if pending[1] and pending[1][2] == owner then
      local claimed = redis.call('XCLAIM', streams[kind], ARGV[1], ARGV[2], 0, entry)
      if claimed[1] then
        table.insert(taken[kind], claimed[1])
        count = count + 1
      end
    end
  end
end
return {taken.j, taken.b}
"""

# LORA_WITHDRAW: end an offer; after it no other worker can take the entry through it.
# KEYS[1] offers, KEYS[2] the entry's stream; ARGV[1] member, ARGV[2] group, ARGV[3] entry id,
# ARGV[4] the offering worker
# returns 1 when the entry is still pending under the offering worker (it runs it), else 0
LORA_WITHDRAW_SCRIPT = """
redis.call('ZREM', KEYS[1], ARGV[1])
local pending = redis.call('XPENDING', KEYS[2], ARGV[2], ARGV[3], ARGV[3], 1)
if pending[1] and pending[1][2] == ARGV[4] then return 1 end
return 0
"""

# Hand a job back to its queue (worker shutdown), atomic per job: retire the old entry and queue
# a fresh one for the same job, unless the job ended meanwhile. A graceful hand-back is no
# failed attempt, so the attempt counted when the job was started is given back, and the start
# is marked ended (no `run_state`: nobody takes it for a start cut off by a crash).
# KEYS[1] jobs stream, KEYS[2] job hash
# ARGV[1] group, ARGV[2] entry id held, ARGV[3] job id, ARGV[4] '1': return our attempt,
# ARGV[5] the model's arrivals channel
# returns the new entry id, or false when the job is over (entry just retired)
HANDBACK_SCRIPT = _render(
    """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
local status = redis.call('HGET', KEYS[2], '$JOB_STATUS')
if status ~= '$STATUS_QUEUED' and status ~= '$STATUS_RUNNING' then return false end
local entry = redis.call('XADD', KEYS[1], '*', '$ENTRY_FIELD', ARGV[3])
redis.call('HSET', KEYS[2], '$JOB_ENTRY_ID', entry)
if ARGV[4] == '1' then
  if tonumber(redis.call('HGET', KEYS[2], '$JOB_ATTEMPTS') or '0') > 0 then
    redis.call('HINCRBY', KEYS[2], '$JOB_ATTEMPTS', -1)
  end
  redis.call('HDEL', KEYS[2], '$JOB_RUN_STATE')
end
redis.call('PUBLISH', ARGV[5], entry)
return entry
"""
)

# Redis Cluster: a job's hash and its queue stream live in different slots, so enqueue and
# hand-back run as steps, each one atomic on one slot, ordered so that no step leaves a job a
# worker would skip or run twice (see producer_api.cluster_queue, worker.handback).
#
# CLUSTER_JOB_CREATE: the new job's hash, queued, with a provisional TTL that
# CLUSTER_JOB_ENTRY_SCRIPT lifts once the stream entry exists (an enqueue cut off in between
# leaves a hash that expires, never a queued job nobody will run).
# KEYS[1] job hash; ARGV[1] provisional TTL seconds, ARGV[2..] field, value pairs
# returns 1 when created, 0 when a job of that id exists already
CLUSTER_JOB_CREATE_SCRIPT = _render(
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
$SET_FIELDS
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
""",
    SET_FIELDS=_hset_argv_pairs("2"),
)

# CLUSTER_ENQUEUE_LOCAL: CLUSTER_JOB_CREATE, the XADD and CLUSTER_JOB_ENTRY in one atomic step,
# for a job whose queue stream is on the same node as its hash (what schemas.cluster_slots
# arranges): the stream travels in ARGV, so the client routes the call by the job's slot, and
# the flag lets the script touch the stream's slot too. Where the stream is on another node
# Redis refuses the XADD ("non local key"), before anything was written, and the caller takes
# the steps instead.
# KEYS[1] job hash; ARGV[1] queue stream, ARGV[2] job id, ARGV[3] the model's arrivals channel,
# ARGV[4..] field, value pairs
# returns the new entry id, or 0 when a job of that id exists already (nothing written)
CLUSTER_ENQUEUE_LOCAL_SCRIPT = _render(
    """#!lua flags=allow-cross-slot-keys
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local entry = redis.call('XADD', ARGV[1], '*', '$ENTRY_FIELD', ARGV[2])
$SET_FIELDS
redis.call('HSET', KEYS[1], '$JOB_ENTRY_ID', entry)
redis.call('PUBLISH', ARGV[3], entry)
return entry
""",
    SET_FIELDS=_hset_argv_pairs("4"),
)

# CLUSTER_JOB_ENTRY: record the job's (new) stream entry while it is queued or running, and make
# the hash permanent again; a job that ended meanwhile keeps its result's TTL.
# KEYS[1] job hash; ARGV[1] entry id; returns 1 when recorded, 0 when the job is over or gone
CLUSTER_JOB_ENTRY_SCRIPT = _render(
    """
local status = redis.call('HGET', KEYS[1], '$JOB_STATUS')
if status ~= '$STATUS_QUEUED' and status ~= '$STATUS_RUNNING' then return 0 end
redis.call('HSET', KEYS[1], '$JOB_ENTRY_ID', ARGV[1])
redis.call('PERSIST', KEYS[1])
return 1
"""
)

# CLUSTER_HANDBACK_JOB: HANDBACK_SCRIPT's part on the job hash, before the new entry is added:
# unless the job is over, forget its entry (a reader of the new entry must not take it for a
# superseded one) and, with ARGV[1] '1', give back the attempt.
# KEYS[1] job hash; returns 1 when the job goes back to the queue, 0 when it is over
CLUSTER_HANDBACK_JOB_SCRIPT = _render(
    """
local status = redis.call('HGET', KEYS[1], '$JOB_STATUS')
if status ~= '$STATUS_QUEUED' and status ~= '$STATUS_RUNNING' then return 0 end
redis.call('HDEL', KEYS[1], '$JOB_ENTRY_ID')
if ARGV[1] == '1' then
  if tonumber(redis.call('HGET', KEYS[1], '$JOB_ATTEMPTS') or '0') > 0 then
    redis.call('HINCRBY', KEYS[1], '$JOB_ATTEMPTS', -1)
  end
  redis.call('HDEL', KEYS[1], '$JOB_RUN_STATE')
end
return 1
"""
)

# Compare-and-set of a batch's status.
# KEYS[1] batch hash
# ARGV[1] new status, ARGV[2] time field to set ('': none), ARGV[3] its value,
# ARGV[4..] statuses the batch may be in now, then BATCH_STATUS_ARGS_END and field, value pairs
# returns {1, previous} when applied, {0, current} when not (current false: no such batch)
BATCH_SET_STATUS_SCRIPT = _render(
    """
local current = redis.call('HGET', KEYS[1], '$BATCH_STATUS')
if not current then return {0, false} end
local i = 4
local allowed = false
while i <= #ARGV and ARGV[i] ~= '$BATCH_STATUS_ARGS_END' do
  if ARGV[i] == current then allowed = true end
  i = i + 1
end
if not allowed then return {0, current} end
redis.call('HSET', KEYS[1], '$BATCH_STATUS', ARGV[1])
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], ARGV[2], ARGV[3]) end
$SET_EXTRA
return {1, current}
""",
    SET_EXTRA=_hset_argv_pairs("i + 1"),
)

# The batch controller's lease (KEYS[1], a string holding its holder's token ARGV[1]).
# LEASE_RENEW: ARGV[2] new TTL in ms; returns 1 when renewed, 0 when the lease is not ours.
LEASE_RENEW_SCRIPT = _if_lease_holder("redis.call('PEXPIRE', KEYS[1], ARGV[2])")
# LEASE_RELEASE: returns 1 when deleted, 0 when the lease is not ours.
LEASE_RELEASE_SCRIPT = _if_lease_holder("redis.call('DEL', KEYS[1])")


@cache
def _sharded(script: str) -> str:
    return script.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")


def job_channel_script(script: str, keys: RedisKeys) -> str:
    """`script` (one that publishes on job channels only, as TRANSITION_SCRIPT) as
    it must run under `keys`: in cluster mode with SPUBLISH, the sharded pub/sub of the job's
    own slot, which its keys share."""
    return _sharded(script) if keys.cluster else script


ALL_SCRIPTS: Mapping[str, str] = {
    name: text for name, text in globals().items() if name.endswith("_SCRIPT")
}
"""Every script by its constant's name (for tests and tools that check them all)."""
