"""The LoRA term of the token embedding, batched by adapter slot.

PEFT adapts `embed_tokens` with lora_embedding_A [r, vocab] and lora_embedding_B [hidden, r]:
a token's term is B @ A[:, id] (times the scaling), i.e. a lookup of A's column for the token
followed by one small matmul. Each slot keeps A transposed as a lookup table [vocab, max_rank]
(a lower rank leaves zero columns), so a step's adapted tokens take one gather and one matmul
per slot present, whatever the number of requests.
"""

from __future__ import annotations

import torch

from engine.lora.batched import StepSource


class EmbeddingLoRASlots:
    def __init__(
        self,
        num_slots: int,
        vocab_size: int,
        embedding_dim: int,
        max_rank: int,
        step_of: StepSource,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.table = torch.zeros(num_slots, vocab_size, max_rank, device=device, dtype=dtype)
        self.b_t = torch.zeros(num_slots, max_rank, embedding_dim, device=device, dtype=dtype)
        self.targeted = [False] * num_slots
        self._step_of = step_of

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes + self.b_t.nbytes)

    def clear(self, slot: int) -> None:
        self.table[slot].zero_()
        self.b_t[slot].zero_()
        self.targeted[slot] = False

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a [rank, vocab] and b [hidden, rank] (the scaling folded in) into slot."""
        rank = a.shape[0]
        self.table[slot, :, :rank].copy_(a.T)
        self.b_t[slot, :rank].copy_(b.T)
        self.targeted[slot] = True

    def add_to(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the embedded ids [T, hidden]) plus each adapted token's term."""
        step = self._step_of.current
        if not any(self.targeted[slot] for slot in step.slots):
            return out
        mapping = step.for_rows(ids.shape[0])
        picked = ids.index_select(0, mapping.order)
        terms = out.new_zeros(picked.shape[0], out.shape[1])
        for segment in mapping.segments:
            if not self.targeted[segment.slot]:
                continue
            span = slice(segment.start, segment.end)
            rows = self.table[segment.slot].index_select(0, picked[span])
            torch.matmul(rows, self.b_t[segment.slot], out=terms[span])
        return out.index_add(0, mapping.order, terms)
