"""Engines of two dtypes in one process each keep their compiled glue.

dynamo keeps compiled graphs, and counts recompiles against its limit, per code object. With
one set of glue functions for every dtype, an fp32 engine and a bf16 engine shared one budget:
once it ran out, the compiled glue fell back to eager for good (a warning in the log, nothing
else). Each dtype now compiles its own copies, with a budget of its own.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from engine.platforms.cpu import glue as cpu_glue


def _has_cpp_compiler() -> bool:
    from torch._inductor import cpp_builder

    try:
        return bool(cpp_builder.get_cpp_compiler())
    except Exception:  # inductor raises where no C++ compiler is installed
        return False


pytestmark = pytest.mark.skipif(not _has_cpp_compiler(), reason="no C++ compiler for inductor")

NUM_TOKENS, HIDDEN, HEAD_DIM, INTERMEDIATE = 5, 64, 16, 40


def _calls(glue: cpu_glue.Glue, dtype: torch.dtype) -> list[tuple[str, object]]:
    """One call of each glue function, on fixed random inputs of dtype."""
    generator = torch.Generator().manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(dtype)

    hidden, residual, weight = rand(NUM_TOKENS, HIDDEN), rand(NUM_TOKENS, HIDDEN), rand(HIDDEN)
    q, k = rand(NUM_TOKENS, 4 * HEAD_DIM), rand(NUM_TOKENS, 2 * HEAD_DIM)
    cos, sin = rand(NUM_TOKENS, 1, HEAD_DIM), rand(NUM_TOKENS, 1, HEAD_DIM)
    gate_up = rand(NUM_TOKENS, 2 * INTERMEDIATE)
    return [
        ("rms_norm", glue.rms_norm(hidden, weight, 1e-6)),
        ("add_rms_norm", glue.add_rms_norm(hidden, residual, weight, 1e-6)),
        ("rotate", glue.rotate(q, k, cos, sin, HEAD_DIM)),
        ("silu_and_mul", glue.silu_and_mul(gate_up)),
    ]


def _compiled_regions(glue: cpu_glue.Glue, dtype: torch.dtype) -> tuple[int, list]:
    """How many calls ran compiled code (the profiler's compiled regions), and the outputs."""
    with torch.inference_mode(), profile() as prof:
        outputs = _calls(glue, dtype)
    regions = sum(event.name.startswith("Torch-Compiled Region") for event in prof.events())
    return regions, outputs


def test_fp32_then_bf16_then_fp32_glue_all_stay_compiled_and_match_eager() -> None:
    # A budget of one graph per function: all one dtype needs for these calls, so a second
    # dtype compiling into the same budget would run out of it at once (as the suite's many
    # engines of two dtypes ran out of the default one).
    fp32, bf16 = cpu_glue.new_compiled(), cpu_glue.new_compiled()
    with torch._dynamo.config.patch(recompile_limit=1):
        for dtype, glue in ((torch.float32, fp32), (torch.bfloat16, bf16), (torch.float32, fp32)):
            _compiled_regions(glue, dtype)  # compiles on the first call of each dtype
            regions, outputs = _compiled_regions(glue, dtype)
            assert regions == 4, f"{dtype}: {4 - regions} of 4 glue functions ran eagerly"
            with torch.inference_mode():
                expected = _calls(cpu_glue.EAGER, dtype)
            tolerance = (
                {"atol": 1e-5, "rtol": 1e-5}
                if dtype == torch.float32
                else {"atol": 3e-2, "rtol": 2e-2}
            )
            for (name, got), (_, want) in zip(outputs, expected, strict=True):
                torch.testing.assert_close(
                    got, want, **tolerance, msg=lambda m, n=name: f"{n}: {m}"
                )


def test_the_process_wide_glue_is_one_per_dtype() -> None:
    assert cpu_glue.compiled(torch.float32) is cpu_glue.compiled(torch.float32)
    assert cpu_glue.compiled(torch.bfloat16) is not cpu_glue.compiled(torch.float32)
