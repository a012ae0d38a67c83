"""The prefill-attention choice: the fastest candidate by measurement, failures dropped, and
each path the choice can name computing the same attention as the torch reference."""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.prefill_select import (
    PrefillCandidate,
    PrefillChoice,
    Run,
    fastest,
    measure,
)
from engine.attention.torch_plan import PrefillShape
from kernels.reference import unified_attention_ref
from tests.engine.test_model_parity import TRITON_DEVICE
from tests.kernels.paged_cases import PagedBatch, make_paged_batch


def _seconds_timer(run: Run) -> float:
    """A stand-in clock: each fake backend's run returns the seconds it 'takes'."""
    seconds = run()
    assert isinstance(seconds, float)
    return seconds


def _fake(name: str, seconds: float) -> PrefillCandidate:
    return PrefillCandidate(name, lambda: lambda: seconds)


def _broken_at_prepare(name: str) -> PrefillCandidate:
    def prepare() -> Run:
        raise RuntimeError("no kernel image is available for execution on the device")

    return PrefillCandidate(name, prepare)


def _broken_at_run(name: str) -> PrefillCandidate:
    def run() -> object:
        raise NotImplementedError("this torch has no flash path for these inputs")

    return PrefillCandidate(name, lambda: run)


def test_the_faster_of_two_backends_is_chosen() -> None:
    seconds = measure([_fake("slow", 0.004), _fake("fast", 0.001)], _seconds_timer)
    assert seconds == {"slow": 0.004, "fast": 0.001}
    assert fastest(seconds) == "fast"
    assert fastest(measure([_fake("fast", 0.001), _fake("slow", 0.004)], _seconds_timer)) == "fast"


def test_a_backend_that_raises_drops_out(caplog) -> None:
    candidates = [_broken_at_prepare("faster"), _fake("kernel", 0.003), _broken_at_run("flash")]
    seconds = measure(candidates, _seconds_timer)
    assert seconds == {"kernel": 0.003}
    assert fastest(seconds) == "kernel"
    assert "faster failed" in caplog.text and "flash failed" in caplog.text


def test_no_choice_where_every_backend_raises() -> None:
    assert fastest(measure([_broken_at_prepare("a"), _broken_at_run("b")], _seconds_timer)) is None


def _metadata(batch: PagedBatch) -> AttentionMetadata:
    seq_lens = batch.seq_lens.tolist()
    return AttentionMetadata(
        slot_mapping=torch.full((batch.q.shape[0],), -1, dtype=torch.int64, device=batch.q.device),
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_tables=batch.block_tables,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        query_lens_cpu=list(batch.query_lens),
        seq_lens_cpu=seq_lens,
    )


def _choices() -> list[PrefillChoice]:
    pytest.importorskip("triton")  # tests/conftest.py selects the interpreter on the CPU
    from kernels import PrefillTiles

    return [
        PrefillChoice(),
        PrefillChoice(sdpa=True),
        PrefillChoice(tiles=PrefillTiles(128, 64, 4, 2)),
    ]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["kernel-default", "sdpa", "kernel-128x64"])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(8, 2), (6, 6)], ids=["gqa4", "mha"])
def test_each_chosen_path_matches_the_reference(
    index: int, num_q_heads: int, num_kv_heads: int
) -> None:
    """A mixed step: a chunk after a paged prefix, a decode, a whole prompt."""
    choice = _choices()[index]
    from engine.attention.triton_backend import TritonAttentionBackend

    asked: list[PrefillShape] = []

    def choose(shape: PrefillShape) -> PrefillChoice:
        asked.append(shape)
        return choice

    backend = TritonAttentionBackend(choose_prefill=choose)
    batch = make_paged_batch(
        [20, 1, 33], [45, 13, 33], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=64, block_size=16, dtype=torch.float32, device=torch.device(TRITON_DEVICE),
    )  # fmt: skip
    meta = _metadata(batch)
    k = torch.zeros(batch.q.shape[0], num_kv_heads, 64, device=batch.q.device)
    expected = unified_attention_ref(*batch.attention_args(torch.empty_like(batch.q), 0.125))
    for _ in range(2):  # the second step reuses the choice
        out = backend.forward(batch.q, k, k, batch.k_cache, batch.v_cache, meta, 0.125)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert asked == [PrefillShape(torch.float32, num_q_heads, num_kv_heads, 64, 16)]


def test_an_sdpa_failure_mid_run_falls_back_to_the_kernel(caplog) -> None:
    pytest.importorskip("triton")
    from engine.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend(choose_prefill=lambda shape: PrefillChoice(sdpa=True))
    calls: list[int] = []

    def failing_sdpa(*args: object) -> torch.Tensor:
        calls.append(1)
        raise RuntimeError("CUDA error: no kernel for this head size")

    backend._sdpa_paged_prefill = failing_sdpa  # type: ignore[method-assign]
    batch = make_paged_batch(
        [20, 1], [45, 13], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float32, device=torch.device(TRITON_DEVICE),
    )  # fmt: skip
    k = torch.zeros(batch.q.shape[0], 2, 64, device=batch.q.device)
    expected = unified_attention_ref(*batch.attention_args(torch.empty_like(batch.q), 0.125))
    for _ in range(2):
        out = backend.forward(batch.q, k, k, batch.k_cache, batch.v_cache, _metadata(batch), 0.125)
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-5)
    assert calls == [1]  # the failure moved the shape to the kernel for good
    assert "SDPA prefill failed" in caplog.text
