"""A worker's engine settings, derived field by field from `engine.config.EngineConfig`.

Each engine argument becomes an optional `INFERQ_<FIELD>` setting with the bounds and help text
declared on the dataclass; unset (None) leaves the engine's own default, which the help text
names. So a new `EngineConfig` field is a worker setting, an `inferq worker` flag and an
environment variable with no code here.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Any

from pydantic import create_model
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import EngineConfig

ENV_PREFIX = "INFERQ_"
# The model is a worker setting of its own: a worker has a default model, the engine does not.
ENGINE_SETTINGS = tuple(f.name for f in dataclasses.fields(EngineConfig) if f.name != "model")


class InferqSettings(BaseSettings):
    """Settings read from `INFERQ_<FIELD>` environment variables."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")


_HINTS = typing.get_type_hints(EngineConfig, include_extras=True)


def _declared(name: str) -> tuple[Any, FieldInfo]:
    """The type of engine argument `name` and its `Field(...)` (bounds, description)."""
    annotation = _HINTS[name]
    declared = [m for m in typing.get_args(annotation)[1:] if isinstance(m, FieldInfo)]
    if not declared:
        return annotation, FieldInfo()
    return typing.get_args(annotation)[0], FieldInfo.merge_field_infos(*declared)


def _optional_setting(field: dataclasses.Field[Any]) -> tuple[Any, FieldInfo]:
    """`(T | None, Field(None, ...))`: the argument's bounds and help, and its engine default."""
    kind, info = _declared(field.name)
    description = info.description or ""
    if field.default is not None:
        description += f"{'; ' if description else ''}engine default: {field.default}"
    setting = FieldInfo.merge_field_infos(info, default=None, description=description or None)
    return kind | None, setting


def engine_setting(name: str, default: Any) -> Any:
    """Engine argument `name` as a settings field with its bounds and help and this default
    (for a setting a worker declares itself, as the model). Typed Any, as `Field()` is."""
    return FieldInfo.merge_field_infos(_declared(name)[1], default=default)


def _engine_settings_model() -> type[InferqSettings]:
    definitions: dict[str, Any] = {
        f.name: _optional_setting(f)
        for f in dataclasses.fields(EngineConfig)
        if f.name in ENGINE_SETTINGS
    }
    model = create_model("EngineSettings", __base__=InferqSettings, **definitions)
    model.__doc__ = (
        "Engine arguments of a worker (`engine.config.EngineConfig`; `LLM(model, **kwargs)` "
        "takes the same names); unset: the engine's own default."
    )
    return model


# The type checker cannot see fields made at run time: to it the engine settings are a plain
# settings class, and code reads them through `WorkerSettings.engine_config()`.
if TYPE_CHECKING:
    EngineSettings = InferqSettings
else:
    EngineSettings = _engine_settings_model()


def engine_config_of(settings: InferqSettings, model: str) -> EngineConfig:
    """The engine configuration of `model` with every engine setting given (not None)."""
    given = settings.model_dump(include=set(ENGINE_SETTINGS), exclude_none=True)
    return EngineConfig(model=model, **given)
