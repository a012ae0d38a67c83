"""PNG plots of the benchmark report (matplotlib, headless). Each measured line is drawn beside
its baseline from the same run: the HTTP stack beside the in-process engine at the same
arrivals, prefix caching on beside off, inferq beside transformers."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and in CI
import matplotlib.pyplot as plt

STACK = "Redis + API + worker (HTTP)"
BASELINE = "engine in-process, same arrivals (baseline)"
PERCENTILE_COLOURS = {"p50": "tab:blue", "p90": "tab:orange", "p99": "tab:red"}


def _by_mode(serving: list[dict], mode: str) -> list[dict]:
    return sorted((r for r in serving if r["mode"] == mode), key=lambda r: r["rate"])


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_serving_throughput(
    serving: list[dict], path: Path, mean_output_tokens: float | None = None
) -> Path:
    """Output tokens/s vs request rate, stack beside baseline (and the offered load)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, label, style in (("http", STACK, "o-"), ("engine", BASELINE, "s--")):
        runs = _by_mode(serving, mode)
        if runs:
            ax.plot(
                [r["rate"] for r in runs],
                [r["output_token_throughput"] for r in runs],
                style,
                label=label,
            )
    if mean_output_tokens:
        rates = sorted({r["rate"] for r in serving})
        ax.plot(
            rates, [rate * mean_output_tokens for rate in rates], ":", c="grey", label="offered"
        )
    ax.set_xlabel("request rate (req/s, Poisson arrivals)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Serving throughput vs request rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_serving_latency(serving: list[dict], path: Path) -> Path:
    """TTFT and ITL p50/p90/p99 vs rate: solid the stack, dashed the in-process baseline."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, title in zip(
        axes, ("ttft", "itl"), ("Time to first token", "Inter-token latency"), strict=True
    ):
        for mode, style, suffix in (("http", "o-", "stack"), ("engine", "s--", "baseline")):
            runs = _by_mode(serving, mode)
            for pct, colour in PERCENTILE_COLOURS.items():
                if runs:
                    ax.plot(
                        [r["rate"] for r in runs],
                        [r[f"{metric}_ms_{pct}"] for r in runs],
                        style,
                        color=colour,
                        alpha=1.0 if mode == "http" else 0.55,
                        label=f"{pct} {suffix}",
                    )
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(f"{title} (solid: {STACK.split(' (')[0]}; dashed: engine alone)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def plot_prefix_cache(prefix: dict, path: Path) -> Path:
    """Bars: output tokens/s and TTFT p50/p99, prefix caching on vs off."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
    modes = ("off", "on")
    colours = ("tab:grey", "tab:green")
    labels = [f"prefix cache {m}" for m in modes]
    axes[0].bar(
        labels, [prefix[m]["output_token_throughput"] for m in modes], color=colours, width=0.6
    )
    axes[0].set_ylabel("output tokens/s")
    axes[0].set_title(f"Throughput (on/off {prefix['throughput_ratio']:.2f}x)")
    width = 0.38
    for offset, pct in ((-width / 2, "p50"), (width / 2, "p99")):
        axes[1].bar(
            [i + offset for i in range(len(modes))],
            [prefix[m][f"ttft_ms_{pct}"] for m in modes],
            width,
            label=f"TTFT {pct}",
            color=PERCENTILE_COLOURS[pct],
        )
    axes[1].set_xticks(range(len(modes)), labels)
    axes[1].set_ylabel("ms")
    axes[1].set_title(f"Time to first token (p50 on/off {prefix['ttft_p50_ratio']:.2f})")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def plot_offline(offline: dict, queue: dict | None, path: Path) -> Path:
    """Bars of offline output tokens/s: inferq beside transformers, queue beside in-process."""
    bars = [("inferq LLM.generate", offline["ours"]["output_tok_s"], "tab:green")]
    if offline.get("transformers_best"):
        best = offline["transformers_best"]
        label = f"transformers generate\n(batch {best['batch_size']})"
        bars.append((label, best["output_tok_s"], "tab:grey"))
    if queue:
        bars.append(
            (
                "engine in-process\n(queue baseline)",
                queue["in_process"]["output_tok_s"],
                "tab:olive",
            )
        )
        bars.append(("Redis + worker\n(streaming)", queue["queue"]["output_tok_s"], "tab:blue"))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars], width=0.6)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline throughput (each pair measured in the same run)")
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)
