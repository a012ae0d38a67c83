"""Pure helpers of the GPU benchmark: shapes, model arithmetic, rooflines, markdown tables.

No torch or engine imports here, so the arithmetic is unit-tested on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

# Llama-3-8B's config.json (meta-llama/Meta-Llama-3-8B), what the engine's dummy loader reads.
LLAMA3_8B_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}

H100_BF16_PEAK_FLOPS = 989e12  # dense bf16 tensor-core peak of an H100 SXM


@dataclass(frozen=True)
class PrefillShape:
    batch: int
    query_len: int
    context_len: int = 0  # tokens already cached before this chunk

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len

    @property
    def label(self) -> str:
        suffix = f"+{self.context_len} cached" if self.context_len else ""
        return f"{self.batch}x{self.query_len}{suffix}"


def parse_int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]."""
    return [int(part) for part in text.split(",") if part.strip()]


def parse_prefill_shapes(text: str) -> list[PrefillShape]:
    """'1x2048,4x512+1024' -> batch x new tokens [+ cached context tokens]."""
    shapes = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        head, _, context = part.partition("+")
        batch, _, query_len = head.partition("x")
        if not query_len:
            raise ValueError(f"prefill shape {part!r} is not BATCHxLEN[+CONTEXT]")
        shapes.append(PrefillShape(int(batch), int(query_len), int(context or 0)))
    return shapes


@dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # the input embedding table (a lookup, not a matmul)
    tied: bool

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matmul per token (the lm_head included)."""
        return self.total - (0 if self.tied else self.embedding)

    def streamed_bytes_per_token(self, bytes_per_param: int) -> int:
        """Weights a batch-1 decode step must read: all but the untouched embedding rows."""
        return self.matmul * bytes_per_param


def llama_param_counts(config: dict) -> ParamCounts:
    """Parameter count of a Llama-family (Llama / Mistral / Qwen2) HF config."""
    hidden = config["hidden_size"]
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    tied = bool(config.get("tie_word_embeddings", False))
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q_size + 2 * kv_size) + q_size * hidden
    if config.get("attention_bias") or config.get("model_type") == "qwen2":
        attention += q_size + 2 * kv_size
    mlp = 3 * hidden * inter
    norms = 2 * hidden
    embedding = vocab * hidden
    total = layers * (attention + mlp + norms) + hidden + embedding + (0 if tied else embedding)
    return ParamCounts(total=total, embedding=embedding, tied=tied)


def bandwidth_floor_ms(weight_bytes: int, bytes_per_second: float) -> float:
    """Lowest batch-1 decode time per token: every weight byte read once at copy bandwidth."""
    return weight_bytes / bytes_per_second * 1e3


def compute_roofline_tokens_per_s(matmul_params: int, peak_flops: float) -> float:
    """Tokens/s if every token cost 2 FLOPs per matmul parameter at peak (attention ignored)."""
    return peak_flops / (2 * matmul_params)


def attention_flops(
    batch: int, heads: int, head_dim: int, query_len: int, context_len: int
) -> float:
    """QK^T and PV FLOPs of causal attention for `query_len` new tokens after `context_len`."""
    visible_keys = query_len * context_len + query_len * (query_len + 1) / 2
    return 4.0 * batch * heads * head_dim * visible_keys


def fmt(value: float | int | str | None) -> str:
    """Table cell text: ints as is, floats with precision that suits their size."""
    if value is None:
        return "-"
    if isinstance(value, str | int):
        return str(value)
    magnitude = abs(value)
    if magnitude == 0:
        return "0"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    if magnitude >= 1e-3:
        return f"{value:.4f}"
    return f"{value:.2e}"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    """A GitHub-markdown table; cells go through fmt()."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row has {len(row)} cells, table has {len(headers)} columns")
        lines.append("| " + " | ".join(fmt(cell) for cell in row) + " |")
    return "\n".join(lines)
