"""The greedy screen of a float32 LM head: a bf16 pass picks the candidates, fp32 settles them,
and the tokens are those of the fp32 logits' argmax, near-ties, padding and broken rows
included; the engine uses it only for plain greedy rows and generates the same tokens."""

from __future__ import annotations

import pytest
import torch

from engine.layers.linear import Linear
from engine.platforms.cpu import greedy_screen, machine_cache
from engine.platforms.cpu.greedy_screen import ScreenedLMHead
from kernels import cpu_ops

pytestmark = pytest.mark.skipif(
    not (cpu_ops.cpu_kernels_available() and cpu_ops.panel_matmul_supported(torch.bfloat16)),
    reason="no bf16 panel kernels on this CPU (AVX512-BF16)",
)

VOCAB, HIDDEN = 1000, 96


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERQ_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(machine_cache, "_others_share", lambda *args: 0.0)


def _head(weight: torch.Tensor) -> Linear:
    layer = Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


def _hidden_near(weight: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """Hidden states like a model's: near some tokens' rows, at a final norm's scale."""
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, weight.shape[0], (rows,), generator=generator)
    near = weight[picks] + 0.5 * torch.randn(rows, weight.shape[1], generator=generator)
    return near * (50.0 / near.norm(dim=1, keepdim=True))


def _weight(seed: int = 0, rows: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HIDDEN, generator=generator) * 0.13


def _fp32_argmax(hidden: torch.Tensor, weight: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    return (hidden @ weight.T)[:, :vocab].argmax(dim=-1)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_the_screen_finds_the_fp32_argmax(rows):
    weight = _weight()
    hidden = _hidden_near(weight, rows, seed=rows)
    head = ScreenedLMHead(_head(weight), VOCAB)
    assert torch.equal(head.argmax(hidden), _fp32_argmax(hidden, weight))


def test_flat_rows_are_settled_in_fp32_too():
    """Hidden states that favour no token: many candidates, still the fp32 argmax."""
    weight = _weight(1)
    hidden = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(3))
    head = ScreenedLMHead(_head(weight), VOCAB)
    assert torch.equal(head.argmax(hidden), _fp32_argmax(hidden, weight))


def test_a_near_tie_below_bf16_resolution_goes_to_the_fp32_winner():
    """Two tokens whose logits differ far below what bf16 resolves: the fp32 larger one wins,
    whichever of the two comes first in the vocabulary."""
    weight = _weight(2)
    hidden = _hidden_near(weight, 1, seed=5)
    top = int(_fp32_argmax(hidden, weight))
    other = (top + 17) % VOCAB
    for bigger in (top, other):
        nudged = weight.clone()
        nudged[other] = weight[top]
        # Moves the nudged token's logit by ~1e-5 of ~30: invisible in bf16, clear in fp32.
        column = int(hidden[0].abs().argmax())
        sign = 1.0 if bigger == other else -1.0
        nudged[other, column] += sign * 3e-4 / float(hidden[0, column])
        expected = _fp32_argmax(hidden, nudged)
        assert int(expected) == bigger
        head = ScreenedLMHead(_head(nudged), VOCAB)
        assert torch.equal(head.argmax(hidden), expected)


def test_equal_logits_keep_the_first_token_as_torch_argmax_does():
    weight = _weight(3)
    hidden = _hidden_near(weight, 4, seed=6)
    winners = _fp32_argmax(hidden, weight)
    copied = weight.clone()
    for token in winners.tolist():
        copied[VOCAB - 1 - token % 10] = weight[token]  # an equal row elsewhere
    head = ScreenedLMHead(_head(copied), VOCAB)
    assert torch.equal(head.argmax(hidden), _fp32_argmax(hidden, copied))


def test_padding_columns_past_the_vocabulary_never_win():
    weight = _weight(4, rows=VOCAB + 24)
    hidden = _hidden_near(weight[:VOCAB], 8, seed=7)
    weight[VOCAB:] = hidden[0] * 10  # padding rows with the largest logits of all
    head = ScreenedLMHead(_head(weight), VOCAB)
    got = head.argmax(hidden)
    assert (got < VOCAB).all()
    assert torch.equal(got, _fp32_argmax(hidden, weight))


