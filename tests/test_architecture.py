"""The architecture's import table, enforced: who may import whom among the project's packages,
and which libraries each one must not know about. Every import in every .py file counts, at
module level or inside a function (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("schemas", "kernels", "engine", "redis_io", "worker", "producer_api", "cli")
HTTP = frozenset({"fastapi", "starlette", "uvicorn", "httpx"})
MODEL_RUNTIME = frozenset({"torch", "triton", "transformers", "safetensors", "numpy"})


@dataclass(frozen=True)
class Rule:
    may_import: frozenset[str]  # project packages besides itself
    must_not_know: frozenset[str] = frozenset()  # third-party libraries
    only_libraries: frozenset[str] | None = None  # if set: no other third-party library


RULES = {
    # the wire contract: no project package, no model runtime, no Redis client, no HTTP
    "schemas": Rule(frozenset(), MODEL_RUNTIME | HTTP | {"redis", "arq"}),
    # kernels know torch / triton (and numpy) only
    "kernels": Rule(frozenset(), only_libraries=frozenset({"torch", "triton", "numpy"})),
    # the engine: no Redis, no HTTP
    "engine": Rule(frozenset({"schemas", "kernels"}), HTTP | {"redis", "arq"}),
    # Redis I/O shared by the worker, the API and the CLI: the contract and a Redis client only
    "redis_io": Rule(frozenset({"schemas"}), only_libraries=frozenset({"redis"})),
    # the worker joins Redis to the engine and knows nothing of HTTP
    "worker": Rule(frozenset({"schemas", "engine", "redis_io"}), HTTP),
    # the API and the client backend apps import: never the engine or its runtime
    "producer_api": Rule(frozenset({"schemas", "redis_io"}), MODEL_RUNTIME),
    # the command line sits above the others and may import them all
    "cli": Rule(frozenset(PACKAGES)),
}


def imported_modules(source: str, filename: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import; relative imports stay in their package
    and are skipped. `importlib.import_module("literal")` counts as an import too."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and (module := _import_module_literal(node)):
            found.append((node.lineno, module))
    return found


def _import_module_literal(call: ast.Call) -> str | None:
    """The module of `import_module("name")` / `importlib.import_module("name")`, else None."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else None
    if isinstance(func, ast.Name):
        name = func.id
    first = call.args[0] if call.args else None
    if name == "import_module" and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def import_violations(package: str, filename: str, source: str) -> list[str]:
    """`file:line: imports <module> (<why>)` for each import the package's rule forbids."""
    problems = []
    for line, module in imported_modules(source, filename):
        why = _forbidden(package, module.split(".")[0])
        if why:
            problems.append(f"{filename}:{line}: imports {module} ({why})")
    return problems


def _forbidden(package: str, top: str) -> str | None:
    """Why `package` must not import the top-level module `top`, or None when it may."""
    rule = RULES[package]
    if top in (package, "__future__"):
        return None
    if top in PACKAGES:
        if top in rule.may_import:
            return None
        allowed = ", ".join(sorted(rule.may_import)) or "no other project package"
        return f"{package} may import only {allowed}"
    if top in rule.must_not_know:
        return f"{package} must not know about {top}"
    if rule.only_libraries is not None and top not in rule.only_libraries | sys.stdlib_module_names:
        return f"{package} may use only {', '.join(sorted(rule.only_libraries))}"
    return None


def package_files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_follow_the_architecture(package: str) -> None:
    files = package_files(package)
    assert files, f"no .py files under {package}/"
    problems = []
    for path in files:
        relative = str(path.relative_to(REPO))
        problems += import_violations(package, relative, path.read_text(encoding="utf-8"))
    assert not problems, "imports against the architecture:\n" + "\n".join(problems)


def test_nothing_imports_the_cli() -> None:
    assert all("cli" not in rule.may_import for name, rule in RULES.items() if name != "cli")


def test_the_checker_names_file_line_and_import_of_a_violation() -> None:
    source = (
        '"""A worker module that reaches into HTTP."""\n'
        "import asyncio\n"
        "from schemas import Job\n"
        "\n"
        "def serve():\n"
        "    from producer_api.settings import ApiSettings\n"
        "    import fastapi\n"
        "    from . import sibling\n"
    )
    problems = import_violations("worker", "worker/bad.py", source)
    assert problems == [
        "worker/bad.py:6: imports producer_api.settings (worker may import only engine, redis_io, "
        "schemas)",
        "worker/bad.py:7: imports fastapi (worker must not know about fastapi)",
    ]


def test_the_checker_sees_lazy_and_dynamic_imports_in_every_package() -> None:
    assert import_violations("schemas", "s.py", "def f():\n    import torch\n") == [
        "s.py:2: imports torch (schemas must not know about torch)"
    ]
    assert import_violations("kernels", "k.py", "import redis\nimport math\n") == [
        "k.py:1: imports redis (kernels may use only numpy, torch, triton)"
    ]
    assert import_violations(
        "engine", "e.py", "import importlib\nimportlib.import_module('cli.main')\n"
    )
    assert import_violations("producer_api", "p.py", "from engine.llm import LLM\n")
    assert import_violations("redis_io", "r.py", "from worker.logs import log_event\n") == [
        "r.py:1: imports worker.logs (redis_io may import only schemas)"
    ]
    assert import_violations("redis_io", "r.py", "import httpx\n") == [
        "r.py:1: imports httpx (redis_io may use only redis)"
    ]
    assert not import_violations("cli", "c.py", "import engine, worker, producer_api, torch\n")
