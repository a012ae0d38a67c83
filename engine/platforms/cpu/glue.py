"""The CPU forward's elementwise glue (norms, rotary, SiLU-and-mul), eager or compiled.

Between two matmuls a layer runs a handful of small ops that each make a pass over memory and a
Python dispatch: the residual add and RMSNorm, the rotary rotation of q and k, SiLU times up.
TorchInductor fuses each group into one C++ loop. The compiled functions take the weights as
arguments and every dimension as a symbol, so one compiled graph per function and dtype serves
every layer, every step and every model: a worker compiles at start-up and never again.

Each dtype gets compiled functions of its own (`compiled(dtype)`), copies with their own code
objects: dynamo keeps its graphs, and counts recompiles against its limit, per code object, so
with one copy for every dtype an fp32 and a bf16 engine in one process would share one budget,
exhaust it, and leave the glue eager.

A compiled call pays ~20-30 us of guard checks that an eager op does not, so fusion only pays
from some number of tokens per step on; the CPU platform measures where at start-up and picks
each step's glue (engine.platforms.cpu.platform).
Inductor's kernels are single-threaded: they link the system's OpenMP runtime, a second one
beside torch's own, and two thread pools on the same cores stall each other by milliseconds.

At decode sizes the C++ glue (`native`, kernels.cpu_ops) beats both: one call per group of ops,
no guards, no intermediate tensors. It serves every step the compiled glue does not.

A model forward reads the glue its CPU platform set for the step (`using`: a ContextVar, so
engines in one process, or on two threads, may differ). A compiled function that fails logs a
warning once and hands its work back to the eager one for good: compiling is an optimisation,
never an outage.
"""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from kernels import cpu_ops
from kernels.reference import silu_and_mul_ref

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused op: HF's fp32 arithmetic exactly; in bf16 it normalizes and scales in fp32 and
    # rounds once where HF rounds twice (after normalizing, after scaling), a half-ulp apart.
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary for q [T, H*D] and k [T, Hkv*D] with per-token cos / signed sin [T, 1, D]."""
    num_tokens = q.shape[0]
    return (
        _rotate(q.view(num_tokens, -1, head_dim), cos, signed_sin),
        _rotate(k.view(num_tokens, -1, head_dim), cos, signed_sin),
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x * cos + rotate_half(x) * sin, with rotate_half's negation folded into signed_sin.
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, signed_sin)


@dataclass(frozen=True)
class Glue:
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    rotate: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int],
        tuple[torch.Tensor, torch.Tensor],
    ]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]


EAGER = Glue(rms_norm, add_rms_norm, rotate, silu_and_mul_ref)
_current: ContextVar[Glue] = ContextVar("inferq_cpu_glue", default=EAGER)


def current() -> Glue:
    return _current.get()


@contextlib.contextmanager
def using(glue: Glue) -> Iterator[None]:
    token = _current.set(glue)
    try:
        yield
    finally:
        _current.reset(token)


_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native_fits(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
    return (
        x.dtype in _NATIVE_DTYPES
        and x.is_contiguous()
        and (weight is None or (weight.dtype == x.dtype and weight.is_contiguous()))
    )


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _native_fits(x, weight):
        return cpu_ops.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def native_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_fits(x, weight) and residual.dtype == x.dtype and residual.is_contiguous():
        return cpu_ops.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm(x, residual, weight, eps)


def native_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _native_fits(x):
        return cpu_ops.silu_and_mul(x)
    return silu_and_mul_ref(x)


# Rotary stays eager here: where the CPU kernels run, every step rotates inside the KV-cache
# store (rotary_store_kv).
NATIVE = Glue(native_rms_norm, native_add_rms_norm, rotate, native_silu_and_mul)


def native() -> Glue:
    """The C++ glue where the CPU kernels could be built, else the eager one."""
    return NATIVE if cpu_ops.cpu_kernels_available() else EAGER


F_ = TypeVar("F_", bound=Callable[..., object])


def first_line(error: BaseException) -> str:
    """An exception as one log line (compiler errors run to pages)."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _compiled_or_eager(eager: F_) -> F_:
    compiled = torch.compile(eager, fullgraph=True, dynamic=True, options={"cpp.threads": 1})
    failed = False

    def call(*args: object) -> object:
        nonlocal failed
        if not failed:
            try:
                return compiled(*args)
            except Exception as error:  # any compiler failure falls back
                failed = True
                logger.warning(
                    "compiled %s failed (%s); it runs eagerly", eager.__name__, first_line(error)
                )
        return eager(*args)

    return call  # type: ignore[return-value]


