"""Linear layers: one matmul entry point, and fused projections (QKV, gate-up).

On the CPU each layer computes through the backend its plan names for the call's row count
(engine.platforms.cpu.matmul); the plan is measured per machine at start-up and the weights
are packed once for it (engine.platforms.cpu.matmul_tuning.apply_plan). Until then, and on
CUDA, a layer is a plain `F.linear`. A quantized layer holds its scheme's `LinearMethod`
(engine.quantization) instead of its plain weight and computes through it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.activation import silu_and_mul
from engine.lora.batched import LoRASlots
from engine.lora.segmented import add_lora_terms
from engine.platforms.cpu.matmul import (
    ATEN,
    MatmulPlan,
    PackedWeights,
    native,
    pack,
    packs_gated,
    run,
    run_gated,
)
from engine.quantization.base import LinearMethod, QuantizedLinearMethod
from engine.quantization.full_precision import FULL_PRECISION
from kernels.cpu_ops import NativeLinear


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    plan: MatmulPlan = ATEN,
    packed: PackedWeights | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias, for x [..., in] and weight [out, in], through the plan's backend."""
    if plan is ATEN or x.device.type != "cpu" or not x.numel():
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    return run(plan.backend_for(rows), x, weight, bias, packed or PackedWeights())


class Linear(nn.Linear):
    """nn.Linear computed by its `LinearMethod`: full precision through `linear` with the
    layer's matmul plan, or a quantization scheme's (engine.quantization.registry)."""

    plan: MatmulPlan = ATEN
    packed: PackedWeights | None = None
    method: LinearMethod = FULL_PRECISION
    lora: LoRASlots | None = None  # resident LoRA adapters (engine.lora), added to the output
    _gated = False  # a [gate; up] projection whose weight may be packed for one gated kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        return out if self.lora is None else add_lora_terms(self.lora, x, out)

    @property
    def is_quantized(self) -> bool:
        return self.method is not FULL_PRECISION

    def plain(self, x: torch.Tensor, plan: MatmulPlan) -> torch.Tensor:
        """x through the layer's full-precision weight and `plan` (a quantized layer that
        keeps its plain weight passes the plan's plain kin: it has no packed copies)."""
        return linear(x, self.weight, self.bias, plan, self.packed)

    def plain_native_spec(self, plan: MatmulPlan, rows: int) -> NativeLinear:
        """`plain` as the C++ decode stack runs it for calls of `rows` rows."""
        backend = "aten" if plan is ATEN else plan.backend_for(rows)
        return native(backend, self.weight, self.bias, self.packed or PackedWeights())

    def native_spec(self, rows: int) -> NativeLinear | None:
        """How the C++ decode stack computes this layer for calls of `rows` rows, exactly as
        forward would on the CPU; None where it cannot (fp8 weights)."""
        return self.method.native_spec(self, rows)

    def use_method(self, method: QuantizedLinearMethod, keep_plain_weight: bool = False) -> None:
        """Compute through `method` from now on and free the plain weight (unless it is shared,
        e.g. with a tied embedding that still reads it)."""
        if method.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {method.shape} for a {self.weight.shape} layer")
        self.method = method.to(self.weight.device)
        self.packed = None
        if not keep_plain_weight:
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def use_plan(self, plan: MatmulPlan, keep_plain_weight: bool = False) -> None:
        """Compute through `plan` from now on: pack the weight once for it, and free the plain
        weight when no backend of the plan reads it (unless keep_plain_weight: e.g. it is shared
        with a tied embedding)."""
        if self.is_quantized:
            # The quantized matmul has its own kernels; only its GEMM over dequantized tiles
            # (calls of many rows) follows the plan's choice for large calls.
            self.plan = plan
            return
        with torch.no_grad():
            weight = self.weight.detach()
            self.packed = pack(weight, plan, self._gated and packs_gated(weight, self.bias, plan))
        self.plan = plan
        if "plain" not in plan.storage() and not keep_plain_weight:
            # A meta tensor keeps the shape (and the module's repr) without the memory.
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)


class MergedLinear(Linear):
    """Output rows are the concatenation of shards (e.g. [q; k; v]); the loader fills each shard.

    gated: the shards are a gated MLP's [gate; up], of one size, which `activated` turns into
    silu(gate) * up."""

    def __init__(
        self, in_features: int, shard_sizes: list[int], bias: bool = False, gated: bool = False
    ) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)
        if gated and (len(shard_sizes) != 2 or shard_sizes[0] != shard_sizes[1]):
            raise ValueError(f"a gated projection has two equal shards, got {shard_sizes}")
        self._gated = gated

    def activated(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x's [gate; up] projection (gated layers): in the matmul's own
        kernel where the plan packed the weight for it, else projected and then activated."""
        if not self._gated:
            raise TypeError("activated() needs a gated [gate; up] projection")
        adapted = self.lora is not None and self.lora.active()
        if self.packed is not None and not self.is_quantized and x.numel() and not adapted:
            rows = x.numel() // x.shape[-1]
            fused = run_gated(self.plan.backend_for(rows), x, self.weight, self.packed)
            if fused is not None:
                return fused
        return silu_and_mul(self(x))

    def shard_offset(self, shard: int) -> int:
        return sum(self.shard_sizes[:shard])


def shared_parameter_ids(model: nn.Module) -> set[int]:
    """ids of the parameters two modules hold (a tied embedding and lm_head): a layer that
    changes how it stores its weight must keep such a one for the other holder."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return {key for key, count in uses.items() if count > 1}
