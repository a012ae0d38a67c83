"""Speculative decoding (n-gram prompt lookup) on vs off, in one run on one machine.

    python bench/engine/speculative.py --output-len 64 --batch-sizes 1 4 16 --repeats 3
    inferq bench speculative -- --output-len 64

Two workloads: "repetitive" (rewrite a given text, and code with one change: the answer
repeats the prompt; greedy) and "random" (random token prompts, seeded sampling at temperature
1: lookups rarely pay, so the auto-off must keep the cost small). For each batch size, both
engines (same weights, one with speculative_config ngram and its default auto-off) generate
the same --output-len tokens (ignore_eos) for that many prompts at once, alternating for --repeats rounds; medians of
decode ms per output token (per sequence) and output tokens per second are reported, with the
on/off ratio, the acceptance rate and the mean accepted length of the speculating engine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from engine import LLM, SamplingParams

TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. Visitors may "
    "borrow up to five books at a time for three weeks. Laptops can be used in the reading room "
    "on the second floor, where the power outlets are next to the windows. Please keep your "
    "phone silent and return the books to the desk at the entrance when you leave."
)
CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal += item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)
REPETITIVE = [
    f"Rewrite the following text exactly, word for word.\n\nText: {TEXT}\n\nRewritten text: ",
    "Rename the function total_price to order_total and repeat the whole code.\n\n"
    f"{CODE}\nRenamed code:\n",
]


def repetitive_prompts(count: int) -> list[str]:
    return [REPETITIVE[i % len(REPETITIVE)] for i in range(count)]


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def workload_params(workload: str, count: int, output_len: int) -> list[SamplingParams]:
    """Greedy for the repetitive workload. Random prompts are sampled (seeded, so both engines
    make the same tokens): greedy continuations of random tokens fall into loops that the
    lookup predicts perfectly, which is not the case this workload stands for."""
    if workload == "repetitive":
        return [SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)] * count
    return [
        SamplingParams(temperature=1.0, seed=i, max_tokens=output_len, ignore_eos=True)
        for i in range(count)
    ]


def timed_round(llm: LLM, prompts: list, params: list[SamplingParams]) -> dict[str, float]:
    before = llm.engine.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    drafts = after.spec_num_drafts - before.spec_num_drafts
    return {
        "ms_per_token": 1000 * elapsed / (tokens / len(prompts)),
        "tokens_per_s": tokens / elapsed,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": accepted / drafts if drafts else 0.0,
        "draft_tokens": drafted,
    }


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="the auto-off batch size to measure (default: the engine's; 0: never off)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()

    spec: dict[str, object] = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
    }
    if args.disable_by_batch_size is not None:
        spec["disable_by_batch_size"] = args.disable_by_batch_size or None
    engines = {
        "off": LLM(args.model, dtype=args.dtype),
        "ngram": LLM(args.model, dtype=args.dtype, speculative_config=spec),
    }
    vocab_size = engines["off"].engine.vocab_size
    rows = []
    print(
        "workload    batch  off ms/tok  ngram ms/tok  speedup  off tok/s  ngram tok/s  accept  mean len"
    )
    for workload in ("repetitive", "random"):
        for batch in args.batch_sizes:
            prompts: list = (
                repetitive_prompts(batch)
                if workload == "repetitive"
                else random_prompts(batch, args.random_input_len, vocab_size, seed=batch)
            )
            for llm in engines.values():  # warm-up: prefix cache and first-step costs alike
                timed_round(llm, prompts, workload_params(workload, batch, 4))
            rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in engines}
            for _ in range(args.repeats):
                for mode, llm in engines.items():
                    params = workload_params(workload, batch, args.output_len)
                    rounds[mode].append(timed_round(llm, prompts, params))
            off, on = median_of(rounds["off"]), median_of(rounds["ngram"])
            row = {"workload": workload, "batch": batch, "off": off, "ngram": on}
            rows.append(row)
            print(
                f"{workload:<11} {batch:>5}  {off['ms_per_token']:>10.1f}  "
                f"{on['ms_per_token']:>12.1f}  {off['ms_per_token'] / on['ms_per_token']:>6.2f}x  "
                f"{off['tokens_per_s']:>9.1f}  {on['tokens_per_s']:>11.1f}  "
                f"{on['acceptance_rate']:>6.2f}  {on['mean_accepted_length']:>8.2f}  "
                f"{on['draft_tokens']:>7.0f}"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
