"""The offline API: `LLM(model).generate(prompts, params)` runs a whole workload to completion."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence as SequenceABC
from typing import Any

from engine.beam_search import BeamSearchParams
from engine.beam_search_output import BeamSearchOutput
from engine.config import EngineConfig
from engine.distributed.executor import run_executor
from engine.distributed.group import is_torchrun_executor
from engine.engine import Engine
from engine.engine_args import ENGINE_ARG_NAMES, EngineArgs
from engine.lora.request import LoRARequest
from engine.outputs import EngineRequest, RequestOutput
from engine.pooling.engine import PoolingEngine
from engine.pooling_llm import PoolingMethods, pooling_config
from engine.prompts import PromptType, parse_prompts
from schemas.sampling import SamplingParams

Prompts = PromptType | SequenceABC[PromptType]


def start_engine(config: EngineConfig) -> Engine:
    """The engine of this process. A non-driver rank of a torchrun-started tensor-parallel
    replica serves the driver's steps instead, then ends the script here: only the driver
    generates."""
    if is_torchrun_executor(config.tensor_parallel_size):
        raise SystemExit(run_executor(config))
    return Engine(config)


class LLM(PoolingMethods):
    """Offline batch generation with continuous batching, e.g.

    >>> llm = LLM("SmolLM2-135M-Instruct")
    >>> llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    """

    def __init__(self, model: str, task: str | None = None, **engine_args: Any) -> None:
        """engine_args: EngineConfig's fields, or vLLM's names for them (engine.engine_args).
        task: vLLM's older name of the runner ("embed" -> runner="pooling")."""
        unknown = set(engine_args) - ENGINE_ARG_NAMES
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        config = EngineArgs(model=model, **engine_args).create_engine_config()
        if pooling_config(config, task):  # embeddings: see engine.pooling_llm
            self.pooling_engine = PoolingEngine(config)
            return
        self.engine = start_engine(config)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel replica now (else done at exit)."""
        if self.pooling_engine is not None:
            return  # a pooling model runs on this process alone
        ranks = self.engine.runner.tp_ranks
        if ranks is not None:
            ranks.stop()

    @property
    def tokenizer(self) -> Any:
        if self.pooling_engine is not None:
            return self.pooling_engine.tokenizer
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's HF tokenizer (None for a model without one), as vLLM's LLM gives it."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompts,
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: SequenceABC[int] | None = None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's TextPrompt / TokensPrompt
        dicts, mixed as they come); outputs come back in prompt order. lora_request: one
        adapter for every prompt, or one (or None) per prompt."""
        prompt_list = parse_prompts(prompts)
        count = len(prompt_list)
        params_list = _broadcast(sampling_params or SamplingParams(), count)
        priorities = list(priority) if priority is not None else [0] * count
        loras = _broadcast_lora(lora_request, count)
        request_ids = []
        for prompt, params, prio, lora in zip(
            prompt_list, params_list, priorities, loras, strict=True
        ):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(
                EngineRequest(request_id, prompt, params, priority=prio, lora_request=lora)
            )
            request_ids.append(request_id)
        return self._run(request_ids, use_tqdm)

    def beam_search(
        self,
        prompts: Prompts,
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt, next to any other request in the batch: each output
        holds the beam_width best beams, best first, with their cumulative logprobs, as vLLM's
        `.sequences` and as a RequestOutput's `.outputs`."""
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm)
        tokenizer = self.engine.tokenizer
        decode = tokenizer.decode if tokenizer is not None else None
        return [BeamSearchOutput.of(output, decode) for output in outputs]

    def chat(
        self,
        conversations: list[dict[str, str]] | SequenceABC[list[dict[str, str]]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to chat conversations through the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self.engine.apply_chat_template(list(c)) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def perplexity(self, text: str | list[int]) -> float:
        """exp of the mean negative log-likelihood of the text's tokens after the first, from
        one forward pass over the whole text (it must fit the model and the KV cache)."""
        ids = self.tokenizer.encode(text) if isinstance(text, str) else list(text)
        if len(ids) < 2:
            raise ValueError("perplexity needs at least two tokens")
        return math.exp(-self.engine.token_logprobs(ids).double().mean().item())

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        outputs: dict[str, RequestOutput] = {}
        pending = set(request_ids)
        with progress:
            while pending:
                for delta in self.engine.step():
                    if delta.output is not None and delta.request_id in pending:
                        outputs[delta.request_id] = delta.output
                        pending.discard(delta.request_id)
                        progress.update(1)
        return [outputs[request_id] for request_id in request_ids]


def _broadcast(
    params: SamplingParams | SequenceABC[SamplingParams], count: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params


def _broadcast_lora(
    lora: LoRARequest | SequenceABC[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * count
    loras = list(lora)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} LoRA requests for {count} prompts")
    return loras
