"""LoRA serving on the default model, same run: one mixed workload spread over N adapters (rank
16 on every attention and MLP projection, random PEFT adapters made here) against the same
workload on the base model alone (the issue's goal: >= 0.8x), and against serving each adapter
merged into the weights, one after the other (load time reported apart); memory per extra
adapter (its slot stacks, and its host copy). Base and mixed runs alternate for --rounds
(medians; the per-round ratios too), so a shared machine's load hits both alike.

    python bench/engine/lora.py --adapters 8 --num-prompts 64 --json lora.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.figures import rates
from bench.common.machine import describe_machine, machine_one_liner
from bench.common.workload import Request, ranged_workload, token_counts, tune_cpu_runtime
from bench.engine.throughput import greedy, warm_up
from schemas.defaults import DEFAULT_MODEL

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-range", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-range", type=int, nargs=2, default=(16, 96))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="base and mixed alternate")
    parser.add_argument("--skip-merged", action="store_true", help="no merged-weights run")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()
    runtime = tune_cpu_runtime(args.threads)
    from engine.model_files import resolve_model_path

    base_path = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as scratch:
        adapters = make_adapters(base_path, Path(scratch), args.adapters, args.rank, args.seed)
        figures = measure(args, base_path, adapters, Path(scratch))
    figures["runtime"] = runtime
    machine = describe_machine()
    print(f"# machine: {machine_one_liner(machine)}")
    print(f"# {runtime}")
    print(json.dumps(figures, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, **figures}, indent=1))


def make_adapters(base: Path, scratch: Path, count: int, rank: int, seed: int) -> list[Path]:
    """`count` PEFT adapters (random A and B, so every one changes the output) on `base`."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
    wrapped = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(count):
        with torch.no_grad():
            for name, param in wrapped.named_parameters():
                if "lora_" in name:
                    noise = torch.randn(param.shape, generator=generator)
                    param.copy_(noise * 0.5 / param.shape[-1] ** 0.5)
        path = scratch / f"adapter-{index}"
        wrapped.save_pretrained(path)
        out.append(path)
    return out


def measure(args: argparse.Namespace, base: Path, adapters: list[Path], scratch: Path) -> dict:
    from engine import LLM
    from engine.lora import LoRARequest

    common = {"dtype": args.dtype, "num_threads": args.threads, "seed": args.seed}
    plain = LLM(str(base), **common)
    warm_up(plain, args.seed)
    requests = ranged_workload(
        args.num_prompts,
        tuple(args.input_range),
        tuple(args.output_range),
        plain.engine.runner.vocab_size,
        args.seed,
    )
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(path)) for i, path in enumerate(adapters)] * (
        len(requests) // len(adapters) + 1
    )
    loras = loras[: len(requests)]
    prompt_tokens, output_tokens = token_counts(requests)
    served = LLM(
        str(base),
        enable_lora=True,
        max_loras=len(adapters),
        max_lora_rank=args.rank,
        **common,
    )
    warm_up(served, args.seed)
    timed(served, requests[: len(adapters)], loras[: len(adapters)])  # loads every adapter
    base_s, mixed_s = [], []
    for _ in range(args.rounds):  # alternating, so both see the same machine
        base_s.append(timed(plain, requests, None))
        mixed_s.append(timed(served, requests, loras))
    base_run = rates(statistics.median(base_s), prompt_tokens, output_tokens)
    mixed_run = rates(statistics.median(mixed_s), prompt_tokens, output_tokens)
    ratios = sorted(b / m for b, m in zip(base_s, mixed_s, strict=True))
    manager = served.engine.runner.lora
    assert manager is not None
    memory = {
        "slot_mib_per_adapter": manager.slot_bytes / manager.max_loras / 2**20,
        "host_mib_per_adapter": adapter_bytes(adapters[0]) / 2**20,
    }
    del served, plain

    figures = {
        "workload": (
            f"{len(requests)} requests over {len(adapters)} adapters (rank {args.rank}, "
            f"{', '.join(TARGETS)}), {prompt_tokens} prompt / {output_tokens} output tokens, greedy"
        ),
        "base": base_run,
        "mixed_lora": mixed_run,
        "mixed_vs_base": mixed_run["output_tok_s"] / base_run["output_tok_s"],
        "mixed_vs_base_per_round": ratios,
        "memory": memory,
    }
    if not args.skip_merged:
        figures["merged_one_after_another"] = merged_runs(
            args, base, adapters, requests, scratch, common
        )
        figures["mixed_vs_merged"] = (
            mixed_run["output_tok_s"] / figures["merged_one_after_another"]["output_tok_s"]
        )
    return figures


def timed(llm, requests: list[Request], loras) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    llm.generate(
        [r.prompt_token_ids for r in requests],
        [greedy(r.output_len) for r in requests],
        use_tqdm=False,
        lora_request=loras,
    )
    return time.perf_counter() - started


def merged_runs(  # type: ignore[no-untyped-def]
    args: argparse.Namespace, base: Path, adapters: list[Path], requests, scratch: Path, common
) -> dict:
    """Each adapter merged into the weights and served alone, one after the other, on its
    share of the workload: generation seconds summed, load (merge + save + engine) apart."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from engine import LLM

    generate_s = load_s = 0.0
    for index, adapter in enumerate(adapters):
        share = requests[index :: len(adapters)]
        started = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        merged = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
        folder = scratch / f"merged-{index}"
        merged.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (base / name).exists():
                shutil.copy(base / name, folder / name)
        llm = LLM(str(folder), **common)
        warm_up(llm, args.seed)
        load_s += time.perf_counter() - started
        generate_s += timed(llm, share, None)
        del llm, merged, model
        shutil.rmtree(folder)
    prompt_tokens, output_tokens = token_counts(requests)
    return {**rates(generate_s, prompt_tokens, output_tokens), "load_s": load_s}


def adapter_bytes(adapter: Path) -> int:
    """Bytes of an adapter's host copy: its tensors in float32, as the engine keeps them."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 (safe_open has no __iter__)
            total += 4 * math.prod(tensors.get_slice(key).get_shape())
    return total


if __name__ == "__main__":
    main()
