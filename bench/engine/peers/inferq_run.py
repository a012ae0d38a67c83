"""inferq as a peer of bench/engine/vs_vllm.py: `python inferq_run.py JOB.json`, started by the
bench under inferq's tuned CPU runtime (engine/platforms/cpu/runtime.py), timed by peer_timing
like every side."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root

from peer_timing import read_job, serve


def main() -> None:
    job = read_job(sys.argv)
    import torch

    from engine import LLM, SamplingParams
    from engine.platforms.cpu.runtime import describe_cpu_runtime

    started = time.perf_counter()
    llm = LLM(
        job["model"],
        dtype=job["dtype"],
        enable_prefix_caching=False,
        max_model_len=job["max_model_len"],
        kv_cache_memory=job["kv_cache_gib"] << 30,
        num_threads=job["threads"],
    )
    load_s = time.perf_counter() - started

    def generate(prompts: list[list[int]], output_lens: list[int]) -> int:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens
        ]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    info = {
        "system": "inferq",
        "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "runtime": describe_cpu_runtime(),
        "load_s": load_s,
    }
    serve(job, generate, info)


if __name__ == "__main__":
    main()
