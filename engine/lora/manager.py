"""LoRA adapters of one engine: loaded ones in host memory, resident ones in slots.

`add` loads and checks a request's adapter at admission, so a bad one fails its request there
and nothing else. Host memory keeps up to max_cpu_loras adapters (least recently used evicted
beyond, reloaded from their folder when asked for again); up to max_loras sit in the slots
beside the base layers, which the scheduler never exceeds in one step. `begin_step` maps each
token of a step to its adapter's slot (loading into the least recently used slot no sequence
of the step needs), and the layers add their LoRA terms for it (engine.lora.batched).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from engine.config import EngineConfig
from engine.lora.adapter import LoRAAdapter, load_adapter
from engine.lora.batched import LoRASlots, LoRAStep, StepSource
from engine.lora.embedding import EmbeddingLoRASlots
from engine.lora.request import LoRAAdapterError, LoRARequest
from engine.lora.targets import EmbeddingTarget, adaptable_layers, num_parts
from engine.models.interface import CausalLM

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self, model: CausalLM, config: EngineConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.max_loras = config.max_loras
        self.max_rank = config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        self.model = model
        self._device, self._dtype = device, dtype
        self.steps = StepSource()
        self._slots: dict[int, LoRASlots] = {}  # id(base layer) -> its slots
        for layer in [*adaptable_layers(model), model.lm_head]:
            if layer.lora is not None:
                raise ValueError("a layer already has LoRA slots")
            slots = LoRASlots(
                self.max_loras,
                layer.in_features,
                layer.out_features,
                num_parts(layer) * self.max_rank,
                self.steps,
                device,
                dtype,
            )
            layer.lora = slots
            self._slots[id(layer)] = slots
        self._embedding: EmbeddingLoRASlots | None = None
        embedding = model.input_embedding()
        if embedding is not None:
            self._embedding = EmbeddingLoRASlots(
                self.max_loras,
                model.vocab_size,
                model.hidden_size,
                self.max_rank,
                self.steps,
                device,
                dtype,
            )
            embedding.lora = self._embedding
        # Every adapter asked for (ids are never reused for other weights): where to reload from.
        self._known: dict[int, LoRARequest] = {}
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU, host memory
        self._resident: OrderedDict[int, int] = OrderedDict()  # id -> slot, LRU
        # Adapters known here since the last take_new_adapters: tensor-parallel executors load
        # them too, before the step that first uses them.
        self._unshared: list[LoRARequest] = []
        logger.info(
            "LoRA: %d slots of rank <= %d (%.1f MiB), %d adapters in host memory",
            self.max_loras,
            self.max_rank,
            self.slot_bytes / 2**20,
            self.max_cpu_loras,
        )

    @property
    def slot_bytes(self) -> int:
        embedding = 0 if self._embedding is None else self._embedding.nbytes
        return embedding + sum(slots.nbytes for slots in self._slots.values())

    @property
    def loaded_ids(self) -> list[int]:
        return list(self._loaded)

    @property
    def resident_ids(self) -> list[int]:
        return list(self._resident)

    @property
    def cached_ids(self) -> list[int]:
        """Adapters in host memory but in no slot: a step that needs one copies it in."""
        return [lora_id for lora_id in self._loaded if lora_id not in self._resident]

    def add(self, request: LoRARequest) -> None:
        """Load and check `request`'s adapter (raises LoRAAdapterError naming the problem)."""
        known = self._known.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise LoRAAdapterError(
                f"LoRA id {request.lora_int_id} already names {known.lora_path!r}, not "
                f"{request.lora_path!r}: one id, one adapter"
            )
        self._load(request)
        if known is None:
            self._unshared.append(request)
        self._known[request.lora_int_id] = request

    def take_new_adapters(self) -> bytes:
        """The adapters added since the last call, encoded for add_encoded on another rank."""
        requests, self._unshared = self._unshared, []
        if not requests:
            return b""
        return json.dumps([[r.lora_name, r.lora_int_id, r.lora_path] for r in requests]).encode()

    def add_encoded(self, encoded: bytes) -> None:
        """Add the adapters another rank's take_new_adapters encoded."""
        for name, lora_id, path in json.loads(encoded):
            self.add(LoRARequest(name, lora_id, path))
        self._unshared.clear()

    def _load(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._loaded.get(request.lora_int_id)
        if adapter is None:
            adapter = load_adapter(request, self.model, self.max_rank)
            self._loaded[request.lora_int_id] = adapter
            while len(self._loaded) > self.max_cpu_loras:
                evicted, _ = self._loaded.popitem(last=False)
                logger.info("LoRA adapter %d evicted from host memory", evicted)
        self._loaded.move_to_end(request.lora_int_id)
        return adapter

    def _slot_for(self, lora_id: int, in_use: set[int]) -> int:
        slot = self._resident.get(lora_id)
        if slot is None:
            free = set(range(self.max_loras)) - set(self._resident.values())
            if free:
                slot = min(free)
            else:
                victim = next((i for i in self._resident if self._resident[i] not in in_use), None)
                if victim is None:
                    raise RuntimeError(f"more than max_loras={self.max_loras} adapters in a step")
                slot = self._resident.pop(victim)
            self._write(slot, self._load(self._known[lora_id]))
            self._resident[lora_id] = slot
        self._resident.move_to_end(lora_id)
        return slot

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for slots in self._slots.values():
            slots.clear(slot)
        if self._embedding is not None:
            self._embedding.clear(slot)
        for projection in adapter.projections:
            target = projection.target
            if isinstance(target, EmbeddingTarget):
                assert self._embedding is not None  # the adapter was checked against the model
                self._embedding.write(slot, projection.a, projection.b)
                continue
            rows = slice(target.start, target.stop)
            first_column = target.part * self.max_rank
            self._slots[id(target.layer)].write(
                slot, first_column, rows, projection.a, projection.b
            )

    @contextlib.contextmanager
    def step(
        self,
        lora_ids: Sequence[int],
        query_lens: Sequence[int],
        sample_rows: np.ndarray | None,
    ) -> Iterator[LoRAStep]:
        """The layers add each sequence's adapter (lora_ids: per sequence, 0 for none, each
        with query_lens tokens; sample_rows: the rows the last layer keeps, None: all) while
        this is open."""
        seq_slots: np.ndarray = np.full(len(lora_ids), -1, dtype=np.int64)
        in_use: set[int] = set()
        for index, lora_id in enumerate(lora_ids):
            if lora_id:
                seq_slots[index] = slot = self._slot_for(lora_id, in_use)
                in_use.add(slot)
        token_slots: np.ndarray = np.repeat(seq_slots, np.asarray(query_lens, dtype=np.int64))
        self.steps.current = LoRAStep.of(token_slots, sample_rows, self._device, self._dtype)
        try:
            yield self.steps.current
        finally:
            self.steps.current = LoRAStep()
