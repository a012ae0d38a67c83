"""`inferq batch submit` against the API (fake engine), and `inferq batch run --local` on the
default model: progress bar, Ctrl-C, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from cli.main import main
from tests.api.conftest import ALICE_KEY
from tests.batch.conftest import BatchStack
from tests.batch.real_system import MAX_MODEL_LEN, MODEL, REPO, completion_line
from tests.batch.test_batch_api import completion_line as fake_line
from tests.batch.test_batch_api import expected_text


def test_submit_waits_with_a_progress_bar_and_downloads_the_files(
    batch_stack: BatchStack, tmp_path: Path, capsys
):
    prompts = {f"s-{i}": f"submit {i}" for i in range(12)}
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([*(fake_line(c, p) for c, p in prompts.items()), "oops"]) + "\n")
    batch_stack.start_worker()
    batch_stack.start_controller()
    out = tmp_path / "out.jsonl"
    argv = ["batch", "submit", str(source), "-o", str(out), "--poll", "0.1"]
    argv += ["--api-url", batch_stack.api.url, "--api-key", ALICE_KEY]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().startswith("batch_")
    assert "13/13" in captured.err and "done=12" in captured.err and "failed=1" in captured.err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records} == {
        c: expected_text(p) for c, p in prompts.items()
    }
    (error,) = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert error["error"]["line"] == 13


def test_submit_reports_a_refused_file(batch_stack: BatchStack, tmp_path: Path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text("not json\n")
    argv = ["batch", "submit", str(source), "--api-url", batch_stack.api.url]
    assert main([*argv, "--api-key", ALICE_KEY]) == 2
    assert "no valid request line" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.model
def test_local_run_shows_progress_and_resumes_after_ctrl_c(tmp_path: Path):
    from engine import LLM, SamplingParams

    prompts = [f"Line {i}: name a fruit that starts with {chr(65 + i % 26)}." for i in range(200)]
    lines = [completion_line(f"l-{i}", p, 4) for i, p in enumerate(prompts)]
    lines.insert(50, '{"custom_id": "bad"')
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    command = [
        sys.executable, "-m", "cli", "--log-level", "warning", "batch", "run", str(source),
        "-o", str(out), "--local", "--max-model-len", str(MAX_MODEL_LEN),
    ]  # fmt: skip
    env = {**os.environ, "INFERQ_NUM_THREADS": "2"}
    first = subprocess.Popen(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    give_up = time.monotonic() + 300
    while not out.exists() or len(out.read_text().splitlines()) < 32:
        assert first.poll() is None, first.stderr.read()
        assert time.monotonic() < give_up
        time.sleep(0.2)
    first.send_signal(signal.SIGINT)
    _, first_err = first.communicate(timeout=120)
    assert first.returncode == 130, first_err
    assert "interrupted" in first_err and "/201" in first_err  # tqdm: done/total, rate, ETA
    partial = len(out.read_text().splitlines())
    assert 32 <= partial < 200

    second = subprocess.run(command, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    assert second.returncode == 0, second.stderr
    assert f"{partial + 1}/201" in second.stderr  # resumed after what was done
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert Counter(r["custom_id"] for r in records) == Counter({f"l-{i}": 1 for i in range(200)})
    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN)
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    texts = {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records}
    assert texts == {f"l-{i}": o.outputs[0].text for i, o in enumerate(want)}
    errors = (tmp_path / "out.errors.jsonl").read_text().splitlines()
    assert len(errors) == 1 and json.loads(errors[0])["error"]["line"] == 51
