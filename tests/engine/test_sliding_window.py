"""Sliding-window models served past their window: greedy tokens equal transformers', and a
running sequence's KV blocks stop growing once it is longer than the window.

Tiny random Mistral models with windows of a few blocks run prompts several windows long
through the offline LLM: alone, batched with other requests, in small prefill chunks, and
after a prefix-cache hit; through the CPU kernels we ship and through the plain-torch path.
Hybrid local/global models (Qwen2 with max_window_layers, Gemma 2 with soft-capped scores,
Gemma 3) run batched in small chunks on both paths.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.attention import torch_backend
from engine.block_manager import FREED
from engine.outputs import EngineRequest
from tests.engine.conftest import transformers_greedy

WINDOW = 12
BLOCK_SIZE = 4
NEW_TOKENS = 24
PROMPT_LENGTHS = [41, 57, 70]


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.engine.conftest import save_tiny_model

    return save_tiny_model(
        tmp_path_factory.mktemp("mistral"), "mistral", seed=3, sliding_window=WINDOW
    )


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(mistral_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(mistral_dir, prompts, NEW_TOKENS)


@pytest.fixture(params=["cpu kernels", "plain torch"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "plain torch":
        monkeypatch.setattr(torch_backend, "cpu_kernels_available", lambda: False)
    return str(request.param)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _llm(model: Path, **engine_args: object) -> LLM:
    return LLM(str(model), dtype="float32", block_size=BLOCK_SIZE, **engine_args)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_the_reference_itself_depends_on_the_window(
    mistral_dir: Path, prompts: list[list[int]], reference: list[list[int]], tmp_path: Path
) -> None:
    """Parity below means something: the same weights without a window generate otherwise."""
    from tests.engine.conftest import save_tiny_model

    unwindowed = save_tiny_model(tmp_path / "full", "mistral", seed=3, sliding_window=None)
    assert transformers_greedy(unwindowed, prompts, NEW_TOKENS) != reference


def test_the_window_is_not_a_length_cap(mistral_dir: Path) -> None:
    llm = _llm(mistral_dir, num_kv_blocks=64)
    assert llm.engine.max_model_len > WINDOW
    assert llm.engine.max_model_len > 64 * BLOCK_SIZE  # only the window's blocks are kept


def test_alone_matches_transformers(
    mistral_dir: Path, prompts: list[list[int]], reference: list[list[int]], attention_path: str
) -> None:
    llm = _llm(mistral_dir, enable_prefix_caching=False)
    for prompt, expected in zip(prompts, reference, strict=True):
        assert _generate(llm, [prompt]) == [expected], f"prompt of {len(prompt)} tokens"


def test_batched_in_small_chunks_matches_transformers(
    mistral_dir: Path, prompts: list[list[int]], reference: list[list[int]], attention_path: str
) -> None:
    """All prompts together with another request, prefilled 16 tokens a step (chunks start
    past the window of earlier chunks)."""
    other = [5, 6, 7]
    llm = _llm(mistral_dir, max_num_batched_tokens=16, enable_prefix_caching=False)
    out = _generate(llm, [*prompts, other])
    assert out[:-1] == reference


def test_prefix_cache_hit_matches_transformers(
    mistral_dir: Path, prompts: list[list[int]], reference: list[list[int]], attention_path: str
) -> None:
    """A prompt sharing a long prefix with a finished one starts from cached blocks."""
    llm = _llm(mistral_dir)
    assert _generate(llm, [prompts[2]]) == [reference[2]]
    extended = prompts[2] + reference[2][:9]
    [expected] = transformers_greedy(llm_path(llm), [extended], NEW_TOKENS)
    before = llm.engine.block_manager.prefix_cache_hits
    assert _generate(llm, [extended]) == [expected]
    assert llm.engine.block_manager.prefix_cache_hits - before >= 40


def llm_path(llm: LLM) -> Path:
    return Path(llm.engine.config.model)


def test_blocks_held_stay_bounded_as_a_sequence_grows(mistral_dir: Path) -> None:
    """Decoding far past the window, a sequence holds the window's blocks and a few more, and
    the blocks before its window are given back."""
    llm = _llm(mistral_dir, max_num_batched_tokens=16, num_kv_blocks=24)
    engine = llm.engine
    manager = engine.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    engine.add_request(EngineRequest("long", list(range(1, 50)), params))
    held: list[int] = []
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            held.append(manager.held_blocks(seq))
            assert FREED not in seq.block_table[-(WINDOW // BLOCK_SIZE) :]
    bound = manager.blocks_for_tokens(WINDOW - 1 + 16) + 1
    assert max(held) <= bound
    assert len(held) > 200  # it ran far past the 24 blocks' 96 tokens


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 windowing its layers from max_window_layers on: layer 0 global, 1 and 2 local."""
    from tests.engine.conftest import save_tiny_model

    return save_tiny_model(
        tmp_path_factory.mktemp("hybrid"),
        "qwen2",
        seed=5,
        sliding_window=WINDOW,
        use_sliding_window=True,
        max_window_layers=1,
    )


