"""Redis I/O shared by the worker, the API (with its client and batch controller) and the CLI:
one module per job, each importing only `schemas` and redis.

- `clients`: a client from `schemas.redis_connection.RedisConnectionSettings` (a plain URL,
  the master a set of Sentinels names, or a Redis Cluster), and pipelines that are MULTI only
  off a cluster;
- `pubsub`: subscribing alike on one Redis and on a cluster (sharded pub/sub for job channels);
- `scripts`: running one of `schemas.redis_scripts`' Lua scripts by EVALSHA;
- `memory_check`: the start-up look at Redis's `maxmemory` settings;
- `replica_wait`: the WAIT after a write that must survive a failover.
"""
