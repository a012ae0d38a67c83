"""Beam search with EOS allowed against transformers' generate(num_beams=W, do_sample=False,
early_stopping=True): the same finished beams in the same order, token for token, and the
same scores (cumulative logprob / output length ** length_penalty, the EOS counted).

Two models: the default one on chat prompts, whose answers end on its real EOS, and a tiny
random one whose EOS ids are a third of its vocabulary, so that most steps rank several EOS
continuations among their best ones. Every case checks that some beams do end on EOS before
max_tokens. Both sides run in float32."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import LLM, BeamSearchParams
from engine.model_files import DEFAULT_MODEL, resolve_model_path
from engine.outputs import RequestOutput

CHAT_QUESTIONS = [
    "What is 2+2?",
    "What is the capital of France?",
    "Is water wet? Answer yes or no.",
    "Say hello.",
    "Name a colour.",
    "What is the opposite of hot?",
]
CHAT_NEW_TOKENS = 20
TINY_PROMPTS = [[5, 17, 42, 9], [100, 3, 77], [250, 251, 12, 13, 14], [8, 8, 8, 8], [60, 61]]
TINY_NEW_TOKENS = 10
TINY_EOS_TOKEN_IDS = list(range(3, 256, 3))


@dataclass(frozen=True)
class Beam:
    token_ids: list[int]  # output tokens, up to and including the first EOS
    score: float


def reference_beams(
    hf_model, prompt_ids: list[int], width: int, new_tokens: int, length_penalty: float
) -> list[Beam]:
    """transformers' beams, best first (its padding after the EOS cut off)."""
    eos_token_ids = set(hf_model.generation_config.eos_token_id)
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=True,
            return_dict_in_generate=True,
            output_scores=True,
        )
    beams = []
    for row, score in zip(out.sequences, out.sequences_scores.tolist(), strict=True):
        tokens = row[len(prompt_ids) :].tolist()
        ends = [i for i, token in enumerate(tokens) if token in eos_token_ids]
        beams.append(Beam(tokens[: ends[0] + 1] if ends else tokens, score))
    return beams


def check_against_reference(
    llm: LLM,
    hf_model,
    prompts: list[list[int]],
    width: int,
    new_tokens: int,
    length_penalty: float,
) -> int:
    """Asserts the beams equal transformers'; returns how many prompts had a beam end on EOS
    before new_tokens."""
    eos_token_ids = llm.engine.eos_token_ids
    params = BeamSearchParams(
        beam_width=width, max_tokens=new_tokens, length_penalty=length_penalty
    )
    outputs: list[RequestOutput] = llm.beam_search(prompts, params)
    ended_early = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = reference_beams(
            hf_model, output.prompt_token_ids, width, new_tokens, length_penalty
        )
        got = [beam.token_ids for beam in output.outputs]
        assert got == [beam.token_ids for beam in expected], f"beams differ for {prompt!r}"
        for beam, reference in zip(output.outputs, expected, strict=True):
            score = beam.cumulative_logprob / len(beam.token_ids) ** length_penalty
            assert score == pytest.approx(reference.score, abs=1e-3), prompt
            ends_on_eos = beam.token_ids[-1] in eos_token_ids
            assert beam.finish_reason == ("stop" if ends_on_eos else "length")
        if any(
            b.token_ids[-1] in eos_token_ids and len(b.token_ids) < new_tokens
            for b in output.outputs
        ):
            ended_early += 1
    return ended_early


# ---- the default model, its own EOS --------------------------------------------------------


@pytest.fixture(scope="module")
def model_path() -> Path:
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def llm(model_path: Path) -> LLM:
    return LLM(str(model_path), dtype="float32", enforce_eager=True)


@pytest.fixture(scope="module")
def hf_model(model_path: Path, llm: LLM):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = sorted(llm.engine.eos_token_ids)
    return model


def chat_prompts(llm: LLM, questions: list[str]) -> list[list[int]]:
    return [llm.engine.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


def test_chat_beams_ending_on_eos_match_transformers(llm: LLM, hf_model) -> None:
    prompts = chat_prompts(llm, CHAT_QUESTIONS[:3])
    ended_early = check_against_reference(llm, hf_model, prompts, 4, CHAT_NEW_TOKENS, 0.5)
    assert ended_early == len(prompts)


@pytest.mark.slow
@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("width", [2, 4])
def test_chat_beams_with_eos_match_transformers_on_six_prompts(
    llm: LLM, hf_model, width: int, length_penalty: float
) -> None:
    prompts = chat_prompts(llm, CHAT_QUESTIONS)
    ended_early = check_against_reference(
        llm, hf_model, prompts, width, CHAT_NEW_TOKENS, length_penalty
    )
    assert ended_early >= 2


# ---- a tiny random model with many EOS ids ------------------------------------------------


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
@pytest.mark.parametrize("width", [2, 4])
def test_beams_with_many_eos_ids_match_transformers(
    tiny_model_factory: Callable[..., Path], width: int, length_penalty: float
) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory("llama", eos_token_id=TINY_EOS_TOKEN_IDS)
    llm = LLM(str(path), dtype="float32", enforce_eager=True)
    assert llm.engine.eos_token_ids == set(TINY_EOS_TOKEN_IDS)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_model.generation_config.pad_token_id = 0  # not an EOS: only fills after one
    ended_early = check_against_reference(
        llm, hf_model, TINY_PROMPTS, width, TINY_NEW_TOKENS, length_penalty
    )
    assert ended_early >= len(TINY_PROMPTS) // 2
