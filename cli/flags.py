"""Command-line flags derived from a pydantic settings model, so a setting is declared once.

Every field becomes `--field-name` (Literal fields get their values as choices, booleans a
`--flag/--no-flag` pair, dicts and lists take JSON) with the field's description as its help.
Flags default to None, meaning "not given": the model then reads the environment
(`INFERQ_<FIELD>`) and its own default, so a flag overrides the environment and nothing else.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)

# --help title of the engine's arguments wherever a command takes them
ENGINE_SECTION = "engine arguments (engine.config.EngineConfig; unset: the engine's default)"


@dataclass(frozen=True)
class SettingsFlags(Generic[S]):
    """The flags one settings model added to a parser, and how to build the model from them."""

    model: type[S]
    names: tuple[str, ...]

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """The settings whose flags were given on the command line."""
        values = vars(args)
        return {name: values[name] for name in self.names if values[name] is not None}

    def settings(self, args: argparse.Namespace) -> S:
        """The model from the flags given, the environment and its defaults, in that order."""
        return self.model(**self.given(args))


def add_settings_arguments(
    parser: argparse.ArgumentParser,
    model: type[S],
    *,
    exclude: Collection[str] = (),
    sections: Mapping[str, Collection[str]] | None = None,
    environment: bool = True,
    aliases: Mapping[str, Collection[str]] | None = None,
) -> SettingsFlags[S]:
    """Add a flag for each field of `model` but those in `exclude`; the fields named in a
    section are listed under that title in `--help`. `environment`: the command builds the
    model (`SettingsFlags.settings`), so the help names each flag's variable; a command that
    passes on only the flags given (`SettingsFlags.given`) says False. `aliases`: more flags
    for a field (`{"grpc_port": ["--port"]}`)."""
    prefix = model.model_config.get("env_prefix", "")
    groups = {}
    for title, members in (sections or {}).items():
        group = parser.add_argument_group(title)
        groups.update(dict.fromkeys(members, group))
    names = []
    for name, field in model.model_fields.items():
        if name in exclude:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = _help(field, f"{prefix}{name}".upper() if environment else None)
        target = groups.get(name, parser)
        flags = [flag, *(aliases or {}).get(name, ())]
        target.add_argument(
            *flags, dest=name, default=None, help=help_text, **_parsing(name, field)
        )
        names.append(name)
    return SettingsFlags(model, tuple(names))


def _help(field: FieldInfo, env_name: str | None) -> str:
    notes = [f"env {env_name}"] if env_name else []
    if field.default is not PydanticUndefined and field.default is not None:
        notes.append(f"default {field.default}")
    parts = [field.description or "", f"({'; '.join(notes)})" if notes else ""]
    return " ".join(part for part in parts if part).replace("%", "%%")


def _parsing(name: str, field: FieldInfo) -> dict[str, Any]:
    """argparse keywords that read the field's type from the command line."""
    annotation = _without_none(field.annotation)
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        return {"choices": choices, "type": type(choices[0])}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin in (dict, list) or annotation in (dict, list) or _is_model(annotation):
        return {"type": json.loads, "metavar": "JSON"}
    parsers: dict[object, Callable[[str], object]] = {int: int, float: float, str: str, Path: Path}
    if annotation in parsers:
        return {"type": parsers[annotation]}
    raise TypeError(f"setting {name!r}: no command-line form for {annotation!r}")


def _is_model(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _without_none(annotation: object) -> object:
    """`T | None` -> T; anything else as it is."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


@dataclass(frozen=True)
class SettingsCommand(Generic[S]):
    """A subcommand run on settings built from its flags, the environment and the defaults; a
    setting refused by the model ends the command with exit code 2 and the reason."""

    name: str
    flags: SettingsFlags[S]
    run: Callable[[S, argparse.Namespace], int]

    def __call__(self, args: argparse.Namespace, extra: list[str]) -> int:
        try:
            settings = self.flags.settings(args)
        except ValidationError as exc:
            print(f"inferq {self.name}: error: {self.reasons(exc)}", file=sys.stderr)
            return 2
        return self.run(settings, args)

    def reasons(self, exc: ValidationError) -> str:
        """The refusals on one line, each naming the flag and variable it came from (never
        the value: it may be a key)."""
        prefix = str(self.flags.model.model_config.get("env_prefix", ""))
        reasons = []
        for error in exc.errors():
            name = ".".join(str(part) for part in error["loc"])
            sources = [f"--{name.replace('_', '-')}"] if name in self.flags.names else []
            sources += [f"{prefix}{name}".upper()] if name else []
            where = " / ".join(sources)
            reasons.append(f"{where}: {error['msg']}" if where else error["msg"])
        return "; ".join(reasons)


def same_setting(model: type[BaseSettings], name: str) -> Any:
    """Field `name` of `model` (default, bounds, description), to declare the same setting in
    another settings class without restating it. Typed Any, as pydantic's `Field()` is."""
    return copy.deepcopy(model.model_fields[name])
