"""What a model folder says about pooling: the sentence-transformers modules (`modules.json`,
`1_Pooling/config.json`, a Normalize module, `sentence_bert_config.json`), else the defaults of
the model's kind (vLLM's: CLS for encoders, the last token for decoders, both normalized)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from schemas.pooling import PoolingParams, PoolingType

_ST_PREFIX = "sentence_transformers.models."
# Pooling modes of 1_Pooling/config.json we compute, by their flag name.
_MODES = {
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_lasttoken": PoolingType.LAST,
}
# Encoder architectures (bidirectional attention, engine.models.bert); every other served
# architecture is a decoder.
ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta"})
# Architectures that are a bare transformer, no LM head: only pooling serves them.
_BARE_SUFFIX = "Model"


class PoolingConfigError(ValueError):
    """The folder's sentence-transformers modules ask for what the engine does not compute."""


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: PoolingType
    normalize: bool
    max_seq_length: int | None = None  # sentence-transformers' own cap on input tokens

    def resolve(self, params: PoolingParams) -> tuple[PoolingType, bool]:
        """The pooling type and normalization one request gets."""
        pooling = params.pooling_type or self.pooling_type
        normalize = self.normalize if params.normalize is None else params.normalize
        return pooling, normalize


def is_sentence_transformers_folder(model_path: Path) -> bool:
    return (model_path / "modules.json").exists()


def is_bare_model(architectures: list[str] | None) -> bool:
    """Whether the config names only a bare transformer (e.g. BertModel): no generation."""
    named = architectures or []
    return bool(named) and all(arch.endswith(_BARE_SUFFIX) for arch in named)


def read_pooler_config(model_path: Path, is_encoder: bool) -> PoolerConfig:
    if not is_sentence_transformers_folder(model_path):
        default = PoolingType.CLS if is_encoder else PoolingType.LAST
        return PoolerConfig(default, normalize=True)
    modules = json.loads((model_path / "modules.json").read_text())
    pooling: PoolingType | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST_PREFIX)
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = _read_pooling(model_path / module.get("path", ""))
        elif kind == "Normalize":
            normalize = True
        else:
            raise PoolingConfigError(
                f"{model_path}: sentence-transformers module {module.get('type')!r} is not "
                "computed by the engine (Transformer, Pooling and Normalize are)"
            )
    if pooling is None:
        pooling = PoolingType.CLS if is_encoder else PoolingType.LAST
    return PoolerConfig(pooling, normalize, _read_max_seq_length(model_path))


def _read_pooling(folder: Path) -> PoolingType:
    config = json.loads((folder / "config.json").read_text())
    chosen = [mode for flag, mode in _MODES.items() if config.get(flag)]
    others = [
        flag
        for flag, value in config.items()
        if flag.startswith("pooling_mode_") and value and flag not in _MODES
    ]
    if others or len(chosen) != 1:
        raise PoolingConfigError(
            f"{folder}: pooling {sorted(others) or chosen} is not computed; the engine pools "
            "by exactly one of the CLS token, the mean of the tokens, or the last token"
        )
    return chosen[0]


def _read_max_seq_length(model_path: Path) -> int | None:
    config = model_path / "sentence_bert_config.json"
    if not config.exists():
        return None
    value = json.loads(config.read_text()).get("max_seq_length")
    return int(value) if value else None
