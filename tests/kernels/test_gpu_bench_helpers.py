"""The GPU benchmark's host-side logic: argument parsing, model arithmetic, tables, no-GPU exit."""

from __future__ import annotations

import pytest
import torch

from bench.common.gpu_report import (
    LLAMA3_8B_CONFIG,
    PrefillShape,
    bandwidth_floor_ms,
    compute_roofline_tokens_per_s,
    llama_param_counts,
    markdown_table,
)
from bench.suites import gpu


def test_parse_args_lists_and_shapes():
    args = gpu.parse_args(
        ["--parts", "a,c", "--decode-batches", "1,8", "--prefill-shapes", "2x256,1x512+4096"]
    )
    assert args.parts == ["a", "c"]
    assert args.decode_batches == [1, 8]
    assert args.prefill_shapes == [PrefillShape(2, 256), PrefillShape(1, 512, 4096)]
    assert args.prefill_shapes[1].seq_len == 4608
    assert gpu.parse_args([]).parts == ["a", "b", "c", "d", "e", "f"]  # every part, fp8 too


@pytest.mark.parametrize(
    "argv", [["--parts", "a,x"], ["--prefill-shapes", "512"], ["--decode-tokens", "1"]]
)
def test_parse_args_rejects_bad_input(argv):
    with pytest.raises(SystemExit):
        gpu.parse_args(argv)


def _meta_param_count(model_cls, config) -> int:
    with torch.device("meta"):  # shapes only: an 8B model costs no memory
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())


def test_param_counts_match_transformers_models():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    llama = {k: v for k, v in LLAMA3_8B_CONFIG.items() if k != "architectures"}
    counts = llama_param_counts(LLAMA3_8B_CONFIG)
    assert counts.total == _meta_param_count(LlamaForCausalLM, LlamaConfig(**llama))
    assert counts.matmul == counts.total - counts.embedding  # untied: the lookup is no matmul

    small_qwen = {
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "tie_word_embeddings": True,
    }  # fmt: skip
    counts = llama_param_counts(small_qwen)
    assert counts.total == _meta_param_count(Qwen2ForCausalLM, Qwen2Config(**small_qwen))
    assert counts.matmul == counts.total  # tied: the embedding doubles as the lm_head


def test_rooflines_scale_the_right_way():
    params, peak = 7_000_000_000, 989e12
    tokens_per_s = compute_roofline_tokens_per_s(params, peak)
    assert tokens_per_s * 2 * params == pytest.approx(peak)
    assert compute_roofline_tokens_per_s(2 * params, peak) == pytest.approx(tokens_per_s / 2)
    floor = bandwidth_floor_ms(15_000_000_000, 3e12)
    assert floor * 1e-3 * 3e12 == pytest.approx(15_000_000_000)
    assert bandwidth_floor_ms(15_000_000_000, 6e12) == pytest.approx(floor / 2)


