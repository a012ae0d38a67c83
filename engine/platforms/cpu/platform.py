"""CpuPlatform: the CPU's start-up preparation of a loaded model and its per-step glue choice."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import asdict
from typing import Any

import torch
from transformers import PretrainedConfig

from engine.attention.base import AttentionBackend
from engine.config import EngineConfig
from engine.distributed import tensor_parallel
from engine.distributed.group import TensorParallel
from engine.models.interface import CausalLM
from engine.platforms.base import Platform
from engine.platforms.cpu import glue as cpu_glue
from engine.platforms.cpu import greedy_screen, matmul_tuning
from engine.platforms.cpu.decode_stack import stacks_of
from engine.platforms.cpu.greedy_screen import ScreenedLMHead
from engine.platforms.cpu.machine_cache import cached, machine_key

logger = logging.getLogger(__name__)

# Step sizes at which the start-up measurement compares the compiled glue with the native one.
_GLUE_CANDIDATES = (8, 32, 128, 512, 2048)


class CpuPlatform(Platform):
    def __init__(
        self,
        config: EngineConfig,
        hf_config: PretrainedConfig,
        attention: AttentionBackend,
        tp: TensorParallel | None,
    ) -> None:
        self._config = config
        self._tp = tp
        self._linear_shapes = matmul_tuning.linear_shapes(hf_config, attention, tp)
        self.greedy_screen: ScreenedLMHead | None = None
        # Steps of at least this many tokens run the compiled glue; None: never.
        self.compiled_glue_min_tokens: int | None = None
        self._compiled_glue: cpu_glue.Glue | None = None

    def auto_dtype(self) -> torch.dtype:
        return matmul_tuning.auto_dtype(self._linear_shapes, self._config.cpu_matmul)

    def prepare(self, model: CausalLM, dtype: torch.dtype) -> None:
        config = self._config
        matmul_tuning.tune_model(model, self._linear_shapes, dtype, config.cpu_matmul)
        if self._tp is None and dtype == torch.float32:
            self.greedy_screen = greedy_screen.build(
                model.lm_head, model.vocab_size, config.cpu_greedy_screen
            )
        if not config.enforce_eager:
            self._compile_glue(model, dtype)
        # Tuning packed (and quantizing replaced) the weights the stacks read.
        for stack in stacks_of(model):
            stack.prepare()

    @property
    def extra_weight_bytes(self) -> int:
        # The greedy screen's bf16 copy of the LM head counts against memory_budget.
        return 0 if self.greedy_screen is None else self.greedy_screen.nbytes

    def step(self, num_tokens: int, decode_only: bool) -> contextlib.AbstractContextManager[None]:
        return cpu_glue.using(self._glue_for_step(num_tokens, decode_only))

    def _glue_for_step(self, num_tokens: int, decode_only: bool) -> cpu_glue.Glue:
        # A decode-only step keeps the native glue whatever its size: with it the whole step
        # runs as one C++ call (engine.platforms.cpu.decode_stack), which saves more than the
        # compiled glue does; the glue alone is what the start-up measurement compared.
        threshold = self.compiled_glue_min_tokens
        if (
            threshold is None
            or self._compiled_glue is None
            or num_tokens < threshold
            or decode_only
        ):
            return cpu_glue.native()
        return self._compiled_glue

    def _compile_glue(self, model: CausalLM, dtype: torch.dtype) -> None:
        """Compile the forward's glue now, not in the first request, and measure from how many
        tokens per step it pays; the answer is kept per machine (machine_cache), and where it
        is "never" later starts skip compiling. A failure leaves the forward eager, never the
        worker down."""
        started = time.perf_counter()
        local = tensor_parallel.local_sizes(model)
        shapes = cpu_glue.GlueShapes(
            hidden_size=model.hidden_size,
            intermediate_size=local.intermediate_size,
            num_heads=local.num_heads,
            num_kv_heads=local.num_kv_heads,
            head_dim=model.attention_spec(0).head_dim,
            dtype=dtype,
        )
        budget = self._config.max_num_batched_tokens
        candidates = tuple(n for n in _GLUE_CANDIDATES if n <= budget) or (budget,)
        key = machine_key(
            shapes={**asdict(shapes), "dtype": str(dtype).removeprefix("torch.")},
            candidates=list(candidates),
            baseline="native" if cpu_glue.native() is cpu_glue.NATIVE else "eager",
        )

        def read(stored: Any) -> int | None:
            return None if stored is None else int(stored)

        try:
            threshold = cached(
                "cpu_glue",
                key,
                lambda: cpu_glue.min_tokens_for_compiled(shapes, candidates),
                read,
            )
            if threshold is not None:
                cpu_glue.compile_now(shapes)  # a cached answer: compile before any request
        except Exception as error:  # no compiler, an inductor bug: stay eager
            logger.warning(
                "compiling the CPU forward failed (%s); it runs eagerly", cpu_glue.first_line(error)
            )
            return
        self.compiled_glue_min_tokens = threshold
        self._compiled_glue = cpu_glue.compiled(dtype)
        logger.info(
            "CPU forward glue: %s (%.1f s)",
            "eager, measured faster than compiled at every step size"
            if threshold is None
            else f"compiled for steps of {threshold} tokens or more (measured faster from there)",
            time.perf_counter() - started,
        )
