"""CPU matmul paths for the linear layers: torch's default (MKL sgemm) vs oneDNN, same run.

    python bench/cpu_matmul.py [--model SmolLM2-135M-Instruct] [--rows 1,4,16,96,512] [--threads 2]

Runs every linear layer of the model's shape once per "forward" (distinct weights per layer,
so they stream from memory as in a real step instead of sitting in cache) at several row
counts M (decode batch sizes, then prefill-sized), and prints ms per forward, achieved GB/s
and GFLOP/s for both paths and their ratio. engine/layers/linear.py picks the path from this.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workload import tune_cpu_runtime

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
    args = parser.parse_args()
    runtime = tune_cpu_runtime(args.threads)

    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig

    from engine.model_files import resolve_model_path

    hf_config = AutoConfig.from_pretrained(str(resolve_model_path(args.model)))
    shapes = layer_shapes(hf_config) * hf_config.num_hidden_layers
    shapes.append((hf_config.vocab_size, hf_config.hidden_size))  # lm_head
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) for shape in shapes]
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    params = sum(w.numel() for w in weights)
    print(f"# {args.model}: {len(weights)} linear layers, {weight_bytes / 1e6:.0f} MB fp32")
    print(f"# {runtime}")

    paths = {
        "torch default (MKL)": lambda x, w: F.linear(x, w),
        "oneDNN": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
    }
    print(f"{'M':>5} {'path':<20} {'ms/forward':>10} {'GB/s':>7} {'GFLOP/s':>8}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=generator) for k in {s[1] for s in shapes}}
        times = {}
        for name, matmul in paths.items():

            def forward(matmul=matmul, inputs=inputs) -> None:
                for weight in weights:
                    matmul(inputs[weight.shape[1]], weight)

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
        ratio = times["torch default (MKL)"] / times["oneDNN"]
        print(f"{rows:>5} {'speed-up of oneDNN':<20} {ratio:>10.2f}x")


if __name__ == "__main__":
    main()
