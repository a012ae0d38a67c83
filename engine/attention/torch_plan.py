"""The torch attention backend's per-step plan: gather indices, masks and the CPU kernels' tables.

Everything that depends only on the batch shape is derived once per step from the attention
metadata (`build_plan`) and kept on it, so every layer reuses it (engine.attention.torch_backend).
The portable path's masks under a sliding window are built on first use per window size
(`TorchAttentionPlan.masks`), so layers of a hybrid local/global model share them too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionMetadata


@dataclass(frozen=True)
class PrefillShape:
    """What the speed of a layer's prefill attention depends on, besides the chunk sizes."""

    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


@dataclass
class PrefillChunk:
    """One sequence with several query tokens: rows start:end of the flat batch."""

    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size)] block ids of its context
    mask: (
        torch.Tensor | None
    )  # [query_len, seq_len] additive; None: plain causal (no cached context)

    def windowed_mask(self, window: int, dtype: torch.dtype) -> torch.Tensor | None:
        """The chunk's mask where each query sees only the last `window` positions up to its
        own; None where that is plain causal (no cached context, nothing older than a window)."""
        n = self.end - self.start
        if self.mask is None and self.seq_len <= window:
            return None
        device = self.blocks.device
        key_pos = torch.arange(self.seq_len, device=device)[None, :]
        query_pos = torch.arange(self.seq_len - n, self.seq_len, device=device)[:, None]
        return _additive((key_pos > query_pos) | (key_pos <= query_pos - window), dtype)


@dataclass(frozen=True)
class WindowMasks:
    """The portable path's masks for one sliding-window size."""

    decode_mask: torch.Tensor | None  # as TorchAttentionPlan.decode_mask
    prefill_masks: list[torch.Tensor | None]  # one per TorchAttentionPlan.prefills entry


@dataclass
class PagedPrefill:
    """Every prefill chunk of a step as the CPU prefill kernel reads them (int32, one entry per
    chunk)."""

    tables: torch.Tensor  # [chunks, W] block tables
    starts: torch.Tensor  # first query row of each chunk
    query_lens: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class TorchAttentionPlan:
    token_slots: torch.Tensor  # [T] int64 cache slot of every token; -1: not stored
    write_slots: torch.Tensor  # [W] int64 cache slots to store
    write_rows: torch.Tensor | None  # [W] the token rows they come from; None: all rows, in order
    decode_rows: torch.Tensor | None  # rows of single-token sequences; None: every row is one
    decode_blocks: torch.Tensor | None  # [num_decodes * decode_blocks_per_seq] block ids
    decode_tables: torch.Tensor | None  # [num_decodes, W] int32 block tables (fused kernel)
    decode_lens: torch.Tensor | None  # [num_decodes] int32 context lengths (fused kernel)
    num_decodes: int
    decode_blocks_per_seq: int
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, ctx] additive; None: nothing padded
    prefills: list[PrefillChunk]  # the portable path's chunks; empty where paged_prefill runs
    max_gather_blocks: int  # workspace size in blocks
    paged_prefill: PagedPrefill | None = None
    # Every sequence goes through the CPU kernels: the step may rotate and store in one kernel
    # call too (attend_from_qkv).
    kernels: bool = False
    # ... and every sequence decodes one token (the C++ decode stack runs such steps).
    decodes_only_fused: bool = False
    decode_lens_cpu: list[int] = field(default_factory=list)  # the portable decodes' lengths
    decode_context: int = 0  # the portable decodes' gathered keys per sequence
    dtype: torch.dtype = torch.float32
    _window_masks: dict[int, WindowMasks] = field(default_factory=dict)

    def masks(self, window: int | None) -> WindowMasks:
        """The portable path's decode and prefill masks under `window` (None: full attention)."""
        if window is None:
            return WindowMasks(self.decode_mask, [chunk.mask for chunk in self.prefills])
        if window not in self._window_masks:
            decode_mask = self.decode_mask
            if any(n > window for n in self.decode_lens_cpu):
                decode_mask = _decode_mask(
                    self.decode_lens_cpu,
                    self.decode_context,
                    window,
                    self.dtype,
                    self.token_slots.device,
                )
            self._window_masks[window] = WindowMasks(
                decode_mask, [chunk.windowed_mask(window, self.dtype) for chunk in self.prefills]
            )
        return self._window_masks[window]


