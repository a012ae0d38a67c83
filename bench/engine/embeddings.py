"""Embedding throughput: our pooling engine (`LLM.embed`) against sentence-transformers'
`encode` at its best batch size, on the shipped MiniLM, same process, same CPU.

    python bench/engine/embeddings.py --num-sentences 4000 --threads 4

The corpus is deterministic random sentences of 4 to 60 words. Each side embeds the whole
corpus --repeats times (medians reported); sentence-transformers is tried once at every
--st-batch-sizes and its fastest is the baseline. Our vectors are checked against its own
(the largest cosine distance is printed); after picking its best batch size the two sides
alternate round by round. Peak RSS is the process's (both sides share it). Numbers from a
shared machine are "measured under load": say so when quoting them.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*, engine, ...

from bench.common.machine import describe_machine, machine_one_liner

WORDS = [
    "queue",
    "worker",
    "vector",
    "search",
    "index",
    "model",
    "token",
    "batch",
    "stream",
    "result",
    "embed",
    "sentence",
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "fast",
    "slow",
    "large",
    "small",
    "every",
    "each",
    "system",
    "memory",
    "engine",
    "request",
    "line",
    "file",
    "bulk",
    "scale",
    "redis",
    "cluster",
    "latency",
    "throughput",
]


def corpus(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 60))) + "." for _ in range(count)]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_runs(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--num-sentences", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (both sides)")
    parser.add_argument("--st-batch-sizes", default="16,32,64,128")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from engine.model_files import resolve_model_path

    path = resolve_model_path(args.model)
    texts = corpus(args.num_sentences)
    report: dict[str, object] = {
        "machine": machine_one_liner(describe_machine()),
        "threads": torch.get_num_threads(),
        "sentences": len(texts),
    }
    from sentence_transformers import SentenceTransformer

    from engine import LLM

    llm = LLM(str(path), max_num_batched_tokens=args.max_num_batched_tokens)
    st = SentenceTransformer(str(path), device="cpu")
    llm.embed(texts[:64], use_tqdm=False)  # warm-up
    st.encode(texts[:64])
    vectors: dict[str, torch.Tensor] = {}

    def ours() -> None:
        outputs = llm.embed(texts, use_tqdm=False)
        vectors["ours"] = torch.tensor([o.outputs.embedding for o in outputs])

    def encode(batch_size: int) -> None:
        vectors["st"] = torch.from_numpy(st.encode(texts, batch_size=batch_size))

    # sentence-transformers' best batch size, one pass each; then both sides alternate round
    # by round, so a change in the machine's load hits both alike.
    by_batch = {
        size: len(texts) / time_runs(lambda size=size: encode(size), 1)
        for size in (int(b) for b in args.st_batch_sizes.split(","))
    }
    best = max(by_batch, key=by_batch.__getitem__)
    ours_times, st_times = [], []
    for _ in range(args.repeats):
        ours_times.append(time_runs(ours, 1))
        st_times.append(time_runs(lambda: encode(best), 1))
    ours_rate = len(texts) / statistics.median(ours_times)
    st_rate = len(texts) / statistics.median(st_times)
    distance = 1 - torch.nn.functional.cosine_similarity(vectors["ours"], vectors["st"])
    report.update(
        ours_sentences_per_s=ours_rate,
        st_sentences_per_s_by_batch_size=by_batch,
        st_best_batch_size=best,
        st_sentences_per_s=st_rate,
        speedup=ours_rate / st_rate,
        max_cosine_distance=distance.max().item(),
        peak_rss_mib=peak_rss_mib(),
    )
    print(json.dumps(report, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
