"""CPU matmul backends of the linear layers: every backend computes x @ W.T + b, packed or not;
the plan is measured once per machine and cached; a forced backend wins; dtype auto picks bf16
only where the CPU has it natively and it measures faster."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.layers.linear import Linear, MergedLinear, linear
from engine.model_runner import ModelRunner, resolve_dtype
from engine.platforms.cpu import machine_cache, matmul_tuning
from engine.platforms.cpu.matmul import (
    BACKENDS,
    SMALL_ROWS,
    MatmulPlan,
    available_backends,
    uniform,
)
from engine.quantization.int8 import Int8Linear
from engine.quantization.matmul import quantized_linear
from engine.quantization.weights import quantize_int8
from kernels.reference import silu_and_mul_ref

SHAPES = [(40, 48), (96, 48), (48, 32)]


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERQ_HOME", str(tmp_path / "home"))
    # Whether the CPU was busy meanwhile is tests/engine/test_machine_cache.py's concern.
    monkeypatch.setattr(machine_cache, "_others_share", lambda *args: 0.0)


def _layer(dtype: torch.dtype, bias: bool, seed: int = 0) -> Linear:
    generator = torch.Generator().manual_seed(seed)
    layer = Linear(48, 40, bias=bias).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 48, generator=generator) / 7)
        if bias:
            layer.bias.copy_(torch.randn(40, generator=generator))
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
def test_every_backend_computes_the_linear(dtype, backend, bias):
    if backend not in available_backends(dtype):
        pytest.skip(f"{backend} does not run {dtype} on this CPU / torch build")
    layer = _layer(dtype, bias)
    weight = layer.weight.detach().clone()
    bias_value = None if layer.bias is None else layer.bias.detach().clone()
    layer.use_plan(uniform(backend))
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for rows in (1, 5, SMALL_ROWS + 1, 64):
        x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows)).to(dtype)
        with torch.inference_mode():
            expected = F.linear(x, weight, bias_value)
            torch.testing.assert_close(layer(x), expected, **tolerance)
            torch.testing.assert_close(layer(x.view(1, rows, 48)), expected[None], **tolerance)


def test_a_plan_sends_small_and_large_calls_to_their_backends(monkeypatch):
    plan = MatmulPlan(small="aten", large="onednn")
    assert plan.backend_for(1) == plan.backend_for(SMALL_ROWS) == "aten"
    assert plan.backend_for(SMALL_ROWS + 1) == "onednn"
    seen = []
    monkeypatch.setattr(
        "engine.layers.linear.run", lambda backend, x, *args: seen.append(backend) or x
    )
    weight = torch.randn(4, 4)
    linear(torch.randn(2, 4), weight, None, plan)
    linear(torch.randn(SMALL_ROWS + 1, 4), weight, None, plan)
    assert seen == ["aten", "onednn"]


def test_packing_frees_the_plain_weight_unless_it_is_shared():
    if "onednn_packed" not in available_backends(torch.float32):
        pytest.skip("no oneDNN in this torch build")
    layer = _layer(torch.float32, bias=False)
    layer.use_plan(uniform("onednn_packed"))
    assert layer.weight.is_meta  # only the packed copy is kept
    tied = _layer(torch.float32, bias=False)
    tied.use_plan(uniform("onednn_packed"), keep_plain_weight=True)
    assert not tied.weight.is_meta


def test_the_plan_is_the_fastest_and_keeps_one_copy_of_the_weights_unless_it_pays():
    fast_everywhere = {"aten": (2.0, 20.0), "onednn": (1.5, 10.0), "onednn_packed": (1.0, 8.0)}
    assert matmul_tuning.choose_plan(fast_everywhere) == uniform("onednn_packed")
    # aten decodes much faster, oneDNN prefills much faster: both read the same plain weight.
    split = {"aten": (1.0, 40.0), "onednn": (3.0, 10.0), "onednn_packed": (3.0, 11.0)}
    assert matmul_tuning.choose_plan(split) == MatmulPlan("aten", "onednn")
    # A packed copy beside the plain one doubles weight memory: only for a clear gain.
    slight = {"aten": (1.0, 10.5), "onednn": (1.05, 10.5), "onednn_packed": (1.1, 10.0)}
    assert len(matmul_tuning.choose_plan(slight).storage()) == 1
    clear = {"aten": (1.0, 30.0), "onednn": (3.0, 30.0), "onednn_packed": (3.0, 10.0)}
    assert matmul_tuning.choose_plan(clear) == MatmulPlan("aten", "onednn_packed")


def test_the_measurement_is_cached_per_machine(monkeypatch, tmp_path):
    calls = []
    real_measure = matmul_tuning.measure

    def counting_measure(*args, **kwargs):
        calls.append(args)
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(matmul_tuning, "measure", counting_measure)
    first = matmul_tuning.tune(SHAPES, torch.float32, "auto")
    assert set(first.timings) == set(available_backends(torch.float32))
    assert all(small > 0 and large > 0 for small, large in first.timings.values())
    files = list((tmp_path / "home" / "cpu_matmul").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["key"]["dtype"] == "float32"
    second = matmul_tuning.tune(SHAPES, torch.float32, "auto")
    assert len(calls) == 1  # the second start read the cache
    assert second == first
    matmul_tuning.tune(SHAPES[:2], torch.float32, "auto")  # other shapes: measured anew
    assert len(calls) == 2


def test_the_large_range_is_timed_at_a_decode_batch_and_a_prefill(monkeypatch):
    # Calls above SMALL_ROWS rows are decode steps of many sequences as well as prefills: a
    # backend slower only on the first of them must not win the large range.
    slow_rows = matmul_tuning.BATCH_ROWS
    real_run = matmul_tuning.run

    def run_slowed(name, x, weight, bias, packs):
        if name == "aten" and x.shape[0] == slow_rows:
            now[0] += 1.0  # one fake second per call
        return real_run(name, x, weight, bias, packs)

    now = [0.0]
    monkeypatch.setattr(matmul_tuning, "run", run_slowed)
    timings = matmul_tuning.measure(SHAPES, torch.float32, ["aten"], clock=lambda: now[0])
    small, large = timings["aten"]
    assert small == 0.0
    # One fake second per weight streamed at BATCH_ROWS: every copy a decode pass reads.
    assert large >= 1e3 * len(SHAPES)


def test_a_forced_backend_is_used_without_measuring(monkeypatch):
    monkeypatch.setattr(matmul_tuning, "measure", lambda *a, **k: pytest.fail("measured"))
    tuning = matmul_tuning.tune(SHAPES, torch.float32, "aten")
    assert tuning.plan == uniform("aten") and tuning.timings is None
    with pytest.raises(ValueError, match="cpu_matmul='no_such'"):
        matmul_tuning.tune(SHAPES, torch.float32, "no_such")


def _fake_timings(bf16_ms: float):
    def timings(shapes):
        return {"float32": {"aten": (10.0, 100.0)}, "bfloat16": {"aten": (bf16_ms, bf16_ms * 10)}}

    return timings


@pytest.mark.parametrize(
    ("native", "bf16_ms", "expected"),
    [
        (False, 1.0, torch.float32),  # no native bf16: not even measured
        (True, 5.0, torch.bfloat16),  # native and faster
        (True, 20.0, torch.float32),  # native but slower here
    ],
)
def test_auto_dtype_on_the_cpu_picks_bf16_only_where_native_and_faster(
    monkeypatch, native, bf16_ms, expected
):
    monkeypatch.setattr(matmul_tuning, "dtype_timings", _fake_timings(bf16_ms))
    chosen = matmul_tuning.auto_dtype(SHAPES, bf16_native=lambda: native)
    assert chosen == expected
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, lambda: chosen) == expected
    assert resolve_dtype("float32", cpu, lambda: torch.bfloat16) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), lambda: torch.float32) == torch.bfloat16


def test_auto_dtype_keeps_float32_for_a_forced_fp32_only_backend(monkeypatch):
    monkeypatch.setattr(matmul_tuning, "dtype_timings", _fake_timings(1.0))
    assert matmul_tuning.auto_dtype(SHAPES, "mkl_packed", lambda: True) == torch.float32


def test_fp32_and_bf16_are_measured_alternately_once_per_machine(monkeypatch, tmp_path):
    # Measured apart, a burst of load could slow one dtype only, and the cache would keep the
    # wrong choice for good; alternating makes it hit both alike.
    order = []

    def fake_measure(shapes, dtype, backends):
        order.append(dtype)
        return {name: (1.0, 1.0) for name in backends}

    monkeypatch.setattr(matmul_tuning, "measure", fake_measure)
    first = matmul_tuning.dtype_timings(SHAPES)
    assert order == [torch.float32, torch.bfloat16] * 2
    assert set(first) == {"float32", "bfloat16"}
    assert matmul_tuning.dtype_timings(SHAPES) == first  # the next start reads the cache
    assert len(order) == 4
    files = list((tmp_path / "home" / matmul_tuning.AUTO_DTYPE_KIND).glob("*.json"))
    assert len(files) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6, 7, 8, 9, 13, 37, 100])
def test_the_panel_kernel_covers_long_inputs_and_partial_panels(dtype, rows):
    """Inputs beyond one pass of the AVX2 fp32 kernel (it accumulates pass after pass) and an
    odd count (bf16 multiplies inputs in pairs), row counts around the tiles (6 rows on AVX2, 8
    on AVX-512) and the 96-row blocks, and an output count that leaves the last panel partial."""
    if "panels" not in available_backends(dtype):
        pytest.skip(f"no {dtype} panel kernel for this CPU")
    from kernels import cpu_ops

    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(37, 601, generator=generator) / 20).to(dtype)
    bias = torch.randn(37, generator=generator).to(dtype)
    x = torch.randn(rows, 601, generator=generator).to(dtype)
    out = cpu_ops.panel_linear(x, cpu_ops.pack_panels(weight), bias, 37)
    expected = F.linear(x.double(), weight.double(), bias.double()).to(dtype)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 13, 100])
def test_the_gated_panel_kernel_is_the_projection_then_silu_and_mul(dtype, rows):
    """An MLP's [gate; up] projection with its SiLU-and-mul in one kernel gives what the two ops
    give one after the other (in bf16 rounded where they round: the projection, then the SiLU)."""
    from kernels import cpu_ops

    if not cpu_ops.panel_gated_supported(dtype):
        pytest.skip(f"no gated {dtype} panel kernel for this CPU")
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(2 * 48, 601, generator=generator) / 20).to(dtype)
    x = torch.randn(rows, 601, generator=generator).to(dtype)
    panels = cpu_ops.pack_panels(cpu_ops.interleave_gate_up(weight))
    fused = cpu_ops.panel_gated_linear(x, panels, 48)
    projected = cpu_ops.panel_linear(x, cpu_ops.pack_panels(weight), None, 2 * 48)
    torch.testing.assert_close(fused, cpu_ops.silu_and_mul(projected))
    gate, up = F.linear(x.double(), weight.double()).chunk(2, dim=-1)
    tolerance = {"atol": 1e-5, "rtol": 1e-4} if dtype == torch.float32 else {}
    torch.testing.assert_close(fused, (F.silu(gate) * up).to(dtype), **tolerance)


def test_bf16_panels_run_on_amx_tiles_where_the_cpu_has_them():
    # Elsewhere the AVX-512 tiles serve every shape; on an AMX CPU the tiles must be in use, or
    # the tests below would only check the fallback.
    from kernels import cpu_build, cpu_ops

    if "amx_bf16" not in cpu_build.cpu_flags().split() or not cpu_ops.cpu_kernels_available():
        pytest.skip("no AMX on this CPU")
    assert cpu_ops.panel_amx_usable()


# Row counts around the AMX tiles: one row, a partial tile, one tile, a tile and a row (the
# padded last tile), an odd count of tiles, and many pairs of tiles.
AMX_ROWS = [1, 5, 16, 17, 48, 100, 300]


@pytest.mark.parametrize("rows", [17, 48])
def test_bf16_panels_over_several_l2_groups_match_the_projection(rows):
    """Panels of 1,024 inputs (64 KiB each), so that each thread's panels come in several
    groups of the AMX tiles' L2-sized passes, and a partial last panel."""
    from kernels import cpu_ops

    if "panels" not in available_backends(torch.bfloat16):
        pytest.skip("no bf16 panel kernel for this CPU")
    generator = torch.Generator().manual_seed(rows)
    weight = (torch.randn(600, 1024, generator=generator) / 30).bfloat16()
    x = torch.randn(rows, 1024, generator=generator).bfloat16()
    out = cpu_ops.panel_linear(x, cpu_ops.pack_panels(weight), None, 600)
    expected = F.linear(x.double(), weight.double()).bfloat16()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("rows", AMX_ROWS)
