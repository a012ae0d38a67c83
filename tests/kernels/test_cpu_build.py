"""The CPU kernels are built once per machine and reused by every process, clone and command:
a second checkout of the same sources loads the finished library without compiling."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernels import cpu_build, cpu_ops

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not cpu_ops.cpu_kernels_available(), reason="the CPU kernels cannot be built here"
)


def _run_in(clone: Path, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(clone)}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_another_clone_of_the_same_sources_loads_the_build_without_compiling(
    tmp_path: Path,
) -> None:
    clone = tmp_path / "elsewhere"
    shutil.copytree(REPO / "kernels", clone / "kernels")
    started = time.monotonic()
    # cpp_extension.load is what compiles: the clone must never reach it
    result = _run_in(
        clone,
        "import sys\n"
        "from torch.utils import cpp_extension\n"
        "def refuse(**_):\n"
        "    sys.exit('compiled again')\n"
        "cpp_extension.load = refuse\n"
        "import kernels.cpu_ops as ops\n"
        "assert '/elsewhere/' in ops.__file__, ops.__file__\n"
        "assert ops.cpu_kernels_available()\n"
        "import torch\n"
        "x = torch.randn(3, 8)\n"
        "assert torch.equal(ops.argmax_rows(x), x.argmax(dim=1))\n",
    )
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60  # importing torch, then a dlopen
    assert cpu_build.built_library(cpu_ops.CFLAGS).exists()


def test_the_setup_command_says_the_kernels_are_built(tmp_path: Path) -> None:
    result = _run_in(REPO, "from kernels.cpu_build import main; main()")
    assert result.returncode == 0, result.stderr
    assert "CPU kernels: built already" in result.stdout


def test_a_changed_source_is_a_different_build(tmp_path: Path) -> None:
    clone = tmp_path / "changed"
    shutil.copytree(REPO / "kernels", clone / "kernels")
    greedy = clone / "kernels" / "cpu" / "greedy.cpp"
    greedy.write_text(greedy.read_text() + "\n// changed\n")
    result = _run_in(clone, "from kernels import cpu_ops, cpu_build; print(cpu_ops.build_name())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() != cpu_ops.build_name()
