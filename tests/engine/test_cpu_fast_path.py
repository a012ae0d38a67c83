"""The CPU fast path: compiled forward glue and the C++ decode kernel, each with its fallback.

Compiling and building are optimisations: outputs must not change with them, and when either
fails the engine must keep serving on the plain-torch path, saying so once in the log.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.platforms.cpu import glue as cpu_glue
from kernels import cpu_ops
from schemas.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 9, 17, 3, 250, 42, 8], [1, 2, 3], list(range(40, 75))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_compiled_glue_matches_eager(dtype: torch.dtype, num_tokens: int) -> None:
    torch.manual_seed(0)
    hidden, residual = torch.randn(2, num_tokens, 96).to(dtype)
    weight = torch.randn(96).to(dtype)
    q, k = torch.randn(num_tokens, 6 * 16).to(dtype), torch.randn(num_tokens, 2 * 16).to(dtype)
    cos, sin = torch.randn(2, num_tokens, 1, 16).to(dtype)
    gate_up = torch.randn(num_tokens, 2 * 40).to(dtype)
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    )
    compiled, eager = cpu_glue.compiled(dtype), cpu_glue.EAGER
    with torch.inference_mode():
        pairs = [
            (glue.rms_norm(hidden, weight, 1e-5) for glue in (compiled, eager)),
            (glue.add_rms_norm(hidden, residual, weight, 1e-5) for glue in (compiled, eager)),
            (glue.rotate(q, k, cos, sin, 16) for glue in (compiled, eager)),
            (glue.silu_and_mul(gate_up) for glue in (compiled, eager)),
        ]
        for got, expected in pairs:
            torch.testing.assert_close(got, expected, **tolerance)


def _llm(model_dir: Path, **engine_args: bool) -> LLM:
    # fp32, where two ways of computing the same forward must give the same greedy tokens (bf16
    # rounds differently along different paths, and near-ties flip)
    return LLM(str(model_dir), dtype="float32", **engine_args)


def _greedy_tokens(llm: LLM) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_compiled_forward_generates_what_the_eager_one_does(tiny_llama_dir: Path) -> None:
    eager = _llm(tiny_llama_dir, enforce_eager=True)
    compiled = _llm(tiny_llama_dir)
    compiled.engine.runner.platform.compiled_glue_min_tokens = 1  # every step, whatever measured
    assert _greedy_tokens(compiled) == _greedy_tokens(eager)


def test_a_failed_compile_leaves_the_engine_eager_and_working(
    tiny_llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(*_: object) -> int:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setenv("INFERQ_HOME", str(tmp_path / "home"))  # nothing measured before
    monkeypatch.setattr(cpu_glue, "min_tokens_for_compiled", broken)
    with caplog.at_level(logging.WARNING):
        llm = _llm(tiny_llama_dir)
    assert llm.engine.runner.platform.compiled_glue_min_tokens is None
    assert "compiling the CPU forward failed (RuntimeError: no C++ compiler)" in caplog.text
    assert _greedy_tokens(llm) == _greedy_tokens(_llm(tiny_llama_dir, enforce_eager=True))


def test_a_function_the_compiler_rejects_runs_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    def untraceable(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # a whole-graph compile cannot get past this
        return x * 2

    call = cpu_glue._compiled_or_eager(untraceable)
    x = torch.arange(6.0)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(call(x), x * 2)
        assert torch.equal(call(x), x * 2)
    assert caplog.text.count("compiled untraceable failed") == 1


def test_without_the_decode_kernel_decoding_gathers_and_agrees(
    tiny_llama_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torch.utils import cpp_extension

    assert cpu_ops.cpu_kernels_available()
    with_kernel = _greedy_tokens(_llm(tiny_llama_dir, enforce_eager=True))

    def no_ninja(**_: object) -> None:
        raise RuntimeError("ninja not found")

    monkeypatch.setattr(cpp_extension, "load", no_ninja)
    # a machine that never built them: nothing to load, and building fails
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "no-builds"))
    cpu_ops.cpu_kernels_available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            gathered = _greedy_tokens(_llm(tiny_llama_dir, enforce_eager=True))
        assert not cpu_ops.cpu_kernels_available()
    finally:
        cpu_ops.cpu_kernels_available.cache_clear()  # the next caller builds (loads) again
    assert "CPU attention kernels unavailable (ninja not found)" in caplog.text
    assert gathered == with_kernel


def test_where_compiling_never_pays_later_starts_do_not_compile(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERQ_HOME", str(tmp_path / "home"))
    measured: list[object] = []

    def never_pays(*args: object) -> None:
        measured.append(args)
        return None

    monkeypatch.setattr(cpu_glue, "min_tokens_for_compiled", never_pays)
    first = _llm(tiny_llama_dir)
    assert first.engine.runner.platform.compiled_glue_min_tokens is None and len(measured) == 1
    assert list((tmp_path / "home" / "cpu_glue").glob("*.json"))

    monkeypatch.setattr(cpu_glue, "compile_now", lambda *_: pytest.fail("compiled again"))
    second = _llm(tiny_llama_dir)
    assert second.engine.runner.platform.compiled_glue_min_tokens is None
    assert len(measured) == 1  # the second start read the first one's answer
