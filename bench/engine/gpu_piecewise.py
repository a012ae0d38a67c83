"""Part (e) of bench/suites/gpu.py: steps with prefills with piecewise CUDA graphs on and off.

Requests arrive one per step while earlier ones decode, so nearly every step mixes a short
prefill with a few dozen decodes: the steps whole-step decode graphs cannot serve and
piecewise graphs can (up to cuda_graph_max_tokens tokens). Both runs use the same loaded
engine; "off" only detaches its captured pieces.
"""

from __future__ import annotations

import logging
import time

import torch

from bench.common.gpu_report import markdown_table
from bench.engine.gpu_engine import EngineBenchConfig, random_prompts
from engine import SamplingParams
from engine.outputs import EngineRequest

logger = logging.getLogger("bench.gpu")


def _staggered(llm, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[float, int]:
    """(seconds, steps) to serve prompts arriving one per step."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    pending = list(enumerate(prompts))
    steps = 0
    torch.cuda.synchronize()
    started = time.perf_counter()
    while pending or engine.has_unfinished():
        if pending:
            index, prompt = pending.pop(0)
            engine.add_request(EngineRequest(f"{tag}-{index}", prompt, params))
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    return time.perf_counter() - started, steps


def bench_piecewise(
    cfg: EngineBenchConfig,
    llm,
    num_requests: int = 96,
    prompt_len: int = 96,
    new_tokens: int = 32,
) -> str:
    runner = llm.engine.runner
    graphs = runner.piecewise_graphs
    if graphs is None:
        return (
            "No piecewise graphs were captured (enforce_eager, or the capture failed: see the log)."
        )
    vocab = cfg.model_config["vocab_size"]
    prompts = random_prompts(num_requests, prompt_len, vocab, cfg.seed + 11)
    rows = []
    timings: dict[str, float] = {}
    try:
        for label, pieces in (("eager", None), ("piecewise graphs", graphs)):
            runner.piecewise_graphs = pieces
            _staggered(llm, prompts[:8], 4, f"warm-{label}")
            seconds, steps = _staggered(llm, prompts, new_tokens, label)
            timings[label] = seconds
            logger.info("piecewise bench, %s: %.2f s, %d steps", label, seconds, steps)
            rows.append(
                [label, steps, seconds, 1e3 * seconds / steps, num_requests * new_tokens / seconds]
            )
    finally:
        runner.piecewise_graphs = graphs
    speedup = timings["eager"] / timings["piecewise graphs"]
    headers = ["steps with prefills", "steps", "s", "ms/step", "output tok/s"]
    return (
        f"{num_requests} requests of {prompt_len} tokens arriving one per step, {new_tokens} "
        f"new tokens each (mixed steps of ~{new_tokens} decodes + one prefill); captured token "
        f"counts {list(graphs.captured_sizes)}. Piecewise graphs: **{speedup:.2f}x** eager.\n\n"
        + markdown_table(headers, rows)
    )
