"""A Batch API embedding job against the engine alone, with each process's peak memory.

    python bench/system/bulk_embeddings.py --lines 20000 [--kills]

In one run: `LLM.embed` on N texts in a process of its own (the baseline: seconds and peak
RSS), then the same N texts as one Batch API batch of `/v1/embeddings` lines through the real
system (its own redis-server, the API, an `inferq batch controller` and an `inferq worker` on the
shipped all-MiniLM-L6-v2, each a process). With --kills, the controller is SIGKILLed at 30% of
the lines and the worker at 60%, each restarted at once. Times run from the batch's creation to
`completed`; the ratio is the engine's seconds over the batch's. Checks every line is in the
output exactly once with the engine's vector (cosine distance), and prints the peak RSS of the
engine alone, the API, the controller and the worker (VmHWM; a killed process's peak counts) and
Redis' peak memory (it holds the input and output files). Undisturbed, it prints the CPU seconds
each process spent per 1,000 lines (API, controller, worker, Redis) against the engine alone's:
on a machine with few cores, whatever the others spend comes out of the engine's share.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.machine import describe_machine, machine_one_liner
from bench.common.workload import bench_redis, tune_cpu_runtime, unpinned
from bench.system.batch_kills import System, peak_rss_mb

MODEL = "all-MiniLM-L6-v2"
ENDPOINT = "/v1/embeddings"


def texts_for(count: int) -> list[str]:
    subjects = ["queues", "embeddings", "search indexes", "workers", "batches", "vectors"]
    return [
        f"Document {i}: notes on {subjects[i % len(subjects)]}, part {i * 7 % 1000}, "
        f"written for reader {i % 97}."
        for i in range(count)
    ]


def _engine_alone(texts: list[str], out: str) -> None:
    """In a child process: embed `texts`, write seconds, peak RSS and the vectors to `out`."""
    import os

    import torch

    from engine import LLM

    llm = LLM(MODEL)
    llm.embed(texts[:256], use_tqdm=False)  # warm-up, as the worker's start does
    started, cpu_started = time.perf_counter(), time.process_time()
    outputs = llm.embed(texts, use_tqdm=False)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    vectors = torch.tensor([o.outputs.embedding for o in outputs])
    peak = peak_rss_mb(os.getpid())
    torch.save({"seconds": seconds, "cpu": cpu, "peak_mb": peak, "vectors": vectors}, out)


def engine_alone(texts: list[str], workdir: Path) -> tuple[float, float, float, object]:
    """Wall seconds, CPU seconds (all threads), peak RSS (MiB) and vectors of the engine alone."""
    import torch

    out = str(workdir / "engine.pt")
    child = multiprocessing.get_context("spawn").Process(target=_engine_alone, args=(texts, out))
    with unpinned():  # else the child inherits this process's one-core mask
        child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the engine-alone process exited with {child.exitcode}")
    result = torch.load(out)
    return result["seconds"], result["cpu"], result["peak_mb"], result["vectors"]


def redis_peak_mb(redis_url: str) -> float:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.info("memory")["used_memory_peak"]) / 2**20
    finally:
        client.close()


def memory_only(system: System, lines: list[str], seconds: float, redis_url: str) -> int:
    """Upload and start the batch, note each process's peak RSS `seconds` in, cancel it."""
    files = {"file": ("in.jsonl", ("\n".join(lines) + "\n").encode())}
    started = time.monotonic()
    uploaded = system.http.post("/v1/files", files=files, data={"purpose": "batch"}).json()
    upload_s = time.monotonic() - started
    body = {"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "completion_window": "24h"}
    batch = system.http.post("/v1/batches", json=body).json()
    time.sleep(seconds)
    batch = system.http.get(f"/v1/batches/{batch['id']}").json()
    system.note_peaks()
    system.http.post(f"/v1/batches/{batch['id']}/cancel")
    peaks = ", ".join(f"{name} {mb:.0f}" for name, mb in sorted(system.peaks.items()))
    print(f"{len(lines)} lines: upload {upload_s:.1f} s; {seconds:.0f} s in: {batch['status']}, "
          f"{batch['request_counts']['completed']} done; peak RSS MiB: {peaks}; "
          f"redis {redis_peak_mb(redis_url):.0f}")  # fmt: skip
    return 0


def main() -> int:
    import torch
    import torch.nn.functional as F

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--kills", action="store_true", help="SIGKILL controller and worker")
    parser.add_argument("--skip-engine", action="store_true", help="only the batch (no check)")
    parser.add_argument(
        "--memory-only",
        type=float,
        metavar="S",
        help="no engine alone; note peak RSS S seconds into the batch, then cancel it",
    )
    args = parser.parse_args()
    runtime = tune_cpu_runtime(None)
    print(machine_one_liner(describe_machine()), "|", runtime, flush=True)
    texts = texts_for(args.lines)
    workdir = Path(tempfile.mkdtemp(prefix="inferq-bulk-embeddings-"))
    engine_s, engine_cpu, engine_peak = float("nan"), float("nan"), float("nan")
    reference = None
    if not args.skip_engine and args.memory_only is None:
        engine_s, engine_cpu, engine_peak, reference = engine_alone(texts, workdir)
        rate = args.lines / engine_s
        print(f"engine alone: {args.lines} texts in {engine_s:.1f} s ({rate:.0f}/s), "
              f"{engine_cpu:.1f} CPU s, peak RSS {engine_peak:.0f} MiB", flush=True)  # fmt: skip
    lines = [
        json.dumps(
            {
                "custom_id": f"d-{i}",
                "method": "POST",
                "url": ENDPOINT,
                "body": {"model": MODEL, "input": text},
            }
        )
        for i, text in enumerate(texts)
    ]
    limits = {"INFERQ_MAX_BATCH_LINES": str(max(args.lines, 50_000)), "INFERQ_DTYPE": "float32"}
    with bench_redis(workdir / "redis") as (_, redis_url):
        system = System(workdir, redis_url, "float32", model=MODEL, env=limits)
        try:
            print(f"worker ready in {system.wait_ready():.1f} s", flush=True)
            if args.memory_only is not None:
                return memory_only(system, lines, args.memory_only, redis_url)
            cpu_before = system.cpu_seconds()
            seconds, batch, notes = system.run_batch(lines, args.kills, ENDPOINT)
            cpu_spent = system.cpu_seconds()
            output = system.output(batch.get("output_file_id"))
            redis_peak = redis_peak_mb(redis_url)
        finally:
            system.close()
    counts = Counter(record["custom_id"] for record in output)
    once = counts == Counter({f"d-{i}": 1 for i in range(args.lines)})
    worst = float("nan")
    if reference is not None and output:
        got = torch.zeros(args.lines, reference.shape[1])
        for record in output:
            index = int(record["custom_id"][2:])
            got[index] = torch.tensor(record["response"]["body"]["data"][0]["embedding"])
        worst = float((1 - F.cosine_similarity(got.double(), reference.double())).max())
    ratio = engine_s / seconds
    print(f"\nbatch: {batch['status']} in {seconds:.1f} s ({args.lines / seconds:.0f} lines/s), "
          f"{ratio:.3f}x the engine alone; every line once: {once}; worst cosine distance to "
          f"the engine's vectors: {worst:.2e}; {'; '.join(notes) or 'no kills'}")  # fmt: skip
    if not args.kills:  # a restarted process's counter starts again: only undisturbed runs add up
        per_k = 1000 / args.lines
        shares = ", ".join(
            f"{name} {(cpu_spent[name] - cpu_before[name]) * per_k:.2f}" for name in cpu_spent
        )
        print(f"CPU s per 1,000 lines: engine alone {engine_cpu * per_k:.2f}; batch: {shares}")
    peaks = ", ".join(f"{name} {mb:.0f}" for name, mb in sorted(system.peaks.items()))
    print(f"peak RSS MiB: engine alone {engine_peak:.0f}; {peaks}; redis {redis_peak:.0f}")
    print(f"logs: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
