"""The offline API's pooling methods, as vLLM writes them: `LLM(model, runner="pooling")` (or
the older `task="embed"`, or a folder detected as a pooling model), then `llm.embed(texts)`
-> `outputs[i].outputs.embedding`, `llm.encode(texts)` -> `outputs[i].outputs.data` and
`llm.score(a, b)` -> `outputs[i].outputs.score` (cross-encoders, or cosine of embeddings)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC

import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.model_files import ModelNotFoundError, resolve_model_path
from engine.model_runner import load_hf_config
from engine.pooling.engine import PoolingEngine
from engine.pooling.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PooledResult,
    PoolingOutput,
    PoolingRequest,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from engine.pooling.task import resolve_runner, runner_of_task
from schemas.pooling import PoolingParams

PoolingPrompt = str | list[int]


def pooling_config(config: EngineConfig, task: str | None) -> bool:
    """Whether `config` (with vLLM's `task`, when given) is served by the pooling runner; a
    task naming the runner sets config.runner."""
    if task is not None:
        by_task = runner_of_task(task)
        if by_task is not None:
            if config.runner not in ("auto", by_task):
                raise ValueError(f"task={task!r} contradicts runner={config.runner!r}")
            config.runner = by_task
    if config.runner != "auto":
        return config.runner == "pooling"
    try:
        model_path = resolve_model_path(config.model)
    except ModelNotFoundError:
        return False  # the generating engine reports the missing model
    return resolve_runner("auto", model_path, load_hf_config(model_path)) == "pooling"


class PoolingMethods:
    """Mixed into LLM: set `pooling_engine` where the model is a pooling one."""

    pooling_engine: PoolingEngine | None = None
    _pooling_ids = itertools.count()

    def _pooling(self) -> PoolingEngine:
        if self.pooling_engine is None:
            raise ValueError(
                "this LLM generates: load an embedding model with runner='pooling' to embed"
            )
        return self.pooling_engine

    def encode(
        self,
        prompts: PoolingPrompt | SequenceABC[PoolingPrompt],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """One pooled vector (a float32 tensor) per prompt, in prompt order."""
        return [
            PoolingRequestOutput(r.request_id, r.prompt_token_ids, PoolingOutput(r.data))
            for r in self._pool(prompts, pooling_params, use_tqdm)
        ]

    def embed(
        self,
        prompts: PoolingPrompt | SequenceABC[PoolingPrompt],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding (a list of floats) per prompt, in prompt order."""
        return [
            EmbeddingRequestOutput(
                r.request_id, r.prompt_token_ids, EmbeddingOutput(r.data.tolist())
            )
            for r in self._pool(prompts, pooling_params, use_tqdm)
        ]

    def score(
        self,
        text_1: str | SequenceABC[str],
        text_2: str | SequenceABC[str],
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """One score per pair (text_1[i], text_2[i]); a single text_1 pairs with every
        text_2. A cross-encoder (*ForSequenceClassification, one label) scores each pair
        joined as one input, through a sigmoid as sentence-transformers' CrossEncoder does;
        an embedding model scores the cosine similarity of the two texts' embeddings."""
        engine = self._pooling()
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise ValueError(f"got {len(firsts)} first texts for {len(seconds)} second texts")
        if engine.num_labels is not None:
            if engine.num_labels != 1:
                raise ValueError(f"score needs a one-label cross-encoder ({engine.num_labels})")
            pairs = [engine.tokenize_pair(a, b) for a, b in zip(firsts, seconds, strict=True)]
            results = self._pool_inputs(pairs, [PoolingParams()] * len(pairs), use_tqdm)
            return [
                ScoringRequestOutput(
                    r.request_id, r.prompt_token_ids, ScoringOutput(torch.sigmoid(r.data[0]).item())
                )
                for r in results
            ]
        vectors = self._pool([*firsts, *seconds], None, use_tqdm)
        half = len(firsts)
        return [
            ScoringRequestOutput(
                a.request_id,
                a.prompt_token_ids + b.prompt_token_ids,
                ScoringOutput(F.cosine_similarity(a.data, b.data, dim=0).item()),
            )
            for a, b in zip(vectors[:half], vectors[half:], strict=True)
        ]

    def _pool(
        self,
        prompts: PoolingPrompt | SequenceABC[PoolingPrompt],
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None,
        use_tqdm: bool,
    ) -> list[PooledResult]:
        engine = self._pooling()
        prompt_list = _as_prompts(prompts)
        params = pooling_params or PoolingParams()
        params_list = (
            [params] * len(prompt_list) if isinstance(params, PoolingParams) else list(params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(
                f"got {len(params_list)} pooling params for {len(prompt_list)} prompts"
            )
        texts = [p for p in prompt_list if isinstance(p, str)]
        tokenized = iter(engine.tokenize_many(texts))
        inputs = [(next(tokenized) if isinstance(p, str) else p, None) for p in prompt_list]
        return self._pool_inputs(inputs, params_list, use_tqdm)

    def _pool_inputs(
        self,
        inputs: SequenceABC[tuple[list[int], list[int] | None]],
        params_list: SequenceABC[PoolingParams],
        use_tqdm: bool,
    ) -> list[PooledResult]:
        """Run tokenized inputs (ids, token type ids or None) to completion, in input order."""
        from tqdm.auto import tqdm

        engine = self._pooling()
        ids = [f"embed-{next(self._pooling_ids)}" for _ in inputs]
        # Shortest first: batches of like lengths pad an encoder's batch least.
        order = sorted(range(len(ids)), key=lambda i: len(inputs[i][0]))
        try:
            for i in order:
                token_ids, token_types = inputs[i]
                engine.add_request(
                    PoolingRequest(ids[i], token_ids, params_list[i], token_type_ids=token_types)
                )
        except BaseException:
            for request_id in ids:
                engine.abort(request_id)
            raise
        results: dict[str, PooledResult] = {}
        with tqdm(total=len(ids), desc="embed", disable=not use_tqdm) as progress:
            while engine.has_unfinished():
                for result in engine.step():
                    results[result.request_id] = result
                    progress.update(1)
        return [results[request_id] for request_id in ids]


def _as_prompts(prompts: PoolingPrompt | SequenceABC[PoolingPrompt]) -> list[PoolingPrompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]  # type: ignore[list-item]  # one prompt given as token ids
    return [p if isinstance(p, str) else list(p) for p in prompts]
