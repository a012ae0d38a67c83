"""Part (a) of bench/suites/gpu.py: unified_attention vs SDPA on pre-gathered K/V.

Imports only torch, triton and kernels (no engine, no pydantic), except `bench_chosen_prefill`,
which asks the engine's attention backend for the prefill path it picks on this GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from bench.common.gpu_report import PrefillShape, attention_flops, markdown_table

if TYPE_CHECKING:
    from engine.attention.triton_backend import TritonAttentionBackend

logger = logging.getLogger("bench.gpu")


@dataclass(frozen=True)
class AttentionBenchConfig:
    decode_batches: list[int]
    decode_contexts: list[int]
    prefill_shapes: list[PrefillShape]
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    max_gib: float = 40.0  # skip shapes whose paged + gathered K/V would exceed this
    warmup_ms: int = 25
    rep_ms: int = 100
    device: str = "cuda"  # "cpu" only for smoke tests under TRITON_INTERPRET=1


@dataclass
class _Case:
    """A paged cache (shuffled blocks) plus the same K/V gathered densely for SDPA."""

    q_flat: torch.Tensor  # [T, Hq, D] for unified_attention
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    q_dense: torch.Tensor  # [B, Hq, L, D]
    k_dense: torch.Tensor  # [B, Hkv, S, D]
    v_dense: torch.Tensor


def _bytes_needed(cfg: AttentionBenchConfig, batch: int, seq_len: int) -> int:
    blocks = -(-seq_len // cfg.block_size) * cfg.block_size
    # paged K+V plus the gathered dense copy for SDPA, bf16
    return 2 * 2 * batch * (blocks + seq_len) * cfg.num_kv_heads * cfg.head_dim


def _make_case(cfg: AttentionBenchConfig, batch: int, query_len: int, seq_len: int) -> _Case:
    device, dtype = torch.device(cfg.device), torch.bfloat16
    blocks_per_seq = -(-seq_len // cfg.block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        dense = cache[block_tables].flatten(1, 2)[:, :seq_len]  # [B, S, Hkv, D]
        return dense.transpose(1, 2).contiguous()

    q_dense = torch.randn(
        batch, cfg.num_q_heads, query_len, cfg.head_dim, device=device, dtype=dtype
    )
    starts = torch.arange(batch + 1, device=device, dtype=torch.int32) * query_len
    return _Case(
        q_flat=q_dense.transpose(1, 2).reshape(batch * query_len, cfg.num_q_heads, cfg.head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        query_start_loc=starts,
        seq_lens=torch.full((batch,), seq_len, device=device, dtype=torch.int32),
        block_tables=block_tables.to(torch.int32),
        max_query_len=query_len,
        max_seq_len=seq_len,
        q_dense=q_dense,
        k_dense=gather(k_cache),
        v_dense=gather(v_cache),
    )


def _sdpa_fn(case: _Case, scale: float) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA over the dense K/V, bottom-right causal; native GQA where this torch has it."""
    q_len, seq_len = case.q_dense.shape[2], case.k_dense.shape[2]
    group = case.q_dense.shape[1] // case.k_dense.shape[1]
    mask = None
    if 1 < q_len < seq_len:
        mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=case.q_dense.device)
        mask = mask.tril(seq_len - q_len)
    causal = q_len == seq_len and q_len > 1
    kwargs = {"attn_mask": mask, "is_causal": causal, "scale": scale}
    try:
        F.scaled_dot_product_attention(
            case.q_dense, case.k_dense, case.v_dense, enable_gqa=True, **kwargs
        )
    except (TypeError, RuntimeError):  # torch < 2.5, or no kernel for GQA with these inputs
        k = case.k_dense.repeat_interleave(group, dim=1)
        v = case.v_dense.repeat_interleave(group, dim=1)
        return lambda: F.scaled_dot_product_attention(case.q_dense, k, v, **kwargs), "expanded K/V"
    return (
        lambda: F.scaled_dot_product_attention(
            case.q_dense, case.k_dense, case.v_dense, enable_gqa=True, **kwargs
        ),
        "enable_gqa" if mask is None else "enable_gqa, explicit mask",
    )


