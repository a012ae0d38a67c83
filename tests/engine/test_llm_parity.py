"""The offline LLM against transformers on the default model: same greedy tokens however batched.

The reference runs in float32, so the engine does too (dtype auto may pick bf16 on a CPU with
native bf16, whose tokens drift from float32's after a few dozen)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.model_files import DEFAULT_MODEL, resolve_model_path
from tests.engine.conftest import transformers_greedy

NEW_TOKENS = 48
PROMPT_LENGTHS = [1, 7, 16, 33, 64, 150, 257, 400]
TEXT = (
    "In the early morning the harbour was quiet. Fishing boats rocked against the pier while gulls "
    "circled overhead, and the smell of salt and diesel drifted over the stones. Maria walked along "
    "the water with a notebook, counting the boats and writing down their names: Esperanza, Blue "
    "Heron, Little Tom, and the old ferry that nobody had used for years. "
)


@pytest.fixture(scope="module")
def model_path():
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def prompts(model_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer.encode(TEXT * 20)
    return [ids[:length] for length in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(model_path, prompts) -> list[list[int]]:
    return transformers_greedy(model_path, prompts, NEW_TOKENS)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_one_at_a_time_matches_transformers(model_path, prompts, reference) -> None:
    llm = LLM(str(model_path), dtype="float32", enable_prefix_caching=False)
    for prompt, expected in zip(prompts, reference, strict=True):
        assert _generate(llm, [prompt]) == [expected], f"prompt of {len(prompt)} tokens"


def test_all_together_matches_transformers(model_path, prompts, reference) -> None:
    llm = LLM(str(model_path), dtype="float32")
    assert _generate(llm, prompts) == reference


def test_chunked_prefill_matches_transformers(model_path, prompts, reference) -> None:
    llm = LLM(str(model_path), dtype="float32", max_num_batched_tokens=64)
    assert _generate(llm, prompts) == reference
    assert llm.engine.stats().num_steps > sum(PROMPT_LENGTHS) // 64  # prompts really were chunked


def test_preemption_matches_transformers(model_path, prompts, reference) -> None:
    # 448 tokens need 28 blocks of 16: 40 blocks cannot hold all eight sequences at once.
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=40, max_num_batched_tokens=256)
    assert _generate(llm, prompts) == reference
    assert llm.engine.stats().num_preemptions > 0


def test_prefix_cache_computes_only_the_suffix(model_path, prompts) -> None:
    prefix, tail = prompts[-1][:256], prompts[-1][300:337]
    first, second = prefix + tail[:20], prefix + tail[::-1]  # the suffixes differ at once
    cached = LLM(str(model_path), dtype="float32")
    uncached = LLM(str(model_path), dtype="float32", enable_prefix_caching=False)

    cached.generate([first], GREEDY, use_tqdm=False)
    before = cached.engine.stats().num_prompt_tokens_computed
    out = cached.generate([second], GREEDY, use_tqdm=False)[0]
    computed = cached.engine.stats().num_prompt_tokens_computed - before

    assert out.metrics.num_cached_prompt_tokens == 256
    assert computed == len(second) - 256
    assert cached.engine.stats().prefix_cache_hit_rate > 0
    assert out.outputs[0].token_ids == _generate(uncached, [second])[0]


def test_perplexity_leaves_cached_prefixes_true(model_path, prompts) -> None:
    """Scoring a text takes its KV blocks like a prompt: a prefix cached before it still
    continues as computed from scratch afterwards."""
    llm = LLM(str(model_path), dtype="float32", num_kv_blocks=40)
    uncached = LLM(str(model_path), dtype="float32", enable_prefix_caching=False)
    prompt = prompts[-1][:200]
    llm.generate([prompt], GREEDY, use_tqdm=False)
    perplexity = llm.perplexity(prompts[-1][300:500])
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert perplexity == pytest.approx(uncached.perplexity(prompts[-1][300:500]), rel=1e-4)
    assert again.metrics.num_cached_prompt_tokens > 0
    assert again.outputs[0].token_ids == _generate(uncached, [prompt])[0]


def test_seeded_sampling_ignores_batch_composition(model_path, prompts) -> None:
    llm = LLM(str(model_path), dtype="float32")
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompts[4]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = [prompts[2], prompts[4], prompts[6], prompts[1]]
    params = [others, seeded, others, others]
    together = llm.generate(batch, params, use_tqdm=False)[1].outputs[0].token_ids
    assert alone == together
    other_seed = seeded.model_copy(update={"seed": 4321})
    assert llm.generate([prompts[4]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_choices_share_the_prompt(model_path, prompts) -> None:
    llm = LLM(str(model_path), dtype="float32")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    out = llm.generate([prompts[5]], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 16 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([prompts[5]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert llm.engine.stats().num_blocks_free == llm.engine.stats().num_blocks_total


def test_stop_string_spanning_tokens_is_cut(model_path, prompts) -> None:
    llm = LLM(str(model_path), dtype="float32")
    full = llm.generate([prompts[5]], GREEDY, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.tokenizer
    pieces = [tokenizer.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # a stop string that starts inside one token's text and ends inside a later one
    start = len(pieces[9]) - 1
    stop = full.text[start : start + max(4, len(pieces[12]) - start)]
    assert stop.strip(), "picked an empty stop string"
    cut = llm.generate([prompts[5]], GREEDY.model_copy(update={"stop": [stop]}), use_tqdm=False)[0]
    choice = cut.outputs[0]
    assert choice.finish_reason == "stop"
    assert choice.stop_reason == stop
    assert choice.text == full.text[: full.text.index(stop)]


def test_chat_uses_the_template(model_path) -> None:
    llm = LLM(str(model_path), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    out = llm.chat([{"role": "user", "content": "Say hello."}], params, use_tqdm=False)[0]
    expected_prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello."}], tokenize=False, add_generation_prompt=True
    )
    assert out.prompt_token_ids == llm.tokenizer.encode(expected_prompt, add_special_tokens=False)
    assert out.outputs[0].text
