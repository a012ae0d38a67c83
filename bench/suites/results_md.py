"""Markdown of the benchmark report: machine, headline ratios, one section per benchmark.

Every figure comes from the `data` dict bench/suites/report.py measured (also saved as JSON); ratios
are always against a baseline measured in the same run."""

from __future__ import annotations

from bench.common.gpu_report import fmt, markdown_table

LATENCY_PERCENTILES = ("p50", "p90", "p99")


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def _pair(figure: str, measured: tuple[str, float], baseline: tuple[str, float], r: float) -> list:
    return [
        figure,
        f"{measured[0]} {fmt(measured[1])}",
        f"{baseline[0]} {fmt(baseline[1])}",
        ratio(r),
    ]


def headline_rows(data: dict) -> list[list]:
    """[figure, measured, baseline, ratio] rows: the table report.md and the README share."""
    rows = []
    offline = data.get("offline")
    if offline and offline.get("transformers_best"):
        ours, best = offline["ours"]["output_tok_s"], offline["transformers_best"]["output_tok_s"]
        rows.append(_pair("offline throughput, output tok/s", ("inferq", ours),
                          ("transformers generate", best), offline["throughput_ratio"]))  # fmt: skip
    queue = data.get("queue")
    if queue:
        queued, alone = queue["queue"]["output_tok_s"], queue["in_process"]["output_tok_s"]
        rows.append(_pair("queue path, output tok/s", ("Redis + worker", queued),
                          ("engine alone", alone), queue["throughput_ratio"]))  # fmt: skip
    serving = data.get("serving") or []
    top = max((r["rate"] for r in serving), default=None)
    at_top = {r["mode"]: r for r in serving if r["rate"] == top}
    if "http" in at_top and "engine" in at_top:
        for key, name in (("ttft_ms_p50", "TTFT p50"), ("itl_ms_p50", "ITL p50")):
            http, engine = at_top["http"][key], at_top["engine"][key]
            rows.append(_pair(f"serving {name} at {fmt(top)} req/s, ms", ("HTTP stack", http),
                              ("engine alone", engine), http / engine))  # fmt: skip
    prefix = data.get("prefix_cache")
    if prefix:
        for key, name, r in (
            ("output_token_throughput", "output tok/s", prefix["throughput_ratio"]),
            ("ttft_ms_p50", "TTFT p50 ms", prefix["ttft_p50_ratio"]),
        ):
            rows.append(_pair(f"shared system prompt, {name}", ("prefix cache on", prefix["on"][key]),
                              ("off", prefix["off"][key]), r))  # fmt: skip
    return rows


HEADLINE_HEADERS = ["figure", "measured", "baseline (same run)", "ratio"]


def _machine(data: dict) -> str:
    facts = data["machine"]
    table = markdown_table(["", ""], [[key, value] for key, value in facts.items()])
    note = data.get("machine_note")
    return table + (f"\n\n{note}" if note else "")


def _offline(data: dict) -> str:
    offline, w = data["offline"], data["sizes"]["offline"]
    rows = [["inferq `LLM.generate` (continuous batching)", *_rate_cells(offline["ours"]), "1.00x"]]
    best = offline.get("transformers_best")
    if best:
        rows.append([
            f"transformers `generate`, static batches of {best['batch_size']} (best tried)",
            *_rate_cells(best),
            ratio(best["output_tok_s"] / offline["ours"]["output_tok_s"]),
        ])  # fmt: skip
    return (
        f"{w['num_prompts']} random-token prompts, input ~{w['input_len']} and output "
        f"~{w['output_len']} tokens (lengths ±{w['range_ratio']:.0%}), greedy, `ignore_eos`; "
        "reuses `bench/engine/throughput.py`. The baseline is transformers' own `generate` on the same "
        f"weights, batch sizes {w['baseline_batch_sizes']} tried and the best kept.\n\n"
        + markdown_table(["path", "seconds", "output tok/s", "total tok/s", "vs inferq"], rows)
        + (
            f"\n\n**inferq / transformers: {ratio(offline['throughput_ratio'])}** output tokens/s."
            if best
            else ""
        )
    )


def _rate_cells(run: dict) -> list:
    return [f"{run['seconds']:.2f}", run["output_tok_s"], run["total_tok_s"]]


def _queue(data: dict) -> str:
    queue, w = data["queue"], data["sizes"]["queue"]
    lat = queue["chunk_latency_ms"]
    rows = [
        ["engine alone, `LLM.generate` in-process (baseline)", *_rate_cells(queue["in_process"])],
        ["Redis + 1 worker, streaming every token", *_rate_cells(queue["queue"])],
    ]
    return (
        f"{w['num_prompts']} prompts (input ~{w['input_len']}, output ~{w['output_len']}) enqueued "
        "at once into a fresh redis-server and served by one `inferq worker`, timed to the last "
        "final chunk a subscriber saw; alternated with the same requests in-process for "
        f"{w['repeats']} rounds, medians. Reuses `bench/system/queue_overhead.py`.\n\n"
        + markdown_table(["path", "seconds", "output tok/s", "total tok/s"], rows)
        + f"\n\n**queue / engine alone: {queue['throughput_ratio']:.3f}** output tokens/s. Chunk "
        f"delivery (engine step returned -> subscriber got the chunk) p50 {fmt(lat['p50'])} ms, "
        f"p99 {fmt(lat['p99'])} ms over {lat['chunks']} chunks."
    )