def test_bf16_panels_of_whole_amx_steps_match_the_projection(rows):
    """Inputs a multiple of 32 (the AMX step; elsewhere the same shapes take the AVX-512
    tiles), a bias, and an output count that leaves the last panel partial."""
    from kernels import cpu_ops

    if "panels" not in available_backends(torch.bfloat16):
        pytest.skip("no bf16 panel kernel for this CPU")
    generator = torch.Generator().manual_seed(rows)
    in_features = 3 * cpu_ops.AMX_INPUTS
    weight = (torch.randn(37, in_features, generator=generator) / 10).bfloat16()
    bias = torch.randn(37, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    out = cpu_ops.panel_linear(x, cpu_ops.pack_panels(weight), bias, 37)
    expected = F.linear(x.double(), weight.double(), bias.double()).bfloat16()
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("rows", AMX_ROWS)
def test_gated_bf16_panels_of_whole_amx_steps_are_the_projection_then_silu_and_mul(rows):
    from kernels import cpu_ops

    if not cpu_ops.panel_gated_supported(torch.bfloat16):
        pytest.skip("no gated bf16 panel kernel for this CPU")
    generator = torch.Generator().manual_seed(rows)
    in_features = 2 * cpu_ops.AMX_INPUTS
    weight = (torch.randn(2 * 48, in_features, generator=generator) / 10).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    fused = cpu_ops.panel_gated_linear(
        x, cpu_ops.pack_panels(cpu_ops.interleave_gate_up(weight)), 48
    )
    projected = cpu_ops.panel_linear(x, cpu_ops.pack_panels(weight), None, 2 * 48)
    torch.testing.assert_close(fused, cpu_ops.silu_and_mul(projected))
    gate, up = F.linear(x.double(), weight.double()).chunk(2, dim=-1)
    torch.testing.assert_close(fused, (F.silu(gate) * up).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gated_projection_activates_in_its_matmul_and_still_projects(dtype):
    if "panels" not in available_backends(dtype):
        pytest.skip(f"no {dtype} panel kernel for this CPU")
    from kernels import cpu_ops

    generator = torch.Generator().manual_seed(0)
    layer = MergedLinear(48, [32, 32], gated=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 48, generator=generator) / 7)
    weight = layer.weight.detach().clone()
    layer.use_plan(uniform("panels"))
    assert layer.packed.gated == cpu_ops.panel_gated_supported(dtype)
    tolerance = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for rows in (1, SMALL_ROWS + 5):
        x = torch.randn(rows, 48, generator=generator).to(dtype)
        projected = F.linear(x, weight)
        torch.testing.assert_close(layer(x), projected, **tolerance)  # still [gate; up]
        torch.testing.assert_close(layer.activated(x), silu_and_mul_ref(projected), **tolerance)


def test_only_two_equal_shards_make_a_gated_projection():
    with pytest.raises(ValueError, match="two equal shards"):
        MergedLinear(48, [32, 16], gated=True)
    with pytest.raises(TypeError, match="gated"):
        MergedLinear(48, [32, 16]).activated(torch.zeros(1, 48))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forced_backend_generates_the_same_tokens(tiny_llama_dir, backend):
    if backend not in available_backends(torch.float32):
        pytest.skip(f"{backend} is not in this torch build")
    from engine import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29] * 3, [3, 4]]

    def tokens(**overrides) -> list[list[int]]:
        llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, **overrides)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    assert tokens(cpu_matmul=backend) == tokens(cpu_matmul="aten")


