"""Choose the CPU matmul plan (and the CPU's auto dtype) by measuring, once per machine.

Which backend is fastest differs from machine to machine in ways a CPU's vendor name does not
tell, so at start-up every available backend (matmul) runs the model's own linear
shapes at both ends of the plan's two ranges: decode-sized row counts (1 and 16), and a decode
step of many sequences (64) with a prefill-sized call (128), interleaved so that a burst of load
from elsewhere hits all of them alike, keeping each one's fastest pass. Decode passes run over
several copies of the weights, so that they stream from memory as they do in a real step instead
of sitting in cache. The whole measurement takes milliseconds for tiny models and stays well
under a second for real ones (large weights are measured on their first rows).

The timings are cached as JSON under $INFERQ_HOME/cpu_matmul (machine_cache), keyed by CPU
model, CPU flags, torch version, thread count, dtype and shapes, so a second start on the same machine measures
nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.attention.base import AttentionBackend
from engine.distributed.group import TensorParallel
from engine.layers.linear import Linear, shared_parameter_ids
from engine.models import meta_model
from engine.platforms.cpu.machine_cache import cached, lookup, machine_key
from engine.platforms.cpu.matmul import (
    SMALL_ROWS,
    Backend,
    MatmulPlan,
    available_backends,
    has_native_bf16,
    pack,
    run,
    uniform,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

CACHE_KIND = "cpu_matmul"  # the folder under $INFERQ_HOME
AUTO_DTYPE_KIND = "cpu_auto_dtype"  # fp32 against bf16, measured together

Shape = tuple[int, int]  # (out, in) of a weight
Timings = dict[Backend, tuple[float, float]]  # backend -> ms per pass (small rows, large rows)

DECODE_ROWS = (1, SMALL_ROWS)  # the plan's small range, both ends
# The large range, both ends: a decode step of many sequences, whose weights stream from memory
# like any decode's, and a prefill-sized call, compute-bound.
BATCH_ROWS = 64
PREFILL_ROWS = 128
LARGE_ROWS = (BATCH_ROWS, PREFILL_ROWS)
_MAX_ELEMENTS = 1 << 21  # a larger weight is measured on its first rows (same kernel, less time)
_STREAM_BYTES = 32 << 20  # decode passes read at least this much: more than a CPU's caches
_MAX_COPIES = 8
_REPEATS = 3
_BUDGET_S = 0.25  # per dtype; after it, stop repeating (every backend has one timed pass)
_DTYPE_ROUNDS = 2  # alternations of fp32 and bf16 when choosing the auto dtype
# A plan that keeps two copies of each weight must beat the best one-copy plan by this factor.
_TWO_COPY_GAIN = 0.85


@dataclass(frozen=True)
class Tuning:
    """The plan chosen for a dtype and the timings (None: forced, nothing measured)."""

    dtype: torch.dtype
    plan: MatmulPlan
    timings: Timings | None

    def describe(self) -> str:
        text = f"cpu matmul ({str(self.dtype).removeprefix('torch.')}): {self.plan.describe()}"
        if self.timings is None:
            return text + " (forced)"
        measured = ", ".join(
            f"{name} {small:.2f}/{large:.2f}" for name, (small, large) in self.timings.items()
        )
        small, large = ("+".join(map(str, rows)) for rows in (DECODE_ROWS, LARGE_ROWS))
        return f"{text}; ms per pass at {small}/{large} rows: {measured}"


def linear_shapes(
    hf_config: PretrainedConfig, attention: AttentionBackend, tp: TensorParallel | None = None
) -> list[Shape]:
    """The distinct (out, in) of the model's linear layers, lm_head included, in model order
    (of this rank's shards under tensor parallelism).

    The model is built on the meta device, which costs no memory and no initialisation."""
    model = meta_model(hf_config, attention, tp)
    shapes = ((m.out_features, m.in_features) for m in model.modules() if isinstance(m, nn.Linear))
    return list(dict.fromkeys(shapes))


def choose_plan(timings: Mapping[Backend, tuple[float, float]]) -> MatmulPlan:
    """The plan with the lowest decode-plus-prefill time, each relative to its best backend.

    A plan that keeps two copies of each weight (e.g. plain for decode, oneDNN-packed for
    prefill) doubles weight memory, so it is taken only where it clearly pays; three never."""
    best_small = min(small for small, _ in timings.values())
    best_large = min(large for _, large in timings.values())

    def score(plan: MatmulPlan) -> float:
        return timings[plan.small][0] / best_small + timings[plan.large][1] / best_large

    plans = [MatmulPlan(small, large) for small in timings for large in timings]
    best = min((plan for plan in plans if len(plan.storage()) == 1), key=score)
    two_copies = [plan for plan in plans if len(plan.storage()) == 2]
    if two_copies and score(min(two_copies, key=score)) < _TWO_COPY_GAIN * score(best):
        return min(two_copies, key=score)
    return best


def measure(
    shapes: list[Shape],
    dtype: torch.dtype,
    backends: Iterable[Backend],
    clock: Callable[[], float] = time.perf_counter,
) -> Timings:
    """ms per backend: passes over the shapes at each of DECODE_ROWS summed, and at LARGE_ROWS.

    Decode is measured at both ends of the plan's small range: a layout packed for one row
    (MKL's) may fall back to the plain path at a few rows."""
    generator = torch.Generator().manual_seed(0)
    capped = [(min(out, max(1, _MAX_ELEMENTS // inp)), inp) for out, inp in shapes]
    weights = [torch.rand(shape, generator=generator).sub_(0.5).to(dtype) for shape in capped]
    set_bytes = sum(w.numel() * w.element_size() for w in weights)
    copies = min(_MAX_COPIES, max(1, -(-_STREAM_BYTES // set_bytes)))
    # Decode passes stream distinct copies; prefill passes are compute-bound, one set will do.
    decode_weights = weights + [w.clone() for _ in range(copies - 1) for w in weights]
    names = list(backends)
    # The first len(weights) packed copies of each backend serve the prefill passes.
    packed = {name: [pack(w, uniform(name)) for w in decode_weights] for name in names}
    all_rows = (*DECODE_ROWS, *LARGE_ROWS)
    inputs = {
        rows: {inp: torch.rand(rows, inp, generator=generator).to(dtype) for _, inp in capped}
        for rows in all_rows
    }

    def one_pass(name: Backend, rows: int) -> float:
        count = len(weights) if rows == PREFILL_ROWS else len(decode_weights)
        started = clock()
        for weight, packs in zip(decode_weights[:count], packed[name][:count], strict=True):
            run(name, inputs[rows][weight.shape[1]], weight, None, packs)
        return (clock() - started) * 1e3

    best = {(name, rows): float("inf") for name in names for rows in all_rows}
    started = clock()
    with torch.inference_mode():
        for name in names:  # warm-up: oneDNN creates its kernels on a shape's first call
            for rows in all_rows:
                one_pass(name, rows)
        for _ in range(_REPEATS):
            # Interleaved, so that a burst of load from elsewhere hits every backend alike.
            for name in names:
                for rows in all_rows:
                    best[name, rows] = min(best[name, rows], one_pass(name, rows))
            if clock() - started > _BUDGET_S:
                break
    return {
        name: (
            sum(best[name, rows] for rows in DECODE_ROWS),
            sum(best[name, rows] for rows in LARGE_ROWS),
        )
        for name in names
    }


def _timings_key(shapes: list[Shape], dtype: torch.dtype) -> dict[str, Any]:
    return machine_key(
        dtype=str(dtype).removeprefix("torch."), shapes=[list(shape) for shape in shapes]
    )


def cached_timings(shapes: list[Shape], dtype: torch.dtype) -> Timings:
    """The timings of this machine for (shapes, dtype): from the cache, else measured and kept.

    Where `dtype_timings` already measured fp32 against bf16 for these shapes, its timings of
    dtype are used as they are, so a start with dtype="auto" measures once."""
    joint = lookup(AUTO_DTYPE_KIND, _auto_dtype_key(shapes), _read_dtype_timings)
    name = str(dtype).removeprefix("torch.")
    if joint is not None and name in joint:
        return joint[name]
    backends = available_backends(dtype)
    key = _timings_key(shapes, dtype)

    def read(stored: Any) -> Timings:
        if set(stored) != set(backends):
            raise KeyError("measured with other backends")
        return {name: (float(ms[0]), float(ms[1])) for name, ms in stored.items()}

    return cached(CACHE_KIND, key, lambda: measure(shapes, dtype, backends), read)


def tune(shapes: list[Shape], dtype: torch.dtype, choice: str) -> Tuning:
    """The plan for the model's shapes in dtype: measured (cached) for choice "auto", else the
    backend named (EngineConfig.cpu_matmul)."""
    if choice != "auto":
        available = available_backends(dtype)
        forced = next((name for name in available if name == choice), None)
        if forced is None:
            raise ValueError(
                f"cpu_matmul={choice!r} is not available for {dtype} on this CPU and torch "
                f"build (available: auto, {', '.join(available)})"
            )
        return Tuning(dtype, uniform(forced), None)
    timings = cached_timings(shapes, dtype)
    return Tuning(dtype, choose_plan(timings), timings)


def dtype_timings(shapes: list[Shape]) -> dict[str, Timings]:
    """float32's and bfloat16's timings by dtype name, measured alternately in one run and
    cached per machine (kind AUTO_DTYPE_KIND).

    Two separate measurements could each catch a different burst of load from elsewhere, and
    the cache keeps a wrong answer for good: alternating makes a burst hit both dtypes alike,
    and each backend keeps its fastest pass over the rounds."""

    def measure_both() -> dict[str, Timings]:
        best: dict[str, Timings] = {}
        for _ in range(_DTYPE_ROUNDS):
            for name, dtype in _AUTO_DTYPES.items():
                timings = measure(shapes, dtype, available_backends(dtype))
                previous = best.get(name, timings)
                best[name] = {
                    backend: (min(small, previous[backend][0]), min(large, previous[backend][1]))
                    for backend, (small, large) in timings.items()
                }
        return best

    return cached(AUTO_DTYPE_KIND, _auto_dtype_key(shapes), measure_both, _read_dtype_timings)


_AUTO_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _auto_dtype_key(shapes: list[Shape]) -> dict[str, Any]:
    return machine_key(shapes=[list(shape) for shape in shapes])


def _read_dtype_timings(stored: Any) -> dict[str, Timings]:
    result: dict[str, Timings] = {}
    for name, dtype in _AUTO_DTYPES.items():
        if set(stored[name]) != set(available_backends(dtype)):
            raise KeyError("measured with other backends")
        result[name] = {b: (float(ms[0]), float(ms[1])) for b, ms in stored[name].items()}
    return result


def auto_dtype(
    shapes: list[Shape], choice: str = "auto", bf16_native: Callable[[], bool] = has_native_bf16
) -> torch.dtype:
    """bfloat16 where the CPU computes it natively and its plan (see `tune`) measures faster
    than float32's, decode and prefill summed (`dtype_timings`); float32 elsewhere."""
    if not bf16_native() or choice not in ("auto", *available_backends(torch.bfloat16)):
        return torch.float32
    timings = dtype_timings(shapes)

    def cost(name: str, dtype: torch.dtype) -> float:
        measured = timings[name]
        plan = choose_plan(measured) if choice == "auto" else tune(shapes, dtype, choice).plan
        return measured[plan.small][0] + measured[plan.large][1]

    bf16_cost, fp32_cost = cost("bfloat16", torch.bfloat16), cost("float32", torch.float32)
    return torch.bfloat16 if bf16_cost < fp32_cost else torch.float32


def apply_plan(model: nn.Module, plan: MatmulPlan) -> None:
    """Switch every Linear of the model to the plan, packing each weight once."""
    shared = shared_parameter_ids(model)
    with torch.inference_mode(False):
        for module in model.modules():
            if isinstance(module, Linear):
                # A weight shared with another module (a tied embedding) stays as it is.
                module.use_plan(plan, keep_plain_weight=id(module.weight) in shared)


def tune_model(model: nn.Module, shapes: list[Shape], dtype: torch.dtype, choice: str) -> Tuning:
    """Choose the plan for the loaded model (see `tune`), apply it, and log it."""
    started = time.perf_counter()
    tuning = tune(shapes, dtype, choice)
    apply_plan(model, tuning.plan)
    logger.info("%s (%.0f ms)", tuning.describe(), (time.perf_counter() - started) * 1e3)
    return tuning
