"""The CPU launcher restarts a process once under a caching allocator, keeping its command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.cpu_runtime import find_allocator

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import json, os, sys
from engine.cpu_runtime import reexec_with_cpu_runtime
reexec_with_cpu_runtime(2, bind_threads={bind})
print(json.dumps({{"argv": sys.argv[1:], "tuned": os.environ.get("INFERQ_CPU_RUNTIME_TUNED"),
                  "preload": os.environ.get("LD_PRELOAD", ""),
                  "bind": os.environ.get("OMP_PROC_BIND"),
                  "threads": os.environ.get("OMP_NUM_THREADS")}}))
"""


def _run_probe(tmp_path: Path, bind: bool, **env: str) -> dict:
    (tmp_path / "probe.py").write_text(PROBE.format(bind=bind))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "KMP_"))}
    clean.pop("LD_PRELOAD", None)
    clean.pop("INFERQ_CPU_RUNTIME_TUNED", None)
    result = subprocess.run(
        [sys.executable, "-m", "probe", "one", "--two"],
        cwd=tmp_path,
        env={**clean, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_reexec_keeps_the_command_line_and_preloads_the_allocator(tmp_path: Path) -> None:
    seen = _run_probe(tmp_path, bind=False)
    assert seen["argv"] == ["one", "--two"]  # `python -m probe one --two` ran again as is
    assert seen["tuned"] == "1"
    allocator = find_allocator()
    assert seen["preload"] == (allocator or "")
    assert seen["bind"] is None  # a process sharing the host does not pin threads
    assert seen["threads"] == "2"


def test_binding_only_when_asked_and_opt_out(tmp_path: Path) -> None:
    assert _run_probe(tmp_path, bind=True)["bind"] == "close"
    untouched = _run_probe(tmp_path, bind=True, INFERQ_CPU_TUNE="0")
    assert untouched["tuned"] is None and untouched["preload"] == ""
