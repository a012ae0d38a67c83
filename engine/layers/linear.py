"""Linear layers: one matmul entry point, and fused projections (QKV, gate-up).

On the CPU each layer computes through the backend its plan names for the call's row count
(engine.platforms.cpu.matmul); the plan is measured per machine at start-up and the weights
are packed once for it (engine.platforms.cpu.matmul_tuning.apply_plan). Until then, and on
CUDA, a layer is a plain `F.linear`. A quantized layer (engine.quantization) holds a `QuantizedWeight` instead
of its plain weight and computes through the quantized matmul.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.activation import silu_and_mul
from engine.platforms.cpu.matmul import (
    ATEN,
    ONEDNN_BACKENDS,
    SMALL_ROWS,
    MatmulPlan,
    NativeLinear,
    PackedWeights,
    native,
    pack,
    packs_gated,
    run,
    run_gated,
)
from engine.quantization.matmul import quantized_linear
from engine.quantization.weights import QuantizedWeight
from kernels import cpu_ops


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
    """nn.Linear computed through `linear` with the layer's matmul plan."""

    plan: MatmulPlan = ATEN
    packed: PackedWeights | None = None
    quantized: QuantizedWeight | None = None
    _gated = False  # a [gate; up] projection whose weight may be packed for one gated kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is None:
            return linear(x, self.weight, self.bias, self.plan, self.packed)
        if self._plain_for(x):
            return linear(x, self.weight, self.bias, self.plan.plain())
        return quantized_linear(x, self.quantized, self.bias, self._onednn_tiles())

    def _plain_for(self, x: torch.Tensor) -> bool:
        """Whether a quantized layer computes this call from its full-precision weight: one it
        keeps anyway (an lm_head tied to the embedding), on the CPU, for a call of more than
        SMALL_ROWS rows. Such calls are bound by arithmetic, where the weight's bytes do not
        matter and dequantizing costs; decode-sized calls stream the smaller quantized weight."""
        return x.device.type == "cpu" and self._plain_for_rows(x.numel() // self.in_features)

    def _plain_for_rows(self, rows: int) -> bool:
        return self.weight.device.type == "cpu" and rows > SMALL_ROWS

    def _onednn_tiles(self) -> bool:
        return self.plan.large in ONEDNN_BACKENDS

    def native_spec(self, rows: int) -> NativeLinear | None:
        """How the C++ decode stack computes this layer for calls of `rows` rows, exactly as
        forward would on the CPU; None where it cannot (fp8 weights)."""
        bias = self.bias
        quantized = self.quantized
        if quantized is not None and not self._plain_for_rows(rows):
            if quantized.is_fp8:
                return None
            if quantized.int8_activations:
                tensors = [quantized.data, quantized.scales, None, None, bias]
                return cpu_ops.LINEAR_W8A8, tensors, [SMALL_ROWS, int(self._onednn_tiles()), 0]
            tensors = [quantized.data, quantized.scales, quantized.mins, quantized.input_order]
            ints = [quantized.bits, quantized.group_size, int(self._onednn_tiles())]
            return cpu_ops.LINEAR_QUANT, [*tensors, bias], ints
        plan = self.plan if quantized is None else self.plan.plain()
        backend = "aten" if plan is ATEN else plan.backend_for(rows)
        return native(backend, self.weight, bias, self.packed or PackedWeights())

    def use_quantized(self, weight: QuantizedWeight, keep_plain_weight: bool = False) -> None:
        """Compute through `weight` from now on and free the plain weight (unless it is shared,
        e.g. with a tied embedding that still reads it)."""
        if weight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {weight.shape} for a {self.weight.shape} layer")
        self.quantized = weight.to(self.weight.device)
        self.packed = None
        if not keep_plain_weight:
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def use_plan(self, plan: MatmulPlan, keep_plain_weight: bool = False) -> None:
        """Compute through `plan` from now on: pack the weight once for it, and free the plain
        weight when no backend of the plan reads it (unless keep_plain_weight: e.g. it is shared
        with a tied embedding)."""
        if self.quantized is not None:
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
        if self.packed is not None and self.quantized is None and x.numel():
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
