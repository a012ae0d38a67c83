"""Beam search against independent samples, in one run on one machine.

    python bench/engine/beam_search.py --num-prompts 8 --input-len 256 --output-len 64 --width 4
    inferq bench beam_search -- --width 4

The same prompts run twice through one engine: as beam searches of width W
(`LLM.beam_search`, `ignore_eos`) and as W independent samples each (`n=W`, temperature 1,
`ignore_eos`). Reported per mode, medians of --repeats alternating rounds: requests per second,
generated tokens per second (W sequences' tokens per request), and the peak count of KV blocks
in use, read after every engine step. Beams share their prompt's blocks and copy a block only
where they diverge inside it, as samples of one request do, so the peaks should be close.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from engine import LLM, BeamSearchParams, SamplingParams
from engine.model_files import DEFAULT_MODEL
from engine.outputs import EngineRequest


def run_mode(llm: LLM, prompts: list[list[int]], mode: str, width: int, output_len: int) -> dict:
    """One pass over every prompt at once; seconds, tokens and the peak of blocks in use."""
    engine = llm.engine
    blocks = engine.scheduler.block_manager
    total = blocks.num_total_blocks
    if mode == "beam":
        params = BeamSearchParams(beam_width=width, max_tokens=output_len, ignore_eos=True)
        sampling = params.to_sampling_params()
    else:
        sampling = SamplingParams(n=width, temperature=1.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"{mode}-{index}-{started}", prompt, sampling))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, total - blocks.num_free_blocks)
    seconds = time.perf_counter() - started
    tokens = len(prompts) * width * output_len
    return {
        "requests_per_s": len(prompts) / seconds,
        "tokens_per_s": tokens / seconds,
        "peak_blocks": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False)
    rng = random.Random(args.seed)
    vocab = llm.engine.runner.vocab_size
    prompts = [
        [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)
    ]
    run_mode(llm, prompts[:1], "beam", args.width, 4)  # warm-up
    rounds: dict[str, list[dict]] = {"beam": [], "samples": []}
    for _ in range(args.repeats):
        for mode in rounds:
            rounds[mode].append(run_mode(llm, prompts, mode, args.width, args.output_len))
    print(
        f"# {args.num_prompts} prompts x {args.input_len} tokens, {args.output_len} new tokens "
        f"per sequence, width {args.width}, {args.dtype}, medians of {args.repeats} rounds"
    )
    print(f"{'mode':<10}{'requests/s':>12}{'tokens/s':>12}{'peak KV blocks':>16}")
    medians = {}
    for mode, samples in rounds.items():
        medians[mode] = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
        row = medians[mode]
        print(
            f"{mode:<10}{row['requests_per_s']:>12.2f}{row['tokens_per_s']:>12.1f}"
            f"{row['peak_blocks']:>16.0f}"
        )
    beam, samples = medians["beam"], medians["samples"]
    print(
        f"beam / samples: throughput {beam['tokens_per_s'] / samples['tokens_per_s']:.2f}x, "
        f"peak blocks {beam['peak_blocks'] / samples['peak_blocks']:.2f}x"
    )


if __name__ == "__main__":
    main()
