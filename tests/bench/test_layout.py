"""bench/ grouped by what it measures: every module imports under its group, every script is
found by `inferq bench NAME` (with or without its group), and the key scripts run as
`python bench/<group>/<name>.py` from the repo root without any PYTHONPATH."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import bench_scripts

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
PROJECT_PACKAGES = {"bench", "cli", "engine", "kernels", "producer_api", "schemas", "worker"}
# started as `python <script> JOB.json` by bench/engine/vs_vllm.py, inside each system's own venv
PEER_SCRIPTS = {"inferq_run.py", "vllm_run.py"}


def _modules() -> list[str]:
    return [
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for path in sorted(BENCH.rglob("*.py"))
        if path.name != "__init__.py" and path.name not in PEER_SCRIPTS
    ]


def _scripts() -> list[Path]:
    return [
        path
        for path in sorted(BENCH.glob("*/*.py"))
        if 'if __name__ == "__main__":' in path.read_text()
    ]


def test_no_python_file_is_left_flat_in_bench() -> None:
    assert sorted(p.name for p in BENCH.glob("*.py")) == ["__init__.py"]


@pytest.mark.parametrize("module", _modules())
def test_every_bench_module_imports_under_its_group(module: str) -> None:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as missing:
        if (missing.name or "").split(".")[0] in PROJECT_PACKAGES:
            raise
        pytest.skip(f"{module} needs {missing.name}, an optional library")


def test_every_benchmark_is_found_by_its_name_alone_and_with_its_group() -> None:
    scripts = _scripts()
    assert len(scripts) >= 15
    for script in scripts:
        name = script.stem.replace("_", "-")
        assert bench_scripts(name) == [script], name
        assert bench_scripts(f"{script.parent.name}/{name}") == [script], name
    assert bench_scripts("no-such-benchmark") == []


@pytest.mark.parametrize(
    ("script", "flag"),
    [("bench/engine/vs_vllm.py", "--vllm-python"), ("bench/system/queue_overhead.py", "--repeats")],
)
def test_key_scripts_run_from_the_repo_root(script: str, flag: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage:") and flag in done.stdout