def test_the_runner_logs_its_choice(tiny_llama_dir, caplog):
    caplog.set_level("INFO", logger="engine.platforms.cpu.matmul_tuning")
    ModelRunner(
        EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=8, enforce_eager=True), tiny_llama_dir
    )
    assert any("cpu matmul" in record.getMessage() for record in caplog.records)


def test_a_quantized_layer_keeping_its_plain_weight_uses_it_for_prefill_sized_calls() -> None:
    # A tied lm_head keeps the embedding's full-precision weight anyway: calls bound by
    # arithmetic use it (exact and faster), decode-sized ones stream the int8 codes.
    torch.manual_seed(0)
    tied, separate = Linear(64, 48, bias=False), Linear(64, 48, bias=False)
    separate.weight = tied.weight
    quantized = quantize_int8(tied.weight.detach())
    tied.use_method(Int8Linear(quantized), keep_plain_weight=True)
    separate.use_method(Int8Linear(quantized))
    many, few = torch.randn(SMALL_ROWS + 1, 64), torch.randn(SMALL_ROWS, 64)
    with torch.inference_mode():
        torch.testing.assert_close(tied(many), F.linear(many, tied.weight))
        torch.testing.assert_close(tied(few), quantized_linear(few, quantized))
        torch.testing.assert_close(separate(many), quantized_linear(many, quantized))
        assert not torch.allclose(tied(many), separate(many), rtol=1e-6, atol=1e-6)


def test_the_chosen_dtype_plan_reuses_the_alternating_measurement(monkeypatch, tmp_path):
    # dtype="auto" measures both dtypes at start-up; the plan for the chosen one must not
    # measure again (start-up time), and must come from those same timings.
    order = []

    def fake_measure(shapes, dtype, backends):
        order.append(dtype)
        return {name: (len(order), 2.0 * len(order)) for name in backends}

    monkeypatch.setattr(matmul_tuning, "measure", fake_measure)
    both = matmul_tuning.dtype_timings(SHAPES)
    measured = len(order)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        tuning = matmul_tuning.tune(SHAPES, dtype, "auto")
        assert tuning.timings == both[name]
    assert len(order) == measured
