"""The runner's platform: the CPU one prepares the model and picks each step's glue; every
other device gets one that does nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from engine import LLM
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineConfig
from engine.platforms.base import Platform
from engine.platforms.cpu import glue as cpu_glue
from engine.platforms.cpu.decode_stack import stacks_of
from engine.platforms.cpu.platform import CpuPlatform
from engine.platforms.select import platform_for
from kernels import cpu_ops
from schemas.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)


def test_a_device_without_fast_paths_gets_a_platform_that_does_nothing(
    tiny_llama_dir: Path,
) -> None:
    hf_config = AutoConfig.from_pretrained(str(tiny_llama_dir))
    config = EngineConfig(model=str(tiny_llama_dir))
    platform = platform_for(
        torch.device("meta"), config, hf_config, TorchAttentionBackend(), tp=None
    )
    assert type(platform) is Platform
    platform.prepare(torch.nn.Linear(2, 2), torch.float32)
    assert platform.greedy_screen is None and platform.extra_weight_bytes == 0
    with platform.step(4096, decode_only=False):
        assert cpu_glue.current() is cpu_glue.EAGER  # nothing set


def test_cpu_steps_take_the_compiled_glue_from_the_measured_size_on(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERQ_HOME", str(tmp_path / "home"))  # nothing measured before
    monkeypatch.setattr(cpu_glue, "min_tokens_for_compiled", lambda *_: 32)
    monkeypatch.setattr(cpu_glue, "compile_now", lambda *_: None)
    llm = LLM(str(tiny_llama_dir), dtype="bfloat16")
    platform = llm.engine.runner.platform
    assert isinstance(platform, CpuPlatform) and platform.compiled_glue_min_tokens == 32
    steps = {(31, False): "native", (32, False): "compiled", (512, True): "native"}
    for (num_tokens, decode_only), expected in steps.items():
        with platform.step(num_tokens, decode_only):
            glue = cpu_glue.current()
        want = cpu_glue.compiled(torch.bfloat16) if expected == "compiled" else cpu_glue.native()
        assert glue is want, (num_tokens, decode_only)
    assert cpu_glue.current() is cpu_glue.EAGER  # only inside the step


@pytest.mark.skipif(not cpu_ops.cpu_kernels_available(), reason="no C++ decode stack here")
def test_a_decode_stack_reads_the_weights_again_once_prepared(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, cpu_matmul="aten")
    model = llm.engine.runner.model
    (stack,) = stacks_of(model)
    assert stack is model.model.cpu_decode_stack  # the stack the runner's platform prepared
    prompts = [[5, 9, 17, 3], [1, 2, 3, 4, 5, 6]]

    def outputs() -> list[tuple[list[int], list[float]]]:
        results = llm.generate(prompts, GREEDY, use_tqdm=False)
        return [
            (list(o.outputs[0].token_ids), [e.logprob for e in o.outputs[0].logprobs or []])
            for o in results
        ]

    before = outputs()
    down = model.model.layers[-1].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach() * 3, requires_grad=False)
    stack.prepare()  # the weights are stored anew: the next step reads them
    with_stack = outputs()
    model.model.cpu_decode_stack = None
    try:
        python_forward = outputs()
    finally:
        model.model.cpu_decode_stack = stack
    assert with_stack == python_forward
    assert with_stack != before
