"""The pooling engine: requests in, prefill-only batches packed to the token budget, one
pooled vector per request out. A request finishes in the step that runs it; nothing of it is
kept afterwards (no KV cache, no prefix cache), so admission is by waiting tokens only."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    InvalidTokenIdError,
    RequestRejectedError,
)
from engine.model_files import resolve_model_path
from engine.model_runner import load_hf_config
from engine.pooling.outputs import PooledResult, PoolingRequest
from engine.pooling.pooler import finish
from engine.pooling.runner import PoolingRunner
from engine.tokenizer import load_tokenizer
from schemas.pooling import PoolingParams

logger = logging.getLogger(__name__)


@dataclass
class _Waiting:
    request_id: str
    token_ids: list[int]
    params: PoolingParams
    arrival_time: float
    token_type_ids: list[int] | None = None


class PoolingEngine:
    """Not thread-safe: drive it from one loop, as the generating Engine."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.tokenizer = load_tokenizer(self.model_path)
        self.hf_config = load_hf_config(self.model_path)
        self.runner = PoolingRunner(config, self.model_path, self.hf_config)
        self.max_model_len = self.runner.max_model_len
        self.hidden_size = self.runner.hidden_size
        self.vocab_size: int = self.hf_config.vocab_size
        # A whole sequence runs in one forward: the budget covers the longest one.
        self.token_budget = max(config.max_num_batched_tokens, self.max_model_len)
        self._waiting: deque[_Waiting] = deque()
        self._ids: set[str] = set()
        self.num_prompt_tokens_computed = 0
        self.num_steps = 0

    @property
    def num_labels(self) -> int | None:
        """A cross-encoder's labels (its outputs are scores); None for an embedding model."""
        return self.runner.num_labels

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestRejectedError("this model has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt)

    def tokenize_many(self, prompts: list[str]) -> list[list[int]]:
        """`tokenize` of each prompt, in one call: the tokenizer's batch path, without Python
        work per text."""
        if not prompts:
            return []
        if self.tokenizer is None:
            raise RequestRejectedError("this model has no tokenizer: pass token ids")
        return [list(ids) for ids in self.tokenizer(prompts)["input_ids"]]

    def tokenize_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """A text pair as one input, as the tokenizer joins them: (ids, token type ids)."""
        if self.tokenizer is None:
            raise RequestRejectedError("this model has no tokenizer: pass token ids")
        encoded = self.tokenizer(first, second)
        ids = list(encoded["input_ids"])
        return ids, list(encoded.get("token_type_ids") or [0] * len(ids))

    def validate(self, token_ids: list[int], params: PoolingParams) -> None:
        """Refuse what can never run: empty or too long inputs, bad ids, too many dimensions."""
        if not token_ids:
            raise RequestRejectedError("the input is empty")
        if len(token_ids) > self.max_model_len:
            raise ContextLengthExceededError(
                f"the input has {len(token_ids)} tokens but this model embeds at most "
                f"{self.max_model_len}"
            )
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise InvalidTokenIdError(f"input token ids must be in [0, {self.vocab_size})")
        if params.dimensions is not None and self.num_labels is not None:
            raise RequestRejectedError("dimensions: a cross-encoder's outputs are scores")
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise RequestRejectedError(
                f"dimensions {params.dimensions} exceeds this model's {self.hidden_size}"
            )

    def add_request(self, request: PoolingRequest) -> list[int]:
        """Queue a request (or refuse it with a RequestRejectedError); returns its token ids."""
        if request.request_id in self._ids:
            raise DuplicateRequestError(f"request {request.request_id!r} is already running")
        prompt = request.prompt
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(token_ids, request.params)
        arrival = request.arrival_time or time.monotonic()
        if request.token_type_ids is not None and len(request.token_type_ids) != len(token_ids):
            raise RequestRejectedError("token_type_ids must have one entry per token")
        self._waiting.append(
            _Waiting(request.request_id, token_ids, request.params, arrival, request.token_type_ids)
        )
        self._ids.add(request.request_id)
        return token_ids

    def abort(self, request_id: str) -> bool:
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        self._waiting = deque(w for w in self._waiting if w.request_id != request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def _next_batch(self) -> list[_Waiting]:
        """A decoder's batch: the oldest requests that fit the token budget and max_num_seqs
        together. An encoder pads its batch to the longest input, so it costs rows x the
        longest: there the batch is the oldest request and the waiting ones nearest its length
        (`_like_lengths`), which wastes the least on padding and never starves the oldest."""
        if self.runner.is_encoder:
            return self._like_lengths()
        batch: list[_Waiting] = []
        used = 0
        while self._waiting and len(batch) < self.config.max_num_seqs:
            length = len(self._waiting[0].token_ids)
            if batch and used + length > self.token_budget:
                break
            batch.append(self._waiting.popleft())
            used += length
        return batch

    def _like_lengths(self) -> list[_Waiting]:
        """The oldest waiting request, grown into a run of neighbours in length order: at each
        step the neighbour that adds the fewer padded tokens, while rows x the longest fits the
        token budget and the rows fit max_num_seqs."""
        if not self._waiting:
            return []
        waiting = list(self._waiting)
        lengths = [len(w.token_ids) for w in waiting]
        order = sorted(range(len(waiting)), key=lambda i: (lengths[i], i))
        low = high = order.index(0)  # the oldest; ties keep arrival order, so it is the first
        rows, longest = 1, lengths[0]
        while rows < self.config.max_num_seqs:
            # (padded tokens it adds, the batch's longest after it, which end grows)
            choices = []
            if low > 0:  # a shorter one pads itself to the longest
                shorter = lengths[order[low - 1]]
                choices.append((longest - shorter, longest, -1))
            if high + 1 < len(order):  # a longer one pads every row taken to its own length
                longer = lengths[order[high + 1]]
                choices.append((rows * (longer - longest), longer, 1))
            fitting = [c for c in sorted(choices) if (rows + 1) * c[1] <= self.token_budget]
            if not fitting:
                break
            _, longest, end = fitting[0]
            if end < 0:
                low -= 1
            else:
                high += 1
            rows += 1
        chosen = set(order[low : high + 1])
        self._waiting = deque(w for i, w in enumerate(waiting) if i not in chosen)
        return [waiting[i] for i in sorted(chosen)]

    def step(self) -> list[PooledResult]:
        """Run one batch; every request in it finishes."""
        batch = self._next_batch()
        if not batch:
            return []
        resolved = [self.runner.pooler.resolve(w.params) for w in batch]
        pooled = self.runner.run(
            [w.token_ids for w in batch],
            [kind for kind, _ in resolved],
            [w.token_type_ids for w in batch],
        ).cpu()
        if self.num_labels is not None:  # scores: neither truncated nor normalized
            vectors = list(pooled)
        else:
            dimensions = [w.params.dimensions for w in batch]
            vectors = finish(pooled, dimensions, [norm for _, norm in resolved])
        self.num_steps += 1
        results = []
        for item, vector in zip(batch, vectors, strict=True):
            self._ids.discard(item.request_id)
            self.num_prompt_tokens_computed += len(item.token_ids)
            results.append(PooledResult(item.request_id, item.token_ids, vector))
        return results
