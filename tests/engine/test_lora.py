"""LoRA adapters against PEFT: random adapters saved by PEFT's save_pretrained, run by the
engine alone and mixed in one batch with other adapters and the base model; bad adapters fail
only their own request."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, LoRARequest, SamplingParams
from tests.engine.lora_reference import (
    GREEDY,
    assert_close,
    build,
    load_base,
    lora_term,
    make_adapter,
    peft_greedy,
    prompts_of,
    tokens_and_logprobs,
)

__all__ = ["build", "lora_term"]  # fixtures


@pytest.mark.parametrize(
    "kind, overrides",
    [("llama", {}), ("qwen2", {"tie_word_embeddings": True}), ("qwen3", {})],
    ids=["llama", "qwen2", "qwen3"],
)
def test_adapters_match_peft_alone_and_mixed_with_the_base(
    build: Callable[..., Path],
    tmp_path: Path,
    kind: str,
    overrides: dict[str, object],
    lora_term: str,
) -> None:
    base = build(kind, **overrides)
    full = make_adapter(base, tmp_path / "full", seed=1, rank=8)
    attention = make_adapter(
        base, tmp_path / "attn", seed=2, rank=4, targets=["q_proj", "v_proj", "o_proj"]
    )
    _two_adapters_and_the_base_in_one_batch_match_peft(base, full, attention, prompts_of(3))


def _two_adapters_and_the_base_in_one_batch_match_peft(
    base: Path, first: Path, second: Path, prompts: list[list[int]]
) -> None:
    expected = {
        None: peft_greedy(base, None, prompts),
        1: peft_greedy(base, first, prompts),
        2: peft_greedy(base, second, prompts),
    }
    # Each adapter changes what the model says.
    assert expected[1] != expected[None] and expected[2] != expected[None]
    requests = {1: LoRARequest("first", 1, str(first)), 2: LoRARequest("second", 2, str(second))}
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    # Every prompt under every adapter and the base, all in one batch.
    order = [None, 1, 2] * len(prompts)
    batch = [prompts[i // 3] for i in range(len(order))]
    loras = [None if key is None else requests[key] for key in order]
    outputs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
    for index, output in enumerate(outputs):
        assert output.outputs[0].finish_reason == "length", output.outputs[0].stop_reason
        assert_close([tokens_and_logprobs(output)], [expected[order[index]][index // 3]])


FUSED_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # Phi-3's checkpoint names


@pytest.mark.parametrize(
    "kind, overrides, targets",
    [
        ("mistral", {}, None),
        ("gemma2", {"sliding_window": 8}, None),
        ("gemma3", {"sliding_window": 8}, None),
        ("phi3", {"pad_token_id": 0}, FUSED_TARGETS),
        ("olmo2", {}, None),
        ("granite", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5}, None),
        ("smollm3", {"pad_token_id": 0}, None),
    ],
    ids=["mistral", "gemma2", "gemma3", "phi3", "olmo2", "granite", "smollm3"],
)
def test_adapters_match_peft_on_every_dense_family(
    build: Callable[..., Path],
    tmp_path: Path,
    kind: str,
    overrides: dict[str, object],
    targets: list[str] | None,
) -> None:
    base = build(kind, **overrides)
    adapter = make_adapter(base, tmp_path / "a", seed=1, rank=8, targets=targets)
    prompts = prompts_of(2)
    expected = peft_greedy(base, adapter, prompts)
    base_expected = peft_greedy(base, None, prompts[:1])
    assert expected != peft_greedy(base, None, prompts)  # the adapter changes what it says
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    request = LoRARequest("a", 1, str(adapter))
    outputs = llm.generate(
        [*prompts, prompts[0]], GREEDY, use_tqdm=False, lora_request=[request, request, None]
    )
    assert_close([tokens_and_logprobs(o) for o in outputs], [*expected, *base_expected])


@pytest.mark.parametrize(
    "kind, overrides",
    [
        ("llama", {}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("gemma3", {}),
        ("granite", {"embedding_multiplier": 2.0}),
    ],
    ids=["llama", "qwen2-tied", "gemma3-scaled-embedding", "granite-embedding-multiplier"],
)
def test_embedding_and_lm_head_adapters_match_peft(
    build: Callable[..., Path], tmp_path: Path, kind: str, overrides: dict[str, object]
) -> None:
    base = build(kind, **overrides)
    outer = make_adapter(
        base, tmp_path / "outer", seed=1, rank=4, targets=["embed_tokens", "lm_head"]
    )
    tensors = load_file(str(outer / "adapter_model.safetensors"))
    assert any("lora_embedding_A" in name for name in tensors)  # as PEFT writes them
    both = make_adapter(
        base, tmp_path / "both", seed=2, rank=8, targets=["embed_tokens", "q_proj", "down_proj"]
    )
    _two_adapters_and_the_base_in_one_batch_match_peft(base, outer, both, prompts_of(2))


def test_rslora_scaling_matches_peft(build: Callable[..., Path], tmp_path: Path) -> None:
    base = build("llama")
    adapter = make_adapter(base, tmp_path / "rs", seed=3, rank=16, alpha=8.0, use_rslora=True)
    assert json.loads((adapter / "adapter_config.json").read_text())["use_rslora"]
    prompts = prompts_of(2)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=16)
    outputs = llm.generate(
        prompts, GREEDY, use_tqdm=False, lora_request=LoRARequest("rs", 7, str(adapter))
    )
    assert_close([tokens_and_logprobs(o) for o in outputs], peft_greedy(base, adapter, prompts))


def test_a_mixed_batch_of_four_adapters_and_the_base_equals_each_run_alone(
    build: Callable[..., Path], tmp_path: Path, lora_term: str
) -> None:
    base = build("llama")
    requests = [
        LoRARequest(
            f"a{i}", i, str(make_adapter(base, tmp_path / f"a{i}", seed=10 + i, rank=2 * i))
        )
        for i in range(1, 5)
    ]
    prompts = prompts_of(5, seed=4)
    loras: list[LoRARequest | None] = [*requests, None]
    # Fewer slots and host-memory places than adapters: slots are reused (least recently used
    # first) and evicted adapters reloaded from their folders.
    mixed = LLM(
        str(base), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=8
    )
    together = mixed.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    alone = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    for prompt, lora, output in zip(prompts, loras, together, strict=True):
        single = alone.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        assert_close([tokens_and_logprobs(output)], [tokens_and_logprobs(single)])


def test_two_adapters_never_share_prefix_cache_blocks(
    build: Callable[..., Path], tmp_path: Path
) -> None:
    base = build("llama")
    first = LoRARequest("a", 1, str(make_adapter(base, tmp_path / "a", seed=1)))
    second = LoRARequest("b", 2, str(make_adapter(base, tmp_path / "b", seed=2)))
    prompt = prompts_of(3)[2]  # 40 tokens: two full blocks of 16
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=first)
    hits = llm.engine.stats().prefix_cache_hits
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=second)[0]
    assert llm.engine.stats().prefix_cache_hits == hits  # b reuses nothing a computed
    base_out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert llm.engine.stats().prefix_cache_hits == hits  # nor does the base model
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=first)
    assert llm.engine.stats().prefix_cache_hits > hits  # a's own blocks are reused
    expected = peft_greedy(base, Path(second.lora_path), [prompt])
    assert_close([tokens_and_logprobs(other)], expected)
    assert_close([tokens_and_logprobs(base_out)], peft_greedy(base, None, [prompt]))


def _broken(good: Path, out: Path, change: Callable[[dict, dict], None]) -> Path:  # type: ignore[type-arg]
    out.mkdir()
    config = json.loads((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / "adapter_model.safetensors"))
    change(config, tensors)
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def _poison(config: dict, tensors: dict) -> None:  # type: ignore[type-arg]
    name = next(iter(tensors))
    tensors[name] = torch.full_like(tensors[name], float("nan"))


def _add_embedding_a_alone(config: dict, tensors: dict) -> None:  # type: ignore[type-arg]
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 256)


def _add_expert(config: dict, tensors: dict) -> None:  # type: ignore[type-arg]
    name = "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight"
    tensors[name] = torch.zeros(8, 64)


def _save_whole_modules(config: dict, tensors: dict) -> None:  # type: ignore[type-arg]
    config["modules_to_save"] = ["lm_head"]


def test_a_bad_adapter_fails_only_its_own_request(
    build: Callable[..., Path], tmp_path: Path
) -> None:
    base = build("llama")
    good = make_adapter(base, tmp_path / "good", seed=1)
    other_base = build("llama", hidden_size=32, head_dim=8)
    cases = {
        "no adapter folder": tmp_path / "missing",
        "wrong base shape": make_adapter(other_base, tmp_path / "other", seed=2),
        "exceeds max_lora_rank": make_adapter(base, tmp_path / "big", seed=3, rank=16),
        "bad tensor": _broken(good, tmp_path / "nan", _poison),
        "embed_tokens has lora_A without its pair": _broken(
            good, tmp_path / "a", _add_embedding_a_alone
        ),
        "mixture-of-experts experts are not adapted": _broken(good, tmp_path / "moe", _add_expert),
        "modules_to_save": _broken(good, tmp_path / "save", _save_whole_modules),
    }
    bad = [LoRARequest(f"bad{i}", 10 + i, str(path)) for i, path in enumerate(cases.values())]
    prompts = prompts_of(2)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    loras = [LoRARequest("good", 1, str(good)), None, *bad]
    batch = [prompts[0], prompts[1], *[prompts[0]] * len(bad)]
    outputs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=loras)
    assert_close([tokens_and_logprobs(outputs[0])], peft_greedy(base, good, prompts[:1]))
    assert_close([tokens_and_logprobs(outputs[1])], peft_greedy(base, None, prompts[1:]))
    for problem, output in zip(cases, outputs[2:], strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "error"
        assert problem in str(completion.stop_reason)
        assert completion.token_ids == []


@pytest.mark.parametrize("backend", ["aten", "panels"])
def test_decode_steps_with_and_without_adapters_take_the_cpu_decode_stack(
    build: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    from engine.platforms.cpu import decode_stack
    from engine.platforms.cpu.matmul import available_backends

    if backend not in available_backends(torch.float32):
        pytest.skip(f"{backend} is not built for this CPU")
    calls: list[int] = []
    original = decode_stack.cpu_ops.decode_layers

    def counted(hidden, *args):  # type: ignore[no-untyped-def]
        calls.append(hidden.shape[0])
        return original(hidden, *args)

    monkeypatch.setattr(decode_stack.cpu_ops, "decode_layers", counted)
    # panels pack the [gate; up] weight for their gated kernel, which an adapted step bypasses.
    base = build("llama")
    adapter = make_adapter(base, tmp_path / "a", seed=1)
    prompts = prompts_of(3)
    expected = peft_greedy(base, adapter, prompts) + peft_greedy(base, None, prompts)
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8, cpu_matmul=backend)
    request = LoRARequest("a", 1, str(adapter))
    outputs = llm.generate(
        prompts * 2, GREEDY, use_tqdm=False, lora_request=[request] * 3 + [None] * 3
    )
    assert calls  # the decode steps, adapted rows and base rows alike, ran in C++
    assert_close([tokens_and_logprobs(output) for output in outputs], expected)


def test_a_lora_request_needs_enable_lora(build: Callable[..., Path], tmp_path: Path) -> None:
    from engine.errors import RequestRejectedError

    base = build("llama")
    adapter = make_adapter(base, tmp_path / "a", seed=1)
    llm = LLM(str(base), dtype="float32")
    with pytest.raises(RequestRejectedError, match="enable_lora"):
        llm.generate(prompts_of(1), GREEDY, lora_request=LoRARequest("a", 1, str(adapter)))


@pytest.mark.anyio
async def test_async_engine_streams_with_an_adapter_as_offline(
    build: Callable[..., Path], tmp_path: Path
) -> None:
    from engine import AsyncEngineArgs, AsyncLLMEngine

    base = build("llama")
    adapter = make_adapter(base, tmp_path / "a", seed=1)
    request = LoRARequest("a", 1, str(adapter))
    args = AsyncEngineArgs(model=str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    engine = AsyncLLMEngine.from_engine_args(args)
    try:
        prompt = {"prompt_token_ids": prompts_of(1)[0]}
        final = None
        async for output in engine.generate(prompt, GREEDY, "r1", lora_request=request):
            final = output
    finally:
        engine.shutdown()
    assert final is not None and final.finished
    expected = peft_greedy(base, adapter, prompts_of(1))
    assert_close([tokens_and_logprobs(final)], expected)


def test_speculative_decoding_with_adapters_gives_the_same_tokens(
    build: Callable[..., Path], tmp_path: Path, lora_term: str
) -> None:
    base = build("llama")
    request = LoRARequest("a", 1, str(make_adapter(base, tmp_path / "a", seed=1)))
    # The base model drafts (without the adapter): verified several rows at a time, partly
    # rejected where the adapter changes the tokens.
    prompts = prompts_of(3)
    loras = [request, None, request]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = {
        "method": "draft_model",
        "model": str(base),
        "num_speculative_tokens": 3,
        "disable_by_batch_size": None,
    }
    plain = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    speculating = LLM(
        str(base), dtype="float32", enable_lora=True, max_lora_rank=8, speculative_config=spec
    )
    expected = plain.generate(prompts, params, use_tqdm=False, lora_request=loras)
    got = speculating.generate(prompts, params, use_tqdm=False, lora_request=loras)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert speculating.engine.stats().spec_num_draft_tokens > 0


def test_a_request_waiting_for_an_adapter_slot_lets_the_ones_behind_it_run(
    build: Callable[..., Path], tmp_path: Path
) -> None:
    from engine.outputs import EngineRequest

    base = build("llama")
    first = LoRARequest("a", 1, str(make_adapter(base, tmp_path / "a", seed=1)))
    second = LoRARequest("b", 2, str(make_adapter(base, tmp_path / "b", seed=2)))
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    engine = llm.engine
    prompt = prompts_of(1)[0]
    for request_id, lora in [("a", first), ("b", second), ("base", None), ("a2", first)]:
        engine.add_request(EngineRequest(request_id, prompt, GREEDY, lora_request=lora))
    engine.step()
    # One slot: b waits for a's adapter to leave it; the base model and a's second run now.
    assert {seq.request_id for seq in engine.scheduler.running} == {"a", "base", "a2"}
    finished = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.output is not None:
                finished[delta.request_id] = delta.output
    expected = {
        lora: peft_greedy(base, None if lora is None else Path(lora.lora_path), [prompt])[0]
        for lora in (first, second, None)
    }
    for request_id, lora in [("a", first), ("b", second), ("base", None), ("a2", first)]:
        assert_close([tokens_and_logprobs(finished[request_id])], [expected[lora]])


def _dequantized_copy(llm: LLM, base: Path, out: Path) -> Path:
    """The base model with every projection's weight as the engine's quantized one computes."""
    from engine.quantization.weight_linear import QuantizedWeightLinear
    from engine.quantization.weights import dequantize

    def weight(linear) -> torch.Tensor:  # type: ignore[no-untyped-def]
        assert isinstance(linear.method, QuantizedWeightLinear)
        return dequantize(linear.method.weight)

    model = llm.engine.runner.model
    state = {"lm_head.weight": weight(model.lm_head)}
    for index in range(len(model.decoder_layers)):
        layout = model.projections(index)
        prefix = f"model.layers.{index}."
        q, k, v = weight(layout.qkv).split(layout.qkv.shard_sizes)
        gate, up = weight(layout.gate_up).split(layout.gate_up.shard_sizes)
        for name, tensor in {
            "self_attn.q_proj": q,
            "self_attn.k_proj": k,
            "self_attn.v_proj": v,
            "self_attn.o_proj": weight(layout.o),
            "mlp.gate_proj": gate,
            "mlp.up_proj": up,
            "mlp.down_proj": weight(layout.down),
        }.items():
            state[f"{prefix}{name}.weight"] = tensor
    hf = load_base(base)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("norm" in n or "embed" in n for n in missing)
    hf.save_pretrained(out)
    return out


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_adapters_on_quantized_base_weights_match_peft_on_the_same_weights(
    build: Callable[..., Path], tmp_path: Path, quantization: str
) -> None:
    base = build("llama")
    adapter = make_adapter(base, tmp_path / "a", seed=1)
    llm = LLM(
        str(base), dtype="float32", quantization=quantization, enable_lora=True, max_lora_rank=8
    )
    reference_base = _dequantized_copy(llm, base, tmp_path / "dequantized")
    prompts = prompts_of(2)
    request = LoRARequest("a", 1, str(adapter))
    outputs = llm.generate(
        [*prompts, prompts[0]], GREEDY, use_tqdm=False, lora_request=[request, request, None]
    )
    expected = peft_greedy(reference_base, adapter, prompts)
    expected.append(peft_greedy(reference_base, None, prompts[:1])[0])
    assert_close([tokens_and_logprobs(o) for o in outputs], expected)


@pytest.mark.slow
def test_an_adapter_on_the_default_model_matches_peft(
    default_model_path: Path, tmp_path: Path
) -> None:
    adapter = make_adapter(default_model_path, tmp_path / "smol", seed=5, rank=16)
    prompts = prompts_of(2)
    expected = peft_greedy(default_model_path, adapter, prompts)
    assert expected != peft_greedy(default_model_path, None, prompts)
    llm = LLM(str(default_model_path), dtype="float32", enable_lora=True, max_lora_rank=16)
    request = LoRARequest("smol", 1, str(adapter))
    batch = [prompts[0], prompts[1], prompts[1]]
    outputs = llm.generate(batch, GREEDY, use_tqdm=False, lora_request=[request, None, request])
    base_second = peft_greedy(default_model_path, None, prompts[1:])[0]
    assert_close([tokens_and_logprobs(o) for o in outputs], [expected[0], base_second, expected[1]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_adapters_on_cuda_take_the_triton_kernel_and_match_peft(
    build: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.lora import segmented

    calls: list[int] = []
    original = segmented.add_segmented

    def counted(slots, mapping, x, out):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return original(slots, mapping, x, out)

    monkeypatch.setattr(segmented, "add_segmented", counted)
    base = build("llama")
    full = make_adapter(base, tmp_path / "full", seed=1, rank=8)
    small = make_adapter(base, tmp_path / "small", seed=2, rank=2, targets=["v_proj", "up_proj"])
    prompts = prompts_of(3)
    requests = [LoRARequest("full", 1, str(full)), LoRARequest("small", 2, str(small)), None]
    llm = LLM(
        str(base), device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8
    )
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests)
    assert calls  # the layers' terms went through the kernel
    expected = [
        peft_greedy(base, full, prompts[:1])[0],
        peft_greedy(base, small, prompts[1:2])[0],
        peft_greedy(base, None, prompts[2:])[0],
    ]
    for output, (tokens, logprobs) in zip(outputs, expected, strict=True):
        got_tokens, got_logprobs = tokens_and_logprobs(output)
        assert got_tokens == tokens
        assert got_logprobs == pytest.approx(logprobs, abs=1e-3)