def test_rows_the_screen_cannot_settle_are_computed_in_full(monkeypatch):
    """Rows over the candidate cap (a tie across most of the vocabulary) and a NaN row: the
    kernel leaves them unsettled, and the head computes them through the full fp32 head."""
    weight = _weight(5)
    weight[10:] = weight[9]  # tokens 9.. all tie
    toward_the_tie = weight[9].repeat(2, 1) * (50.0 / float(weight[9].norm()))
    hidden = torch.cat([toward_the_tie, torch.full((1, HIDDEN), torch.nan)])
    monkeypatch.setattr(greedy_screen, "MAX_CANDIDATES", 4)
    head = ScreenedLMHead(_head(weight), VOCAB)
    approx = cpu_ops.panel_linear(hidden.bfloat16(), head.panels, None, VOCAB)
    settled = cpu_ops.screened_argmax(approx, hidden, head.weight, head.row_norms, VOCAB, 4)
    assert settled.tolist() == [-1, -1, -1]
    tokens = head.argmax(hidden)
    assert torch.equal(tokens, (hidden @ weight.T).argmax(dim=-1))
    assert tokens[:2].tolist() == [9, 9]  # the first of the tied tokens


def test_off_builds_nothing_and_on_needs_a_plain_fp32_weight():
    head = _head(_weight())
    assert greedy_screen.build(head, VOCAB, "off") is None
    assert isinstance(greedy_screen.build(head, VOCAB, "on"), ScreenedLMHead)
    with pytest.raises(ValueError, match="cpu_greedy_screen='on'"):
        greedy_screen.build(_head(_weight()).to(torch.bfloat16), VOCAB, "on")


def test_auto_measures_once_and_keeps_the_answer(tmp_path, monkeypatch):
    head = _head(_weight())
    calls = []
    measure = greedy_screen.measure_share
    monkeypatch.setattr(
        greedy_screen, "measure_share", lambda screened: calls.append(1) or measure(screened)
    )
    first = greedy_screen.build(head, VOCAB, "auto")
    second = greedy_screen.build(head, VOCAB, "auto")
    assert len(calls) == 1
    assert (first is None) == (second is None)
    assert list((tmp_path / "home" / greedy_screen.CACHE_KIND).glob("*.json"))


def _llm(model_dir, screen: str):
    from engine import LLM

    return LLM(str(model_dir), dtype="float32", enforce_eager=True, cpu_greedy_screen=screen)


def test_the_engine_generates_the_same_greedy_tokens_through_the_screen(
    tiny_model_factory, monkeypatch
):
    from engine import SamplingParams

    model_dir = tiny_model_factory("llama", tie_word_embeddings=True)
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29] * 3, [3, 4], list(range(40, 90))]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    screened = _llm(model_dir, "on")
    assert screened.engine.runner.greedy_screen is not None
    calls = []
    original = ScreenedLMHead.argmax
    monkeypatch.setattr(
        ScreenedLMHead, "argmax", lambda self, hidden: calls.append(1) or original(self, hidden)
    )
    got = [o.outputs[0].token_ids for o in screened.generate(prompts, greedy, use_tqdm=False)]
    full = _llm(model_dir, "off")
    assert full.engine.runner.greedy_screen is None
    expected = [o.outputs[0].token_ids for o in full.generate(prompts, greedy, use_tqdm=False)]
    assert got == expected
    assert calls  # the tokens did come through the screen


def test_rows_that_need_their_logits_bypass_the_screen(tiny_model_factory, monkeypatch):
    """logprobs, logit_bias and sampled rows in the batch: the full logits, as without it."""
    from engine import SamplingParams

    model_dir = tiny_model_factory("llama", tie_word_embeddings=True)
    prompts = [[1, 5, 9, 13], [3, 4, 5], [7, 8]]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2
        ),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0}),
        SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=11),
    ]
    screened = _llm(model_dir, "on")
    monkeypatch.setattr(
        ScreenedLMHead, "argmax", lambda self, hidden: pytest.fail("screen used for such rows")
    )
    got = screened.generate(prompts, params, use_tqdm=False)
    expected = _llm(model_dir, "off").generate(prompts, params, use_tqdm=False)
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
    assert got[1].outputs[0].token_ids == [42] * 6
    assert got[0].outputs[0].logprobs is not None


def test_the_screens_copy_counts_against_the_memory_budget(tiny_model_factory):
    """Under memory_budget the KV cache gets what the weights leave, the screen's copy included."""
    from engine import LLM

    model_dir = tiny_model_factory("llama", tie_word_embeddings=True)

    def runner(screen: str):
        llm = LLM(
            str(model_dir),
            dtype="float32",
            enforce_eager=True,
            cpu_greedy_screen=screen,
            memory_budget=8 << 20,
        )
        return llm.engine.runner

    with_screen, without = runner("on"), runner("off")
    assert with_screen.greedy_screen is not None
    extra = with_screen.greedy_screen.nbytes
    assert extra > 0
    assert with_screen.weight_bytes == without.weight_bytes + extra
    per_block = without.kv_spec.bytes_per_block
    assert with_screen.num_kv_blocks * per_block <= (8 << 20) - with_screen.weight_bytes
    assert with_screen.num_kv_blocks < without.num_kv_blocks