def _triton_fn(case: _Case, scale: float, num_splits: int | None) -> Callable[[], torch.Tensor]:
    from kernels import unified_attention

    out = torch.empty_like(case.q_flat)
    args = (
        case.q_flat, case.k_cache, case.v_cache, out, case.query_start_loc, case.seq_lens,
        case.block_tables, scale, case.max_query_len, case.max_seq_len,
    )  # fmt: skip
    return lambda: unified_attention(*args, num_splits=num_splits)


def _max_abs_error(triton_out: torch.Tensor, sdpa_out: torch.Tensor) -> float:
    batch, heads, q_len, dim = sdpa_out.shape
    dense = triton_out.view(batch, q_len, heads, dim).transpose(1, 2)
    return (dense.float() - sdpa_out.float()).abs().max().item()


def _release_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _time_ms(fn: Callable[[], object], cfg: AttentionBenchConfig) -> float:
    """Median ms with the L2 cache flushed between runs (triton's do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")


def _decode_row(cfg: AttentionBenchConfig, batch: int, context: int) -> list:
    from kernels import choose_num_splits

    scale = cfg.head_dim**-0.5
    case = _make_case(cfg, batch, 1, context)
    splits = choose_num_splits(batch, cfg.num_kv_heads, 1, context, torch.device(cfg.device))
    auto, single = _triton_fn(case, scale, None), _triton_fn(case, scale, 1)
    sdpa, sdpa_note = _sdpa_fn(case, scale)
    error = _max_abs_error(auto(), sdpa())
    auto_ms, single_ms, sdpa_ms = _time_ms(auto, cfg), _time_ms(single, cfg), _time_ms(sdpa, cfg)
    logger.info("decode %dx%d: triton %.3f ms, sdpa %.3f ms", batch, context, auto_ms, sdpa_ms)
    kv_bytes = 2 * batch * context * cfg.num_kv_heads * cfg.head_dim * 2
    return [
        batch, context, splits, auto_ms, single_ms, sdpa_ms, sdpa_ms / auto_ms,
        kv_bytes / (auto_ms * 1e-3) / 1e9, error, sdpa_note,
    ]  # fmt: skip


def bench_decode(cfg: AttentionBenchConfig) -> str:
    rows = []
    for batch in cfg.decode_batches:
        for context in cfg.decode_contexts:
            if _bytes_needed(cfg, batch, context) > cfg.max_gib * 2**30:
                logger.info("decode %dx%d skipped: over --max-gib", batch, context)
                continue
            rows.append(_decode_row(cfg, batch, context))
            _release_memory()  # the case's tensors died with _decode_row's frame
    headers = [
        "batch", "context", "splits (auto)", "triton ms", "triton 1-pass ms", "SDPA ms",
        "SDPA ÷ triton", "triton K/V GB/s", "max abs err", "SDPA mode",
    ]  # fmt: skip
    return (
        f"Decode, bf16, {cfg.num_q_heads}/{cfg.num_kv_heads} heads, D={cfg.head_dim}, "
        f"block {cfg.block_size} (shuffled). SDPA ÷ triton > 1: the Triton kernel is faster.\n\n"
        + markdown_table(headers, rows)
    )


def _prefill_row(cfg: AttentionBenchConfig, shape: PrefillShape) -> list:
    scale = cfg.head_dim**-0.5
    case = _make_case(cfg, shape.batch, shape.query_len, shape.seq_len)
    triton_fn = _triton_fn(case, scale, None)
    sdpa, sdpa_note = _sdpa_fn(case, scale)
    error = _max_abs_error(triton_fn(), sdpa())
    triton_ms, sdpa_ms = _time_ms(triton_fn, cfg), _time_ms(sdpa, cfg)
    logger.info("prefill %s: triton %.3f ms, sdpa %.3f ms", shape.label, triton_ms, sdpa_ms)
    flops = attention_flops(
        shape.batch, cfg.num_q_heads, cfg.head_dim, shape.query_len, shape.context_len
    )
    return [
        shape.label, triton_ms, sdpa_ms, sdpa_ms / triton_ms,
        flops / (triton_ms * 1e-3) / 1e12, flops / (sdpa_ms * 1e-3) / 1e12, error, sdpa_note,
    ]  # fmt: skip


def bench_prefill(cfg: AttentionBenchConfig) -> str:
    rows = []
    for shape in cfg.prefill_shapes:
        if _bytes_needed(cfg, shape.batch, shape.seq_len) > cfg.max_gib * 2**30:
            logger.info("prefill %s skipped: over --max-gib", shape.label)
            continue
        rows.append(_prefill_row(cfg, shape))
        _release_memory()
    headers = [
        "shape", "triton ms", "SDPA ms", "SDPA ÷ triton", "triton TFLOP/s", "SDPA TFLOP/s",
        "max abs err", "SDPA mode",
    ]  # fmt: skip
    return (
        f"Prefill, bf16, {cfg.num_q_heads}/{cfg.num_kv_heads} heads, D={cfg.head_dim}, causal "
        "(shape = sequences x new tokens [+ cached context]).\n\n" + markdown_table(headers, rows)
    )


CHOSEN_PREFILL_SHAPES = "1x2048,1x4096,1x8192,1x4096+4096"


def bench_chosen_prefill(cfg: AttentionBenchConfig, shapes: list[PrefillShape]) -> str:
    """The prefill path the engine measures fastest at start-up, through its attention backend
    (the paged gather included), against SDPA's flash path on pre-gathered dense K/V."""
    from engine.attention.cuda_prefill import choose_cuda_prefill
    from engine.attention.torch_plan import PrefillShape as HeadShape
    from engine.attention.triton_backend import TritonAttentionBackend

    dtype = torch.bfloat16
    heads = HeadShape(dtype, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.block_size)
    choice = choose_cuda_prefill(heads)
    label = "SDPA per sequence" if choice.sdpa else f"triton {choice.tiles or 'default tiles'}"
    backend = TritonAttentionBackend(choose_prefill=lambda _: choice)
    rows = []
    for shape in shapes:
        if _bytes_needed(cfg, shape.batch, shape.seq_len) > cfg.max_gib * 2**30:
            logger.info("chosen prefill %s skipped: over --max-gib", shape.label)
            continue
        rows.append(_chosen_prefill_row(cfg, shape, backend))
        _release_memory()  # the case's tensors died with the row's frame
    headers = [
        "shape", "chosen ms", "triton default ms", "SDPA ms", "chosen ÷ SDPA (goal <= 1.2)",
        "max abs err", "SDPA mode",
    ]  # fmt: skip
    return (
        f"Prefill through the engine's chosen path ({label}), bf16, {cfg.num_q_heads}/"
        f"{cfg.num_kv_heads} heads, D={cfg.head_dim}, block {cfg.block_size} (shuffled).\n\n"
        + markdown_table(headers, rows)
    )


