"""vLLM's sampling fields on the default model, as a vLLM user reads them: prompt_logprobs
(against transformers' log-softmax over the prompt, float32), allowed_token_ids and bad_words
(never a forbidden token), best_of (the best of the seeded candidates), include_stop_str_in_output,
truncate_prompt_tokens, and min_tokens holding back stop token ids and EOS."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling.token_bans import bad_words_token_ids

ATOL = 1e-4
PROMPTS = [
    "The capital of France is Paris, and the capital of Germany is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


@pytest.fixture(scope="module")
def llm(default_model_path: Path) -> LLM:
    return LLM(str(default_model_path), dtype="float32")


def _reference_log_softmax(model_path: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _generate(llm: LLM, prompt: str | list[int], **params: object) -> list:
    return llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs


def test_prompt_logprobs_match_transformers(llm: LLM, default_model_path: Path) -> None:
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.generate(
        ids, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3), use_tqdm=False
    )
    for prompt, output in zip(ids, outputs, strict=True):
        scored = output.prompt_logprobs
        assert scored is not None and len(scored) == len(prompt)
        assert scored[0] is None
        reference = _reference_log_softmax(default_model_path, prompt)
        expected = reference[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        ours = torch.tensor([item.logprob for item in scored[1:]])
        assert [item.token_id for item in scored[1:]] == prompt[1:]
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
        top = reference[:-1].topk(3, dim=-1)
        ours_top = torch.tensor([[value for _, value in item.top_logprobs] for item in scored[1:]])
        torch.testing.assert_close(ours_top, top.values, atol=ATOL, rtol=0)


def test_without_prompt_logprobs_there_are_none(llm: LLM) -> None:
    output = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert output.prompt_logprobs is None


def test_allowed_token_ids_are_the_only_tokens_in_200(llm: LLM) -> None:
    allowed = llm.tokenizer.encode(" the a of and to in is was it that", add_special_tokens=False)
    for temperature in (1.0, 0.0):
        (out,) = _generate(
            llm,
            PROMPTS[0],
            temperature=temperature,
            seed=7,
            max_tokens=200,
            ignore_eos=True,
            allowed_token_ids=allowed,
        )
        assert len(out.token_ids) == 200
        assert set(out.token_ids) <= set(allowed)


def _contains(tokens: list[int], words: list[list[int]]) -> bool:
    return any(
        tokens[start : start + len(word)] == word
        for word in words
        for start in range(len(tokens) - len(word) + 1)
    )


def test_bad_words_never_appear_in_200_tokens(llm: LLM) -> None:
    free = _generate(llm, PROMPTS[0], temperature=1.0, seed=11, max_tokens=200, ignore_eos=True)
    # The words the model says most readily: its own first few.
    words = free[0].text.split()[:6]
    banned = bad_words_token_ids(llm.tokenizer, words)
    assert _contains(free[0].token_ids, banned)  # not vacuous: free sampling does say them
    (out,) = _generate(
        llm,
        PROMPTS[0],
        temperature=1.0,
        seed=11,
        max_tokens=200,
        ignore_eos=True,
        bad_words=words,
    )
    assert len(out.token_ids) == 200
    assert not _contains(out.token_ids, banned)


def test_best_of_returns_the_highest_cumulative_logprob_of_the_seeded_candidates(
    llm: LLM,
) -> None:
    seed = 1234
    params = dict(temperature=1.0, max_tokens=24, ignore_eos=True)
    (best,) = _generate(llm, PROMPTS[0], n=1, best_of=4, seed=seed, **params)
    # The four candidates, seeded alike (choice i draws from choice i's stream of the seed),
    # as a request that returns them all; the first is also the plain seeded request's.
    candidates = _generate(llm, PROMPTS[0], n=4, seed=seed, logprobs=True, **params)
    (alone,) = _generate(llm, PROMPTS[0], seed=seed, logprobs=True, **params)
    assert alone.token_ids == candidates[0].token_ids
    scores = [sum(item.logprob for item in c.logprobs) for c in candidates]
    winner = candidates[max(range(4), key=scores.__getitem__)]
    assert best.token_ids == winner.token_ids
    assert best.text == winner.text
    assert best.cumulative_logprob == pytest.approx(max(scores), abs=1e-3)
    assert best.logprobs is None  # not asked for
    assert len({tuple(c.token_ids) for c in candidates}) > 1  # the draws differ


def test_best_of_two_of_four_come_best_first(llm: LLM) -> None:
    outs = _generate(
        llm, PROMPTS[1], n=2, best_of=4, seed=5, temperature=1.0, max_tokens=12, logprobs=True
    )
    assert [o.index for o in outs] == [0, 1]
    assert outs[0].cumulative_logprob >= outs[1].cumulative_logprob
    assert all(len(o.logprobs) == len(o.token_ids) for o in outs)


def test_include_stop_str_in_output(llm: LLM) -> None:
    (free,) = _generate(llm, PROMPTS[0], temperature=0, max_tokens=12, ignore_eos=True)
    stop = free.text.split()[1]
    (cut,) = _generate(llm, PROMPTS[0], temperature=0, max_tokens=12, stop=[stop])
    (kept,) = _generate(
        llm, PROMPTS[0], temperature=0, max_tokens=12, stop=[stop], include_stop_str_in_output=True
    )
    assert cut.stop_reason == kept.stop_reason == stop
    assert not cut.text.endswith(stop)
    assert kept.text == cut.text + stop


def test_include_stop_str_keeps_a_stop_tokens_text(llm: LLM) -> None:
    (free,) = _generate(llm, PROMPTS[0], temperature=0, max_tokens=6, ignore_eos=True)
    stop_id = free.token_ids[2]
    (cut,) = _generate(llm, PROMPTS[0], temperature=0, max_tokens=6, stop_token_ids=[stop_id])
    (kept,) = _generate(
        llm,
        PROMPTS[0],
        temperature=0,
        max_tokens=6,
        stop_token_ids=[stop_id],
        include_stop_str_in_output=True,
    )
    assert cut.token_ids == kept.token_ids == free.token_ids[:3]
    assert kept.text == llm.tokenizer.decode(free.token_ids[:3])
    assert cut.text == llm.tokenizer.decode(free.token_ids[:2])


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    ids = llm.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1])
    truncated = llm.generate(
        [ids], SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=9), use_tqdm=False
    )[0]
    direct = llm.generate([ids[-9:]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert truncated.prompt_token_ids == ids[-9:]
    assert truncated.outputs[0].token_ids == direct[0].outputs[0].token_ids


def test_min_tokens_holds_back_stop_token_ids_and_eos(llm: LLM) -> None:
    (free,) = _generate(llm, PROMPTS[0], temperature=0, max_tokens=40)
    eos_ended = free.finish_reason == "stop"
    first = free.token_ids[0]
    (stopped,) = _generate(llm, PROMPTS[0], temperature=0, max_tokens=40, stop_token_ids=[first])
    assert stopped.token_ids == [first] and stopped.stop_reason == first
    (held,) = _generate(
        llm, PROMPTS[0], temperature=0, max_tokens=40, stop_token_ids=[first], min_tokens=5
    )
    assert len(held.token_ids) >= 5
    assert first not in held.token_ids[:4]
    if eos_ended:  # EOS too waits for min_tokens
        least = len(free.token_ids) + 3
        (longer,) = _generate(llm, PROMPTS[0], temperature=0, max_tokens=60, min_tokens=least)
        assert len(longer.token_ids) >= least


def test_prompt_logprobs_across_prefill_chunks_and_a_warm_prefix_cache(
    tiny_llama_dir: Path,
) -> None:
    prompt = [(7 * i + 3) % 256 for i in range(100)]
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_batched_tokens=32, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    reference = _reference_log_softmax(tiny_llama_dir, prompt)
    expected = reference[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    ours = torch.tensor([item.logprob for item in output.prompt_logprobs[1:]])
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    assert all(item.top_logprobs == [] for item in output.prompt_logprobs[1:])


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(logit_bias={256: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[3, 10**6]), "allowed_token_ids"),
    ],
)
def test_token_ids_past_the_vocabulary_are_refused(tiny_llama_dir: Path, params, field) -> None:
    from engine.errors import InvalidTokenIdError
    from engine.outputs import EngineRequest

    llm = LLM(str(tiny_llama_dir), dtype="float32")  # 256 tokens
    with pytest.raises(InvalidTokenIdError, match=field):
        llm.engine.add_request(EngineRequest("r", [1, 2, 3], params))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 2, "best_of": 3, "use_beam_search": True}, "best_of"),
        ({"use_beam_search": True, "allowed_token_ids": [1]}, "allowed_token_ids"),
        ({"use_beam_search": True, "bad_words": ["x"]}, "bad_words"),
        ({"use_beam_search": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_inconsistent_fields_are_refused_naming_the_field(fields: dict, field: str) -> None:
    from pydantic import ValidationError

    from schemas.errors import error_location

    with pytest.raises(ValidationError) as refused:
        SamplingParams(**fields)
    assert field in error_location(refused.value.errors()[0])


def test_prompt_logprobs_with_a_draft_model_are_the_targets(tiny_model_factory) -> None:
    target = tiny_model_factory("llama")
    draft = tiny_model_factory("llama", num_hidden_layers=1)
    spec = {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": 3,
        "disable_by_batch_size": None,
        "min_acceptance_rate": 0.0,
    }
    prompt = [(11 * i + 5) % 256 for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    plain = LLM(str(target), dtype="float32").generate([prompt], params, use_tqdm=False)[0]
    llm = LLM(str(target), dtype="float32", enforce_eager=True, speculative_config=spec)
    drafted = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.engine.stats().spec_num_draft_tokens > 0
    assert drafted.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.prompt_logprobs is not None and drafted.prompt_logprobs is not None
    assert [p and p.token_id for p in drafted.prompt_logprobs] == [
        p and p.token_id for p in plain.prompt_logprobs
    ]
    ours = torch.tensor([p.logprob for p in drafted.prompt_logprobs[1:]])
    expected = torch.tensor([p.logprob for p in plain.prompt_logprobs[1:]])
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
