"""A CPU decode step's decoder layers in one C++ call (kernels.cpu_ops.decode_layers).

The Python forward of one decode step walks 30 layers through a dozen module calls and op
dispatches each; at one sequence that is a fifth of a quantized model's step and a tenth of a
full-precision one. Where a step can take the C++ path (decode-only, on the CPU, every sequence
through the fused paged-attention kernel, the native glue, no tensor parallelism or fp8) the
layers run there; the ops are the same ones the Python forward calls, in the same order, so the
outputs are too. Everything else keeps the Python forward.

The flat argument lists (weights, packed copies, norms) are read once per row class (the
matmul plan picks backends by rows) on the first step after `prepare`: the CPU platform prepares
every stack of a model once its weights are stored as they will stay (quantized, packed for
the tuned plan), so a stack never reads a weight another layer is about to replace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.interface import ProjectionLayout
from engine.platforms.cpu import glue as cpu_glue
from engine.platforms.cpu.matmul import SMALL_ROWS
from kernels import cpu_ops


@dataclass(frozen=True)
class _LayerArgs:
    """decode_layers' weight arguments for one row class."""

    norm_weights: list[torch.Tensor]
    linear_tensors: list[torch.Tensor | None]
    linear_ints: list[int]


@dataclass(frozen=True)
class _AdapterArgs:
    """decode_layers' LoRA arguments for one step (see kernels.cpu_ops.decode_layers)."""

    stacks: list[torch.Tensor | None]
    rows: list[torch.Tensor]


_NO_ADAPTERS = _AdapterArgs([], [])


@dataclass(frozen=True)
class DecoderLayerParts:
    """What the stack reads of one pre-norm decoder layer (a family whose layers run the
    stack's op sequence builds these): its projections run in the layout's order."""

    input_norm: RMSNorm
    post_attention_norm: RMSNorm
    projections: ProjectionLayout


@dataclass(frozen=True)
class _SharedParts:
    """What every layer of the stack shares; kept out of the module tree (the model owns it)."""

    backend: TorchAttentionBackend
    rotary: RotaryEmbedding


class CpuDecodeStack(nn.Module):
    """A module without parameters of its own, so that the CPU platform finds every stack of a
    model among its modules (`stacks_of`) and prepares it."""

    def __init__(
        self,
        layers: Sequence[DecoderLayerParts],
        backend: TorchAttentionBackend,
        rotary: RotaryEmbedding,
        num_heads: int,
        eps: float,
        scale: float,
        windows: list[int] | None = None,
    ) -> None:
        """windows: each layer's sliding window (0: full attention); None: none has one."""
        super().__init__()
        self._layers = list(layers)
        self._shared = _SharedParts(backend, rotary)
        self._num_heads = num_heads
        self._eps = eps
        self._scale = scale
        self._windows = list(windows) if windows is not None else [0] * len(self._layers)
        # Per row class (small or not): the arguments (None: some layer has no C++ path), read
        # on the first step after `prepare`.
        self._args: dict[bool, _LayerArgs | None] = {}

    def _adapters(self, rows: int) -> _AdapterArgs:
        """The step's LoRA arguments (empty where no adapter runs in it)."""
        slots = self._layers[0].projections.qkv.lora if self._layers else None
        if slots is None or not slots.step_active:
            return _NO_ADAPTERS
        mapping = slots.current_step.for_rows(rows)
        stacks: list[torch.Tensor | None] = []
        for layer in self._layers:
            for projection in layer.projections:
                lora = projection.lora
                # A layer no adapter of the step targets computes as the base, as in Python.
                stacks += (
                    lora.native_stacks()
                    if lora is not None and lora.active()
                    else (None, None, None)
                )
        return _AdapterArgs(stacks, [mapping.order, mapping.segment_slots, mapping.segment_starts])

    def prepare(self) -> None:
        """Read the layers' weights again on the next step: they have changed how they are
        stored (quantized, packed for a matmul plan) since any step read them."""
        self._args.clear()

    def run(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden, residual) after the last layer, or None where this step needs the Python
        forward."""
        if (
            hidden.device.type != "cpu"
            or cpu_glue.current() is not cpu_glue.NATIVE
            or not kv_caches
        ):
            return None
        plan = self._shared.backend.fused_decode_plan(meta, kv_caches[0][0], hidden)
        if plan is None or plan.decode_tables is None or plan.decode_lens is None:
            return None
        args = self._layer_args(hidden.shape[0])
        if args is None:
            return None
        adapters = self._adapters(hidden.shape[0])
        return cpu_ops.decode_layers(
            hidden.contiguous(),
            positions.to(torch.int64).contiguous(),
            plan.write_slots.contiguous(),
            plan.decode_tables,
            plan.decode_lens,
            self._shared.rotary.cos_sin_cache,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            args.norm_weights,
            args.linear_tensors,
            args.linear_ints,
            self._num_heads,
            self._eps,
            self._scale,
            self._windows,
            adapters.stacks,
            adapters.rows,
        )

    def _layer_args(self, rows: int) -> _LayerArgs | None:
        small = rows <= SMALL_ROWS
        if small not in self._args:
            self._args[small] = self._build_args(rows)
        return self._args[small]

    def _build_args(self, rows: int) -> _LayerArgs | None:
        norms: list[torch.Tensor] = []
        tensors: list[torch.Tensor | None] = []
        ints: list[int] = []
        for layer in self._layers:
            norms += [layer.input_norm.weight, layer.post_attention_norm.weight]
            for projection in layer.projections:
                spec = projection.native_spec(rows)
                if spec is None:
                    return None
                tensors += spec.tensors()
                ints += spec.ints()
        return _LayerArgs(norms, tensors, ints)


def stacks_of(model: nn.Module) -> list[CpuDecodeStack]:
    """The decode stacks a model holds (none on CUDA or under tensor parallelism)."""
    return [module for module in model.modules() if isinstance(module, CpuDecodeStack)]
