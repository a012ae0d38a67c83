"""Neox-style rotary position embedding with a precomputed cos/sin cache.

Scalings: default, linear, llama3, yarn and longrope, exactly as transformers computes them.
cos_sin_cache layout (shared with the Triton kernel): [max_position, rotary_dim] float32, row p is
cat(cos(p * inv_freq), sin(p * inv_freq)) * attention_factor with inv_freq of length
rotary_dim / 2. rotary_dim is head_dim unless the model rotates only the first part of each
head (partial rotary: only the Python path rotates those, see `RotaryEmbedding.forward`).

LongRoPE has a short and a long set of frequencies. transformers' Phi-3 uses the short set while
a sequence fits original_max_position_embeddings and, once it outgrows it, recomputes the whole
sequence's cache with the long set. A paged cache keeps what it stored, so here row p uses the
long set from p = original_max_position_embeddings on: identical to transformers for every
sequence within the original context; past it, the rows before the boundary keep the short set.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.platforms.cpu import glue as cpu_glue

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"  # HF layer_types


def rope_parameters(
    hf_config: Any, allow_partial: bool = False
) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from an HF config, for both the v5 `rope_parameters` and v4 fields.

    A partial rotary factor (in either place) is refused unless the caller reads it
    (`partial_rotary_factor`). Where the config gives each layer kind its own parameters
    (Gemma 3), these are the full-attention layers'; see `sliding_rope_parameters`."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and FULL_ATTENTION in params:
        params = params[FULL_ATTENTION]
    return _theta_and_scaling(params, hf_config, allow_partial)


def sliding_rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None] | None:
    """The sliding-window layers' own (theta, scaling) where the config gives them one."""
    params = getattr(hf_config, "rope_parameters", None)
    if not isinstance(params, dict) or SLIDING_ATTENTION not in params:
        return None
    return _theta_and_scaling(params[SLIDING_ATTENTION], hf_config, allow_partial=False)


def _theta_and_scaling(
    params: object, hf_config: Any, allow_partial: bool
) -> tuple[float, dict[str, Any] | None]:
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_scaling type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    partial = partial_rotary_factor(hf_config)
    if partial != 1.0 and not allow_partial:
        raise NotImplementedError(
            f"partial_rotary_factor={partial} (partial rotary embeddings) is not supported "
            "by this model family"
        )
    scaling.pop("partial_rotary_factor", None)
    if rope_type in ("yarn", "longrope"):
        # transformers reads these from the top level of older configs (Phi-3).
        top_level = getattr(hf_config, "original_max_position_embeddings", None)
        if top_level is not None:
            scaling["original_max_position_embeddings"] = int(top_level)
        scaling.setdefault(
            "original_max_position_embeddings", int(hf_config.max_position_embeddings)
        )
    return theta, ({**scaling, "rope_type": rope_type} if rope_type != "default" else None)


def partial_rotary_factor(hf_config: Any) -> float:
    """The fraction of each head the rotary embedding turns (1.0: all of it)."""
    params = getattr(hf_config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None)
    return 1.0 if factor is None else float(factor)


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """inv_freq for scalings whose frequencies do not depend on the position."""
    inv_freq = 1.0 / (theta ** _exponents(head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        return _llama3_inverse_frequencies(inv_freq, scaling)
    raise ValueError(f"rope type {scaling['rope_type']!r} needs rope_table")


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim


def rope_table(
    rotary_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    """cos_sin_cache [max_position, rotary_dim] (see the module docstring)."""
    positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
    rope_type = None if scaling is None else scaling["rope_type"]
    if rope_type == "yarn":
        inv_freq, attention_factor = _yarn(rotary_dim, theta, scaling, max_position)
        return _cos_sin(torch.outer(positions, inv_freq), attention_factor)
    if rope_type == "longrope":
        assert scaling is not None
        return _longrope_table(rotary_dim, theta, scaling, max_position, positions)
    inv_freq = inverse_frequencies(rotary_dim, theta, scaling)
    return _cos_sin(torch.outer(positions, inv_freq), 1.0)


def _cos_sin(freqs: torch.Tensor, attention_factor: float) -> torch.Tensor:
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat((cos, sin), dim=-1)


def _scaling_factor(scaling: dict[str, Any], max_position: int) -> float:
    factor = scaling.get("factor")
    if factor is None:
        factor = max_position / scaling["original_max_position_embeddings"]
    return float(factor)


def _yarn(
    dim: int, theta: float, scaling: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    factor = _scaling_factor(scaling, max_position)
    original = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation = 1 - ramp
    pos_freqs = theta ** _exponents(dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope_table(
    dim: int, theta: float, scaling: dict[str, Any], max_position: int, positions: torch.Tensor
) -> torch.Tensor:
    original = int(scaling["original_max_position_embeddings"])
    factor = _scaling_factor(scaling, max_position)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    rows = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32, device="cpu")
        if ext.numel() != dim // 2:
            raise ValueError(f"rope_scaling {key} has {ext.numel()} entries, expected {dim // 2}")
        inv_freq = 1.0 / (ext * theta ** _exponents(dim))
        rows.append(_cos_sin(torch.outer(positions, inv_freq), float(attention_factor)))
    short, long = rows
    return torch.cat((short[:original], long[original:]))


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
        return rope_table(self.head_dim, self.max_position, self.theta, self.scaling)

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


class IdentityRotary(RotaryEmbedding):
    """A table that turns nothing (cos 1, sin 0, so the rotation is exact identity): what the
    fused rotary kernels apply in layers without a position embedding (SmolLM3's NoPE layers)
    or whose q and k were rotated already (partial rotary)."""

    def __init__(self, head_dim: int, max_position: int) -> None:
        super().__init__(head_dim, max_position, 1.0, None)

    def _compute_cache(self) -> torch.Tensor:
        half = self.head_dim // 2
        return torch.cat(
            (
                torch.ones(self.max_position, half, device="cpu"),
                torch.zeros(self.max_position, half, device="cpu"),
            ),
            dim=-1,
        )


class PartialRotary(nn.Module):
    """Rotates the first rotary_dim features of each head (Neox pairs within them), passing the
    rest through, as transformers' partial rotary (Phi-4-mini, partial_rotary_factor)."""

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None,
    ) -> None:
        super().__init__()
        self.inner = RotaryEmbedding(rotary_dim, max_position, theta, scaling)
        self.head_dim, self.rotary_dim = head_dim, rotary_dim

    def rotate_in_place(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """x [T, heads * head_dim] (a view into the fused qkv is fine)."""
        heads = x.view(x.shape[0], -1, self.head_dim)
        part = heads[..., : self.rotary_dim]
        cos, sin = self.inner.lookup(positions, x.dtype)
        half = self.rotary_dim // 2
        swapped = torch.cat((part[..., half:], part[..., :half]), dim=-1)
        part.copy_(torch.addcmul(part * cos, swapped, sin))