def _chosen_prefill_row(
    cfg: AttentionBenchConfig, shape: PrefillShape, backend: TritonAttentionBackend
) -> list:
    from engine.attention.base import AttentionMetadata

    scale = cfg.head_dim**-0.5
    case = _make_case(cfg, shape.batch, shape.query_len, shape.seq_len)
    tokens, device = case.q_flat.shape[0], case.q_flat.device
    meta = AttentionMetadata(
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=case.query_start_loc,
        seq_lens=case.seq_lens,
        block_tables=case.block_tables,
        max_query_len=case.max_query_len,
        max_seq_len=case.max_seq_len,
        query_lens_cpu=[shape.query_len] * shape.batch,
        seq_lens_cpu=[shape.seq_len] * shape.batch,
    )
    kv = torch.zeros(tokens, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16, device=device)

    def chosen() -> torch.Tensor:
        return backend.forward(case.q_flat, kv, kv, case.k_cache, case.v_cache, meta, scale)

    default = _triton_fn(case, scale, None)
    sdpa, sdpa_note = _sdpa_fn(case, scale)
    error = _max_abs_error(chosen(), sdpa())
    chosen_ms, default_ms = _time_ms(chosen, cfg), _time_ms(default, cfg)
    sdpa_ms = _time_ms(sdpa, cfg)
    logger.info("chosen prefill %s: %.3f ms, sdpa %.3f ms", shape.label, chosen_ms, sdpa_ms)
    return [shape.label, chosen_ms, default_ms, sdpa_ms, chosen_ms / sdpa_ms, error, sdpa_note]
