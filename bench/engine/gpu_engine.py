"""Parts (b) and (c) of bench/suites/gpu.py: the engine (LLM API) on a dummy-weight Llama-3-8B.

(b) batch-1 decode ms/token against the weight-bandwidth floor; (c) offline throughput
against transformers' generate and the compute roofline. Needs the engine's dependencies
(pydantic among them); imported only when those parts run.
"""

from __future__ import annotations

import gc
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common.figures import rates
from bench.common.gpu_report import (
    bandwidth_floor_ms,
    compute_roofline_tokens_per_s,
    llama_param_counts,
    markdown_table,
)
from bench.common.workload import random_workload
from bench.engine.throughput import greedy

logger = logging.getLogger("bench.gpu")


@dataclass(frozen=True)
class EngineBenchConfig:
    model_config: dict
    model_dir: Path  # where config.json goes (nothing else: dummy weights)
    decode_prompt_len: int = 128
    decode_tokens: int = 128
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    hf_prompts: int = 64
    hf_batch_size: int = 64
    peak_flops: float = 989e12
    gpu_memory_utilization: float = 0.90
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enforce_eager: bool = False
    seed: int = 0
    device: str = "cuda"  # "cpu" only for smoke tests: the numbers mean nothing there
    quantization: str | None = None  # "fp8": the dummy bf16 weights quantized at load

    @property
    def weights_label(self) -> str:
        return "bf16 dummy weights" if self.quantization is None else (
            f"{self.quantization} weights (quantized at load from bf16 dummy weights)"
        )  # fmt: skip

    @property
    def bytes_per_param(self) -> int:
        return 1 if self.quantization == "fp8" else 2


def write_model_dir(cfg: EngineBenchConfig) -> Path:
    cfg.model_dir.mkdir(parents=True, exist_ok=True)
    (cfg.model_dir / "config.json").write_text(json.dumps(cfg.model_config, indent=2))
    return cfg.model_dir


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    return [r.prompt_token_ids for r in random_workload(count, length, 1, 0.0, vocab_size, seed)]


def _is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _synchronize(device: str) -> None:
    # CPU work is done when the call returns; only CUDA queues kernels behind the host's back.
    if _is_cuda(device):
        torch.cuda.synchronize()


def _cuda_copy_ms(src: torch.Tensor, dst: torch.Tensor) -> float:
    import triton.testing

    return triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")


