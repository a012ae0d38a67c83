"""CPU matmul backends of the linear layers, and the plan that says which one runs when.

Five ways to compute x @ W.T + b on the CPU, four of them in torch 2.x:

- aten: `F.linear` (MKL sgemm for fp32, oneDNN for bf16), weight in plain layout.
- onednn: oneDNN's linear on the plain weight; it may reorder the weight on every call.
- onednn_packed: the weight reordered once, at load, into the blocked layout oneDNN's kernels
  want (what vLLM does on the CPU); no reorder per call, one (blocked) copy of the weight.
- mkl_packed (fp32 only): MKL's packed sgemm; it also keeps the plain weight, so two copies.
- panels (fp32 on AVX2 + FMA, bf16 on AVX512-BF16, on AMX tiles where the CPU has them): our
  own register-tiled kernel (kernels/cpu/panel_matmul.cpp) over the weight packed once into
  panels of 16 (fp32) or 32 (bf16) features; one copy.

Which is fastest depends on the machine (AMD without AVX-512, AMD with AVX-512 and bf16, Intel
with AMX) and on how many rows a call has: a decode step of a few sequences streams the weights
(memory-bound), a prefill chunk is compute-bound. So a plan names one backend for small calls
(at most SMALL_ROWS rows) and one for the rest; matmul_tuning measures and picks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.cpu_ops import LinearKind, NativeLinear

Backend = Literal["aten", "onednn", "onednn_packed", "mkl_packed", "panels"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
ONEDNN_BACKENDS: tuple[Backend, ...] = ("onednn", "onednn_packed")

SMALL_ROWS = 16  # rows of a call up to which the plan's decode-sized backend runs
# Batch-size hints of the packed layouts: oneDNN's blocked layout for a prefill-sized hint also
# serves one row without a reorder; MKL's packed sgemm is packed for the decode of one row.
ONEDNN_PACK_HINT = 128
MKL_PACK_HINT = 1

# What each backend keeps of a weight: the plain tensor and/or a packed copy of its own.
_STORAGE: dict[Backend, frozenset[str]] = {
    "aten": frozenset({"plain"}),
    "onednn": frozenset({"plain"}),
    "onednn_packed": frozenset({"onednn"}),
    "mkl_packed": frozenset({"plain", "mkl"}),
    "panels": frozenset({"panels"}),
}


@dataclass(frozen=True)
class MatmulPlan:
    """The backend for calls of at most SMALL_ROWS rows (decode) and for larger ones."""

    small: Backend = "aten"
    large: Backend = "aten"

    def backend_for(self, rows: int) -> Backend:
        return self.small if rows <= SMALL_ROWS else self.large

    def storage(self) -> frozenset[str]:
        """The forms of each weight this plan keeps ("plain", "onednn", "mkl")."""
        return _STORAGE[self.small] | _STORAGE[self.large]

    def plain(self) -> MatmulPlan:
        """This plan on weights kept only in plain layout (packed backends -> their plain kin)."""
        kin: dict[Backend, Backend] = {
            "onednn_packed": "onednn",
            "mkl_packed": "aten",
            "panels": "aten",
        }
        plain = MatmulPlan(kin.get(self.small, self.small), kin.get(self.large, self.large))
        return self if plain == self else plain

    def describe(self) -> str:
        if self.small == self.large:
            return self.small
        return f"{self.small} (<= {SMALL_ROWS} rows), {self.large} (more rows)"


ATEN = MatmulPlan()


def uniform(backend: Backend) -> MatmulPlan:
    return MatmulPlan(backend, backend)


def available_backends(dtype: torch.dtype) -> tuple[Backend, ...]:
    """The backends this torch build and CPU run for dtype (aten always)."""
    found: list[Backend] = ["aten"]
    onednn = torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )
    if onednn and (dtype == torch.float32 or (dtype == torch.bfloat16 and has_native_bf16())):
        found += ["onednn", "onednn_packed"]
    if (
        dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    ):
        found.append("mkl_packed")
    if cpu_ops.panel_matmul_supported(dtype):
        found.append("panels")
    return tuple(found)


def has_native_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX), as oneDNN sees it."""
    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@dataclass
