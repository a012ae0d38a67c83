"""Decode steps on the CPU run every decoder layer in one C++ call: same outputs, fewer calls.

The C++ stack calls the same kernels as the Python forward, in the same order, so greedy
tokens and their log-probabilities must be equal, not merely close, for every way a linear
layer can be stored (plain, packed for oneDNN or MKL, int8 or int4 codes) and both dtypes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.layers.linear import Linear, NativeLinear
from engine.platforms.cpu import decode_stack
from engine.platforms.cpu.matmul import available_backends
from kernels import cpu_ops
from kernels.cpu_ops import LinearKind
from schemas.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=True)

pytestmark = pytest.mark.skipif(
    not cpu_ops.cpu_kernels_available(), reason="the CPU kernels need a C++ compiler"
)


def _prompts(count: int) -> list[list[int]]:
    return [[(7 * i + j) % 250 + 3 for j in range(5 + i % 9)] for i in range(count)]


def _outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    results = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [
        (
            list(out.outputs[0].token_ids),
            [entry.logprob for entry in out.outputs[0].logprobs or []],
        )
        for out in results
    ]


@pytest.fixture
def stack_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Row counts of the steps the C++ stack ran."""
    calls: list[int] = []
    original = cpu_ops.decode_layers

    def counted(hidden, *args):  # type: ignore[no-untyped-def]
        calls.append(hidden.shape[0])
        return original(hidden, *args)

    monkeypatch.setattr(decode_stack.cpu_ops, "decode_layers", counted)
    yield calls


def _with_and_without_stack(
    llm: LLM, prompts: list[list[int]]
) -> tuple[list[tuple[list[int], list[float]]], list[tuple[list[int], list[float]]]]:
    model = llm.engine.runner.model.model
    stack = model.cpu_decode_stack
    assert stack is not None
    with_stack = _outputs(llm, prompts)
    model.cpu_decode_stack = None
    try:
        without = _outputs(llm, prompts)
    finally:
        model.cpu_decode_stack = stack
    return with_stack, without


@pytest.mark.parametrize(
    "engine_args",
    [
        {"dtype": "float32", "cpu_matmul": "aten"},
        {"dtype": "float32", "cpu_matmul": "onednn_packed"},
        {"dtype": "float32", "cpu_matmul": "mkl_packed"},
        {"dtype": "float32", "cpu_matmul": "panels"},
        {"dtype": "bfloat16", "cpu_matmul": "aten"},
        {"dtype": "bfloat16", "cpu_matmul": "panels"},
        {"dtype": "float32", "quantization": "int8"},
        {"dtype": "float32", "quantization": "w8a8"},
        {"dtype": "float32", "quantization": "int4"},
        {"dtype": "bfloat16", "quantization": "int4"},
    ],
    ids=lambda args: "-".join(str(v) for v in args.values()),
)
def test_decode_stack_gives_the_python_forwards_tokens_and_logprobs(
    tiny_llama_dir: Path, engine_args: dict[str, str], stack_calls: list[int]
) -> None:
    backend = engine_args.get("cpu_matmul")
    dtype = getattr(torch, engine_args["dtype"])
    if backend is not None and backend not in available_backends(dtype):
        pytest.skip(f"{backend} does not run on this CPU")
    llm = LLM(str(tiny_llama_dir), **engine_args)
    with_stack, without = _with_and_without_stack(llm, _prompts(3))
    assert stack_calls, "no decode step ran through the C++ stack"
    assert with_stack == without


def test_projection_biases_and_tied_embeddings_go_through_the_stack(
    tiny_qwen2_dir: Path, stack_calls: list[int]
) -> None:
    llm = LLM(str(tiny_qwen2_dir), dtype="float32")
    with_stack, without = _with_and_without_stack(llm, _prompts(3))
    assert stack_calls
    assert with_stack == without


@pytest.mark.parametrize(
    "engine_args",
    [{"cpu_matmul": "onednn_packed"}, {"quantization": "w8a8"}],
    ids=["onednn_packed", "w8a8"],
)
def test_decode_batches_above_the_small_call_size_use_the_large_backend(
    tiny_llama_dir: Path, engine_args: dict[str, str], stack_calls: list[int]
) -> None:
    # More sequences than SMALL_ROWS: the matmul plan's other backend, built as its own spec;
    # for w8a8 the calls that quantize activations.
    llm = LLM(str(tiny_llama_dir), dtype="float32", **engine_args)
    with_stack, without = _with_and_without_stack(llm, _prompts(24))
    assert max(stack_calls) > 16
    assert with_stack == without


def test_only_decode_only_steps_take_the_stack(
    tiny_llama_dir: Path, stack_calls: list[int]
) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    llm.generate(_prompts(2), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # Two prompts prefill in one step, then three decode steps of both sequences.
    assert stack_calls == [2, 2, 2]


def test_a_layer_without_a_cpp_path_keeps_the_python_forward(
    tiny_llama_dir: Path,
    stack_calls: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    model = llm.engine.runner.model.model
    down = model.layers[-1].mlp.down_proj
    native_spec = Linear.native_spec

    def without_down(self: Linear, rows: int) -> NativeLinear | None:
        return None if self is down else native_spec(self, rows)  # as fp8 weights answer

    monkeypatch.setattr(Linear, "native_spec", without_down)
    got = _outputs(llm, _prompts(2))
    assert stack_calls == []
    model.cpu_decode_stack = None
    assert got == _outputs(llm, _prompts(2))


def test_a_linear_kind_the_cpp_stack_does_not_know_stops_the_step(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The C++ stack reads each kind by the value Python's LinearKind gives it; one past them is
    # refused, not computed as some other kind.
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    native_spec = Linear.native_spec
    unknown = max(LinearKind) + 1

    def unknown_kind(self: Linear, rows: int) -> NativeLinear | None:
        spec = native_spec(self, rows)
        return None if spec is None else dataclasses.replace(spec, kind=unknown)

    monkeypatch.setattr(Linear, "native_spec", unknown_kind)
    with pytest.raises(RuntimeError, match=f"unknown linear kind {unknown}"):
        _outputs(llm, _prompts(2))
