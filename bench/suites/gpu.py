"""GPU benchmark: attention kernels, batch-1 decode and offline throughput, as markdown tables.

    python bench/suites/gpu.py                       # all parts, Llama-3-8B shapes, H100 defaults
    python bench/suites/gpu.py --parts a --out results.md
    python bench/suites/gpu.py --parts b,c --num-prompts 200 --hf-prompts 32

(a) unified_attention vs torch SDPA on pre-gathered K/V (decode and prefill shapes); needs
    only torch + triton. (b) batch-1 decode ms/token of a dummy-weight Llama-3-8B through
    `engine.LLM` vs the weight-bandwidth floor. (c) offline throughput of the same model vs
    transformers' generate and the compute roofline. (d) the GPU's idle share of decode steps.
    (e) steps mixing a prefill with decodes, piecewise CUDA graphs on and off. (f) batch-1
    decode and offline throughput of the same model with fp8 weights (quantized at load;
    w8a8-fp8 through torch._scaled_mm where it measures faster), against (b) and (c). (b)-(f)
    and (a)'s table of the engine's chosen prefill path need the engine's deps.
"""

from __future__ import annotations

import argparse
import gc
import logging
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.gpu_report import (
    H100_BF16_PEAK_FLOPS,
    LLAMA3_8B_CONFIG,
    parse_int_list,
    parse_prefill_shapes,
)

logger = logging.getLogger("bench.gpu")
PARTS = ("a", "b", "c", "d", "e", "f")
C = TypeVar("C")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--parts",
        default="a,b,c,d,e,f",
        help="comma list of a (attention), b (decode), c (throughput), d (step overhead), "
        "e (steps with prefills, piecewise graphs on and off), f (fp8 decode and throughput)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="append the results as a markdown section"
    )
    attention = parser.add_argument_group("(a) attention kernel")
    attention.add_argument("--decode-batches", default="1,4,16,64,256")
    attention.add_argument("--decode-contexts", default="1024,2048,4096,8192")
    attention.add_argument("--prefill-shapes", default="1x512,1x2048,4x1024,1x8192,1x512+4096",
                           help="BATCHxNEW_TOKENS[+CACHED_CONTEXT], comma separated")  # fmt: skip
    attention.add_argument("--num-q-heads", type=int, default=32)
    attention.add_argument("--num-kv-heads", type=int, default=8)
    attention.add_argument("--head-dim", type=int, default=128)
    attention.add_argument("--block-size", type=int, default=16)
    attention.add_argument(
        "--max-gib", type=float, default=40.0, help="skip shapes needing more K/V memory"
    )
    engine = parser.add_argument_group("(b)/(c) engine on a dummy-weight Llama-3-8B")
    engine.add_argument("--decode-prompt-len", type=int, default=128)
    engine.add_argument("--decode-tokens", type=int, default=128)
    engine.add_argument("--num-prompts", type=int, default=1000)
    engine.add_argument("--input-len", type=int, default=1024)
    engine.add_argument("--output-len", type=int, default=128)
    engine.add_argument(
        "--hf-prompts", type=int, default=64, help="prompts for the transformers baseline (0: skip)"
    )
    engine.add_argument("--hf-batch-size", type=int, default=64)
    engine.add_argument(
        "--peak-flops", type=float, default=H100_BF16_PEAK_FLOPS, help="peak bf16 FLOP/s"
    )
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=8192)
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument(
        "--step-batches", default="1,64,256", help="(d) sequences per decode-heavy run"
    )
    engine.add_argument(
        "--fp8-prompts",
        type=int,
        default=None,
        help="(e) prompts of the fp8 throughput run (default: --num-prompts, the same workload)",
    )
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument(
        "--modes",
        default="sync,async",
        help="(b)/(c)/(d) scheduling modes to run, each on the same loaded model: sync, async",
    )
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in ("sync", "async") for m in args.modes):
        parser.error(f"--modes takes sync and/or async, not {args.modes}")
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    try:
        args.decode_batches = parse_int_list(args.decode_batches)
        args.decode_contexts = parse_int_list(args.decode_contexts)
        args.prefill_shapes = parse_prefill_shapes(args.prefill_shapes)
        args.step_batches = parse_int_list(args.step_batches)
    except ValueError as error:
        parser.error(str(error))
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2 (ms/token subtracts a 1-token run)")
    return args


def render_section(title: str, blocks: list[tuple[str, str]]) -> str:
    """'## title' followed by '### name' + body for every block."""
    parts = [f"## {title}", ""]
    for name, body in blocks:
        parts += [f"### {name}", "", body, ""]
    return "\n".join(parts)


def _environment_line() -> str:
    import torch

    versions = [f"torch {torch.__version__}"]
    for module in ("triton", "transformers"):
        try:
            versions.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            versions.append(f"{module} missing")
    device = torch.cuda.get_device_name()
    return f"{device}, {', '.join(versions)}, Python {platform.python_version()}"


def config_from_flags(config: type[C], args: argparse.Namespace, **given: Any) -> C:
    """A bench config: the fields in `given`, the others from the flag of the same name where
    there is one, else the field's default (e.g. `device`)."""
    flags = vars(args)
    from_flags = {f.name: flags[f.name] for f in fields(config) if f.name in flags}
    return config(**{**from_flags, **given})


class _PrintedBlocks(list[tuple[str, str]]):
    """A part's tables, each printed as soon as it is measured: a run stopped at the lease's
    limit still leaves the tables it finished in the log."""

    def append(self, block: tuple[str, str]) -> None:
        print(f"### {block[0]}\n\n{block[1]}\n", flush=True)
        super().append(block)

    def __iadd__(self, more):  # type: ignore[override]
        for block in more:
            self.append(block)
        return self


