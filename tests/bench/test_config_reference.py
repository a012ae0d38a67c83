"""README's configuration reference must match the settings classes it is generated from."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "config_reference", REPO / "scripts" / "config_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("config_reference", module)
    spec.loader.exec_module(module)
    return module


def test_readme_configuration_reference_is_up_to_date() -> None:
    script = _load_script()
    in_readme = script.read_block((REPO / "README.md").read_text(), script.BLOCK)
    assert in_readme is not None, (
        "README.md lacks the <!-- config-reference:start/end --> markers of its Configuration "
        f"section; add them and run `{script.REGENERATE}`"
    )
    assert in_readme == script.render().strip("\n"), (
        "README.md's configuration reference no longer matches WorkerSettings / ApiSettings "
        f"(a field was added, removed or changed). Regenerate it with `{script.REGENERATE}` "
        "and commit README.md."
    )


def test_every_settings_field_has_its_environment_variable_listed() -> None:
    script = _load_script()
    text = script.render()
    for _, cls in script.settings_classes():
        for name, field in cls.model_fields.items():
            row = next(line for line in text.splitlines() if f"`INFERQ_{name.upper()}`" in line)
            if field.description:
                assert script._cell(field.description) in row
