"""vLLM users' scripts run with only the import changed: the snippets below follow vLLM's docs
(offline inference, the async engine's streaming, beam search, prompt dicts) on the default
model, and assert what a vLLM user reads from them."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine import (
    LLM,
    AsyncEngineArgs,
    AsyncLLMEngine,
    BeamSearchParams,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
    async_llm,
)
from engine.config import EngineConfig
from engine.outputs import EngineRequest, RequestDelta, RequestMetrics

pytestmark = pytest.mark.model

PROMPTS = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
    "Water boils at",
]
MAX_TOKENS = 10
# float32 on both engines, so the async engine's greedy tokens equal the offline engine's
ENGINE_ARGS = dict(max_model_len=512, dtype="float32")


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> Iterator[LLM]:
    llm = LLM(str(default_model_path), **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def async_engine(default_model_path: Path) -> Iterator[AsyncLLMEngine]:
    # As vLLM's docs build it, plus our float32
    engine_args = AsyncEngineArgs(
        model=str(default_model_path),
        gpu_memory_utilization=0.5,
        disable_log_stats=False,
        **ENGINE_ARGS,
    )
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    yield engine
    engine.shutdown()


def greedy(**extra: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def offline_greedy(llm: LLM) -> list[RequestOutput]:
    return llm.generate(PROMPTS, greedy(), use_tqdm=False)


# ---- offline inference -----------------------------------------------------------------------


def test_offline_inference_quickstart(llm: LLM) -> None:
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS, seed=0)
    outputs = llm.generate(PROMPTS, sampling_params)
    tokenizer = llm.get_tokenizer()
    assert [output.prompt for output in outputs] == PROMPTS
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        generated = output.outputs[0]
        assert output.finished
        assert output.prompt_token_ids == tokenizer.encode(prompt)
        assert 1 <= len(generated.token_ids) <= MAX_TOKENS
        assert generated.text == tokenizer.decode(generated.token_ids, skip_special_tokens=True)
        assert generated.finish_reason in ("stop", "length")


def test_prompt_dicts_and_token_ids_mix_in_one_call(
    llm: LLM, offline_greedy: list[RequestOutput]
) -> None:
    token_ids = llm.get_tokenizer().encode(PROMPTS[0])
    prompts = [
        TokensPrompt(prompt_token_ids=token_ids),
        {"prompt": PROMPTS[1]},
        TextPrompt(prompt=PROMPTS[2]),
        PROMPTS[3],
        {"prompt_token_ids": llm.get_tokenizer().encode(PROMPTS[4])},
    ]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in offline_greedy]
    assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in offline_greedy]
    assert outputs[0].prompt is None and outputs[1].prompt == PROMPTS[1]
    single = llm.generate({"prompt": PROMPTS[2]}, greedy(), use_tqdm=False)
    assert single[0].outputs[0].text == offline_greedy[2].outputs[0].text


@pytest.mark.parametrize(
    ("prompt", "named"),
    [
        ({"prompt": "hi", "multi_modal_data": {"image": None}}, "multi_modal_data"),
        ({"text": "hi"}, "text"),
        ({"prompt_token_ids": ["a"]}, "prompt_token_ids"),
        (3.5, "prompt"),
    ],
)
def test_prompt_forms_it_cannot_serve_are_refused_by_name(
    llm: LLM, prompt: object, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        llm.generate([prompt], greedy(), use_tqdm=False)  # type: ignore[list-item]


def test_beam_search_returns_vllm_shaped_sequences(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    prompt_ids = tokenizer.encode(PROMPTS[2])
    outputs = llm.beam_search([{"prompt": PROMPTS[2]}, {"prompt_token_ids": prompt_ids}], params)
    assert len(outputs) == 2
    by_text, by_ids = outputs
    assert [s.tokens for s in by_text.sequences] == [s.tokens for s in by_ids.sequences]
    assert len(by_text.sequences) == 3
    for sequence in by_text.sequences:
        # vLLM's beams hold the prompt and its text is the whole sequence decoded
        assert sequence.tokens[: len(prompt_ids)] == prompt_ids
        assert len(sequence.tokens) == len(prompt_ids) + 8
        assert sequence.text == tokenizer.decode(sequence.tokens)
        assert sequence.text.startswith(PROMPTS[2])
        # the score is the sum of the generated tokens' logprobs, as one prefill computes them
        scored = llm.engine.token_logprobs(sequence.tokens)[len(prompt_ids) - 1 :]
        assert sequence.cum_logprob == pytest.approx(scored.sum().item(), abs=1e-3)
    scores = [s.cum_logprob for s in by_text.sequences]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(s.tokens) for s in by_text.sequences}) == 3


# ---- the async engine ------------------------------------------------------------------------


async def stream(
    engine: AsyncLLMEngine, prompt: str, params: SamplingParams, request_id: str
) -> list[RequestOutput]:
    """vLLM's docs pattern: `async for output in engine.generate(...)`."""
    results = []
    async for request_output in engine.generate(prompt, params, request_id=request_id):
        results.append(request_output)
    return results


