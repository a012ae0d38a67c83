"""A replica whose ranks torchrun starts (the multi-machine path, here on one machine): the same
script runs on every rank, only the driver generates, and it generates what one device does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.llm import LLM
from schemas.sampling import SamplingParams

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, os, sys
from engine.llm import LLM
from schemas.sampling import SamplingParams

llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", num_threads=1,
          enforce_eager=True, num_kv_blocks=64)
# Only the driver gets here: LLM(...) serves the driver's steps on the other rank, then exits.
out = llm.generate([list(range(5, 30)), list(range(40, 52))],
                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
with open(sys.argv[2], "w") as f:
    json.dump({"rank": os.environ["RANK"], "ids": [o.outputs[0].token_ids for o in out]}, f)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_torchrun_started_ranks_generate_like_one_device(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model_factory("llama")
    # The one-device reference first: it builds the C++ kernels (minutes on a cold cache, once
    # per source change), so the ranks only load them and the wait below is the ranks' own.
    single = LLM(
        str(model), device="cpu", dtype="float32", num_threads=1, enforce_eager=True
    ).generate(
        [list(range(5, 30)), list(range(40, 52))],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT)
    result = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(script),
        str(model),
        str(result),
    ]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    sharded = json.loads(result.read_text())
    assert sharded["rank"] == "0"
    assert sharded["ids"] == [o.outputs[0].token_ids for o in single]
