"""Logprob token texts: each id decoded on its own, as vLLM reports them."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model_files import DEFAULT_MODEL, resolve_model_path
from engine.token_text import TokenTexts
from engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(DEFAULT_MODEL))


def test_byte_level_tokens_read_as_text(tokenizer) -> None:
    ids = tokenizer.encode(" the café")
    texts = TokenTexts(tokenizer)(ids)
    assert "".join(texts[i] for i in ids) == " the café"
    assert " the" in texts.values()  # 'Ġthe', with the byte-level space decoded


def test_part_of_a_character_reads_as_the_replacement_character(tokenizer) -> None:
    ids = tokenizer.encode("🦜")
    assert len(ids) > 1  # this tokenizer splits the parrot into bytes
    assert set(TokenTexts(tokenizer)(ids).values()) == {"\ufffd"}


def test_special_tokens_keep_their_text(tokenizer) -> None:
    eos = tokenizer.eos_token_id
    assert TokenTexts(tokenizer)([eos]) == {eos: tokenizer.eos_token}


def test_no_tokenizer_no_texts() -> None:
    assert TokenTexts(None)([1, 2, 3]) == {}


def test_engine_logprobs_carry_the_text_of_every_token_they_name() -> None:
    llm = LLM(DEFAULT_MODEL, max_model_len=128)
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2
    )
    [output] = llm.generate(["The capital of France is"], params, use_tqdm=False)
    choice = output.outputs[0]
    assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids)
    assert "".join(lp.token_texts[lp.token_id] for lp in choice.logprobs) == choice.text
    for lp in choice.logprobs:
        assert len(lp.top_logprobs) == 2
        for top_id, _ in lp.top_logprobs:
            assert lp.token_texts[top_id] == llm.engine.tokenizer.decode([top_id])
