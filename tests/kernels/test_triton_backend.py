"""TritonAttentionBackend over several engine steps equals dense causal attention."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paged_cases import dense_causal_attention

from engine.attention.base import AttentionMetadata

pytest.importorskip("triton")

BLOCK_SIZE, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 6, 2, 32


class _PagedSequence:
    """One sequence's ground-truth K/V and its (shuffled) physical blocks."""

    def __init__(self, free_blocks: list[int]) -> None:
        self.free_blocks = free_blocks
        self.blocks: list[int] = []
        self.k = torch.empty(0, NUM_KV_HEADS, HEAD_DIM)
        self.v = torch.empty(0, NUM_KV_HEADS, HEAD_DIM)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> list[int]:
        """Grows the context by len(k) tokens; returns their cache slots."""
        start = self.k.shape[0]
        self.k, self.v = torch.cat([self.k, k]), torch.cat([self.v, v])
        while len(self.blocks) * BLOCK_SIZE < self.k.shape[0]:
            self.blocks.append(self.free_blocks.pop())
        positions = range(start, self.k.shape[0])
        return [self.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def _step(backend, caches, seqs, new_tokens, gen, device, padding_tokens=0):
    """Runs one step where seqs[i] gets new_tokens[i] tokens; checks every output row."""
    qs, ks, vs, slots = [], [], [], []
    for seq, n in zip(seqs, new_tokens, strict=True):
        qs.append(torch.randn(n, NUM_Q_HEADS, HEAD_DIM, generator=gen))
        ks.append(torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen))
        vs.append(torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=gen))
        slots += seq.append(ks[-1], vs[-1])
    for _ in range(padding_tokens):  # CUDA-graph style padding: garbage rows, slot -1
        qs.append(torch.randn(1, NUM_Q_HEADS, HEAD_DIM, generator=gen))
        ks.append(torch.full((1, NUM_KV_HEADS, HEAD_DIM), float("nan")))
        vs.append(torch.full((1, NUM_KV_HEADS, HEAD_DIM), float("nan")))
        slots.append(-1)
    max_blocks = max(len(s.blocks) for s in seqs)
    tables = [s.blocks + [0] * (max_blocks - len(s.blocks)) for s in seqs]
    seq_lens = [s.k.shape[0] for s in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, *torch.tensor(new_tokens).cumsum(0).tolist()],
                                     dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(new_tokens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(new_tokens),
        seq_lens_cpu=seq_lens,
    )  # fmt: skip
    q = torch.cat(qs).to(device)
    scale = HEAD_DIM**-0.5
    out = backend.forward(
        q, torch.cat(ks).to(device), torch.cat(vs).to(device), *caches, meta, scale
    )
    assert out.shape == q.shape
    start = 0
    for seq, n in zip(seqs, new_tokens, strict=True):
        expected = dense_causal_attention(
            q[start : start + n], seq.k.to(device), seq.v.to(device), scale
        )
        torch.testing.assert_close(out[start : start + n], expected, atol=2e-5, rtol=1e-5)
        start += n


def test_chunked_prefill_then_decodes(device):
    """A 40-token prompt in two chunks beside another sequence's prefill and decodes."""
    from engine.attention.triton_backend import TritonAttentionBackend

    backend = TritonAttentionBackend()
    num_blocks = 12
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    caches = (torch.full(shape, float("nan"), device=device),
              torch.full(shape, float("nan"), device=device))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    long_seq, short_seq = _PagedSequence(free_blocks), _PagedSequence(free_blocks)

    _step(backend, caches, [long_seq, short_seq], [25, 10], gen, device)
    _step(backend, caches, [long_seq, short_seq], [15, 1], gen, device, padding_tokens=2)
    for _ in range(3):
        _step(backend, caches, [long_seq, short_seq], [1, 1], gen, device, padding_tokens=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cpu_without_interpreter_is_a_clear_error_and_refs_need_no_triton():
    script = (
        "import sys, torch, kernels\n"
        "from kernels import rms_norm_ref\n"
        "assert 'triton' not in sys.modules, 'importing the reference twins pulled in triton'\n"
        "from kernels import rms_norm\n"
        "try:\n"
        "    rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6)\n"
        "except RuntimeError as e:\n"
        "    assert 'TRITON_INTERPRET' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_every_kernel_variant_compiles_for_sm90(tmp_path):
    """The interpreter is lenient; the real compiler (to an H100 cubin) must accept them too."""
    script = Path(__file__).with_name("compile_for_sm90.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
