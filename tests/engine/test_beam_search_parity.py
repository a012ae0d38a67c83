"""Beam search against transformers on the default model: the same beams, token for token.

transformers' EOS is turned off (no eos_token_id), as ignore_eos turns off ours, so EOS is an
ordinary token to both. Both run in float32 (the reference's dtype)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, BeamSearchParams
from engine.model_files import DEFAULT_MODEL, resolve_model_path

NEW_TOKENS = 12
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "Water boils at",
    "My favourite book is",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def model_path():
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def llm(model_path) -> LLM:
    return LLM(str(model_path), dtype="float32", enforce_eager=True)


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    # generate() fills a passed config's unset fields from the model's: clear EOS at the source.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.config.eos_token_id = None
    return model


def reference_beams(hf_model, prompt_ids: list[int], width: int) -> list[list[int]]:
    """transformers' beams, best first, without EOS stopping."""
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            length_penalty=1.0,
            early_stopping=True,
        )
    return [row[len(prompt_ids) :].tolist() for row in out]


def _check_width(llm: LLM, hf_model, prompts: list[str], width: int) -> None:
    params = BeamSearchParams(beam_width=width, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.beam_search(prompts, params)
    for prompt, output in zip(prompts, outputs, strict=True):
        expected = reference_beams(hf_model, output.prompt_token_ids, width)
        got = [beam.token_ids for beam in output.outputs]
        assert got[0] == expected[0], f"best beam differs for {prompt!r}"
        assert got == expected, f"beam set differs for {prompt!r}"
        scores = [beam.cumulative_logprob for beam in output.outputs]
        assert scores == sorted(scores, reverse=True)
        assert all(beam.finish_reason == "length" for beam in output.outputs)


def test_beams_match_transformers_width_4(llm, hf_model) -> None:
    _check_width(llm, hf_model, PROMPTS[:3], 4)


@pytest.mark.slow
@pytest.mark.parametrize("width", [2, 4, 8])
def test_beams_match_transformers_on_eight_prompts(llm, hf_model, width: int) -> None:
    _check_width(llm, hf_model, PROMPTS, width)
