"""Speculative sampling keeps the target's distribution exactly (a random tiny model).

Many draws of three tokens at temperature 0.7 and top-k 8, with n-gram drafts taken from a
prompt the model continued itself, or the model's own greedy tokens as a draft model (both
disagree with the sampled tokens often): the empirical distributions of the second and third tokens must match the
model's own, computed by enumerating every (first, second) prefix top-k allows, within a
chi-square test at p > 0.01.
The third token is where verification matters: after an accepted draft it is the bonus token
drawn from the logits of a draft position.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import propose_ngram

TEMPERATURE, TOP_K, DRAWS = 0.7, 8, 3000


def _next_token_probs(model: torch.nn.Module, prefixes: list[list[int]]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor(prefixes)).logits[:, -1].float() / TEMPERATURE
    kth = logits.topk(TOP_K, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, -torch.inf).softmax(-1)


def _target_marginals(model_dir, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's distributions of the second and third sampled tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    first = _next_token_probs(model, [prompt])[0]
    t0s = first.nonzero().flatten().tolist()
    second = _next_token_probs(model, [[*prompt, t0] for t0 in t0s])
    pairs = [(t0, t1) for i, t0 in enumerate(t0s) for t1 in second[i].nonzero().flatten().tolist()]
    third = _next_token_probs(model, [prompt + list(pair) for pair in pairs])
    pair_probs = torch.tensor([first[t0] * second[t0s.index(t0), t1] for t0, t1 in pairs])
    return (first[t0s, None] * second).sum(0), (pair_probs[:, None] * third).sum(0)


def _self_continued_prompt(model_dir) -> list[int]:
    """Random tokens and the model's greedy continuation of them: the n-gram lookup then finds
    most sampled tokens in the prompt, and proposes what the model tends to say next."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        out = model.generate(
            input_ids=start,
            attention_mask=torch.ones_like(start),
            max_new_tokens=150,
            min_new_tokens=150,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0].tolist()


def _chi_square_p(observed: Counter[int], expected_probs: torch.Tensor, draws: int) -> float:
    """p-value of observed counts against the probabilities (buckets under 5 expected merged)."""
    expected = expected_probs.double() * draws
    big = (expected >= 5).nonzero().flatten().tolist()
    obs = [observed.get(t, 0) for t in big]
    exp = [float(expected[t]) for t in big]
    obs.append(draws - sum(obs))
    exp.append(draws - sum(exp))
    statistic = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True) if e > 0)
    dof = sum(1 for e in exp if e > 0) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


@pytest.mark.parametrize(
    ("method", "seeded"),
    [("ngram", False), ("ngram", True), pytest.param("draft_model", False, marks=pytest.mark.slow)],
)
def test_sampled_tokens_follow_the_target_distribution(
    tiny_llama_dir, method: str, seeded: bool
) -> None:
    prompt = _self_continued_prompt(tiny_llama_dir)
    spec = {
        "method": method,
        "num_speculative_tokens": 2,
        "disable_by_batch_size": None,
        "min_acceptance_rate": 0.0,
    }
    if method == "draft_model":  # the model itself: its argmax, which sampling often is not
        spec["model"] = str(tiny_llama_dir)
    llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, speculative_config=spec)
    params = [
        SamplingParams(
            temperature=TEMPERATURE,
            top_k=TOP_K,
            max_tokens=3,
            ignore_eos=True,
            seed=i if seeded else None,
        )
        for i in range(DRAWS)
    ]
    outputs = llm.generate([prompt] * DRAWS, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outputs]
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens >= DRAWS // 4
    assert 0 < stats.spec_acceptance_rate < 0.8  # the drafts disagree often, not always

    second, third = _target_marginals(tiny_llama_dir, prompt)
    assert _chi_square_p(Counter(t[1] for t in tokens), second, DRAWS) > 0.01
    assert _chi_square_p(Counter(t[2] for t in tokens), third, DRAWS) > 0.01


def test_ngram_proposes_what_followed_the_latest_match() -> None:
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [5, 6]  # the latest "1 2 3" is followed by 5 6
    assert propose_ngram(tokens, 5, 4, 4) == []  # "7 1 2 3" never appeared before
    assert propose_ngram([8, 8, 8], 3, 1, 2) == [8]


@pytest.mark.parametrize(
    ("given", "complaint"),
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
    ],
)
def test_bad_speculative_config_is_refused_naming_the_field(given, complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        EngineConfig(model="any", speculative_config=given)


def test_speculative_config_reads_json_text() -> None:
    config = EngineConfig(
        model="any", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}'
    )
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
