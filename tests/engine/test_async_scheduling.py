"""Asynchronous scheduling: the same tokens as the synchronous engine, and the host's work
overlapping the device's (a stand-in device that takes a fixed time per step)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.engine import Engine
from engine.outputs import EngineRequest, RequestOutput
from schemas.structured import StructuredOutput

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colours:",
]


@pytest.fixture(scope="module")
def engines(default_model_path: Path) -> tuple[LLM, LLM]:
    """(synchronous, asynchronous) engines on the default model, float32."""
    args = dict(dtype="float32", enforce_eager=True, max_model_len=512)
    sync = LLM(str(default_model_path), **args)
    asynchronous = LLM(str(default_model_path), async_scheduling=True, **args)
    assert sync.engine.async_steps is None and asynchronous.engine.async_steps is not None
    return sync, asynchronous


def _choices(outputs: list[RequestOutput]) -> list[list[tuple[list[int], str, str | None]]]:
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def _same(engines: tuple[LLM, LLM], params: SamplingParams | list[SamplingParams]) -> int:
    """Assert both engines give the same choices; returns how many of the asynchronous
    engine's steps ran overlapped."""
    sync, asynchronous = engines
    steps = asynchronous.engine.async_steps
    assert steps is not None
    overlapped_before = steps.num_overlapped_steps
    expected = _choices(sync.generate(PROMPTS, params, use_tqdm=False))
    assert _choices(asynchronous.generate(PROMPTS, params, use_tqdm=False)) == expected
    assert not asynchronous.engine.has_unfinished()
    manager = asynchronous.engine.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks  # nothing leaked
    return steps.num_overlapped_steps - overlapped_before


def test_greedy_matches_the_synchronous_engine(engines) -> None:
    assert _same(engines, SamplingParams(temperature=0.0, max_tokens=12)) > 5


def test_stop_strings_eos_and_mixed_lengths_match(engines) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, stop=[" the"] if n % 2 else None)
        for n in (1, 5, 9, 14)
    ]
    _same(engines, params)


def test_seeded_sampling_and_n_choices_match(engines) -> None:
    assert _same(engines, SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10)) > 5
    n_choices = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=8, logprobs=True)
    assert _same(engines, n_choices) > 3  # the first step (forking) is synchronous


def test_steps_that_need_the_host_fall_back_and_match(engines) -> None:
    """Beams, penalties, logit bias and grammars make their steps synchronous."""
    choice = StructuredOutput(choice=["red", "green", "blue"])
    for params in (
        SamplingParams(use_beam_search=True, n=2, temperature=0.0, max_tokens=6),
        SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=8, logit_bias={13: 5.0}),
        SamplingParams(temperature=1.0, seed=1, max_tokens=8, structured_output=choice),
    ):
        assert _same(engines, params) == 0
    # best_of: every candidate runs with logprobs, which need nothing of the host.
    _same(engines, SamplingParams(temperature=1.0, seed=5, n=2, best_of=4, max_tokens=6))


def test_a_batch_mixing_kinds_switches_between_modes_and_matches(engines) -> None:
    """Plain rows overlap while no beam or grammar shares their steps, then resume
    overlapping once those finish."""
    choice = StructuredOutput(choice=["yes", "no"])
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(use_beam_search=True, n=2, temperature=0.0, max_tokens=3),
        SamplingParams(temperature=1.0, seed=2, max_tokens=6, structured_output=choice),
        SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True),
    ]
    assert _same(engines, params) > 5


def test_prompt_logprobs_match(engines) -> None:
    _same(engines, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1))


def test_preemption_matches(default_model_path: Path) -> None:
    args = dict(dtype="float32", enforce_eager=True, num_kv_blocks=12, block_size=16)
    prompts = [p * 3 for p in PROMPTS]
    sync = LLM(str(default_model_path), **args)
    asynchronous = LLM(str(default_model_path), async_scheduling=True, **args)
    for params in (
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=4, max_tokens=40, ignore_eos=True),
    ):
        preempted_before = asynchronous.engine.stats().num_preemptions
        expected = _choices(sync.generate(prompts, params, use_tqdm=False))
        assert _choices(asynchronous.generate(prompts, params, use_tqdm=False)) == expected
        assert asynchronous.engine.stats().num_preemptions > preempted_before


def test_speculation_keeps_synchronous_steps(default_model_path: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    args = dict(dtype="float32", enforce_eager=True, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    expected = _choices(LLM(str(default_model_path), **args).generate(PROMPTS, params))
    asynchronous = LLM(str(default_model_path), async_scheduling=True, **args)
    assert asynchronous.engine.async_steps is None  # speculation proposes from the tokens
    assert _choices(asynchronous.generate(PROMPTS, params, use_tqdm=False)) == expected


def _run_with_abort(engine: Engine, abort_after: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(EngineRequest(f"r{index}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    steps = 0
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
        steps += 1
        if steps == abort_after:
            assert engine.abort("r1")
    return tokens


def test_abort_mid_run_is_exact(engines) -> None:
    sync, asynchronous = engines
    expected = _run_with_abort(sync.engine, abort_after=5)
    got = _run_with_abort(asynchronous.engine, abort_after=5)
    for request_id in ("r0", "r2", "r3"):
        assert got[request_id] == expected[request_id]
    # The aborted request stops at once: nothing of it comes out after the abort, and the
    # asynchronous engine is at most one step behind (its outputs come a step late).
    assert len(got["r1"]) < 16 and got["r1"] == expected["r1"][: len(got["r1"])]
    manager = asynchronous.engine.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks


# ---------------------------------------------------------------------- overlap

HOST_S = 0.04  # host work per step (stands for scheduling, detokenizing, publishing)
DEVICE_S = 0.04  # device work per step


def _stand_in_device(engine: Engine) -> None:
    """The runner's step takes DEVICE_S more on the device, the host's output processing
    HOST_S more: sleeps, which leave the interpreter to the other thread as a device would."""
    execute: Callable = engine.runner.execute
    process: Callable = engine.outputs.process

    def slow_execute(*args, **kwargs):
        time.sleep(DEVICE_S)
        return execute(*args, **kwargs)

    def slow_process(*args, **kwargs):
        time.sleep(HOST_S)
        return process(*args, **kwargs)

    engine.runner.execute = slow_execute  # type: ignore[method-assign]
    engine.outputs.process = slow_process  # type: ignore[method-assign]


def _seconds_per_step(model_dir: Path, async_scheduling: bool) -> float:
    llm = LLM(
        str(model_dir), dtype="float32", enforce_eager=True, async_scheduling=async_scheduling
    )
    _stand_in_device(llm.engine)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # Steady state: the first run pays one-time costs (a GPU's kernel compiles, workspaces).
    llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)
    steps_before = llm.engine.stats().num_steps
    start = time.perf_counter()
    llm.generate([[1, 2, 3, 4]], params, use_tqdm=False)
    return (time.perf_counter() - start) / (llm.engine.stats().num_steps - steps_before)


def test_host_work_overlaps_the_device(tiny_model_factory) -> None:
    """Step time is about max(host, device), not their sum (a functional check with wide
    margins, not a benchmark)."""
    model_dir = tiny_model_factory("llama")
    synchronous = _seconds_per_step(model_dir, async_scheduling=False)
    overlapped = _seconds_per_step(model_dir, async_scheduling=True)
    assert synchronous >= HOST_S + DEVICE_S
    assert overlapped < 0.8 * (HOST_S + DEVICE_S), (overlapped, synchronous)
