"""Redis names in cluster mode: a job's keys share one hash slot, a model's queue partitions
spread over slots, each partition's jobs and bulk streams share one; and without cluster mode
and with one partition, every name is the single-node one."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from redis.crc import key_slot

from schemas import PRIORITY_BULK, RedisKeys
from schemas.redis_connection import DEFAULT_CLUSTER_PARTITIONS, RedisConnectionSettings

JOB = "job_N3E9vjRWMDWF-ltq79SMfA"
MODEL = "org/My Model:v2"


def _slot(name: str) -> int:
    return key_slot(name.encode())


def test_a_jobs_keys_and_channel_share_one_slot():
    keys = RedisKeys(cluster=True, partitions=6)
    names = [keys.job(JOB), keys.out_stream(JOB), keys.channel(JOB)]
    assert len({_slot(name) for name in names}) == 1
    other = "job_AAAAvjRWMDWF-ltq79SMfB"
    assert _slot(keys.job(other)) != _slot(keys.job(JOB))


def test_a_models_partitions_spread_and_pair_jobs_with_bulk():
    keys = RedisKeys(cluster=True, partitions=6)
    jobs, bulk = keys.jobs_streams(MODEL), keys.bulk_streams(MODEL)
    assert len(set(jobs)) == 6 and len({_slot(s) for s in jobs}) == 6
    assert [_slot(s) for s in jobs] == [_slot(s) for s in bulk]
    assert all(keys.model_of_jobs_stream(s) == MODEL for s in jobs + bulk)


def test_a_job_is_queued_on_the_partition_its_id_names():
    keys = RedisKeys(cluster=True, partitions=6)
    ids = [f"job_{i:022d}" for i in range(600)]
    used = {keys.queue_stream(MODEL, 0, job_id) for job_id in ids}
    assert used == set(keys.jobs_streams(MODEL))  # every partition gets jobs
    assert keys.queue_stream(MODEL, PRIORITY_BULK, JOB) in keys.bulk_streams(MODEL)
    assert keys.queue_stream(MODEL, 0, JOB) == keys.jobs_stream(MODEL, keys.job_partition(JOB))


def test_a_job_and_its_partition_share_a_shard_of_an_evenly_split_cluster():
    # what `redis-cli --cluster create` gives 3 primaries: 0-5460, 5461-10922, 10923-16383
    def shard(name: str) -> int:
        slot = _slot(name)
        return 0 if slot <= 5460 else 1 if slot <= 10922 else 2

    keys = RedisKeys(cluster=True, partitions=6)
    ids = [f"job_{i:022d}" for i in range(600)]
    apart = [j for j in ids if shard(keys.job(j)) != shard(keys.queue_stream(MODEL, 0, j))]
    assert len(apart) <= 1  # the ranges of 6 partitions split 16,384 slots a slot off
    assert {shard(s) for s in keys.jobs_streams(MODEL)} == {0, 1, 2}
    assert sorted(keys.job_partition(j) for j in ids[:60]) != [0] * 60


def test_single_node_names_are_unchanged():
    keys = RedisConnectionSettings().redis_keys("inferq")
    assert keys == RedisKeys("inferq")
    assert keys.job(JOB) == f"inferq:job:{JOB}"
    assert keys.channel(JOB) == f"inferq:chan:{JOB}"
    assert keys.jobs_streams(MODEL) == ["inferq:jobs:org%2FMy%20Model%3Av2"]
    assert keys.queue_stream(MODEL, 0, JOB) == keys.jobs_stream(MODEL)
    split = RedisConnectionSettings(redis_queue_partitions=3).redis_keys("inferq")
    assert split.jobs_streams("m") == ["inferq:jobs:m", "inferq:jobs:m:1", "inferq:jobs:m:2"]


def test_the_cluster_setting_picks_cluster_names_and_partitions():
    keys = RedisConnectionSettings(redis_cluster=True).redis_keys("inferq")
    assert keys.cluster and keys.partitions == DEFAULT_CLUSTER_PARTITIONS
    assert keys.job(JOB) == "inferq:job:{" + JOB + "}"


def test_settings_that_a_cluster_cannot_honour_are_refused_by_name():
    with pytest.raises(ValidationError, match="redis_cluster"):
        RedisConnectionSettings(redis_cluster=True, redis_sentinels="s1:26379")
    with pytest.raises(ValidationError, match="redis_wait_replicas"):
        RedisConnectionSettings(redis_cluster=True, redis_wait_replicas=1)
