"""Every engine argument, declared once in `EngineConfig`, is reachable three ways with no code
of its own: `LLM(model, **kwargs)`, `inferq worker --<flag>`, and `INFERQ_<FIELD>`."""

from __future__ import annotations

import dataclasses
import os
import types
import typing

import pytest
from pydantic import BaseModel

import engine.llm
from cli.flags import SettingsCommand
from cli.main import build_parser
from engine.config import EngineConfig
from worker.engine_api import build_engine
from worker.settings import WorkerSettings

FIELDS = dataclasses.fields(EngineConfig)
HINTS = typing.get_type_hints(EngineConfig)


def _value_type(name: str) -> object:
    """The field's type without `| None`."""
    hint = HINTS[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def other_value(field: dataclasses.Field) -> object:
    """A valid value that differs from the field's default, found from its type alone."""
    kind = _value_type(field.name)
    default = None if field.default is dataclasses.MISSING else field.default
    if typing.get_origin(kind) is typing.Literal:
        return next(choice for choice in typing.get_args(kind) if choice != default)
    if kind is bool:
        return not default
    if kind is int:
        return (default or 1) + 3
    if kind is float:
        return default / 2 if default else 0.5
    if kind is str:
        return "some-other-model"
    if isinstance(kind, type) and issubclass(kind, BaseModel):  # a JSON setting: its example
        return kind.model_validate(kind.model_json_schema()["examples"][0])
    raise AssertionError(f"{field.name}: no test value for {kind!r}; extend other_value")


def as_text(value: object) -> str:
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return str(value).lower() if isinstance(value, bool) else str(value)


def flag_argv(name: str, value: object) -> list[str]:
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return [f"--{flag}" if value else f"--no-{flag}"]
    return [f"--{flag}", as_text(value)]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in [v for v in os.environ if v.startswith("INFERQ_")]:
        monkeypatch.delenv(variable)


class RecordingEngine:
    configs: list[EngineConfig] = []

    def __init__(self, config: EngineConfig) -> None:
        RecordingEngine.configs.append(config)


def test_every_field_is_tested() -> None:
    assert {f.name for f in FIELDS} >= {"model", "block_size", "enable_prefix_caching", "seed"}
    for field in FIELDS:
        assert other_value(field) != field.default


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_llm_keyword(field: dataclasses.Field, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.llm, "Engine", RecordingEngine)
    value = other_value(field)
    if field.name == "model":
        engine.llm.LLM(value)
    else:
        engine.llm.LLM("any-model", **{field.name: value})
    assert getattr(RecordingEngine.configs[-1], field.name) == value


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_inferq_worker_flag(field: dataclasses.Field) -> None:
    value = other_value(field)
    args = build_parser().parse_args(["worker", *flag_argv(field.name, value)])
    assert isinstance(args.handler, SettingsCommand)
    settings = args.handler.flags.settings(args)
    assert getattr(settings.engine_config(), field.name) == value


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_environment_variable(field: dataclasses.Field, monkeypatch: pytest.MonkeyPatch) -> None:
    value = other_value(field)
    monkeypatch.setenv(f"INFERQ_{field.name.upper()}", as_text(value))
    assert getattr(WorkerSettings().engine_config(), field.name) == value


@pytest.mark.parametrize("field", FIELDS, ids=lambda f: f.name)
def test_worker_builds_its_engine_with_it(
    field: dataclasses.Field, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.engine

    monkeypatch.setattr(engine.engine, "Engine", RecordingEngine)
    value = other_value(field)
    build_engine(WorkerSettings(**{field.name: value}))
    assert getattr(RecordingEngine.configs[-1], field.name) == value


def test_unset_settings_leave_the_engine_defaults() -> None:
    config = WorkerSettings().engine_config()
    defaults = EngineConfig(model=config.model)
    assert config == defaults


def test_every_engine_argument_has_help_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--help"])
    help_text = capsys.readouterr().out
    for field in FIELDS:
        assert f"--{field.name.replace('_', '-')}" in help_text
        assert WorkerSettings.model_fields[field.name].description, field.name


def test_engine_bounds_are_enforced_on_settings(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["worker", "--max-num-seqs", "0"])
    assert args.handler(args, []) == 2  # refused with the reason, before any engine loads
    assert "inferq worker: error" in capsys.readouterr().err