@pytest.mark.anyio
async def test_five_concurrent_streams_grow_and_finish_as_offline(
    async_engine: AsyncLLMEngine, offline_greedy: list[RequestOutput]
) -> None:
    runs = await asyncio.gather(
        *(stream(async_engine, p, greedy(), f"req-{i}") for i, p in enumerate(PROMPTS))
    )
    for outputs, offline in zip(runs, offline_greedy, strict=True):
        assert len(outputs) > 1  # streamed, not handed over at the end
        texts = [o.outputs[0].text for o in outputs]
        for before, after in itertools.pairwise(texts):
            assert after.startswith(before)
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        last = outputs[-1]
        assert last.outputs[0].text == offline.outputs[0].text
        assert last.outputs[0].token_ids == offline.outputs[0].token_ids
        assert last.outputs[0].finish_reason == "length"
        assert last.prompt_token_ids == offline.prompt_token_ids
        assert outputs[0].prompt_token_ids == offline.prompt_token_ids


@pytest.mark.anyio
async def test_delta_outputs_concatenate_to_the_cumulative_text(
    async_engine: AsyncLLMEngine, offline_greedy: list[RequestOutput]
) -> None:
    delta = greedy(output_kind=RequestOutputKind.DELTA)
    runs = await asyncio.gather(
        *(stream(async_engine, p, delta, f"delta-{i}") for i, p in enumerate(PROMPTS))
    )
    for outputs, offline in zip(runs, offline_greedy, strict=True):
        assert len(outputs) > 1
        pieces = [o.outputs[0] for o in outputs if o.outputs]
        assert "".join(p.text for p in pieces) == offline.outputs[0].text
        assert [t for p in pieces for t in p.token_ids] == offline.outputs[0].token_ids
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    final_only = greedy(output_kind=RequestOutputKind.FINAL_ONLY)
    (only,) = await stream(async_engine, PROMPTS[0], final_only, "final-only")
    assert only.finished and only.outputs[0].text == offline_greedy[0].outputs[0].text


@pytest.mark.anyio
async def test_each_output_of_an_n_2_stream_holds_both_choices(
    async_engine: AsyncLLMEngine,
) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = await stream(async_engine, PROMPTS[3], params, "two-choices")
    assert all([c.index for c in o.outputs] == [0, 1] for o in outputs)
    assert outputs[-1].finished
    assert [len(c.token_ids) for c in outputs[-1].outputs] == [MAX_TOKENS, MAX_TOKENS]


