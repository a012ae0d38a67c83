"""CPU matmul backends of the linear layers (engine/platforms/cpu/matmul.py), side by side.

    python bench/micro/cpu_matmul.py [--model SmolLM2-135M-Instruct] [--rows 1,4,16,96,512] [--threads 2]
        [--dtype float32|bfloat16]

Runs every linear layer of the model's shape once per "forward" (distinct weights per layer,
so they stream from memory as in a real step instead of sitting in cache) at several row
counts M (decode batch sizes, then prefill-sized), and prints ms per forward, achieved GB/s
and GFLOP/s for each backend this CPU and torch build run, and each one's speed-up over torch's
default (aten). The engine itself picks per machine by a short measurement of the same kind at
start-up (engine/platforms/cpu/matmul_tuning.py); this is the long version, for reading.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.workload import tune_cpu_runtime
from schemas.defaults import DEFAULT_MODEL


def layer_shapes(hf_config) -> list[tuple[int, int]]:
    """(out, in) of each linear layer of one decoder layer, fused as our models fuse them."""
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    return [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inter, hidden),
        (hidden, inter),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rows", default="1,4,16,96,512")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    runtime = tune_cpu_runtime(args.threads)

    import torch
    from transformers import AutoConfig

    from engine.model_files import resolve_model_path
    from engine.platforms.cpu.matmul import available_backends, pack, run, uniform

    hf_config = AutoConfig.from_pretrained(str(resolve_model_path(args.model)))
    shapes = layer_shapes(hf_config) * hf_config.num_hidden_layers
    shapes.append((hf_config.vocab_size, hf_config.hidden_size))  # lm_head
    generator = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    weights = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    params = sum(w.numel() for w in weights)
    print(f"# {args.model}: {len(weights)} linear layers, {weight_bytes / 1e6:.0f} MB {args.dtype}")
    print(f"# {runtime}")

    backends = available_backends(dtype)
    packed = {name: [pack(w, uniform(name)) for w in weights] for name in backends}
    print(f"{'M':>5} {'backend':<20} {'ms/forward':>10} {'GB/s':>7} {'GFLOP/s':>8}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {
            k: torch.randn(rows, k, generator=generator).to(dtype) for k in {s[1] for s in shapes}
        }
        times = {}
        for name in backends:

            def forward(name=name, inputs=inputs) -> None:
                for weight, packs in zip(weights, packed[name], strict=True):
                    run(name, inputs[weight.shape[1]], weight, None, packs)

            forward()
            samples = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                forward()
                samples.append(time.perf_counter() - started)
            seconds = statistics.median(samples)
            times[name] = seconds
            print(
                f"{rows:>5} {name:<20} {seconds * 1e3:>10.1f} {weight_bytes / seconds / 1e9:>7.1f}"
                f" {2 * rows * params / seconds / 1e9:>8.0f}"
            )
        speedups = ", ".join(f"{name} {times['aten'] / t:.2f}x" for name, t in times.items())
        print(f"{rows:>5} speed-up over aten: {speedups}")


if __name__ == "__main__":
    main()
