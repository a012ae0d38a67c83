"""The producer side of the queue, straight on Redis: enqueue, get, wait, stream, cancel.

Both the HTTP API and the Python client (`producer_api.client.redis_client`) call these
functions; they follow the contract in `schemas.keys`, `schemas.chunks` and `schemas.events`.
Every function takes a `redis.asyncio.Redis` (str or bytes responses both work) and the
`RedisKeys` naming the deployment.

This module is where callers import them from; each lives in a module of its own purpose:
`job_enqueue` (enqueue), `job_record` (get, cancel), `job_watch` (wait, stream), `backlog`
(queue length) and `queue_errors` (what they raise).
"""

from __future__ import annotations

from producer_api.backlog import queue_length as queue_length
from producer_api.job_enqueue import check_deadline as check_deadline
from producer_api.job_enqueue import enqueue as enqueue
from producer_api.job_enqueue import enqueue_call as enqueue_call
from producer_api.job_enqueue import enqueued as enqueued
from producer_api.job_record import cancel_job as cancel_job
from producer_api.job_record import get_job as get_job
from producer_api.job_watch import DEFAULT_POLL_INTERVAL_S as DEFAULT_POLL_INTERVAL_S
from producer_api.job_watch import stream_chunks as stream_chunks
from producer_api.job_watch import wait_job as wait_job
from producer_api.queue_errors import REDIS_UNAVAILABLE as REDIS_UNAVAILABLE
from producer_api.queue_errors import JobNotFoundError as JobNotFoundError
from producer_api.queue_errors import QueueError as QueueError
from producer_api.queue_errors import QueueFullError as QueueFullError
