"""Triton kernels for the engine's hot ops, and their plain-torch reference twins.

Names resolve lazily: `from kernels import rms_norm` imports Triton only then, so CPU users
without Triton can still `import kernels` and use the `*_ref` twins. Run the Triton kernels on
CPU tensors by setting TRITON_INTERPRET=1 before the first kernel is imported.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kernels.activation import silu_and_mul
    from kernels.fused_moe import fused_moe
    from kernels.kv_cache import reshape_and_cache
    from kernels.lora import lora_shrink_expand
    from kernels.paged_attention import unified_attention
    from kernels.paged_attention_tiles import PrefillTiles, choose_num_splits, prefill_tiles_for
    from kernels.quant_matmul import quant_matmul_triton
    from kernels.reference import (
        fused_moe_ref,
        lora_shrink_expand_ref,
        quant_matmul_triton_ref,
        reshape_and_cache_ref,
        rms_norm_ref,
        rotary_embedding_ref,
        silu_and_mul_ref,
        unified_attention_ref,
    )
    from kernels.rms_norm import rms_norm
    from kernels.rotary import rotary_embedding

_HOME = {
    "unified_attention": "kernels.paged_attention",
    "choose_num_splits": "kernels.paged_attention_tiles",
    "PrefillTiles": "kernels.paged_attention_tiles",
    "prefill_tiles_for": "kernels.paged_attention_tiles",
    "reshape_and_cache": "kernels.kv_cache",
    "rms_norm": "kernels.rms_norm",
    "rotary_embedding": "kernels.rotary",
    "silu_and_mul": "kernels.activation",
    "quant_matmul_triton": "kernels.quant_matmul",
    "fused_moe": "kernels.fused_moe",
    "fused_moe_ref": "kernels.reference",
    "lora_shrink_expand": "kernels.lora",
    "lora_shrink_expand_ref": "kernels.reference",
    "unified_attention_ref": "kernels.reference",
    "reshape_and_cache_ref": "kernels.reference",
    "rms_norm_ref": "kernels.reference",
    "rotary_embedding_ref": "kernels.reference",
    "silu_and_mul_ref": "kernels.reference",
    "quant_matmul_triton_ref": "kernels.reference",
}

__all__ = [
    "PrefillTiles",
    "choose_num_splits",
    "fused_moe",
    "fused_moe_ref",
    "lora_shrink_expand",
    "lora_shrink_expand_ref",
    "prefill_tiles_for",
    "quant_matmul_triton",
    "quant_matmul_triton_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "unified_attention",
    "unified_attention_ref",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(import_module(home), name)
    globals()[name] = value
    return value
