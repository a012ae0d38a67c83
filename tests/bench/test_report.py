"""bench/suites/report.py end to end in its tiny mode: the results file and plots appear, carrying the
numbers the run measured, and hand-written text around the generated block survives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common.gpu_report import fmt

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.model
pytest.importorskip("matplotlib", reason="the report plots need the bench extra")

HAND_WRITTEN = "## GPU (H100, by hand)\n\nKeep me: 1234 tok/s.\n"


def _run_report(out: Path, *flags: str) -> dict:
    env = dict(os.environ, INFERQ_CPU_TUNE="0", OMP_WAIT_POLICY="PASSIVE")
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "suites" / "report.py"),
            "--tiny",
            "--out",
            str(out),
            *flags,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def _assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


def test_in_process_sections_write_results_and_plots(tmp_path: Path) -> None:
    (tmp_path / "report.md").write_text(f"# results\n\n{HAND_WRITTEN}")
    data = _run_report(tmp_path, "--only", "offline,prefix_cache")
    text = (tmp_path / "report.md").read_text()

    assert HAND_WRITTEN in text  # outside the markers: kept
    assert text.count("<!-- bench-report:start -->") == 1
    assert data["machine"]["CPU"] in text and data["machine"]["torch"] in text
    offline = data["offline"]
    assert offline["ours"]["output_tok_s"] > 0 and offline["transformers_best"]["output_tok_s"] > 0
    assert fmt(offline["ours"]["output_tok_s"]) in text
    assert f"{offline['throughput_ratio']:.2f}x" in text
    prefix = data["prefix_cache"]
    assert prefix["on"]["hit_rate"] > 0 and prefix["off"]["hit_rate"] == 0
    assert prefix["on"]["prompt_tokens_computed"] < prefix["off"]["prompt_tokens_computed"]
    assert f"{prefix['throughput_ratio']:.2f}x" in text
    for png in ("offline_throughput.png", "prefix_cache.png"):
        _assert_png(tmp_path / png)
        assert f"({png})" in text


def test_a_rerun_replaces_only_the_generated_block() -> None:
    from bench.common.markdown_blocks import replace_block

    first = replace_block(f"# results\n\n{HAND_WRITTEN}", "bench-report", "run one: 10 tok/s")
    second = replace_block(first, "bench-report", "run two: 20 tok/s")
    assert HAND_WRITTEN in second and "run two: 20 tok/s" in second
    assert "run one" not in second and second.count("<!-- bench-report:start -->") == 1


@pytest.mark.slow
def test_full_suite_through_redis_api_and_worker(tmp_path: Path) -> None:
    data = _run_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert data["queue"]["queue"]["output_tok_s"] > 0
    assert f"{data['queue']['throughput_ratio']:.3f}" in text
    http = [r for r in data["serving"] if r["mode"] == "http"]
    engine = [r for r in data["serving"] if r["mode"] == "engine"]
    assert len(http) == len(engine) == 2 and all(r["failed"] == 0 for r in http)
    assert fmt(http[-1]["ttft_ms_p50"]) in text and fmt(http[-1]["itl_ms_p90"]) in text
    for png in ("serving_throughput.png", "serving_latency.png", "offline_throughput.png"):
        _assert_png(tmp_path / png)