def _guarded(title: str, part: Callable[[], str]) -> str:
    """A part's table, or the error that stopped it: one failing part must not cost a GPU
    loan the other parts' figures."""
    try:
        return part()
    except Exception as error:
        logger.exception("%s failed", title)
        return f"Failed: `{type(error).__name__}: {error}` (traceback in the log)."


def _run_attention(args: argparse.Namespace) -> list[tuple[str, str]]:
    from bench.micro.gpu_attention import (
        CHOSEN_PREFILL_SHAPES,
        AttentionBenchConfig,
        bench_chosen_prefill,
        bench_decode,
        bench_prefill,
    )

    cfg = config_from_flags(AttentionBenchConfig, args)
    blocks = _PrintedBlocks()
    if cfg.decode_batches and cfg.decode_contexts:
        blocks.append(("(a) attention kernel: decode", bench_decode(cfg)))
    if cfg.prefill_shapes:
        blocks.append(("(a) attention kernel: prefill", bench_prefill(cfg)))
    try:
        import engine  # noqa: F401  (pydantic and the rest of the engine's deps)
    except ImportError as error:
        logger.info("chosen prefill path skipped: %s", error)
    else:
        shapes = parse_prefill_shapes(CHOSEN_PREFILL_SHAPES)
        title = "(a) prefill: chosen path vs SDPA"
        blocks.append((title, _guarded(title, lambda: bench_chosen_prefill(cfg, shapes))))
    return blocks


def _run_engine(args: argparse.Namespace, parts: list[str]) -> list[tuple[str, str]]:
    from bench.engine import gpu_engine

    with tempfile.TemporaryDirectory(prefix="inferq-llama3-8b-") as folder:
        cfg = config_from_flags(
            gpu_engine.EngineBenchConfig,
            args,
            model_config=dict(LLAMA3_8B_CONFIG),
            model_dir=Path(folder),
        )
        # The baseline runs first and frees its weights: both models at once would not fit.
        hf_rates = None
        if "c" in parts and args.hf_prompts > 0:
            logger.info("transformers baseline: %d prompts", args.hf_prompts)
            hf_rates = gpu_engine.bench_transformers(cfg)
        logger.info("building the engine (dummy Llama-3-8B weights)")
        llm = gpu_engine.make_llm(cfg)
        blocks = _PrintedBlocks()
        for index, mode in enumerate(args.modes):  # asynchronous against synchronous steps
            llm.engine.set_async_scheduling(mode == "async")
            label = f", {mode} scheduling"
            # Each mode draws its own prompts: the same prompts again would hit the prefix
            # cache the previous mode filled and skip their prefills.
            mode_cfg = replace(cfg, seed=cfg.seed + 100 * index)
            if "b" in parts:
                decode = gpu_engine.bench_decode(mode_cfg, llm)
                blocks.append((f"(b) batch-1 decode vs bandwidth floor{label}", decode))
            if "c" in parts:
                throughput = gpu_engine.bench_throughput(mode_cfg, llm, hf_rates)
                blocks.append((f"(c) offline throughput{label}", throughput))
            if "d" in parts:
                overhead = gpu_engine.bench_step_overhead(mode_cfg, llm, args.step_batches)
                blocks.append((f"(d) time outside the GPU per step{label}", overhead))
        if "e" in parts:
            from bench.engine.gpu_piecewise import bench_piecewise

            llm.engine.set_async_scheduling(False)
            title = "(e) steps with prefills: piecewise graphs"
            blocks.append((title, _guarded(title, lambda: bench_piecewise(cfg, llm))))
        if "f" in parts:
            # One engine at a time: the bf16 one's KV cache takes most of the memory.
            import torch

            del llm
            gc.collect()
            torch.cuda.empty_cache()
            try:
                blocks += _run_fp8(cfg, args)
            except Exception as error:  # one failing part must not cost the others' figures
                logger.exception("(f) fp8 weights failed")
                blocks.append(("(f) fp8 weights", f"Failed: `{type(error).__name__}: {error}`."))
        return blocks


def _run_fp8(cfg: Any, args: argparse.Namespace) -> list[tuple[str, str]]:
    from bench.engine import gpu_engine

    prompts = args.num_prompts if args.fp8_prompts is None else args.fp8_prompts
    fp8 = replace(cfg, quantization="fp8", num_prompts=prompts)
    logger.info("building the engine with fp8 weights")
    llm = gpu_engine.make_llm(fp8)
    llm.engine.set_async_scheduling("async" in args.modes)
    return [
        ("(f) fp8 weights: batch-1 decode", gpu_engine.bench_decode(fp8, llm)),
        ("(f) fp8 weights: offline throughput", gpu_engine.bench_throughput(fp8, llm, None)),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        import torch
    except ImportError:
        print("bench/suites/gpu.py needs torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/suites/gpu.py needs a CUDA GPU; none is visible (torch.cuda.is_available() is False)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench/suites/gpu.py needs triton (pip install 'triton>=3.1')", file=sys.stderr)
        return 2

    blocks = []
    if "a" in args.parts:
        blocks += _run_attention(args)
    engine_parts = [p for p in args.parts if p in ("b", "c", "d", "e", "f")]
    if engine_parts:
        try:
            import engine  # noqa: F401  (pydantic and the rest of the engine's deps)
        except ImportError as error:
            print(f"parts b/c need the engine's dependencies: {error}", file=sys.stderr)
            return 2
        blocks += _run_engine(args, engine_parts)

    title = f"GPU bench {time.strftime('%Y-%m-%d %H:%M')}: {_environment_line()}"
    section = render_section(title, blocks)
    print(section)
    if args.out:
        with args.out.open("a") as handle:
            handle.write(section + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
