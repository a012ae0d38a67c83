"""Whether a CPU step's prefill chunks run faster through torch's SDPA than through our kernel.

Our paged prefill kernel computes in float32 vectors. torch's SDPA gathers nothing itself but
runs its bf16 matmuls on AMX tiles where the CPU has them: on a Xeon with AMX it took a 256-token
chunk in 40% of the kernel's time, while on CPUs without AMX, and in float32, the kernel is as
fast or faster. So it is measured, once per machine and attention shape, over one layer's
prefill through the backend itself (chunks with and without cached context, the gather from the
cache included), and kept in engine.platforms.cpu.machine_cache.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.torch_plan import PrefillShape
from engine.platforms.cpu.machine_cache import cached, machine_key

logger = logging.getLogger(__name__)

KIND = "cpu_prefill_attention"
# (cached context, new tokens) per chunk of the measured step: a whole prompt and the second
# chunk of a longer one
CHUNKS = ((0, 256), (256, 128))
# The answer is kept for good: only a clear win moves a machine off the kernel.
CLEAR_WIN = 0.85


def sdpa_prefill_wins(shape: PrefillShape) -> bool:
    """Whether SDPA clearly beats the prefill kernel at `shape` on this machine."""
    key = machine_key(
        dtype=str(shape.dtype).removeprefix("torch."),
        heads=shape.num_heads,
        kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=shape.block_size,
        chunks=[list(chunk) for chunk in CHUNKS],
    )
    seconds = cached(KIND, key, lambda: _measure(shape), _read)
    wins = seconds["sdpa"] < CLEAR_WIN * seconds["kernel"]
    logger.info(
        "CPU prefill attention (%s): kernel %.2f ms, SDPA %.2f ms -> %s",
        key["dtype"],
        1e3 * seconds["kernel"],
        1e3 * seconds["sdpa"],
        "SDPA" if wins else "kernel",
    )
    return wins


def _read(stored: object) -> dict[str, float]:
    if not isinstance(stored, dict):
        raise TypeError("not a timing pair")
    return {"kernel": float(stored["kernel"]), "sdpa": float(stored["sdpa"])}


def _measure(shape: PrefillShape) -> dict[str, float]:
    """Best of a few alternating runs of one layer's prefill through each path, in seconds."""
    bs = shape.block_size
    tables, slots, seq_lens, row_blocks = [], [], [], 0
    for context, new in CHUNKS:
        blocks = list(range(row_blocks, row_blocks + -(-(context + new) // bs)))
        row_blocks += len(blocks)
        tables.append(blocks)
        slots += [blocks[p // bs] * bs + p % bs for p in range(context, context + new)]
        seq_lens.append(context + new)
    width = max(len(t) for t in tables)
    query_lens = [new for _, new in CHUNKS]
    cache_shape = (row_blocks, bs, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape).to(shape.dtype)
    v_cache = torch.randn(cache_shape).to(shape.dtype)
    tokens = sum(query_lens)
    q = torch.randn(tokens, shape.num_heads, shape.head_dim).to(shape.dtype)
    k = torch.randn(tokens, shape.num_kv_heads, shape.head_dim).to(shape.dtype)
    v = torch.randn_like(k)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)

    def step_metadata() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]).int(),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )

    paths = {
        "kernel": TorchAttentionBackend(paged_kernels=True, sdpa_prefill=False),
        "sdpa": TorchAttentionBackend(paged_kernels=True, sdpa_prefill=True),
    }
    best = dict.fromkeys(paths, float("inf"))
    with torch.inference_mode():
        for _ in range(5):
            for name, backend in paths.items():
                meta = step_metadata()
                started = time.perf_counter()
                backend.forward(q, k, v, k_cache, v_cache, meta, shape.head_dim**-0.5)
                best[name] = min(best[name], time.perf_counter() - started)
    return best
