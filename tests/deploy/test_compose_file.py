"""docker-compose.yml and the Dockerfile: the services a deployment needs, wired the way the
README says, and every `inferq ...` command they run exists in the CLI with those flags."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.main import build_parser
from producer_api.batches.settings import BatchControllerSettings
from producer_api.settings import ApiSettings
from redis_io.memory_check import redis_memory_warning
from schemas.redis_connection import RedisConnectionSettings
from worker.settings import WorkerSettings

REPO = Path(__file__).resolve().parents[2]
ENV = {"REDIS_PASSWORD": "s3cret-pw", "INFERQ_API_KEYS": '{"me": "k"}', "HF_TOKEN": "hf_x"}
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


class MissingVariable(Exception):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution (${X}, ${X:-default}, ${X:?error}, $$) over the tree."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.groups()
        current = env.get(name)
        if op in (":-", "-"):
            return current if current else arg
        if op in (":?", "?") and not current:
            raise MissingVariable(f"{name}: {arg}")
        return current or ""

    return _VAR.sub(substitute, value)


def compose_raw() -> dict[str, Any]:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return compose_raw()


@pytest.fixture(scope="module")
def compose(raw: dict[str, Any]) -> dict[str, Any]:
    return interpolate(raw, ENV)


def _inferq_commands(compose: dict[str, Any]) -> list[list[str]]:
    commands = []
    for service in compose["services"].values():
        candidates = [service.get("command"), service.get("healthcheck", {}).get("test")]
        for command in candidates:
            if not isinstance(command, list):
                continue
            if command and command[0] in ("CMD", "CMD-SHELL"):
                command = command[1:]
            if command and command[0] == "inferq":
                commands.append(command)
    return commands


HA = ("redis-replica", "redis-sentinel-1", "redis-sentinel-2", "redis-sentinel-3")
CLUSTER_NODES = tuple(f"redis-cluster-{n}" for n in range(1, 7))
CLUSTER = (*CLUSTER_NODES, "redis-cluster-create")


def test_services_and_profiles(compose):
    services = compose["services"]
    assert set(services) == {
        "redis", "api", "grpc", "batch-controller", "worker-gpu", "worker-cpu", *HA, *CLUSTER
    }  # fmt: skip
    assert services["worker-cpu"]["profiles"] == ["cpu"]
    assert all(services[s]["profiles"] == ["ha"] for s in HA)
    assert all(services[s]["profiles"] == ["cluster"] for s in CLUSTER)
    always = ("redis", "api", "grpc", "batch-controller", "worker-gpu")
    assert all("profiles" not in services[s] for s in always)
    assert set(compose["volumes"]) == {
        "redis-data", "redis-replica-data", "model-cache", *(f"{n}-data" for n in CLUSTER_NODES)
    }  # fmt: skip


def test_the_cluster_profile_joins_three_primaries_with_a_replica_each(compose):
    services = compose["services"]
    hostnames = set()
    for name in CLUSTER_NODES:
        node = services[name]
        command = " ".join(node["command"])
        assert "--cluster-enabled yes" in command and "--appendonly yes" in command
        assert "--maxmemory-policy noeviction" in command
        assert '--requirepass "$REDIS_PASSWORD"' in command
        assert f"{name}-data:/data" in node["volumes"]
        hostnames.add(node["hostname"])
    assert hostnames == set(CLUSTER_NODES)  # each announces its own name
    create = " ".join(services["redis-cluster-create"]["command"])
    assert "--cluster create" in create and "--cluster-replicas 1" in create
    assert all(f"{name}:6379" in create for name in CLUSTER_NODES)
    assert set(services["redis-cluster-create"]["depends_on"]) == set(CLUSTER_NODES)
    # off by default; the documented variables point every process at the cluster
    assert services["api"]["environment"]["INFERQ_REDIS_CLUSTER"] == "false"
    env = {**ENV, "INFERQ_REDIS_HOST": "redis-cluster-1", "INFERQ_REDIS_CLUSTER": "true"}
    for service in ("api", "grpc", "batch-controller", "worker-gpu"):
        variables = interpolate(compose_raw(), env)["services"][service]["environment"]
        settings = RedisConnectionSettings(
            redis_url=variables["INFERQ_REDIS_URL"],
            redis_cluster=variables["INFERQ_REDIS_CLUSTER"],
        )
        assert settings.redis_cluster and "@redis-cluster-1:6379" in settings.redis_url
        assert settings.queue_partitions() > 1


def test_the_ha_profile_replicates_redis_and_its_sentinels_name_the_settings_master(compose):
    services = compose["services"]
    replica = " ".join(services["redis-replica"]["command"])
    assert "--replicaof redis 6379" in replica and '--masterauth "$REDIS_PASSWORD"' in replica
    master_name = RedisConnectionSettings().redis_master_name
    for name in HA[1:]:
        sentinel = " ".join(services[name]["command"])
        assert f"sentinel monitor {master_name} redis 6379 2" in sentinel
        assert "--sentinel" in sentinel
    # off by default: the processes use INFERQ_REDIS_URL until the Sentinels are named
    assert services["api"]["environment"]["INFERQ_REDIS_SENTINELS"] == ""
    hosts = ",".join(f"{name}:26379" for name in HA[1:])
    env = {**ENV, "INFERQ_REDIS_SENTINELS": hosts, "INFERQ_REDIS_WAIT_REPLICAS": "1"}
    for service in ("api", "batch-controller", "worker-gpu"):
        settings = interpolate(compose_raw(), env)["services"][service]["environment"]
        assert settings["INFERQ_REDIS_SENTINELS"] == hosts
        assert RedisConnectionSettings(redis_sentinels=hosts).sentinel_addresses()[0][1] == 26379


def test_redis_has_aof_a_volume_and_the_password_from_the_environment(compose, raw):
    redis = compose["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    assert '--requirepass "$REDIS_PASSWORD"' in command  # read in the container, not baked in
    assert redis["environment"]["REDIS_PASSWORD"] == ENV["REDIS_PASSWORD"]
    assert "redis-data:/data" in redis["volumes"]
    assert "ports" not in redis, "Redis must not be published on the host"
    assert "redis-cli ping" in " ".join(redis["healthcheck"]["test"])
    with pytest.raises(MissingVariable, match="REDIS_PASSWORD"):
        interpolate(raw, {k: v for k, v in ENV.items() if k != "REDIS_PASSWORD"})


def test_redis_memory_is_capped_and_never_evicts(compose, raw):
    command = " ".join(compose["services"]["redis"]["command"])
    assert "--maxmemory 4gb " in command
    policy = re.search(r"--maxmemory-policy (\S+)", command)
    assert policy is not None  # the start-up check of the API and workers finds it safe:
    assert redis_memory_warning({"maxmemory": 4 << 30, "maxmemory_policy": policy[1]}) is None
    sized = interpolate(raw, {**ENV, "REDIS_MAXMEMORY": "24gb"})["services"]["redis"]["command"]
    assert "--maxmemory 24gb " in " ".join(sized)


def test_api_port_environment_and_health(compose, raw):
    api = compose["services"]["api"]
    assert api["ports"] == ["8000:8000"]
    assert interpolate(raw, {**ENV, "INFERQ_API_PORT": "9100"})["services"]["api"]["ports"] == [
        "9100:8000"
    ]
    env = api["environment"]
    assert env["INFERQ_REDIS_URL"] == f"redis://:{ENV['REDIS_PASSWORD']}@redis:6379/0"
    assert env["INFERQ_API_KEYS"] == ENV["INFERQ_API_KEYS"]
    with pytest.raises(MissingVariable, match="INFERQ_API_KEYS"):
        interpolate(raw, {k: v for k, v in ENV.items() if k != "INFERQ_API_KEYS"})
    assert api["command"][:2] == ["inferq", "api"] and "0.0.0.0" in api["command"]
    checked = [a for a in api["healthcheck"]["test"] if a.startswith("http")]
    assert checked == ["http://127.0.0.1:8000/health", "http://127.0.0.1:8000/ready"]
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"


def test_gpu_worker_reserves_a_gpu_keeps_models_and_passes_hf_token(compose):
    worker = compose["services"]["worker-gpu"]
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "model-cache:/models" in worker["volumes"]
    assert worker["environment"]["HF_TOKEN"] == ENV["HF_TOKEN"]
    assert worker["environment"]["INFERQ_REDIS_URL"].startswith("redis://:s3cret-pw@redis:")
    assert worker["command"][:2] == ["inferq", "worker"]
    assert worker["command"][worker["command"].index("--device") + 1] == "cuda"
    assert worker["build"]["args"]["INFERQ_TORCH_SPEC"].startswith("torch==")
    assert worker["healthcheck"]["test"][1:] == ["inferq", "status", "--check-worker"]
    # Longer than the worker's default drain (30 s), so SIGTERM lets running jobs finish.
    assert (
        int(worker["stop_grace_period"].rstrip("s"))
        > WorkerSettings.model_fields["drain_timeout_s"].default
    )


def test_cpu_worker_runs_on_the_cpu_image(compose):
    worker = compose["services"]["worker-cpu"]
    assert worker["image"] == compose["services"]["api"]["image"]
    assert worker["command"][worker["command"].index("--device") + 1] == "cpu"
    assert "model-cache:/models" in worker["volumes"]


def test_batch_controller_runs_off_the_gpu_against_the_same_redis(compose):
    controller = compose["services"]["batch-controller"]
    assert controller["command"] == ["inferq", "batch", "controller"]
    assert controller["image"] == compose["services"]["api"]["image"]
    assert "deploy" not in controller  # no GPU reservation
    api_env = compose["services"]["api"]["environment"]
    for variable in ("INFERQ_REDIS_URL", "INFERQ_PREFIX"):
        assert controller["environment"][variable] == api_env[variable]


def test_grpc_serves_the_apis_jobs_with_its_keys_on_its_port(compose, raw):
    grpc = compose["services"]["grpc"]
    api = compose["services"]["api"]
    assert grpc["command"][:2] == ["inferq", "grpc"] and "0.0.0.0" in grpc["command"]
    assert grpc["ports"] == ["50051:50051"]
    assert interpolate(raw, {**ENV, "INFERQ_GRPC_PORT": "9051"})["services"]["grpc"]["ports"] == [
        "9051:50051"
    ]
    for variable in ("INFERQ_REDIS_URL", "INFERQ_PREFIX", "INFERQ_API_KEYS", "INFERQ_MODELS"):
        assert grpc["environment"][variable] == api["environment"][variable]
    assert grpc["image"] == api["image"]


def test_every_inferq_command_exists_in_the_cli(compose):
    commands = _inferq_commands(compose)
    assert {c[1] for c in commands} == {"api", "grpc", "worker", "status", "batch"}
    parser = build_parser()
    for command in commands:
        args = parser.parse_args(command[1:])  # argparse exits (fails the test) on a bad flag
        assert args.handler is not None


def test_every_inferq_variable_is_a_setting(compose):
    """A misspelt INFERQ_* variable would be ignored silently by the settings classes."""
    known = {f"INFERQ_{name.upper()}" for name in ApiSettings.model_fields}
    known |= {f"INFERQ_{name.upper()}" for name in WorkerSettings.model_fields}
    known |= {f"INFERQ_{name.upper()}" for name in BatchControllerSettings.model_fields}
    known |= {"INFERQ_HOME"}  # the model cache folder (engine.model_files)
    for name, service in compose["services"].items():
        for variable in service.get("environment", {}):
            if variable.startswith("INFERQ_"):
                assert variable in known, f"{name}: {variable} is no setting"


def test_dockerfile_installs_like_the_readme_and_matches_the_volumes(compose):
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "bash scripts/env.sh" in dockerfile
    assert re.search(r"^ARG INFERQ_TORCH_SPEC=", dockerfile, re.MULTILINE)
    assert "INFERQ_HOME=/models" in dockerfile  # where the model-cache volume is mounted
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
    assert compose["services"]["worker-gpu"]["build"]["context"] == "."


def test_dockerfile_copies_every_package_the_project_installs():
    """The image's editable install needs each package folder (a missing one breaks `inferq`)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    dockerfile = (REPO / "Dockerfile").read_text()
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        package = pattern.rstrip("*")
        assert f"COPY --chown=inferq:inferq {package} {package}" in dockerfile, package


def test_interpolation_helper_matches_compose_rules():
    env = {"SET": "v", "EMPTY": ""}
    assert interpolate("${SET:-d} ${EMPTY:-d} ${UNSET:-d} $$HOME", env) == "v d d $HOME"
    with pytest.raises(MissingVariable):
        interpolate("${EMPTY:?needed}", env)