def _serving(data: dict) -> str:
    serving, w = data["serving"], data["sizes"]["serving"]
    headers = ["rate req/s", "path", "ok", "req/s", "out tok/s"]
    headers += [f"TTFT {p}" for p in LATENCY_PERCENTILES] + [
        f"ITL {p}" for p in LATENCY_PERCENTILES
    ]
    rows = []
    for r in sorted(serving, key=lambda r: (r["rate"], r["mode"] != "http")):
        path = "HTTP stack" if r["mode"] == "http" else "engine alone (baseline)"
        rows.append(
            [r["rate"], path, f"{r['completed']}/{r['completed'] + r['failed']}"]
            + [r["request_throughput"], r["output_token_throughput"]]
            + [r[f"ttft_ms_{p}"] for p in LATENCY_PERCENTILES]
            + [r[f"itl_ms_{p}"] for p in LATENCY_PERCENTILES]
        )
    return (
        f"At each rate, {w['num_prompts']} requests (input ~{w['input_len']}, output "
        f"~{w['output_len']} tokens, a fresh random workload per rate so no rate finds the one "
        "before in the prefix cache) arrive as a Poisson process. **HTTP stack**: a fresh "
        "redis-server, the API (uvicorn) and one worker; one streaming `POST /v1/completions` "
        "per request, every SSE chunk timed at the client. **Baseline**: the same requests at the "
        "same arrival times fed to an `engine.Engine` in the benchmark process (no Redis, no "
        "HTTP), timed at each engine step. TTFT is from send to first token; ITL the gaps between "
        "token chunks (one token per chunk). Latencies in ms. Reuses `bench/system/serve.py`.\n\n"
        + markdown_table(headers, rows)
        + "\n\n![throughput vs rate](serving_throughput.png)\n\n"
        + "![TTFT and ITL percentiles vs rate](serving_latency.png)"
    )


def _prefix(data: dict) -> str:
    prefix, w = data["prefix_cache"], data["sizes"]["prefix_cache"]
    headers = ["prefix caching", "seconds", "out tok/s", "TTFT p50", "TTFT p99", "hit rate"]
    headers.append("prompt tokens computed")
    rows = [
        [
            mode,
            f"{prefix[mode]['duration_s']:.2f}",
            prefix[mode]["output_token_throughput"],
            prefix[mode]["ttft_ms_p50"],
            prefix[mode]["ttft_ms_p99"],
            f"{prefix[mode]['hit_rate']:.0%}",
            int(prefix[mode]["prompt_tokens_computed"]),
        ]
        for mode in ("off", "on")
    ]
    return (
        f"{w['num_prompts']} requests share one random {w['prefix_len']}-token system prompt, "
        f"each followed by its own {w['suffix_len']} tokens, output {w['output_len']} tokens; all "
        "arrive at once into an in-process engine with prefix caching on, and into a second one "
        f"with it off (alternated for {w['repeats']} rounds, a fresh system prompt each round, "
        "medians). One untimed request per round shows each engine the system prompt first, as "
        "earlier traffic would in serving. `bench/engine/prefix_cache.py`.\n\n"
        + markdown_table(headers, rows)
        + f"\n\n**on / off: throughput {ratio(prefix['throughput_ratio'])}, TTFT p50 "
        f"{ratio(prefix['ttft_p50_ratio'])}** (below 1 is faster).\n\n"
        + "![prefix cache on vs off](prefix_cache.png)"
    )


def render_report(data: dict) -> str:
    """The generated block of report.md (without markers)."""
    parts = [
        f"_Generated by `python bench/suites/report.py {data['command_flags']}` on {data['date']} in "
        f"{data['duration_s'] / 60:.1f} min; figures in `report.json`. Every ratio compares two "
        "paths measured in this same run on this same machine._",
        "## Machine\n\n" + _machine(data),
        "## Headline\n\n" + markdown_table(HEADLINE_HEADERS, headline_rows(data)),
    ]
    if data.get("offline"):
        parts.append("## Offline throughput: inferq vs transformers\n\n" + _offline(data))
    if data.get("queue"):
        parts.append("## Queue overhead: Redis + worker vs the engine alone\n\n" + _queue(data))
    if data.get("offline") or data.get("queue"):
        parts.append("![offline throughput](offline_throughput.png)")
    if data.get("serving"):
        parts.append("## Serving latencies vs request rate\n\n" + _serving(data))
    if data.get("prefix_cache"):
        parts.append("## Prefix cache: shared system prompt\n\n" + _prefix(data))
    return "\n\n".join(parts)