def build_plan(
    meta: AttentionMetadata,
    block_size: int,
    dtype: torch.dtype,
    paged_kernels: bool,
    sdpa_prefill: bool = False,
) -> TorchAttentionPlan:
    """Derive the per-step gather indices and masks from the batch description (once per step).

    paged_kernels: decodes and prefill chunks read the cache through their block tables (no
    gather indices, no masks). sdpa_prefill: with paged_kernels, prefill chunks still take
    the portable path, gathering all of their context from the cache.
    """
    device = meta.slot_mapping.device
    slot_mapping = meta.slot_mapping.to(torch.int64)
    valid = slot_mapping >= 0
    if bool(valid.all()):
        write_slots, write_rows = slot_mapping, None
    else:
        write_rows = valid.nonzero().squeeze(1)
        write_slots = slot_mapping.index_select(0, write_rows)

    query_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = [0] * len(query_lens)
    for i in range(1, len(query_lens)):
        starts[i] = starts[i - 1] + query_lens[i - 1]

    decode_seqs = [i for i, n in enumerate(query_lens) if n == 1]
    decode_rows = decode_blocks = decode_mask = decode_tables = decode_lens = None
    decode_blocks_per_seq = 0
    if decode_seqs and paged_kernels:
        if len(decode_seqs) == len(query_lens):
            decode_tables, decode_lens = meta.block_tables.contiguous(), meta.seq_lens
        else:
            decode_rows = torch.tensor([starts[i] for i in decode_seqs], device=device)
            decode_tables = meta.block_tables.index_select(0, decode_rows.new_tensor(decode_seqs))
            decode_lens = meta.seq_lens.index_select(0, decode_rows.new_tensor(decode_seqs))
    elif decode_seqs:
        decode_lens = [seq_lens[i] for i in decode_seqs]
        decode_blocks_per_seq = -(-max(decode_lens) // block_size)
        if len(decode_seqs) == len(query_lens):
            table = meta.block_tables[:, :decode_blocks_per_seq]
        else:
            decode_rows = torch.tensor([starts[i] for i in decode_seqs], device=device)
            seq_index = torch.tensor(decode_seqs, device=device)
            table = meta.block_tables.index_select(0, seq_index)[:, :decode_blocks_per_seq]
        decode_blocks = table.reshape(-1).to(torch.int64)
        ctx = decode_blocks_per_seq * block_size
        if any(n != ctx for n in decode_lens):
            decode_mask = _decode_mask(decode_lens, ctx, None, dtype, device)

    prefill_seqs = [i for i, n in enumerate(query_lens) if n > 1]
    prefills = []
    max_gather_blocks = len(decode_seqs) * decode_blocks_per_seq
    paged_prefill = None
    if prefill_seqs and paged_kernels and not sdpa_prefill:
        paged_prefill = PagedPrefill(
            tables=meta.block_tables.index_select(0, torch.tensor(prefill_seqs, device=device)),
            starts=_int32([starts[i] for i in prefill_seqs], device),
            query_lens=_int32([query_lens[i] for i in prefill_seqs], device),
            seq_lens=_int32([seq_lens[i] for i in prefill_seqs], device),
        )
    for i in prefill_seqs if paged_prefill is None else ():
        n = query_lens[i]
        seq_len = seq_lens[i]
        num_blocks = -(-seq_len // block_size)
        mask = None
        # read back from the cache: cached context, or any chunk when the kernels stored K/V
        if paged_kernels or seq_len != n:
            max_gather_blocks = max(max_gather_blocks, num_blocks)
        if seq_len != n:  # cached context: query j sits at position seq_len - n + j
            key_pos = torch.arange(seq_len, device=device)[None, :]
            query_pos = torch.arange(seq_len - n, seq_len, device=device)[:, None]
            mask = _additive(key_pos > query_pos, dtype)
        blocks = meta.block_tables[i, :num_blocks].to(torch.int64)
        prefills.append(PrefillChunk(starts[i], starts[i] + n, seq_len, blocks, mask))

    return TorchAttentionPlan(
        token_slots=slot_mapping,
        write_slots=write_slots,
        write_rows=write_rows,
        decode_rows=decode_rows,
        decode_blocks=decode_blocks,
        decode_tables=decode_tables,
        decode_lens=decode_lens,
        num_decodes=len(decode_seqs),
        decode_blocks_per_seq=decode_blocks_per_seq,
        decode_mask=decode_mask,
        prefills=prefills,
        max_gather_blocks=max_gather_blocks,
        kernels=paged_kernels,
        decodes_only_fused=decode_tables is not None and decode_rows is None and not prefill_seqs,
        paged_prefill=paged_prefill,
        decode_lens_cpu=decode_lens if isinstance(decode_lens, list) else [],
        decode_context=decode_blocks_per_seq * block_size,
        dtype=dtype,
    )


def _decode_mask(
    lens: list[int], ctx: int, window: int | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[S, 1, 1, ctx] additive: each decode row sees its first lens[s] keys, or only the last
    `window` of them."""
    lens_t = torch.tensor(lens, device=device)[:, None]
    key_pos = torch.arange(ctx, device=device)[None, :]
    hidden = key_pos >= lens_t
    if window is not None:
        hidden |= key_pos < lens_t - window
    return _additive(hidden, dtype).view(len(lens), 1, 1, ctx)


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _additive(masked_out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(masked_out.shape, dtype=dtype, device=masked_out.device).masked_fill_(
        masked_out, float("-inf")
    )
