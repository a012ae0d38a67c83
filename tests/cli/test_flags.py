"""Flags derived from a settings model: one per field, typed as the field, overriding the
environment only when given."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from cli.flags import SettingsCommand, add_settings_arguments, same_setting


class DemoSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DEMO_", extra="ignore")

    count: int = Field(3, ge=1, description="how many")
    ratio: float | None = None
    mode: Literal["fast", "slow"] = "fast"
    verbose: bool = False
    path: Path | None = None
    limits: dict[str, int] = Field(default_factory=dict)
    secret: str = ""


def parse(argv: list[str], **options: object):
    parser = argparse.ArgumentParser()
    flags = add_settings_arguments(parser, DemoSettings, **options)
    return flags, parser.parse_args(argv)


def test_each_field_is_a_flag_of_its_type() -> None:
    argv = ["--count", "5", "--ratio", "0.5", "--mode", "slow", "--verbose", "--path", "/x"]
    flags, args = parse([*argv, "--limits", '{"a": 1}'])
    settings = flags.settings(args)
    assert (settings.count, settings.ratio, settings.mode, settings.verbose) == (
        5,
        0.5,
        "slow",
        True,
    )
    assert settings.path == Path("/x") and settings.limits == {"a": 1}


def test_choices_come_from_the_literal(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--mode", "medium"])
    assert "invalid choice" in capsys.readouterr().err


def test_only_given_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEMO_COUNT", "7")
    monkeypatch.setenv("DEMO_VERBOSE", "true")
    flags, args = parse(["--no-verbose"])
    assert flags.given(args) == {"verbose": False}
    settings = flags.settings(args)
    assert settings.count == 7 and settings.verbose is False


def test_help_names_description_variable_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "how many (env DEMO_COUNT; default 3)" in out
    assert "--verbose, --no-verbose" in out


def test_excluded_fields_have_no_flag(capsys: pytest.CaptureFixture[str]) -> None:
    flags, _ = parse([], exclude=("secret",))
    assert "secret" not in flags.names
    with pytest.raises(SystemExit):
        parse(["--secret", "x"], exclude=("secret",))


def test_a_refused_setting_ends_the_command_with_its_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags, args = parse(["--count", "0"])
    ran: list[DemoSettings] = []
    command = SettingsCommand("demo", flags, lambda settings, _: ran.append(settings) or 0)
    assert command(args, []) == 2
    assert not ran
    err = capsys.readouterr().err
    assert "inferq demo: error" in err and "count" in err
    assert len(err.strip().splitlines()) == 1  # which flag / variable and why, on one line
    assert "--count / DEMO_COUNT: Input should be greater than or equal to 1" in err


def test_same_setting_copies_default_bounds_and_help() -> None:
    class Other(BaseSettings):
        model_config = SettingsConfigDict(env_prefix="OTHER_")
        count: int = same_setting(DemoSettings, "count")

    field = Other.model_fields["count"]
    assert (field.default, field.description) == (3, "how many")
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        Other(count=0)
