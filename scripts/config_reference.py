"""The README's configuration reference, rendered from the settings classes themselves.

    python scripts/config_reference.py           # print the markdown
    python scripts/config_reference.py --write   # refresh README.md between the markers
    python scripts/config_reference.py --check   # exit 1 when README.md is out of date

Every field of the worker's engine settings (derived from `engine.config.EngineConfig`),
`worker.settings.WorkerSettings`, `producer_api.settings.ApiSettings` and
`producer_api.grpc.settings.GrpcSettings` becomes a row: its
environment variable, type (with bounds), default and description. The comment block above a
group of fields in the class source becomes a heading row, so the reference carries the same
explanations as the code without anyone copying them by hand.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common.markdown_blocks import read_block, replace_block

REPO = Path(__file__).resolve().parent.parent
BLOCK = "config-reference"
README = REPO / "README.md"
REGENERATE = "python scripts/config_reference.py --write"
SHARED_PREFIX = "INFERQ_"


def settings_classes() -> list[tuple[str, type]]:
    """Each table: a title and the settings class whose own fields it lists (a class's fields
    inherited from another settings class are that class's table)."""
    from producer_api.grpc.settings import GrpcSettings
    from producer_api.settings import ApiSettings
    from schemas.redis_connection import RedisConnectionSettings
    from worker.engine_settings import EngineSettings
    from worker.settings import WorkerSettings

    return [
        ("Redis connection (every process)", RedisConnectionSettings),
        ("Engine (`inferq worker`)", EngineSettings),
        ("Worker (`inferq worker`)", WorkerSettings),
        ("API (`inferq api`)", ApiSettings),
        ("gRPC API (`inferq grpc`)", GrpcSettings),
    ]


def declared_in(cls: type) -> type:
    """The class whose source declares `cls`'s fields, with the group comments: the engine
    settings are made at run time from `EngineConfig`."""
    from engine.config import EngineConfig
    from worker.engine_settings import EngineSettings

    return EngineConfig if cls is EngineSettings else cls


def type_name(annotation: object) -> str:
    """`int | None`, `"auto" | "cpu"`, `dict[str, int]`: how a user would write the value."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if annotation is type(None):
        return "None"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥"}


def bounds(field) -> str:
    parts = []
    for item in field.metadata:
        for attr, symbol in _BOUNDS.items():
            value = getattr(item, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    return ", ".join(parts)


def default_text(field) -> str:
    if field.default_factory is not None:
        if field.default_factory in (dict, list):
            return f"`{field.default_factory()}`"
        return f"computed by `{field.default_factory.__name__}()`"
    if field.default is None:
        return "unset"
    if isinstance(field.default, str):
        return f'`"{field.default}"`' if field.default else '`""`'
    return f"`{field.default}`"


def group_comments(cls: type) -> dict[str, str]:
    """field name -> the comment block right above it in the class body (group headings)."""
    lines = inspect.getsource(cls).splitlines()
    groups, pending = {}, []
    for line in lines:
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# ").strip())
            continue
        match = re.match(r"\s{4}(\w+)\s*:", line)
        if match and pending:
            groups[match.group(1)] = " ".join(pending)
        pending = []
    return groups


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_class(title: str, cls: type) -> str:
    # the Redis connection fields are a mixin without a prefix of its own; every settings class
    # that inherits them reads INFERQ_*
    prefix = cls.model_config.get("env_prefix") or SHARED_PREFIX
    groups = group_comments(declared_in(cls))
    doc = " ".join((cls.__doc__ or "").split())
    rows = ["| variable | type | default | description |", "|---|---|---|---|"]
    own = inspect.get_annotations(cls)
    for name, field in cls.model_fields.items():
        if name not in own:
            continue
        if name in groups:
            rows.append(f"| **{_cell(groups[name])}** | | | |")
        kind = type_name(field.annotation)
        limit = bounds(field)
        type_cell = f"`{kind}`" + (f" ({limit})" if limit else "")
        rows.append(
            f"| `{prefix}{name.upper()}` | {_cell(type_cell)} | {_cell(default_text(field))} "
            f"| {_cell(field.description or '')} |"
        )
    return f"### {title}\n\n{doc}\n\n" + "\n".join(rows)


def render() -> str:
    intro = (
        f"_Generated from the settings classes by `{REGENERATE}`; do not edit by hand._ "
        "Every setting is read from the environment; dicts and "
        "lists are JSON."
    )
    return "\n\n".join([intro, *(render_class(t, c) for t, c in settings_classes())])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="refresh README.md")
    action.add_argument("--check", action="store_true", help="exit 1 when README is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        README.write_text(replace_block(README.read_text(), BLOCK, text))
        print(f"updated {README}")
    elif args.check:
        if read_block(README.read_text(), BLOCK) != text.strip("\n"):
            print(f"README.md's configuration reference is stale; run: {REGENERATE}")
            return 1
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
