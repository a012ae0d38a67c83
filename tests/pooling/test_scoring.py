"""LLM.score as vLLM writes it: a tiny random BERT cross-encoder's scores equal transformers'
logits (through a sigmoid, as sentence-transformers' CrossEncoder scores one label); an
embedding model scores the cosine of the two embeddings. And the RoBERTa family's shifted
positions: its token states equal transformers'."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.llm import LLM
from schemas.pooling import PoolingParams, PoolingType

QUERIES = ["what is a queue", "how are embeddings made"]
DOCUMENTS = [
    "A queue holds jobs until a worker takes them.",
    "Pooling turns token states into one vector.",
]
TINY_ENCODER = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


@pytest.fixture
def cross_encoder(tmp_path: Path, minilm_path: Path) -> Path:
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(minilm_path)
    config = tf.BertConfig(vocab_size=tokenizer.vocab_size, num_labels=1, **TINY_ENCODER)
    model = tf.BertForSequenceClassification(config).eval()
    randomize(model)
    model.save_pretrained(tmp_path / "cross")
    tokenizer.save_pretrained(tmp_path / "cross")
    return tmp_path / "cross"


def test_cross_encoder_scores_equal_transformers(cross_encoder: Path) -> None:
    import transformers as tf

    llm = LLM(str(cross_encoder))  # a BertForSequenceClassification folder: pooling, detected
    outputs = llm.score(QUERIES[0], DOCUMENTS, use_tqdm=False)
    pairs = llm.score(QUERIES, DOCUMENTS, use_tqdm=False)
    tokenizer = tf.AutoTokenizer.from_pretrained(cross_encoder)
    reference = tf.BertForSequenceClassification.from_pretrained(cross_encoder).eval()
    for got, query in ((outputs, [QUERIES[0]] * 2), (pairs, QUERIES)):
        batch = tokenizer(query, DOCUMENTS, padding=True, return_tensors="pt")
        with torch.inference_mode():
            logits = reference(**batch).logits[:, 0]
        scores = torch.tensor([o.outputs.score for o in got])
        assert torch.allclose(scores, torch.sigmoid(logits), atol=1e-5)
    assert len(set(round(o.outputs.score, 4) for o in pairs)) == 2  # the pairs differ
    (raw,) = llm.encode([tokenizer(QUERIES[1])["input_ids"]], use_tqdm=False)
    with torch.inference_mode():
        logit = reference(**tokenizer(QUERIES[1], return_tensors="pt")).logits[0]
    assert torch.allclose(raw.outputs.data, logit, atol=1e-5)


def test_embedding_model_scores_cosine(minilm_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    llm = LLM(str(minilm_path))
    scores = [o.outputs.score for o in llm.score(QUERIES, DOCUMENTS, use_tqdm=False)]
    st = SentenceTransformer(str(minilm_path), device="cpu")
    a, b = (torch.from_numpy(st.encode(texts)) for texts in (QUERIES, DOCUMENTS))
    assert torch.allclose(torch.tensor(scores), F.cosine_similarity(a, b), atol=1e-5)


def test_roberta_positions_start_after_padding(tmp_path: Path) -> None:
    import transformers as tf

    config = tf.RobertaConfig(
        vocab_size=120, pad_token_id=1, max_position_embeddings=64, **TINY_ENCODER
    )
    model = tf.RobertaModel(config, add_pooling_layer=False).eval()
    randomize(model, seed=3)
    model.save_pretrained(tmp_path / "roberta")
    llm = LLM(str(tmp_path / "roberta"))
    prompts = [[0, 5, 17, 42, 2], [0, 7, 2], list(range(3, 60))]
    cls = PoolingParams(pooling_type=PoolingType.CLS, normalize=False)
    mean = PoolingParams(pooling_type=PoolingType.MEAN, normalize=False)
    got_cls = llm.encode(prompts, cls, use_tqdm=False)
    got_mean = llm.encode(prompts, mean, use_tqdm=False)
    with pytest.raises(ValueError, match="at most 62"):
        llm.encode([list(range(3, 66))], use_tqdm=False)
    for index, prompt in enumerate(prompts):
        with torch.inference_mode():
            states = model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        assert torch.allclose(got_cls[index].outputs.data, states[0], atol=1e-4)
        assert torch.allclose(got_mean[index].outputs.data, states.mean(0), atol=1e-4)
