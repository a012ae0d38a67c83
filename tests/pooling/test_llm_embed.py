"""LLM.embed / LLM.encode as vLLM writes them: the shipped MiniLM equals sentence-transformers'
own embeddings, and a Qwen3 with last-token pooling equals transformers' last hidden state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.errors import ContextLengthExceededError, RequestRejectedError
from engine.llm import LLM
from schemas.pooling import PoolingParams, PoolingType
from tests.pooling.conftest import save_sentence_transformers_modules, save_tiny_qwen3

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings turn text into vectors",
    "a",
    "Queues that never lose a line are what bulk indexing needs. " * 6,
    "Ünïcödé text, émojis 🚀 and numbers 12345",
]


def cosine_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 1 - F.cosine_similarity(a.double(), b.double(), dim=-1)


@pytest.fixture(scope="module")
def minilm_llm(minilm_path: Path) -> LLM:
    return LLM(str(minilm_path))  # a sentence-transformers folder: detected as pooling


@pytest.fixture(scope="module")
def st_reference(minilm_path: Path) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_path), device="cpu")
    return torch.from_numpy(model.encode(TEXTS, batch_size=2))


def test_minilm_batched_equals_sentence_transformers(
    minilm_llm: LLM, st_reference: torch.Tensor
) -> None:
    outputs = minilm_llm.embed(TEXTS, use_tqdm=False)
    ours = torch.tensor([o.outputs.embedding for o in outputs])
    assert ours.shape == st_reference.shape == (len(TEXTS), 384)
    assert cosine_distance(ours, st_reference).max() < 1e-5
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)  # Normalize


def test_minilm_alone_equals_sentence_transformers(
    minilm_llm: LLM, st_reference: torch.Tensor
) -> None:
    for index, text in enumerate(TEXTS):
        (output,) = minilm_llm.embed(text, use_tqdm=False)
        vector = torch.tensor(output.outputs.embedding)
        assert cosine_distance(vector, st_reference[index]) < 1e-5
        assert output.prompt_token_ids == minilm_llm.tokenizer.encode(text)


def test_runner_and_task_names_as_vllm(minilm_path: Path, st_reference: torch.Tensor) -> None:
    for kwargs in ({"runner": "pooling"}, {"task": "embed"}):
        llm = LLM(str(minilm_path), **kwargs)
        (output,) = llm.encode(TEXTS[0], use_tqdm=False)
        assert isinstance(output.outputs.data, torch.Tensor)
        assert cosine_distance(output.outputs.data, st_reference[0]) < 1e-5


def test_small_token_budget_packs_many_batches(
    minilm_path: Path, st_reference: torch.Tensor
) -> None:
    llm = LLM(str(minilm_path), max_num_batched_tokens=16, max_num_seqs=2)
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    assert cosine_distance(ours, st_reference).max() < 1e-5
    assert llm.pooling_engine.num_steps >= 3


def test_matryoshka_dimensions_and_normalize_override(
    minilm_llm: LLM, st_reference: torch.Tensor
) -> None:
    (short,) = minilm_llm.embed(TEXTS[0], PoolingParams(dimensions=64), use_tqdm=False)
    vector = torch.tensor(short.outputs.embedding)
    assert vector.shape == (64,)
    expected = F.normalize(st_reference[0][:64], dim=0)  # truncated, then unit length again
    assert cosine_distance(vector, expected) < 1e-5
    assert abs(vector.norm().item() - 1) < 1e-5
    (raw,) = minilm_llm.embed(TEXTS[1], PoolingParams(normalize=False), use_tqdm=False)
    assert abs(torch.tensor(raw.outputs.embedding).norm().item() - 1) > 1e-3


def test_pooling_type_override_per_request(minilm_llm: LLM, minilm_path: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    model = AutoModel.from_pretrained(minilm_path).eval()
    with torch.inference_mode():
        hidden = model(**tokenizer(TEXTS[1], return_tensors="pt")).last_hidden_state[0]
    (cls,) = minilm_llm.embed(
        TEXTS[1], PoolingParams(pooling_type=PoolingType.CLS, normalize=False), use_tqdm=False
    )
    assert torch.allclose(torch.tensor(cls.outputs.embedding), hidden[0], atol=1e-4)


def test_bad_inputs_are_refused(minilm_llm: LLM) -> None:
    with pytest.raises(RequestRejectedError, match="empty"):
        minilm_llm.embed([[]], use_tqdm=False)
    with pytest.raises(ContextLengthExceededError, match="at most 256"):
        minilm_llm.embed("word " * 400, use_tqdm=False)
    with pytest.raises(RequestRejectedError, match="dimensions 385"):
        minilm_llm.embed("hi", PoolingParams(dimensions=385), use_tqdm=False)
    assert not minilm_llm.pooling_engine.has_unfinished()
    minilm_llm.shutdown()  # nothing to stop: no tensor-parallel ranks


@pytest.mark.parametrize("bare", [False, True], ids=["causal-lm-folder", "bare-model-folder"])
def test_qwen3_last_token_equals_transformers(tmp_path: Path, bare: bool) -> None:
    import transformers as tf

    path = save_tiny_qwen3(tmp_path / "qwen3", bare)
    save_sentence_transformers_modules(path, pooling="last", normalize=True)
    prompts = [[5, 17, 42, 99, 3], [7, 8], list(range(30, 70)), [200]]
    llm = LLM(str(path), dtype="float32")
    assert llm.pooling_engine is not None
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)])
    reference = tf.Qwen3Model.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        for index, prompt in enumerate(prompts):
            last = reference(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
            assert torch.allclose(ours[index], F.normalize(last, dim=0), atol=1e-5)
    raw = llm.encode(prompts[0], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    with torch.inference_mode():
        last = reference(input_ids=torch.tensor([prompts[0]])).last_hidden_state[0, -1]
    assert torch.allclose(raw, last, atol=1e-4)


def test_generating_model_stays_generating(tmp_path: Path) -> None:
    path = save_tiny_qwen3(tmp_path / "qwen3", bare=False)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=8, enforce_eager=True)
    assert llm.pooling_engine is None
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed("hello", use_tqdm=False)
