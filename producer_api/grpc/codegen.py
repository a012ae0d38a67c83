"""Generate the Python stubs of the gRPC service from its .proto (grpcio-tools' protoc).

    python -m producer_api.grpc.codegen            # rewrite the committed stubs
    python -m producer_api.grpc.codegen --check    # exit 1 when they are out of date

The stubs are committed, so installing inferq needs no code generator; a test regenerates them
into a temporary folder and compares (`stubs_are_current`).
"""

from __future__ import annotations

import argparse
import importlib.resources
import sys
import tempfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding producer_api/
PROTO = Path("producer_api/grpc/proto/inferq/v1/inference.proto")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# protoc stamps the versions of the tools that generated a file; those lines may differ between
# two machines whose stubs are otherwise the same.
_VERSION_STAMPS = ("# Protobuf Python Version:", "GRPC_GENERATED_VERSION", "_runtime_version.")


class CodegenError(Exception):
    pass


def generated_files(root: Path = PACKAGE_ROOT) -> list[Path]:
    stem = (root / PROTO).with_suffix("")
    return [stem.with_name(stem.name + suffix) for suffix in GENERATED_SUFFIXES]


def generate(out: Path) -> list[Path]:
    """Write the stubs under `out` (at PROTO's place relative to it); returns their paths."""
    from grpc_tools import protoc

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    args = [
        "protoc",
        f"-I{PACKAGE_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        raise CodegenError(f"protoc failed on {PROTO}")
    return generated_files(out)


def _comparable(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.lstrip().startswith(_VERSION_STAMPS)]


def stale_stubs() -> list[str]:
    """The committed stubs that differ from freshly generated ones (version stamps aside)."""
    with tempfile.TemporaryDirectory() as folder:
        fresh = generate(Path(folder))
        stale = []
        for committed, generated in zip(generated_files(), fresh, strict=True):
            if not committed.exists() or _comparable(committed.read_text()) != _comparable(
                generated.read_text()
            ):
                stale.append(str(committed.relative_to(PACKAGE_ROOT)))
        return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the committed stubs")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs()
        for path in stale:
            print(f"out of date: {path} (run python -m producer_api.grpc.codegen)")
        return 1 if stale else 0
    for path in generate(PACKAGE_ROOT):
        print(path.relative_to(PACKAGE_ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
