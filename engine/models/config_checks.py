"""Config fields that change a model's arithmetic: a family that does not implement one refuses
a config that sets it, naming the field and its value, rather than serving different math.

A field is listed with the values that leave the math as a plain Llama-style decoder computes
it (absent counts as neutral); each family names the fields it implements itself.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _unset(value: object) -> bool:
    return value is None


def _one(value: object) -> bool:
    return value is None or value == 1


def _false(value: object) -> bool:
    return not value


def _all_rope(value: object) -> bool:
    return value is None or (isinstance(value, (list, tuple)) and all(value))


# field -> whether a value leaves the plain decoder's math unchanged
NEUTRAL: dict[str, Callable[[object], bool]] = {
    "attn_logit_softcapping": _unset,
    "final_logit_softcapping": _unset,
    "query_pre_attn_scalar": _unset,
    "embedding_multiplier": _one,
    "residual_multiplier": _one,
    "attention_multiplier": _unset,  # replaces the softmax scale, so any value changes it
    "logits_scaling": _one,
    "no_rope_layers": _all_rope,
    "use_qk_norm": _false,
    "qk_layernorm": _false,
    "use_parallel_residual": _false,
    "clip_qkv": _unset,
    "attention_chunk_size": _unset,
    "use_bidirectional_attention": _false,
}
# The activations of a gated MLP this engine computes, under their transformers names.
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedConfigError(NotImplementedError):
    """The config sets a field that changes the math in a way this family does not compute."""


def refuse_unsupported(
    hf_config: PretrainedConfig,
    handled: Collection[str] = (),
    activations: Collection[str] = ("silu",),
) -> None:
    """Raise naming the first field of hf_config that changes the math and that neither the
    plain decoder nor the family (`handled`, `activations`) computes."""
    family = type(hf_config).__name__
    for field, neutral in NEUTRAL.items():
        if field in handled:
            continue
        value = getattr(hf_config, field, None)
        if not neutral(value):
            raise UnsupportedConfigError(
                f"{field}={value!r} is not supported for {family} models by this engine"
            )
    activation = hidden_activation(hf_config)
    if activation not in activations:
        raise UnsupportedConfigError(
            f"hidden_act={activation!r} is not supported for {family} models "
            f"(supported: {', '.join(activations)})"
        )
    for kind in getattr(hf_config, "layer_types", None) or ():
        if kind not in ATTENTION_LAYER_TYPES:
            raise UnsupportedConfigError(
                f"layer_types entry {kind!r} is not supported (supported: "
                f"{', '.join(ATTENTION_LAYER_TYPES)})"
            )


def hidden_activation(hf_config: PretrainedConfig) -> str:
    value = getattr(hf_config, "hidden_act", None) or getattr(hf_config, "hidden_activation", None)
    return "silu" if value is None else str(value)
