"""C++ kernels for the CPU path, built once per machine (see kernels.cpu_build: keyed on the
sources, the flags, this CPU's instruction-set flags and torch's version, kept as one shared
library that later processes load in milliseconds; a different CPU gets its own build,
`-march=native`). Building needs a C++ compiler and ninja; where either is missing the caller
keeps its plain-torch path, and `cpu_kernels_available()` says so once in the log.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from kernels import cpu_build
from kernels.cpu_abi import CFLAGS as CFLAGS
from kernels.cpu_abi import LINEAR_INTS as LINEAR_INTS
from kernels.cpu_abi import LINEAR_SLOTS as LINEAR_SLOTS
from kernels.cpu_abi import QUANT_GEMM_MIN_ROWS as QUANT_GEMM_MIN_ROWS
from kernels.cpu_abi import LinearKind as LinearKind
from kernels.cpu_build import load_or_build

logger = logging.getLogger(__name__)


def build_name() -> str:
    """The CPU kernels' build: a hash of their sources, flags, this CPU's flags and torch."""
    return cpu_build.build_name(CFLAGS)


@functools.cache
def cpu_kernels_available() -> bool:
    """Build (or load the cached build of) the CPU kernels once per process; False if impossible."""
    started = time.perf_counter()
    try:
        load_or_build(CFLAGS)
    except Exception as error:  # a missing compiler or ninja: the plain-torch path still works
        logger.warning(
            "CPU attention kernels unavailable (%s); decoding gathers KV blocks and linear layers"
            " use torch's matmuls",
            error,
        )
        return False
    logger.info("CPU kernels ready in %.1f s", time.perf_counter() - started)
    return True


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """out [S, H, D] <- attention of one query row per sequence over its paged context.

    key/value_cache [num_blocks, block_size, Hkv, D]; block_tables [S, W] and seq_lens [S] int32.
    window: the query sees only the last `window` tokens (the blocks before are never read).
    softcap: scaled scores s become softcap * tanh(s / softcap) before the softmax.
    sinks: [H] float32 sink logits, each one more term of its head's softmax denominator.
    """
    torch.ops.inferq_cpu.paged_decode_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale,
        window or 0,
        softcap or 0.0,
        sinks,
    )


def paged_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """out rows of every prefill chunk <- causal attention over the chunk's paged context.

    Chunk c is query rows starts[c]:starts[c] + query_lens[c] of query [T, H, D], the last
    query_lens[c] of its sequence's seq_lens[c] tokens, whose K/V (these rows' included) are in
    key/value_cache [num_blocks, block_size, Hkv, D] through block_tables[c]; all int32.
    window: each query sees only the last `window` positions up to its own. softcap, sinks:
    as paged_decode_attention's."""
    torch.ops.inferq_cpu.paged_prefill_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        starts,
        query_lens,
        seq_lens,
        scale,
        window or 0,
        softcap or 0.0,
        sinks,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * weight over the last dimension (x, weight contiguous, same dtype)."""
    return torch.ops.inferq_cpu.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual)."""
    return torch.ops.inferq_cpu.add_rms_norm(x, residual, weight, eps)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """[rows] int64: each row's first maximum in logits [rows, width] (float32 or bfloat16,
    unit column stride); a NaN counts as the maximum, as in torch.argmax."""
    return torch.ops.inferq_cpu.argmax_rows(logits)


