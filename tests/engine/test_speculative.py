"""Speculative decoding on the default model: the same tokens as without it, however batched.

The engine runs in float32 (dtype auto may pick bf16, whose tokens drift between step shapes).
Speculation is kept on for every batch size (disable_by_batch_size None) so batches speculate.
"""

from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams
from engine.model_files import DEFAULT_MODEL, resolve_model_path
from engine.outputs import RequestOutput

NEW_TOKENS = 32
PROMPT_LENGTHS = [5, 12, 30, 60, 90, 120, 150, 200]
TEXT = (
    "In the early morning the harbour was quiet. Fishing boats rocked against the pier while gulls "
    "circled overhead, and the smell of salt and diesel drifted over the stones. Maria walked along "
    "the water with a notebook, counting the boats and writing down their names: Esperanza, Blue "
    "Heron, Little Tom, and the old ferry that nobody had used for years. "
)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path():
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def prompts(model_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer.encode(TEXT * 10)
    return [ids[:length] for length in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def plain(model_path) -> LLM:
    return LLM(str(model_path), dtype="float32", enforce_eager=True)


@pytest.fixture(scope="module")
def reference(plain, prompts) -> list[list[int]]:
    return _tokens(plain.generate(prompts, GREEDY, use_tqdm=False))


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _spec_llm(model_path, spec=NGRAM, **engine_args) -> LLM:
    return LLM(
        str(model_path), dtype="float32", enforce_eager=True, speculative_config=spec, **engine_args
    )


def test_ngram_alone_matches_plain_decoding(model_path, prompts, reference) -> None:
    llm = _spec_llm(model_path)
    for prompt, expected in zip(prompts, reference, strict=True):
        assert _tokens(llm.generate([prompt], GREEDY, use_tqdm=False)) == [expected]
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0
    # Accepted drafts save steps: fewer steps than one per generated token.
    assert stats.num_steps < stats.num_generation_tokens
    assert 0 < stats.spec_acceptance_rate <= 1
    assert stats.spec_mean_accepted_length > 0


def test_ngram_batched_with_other_requests_matches(model_path, prompts, reference, plain) -> None:
    """Speculating greedy sequences share steps with sampled and penalised ones."""
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    penalised = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.3
    )
    params = [GREEDY] * len(prompts) + [sampled, penalised]
    batch = [*prompts, prompts[3], prompts[4]]
    expected = _tokens(plain.generate(batch, params, use_tqdm=False))
    llm = _spec_llm(model_path)
    assert _tokens(llm.generate(batch, params, use_tqdm=False)) == expected
    assert expected[: len(prompts)] == reference
    assert llm.engine.stats().spec_num_accepted_tokens > 0


@pytest.mark.slow
def test_ngram_with_chunked_prefill_matches(model_path, prompts, reference) -> None:
    llm = _spec_llm(model_path, max_num_batched_tokens=48)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    assert llm.engine.stats().spec_num_accepted_tokens > 0


def test_ngram_with_preemption_matches(model_path, prompts, reference) -> None:
    # 667 prompt + 256 output tokens need 62 blocks of 16: 24 blocks force preemptions.
    llm = _spec_llm(model_path, num_kv_blocks=24, max_num_batched_tokens=256)
    assert _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == reference
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_num_accepted_tokens > 0
    assert stats.num_blocks_free == stats.num_blocks_total  # rejected slots all came back


def test_stop_string_max_tokens_and_logprobs_as_without(model_path, prompts, plain) -> None:
    """A stop inside an accepted run drops the tokens after it; logprobs cover what is kept."""
    free_run = _tokens(plain.generate([prompts[5]], GREEDY, use_tqdm=False))[0]
    stop_text = plain.tokenizer.decode(free_run[10:12])
    params = [
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop=[stop_text.strip()]),
        SamplingParams(temperature=0.0, max_tokens=9, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=[free_run[14]]),
    ]
    batch = [prompts[5]] * 3
    expected = plain.generate(batch, params, use_tqdm=False)
    got = _spec_llm(model_path).generate(batch, params, use_tqdm=False)
    for want, have in zip(expected, got, strict=True):
        w, h = want.outputs[0], have.outputs[0]
        assert (h.token_ids, h.text, h.finish_reason) == (w.token_ids, w.text, w.finish_reason)
    assert got[0].outputs[0].token_ids != free_run[:NEW_TOKENS]  # the stop string did stop it
    want_lp, have_lp = expected[1].outputs[0].logprobs, got[1].outputs[0].logprobs
    assert len(have_lp) == len(want_lp) == 9
    for w, h in zip(want_lp, have_lp, strict=True):
        assert h.token_id == w.token_id
        assert math.isclose(h.logprob, w.logprob, abs_tol=1e-3)
        assert [t for t, _ in h.top_logprobs] == [t for t, _ in w.top_logprobs]


def _all_choices(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


def test_seeded_sampling_gives_the_same_tokens_as_without(model_path, prompts, plain) -> None:
    """Verification draws one noise row per emitted token, as plain sampling does, so a seed
    gives the same tokens with or without speculation (n > 1 choices included)."""
    params = [
        SamplingParams(temperature=t, seed=s, n=n, max_tokens=NEW_TOKENS, top_p=0.9)
        for t, s, n in [(0.5, 1, 1), (0.3, 3, 1), (1.0, 2, 2)]
    ]
    batch = [prompts[4], prompts[6], prompts[7]]
    expected = _all_choices(plain.generate(batch, params, use_tqdm=False))
    llm = _spec_llm(model_path)
    assert _all_choices(llm.generate(batch, params, use_tqdm=False)) == expected
    assert len(expected[2]) == 2 and expected[2][0] != expected[2][1]
    assert llm.engine.stats().spec_num_drafts > 0


@pytest.mark.slow
def test_draft_model_equal_to_target_accepts_everything(model_path, prompts, reference) -> None:
    spec = {
        "method": "draft_model",
        "model": str(model_path),
        "num_speculative_tokens": 3,
        "disable_by_batch_size": None,
    }
    llm = _spec_llm(model_path, spec)
    assert _tokens(llm.generate(prompts[:4], GREEDY, use_tqdm=False)) == reference[:4]
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_acceptance_rate > 0.9


@pytest.mark.slow
def test_random_draft_model_changes_nothing(
    model_path, prompts, reference, tiny_model_factory
) -> None:
    draft = tiny_model_factory("llama", vocab_size=49152, num_hidden_layers=1)
    spec = {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": 3,
        "disable_by_batch_size": None,
        "min_acceptance_rate": 0.0,
    }
    llm = _spec_llm(model_path, spec)
    assert _tokens(llm.generate(prompts[:4], GREEDY, use_tqdm=False)) == reference[:4]
    assert llm.engine.stats().spec_num_draft_tokens > 0