class PackedWeights:
    """A weight's packed copies that a plan uses (None where the plan does not need one)."""

    onednn: torch.Tensor | None = None
    mkl: torch.Tensor | None = None
    panels: torch.Tensor | None = None
    # The panels hold a [gate; up] weight with its halves interleaved (cpu_ops.interleave_gate_up),
    # so that one kernel computes silu(gate) * up (run_gated).
    gated: bool = False


def pack(weight: torch.Tensor, plan: MatmulPlan, gated: bool = False) -> PackedWeights:
    """Reorder weight [out, in] once into the layouts the plan's backends want; gated: weight is
    [gate; up] and its panels are packed for run_gated."""
    storage = plan.storage()
    packed = PackedWeights()
    if "onednn" in storage:
        packed.onednn = torch.ops.mkldnn._reorder_linear_weight(weight, ONEDNN_PACK_HINT)
    if "mkl" in storage:
        packed.mkl = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_HINT)
    if "panels" in storage:
        packed.gated = gated
        packed.panels = cpu_ops.pack_panels(cpu_ops.interleave_gate_up(weight) if gated else weight)
    return packed


def packs_gated(weight: torch.Tensor, bias: torch.Tensor | None, plan: MatmulPlan) -> bool:
    """Whether a [gate; up] weight can be packed for run_gated under this plan: the plan has
    panels, the CPU their gated kernel, the halves whole groups of features, and no bias."""
    half = weight.shape[0] // 2
    return (
        "panels" in plan.storage()
        and bias is None
        and half % cpu_ops.GATED_GROUP == 0
        and cpu_ops.panel_gated_supported(weight.dtype)
    )


def run(
    backend: Backend,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: PackedWeights,
) -> torch.Tensor:
    """x @ weight.T + bias through one backend (its packed copy must exist in `packed`)."""
    if backend == "onednn_packed":
        assert packed.onednn is not None, "onednn_packed needs the weight packed first"
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), packed.onednn, bias, "none", [], ""
        )
    if backend == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    if backend == "mkl_packed":
        assert packed.mkl is not None, "mkl_packed needs the weight packed first"
        return torch.ops.mkl._mkl_linear(x.contiguous(), packed.mkl, weight, bias, MKL_PACK_HINT)
    if backend == "panels":
        assert packed.panels is not None, "panels needs the weight packed first"
        out = cpu_ops.panel_linear(x, packed.panels, bias, weight.shape[0])
        return cpu_ops.deinterleave_gate_up(out) if packed.gated else out
    return F.linear(x, weight, bias)


def run_gated(
    backend: Backend, x: torch.Tensor, weight: torch.Tensor, packed: PackedWeights
) -> torch.Tensor | None:
    """silu(gate) * up of x's projection through a [gate; up] weight, in one kernel, where the
    backend is panels packed gated; None elsewhere (the caller projects, then activates)."""
    if backend != "panels" or not packed.gated:
        return None
    assert packed.panels is not None, "gated panels need the weight packed first"
    return cpu_ops.panel_gated_linear(x, packed.panels, weight.shape[0] // 2)


def native(
    backend: Backend, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeights
) -> NativeLinear:
    """`run` as the C++ decode stack calls it: the same backend on the same tensors."""
    if backend == "onednn_packed":
        assert packed.onednn is not None, "onednn_packed needs the weight packed first"
        return NativeLinear(LinearKind.ONEDNN, packed.onednn, bias=bias)
    if backend == "onednn":
        return NativeLinear(LinearKind.ONEDNN, weight, bias=bias)
    if backend == "mkl_packed":
        assert packed.mkl is not None, "mkl_packed needs the weight packed first"
        return NativeLinear(
            LinearKind.MKL, packed.mkl, (weight, None), bias=bias, params=(MKL_PACK_HINT, 0, 0)
        )
    if backend == "panels":
        assert packed.panels is not None, "panels needs the weight packed first"
        if packed.gated:  # the decode stack then skips its SiLU-and-mul: this kernel applies it
            return NativeLinear(
                LinearKind.GATED_PANELS,
                packed.panels,
                params=(weight.shape[0] // 2, cpu_ops.GATED_GROUP, 0),
            )
        return NativeLinear(
            LinearKind.PANELS, packed.panels, bias=bias, params=(weight.shape[0], 0, 0)
        )
    return NativeLinear(LinearKind.ATEN, weight, bias=bias)
