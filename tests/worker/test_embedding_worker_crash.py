"""An embedding worker killed (SIGKILL) in the middle of a bulk run loses no job: its pending
jobs go to the next worker, every job succeeds once, and the vectors are sentence-transformers'."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from redis import Redis

from producer_api.client import Client
from schemas import JobStatus, RedisKeys
from tests.conftest import RedisServer

MODEL = "all-MiniLM-L6-v2"
JOBS = 400
pytestmark = pytest.mark.slow


def start_worker(redis_url: str, name: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "INFERQ_NUM_THREADS": "1",
        "INFERQ_CLAIM_MIN_IDLE_MS": "2000",
        "INFERQ_REDIS_URL": redis_url,
        "INFERQ_NAME": name,
    }
    command = [sys.executable, "-m", "cli", "--log-level", "warning", "worker", "--model", MODEL]
    return subprocess.Popen(command, env=env)


def statuses(redis: Redis, job_ids: list[str]) -> list[str]:
    keys = RedisKeys()
    with redis.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), "status")
        return [status or "" for status in pipe.execute()]


def test_killed_embedding_worker_loses_no_job(redis_server: RedisServer, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from engine.model_files import ModelNotFoundError, resolve_model_path

    try:
        path = resolve_model_path(MODEL)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    texts = [f"line {i}: " + "bulk embedding through the queue " * (1 + i % 7) for i in range(JOBS)]
    redis = Redis.from_url(redis_server.url, decode_responses=True)
    with Client(redis_server.url) as client:
        job_ids = [client.enqueue(model=MODEL, prompt=text, pooling={}).id for text in texts]
    first = start_worker(redis_server.url, "embed-first")
    second = None
    try:
        give_up = time.monotonic() + 180
        while statuses(redis, job_ids).count(JobStatus.SUCCEEDED) < JOBS // 8:
            assert first.poll() is None and time.monotonic() < give_up
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        done_at_kill = statuses(redis, job_ids).count(JobStatus.SUCCEEDED)
        assert done_at_kill < JOBS, "the first worker finished everything before the kill"
        second = start_worker(redis_server.url, "embed-second")
        while statuses(redis, job_ids).count(JobStatus.SUCCEEDED) < JOBS:
            assert second.poll() is None and time.monotonic() < give_up + 120
            assert JobStatus.FAILED not in statuses(redis, job_ids)
            time.sleep(0.2)
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(60)
    with Client(redis_server.url) as client:
        finished = [client.get(job_id) for job_id in job_ids]
    assert {job.worker for job in finished} == {"embed-first", "embed-second"}
    reference = torch.from_numpy(SentenceTransformer(str(path), device="cpu").encode(texts))
    ours = torch.tensor([job.result.embedding for job in finished])
    assert (1 - F.cosine_similarity(ours.double(), reference.double())).max() < 1e-5
