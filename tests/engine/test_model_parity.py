"""Our models, run step by step through the ModelRunner's paged KV cache, against transformers.

Several sequences run in one batch: full prefills, a prefill split into chunks whose later chunk
attends to cached context, a one-token prompt, and greedy decode steps, all over scattered
cache blocks. Every logits row the runner returns must match transformers' logits for the same
position of the full sequence, computed without any cache.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.sequence import ScheduledSeq, Sequence
from schemas.sampling import SamplingParams
from tests.engine.conftest import LLAMA3_ROPE
from tests.engine.runner_calls import step_logits

ATOL = 1e-4
BLOCK_SIZE = 4
# The Triton kernels compile for a GPU where there is one; on the CPU they run interpreted.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference_logits(model_path: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits [len, vocab] of each whole sequence, run alone without a cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids])).logits[0] for ids in sequences]


def _make_runner(
    model_path: Path,
    num_blocks: int = 96,
    backend: str = "torch",
    dtype: str = "float32",
    device: str = "cpu",
    enforce_eager: bool = False,
) -> ModelRunner:
    config = EngineConfig(
        model=str(model_path),
        device=device,  # type: ignore[arg-type]
        dtype=dtype,  # type: ignore[arg-type]
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        attention_backend=backend,
        enforce_eager=enforce_eager,
    )
    return ModelRunner(config, model_path)


def _run_schedule(
    runner: ModelRunner, prompts: list[list[int]], schedule: list[list[tuple[int, int]]]
) -> dict[tuple[int, int], torch.Tensor]:
    """Run steps of (sequence index, new tokens); sampled sequences append their greedy token.

    Returns {(sequence index, position): logits row}; the sequences end up in `prompts`.
    """
    rng = random.Random(0)
    free = list(range(runner.num_kv_blocks))
    rng.shuffle(free)
    seqs = [
        Sequence(
            f"r{i}", list(p), len(p), SamplingParams(), block_table=[free.pop() for _ in range(12)]
        )
        for i, p in enumerate(prompts)
    ]
    logits_at: dict[tuple[int, int], torch.Tensor] = {}
    for step in schedule:
        batch = [ScheduledSeq(seqs[i], n) for i, n in step]
        logits = step_logits(runner, batch)
        sampled = [s for s in batch if s.samples]
        assert logits.shape == (len(sampled), runner.vocab_size)
        assert logits.dtype == torch.float32
        for row, s in zip(logits, sampled, strict=True):
            index = seqs.index(s.seq)
            logits_at[(index, s.seq.num_tokens - 1)] = row
        for s in batch:  # what the scheduler and sampler do after a step
            s.seq.num_computed_tokens += s.num_new_tokens
        for row, s in zip(logits, sampled, strict=True):
            s.seq.append_token(int(row.argmax()))
    for prompt, seq in zip(prompts, seqs, strict=True):
        prompt[:] = seq.token_ids
    return logits_at


# Sequence 0: 7-token prompt; 1: 13 tokens in chunks of 8 and 5; 2: a one-token prompt;
# 3: 8 tokens, ending exactly at a block boundary. Then mixed and decode-only steps.
PROMPT_LENGTHS = [7, 13, 1, 8]
SCHEDULE = [
    [(0, 7), (1, 8), (2, 1)],
    [(0, 1), (1, 5), (2, 1), (3, 8)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(3, 1), (1, 1), (0, 1), (2, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
]


def _check_parity(
    model_path: Path,
    backend: str = "torch",
    dtype: str = "float32",
    atol: float = ATOL,
    device: str = "cpu",
) -> None:
    runner = _make_runner(model_path, backend=backend, dtype=dtype, device=device)
    rng = random.Random(1)
    prompts = [[rng.randrange(runner.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
    logits_at = _run_schedule(runner, prompts, SCHEDULE)
    assert len(logits_at) == 18
    for index, reference in enumerate(_reference_logits(model_path, prompts)):
        assert reference.std() > 0.3  # logits that vary, so the comparison means something
        positions = sorted(p for i, p in logits_at if i == index)
        ours = torch.stack([logits_at[(index, p)] for p in positions]).cpu()
        torch.testing.assert_close(ours, reference[positions], atol=atol, rtol=0)


CONFIGS = {
    "llama": ("llama", {}),
    "llama-mha-tied": ("llama", {"num_key_value_heads": 8, "tie_word_embeddings": True}),
    "llama3-rope-gqa4": ("llama", {"num_key_value_heads": 2, "rope_parameters": LLAMA3_ROPE}),
    "qwen2-qkv-bias": ("qwen2", {"tie_word_embeddings": True}),
    "mistral-no-window": ("mistral", {"sliding_window": None}),
}


@pytest.mark.parametrize(("kind", "overrides"), CONFIGS.values(), ids=CONFIGS.keys())
def test_tiny_model_matches_transformers(tiny_model_factory, kind: str, overrides: dict) -> None:
    _check_parity(tiny_model_factory(kind, **overrides))


# bf16 weights, activations and KV cache round every value to 8 bits of mantissa; the logits
# (spread ~1 here) stay within a few hundredths of fp32 transformers' (0.04-0.06 measured).
BF16_ATOL = 0.1


@pytest.mark.parametrize("kind", ["llama3-rope-gqa4", "qwen2-qkv-bias"])
def test_bfloat16_stays_close_to_float32_transformers(tiny_model_factory, kind: str) -> None:
    model_kind, overrides = CONFIGS[kind]
    _check_parity(tiny_model_factory(model_kind, **overrides), dtype="bfloat16", atol=BF16_ATOL)


@pytest.mark.parametrize("kind", ["llama3-rope-gqa4", "qwen2-qkv-bias"])
def test_triton_backend_matches_transformers(tiny_model_factory, kind: str) -> None:
    """The Triton kernels (interpreted on the CPU) run the same batches to the same logits."""
    pytest.importorskip("triton")  # on CPU-only machines tests/conftest.py selects the interpreter
    model_kind, overrides = CONFIGS[kind]
    _check_parity(
        tiny_model_factory(model_kind, **overrides), backend="triton", device=TRITON_DEVICE
    )


@pytest.mark.slow
@pytest.mark.model
def test_default_model_last_logits_match_transformers(default_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompts = [
        tokenizer.encode("The capital of France is"),
        tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return"),
    ]
    runner = _make_runner(default_model_path, num_blocks=64)
    seqs = [
        Sequence(
            f"r{i}",
            p,
            len(p),
            SamplingParams(),
            block_table=list(range(10 * i + 9, 10 * i - 1, -1)),
        )
        for i, p in enumerate(prompts)
    ]
    ours = step_logits(runner, [ScheduledSeq(s, s.num_tokens) for s in seqs])

    reference = torch.stack(
        [logits[-1] for logits in _reference_logits(default_model_path, prompts)]
    )
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)
