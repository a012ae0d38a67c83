"""Redis with ACL users and TLS (`rediss://`), end to end: the Python client enqueues and waits,
a worker subprocess serves, and `inferq status` reads, each as its own least-privilege ACL user
over TLS with a throwaway CA made here with openssl. The worker runs the fake engine (the Redis
path is what is under test; the real engine is covered elsewhere)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from worker_harness import start_worker_process, stop_process

from producer_api.client.redis_client import RedisClient
from schemas import JobStatus
from tests.conftest import _find_redis_server, _free_port

# The same rules the README gives: only the inferq: keys and channels, no admin commands.
RULES = "~inferq:* &inferq:* +@all -@dangerous"
USERS = {"inferq-worker": "worker-pw-1", "inferq-api": "api-pw-2", "inferq-ops": "ops-pw-3"}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (valid one day)."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
             "/CN=inferq-test-ca", "-keyout", "ca.key", "-out", "ca.crt", cwd=folder)  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
             "-keyout", "server.key", "-out", "server.csr", cwd=folder)  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", "server.crt",
             cwd=folder)  # fmt: skip
    return {name: folder / f"{name}" for name in ("ca.crt", "server.crt", "server.key")}


@pytest.fixture
def secure_redis(tmp_path: Path):
    """redis-server with TLS only (no plain port) and ACL users; yields (port, CA file)."""
    binary = _find_redis_server()
    if binary is None or shutil.which("openssl") is None:
        pytest.skip("needs redis-server and openssl (scripts/test.sh installs redis-server)")
    certs = make_certificates(tmp_path / "tls")
    port = _free_port()
    users = "\n".join(f"user {name} on >{pw} {RULES}" for name, pw in USERS.items())
    config = tmp_path / "redis.conf"
    config.write_text(
        f"port 0\ntls-port {port}\nbind 127.0.0.1\n"
        f"tls-cert-file {certs['server.crt']}\ntls-key-file {certs['server.key']}\n"
        f"tls-ca-cert-file {certs['ca.crt']}\ntls-auth-clients no\n"
        f'dir {tmp_path}\nsave ""\nappendonly no\n'
        f"user default off\n{users}\n"
        "user outsider on >outsider-pw ~other:* +@all -@dangerous\n"
    )
    process = subprocess.Popen([binary, str(config)], stdout=subprocess.DEVNULL)
    try:
        ca = certs["ca.crt"]
        give_up = time.monotonic() + 15
        while True:
            assert process.poll() is None, "redis-server refused the TLS / ACL configuration"
            try:
                redis.Redis.from_url(url_for("inferq-ops", port, ca)).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < give_up, "TLS redis-server did not answer"
                time.sleep(0.05)
        yield port, ca
    finally:
        process.kill()
        process.wait()


def url_for(user: str, port: int, ca: Path, password: str | None = None) -> str:
    secret = USERS.get(user, "") if password is None else password
    return f"rediss://{user}:{secret}@127.0.0.1:{port}/0?ssl_ca_certs={ca}&ssl_cert_reqs=required"


def test_client_and_worker_over_tls_with_acl_users(secure_redis):
    port, ca = secure_redis
    worker = start_worker_process(
        url_for("inferq-worker", port, ca), fake=True, name="tls-w", model="fake-model"
    )
    try:
        with RedisClient(url_for("inferq-api", port, ca)) as client:
            job = client.enqueue(
                model="fake-model", prompt="hello over TLS", sampling={"max_tokens": 5}
            )
            done = client.wait(job.id, timeout=60)
        assert done.status is JobStatus.SUCCEEDED and done.worker == "tls-w"
        assert len(done.result.choices[0].token_ids) == 5
        status = subprocess.run(
            ["inferq", "status", "--redis-url", url_for("inferq-ops", port, ca)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert "tls-w" in status.stdout and "ops-pw-3" not in status.stdout  # password redacted
        assert stop_process(worker) == 0  # a clean drain over TLS
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_tls_and_acl_refuse_what_they_should(secure_redis):
    port, ca = secure_redis
    plain = f"redis://inferq-api:{USERS['inferq-api']}@127.0.0.1:{port}/0"
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(plain, socket_timeout=2).ping()  # no plain-text port
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url_for("inferq-api", port, ca, password="wrong")).ping()
    with pytest.raises(redis.ConnectionError):  # an unknown CA: the server is not trusted
        redis.Redis.from_url(
            url_for("inferq-api", port, ca).replace(str(ca), "/etc/ssl/certs/ca-certificates.crt")
        ).ping()
    api = redis.Redis.from_url(url_for("inferq-api", port, ca))
    with pytest.raises(redis.exceptions.NoPermissionError):
        api.set("other:key", "x")  # outside the inferq: key space
    with pytest.raises(redis.exceptions.NoPermissionError):
        api.flushall()  # a dangerous command
    outsider = url_for("outsider", port, ca, password="outsider-pw")
    with RedisClient(outsider) as client, pytest.raises(redis.exceptions.NoPermissionError):
        client.enqueue(model="fake-model", prompt="not allowed", sampling={"max_tokens": 1})
