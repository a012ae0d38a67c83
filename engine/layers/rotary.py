"""Neox-style rotary position embedding with a precomputed cos/sin cache (default, linear, llama3).

cos_sin_cache layout (shared with the Triton kernel): [max_position, head_dim] float32, row p is
cat(cos(p * inv_freq), sin(p * inv_freq)) with inv_freq of length head_dim / 2.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.platforms.cpu import glue as cpu_glue

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from an HF config, for both the v5 `rope_parameters` and v4 fields."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope type {rope_type!r} is not supported ({SUPPORTED_ROPE_TYPES})"
        )
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial rotary embeddings are not supported")
    return theta, ({**scaling, "rope_type": rope_type} if rope_type != "default" else None)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inverse_frequencies(inv_freq, scaling)


def _llama3_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin_cache", self._compute_cache(), persistent=False)

    def _compute_cache(self) -> torch.Tensor:
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
        positions = torch.arange(self.max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def init_buffers(self) -> None:
        """Recompute the cache after the module was materialized from the meta device."""
        self.cos_sin_cache = self._compute_cache().to(self.cos_sin_cache.device)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step (cos, signed sin), each [T, 1, head_dim], shared by every layer (CPU path)."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).to(dtype).chunk(2, dim=-1)
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, H*D] and k [T, Hkv*D]; returns [T, H, D] and [T, Hkv, D]."""
        num_tokens = q.shape[0]
        if q.is_cuda:
            from kernels import rotary_embedding

            rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_dim)  # in place
            return q.view(num_tokens, -1, self.head_dim), k.view(num_tokens, -1, self.head_dim)
        cos, sin = cos_sin if cos_sin is not None else self.lookup(positions, q.dtype)
        return cpu_glue.current().rotate(q, k, cos, sin, self.head_dim)