def _cpu_copy_ms(src: torch.Tensor, dst: torch.Tensor, repeats: int = 5) -> float:
    # do_bench needs a GPU; on the CPU a median of a few timed copies is enough for a smoke test.
    dst.copy_(src)  # warm-up: fault in the destination pages
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def measure_copy_bandwidth(num_bytes: int = 2 << 30, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth in bytes/s (each copied byte is read once, written once)."""
    on_cuda = _is_cuda(device)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    ms = (_cuda_copy_ms if on_cuda else _cpu_copy_ms)(src, torch.empty_like(src))
    del src
    if on_cuda:
        torch.cuda.empty_cache()
    return 2 * num_bytes / (ms * 1e-3)


def make_llm(cfg: EngineBenchConfig):
    from engine import LLM

    return LLM(
        model=str(write_model_dir(cfg)),
        load_format="dummy",
        dtype="bfloat16",
        device=cfg.device,
        seed=cfg.seed,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        enforce_eager=cfg.enforce_eager,
        quantization=cfg.quantization,
    )


def _timed_generate(
    llm, prompts: list[list[int]], max_tokens: int, device: str
) -> tuple[float, int]:
    _synchronize(device)
    started = time.perf_counter()
    outputs = llm.generate(prompts, greedy(max_tokens), use_tqdm=False)
    _synchronize(device)
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return time.perf_counter() - started, produced


def bench_decode(cfg: EngineBenchConfig, llm) -> str:
    """Batch-1 ms/token = (time for N tokens - time for 1 token) / (N - 1): prefill cancels out."""
    counts = llama_param_counts(cfg.model_config)
    weight_bytes = counts.streamed_bytes_per_token(bytes_per_param=cfg.bytes_per_param)
    # 2 GiB swamps launch overhead on a GPU; 16 MiB keeps a CPU smoke test quick.
    copy_bytes = 2 << 30 if _is_cuda(cfg.device) else 16 << 20
    bandwidth = measure_copy_bandwidth(copy_bytes, cfg.device)
    floor_ms = bandwidth_floor_ms(weight_bytes, bandwidth)

    vocab = cfg.model_config["vocab_size"]
    n = cfg.decode_tokens
    fresh = iter(random_prompts(16, cfg.decode_prompt_len, vocab, cfg.seed + 1))  # no prefix hits
    _timed_generate(llm, [next(fresh)], 8, cfg.device)  # warm-up
    one = statistics.median(_timed_generate(llm, [next(fresh)], 1, cfg.device)[0] for _ in range(3))
    full = statistics.median(
        _timed_generate(llm, [next(fresh)], n, cfg.device)[0] for _ in range(3)
    )
    ms_per_token = (full - one) / (n - 1) * 1e3
    achieved = weight_bytes / (ms_per_token * 1e-3)
    rows = [[
        f"{counts.total / 1e9:.2f} B", f"{weight_bytes / 1e9:.2f}", f"{bandwidth / 1e12:.2f}",
        floor_ms, ms_per_token, floor_ms / ms_per_token, achieved / 1e12,
    ]]  # fmt: skip
    headers = [
        "params", "weight GB read/token", "copy TB/s (measured)", "floor ms/token",
        "decode ms/token", "floor ÷ measured", "effective TB/s",
    ]  # fmt: skip
    return (
        f"Batch-1 decode, {cfg.weights_label}, prompt {cfg.decode_prompt_len}, {n} new tokens "
        "(ms/token excludes prefill). Floor = weight bytes ÷ measured device copy bandwidth.\n\n"
        + markdown_table(headers, rows)
    )


def bench_throughput(cfg: EngineBenchConfig, llm, hf_rates: dict | None) -> str:
    vocab = cfg.model_config["vocab_size"]
    prompts = random_prompts(cfg.num_prompts, cfg.input_len, vocab, cfg.seed + 2)
    _timed_generate(llm, random_prompts(8, 64, vocab, cfg.seed + 3), 8, cfg.device)  # warm-up
    seconds, produced = _timed_generate(llm, prompts, cfg.output_len, cfg.device)
    expected = cfg.num_prompts * cfg.output_len
    if produced != expected:
        logger.warning("engine produced %d tokens, expected %d", produced, expected)
    ours = rates(seconds, cfg.num_prompts * cfg.input_len, produced)
    counts = llama_param_counts(cfg.model_config)
    roofline = compute_roofline_tokens_per_s(counts.matmul, cfg.peak_flops)
    rows = [[
        f"inferq LLM.generate ({cfg.num_prompts} prompts)", ours["seconds"], ours["output_tok_s"],
        ours["total_tok_s"], ours["total_tok_s"] / roofline, "-",
    ]]  # fmt: skip
    if hf_rates is not None:
        rows.append([
            f"transformers generate ({cfg.hf_prompts} prompts, batch {cfg.hf_batch_size})",
            hf_rates["seconds"], hf_rates["output_tok_s"], hf_rates["total_tok_s"],
            hf_rates["total_tok_s"] / roofline, ours["output_tok_s"] / hf_rates["output_tok_s"],
        ])  # fmt: skip
    headers = [
        "system", "seconds", "output tok/s", "total tok/s", "total ÷ compute roofline",
        "inferq ÷ this (output tok/s)",
    ]  # fmt: skip
    return (
        f"Offline throughput: {cfg.input_len} random token ids in / {cfg.output_len} out, "
        f"ignore_eos, greedy, {cfg.weights_label}. Compute roofline = peak {cfg.peak_flops:.3g} "
        f"FLOP/s ÷ (2 x {counts.matmul / 1e9:.2f} B matmul params) = {roofline:.0f} tok/s "
        "(attention FLOPs not counted).\n\n" + markdown_table(headers, rows)
    )


def bench_step_overhead(cfg: EngineBenchConfig, llm, batch_sizes: list[int]) -> str:
    """How much of a decode-heavy step the GPU sits idle: wall time per engine step against the
    kernel time the profiler records in it (one stream, so kernel times do not overlap). On
    the CPU (smoke tests) operator time stands in for kernel time."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = _is_cuda(cfg.device)
    activity = ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU
    vocab = cfg.model_config["vocab_size"]
    new_tokens = 32
    rows = []
    kernel_tables = []
    for index, batch in enumerate(batch_sizes):
        seed = cfg.seed + 10 + 2 * index
        warm_up = random_prompts(2, cfg.decode_prompt_len, vocab, seed)  # no prefix hits later
        _timed_generate(llm, warm_up, 4, cfg.device)
        prompts = random_prompts(batch, cfg.decode_prompt_len, vocab, seed + 1)
        steps_before = llm.engine.stats().num_steps
        with profile(activities=[activity]) as prof:
            seconds, _ = _timed_generate(llm, prompts, new_tokens, cfg.device)
        steps = llm.engine.stats().num_steps - steps_before
        events = [e for e in prof.key_averages() if _busy_us(e, on_cuda) > 0]
        busy_s = sum(_busy_us(e, on_cuda) for e in events) * 1e-6
        kernel_tables.append(_top_kernels(events, batch, steps, on_cuda))
        rows.append([
            batch, steps, seconds / steps * 1e3, busy_s / steps * 1e3, 1 - busy_s / seconds,
        ])  # fmt: skip
    headers = ["sequences", "steps", "wall ms/step", "GPU busy ms/step", "GPU idle fraction"]
    return (
        f"Decode-heavy steps: prompt {cfg.decode_prompt_len}, {new_tokens} new tokens each, "
        "bf16 dummy weights, under torch.profiler (CUDA activity only). Idle = 1 - kernel time "
        "/ wall time: the host's share of a step that the GPU does not hide.\n\n"
        + markdown_table(headers, rows)
        + "\n\n"
        + "\n\n".join(kernel_tables)
    )


def _busy_us(event, on_cuda: bool) -> float:
    return event.self_device_time_total if on_cuda else event.self_cpu_time_total


def _top_kernels(events: list, batch: int, steps: int, on_cuda: bool, count: int = 8) -> str:
    """The kernels that took the most device time, per step: where a step's busy time goes."""
    top = sorted(events, key=lambda e: _busy_us(e, on_cuda), reverse=True)[:count]
    rows = [
        [e.key[:60], e.count / steps, _busy_us(e, on_cuda) / steps / 1e3] for e in top
    ]  # fmt: skip
    return f"Top kernels at {batch} sequences:\n\n" + markdown_table(
        ["kernel", "launches/step", "ms/step"], rows
    )


def bench_transformers(cfg: EngineBenchConfig) -> dict:
    """transformers generate on the same config (random weights), static batches, then freed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(write_model_dir(cfg))
    with torch.device(cfg.device):
        try:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.bfloat16)
    model.eval()
    vocab = cfg.model_config["vocab_size"]
    prompts = random_prompts(cfg.hf_prompts, cfg.input_len, vocab, cfg.seed + 4)

    def generate(model: torch.nn.Module, batch: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(batch, device=cfg.device)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    generate(model, prompts[:2], 4)  # warm-up
    _synchronize(cfg.device)
    started = time.perf_counter()
    for start in range(0, len(prompts), cfg.hf_batch_size):
        generate(model, prompts[start : start + cfg.hf_batch_size], cfg.output_len)
    _synchronize(cfg.device)
    seconds = time.perf_counter() - started
    del model
    gc.collect()
    if _is_cuda(cfg.device):
        torch.cuda.empty_cache()
    return rates(seconds, len(prompts) * cfg.input_len, len(prompts) * cfg.output_len)