@pytest.mark.anyio
async def test_abort_stops_a_request_and_frees_its_id(async_engine: AsyncLLMEngine) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outputs = []
    other = asyncio.create_task(stream(async_engine, PROMPTS[1], greedy(), "bystander"))
    async for output in async_engine.generate(PROMPTS[0], long, request_id="to-abort"):
        outputs.append(output)
        if len(outputs) == 2:
            await async_engine.abort("to-abort")
    last = outputs[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert len(last.outputs[0].token_ids) < 200
    assert (await other)[-1].outputs[0].finish_reason == "length"  # the others go on
    # A consumer that leaves the loop aborts its request too.
    async for _ in async_engine.generate(PROMPTS[0], long, request_id="to-abort"):
        break
    await asyncio.sleep(0)
    for _ in range(200):  # the engine drops both requests within a step or two
        if not async_engine.engine.has_unfinished():
            break
        await asyncio.sleep(0.02)
    assert not async_engine.engine.has_unfinished()


@pytest.mark.anyio
async def test_a_duplicate_request_id_is_refused_never_merged(
    async_engine: AsyncLLMEngine, offline_greedy: list[RequestOutput]
) -> None:
    first = async_engine.generate(PROMPTS[0], greedy(), request_id="same")
    outputs = [await first.__anext__()]
    with pytest.raises(ValueError, match="'same' is already running"):
        await async_engine.generate(PROMPTS[1], greedy(), request_id="same").__anext__()
    outputs += [output async for output in first]
    assert len(outputs[-1].outputs) == 1
    assert outputs[-1].outputs[0].text == offline_greedy[0].outputs[0].text
    # once finished, the id is free again
    again = await stream(async_engine, PROMPTS[0], greedy(), "same")
    assert again[-1].outputs[0].text == offline_greedy[0].outputs[0].text


@pytest.mark.anyio
async def test_a_refused_request_fails_alone(async_engine: AsyncLLMEngine) -> None:
    too_long = {"prompt_token_ids": [1] * 600}
    with pytest.raises(ValueError, match="context"):
        async for _ in async_engine.generate(too_long, greedy(), request_id="too-long"):
            pass
    fine = await stream(async_engine, PROMPTS[0], greedy(), "after-refusal")
    assert fine[-1].finished


class _FailingEngine:
    """Takes requests, then fails its first step."""

    tokenizer = None
    runner = SimpleNamespace(tp_ranks=None)

    def __init__(self, config: EngineConfig) -> None:
        self.outputs = SimpleNamespace(requests={})

    def add_request(self, new: EngineRequest) -> None:
        state = SimpleNamespace(prompt_token_ids=[1, 2], metrics=RequestMetrics(0.0))
        self.outputs.requests[new.request_id] = state

    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests)

    def step(self) -> list[RequestDelta]:
        raise RuntimeError("the device fell over")


@pytest.mark.anyio
async def test_a_failed_engine_fails_every_stream_and_refuses_new_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(async_llm, "start_engine", _FailingEngine)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model="m"))
    streams = [stream(engine, p, greedy(), f"doomed-{i}") for i, p in enumerate(PROMPTS[:3])]
    results = await asyncio.gather(*streams, return_exceptions=True)
    assert all(isinstance(r, async_llm.EngineDeadError) for r in results)
    assert "the device fell over" in str(results[0])
    assert engine.errored and not engine.is_running
    with pytest.raises(async_llm.EngineDeadError):
        await stream(engine, PROMPTS[0], greedy(), "too-late")
    engine.shutdown()


# ---- engine arguments ------------------------------------------------------------------------


def test_engine_args_take_vllm_names_and_refuse_unknown_ones() -> None:
    config = AsyncEngineArgs(
        model="m", num_gpu_blocks_override=64, trust_remote_code=True, max_num_seqs=8
    ).create_engine_config()
    assert (config.num_kv_blocks, config.max_num_seqs) == (64, 8)
    with pytest.raises(TypeError, match="no_such_argument"):
        AsyncEngineArgs(model="m", no_such_argument=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        AsyncEngineArgs(model="m", pipeline_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="dtype"):
        AsyncEngineArgs(model="m", kv_cache_dtype="fp8").create_engine_config()
    with pytest.raises(TypeError, match="no_such_argument"):
        LLM("m", no_such_argument=1)
