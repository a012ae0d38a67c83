"""CPU matmul kernels for quantized and dense weights (kernels/quant_ops.py) against torch's.

    python bench/micro/quant_matmul.py [--model SmolLM2-135M-Instruct] [--rows 1,4,16,64,256,2048]
        [--formats fp32,onednn,dense,int8,int4g32,int4g64] [--threads 2] [--repeats 5]
        [--gemm-min-rows N]

One "forward" runs every linear layer of the model once (distinct weights per layer plus
lm_head, so they stream from memory as in a real step instead of sitting in cache) at each row
count M; prints the median ms per forward, the GB/s of weight bytes that implies, and each
format's speed-up over fp32 F.linear. Formats:

- fp32: F.linear on the plain fp32 weight (MKL).
- onednn: oneDNN's linear on a weight packed once (what engine.platforms.cpu.matmul calls onednn_packed).
- dense: kernels.quant_ops.dense_matmul on the plain fp32 weight.
- int8: per-output-channel int8 (quantize_int8); int4gG: int4 with groups of G inputs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.workload import tune_cpu_runtime
from bench.micro.cpu_matmul import layer_shapes
from schemas.defaults import DEFAULT_MODEL

FORMATS = ("fp32", "onednn", "dense", "int8", "int4g32", "int4g64")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--rows", default="1,4,16,64,256,2048")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gemm-min-rows", type=int, default=None)
    args = parser.parse_args()
    runtime = tune_cpu_runtime(args.threads)

    import torch
    from transformers import AutoConfig

    from engine.model_files import resolve_model_path
    from engine.quantization.weights import QuantizedWeight, quantize_int4, quantize_int8
    from kernels.quant_ops import (
        QUANT_GEMM_MIN_ROWS,
        cpu_kernels_available,
        dense_matmul,
        quant_matmul,
    )

    if not cpu_kernels_available():
        sys.exit("the CPU kernels could not be built here")
    gemm_min_rows = args.gemm_min_rows or QUANT_GEMM_MIN_ROWS
    hf_config = AutoConfig.from_pretrained(str(resolve_model_path(args.model)))
    shapes = layer_shapes(hf_config) * hf_config.num_hidden_layers
    shapes.append((hf_config.vocab_size, hf_config.hidden_size))  # lm_head
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) / shape[1] ** 0.5 for shape in shapes]
    params = sum(w.numel() for w in weights)
    formats = args.formats.split(",")

    def quantized(make: Callable[[torch.Tensor], QuantizedWeight]) -> list[QuantizedWeight]:
        return [make(w) for w in weights]

    def linear_of(name: str) -> tuple[list[Callable[[torch.Tensor], torch.Tensor]], int]:
        """One callable per layer for this format, and the weight bytes a forward streams."""
        if name == "fp32":
            return [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights], params * 4
        if name == "onednn":
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 128) for w in weights]
            calls = [
                lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                for p in packed
            ]
            return calls, params * 4
        if name == "dense":
            return [lambda x, w=w: dense_matmul(x, w) for w in weights], params * 4
        if name == "int8":
            qs = quantized(quantize_int8)
        elif name.startswith("int4g"):
            group = int(name.removeprefix("int4g"))
            qs = quantized(lambda w: quantize_int4(w, group))
        else:
            raise SystemExit(f"unknown format {name}")
        calls = [
            lambda x, q=q: quant_matmul(
                x, q.data, q.scales, q.mins, q.bits, q.group_size, None, gemm_min_rows
            )
            for q in qs
        ]
        return calls, sum(q.nbytes() for q in qs)

    print(f"# {args.model}: {len(weights)} linear layers, {params / 1e6:.1f} M parameters")
    print(f"# {runtime}; quant GEMM path from {gemm_min_rows} rows")
    print(f"{'M':>5} {'format':<9} {'MB':>6} {'ms/forward':>10} {'GB/s':>6} {'vs fp32':>8}")
    layers = {name: linear_of(name) for name in formats}
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {
            k: torch.randn(rows, k, generator=generator) for k in {shape[1] for shape in shapes}
        }
        repeats = args.repeats if rows <= 256 else max(2, args.repeats // 2)
        samples: dict[str, list[float]] = {name: [] for name in formats}
        for name in formats:  # warm-up: first calls allocate and build oneDNN primitives
            for call, weight in zip(layers[name][0], weights, strict=True):
                call(inputs[weight.shape[1]])
        for _ in range(repeats):  # formats alternate, so a noisy neighbour hits them alike
            for name in formats:
                started = time.perf_counter()
                for call, weight in zip(layers[name][0], weights, strict=True):
                    call(inputs[weight.shape[1]])
                samples[name].append(time.perf_counter() - started)
        baseline = statistics.median(samples[formats[0]])
        for name in formats:
            seconds = statistics.median(samples[name])
            weight_bytes = layers[name][1]
            print(
                f"{rows:>5} {name:<9} {weight_bytes / 1e6:>6.0f} {seconds * 1e3:>10.2f}"
                f" {weight_bytes / seconds / 1e9:>6.1f} {baseline / seconds:>7.2f}x"
            )


if __name__ == "__main__":
    main()
