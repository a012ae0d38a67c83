"""vLLM as a peer of bench/engine/vs_vllm.py: `VENV/bin/python vllm_run.py JOB.json`, run by the vLLM
venv's own python (the project never imports vllm), started by the bench with vLLM's documented
CPU tuning in its environment, timed by peer_timing like every side."""

from __future__ import annotations

import os
import sys
import time

from peer_timing import read_job, serve


def main() -> None:
    job = read_job(sys.argv)
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=job["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
    )
    load_s = time.perf_counter() - started

    def generate(prompts: list[list[int]], output_lens: list[int]) -> int:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    info = {
        "system": f"vLLM {vllm.__version__}",
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "-"),
        "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "-"),
        "load_s": load_s,
    }
    serve(job, generate, info)


if __name__ == "__main__":
    main()
