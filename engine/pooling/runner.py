"""The pooling runner: owns an encoder or a decoder and turns a packed batch of token id lists
into pooled vectors in one forward. Nothing is kept between batches: a decoder's K/V lives in
a scratch cache allocated for the batch alone and dropped after its forward."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.selector import get_attention_backend
from engine.config import EngineConfig
from engine.kv_cache import KVCache, KVCacheSpec
from engine.model_runner import resolve_device, resolve_dtype
from engine.models.bert import BertEncoder, EncoderShape, is_cross_encoder, load_encoder
from engine.models.checkpoint import SafetensorsCheckpoint
from engine.models.interface import CausalLM
from engine.models.loader import build_model, load_weights
from engine.platforms.cpu.matmul_tuning import tune_model
from engine.pooling.model_config import ENCODER_MODEL_TYPES, PoolerConfig, read_pooler_config
from engine.pooling.pooler import pool
from schemas.pooling import PoolingType

logger = logging.getLogger(__name__)


class BareDecoderCheckpoint(SafetensorsCheckpoint):
    """A decoder checkpoint as the causal-LM families name it, also when it was saved as the
    bare transformer (Qwen3-Embedding: `layers.N...` without `model.`, and no lm_head). The
    pooling runner never reads the LM head, so a missing one is filled from the embedding."""

    def __init__(self, model_path: Path, needs_lm_head: bool) -> None:
        super().__init__(model_path)
        renamed = {}
        for name, entry in self.entries.items():
            bare = not name.startswith(("model.", "lm_head."))
            renamed["model." + name if bare else name] = entry
        if needs_lm_head and "lm_head.weight" not in renamed:
            renamed["lm_head.weight"] = renamed["model.embed_tokens.weight"]
        self.entries = renamed


class PoolingRunner:
    def __init__(self, config: EngineConfig, model_path: Path, hf_config: Any) -> None:
        self.device = resolve_device(config.device)
        # Embeddings are compared across models and runs: float32 on the CPU unless asked.
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.is_encoder = hf_config.model_type in ENCODER_MODEL_TYPES
        self.pooler: PoolerConfig = read_pooler_config(model_path, self.is_encoder)
        self.encoder: BertEncoder | None = None
        self.decoder: CausalLM | None = None
        # A cross-encoder: one score per label of each (pair) input instead of a vector.
        self.num_labels: int | None = None
        if self.is_encoder:
            self.encoder = load_encoder(hf_config, model_path, self.device, self.dtype)
            if self.device.type == "cpu":
                # Every call is prefill-sized: MKL's sgemm, torch's default for fp32, reaches
                # half of what oneDNN or our panels do on some CPUs (AMD with AVX-512).
                shapes = self.encoder.linear_shapes()
                tune_model(self.encoder, shapes, self.dtype, config.cpu_matmul)
            model_limit = EncoderShape.read(hf_config).max_tokens
            self.hidden_size = self.encoder.hidden_size
            if is_cross_encoder(hf_config):
                self.num_labels = int(hf_config.num_labels)
        else:
            self.decoder = self._load_decoder(config, model_path, hf_config)
            model_limit = self.decoder.dims.max_position_embeddings
            self.hidden_size = self.decoder.hidden_size
            self.kv_spec = KVCacheSpec.for_model(self.decoder, config.block_size, self.dtype)
        limits = [model_limit, config.max_model_len, self.pooler.max_seq_length]
        self.max_model_len = min(limit for limit in limits if limit)
        logger.info(
            "pooling runner: %s on %s (%s), pooling %s, normalize %s, max_model_len %d",
            "encoder" if self.is_encoder else type(self.decoder).__name__,
            self.device,
            self.dtype,
            self.pooler.pooling_type.value,
            self.pooler.normalize,
            self.max_model_len,
        )

    def _load_decoder(self, config: EngineConfig, model_path: Path, hf_config: Any) -> CausalLM:
        self.backend = get_attention_backend(config.attention_backend, self.device)
        # Built with placeholder weights, then filled from the checkpoint in whichever naming
        # it was saved.
        model = build_model(hf_config, self.backend, self.device, self.dtype, load_format="dummy")
        if config.load_format == "auto":
            checkpoint = BareDecoderCheckpoint(model_path, not model.tie_word_embeddings)
            load_weights(model, checkpoint)
        return model

    @torch.inference_mode()
    def run(
        self,
        token_ids: Sequence[list[int]],
        types: Sequence[PoolingType],
        token_type_ids: Sequence[list[int] | None] = (),
    ) -> torch.Tensor:
        """Pool every sequence of the batch: float32 [B, hidden]; a cross-encoder's scores
        instead: float32 [B, num_labels]. token_type_ids: an encoder's segment of each token
        (a pair's second text is segment 1); none: every token is segment 0."""
        lens = [len(ids) for ids in token_ids]
        if not self.is_encoder:
            return pool(self._decode(token_ids), lens, types)
        hidden = self._encode(token_ids, token_type_ids)
        if self.num_labels is not None:
            assert self.encoder is not None and self.encoder.head is not None
            starts = torch.tensor([0, *np.cumsum(lens)[:-1].tolist()], device=hidden.device)
            return self.encoder.head(hidden.index_select(0, starts)).float()
        return pool(hidden, lens, types)

    def _encode(
        self, token_ids: Sequence[list[int]], token_type_ids: Sequence[list[int] | None]
    ) -> torch.Tensor:
        """The encoder over the batch padded to its longest sequence -> flat [T, hidden]."""
        assert self.encoder is not None
        lens = np.asarray([len(ids) for ids in token_ids])
        width = int(lens.max())
        mask = np.arange(width)[None, :] < lens[:, None]
        ids = np.zeros((len(token_ids), width), dtype=np.int64)
        ids[mask] = np.concatenate([np.asarray(t, dtype=np.int64) for t in token_ids])
        segments = np.zeros_like(ids)
        if any(t is not None for t in token_type_ids):
            segments[mask] = np.concatenate(
                [
                    np.asarray(t if t is not None else [0] * n, dtype=np.int64)
                    for t, n in zip(token_type_ids, lens, strict=True)
                ]
            )
        ids_t = torch.from_numpy(ids).to(self.device)
        mask_t = torch.from_numpy(mask.astype(np.int64)).to(self.device)
        hidden = self.encoder(ids_t, torch.from_numpy(segments).to(self.device), mask_t)
        return hidden[mask_t.bool()]

    def _decode(self, token_ids: Sequence[list[int]]) -> torch.Tensor:
        """The decoder over the packed batch, each sequence a whole prefill into a scratch
        KV cache of its own blocks -> [T, hidden]."""
        assert self.decoder is not None
        block_size = self.kv_spec.block_size
        lens = [len(ids) for ids in token_ids]
        blocks = [-(-n // block_size) for n in lens]
        first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]])
        tables = np.zeros((len(lens), max(blocks)), dtype=np.int32)
        for row, (start, count) in enumerate(zip(first_block, blocks, strict=True)):
            tables[row, :count] = np.arange(start, start + count)
        positions = np.concatenate([np.arange(n) for n in lens])
        seq_index = np.repeat(np.arange(len(lens)), lens)
        slots = (
            tables[seq_index, positions // block_size].astype(np.int64) * block_size
            + positions % block_size
        )
        cu = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        device = self.device

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        meta = AttentionMetadata(
            slot_mapping=to_device(slots),
            query_start_loc=to_device(cu),
            seq_lens=to_device(np.asarray(lens, dtype=np.int32)),
            block_tables=to_device(tables),
            max_query_len=max(lens),
            max_seq_len=max(lens),
            query_lens_cpu=lens,
            seq_lens_cpu=lens,
        )
        scratch = KVCache(self.kv_spec, int(sum(blocks)), device)
        flat = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in token_ids])
        return self.decoder(to_device(flat), to_device(positions), scratch.layers, meta)
