#!/usr/bin/env bash
# Start a local Redis Cluster for trying inferq's cluster mode:
#   scripts/redis_cluster.sh [PRIMARIES=3] [REPLICAS_PER_PRIMARY=1] [FIRST_PORT=7000] [DIR=./.redis-cluster]
# Starts PRIMARIES * (1 + REPLICAS) `redis-server --cluster-enabled yes` processes on
# FIRST_PORT.. (daemonized, AOF on, data and logs under DIR/<port>), joins them with
# `redis-cli --cluster create --cluster-yes`, and prints the settings to point inferq at it.
# Stop it with: scripts/redis_cluster.sh stop [FIRST_PORT] [DIR]
set -euo pipefail

if [[ "${1:-}" == "stop" ]]; then
  first=${2:-7000}
  dir=${3:-./.redis-cluster}
  for pidfile in "$dir"/*/redis.pid; do
    [[ -f "$pidfile" ]] || continue
    port=$(basename "$(dirname "$pidfile")")
    redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  done
  echo "stopped the cluster under $dir (ports from $first)"
  exit 0
fi

primaries=${1:-3}
replicas=${2:-1}
first=${3:-7000}
dir=${4:-./.redis-cluster}
if (( primaries < 3 )); then
  echo "Redis Cluster needs at least 3 primaries (got $primaries)" >&2
  exit 2
fi
count=$(( primaries * (1 + replicas) ))
addresses=()
for (( i = 0; i < count; i++ )); do
  port=$(( first + i ))
  mkdir -p "$dir/$port"
  redis-server --port "$port" --bind 127.0.0.1 --dir "$dir/$port" \
    --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 2000 --cluster-replica-validity-factor 0 \
    --appendonly yes --save "" --maxmemory-policy noeviction \
    --daemonize yes --pidfile "$dir/$port/redis.pid" --logfile "$dir/$port/redis.log"
  addresses+=("127.0.0.1:$port")
done
for address in "${addresses[@]}"; do
  until redis-cli -p "${address##*:}" ping >/dev/null 2>&1; do sleep 0.1; done
done
redis-cli --cluster create "${addresses[@]}" --cluster-replicas "$replicas" --cluster-yes >/dev/null
until redis-cli -p "$first" cluster info | grep -q "cluster_state:ok"; do sleep 0.2; done
echo "Redis Cluster up: $primaries primaries, $replicas replica(s) each, ports $first-$(( first + count - 1 ))"
echo "  export INFERQ_REDIS_URL=redis://127.0.0.1:$first/0 INFERQ_REDIS_CLUSTER=true"
