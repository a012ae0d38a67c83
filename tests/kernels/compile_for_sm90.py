"""Compiles every kernel variant the launchers can pick for sm_90 (H100), without a GPU.

The interpreter accepts code the GPU compiler rejects (tl.dot shapes under 16, mismatched
loop-carried types, ...), so this runs the real Triton pipeline down to a cubin with the
ptxas bundled in the triton wheel. Run in a process without TRITON_INTERPRET:
    python tests/kernels/compile_for_sm90.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

STRIDES_ATTENTION = [
    "stride_q_t", "stride_q_h", "stride_k_b", "stride_k_s", "stride_k_h",
    "stride_v_b", "stride_v_s", "stride_v_h", "stride_o_t", "stride_o_h", "stride_bt",
]  # fmt: skip
STRIDES_CACHE = [
    "stride_k_t", "stride_k_h", "stride_v_t", "stride_v_h", "stride_kc_b",
    "stride_kc_s", "stride_kc_h", "stride_vc_b", "stride_vc_s", "stride_vc_h",
]  # fmt: skip


def _compile(
    fn, signature: dict, constants: dict, num_warps: int, num_stages: int | None = None
) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn, signature, constants)
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert "cubin" in compiled.asm, f"{fn.__name__}: no cubin"


def _attention(
    dtype: str,
    head_dim: int,
    queries_per_kv: int,
    prefill: bool,
    splits: int,
    windowed: bool = False,
    softcap: bool = False,
    sinks: bool = False,
) -> None:
    from kernels.paged_attention import _unified_attention_kernel
    from kernels.paged_attention_tiles import _launch_shape, padded_head_dim

    head_dim_pad = padded_head_dim(head_dim)
    shape = _launch_shape(queries_per_kv, 64 if prefill else 1, head_dim_pad)
    signature = dict.fromkeys(["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"], f"*{dtype}")
    signature |= dict.fromkeys(["part_out_ptr", "part_max_ptr", "part_sum_ptr"], "*fp32")
    signature |= dict.fromkeys(["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"], "*i32")
    signature |= {"num_seqs": "i32", "num_q_heads": "i32", "qk_scale": "fp32"}
    signature |= {"window": "i32", "softcap": "fp32", "sinks_ptr": "*fp32"}
    signature |= dict.fromkeys(STRIDES_ATTENTION, "i32")
    constants = dict(
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=16,
        QUERIES_PER_KV=queries_per_kv, BLOCK_Q=shape.block_q, BLOCK_M=shape.block_m,
        TILE_N=shape.tile_n, NUM_SPLITS=splits, DECODE_ONLY=not prefill, WINDOWED=windowed,
        SOFTCAP=softcap, SINKS=sinks, DOT_UPCAST=False,
        DOT_PRECISION="ieee" if dtype == "fp32" else None,
    )  # fmt: skip
    _compile(_unified_attention_kernel, signature, constants, shape.num_warps)


def _quant_matmul(
    dtype: str, bits: int, rows: int, in_features: int, group_size: int, out_features: int = 4096
) -> None:
    from kernels.quant_matmul import _quant_matmul_kernel, choose_tiles

    tiles = choose_tiles(rows, out_features, in_features, group_size, compute_units=132)
    signature = {
        "x_ptr": f"*{dtype}",
        "data_ptr": "*i8" if bits == 8 else "*u8",
        "scales_ptr": "*fp16",
        "mins_ptr": "*fp16",
        "bias_ptr": f"*{dtype}",
        "out_ptr": f"*{dtype}",
    }
    signature |= dict.fromkeys(["M", "N", "K", "group_size"], "i32")
    signature |= dict.fromkeys(
        ["stride_xm", "stride_dn", "stride_sn", "stride_mn", "stride_om"], "i32"
    )
    constants = dict(
        BITS=bits, HAS_BIAS=True, EVEN_K=in_features % tiles.block_k == 0,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_UPCAST=False,
        DOT_PRECISION="ieee" if dtype == "fp32" else None,
    )  # fmt: skip
    _compile(_quant_matmul_kernel, signature, constants, tiles.num_warps, tiles.num_stages)


def _lora(dtype: str, columns: int, in_features: int, out_features: int) -> None:
    from kernels._launch import next_pow2
    from kernels.lora import (
        _BLOCK_K,
        _BLOCK_M,
        _MAX_BLOCK_N,
        _lora_expand_kernel,
        _lora_shrink_kernel,
    )

    segments = dict.fromkeys(["order_ptr", "seg_slot_ptr", "seg_start_ptr", "seg_len_ptr"], "*i32")
    segments["order_ptr"] = "*i64"
    precision = "ieee" if dtype == "fp32" else None
    shrink = {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "hidden_ptr": "*fp32", **segments}
    shrink |= dict.fromkeys(["K", "columns", "stride_xm", "stride_a", "stride_h"], "i32")
    _compile(
        _lora_shrink_kernel,
        shrink,
        dict(BLOCK_M=_BLOCK_M, BLOCK_N=min(_MAX_BLOCK_N, max(16, next_pow2(columns))),
             BLOCK_K=min(_BLOCK_K, max(16, next_pow2(in_features))), DOT_UPCAST=False,
             DOT_PRECISION=precision),
        num_warps=4,
    )  # fmt: skip
    expand = {"hidden_ptr": "*fp32", "b_t_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", **segments}
    expand |= dict.fromkeys(["N", "columns", "stride_h", "stride_b", "stride_om"], "i32")
    _compile(
        _lora_expand_kernel,
        expand,
        dict(BLOCK_M=_BLOCK_M, BLOCK_N=min(_MAX_BLOCK_N, max(16, next_pow2(out_features))),
             BLOCK_K=min(_BLOCK_K, max(16, next_pow2(columns))), DOT_UPCAST=False,
             DOT_PRECISION=precision),
        num_warps=4,
    )  # fmt: skip


def main() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the interpreter cannot compile")
    from kernels.activation import _silu_and_mul_kernel
    from kernels.fused_moe import _moe_gemm_kernel
    from kernels.kv_cache import _reshape_and_cache_kernel
    from kernels.paged_attention import _merge_splits_kernel
    from kernels.rms_norm import _rms_norm_kernel
    from kernels.rotary import _rotary_kernel

    for dtype in ("bf16", "fp16", "fp32"):
        for prefill in (False, True):
            _attention(dtype, 128, 4, prefill, 1)
    _attention("bf16", 128, 4, False, 8)  # flash decoding
    _attention("bf16", 64, 3, True, 1)  # SmolLM2 shapes
    _attention("bf16", 256, 8, True, 1)
    _attention("bf16", 80, 1, False, 1)  # padded head dim
    _attention("fp32", 8, 4, True, 2)  # tiny test models
    _attention("bf16", 8, 4, False, 1)  # tl.dot's MMA needs K >= 16: padded
    _attention("bf16", 128, 4, True, 1, windowed=True, softcap=True)  # Gemma 2's local layers
    _attention("bf16", 128, 4, False, 8, windowed=True)  # windowed flash decoding
    _attention("bf16", 64, 8, True, 1, windowed=True, sinks=True)  # gpt-oss's sliding layers
    _attention("bf16", 64, 8, False, 1, sinks=True)  # gpt-oss's full layers, decoding
    _attention("bf16", 64, 8, False, 8, sinks=True)  # ... as flash decoding
    for sinks in (False, True):
        _compile(
            _merge_splits_kernel,
            {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32",
             "part_sum_ptr": "*fp32", "sinks_ptr": "*fp32", "num_q_heads": "i32",
             "stride_o_t": "i32", "stride_o_h": "i32"},
            dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=5, SPLITS_PAD=8, SINKS=sinks),
            num_warps=4,
        )  # fmt: skip
    # the fused-MoE GEMM: Qwen/Mixtral experts (bf16; fp32 in IEEE precision), gpt-oss's
    for dtype, bias in (("bf16", False), ("bf16", True), ("fp32", False)):
        _compile(
            _moe_gemm_kernel,
            {"a_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
             "pair_of_row_ptr": "*i32", "expert_of_block_ptr": "*i32", "used_blocks_ptr": "*i32",
             "scale_ptr": "*fp32", "bias_ptr": f"*{dtype}",
             **dict.fromkeys(["num_pairs", "N", "K", "stride_am", "stride_we", "stride_wn",
                              "stride_wk", "stride_be", "stride_om"], "i32")},
            dict(A_ROWS_PER_TOKEN=4, SCALE=bias, BIAS=bias, UPCAST=False,
                 DOT_PRECISION="ieee" if dtype == "fp32" else None, BLOCK_M=16, BLOCK_N=64,
                 BLOCK_K=64),
            num_warps=4,
        )  # fmt: skip
    _compile(
        _reshape_and_cache_kernel,
        {**dict.fromkeys(["k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr"], "*bf16"),
         "slot_mapping_ptr": "*i64", "num_tokens": "i32", **dict.fromkeys(STRIDES_CACHE, "i32")},
        dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_T=4, WIDTH_PAD=1024),
        num_warps=4,
    )  # fmt: skip
    for has_residual in (False, True):
        _compile(
            _rms_norm_kernel,
            {**dict.fromkeys(["x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "residual_out_ptr"], "*bf16"),
             "hidden_size": "i32", "eps": "fp32",
             **dict.fromkeys(["stride_x", "stride_r", "stride_o", "stride_ro"], "i32")},
            dict(HAS_RESIDUAL=has_residual, BLOCK=4096),
            num_warps=8,
        )  # fmt: skip
    _compile(
        _rotary_kernel,
        {"positions_ptr": "*i64", "q_ptr": "*bf16", "k_ptr": "*bf16", "cos_sin_ptr": "*fp32",
         **dict.fromkeys(["num_q_heads", "num_kv_heads", "stride_q", "stride_k", "stride_cache"], "i32")},
        dict(HEAD_DIM=128, HALF=64, HALF_PAD=64, Q_HEADS_PAD=32, K_HEADS_PAD=8),
        num_warps=4,
    )  # fmt: skip
    _compile(
        _silu_and_mul_kernel,
        {"x_ptr": "*bf16", "out_ptr": "*bf16", "intermediate_size": "i32", "stride_x": "i32",
         "stride_o": "i32"},
        dict(BLOCK=1024),
        num_warps=4,
    )  # fmt: skip
    for dtype in ("bf16", "fp16", "fp32"):
        for bits in (4, 8):
            for rows in (1, 48, 512):  # decode, small prefill, prefill tiles
                _quant_matmul(dtype, bits, rows, 4096, 128)
    _quant_matmul("bf16", 4, 1, 4096, 128, out_features=16384)  # 64-wide decode tiles
    _quant_matmul("bf16", 4, 1, 4096, 32)
    _quant_matmul("bf16", 4, 512, 4096, 4096)  # per-channel
    _quant_matmul("bf16", 4, 1, 96, 96)  # per-channel, ragged last K tile
    _quant_matmul("bf16", 8, 512, 80, 80)
    for dtype in ("bf16", "fp16", "fp32"):  # the batched LoRA term
        _lora(dtype, 3 * 16, 4096, 6144)  # a fused [q; k; v] layer, rank 16
    _lora("bf16", 8, 576, 192)  # rank 8 on SmolLM2 shapes
    _lora("bf16", 64, 14336, 4096)  # rank 64 down_proj
    print("all kernels compiled for sm_90")


if __name__ == "__main__":
    main()
