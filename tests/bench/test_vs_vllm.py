"""bench/engine/vs_vllm.py: the workload it gives every system, the tuning it gives vLLM, and a whole
run through `inferq bench vs-vllm` on a tiny random model without a vLLM venv (skipped with a
message saying why and how to get one; inferq's figures still reported)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from bench.engine import vs_vllm
from tests.engine.conftest import save_tiny_model

REPO = Path(__file__).resolve().parents[2]


def test_default_workload_is_the_documented_one(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"vocab_size": 49152, "max_position_embeddings": 8192})
    )
    job, _ = vs_vllm.build_job(vs_vllm.parse_args([]), tmp_path)

    assert len(job["prompts"]) == len(job["output_lens"]) == 64
    assert all(32 <= len(p) <= 256 for p in job["prompts"])
    assert all(16 <= n <= 128 for n in job["output_lens"])
    assert len(job["decode_prompt"]) == 128 and job["decode_tokens"] == 256
    assert job["max_model_len"] == 1024 and job["dtype"] == "float32"
    # the same arguments give the same token prompts: every system sees one workload
    assert vs_vllm.build_job(vs_vllm.parse_args([]), tmp_path)[0] == job


def test_vllm_gets_its_documented_cpu_tuning(tmp_path: Path, monkeypatch) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    cores = sorted(os.sched_getaffinity(0))

    env = vs_vllm.vllm_env(python, len(cores))

    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    bound: set[int] = set()
    for span in env["VLLM_CPU_OMP_THREADS_BIND"].split(","):  # e.g. "0-3,8-11"
        low, _, high = span.partition("-")
        bound |= set(range(int(low), int(high or low) + 1))
    assert bound == set(cores)  # all its compute threads, one per usable core
    assert env["LD_PRELOAD"].endswith(str(tmp_path / "venv" / "lib" / "libiomp5.so"))
    assert "PYTHONPATH" not in env  # inferq's packages stay out of vLLM's process


def test_without_vllm_it_says_so_and_still_reports_inferq(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "tiny", vocab_size=512)
    missing = tmp_path / "no-venv" / "bin" / "python"
    report = tmp_path / "vs_vllm.json"
    sizes = ["--num-requests", "4", "--input-range", "8-16", "--output-range", "2-4"]
    single = ["--decode-prompt-len", "8", "--decode-tokens", "8", "--rounds", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "vs-vllm", "--model", str(model), *sizes,
         *single, "--vllm-python", str(missing), "--json", str(report)],
        cwd=REPO,
        env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"),
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    assert f"vLLM skipped: --vllm-python {missing} is not an executable file" in done.stdout
    assert "install.sh" in done.stdout
    data = json.loads(report.read_text())
    assert list(data["systems"]) == ["inferq"] and data["ratios"] is None
    inferq = data["systems"]["inferq"]
    assert len(inferq["runs"]) == 2 and inferq["info"]["dtype"] == "float32"
    median = inferq["median"]
    assert all(math.isfinite(median[k]) and median[k] > 0 for k in vs_vllm.FIGURES)
    row = next(line for line in done.stdout.splitlines() if line.startswith("inferq "))
    assert f"{median['output_tok_s']:.1f}" in row
    assert f"{median['decode_ms_per_token']:.2f}" in row