def test_hybrid_local_global_layers_match_transformers(
    hybrid_dir: Path, prompts: list[list[int]], attention_path: str
) -> None:
    """Each layer keeps its own kind, and a model with a global layer keeps every block."""
    expected = transformers_greedy(hybrid_dir, prompts, NEW_TOKENS)
    llm = _llm(hybrid_dir, max_num_batched_tokens=16)
    kinds = [spec.window for spec in llm.engine.runner.model.attention_specs()]
    assert kinds == [None, WINDOW, WINDOW]
    assert llm.engine.block_manager.kv_window is None
    assert _generate(llm, prompts) == expected


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 text: layers 0, 1 local (window, local rope base), 2 global; QK-norm,
    sandwich norms, scaled embeddings, gelu-tanh, a query_pre_attn_scalar scale."""
    from tests.engine.conftest import save_tiny_model

    return save_tiny_model(
        tmp_path_factory.mktemp("gemma3"),
        "gemma3",
        seed=11,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        hidden_activation="gelu_pytorch_tanh",
    )


def _uncached_greedy(
    model_path: Path, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """transformers' greedy tokens from its forward over each whole sequence, step by step
    (no KV cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(new_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(logits.argmax()))
            outputs.append(ids[len(prompt) :])
    return outputs


def test_gemma3_matches_transformers(
    gemma3_dir: Path, prompts: list[list[int]], attention_path: str
) -> None:
    """Against transformers' forward without a cache: its generate() for Gemma 3 (5.x) takes
    other tokens than its own forward over the same sequence once past the window (its sliding
    cache), while Mistral's and Qwen2's agree with their forward."""
    expected = _uncached_greedy(gemma3_dir, prompts, NEW_TOKENS)
    llm = _llm(gemma3_dir, max_num_batched_tokens=16)
    kinds = [spec.window for spec in llm.engine.runner.model.attention_specs()]
    assert kinds == [WINDOW, WINDOW, None]
    assert _generate(llm, prompts) == expected


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 2: local and global layers alternating, attention and final logits soft-capped
    (caps low enough to bend these tiny models' scores)."""
    from tests.engine.conftest import save_tiny_model

    return save_tiny_model(
        tmp_path_factory.mktemp("gemma2"),
        "gemma2",
        seed=13,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=5.0,
        hidden_activation="gelu_pytorch_tanh",
    )


def test_gemma2_matches_transformers(
    gemma2_dir: Path, prompts: list[list[int]], attention_path: str
) -> None:
    expected = transformers_greedy(gemma2_dir, prompts, NEW_TOKENS)
    llm = _llm(gemma2_dir, max_num_batched_tokens=16)
    kinds = [spec.window for spec in llm.engine.runner.model.attention_specs()]
    assert kinds == [WINDOW, None, WINDOW]
    assert _generate(llm, prompts) == expected
