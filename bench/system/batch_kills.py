"""The Batch API against the engine alone, with and without a controller and a worker SIGKILL.

    python bench/system/batch_kills.py --lines 4000 [--max-tokens 16] [--dtype float32]

In one run: `LLM.generate` on N completion prompts in this process (the baseline), then the same
N lines as one Batch API batch through the real system (its own redis-server, the API, an
`inferq batch controller` and an `inferq worker` on the default model, each a process), once
undisturbed and once with the controller SIGKILLed when 30% of the lines are done and the worker
at 60%, each restarted at once. Times run from the batch's creation to `completed`; each ratio is
the engine's seconds over the batch's. Checks every line is in the output exactly once with
the engine's text (greedy; fp32 by default, as bf16 rounds differently with the batch's
make-up), and prints where the killed run lost time: the worker's restart to serving, and how
soon the dead worker's held jobs moved (its entries claimed by the new worker). Where the
undisturbed run's time goes: the CPU seconds each process spent (API, controller, worker,
Redis) against the engine alone's, per 1,000 lines; on a machine with few cores, whatever the
others spend comes out of the engine's share.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.machine import describe_machine, machine_one_liner
from bench.common.workload import bench_redis, free_port, tune_cpu_runtime, unpinned
from engine.platforms.cpu.runtime import untuned_env

REPO = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
KILL_CONTROLLER_AT = 0.3
KILL_WORKER_AT = 0.6


def prompts_for(count: int) -> list[str]:
    return [f"Question {i}: what comes after the number {i * 7}?" for i in range(count)]


def engine_alone(prompts: list[str], max_tokens: int, dtype: str) -> tuple[float, float, list[str]]:
    """Wall seconds, CPU seconds (this process, all threads) and texts of the engine alone."""
    from engine import LLM, SamplingParams

    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    # Warm-up at the batch sizes the run reaches (first calls measure and tune, as the worker's
    # start does before it serves), on other prompts so the prefix cache does not help.
    warm_up = [f"Warm-up {i}: name a colour." for i in range(min(len(prompts), 256))]
    llm.generate(warm_up, params, use_tqdm=False)
    started, cpu_started = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    texts = [out.outputs[0].text for out in outputs]
    del llm
    return seconds, cpu, texts


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    """A live process's peak resident memory so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def redis_cpu_seconds(redis_url: str) -> float:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        info = client.info("cpu")
    finally:
        client.close()
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class System:
    """Redis, the API, a batch controller and a worker as processes this run starts and kills."""

    def __init__(
        self,
        workdir: Path,
        redis_url: str,
        dtype: str,
        model: str = MODEL,
        env: dict[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.redis_url = redis_url
        self.model = model
        self.peaks: dict[str, float] = {}  # peak RSS (MiB) of each role, killed processes too
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "INFERQ_REDIS_URL": redis_url,
            "INFERQ_AUTH_DISABLED": "1",
            "INFERQ_DTYPE": dtype,
            "INFERQ_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            **(env or {}),
        }
        self.env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        self.port = free_port()
        self.starts = Counter[str]()
        self.api = self._spawn(
            "api",
            [
                "-m", "uvicorn", "producer_api.app:create_app", "--factory",
                "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning",
            ],
        )  # fmt: skip
        self.controller = self.start_controller()
        self.worker = self.start_worker()
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)

    def _spawn(self, name: str, args: list[str], tuned: bool = False) -> subprocess.Popen[bytes]:
        """A child as production starts it: only the worker runs under the tuned CPU runtime
        (it re-executes itself so); the API and the controller get the plain allocator."""
        self.starts[name] += 1
        log = (self.workdir / f"{name}-{self.starts[name]}.log").open("w")
        env = self.env if tuned else untuned_env(self.env)
        with unpinned():
            return subprocess.Popen(
                [sys.executable, *args], cwd=REPO, env=env, stdout=log, stderr=log
            )

    def start_controller(self) -> subprocess.Popen[bytes]:
        return self._spawn("controller", ["-m", "cli", "batch", "controller"])

    def start_worker(self) -> subprocess.Popen[bytes]:
        args = ["-m", "cli", "--log-level", "info", "worker", "--model", self.model]
        return self._spawn("worker", args, tuned=True)

    def wait_ready(self, timeout: float = 600) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            try:
                if self.http.get("/ready").status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            assert self.worker.poll() is None, "the worker exited during start-up"
            time.sleep(0.1)
        raise TimeoutError("the worker did not come up")

    def run_batch(
        self, lines: list[str], kills: bool, endpoint: str = "/v1/completions"
    ) -> tuple[float, dict, list[str]]:
        text = "\n".join(lines) + "\n"
        files = {"file": ("in.jsonl", text.encode())}
        uploaded = self.http.post("/v1/files", files=files, data={"purpose": "batch"}).json()
        body = {"input_file_id": uploaded["id"], "endpoint": endpoint}
        body["completion_window"] = "24h"
        started = time.monotonic()
        batch = self.http.post("/v1/batches", json=body).json()
        notes: list[str] = []
        pending_kills = [(KILL_CONTROLLER_AT, "controller"), (KILL_WORKER_AT, "worker")]
        pending_kills = pending_kills if kills else []
        ready_after: float | None = None
        while True:
            batch = self.http.get(f"/v1/batches/{batch['id']}").json()
            if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                break
            done = batch["request_counts"]["completed"] / len(lines)
            if pending_kills and done >= pending_kills[0][0]:
                share, name = pending_kills.pop(0)
                at = time.monotonic() - started
                self.note_peaks()
                if name == "controller":
                    self.controller.kill()
                    self.controller.wait()
                    self.controller = self.start_controller()
                else:
                    self.worker.kill()
                    self.worker.wait()
                    self.worker = self.start_worker()
                    ready_after = time.monotonic()
                notes.append(f"{name} killed at {share:.0%} ({at:.1f} s)")
            if ready_after is not None and self._serving():
                notes.append(f"new worker serving {time.monotonic() - ready_after:.1f} s after")
                ready_after = None
            time.sleep(0.2)
        seconds = time.monotonic() - started
        self.note_peaks()
        return seconds, batch, notes

    def note_peaks(self) -> None:
        """Fold each live process's peak RSS into `peaks` (before a kill loses it)."""
        processes = {"api": self.api, "controller": self.controller, "worker": self.worker}
        for name, process in processes.items():
            if process.poll() is None:
                self.peaks[name] = max(self.peaks.get(name, 0.0), peak_rss_mb(process.pid))

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds each process has used so far (a restarted one: since its restart)."""
        processes = {"api": self.api, "controller": self.controller, "worker": self.worker}
        used = {name: process_cpu_seconds(p.pid) for name, p in processes.items()}
        return {**used, "redis": redis_cpu_seconds(self.redis_url)}

    def _serving(self) -> bool:
        log = self.workdir / f"worker-{self.starts['worker']}.log"
        return "worker_started" in log.read_text(errors="replace")

    def output(self, file_id: str | None) -> list[dict]:
        if file_id is None:
            return []
        response = self.http.get(f"/v1/files/{file_id}/content")
        return [json.loads(line) for line in response.text.splitlines()]

    def close(self) -> None:
        self.http.close()
        for process in (self.worker, self.controller, self.api):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (self.worker, self.controller, self.api):
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


def claimed_from_dead(workdir: Path) -> str:
    """The restarted worker's log lines saying it took over the dead worker's entries."""
    found = []
    for log in sorted(workdir.glob("worker-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "entries_claimed" in line:
                found.append(f"{log.stem}: {line[:23]} {line.split('entries_claimed', 1)[1]}")
    return "; ".join(found) or "none"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=4000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-kills", action="store_true", help="only the undisturbed run")
    args = parser.parse_args()
    runtime = tune_cpu_runtime(None)
    print(machine_one_liner(describe_machine()), "|", runtime, flush=True)
    prompts = prompts_for(args.lines)
    engine_s, engine_cpu, reference = engine_alone(prompts, args.max_tokens, args.dtype)
    print(f"engine alone: {args.lines} prompts in {engine_s:.1f} s, {engine_cpu:.1f} CPU s")
    lines = []
    for i, prompt in enumerate(prompts):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens}
        body["temperature"] = 0
        record = {"custom_id": f"q-{i}", "method": "POST", "url": "/v1/completions"}
        lines.append(json.dumps({**record, "body": body}))
    expected = {f"q-{i}": text for i, text in enumerate(reference)}
    workdir = Path(tempfile.mkdtemp(prefix="inferq-batch-kills-"))
    rows = []
    with bench_redis(workdir / "redis") as (_, redis_url):
        system = System(workdir, redis_url, args.dtype)
        try:
            print(f"worker ready in {system.wait_ready():.1f} s", flush=True)
            for kills in (False,) if args.no_kills else (False, True):
                cpu_before = system.cpu_seconds()
                seconds, batch, notes = system.run_batch(lines, kills)
                if not kills:
                    spent = system.cpu_seconds()
                    per_k = 1000 / args.lines
                    shares = ", ".join(
                        f"{name} {(spent[name] - cpu_before[name]) * per_k:.1f}" for name in spent
                    )
                    print(
                        f"CPU s per 1,000 lines: engine alone {engine_cpu * per_k:.1f}; "
                        f"batch: {shares}",
                        flush=True,
                    )
                output = system.output(batch.get("output_file_id"))
                counts = Counter(record["custom_id"] for record in output)
                once = counts == Counter(dict.fromkeys(expected, 1))
                same = sum(
                    record["response"]["body"]["choices"][0]["text"] == expected[cid]
                    for record in output
                    if (cid := record["custom_id"]) in expected
                )
                label = "with kills" if kills else "no kills"
                ratio = engine_s / seconds
                rows.append((label, seconds, ratio, once, same, notes))
                print(
                    f"batch {label}: {batch['status']} in {seconds:.1f} s, "
                    f"{ratio:.3f}x the engine; every line once: {once}; "
                    f"texts equal: {same}/{len(expected)}; {'; '.join(notes)}",
                    flush=True,
                )
        finally:
            system.close()
    print(f"\nengine alone: {engine_s:.1f} s for {args.lines} lines, {args.max_tokens} tokens")
    for label, seconds, ratio, once, same, _notes in rows:
        print(f"batch {label:<10} {seconds:7.1f} s  {ratio:.3f}x  once={once} equal={same}")
    print(f"entries claimed from dead workers: {claimed_from_dead(workdir)}")
    print(f"logs: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
