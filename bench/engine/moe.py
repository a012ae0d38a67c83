"""Mixture of experts: a MoE model against transformers and against a dense model with the same
active parameters, same run, same machine.

    python bench/engine/moe.py --threads 2

The MoE model is Qwen3-MoE-shaped where the engine serves Qwen3-MoE, else Qwen2-MoE-shaped
(its shared expert then counts in the active parameters), with dummy weights; the dense twin
is Qwen2/Qwen3 with intermediate_size = top_k * moe_intermediate_size (+ the shared expert's),
so its MLP reads as many weights per token as the MoE's active experts do. Figures: single-
stream decode ms/token (128-token prompt), mixed-workload throughput (greedy, ignore_eos), for
inferq's MoE, transformers' MoE (same config, its own random weights) and inferq's dense twin;
and the CPU expert computation alone, grouped GEMMs per active expert against one padded
batched GEMM, at several token counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.figures import print_row, rates
from bench.common.machine import describe_machine, machine_one_liner
from bench.common.workload import ranged_workload, token_counts, tune_cpu_runtime, workload_line
from bench.engine.throughput import (
    _hf_decode_ms,
    _hf_static_batches,
    engine_decode_ms,
    measure_inferq,
    warm_up,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=384)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    runtime = tune_cpu_runtime(args.threads)
    import torch

    dtype = getattr(torch, args.dtype)
    results: dict = {"machine": describe_machine(), "runtime": runtime}
    print(f"# machine: {machine_one_liner(results['machine'])}\n# {runtime}")
    results["experts_cpu"] = measure_expert_shapes(args, dtype)

    with tempfile.TemporaryDirectory() as scratch:
        moe_dir, dense_dir, family = write_configs(args, Path(scratch))
        results["family"] = family
        requests = ranged_workload(args.num_prompts, (32, 256), (16, 64), args.vocab, args.seed)
        print(workload_line(requests))
        prompt = ranged_workload(1, (128, 128), (1, 1), args.vocab, args.seed + 2)[0]
        for name, folder in (("moe", moe_dir), ("dense", dense_dir)):
            results[name] = measure_engine(folder, args, requests, prompt.prompt_token_ids)
            print_row(f"inferq {name}", results[name]["throughput"])
            print(f"inferq {name} decode: {results[name]['decode_ms_per_token']:.2f} ms/token")
        if not args.skip_transformers:
            results["transformers_moe"] = measure_transformers(
                moe_dir, dtype, requests, prompt.prompt_token_ids, args.decode_tokens
            )
            print_row("transformers moe, batch 8", results["transformers_moe"]["throughput"])
            print(
                f"transformers moe decode: {results['transformers_moe']['decode_ms_per_token']:.2f}"
            )
    summarize(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def write_configs(args: argparse.Namespace, scratch: Path) -> tuple[Path, Path, str]:
    import transformers as tf

    from engine.models import supported_architectures

    heads = args.hidden // 64
    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    experts = dict(
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        norm_topk_prob=True,
    )
    active = args.top_k * args.moe_intermediate
    if "Qwen3MoeForCausalLM" in supported_architectures():
        family = "qwen3_moe"
        moe = tf.Qwen3MoeConfig(**common, **experts, head_dim=64, intermediate_size=active)
        dense = tf.Qwen3Config(**common, head_dim=64, intermediate_size=active)
    else:
        family = "qwen2_moe"
        shared = args.moe_intermediate
        moe = tf.Qwen2MoeConfig(
            **common, **experts, shared_expert_intermediate_size=shared, intermediate_size=active
        )
        dense = tf.Qwen2Config(**common, intermediate_size=active + shared)
    moe.architectures = [type(moe).__name__.replace("Config", "ForCausalLM")]
    dense.architectures = [type(dense).__name__.replace("Config", "ForCausalLM")]
    moe.save_pretrained(scratch / "moe")
    dense.save_pretrained(scratch / "dense")
    return scratch / "moe", scratch / "dense", family


def measure_engine(folder: Path, args: argparse.Namespace, requests, prompt: list[int]) -> dict:
    import gc

    from engine import LLM
    from engine.quantization.methods import weight_bytes

    llm = LLM(
        str(folder),
        load_format="dummy",
        dtype=args.dtype,
        num_threads=args.threads,
        seed=args.seed,
    )
    warm_up(llm, args.seed)
    figures = {
        "weight_mib": weight_bytes(llm.engine.runner.model) / 2**20,
        "decode_ms_per_token": engine_decode_ms(llm, prompt, args.decode_tokens),
        "throughput": measure_inferq(llm, requests),
    }
    del llm
    gc.collect()
    return figures


def measure_transformers(folder: Path, dtype, requests, prompt: list[int], tokens: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    model.eval()
    prompt_tokens, output_tokens = token_counts(requests)
    seconds = _hf_static_batches(model, requests, 8)
    return {
        "decode_ms_per_token": _hf_decode_ms(model, prompt, tokens),
        "throughput": rates(seconds, prompt_tokens, output_tokens),
    }


def measure_expert_shapes(args: argparse.Namespace, dtype) -> dict:
    """One layer's experts: grouped GEMMs (what the layer runs) against the padded bmm."""
    import torch

    from engine.layers.moe import RouterSpec, Scoring, route
    from engine.layers.moe.compute import grouped_experts, padded_experts, plain_gemms

    generator = torch.Generator().manual_seed(args.seed)
    hidden, inter, count = args.hidden, args.moe_intermediate, args.experts
    w13 = (torch.randn(count, 2 * inter, hidden, generator=generator) * 0.02).to(dtype)
    w2 = (torch.randn(count, hidden, inter, generator=generator) * 0.02).to(dtype)
    spec = RouterSpec(count, args.top_k, Scoring.SOFTMAX_TOPK, True)
    gemms = plain_gemms(w13, w2)
    figures = {}
    for tokens in (1, 4, 16, 64, 256):
        x = torch.randn(tokens, hidden, generator=generator).to(dtype)
        weights, ids = route(torch.randn(tokens, count, generator=generator), spec)
        runs = {
            "grouped": lambda x=x, w=weights, i=ids: grouped_experts(x, w, i, count, *gemms),
            "padded": lambda x=x, w=weights, i=ids: padded_experts(x, w13, w2, w, i),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        with torch.inference_mode():
            for _ in range(5):  # interleaved, so a burst of load elsewhere hits both alike
                for name, run in runs.items():
                    started = time.perf_counter()
                    run()
                    times[name].append((time.perf_counter() - started) * 1e3)
        figures[tokens] = {name: statistics.median(t[1:]) for name, t in times.items()}
        row = figures[tokens]
        print(
            f"experts of one layer, {tokens:4d} tokens: grouped {row['grouped']:.2f} ms, "
            f"padded bmm {row['padded']:.2f} ms"
        )
    return figures


def summarize(results: dict) -> None:
    moe, dense = results["moe"], results["dense"]
    ratio = moe["decode_ms_per_token"] / dense["decode_ms_per_token"]
    results["moe_over_dense_decode"] = ratio
    results["moe_over_dense_throughput"] = (
        moe["throughput"]["output_tok_s"] / dense["throughput"]["output_tok_s"]
    )
    print(f"MoE decode step / dense step with equal active parameters: {ratio:.2f}x")
    print(f"MoE / dense output tok/s: {results['moe_over_dense_throughput']:.2f}")
    hf = results.get("transformers_moe")
    if hf is not None:
        results["vs_transformers_decode"] = moe["decode_ms_per_token"] / hf["decode_ms_per_token"]
        results["vs_transformers_throughput"] = (
            moe["throughput"]["output_tok_s"] / hf["throughput"]["output_tok_s"]
        )
        print(
            f"inferq / transformers MoE: decode ms {results['vs_transformers_decode']:.2f}x, "
            f"output tok/s {results['vs_transformers_throughput']:.2f}x"
        )


if __name__ == "__main__":
    main()
