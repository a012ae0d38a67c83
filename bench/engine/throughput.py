"""Offline throughput: inferq's LLM.generate vs transformers' generate, same workload, one run.

    python bench/engine/throughput.py --num-prompts 96 --input-len 160 --output-len 72 --range-ratio 0.8

Baseline: transformers with static left-padded batches (best of batch sizes 8 / 32 / all),
counting only the tokens each request asked for. Also single-stream decode ms/token
(128-token prompt, 256 new tokens) for both. Greedy, ignore_eos.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.figures import print_row, rates
from bench.common.workload import (
    Request,
    add_workload_args,
    load_llm,
    random_workload,
    token_counts,
    tune_cpu_runtime,
    workload_line,
    workload_series,
)
from bench.engine.tp_comm import CommunicationClock


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_workload_args(parser)
    parser.add_argument("--baseline-batch-sizes", default="8,32,all")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks of the replica; >1 also reports the driver's time in collectives per step",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    runtime = tune_cpu_runtime(args.threads)
    llm = load_llm(
        args, enforce_eager=args.enforce_eager, tensor_parallel_size=args.tensor_parallel_size
    )
    vocab = llm.engine.runner.vocab_size
    requests = workload_series(vars(args), vocab, args.seed)(0)
    print(workload_line(requests))
    print(f"# runtime: {runtime}")

    warm_up(llm, args.seed)
    comm = CommunicationClock.attach(llm)
    results = {"ours": measure_inferq(llm, requests)}
    print_row("inferq LLM.generate", results["ours"])
    if comm is not None:
        results["tensor_parallel"] = comm.report(args.tensor_parallel_size)

    hf_model = None
    if not args.skip_baseline or not args.skip_decode:
        hf_model = load_hf(llm.engine.model_path, llm.engine.runner.dtype)
    if not args.skip_baseline:
        best = measure_transformers(hf_model, requests, args.baseline_batch_sizes.split(","))
        results["transformers_best"] = best
        results["throughput_ratio"] = results["ours"]["output_tok_s"] / best["output_tok_s"]
        print(f"throughput ratio (inferq / best transformers): {results['throughput_ratio']:.2f}x")

    if not args.skip_decode:
        prompt = random_workload(1, 128, 1, 0.0, vocab, args.seed + 2)[0].prompt_token_ids
        ours_ms = engine_decode_ms(llm, prompt, args.decode_tokens)
        hf_ms = _hf_decode_ms(hf_model, prompt, args.decode_tokens)
        results["decode_ms_per_token"] = {
            "ours": ours_ms,
            "transformers": hf_ms,
            "ratio": ours_ms / hf_ms,
        }
        print(
            f"single-stream decode: inferq {ours_ms:.2f} ms/token, transformers {hf_ms:.2f} ms/token, "
            f"ratio {ours_ms / hf_ms:.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def greedy(output_len: int):
    """The benchmarks' sampling: greedy, exactly `output_len` tokens (ignore_eos)."""
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def warm_up(llm, seed: int) -> None:
    """A few small requests first, so one-time costs (allocations, lazy init) stay untimed."""
    warm = random_workload(4, 32, 8, 0.0, llm.engine.runner.vocab_size, seed + 1)
    llm.generate([r.prompt_token_ids for r in warm], greedy(8), use_tqdm=False)


def timed_generate(llm, requests: list[Request]) -> tuple[float, list[list[int]]]:
    """Seconds `LLM.generate` takes over the whole workload, and each request's output ids."""
    started = time.perf_counter()
    outputs = llm.generate(
        [r.prompt_token_ids for r in requests],
        [greedy(r.output_len) for r in requests],
        use_tqdm=False,
    )
    return time.perf_counter() - started, [o.outputs[0].token_ids for o in outputs]


def measure_inferq(llm, requests: list[Request]) -> dict:
    """Time `LLM.generate` over the whole workload; rates() of that run."""
    seconds, outputs = timed_generate(llm, requests)
    prompt_tokens, output_tokens = token_counts(requests)
    produced = sum(len(ids) for ids in outputs)
    assert produced == output_tokens, (produced, output_tokens)
    return rates(seconds, prompt_tokens, output_tokens)


def measure_transformers(hf_model, requests: list[Request], batch_labels: list[str]) -> dict:
    """transformers' generate in static batches of each size ("all": one batch); the best one,
    with its `batch_size`, is the baseline (the fairest showing of the baseline)."""
    prompt_tokens, output_tokens = token_counts(requests)
    best = None
    for label in batch_labels:
        size = len(requests) if label == "all" else int(label)
        seconds = _hf_static_batches(hf_model, requests, size)
        run = rates(seconds, prompt_tokens, output_tokens) | {"batch_size": size}
        print_row(f"transformers generate, batch {label}", run)
        if best is None or run["output_tok_s"] > best["output_tok_s"]:
            best = run
    return best


def load_hf(model_path: Path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()


def _hf_static_batches(model, requests: list[Request], batch_size: int) -> float:
    import torch

    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    started = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            n = len(request.prompt_token_ids)
            ids[row, width - n :] = torch.tensor(request.prompt_token_ids)
            mask[row, width - n :] = 1
        new_tokens = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - started


def _hf_decode_ms(model, prompt: list[int], new_tokens: int) -> float:
    import torch

    ids = torch.tensor([prompt])

    def run(n: int) -> float:
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - started

    run(4)
    one = statistics.median(run(1) for _ in range(3))
    full = statistics.median(run(new_tokens) for _ in range(2))
    return (full - one) / (new_tokens - 1) * 1000


def engine_decode_ms(llm, prompt: list[int], new_tokens: int) -> float:
    from engine.outputs import EngineRequest

    samples = []
    for attempt in range(2):
        engine = llm.engine
        engine.add_request(EngineRequest(f"decode-{attempt}", prompt, greedy(new_tokens)))
        stamps = []
        while engine.has_unfinished():
            if engine.step():
                stamps.append(time.perf_counter())
        samples.append((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000)
    return statistics.median(samples)


if __name__ == "__main__":
    main()
