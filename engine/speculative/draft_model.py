"""A small model of the same vocabulary proposes the next tokens, greedily.

The draft runs in its own ModelRunner with its own KV-cache blocks and block manager. Each
target sequence has a shadow sequence there holding the same tokens; per step the shadows
catch up on what the target accepted since (one batched forward), then extend by one greedy
token per forward until each has its draft. K/V the draft computed for tokens the target
rejected are simply recomputed: a shadow's computed tokens fall back to the common prefix.

The draft proposes its argmax, a point mass, so the target's verification (sample and
compare) is exact rejection sampling for sampled requests too (engine.speculative.verify).
"""

from __future__ import annotations

import dataclasses
import logging

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.model_files import resolve_model_path
from engine.model_runner import ModelRunner
from engine.runner_io import RowMode, SamplingBatch
from engine.scheduler_output import SchedulerOutput
from engine.sequence import ScheduledSeq, Sequence
from engine.speculative.config import SpeculativeConfig

logger = logging.getLogger(__name__)


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = min(len(a), len(b))
    for i in range(length):
        if a[i] != b[i]:
            return i
    return length


class DraftModelProposer:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, vocab_size: int) -> None:
        assert spec.model is not None  # the config's validator requires it for draft_model
        draft_config = dataclasses.replace(
            config, model=spec.model, speculative_config=None, quantization=None
        )
        self.runner = ModelRunner(draft_config, resolve_model_path(spec.model))
        if self.runner.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_config: the draft model's vocabulary ({self.runner.vocab_size} "
                f"tokens) differs from the target's ({vocab_size}); a draft must share the "
                "target's tokenizer"
            )
        self.vocab_size = vocab_size
        self.block_manager = BlockManager(
            self.runner.num_kv_blocks, self.runner.block_size, enable_prefix_caching=False
        )
        self._shadows: dict[int, Sequence] = {}  # target seq_id -> its sequence in the draft
        logger.info(
            "draft model %s: %d KV blocks, %d tokens per step",
            spec.model,
            self.runner.num_kv_blocks,
            spec.num_speculative_tokens,
        )

    def _drop(self, seq_id: int) -> None:
        self.block_manager.free(self._shadows.pop(seq_id))

    def _shadow(self, seq: Sequence) -> Sequence:
        """seq's shadow holding seq's tokens, computed up to what still agrees with them."""
        shadow = self._shadows.get(seq.seq_id)
        if shadow is None:
            shadow = seq.shadow()
            if seq.params.prompt_logprobs is not None:  # the target scores the prompt, not us
                shadow.params = seq.params.model_copy(update={"prompt_logprobs": None})
            self.block_manager.allocate_prompt(shadow, [])
            self._shadows[seq.seq_id] = shadow
            return shadow
        agreed = _common_prefix(shadow.token_ids, seq.token_ids)
        shadow.token_ids = list(seq.token_ids)
        # The last token is always computed, so the step that catches up yields logits.
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, agreed, seq.num_tokens - 1)
        return shadow

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        live = {seq.seq_id for seq in seqs}
        for seq_id in [s for s in self._shadows if s not in live]:
            self._drop(seq_id)
        drafts: list[list[int]] = [[] for _ in seqs]
        batch: list[tuple[int, ScheduledSeq]] = []
        for i, (seq, limit) in enumerate(zip(seqs, max_tokens, strict=True)):
            if seq.num_tokens + limit > self.runner.max_model_len:
                continue
            shadow = self._shadow(seq)
            num_new = shadow.num_tokens - shadow.num_computed_tokens
            # Slots for the catch-up and for every draft token but the last (never computed).
            if self.block_manager.try_allocate_slots(shadow, num_new + limit - 1) is None:
                self._drop(seq.seq_id)  # the draft's cache is full: no proposal this time
                continue
            batch.append((i, ScheduledSeq(shadow, num_new)))
        while batch:
            scheduled = [entry for _, entry in batch]
            step = SchedulerOutput(scheduled=scheduled)
            out = self.runner.execute(step, SamplingBatch.uniform(scheduled, RowMode.ARGMAX))
            tokens = [pick.token_ids[0] for _, pick in out.picks]
            next_batch = []
            for (i, entry), token_id in zip(batch, tokens, strict=True):
                shadow = entry.seq
                shadow.num_computed_tokens += entry.num_new_tokens
                shadow.append_token(token_id)
                drafts[i].append(token_id)
                if len(drafts[i]) < max_tokens[i]:
                    next_batch.append((i, ScheduledSeq(shadow, 1)))
            batch = next_batch
        return drafts