def _own_code(function: F_) -> F_:
    """A copy of function with a code object of its own, and so its own compiled graphs and
    recompile budget (dynamo keeps both per code object)."""
    copy = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    copy.__qualname__ = function.__qualname__
    return copy  # type: ignore[return-value]


def new_compiled() -> Glue:
    """A compiled glue of its own, meant for one dtype: each function compiles on its first
    call, with a recompile budget no other glue shares."""
    return Glue(
        *(
            _compiled_or_eager(_own_code(function))
            for function in (rms_norm, add_rms_norm, rotate, silu_and_mul_ref)
        )
    )


_compiled_by_dtype: dict[torch.dtype, Glue] = {}


def compiled(dtype: torch.dtype) -> Glue:
    """The process-wide compiled glue for dtype (each function compiles on its first call)."""
    if dtype not in _compiled_by_dtype:
        _compiled_by_dtype[dtype] = new_compiled()
    return _compiled_by_dtype[dtype]


@dataclass(frozen=True)
class GlueShapes:
    """One decoder layer's glue dimensions, read from the model config."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype


# The answer is kept for good (machine_cache): only a clear win, not a burst of load on
# the eager side, may switch a machine to the compiled glue.
_CLEAR_WIN = 0.85


def _layer_glue_seconds(glue: Glue, shapes: GlueShapes, num_tokens: int) -> float:
    """Best of a few runs of one layer's glue calls at num_tokens rows."""
    import time

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size).to(shapes.dtype)

    hidden, weight = rand(num_tokens, shapes.hidden_size), rand(shapes.hidden_size)
    residual = rand(num_tokens, shapes.hidden_size)
    gate_up = rand(num_tokens, 2 * shapes.intermediate_size)
    q = rand(num_tokens, shapes.num_heads * shapes.head_dim)
    k = rand(num_tokens, shapes.num_kv_heads * shapes.head_dim)
    cos, sin = rand(num_tokens, 1, shapes.head_dim), rand(num_tokens, 1, shapes.head_dim)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        glue.add_rms_norm(hidden, residual, weight, 1e-5)
        glue.rotate(q, k, cos, sin, shapes.head_dim)
        glue.add_rms_norm(hidden, residual, weight, 1e-5)
        glue.silu_and_mul(gate_up)
        best = min(best, time.perf_counter() - started)
    return best


def compile_now(shapes: GlueShapes) -> None:
    """Compile every glue function (all dimensions are symbols: once serves every step)."""
    with torch.inference_mode():
        _layer_glue_seconds(compiled(shapes.dtype), shapes, 2)


def min_tokens_for_compiled(shapes: GlueShapes, candidates: tuple[int, ...]) -> int | None:
    """The fewest tokens per step from which the compiled glue beats the native one (measured
    on this machine, at the model's shapes); None if it never does among the candidates.

    Also compiles every glue function, so no request waits for the compiler later."""
    glue = compiled(shapes.dtype)
    compile_now(shapes)
    with torch.inference_mode():
        for num_tokens in candidates:
            compiled_s = _layer_glue_seconds(glue, shapes, num_tokens)
            if compiled_s < _CLEAR_WIN * _layer_glue_seconds(native(), shapes, num_tokens):
                return num_tokens
    return None