def test_markdown_table_and_section():
    table = markdown_table(
        ["shape", "ms", "ratio"], [["1x512", 0.01234, 1.5], ["4x1024", 123.4, None]]
    )
    lines = table.splitlines()
    assert lines[0] == "| shape | ms | ratio |"
    assert len(lines) == 4 and all(line.count("|") == 4 for line in lines)
    assert "| 1x512 | 0.0123 | 1.50 |" in lines
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [[1]])
    section = gpu.render_section("GPU bench", [("(a) decode", table)])
    assert section.startswith("## GPU bench\n") and "### (a) decode\n\n| shape" in section


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_main_without_cuda_exits_with_a_clear_message(capsys):
    assert gpu.main(["--parts", "a"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_attention_bench_rows_on_tiny_shapes(device, monkeypatch):
    """Part (a)'s case building, SDPA oracle and table, with the GPU timer stubbed out."""
    pytest.importorskip("triton")
    from bench.micro import gpu_attention

    monkeypatch.setattr(gpu_attention, "_time_ms", lambda fn, cfg: (fn(), 1.0)[1])
    cfg = gpu_attention.AttentionBenchConfig(
        decode_batches=[2],
        decode_contexts=[40],
        prefill_shapes=[PrefillShape(1, 20), PrefillShape(2, 8, 24)],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        device=device.type,
    )
    decode_row = gpu_attention._decode_row(cfg, 2, 40)
    assert decode_row[:3] == [2, 40, 1] and decode_row[8] < 5e-2  # bf16 vs SDPA
    for shape in cfg.prefill_shapes:
        assert gpu_attention._prefill_row(cfg, shape)[6] < 5e-2
    table = gpu_attention.bench_prefill(cfg)
    assert table.count("\n| ") == 3  # header + 2 shapes (the separator starts with "|-")


def test_engine_bench_module_imports_without_a_gpu():
    from bench.engine import gpu_engine

    assert callable(gpu_engine.bench_decode) and callable(gpu_engine.bench_throughput)


def _table_rows(block: str) -> list[list[str]]:
    """The markdown table at the end of a bench block: header first, separator dropped."""
    lines = [line for line in block.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_engine_bench_parts_run_on_cpu_with_a_tiny_llama(tmp_path, caplog):
    """Parts (b), (c) and (d) end to end on the CPU: engine args, transformers API, the tables."""
    import logging
    import math

    from bench.engine import gpu_engine

    tiny = {
        **LLAMA3_8B_CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    cfg = gpu_engine.EngineBenchConfig(
        model_config=tiny,
        model_dir=tmp_path / "tiny-llama",
        decode_prompt_len=8,
        decode_tokens=4,
        num_prompts=4,
        input_len=16,
        output_len=4,
        hf_prompts=2,
        hf_batch_size=2,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        device="cpu",
    )
    with caplog.at_level(logging.WARNING, logger="bench.gpu"):
        hf_rates = gpu_engine.bench_transformers(cfg)
        llm = gpu_engine.make_llm(cfg)
        decode = gpu_engine.bench_decode(cfg, llm)
        throughput = gpu_engine.bench_throughput(cfg, llm, hf_rates)
        overhead = gpu_engine.bench_step_overhead(cfg, llm, [1, 3])
    bench_warnings = [r.getMessage() for r in caplog.records if r.name == "bench.gpu"]
    assert not [m for m in bench_warnings if "expected" in m]  # all tokens produced

    decode_rows = _table_rows(decode)
    assert len(decode_rows) == 2 and decode_rows[0][0] == "params"
    # params and GB/token print as "0.00" for a model this small; floor, ms/token and the ratios
    # are the measured numbers, so a bad timing (ms/token <= 0) shows up there
    assert all(math.isfinite(float(v)) for v in decode_rows[1][1:])
    assert all(float(v) > 0 for v in decode_rows[1][3:])

    throughput_rows = _table_rows(throughput)
    assert len(throughput_rows) == 3 and throughput_rows[0][0] == "system"
    ours, theirs = throughput_rows[1], throughput_rows[2]
    assert ours[0].startswith("inferq") and theirs[0].startswith("transformers")
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in ours[1:5] + theirs[1:])
    assert all(math.isfinite(v) and v > 0 for v in hf_rates.values())

    overhead_rows = _table_rows(overhead)
    assert overhead_rows[0][0] == "sequences" and [r[0] for r in overhead_rows[1:3]] == ["1", "3"]
    assert all(int(r[1]) >= 4 for r in overhead_rows[1:3])  # a step per new token at least
    assert "Top kernels at 3 sequences" in overhead


def test_fp8_engine_bench_part_runs_on_cpu_with_a_tiny_llama(tmp_path):
    """Part (f): the same model with fp8 weights, decode and throughput tables that say so."""
    import dataclasses
    import math

    from bench.engine import gpu_engine

    tiny = {
        **LLAMA3_8B_CONFIG, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    cfg = gpu_engine.EngineBenchConfig(
        model_config=tiny, model_dir=tmp_path / "tiny-llama", decode_prompt_len=8,
        decode_tokens=4, num_prompts=4, input_len=16, output_len=4, max_num_seqs=8,
        max_num_batched_tokens=256, device="cpu",
    )  # fmt: skip
    fp8 = dataclasses.replace(cfg, quantization="fp8")
    llm = gpu_engine.make_llm(fp8)
    assert llm.engine.quantization == "fp8"
    decode = gpu_engine.bench_decode(fp8, llm)
    throughput = gpu_engine.bench_throughput(fp8, llm, None)
    assert "fp8 weights" in decode and "fp8 weights" in throughput
    full_bytes = float(_table_rows(gpu_engine.bench_decode(cfg, gpu_engine.make_llm(cfg)))[1][1])
    decode_row = _table_rows(decode)[1]
    assert float(decode_row[1]) <= full_bytes  # a byte a weight, not two
    assert all(math.isfinite(float(v)) and float(v) > 0 for v in decode_row[3:])
