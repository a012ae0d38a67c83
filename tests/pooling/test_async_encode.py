"""AsyncLLM.encode as vLLM's async engine has it, on the shipped MiniLM: concurrent callers on
one event loop each get one finished output equal to LLM.embed's vector for the same text."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine import AsyncEngineArgs, AsyncLLMEngine
from engine.llm import LLM
from engine.pooling.outputs import PoolingRequestOutput
from schemas.pooling import PoolingParams

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings turn text into vectors",
    "a",
    "Queues that never lose a line are what bulk indexing needs. " * 6,
    "Ünïcödé text, émojis 🚀 and numbers 12345",
]


@pytest.fixture(scope="module")
def async_minilm(minilm_path: Path) -> Iterator[AsyncLLMEngine]:
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(minilm_path)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(minilm_path: Path) -> list[list[float]]:
    llm = LLM(str(minilm_path))
    return [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]


async def encode_all(
    engine: AsyncLLMEngine, prompt: object, request_id: str, params: PoolingParams | None = None
) -> list[PoolingRequestOutput]:
    return [out async for out in engine.encode(prompt, params, request_id=request_id)]


@pytest.mark.anyio
async def test_concurrent_encodes_equal_llm_embed(
    async_minilm: AsyncLLMEngine, offline: list[list[float]]
) -> None:
    runs = await asyncio.gather(
        *(encode_all(async_minilm, text, f"enc-{i}") for i, text in enumerate(TEXTS))
    )
    for index, outputs in enumerate(runs):
        (output,) = outputs  # one output per request, finished
        assert output.finished and output.request_id == f"enc-{index}"
        expected = torch.tensor(offline[index])
        assert F.cosine_similarity(output.outputs.data, expected, dim=0) > 1 - 1e-6
        assert torch.allclose(torch.tensor(output.outputs.embedding), expected, atol=1e-5)
        tokenizer = await async_minilm.get_tokenizer()
        assert output.prompt_token_ids == tokenizer.encode(TEXTS[index])


@pytest.mark.anyio
async def test_prompt_forms_and_dimensions(
    async_minilm: AsyncLLMEngine, offline: list[list[float]]
) -> None:
    tokenizer = await async_minilm.get_tokenizer()
    ids = tokenizer.encode(TEXTS[1])
    (by_dict,) = await encode_all(async_minilm, {"prompt_token_ids": ids}, "dict")
    assert torch.allclose(by_dict.outputs.data, torch.tensor(offline[1]), atol=1e-5)
    (short,) = await encode_all(async_minilm, TEXTS[1], "dims", PoolingParams(dimensions=32))
    assert short.outputs.data.shape == (32,)


@pytest.mark.anyio
async def test_duplicate_id_refused_and_a_bad_input_fails_alone(
    async_minilm: AsyncLLMEngine, offline: list[list[float]]
) -> None:
    first = async_minilm.encode(TEXTS[0], None, request_id="same")
    pending = asyncio.ensure_future(first.__anext__())
    await asyncio.sleep(0)  # the first request is now running
    with pytest.raises(ValueError, match="'same' is already running"):
        await async_minilm.encode(TEXTS[1], None, request_id="same").__anext__()
    output = await pending
    assert torch.allclose(output.outputs.data, torch.tensor(offline[0]), atol=1e-5)
    await first.aclose()
    with pytest.raises(ValueError, match="exceeds"):
        await encode_all(async_minilm, TEXTS[0], "too-wide", PoolingParams(dimensions=10_000))
    (again,) = await encode_all(async_minilm, TEXTS[2], "same")  # the id is free again
    assert torch.allclose(again.outputs.data, torch.tensor(offline[2]), atol=1e-5)


@pytest.mark.anyio
async def test_generate_on_a_pooling_model_is_refused(async_minilm: AsyncLLMEngine) -> None:
    with pytest.raises(ValueError, match="encode"):
        await async_minilm.generate("hi", None, request_id="g").__anext__()