def screened_argmax(
    approx: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    row_norms: torch.Tensor,
    vocab_size: int,
    max_candidates: int,
) -> torch.Tensor:
    """[rows] int64: the first maximum of each row of (hidden @ weight.T)[:, :vocab_size] in
    float32, found from approx, the same product in bf16 (bf16 inputs, fp32 accumulation, bf16
    out), and row_norms, the L2 norm of each weight row: only the tokens whose screened logit
    may, within its rounding bound, be the maximum get an exact fp32 logit. -1 marks a row it
    could not settle (not finite, or more than max_candidates such tokens)."""
    return torch.ops.inferq_cpu.screened_argmax(
        approx, hidden, weight, row_norms, vocab_size, max_candidates
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] holding gate then up -> silu(gate) * up [..., d]."""
    return torch.ops.inferq_cpu.silu_and_mul(x)


def rotary_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
) -> torch.Tensor:
    """Neox-rotate q and k of qkv [T, (H + 2 Hkv) * D]; store k and v in their cache slots.

    Returns q [T, H, D]. slot_mapping [T] int64 (-1 skips a token), caches
    [num_blocks, block_size, Hkv, D] of qkv's dtype, cos_sin_cache [max_position, D] float32.
    """
    return torch.ops.inferq_cpu.rotary_store_kv(
        qkv, positions, cos_sin_cache, slot_mapping, key_cache, value_cache, num_heads
    )


# Output features per panel of kernels/cpu/panel_matmul.cpp's packed weight layouts.
PANEL_WIDTH = {torch.float32: 16, torch.bfloat16: 32}
# A gated weight's gate and up rows are interleaved this many at a time (each half of a tile).
GATED_GROUP = 16


def panel_matmul_supported(dtype: torch.dtype) -> bool:
    """Whether the panel matmul is built for this CPU and dtype (fp32: AVX2 and FMA; bf16:
    AVX512-BF16) and the kernels load."""
    return (
        dtype in PANEL_WIDTH
        and cpu_kernels_available()
        and bool(torch.ops.inferq_cpu.panel_matmul_supported(dtype))
    )


def panel_gated_supported(dtype: torch.dtype) -> bool:
    """Whether `panel_gated_linear` is built for this CPU and dtype (AVX-512; bf16: AVX512-BF16)."""
    return panel_matmul_supported(dtype) and bool(torch.ops.inferq_cpu.panel_gated_supported(dtype))


# Inputs per AMX tile step: a bf16 panel matmul whose input count is a multiple of this runs on
# AMX tiles where the CPU has them (kernels/cpu/panel_amx.h).
AMX_INPUTS = 32


def panel_amx_usable() -> bool:
    """Whether bf16 panel matmuls of whole AMX steps run on AMX tiles here: the CPU has AMX,
    the kernels were built for it and the OS lets this process use its tile state."""
    return cpu_kernels_available() and bool(torch.ops.inferq_cpu.panel_amx_usable())


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> panels of PANEL_WIDTH output features, zero past `out`: fp32
    [panels, in, 16], each panel input by input; bf16 [panels, ceil(in / 2), 32, 2], each
    panel's features holding their inputs in consecutive pairs (zero past `in`)."""
    if weight.dtype not in PANEL_WIDTH:
        raise TypeError(f"panels hold fp32 or bf16 weights, got {weight.dtype}")
    width = PANEL_WIDTH[weight.dtype]
    out_features, in_features = weight.shape
    if weight.dtype == torch.float32:
        padded = torch.nn.functional.pad(weight, (0, 0, 0, -out_features % width))
        return padded.view(-1, width, in_features).transpose(1, 2).contiguous()
    padded = torch.nn.functional.pad(weight, (0, in_features % 2, 0, -out_features % width))
    pairs = padded.view(-1, width, padded.shape[1] // 2, 2)
    return pairs.transpose(1, 2).contiguous()


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x @ W^T + bias for W packed by `pack_panels`; fp32 or bf16, x [..., in] -> [..., out]."""
    return torch.ops.inferq_cpu.panel_linear(x, panels, bias, out_features)


def interleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows [2 I, in] -> GATED_GROUP gate rows, the same features' up rows, the next
    GATED_GROUP gate rows, ...: the order panel_gated_linear wants them packed in."""
    halves = weight.view(2, -1, GATED_GROUP, weight.shape[-1])
    return halves.transpose(0, 1).reshape(weight.shape)


def deinterleave_gate_up(out: torch.Tensor) -> torch.Tensor:
    """A projection's outputs [..., 2 I] through an interleaved weight, back to [gate; up]."""
    groups = out.view(*out.shape[:-1], -1, 2, GATED_GROUP)
    return groups.transpose(-3, -2).reshape(out.shape)


def panel_gated_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """silu(gate) * up [..., out_features] of x's projection through a [gate; up] weight packed
    as pack_panels(interleave_gate_up(weight)); rounded as panel_linear then silu_and_mul."""
    return torch.ops.inferq_cpu.panel_gated_linear(x, panels, out_features)


def lora_add(
    out: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b_t: torch.Tensor,
    spans: torch.Tensor,
    order: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
) -> torch.Tensor:
    """out [T, width] plus each adapted row's LoRA term, in place: order [n] the adapted rows
    sorted by slot, slots[s]'s rows order[starts[s]:starts[s + 1]]; a [slots, columns, in] and
    b_t [slots, columns, width] every slot's stacks, spans [slots, columns, 2] int64 the
    outputs [lo, hi) each slot's column reaches (b_t is zero elsewhere; engine.lora.batched)."""
    return torch.ops.inferq_cpu.lora_add(out, x, a, b_t, spans, order, slots, starts)


@dataclass(frozen=True)
class NativeLinear:
    """One linear layer as decode_layers runs it: its kind, the weight in that kind's form
    (plain, packed, panels or integer codes), what else the kind reads (MKL: the plain weight;
    QUANT: scales and mins; W8A8: scales) and its three int parameters (see
    kernels/cpu/decode_stack.cpp for each kind)."""

    kind: LinearKind
    weight: torch.Tensor
    extra: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    input_order: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    params: tuple[int, int, int] = (0, 0, 0)

    def tensors(self) -> list[torch.Tensor | None]:
        """Its LINEAR_SLOTS tensors, in decode_layers' order."""
        return [self.weight, *self.extra, self.input_order, self.bias]

    def ints(self) -> list[int]:
        """Its LINEAR_INTS ints, in decode_layers' order."""
        return [int(self.kind), *self.params]


def decode_layers(
    hidden: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    norm_weights: list[torch.Tensor],
    linear_tensors: list[torch.Tensor | None],
    linear_ints: list[int],
    num_heads: int,
    eps: float,
    scale: float,
    windows: list[int],
    lora_tensors: list[torch.Tensor | None] | None = None,
    lora_rows: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer of a decode-only step (one query row per sequence) in one call:
    (hidden, residual) after the last layer, before the final norm.

    norm_weights: input and post-attention norm per layer; linear_tensors / linear_ints: the
    qkv, o, gate_up and down projections of each layer (`NativeLinear.tensors()` / `.ints()`
    apiece); windows: each layer's sliding window (0: full attention). LoRA adapters in the
    step: lora_tensors the slot stacks and spans (a, b_t, spans as `lora_add` takes them) of
    each of those linears (three None: not adapted), lora_rows the adapted rows' order, slots and starts as `lora_add` takes them;
    None: no adapter runs."""
    return torch.ops.inferq_cpu.decode_layers(
        hidden,
        positions,
        slot_mapping,
        block_tables,
        seq_lens,
        cos_sin_cache,
        key_caches,
        value_caches,
        norm_weights,
        linear_tensors,
        linear_ints,
        num_heads,
        eps,
        scale,
        QUANT_GEMM_MIN_ROWS,
        windows,
        lora_tensors or [],
        lora_rows or [],
    )
