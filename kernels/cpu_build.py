"""Where the CPU kernels' shared library comes from: built once per machine, keyed by content,
then loaded directly by every process and command.

torch's extension builder rebuilds whenever the build.ninja it writes changes, and that file
names the sources' absolute paths and the venv's include folders: a second clone or venv on the
same machine compiled everything again (minutes on two cores). So the build is keyed instead on
what decides the machine code (sources, flags, this CPU's instruction-set flags, torch's
version, see `build_name`): the finished library is kept as `<cache>/<build_name>.so` and a
process that finds it loads it with `torch.ops.load_library`, with no compiler or ninja run. A
file lock makes concurrent first starts (a test run's processes, a worker beside `inferq up`)
build once; the others wait and load the result.

The cache is TORCH_EXTENSIONS_DIR (torch's own setting for where extensions are built, default
~/.cache/torch_extensions), subfolder `inferq`. `python -m kernels.cpu_build` builds ahead of
time (scripts/env.sh runs it); it prints whether a build was needed and how long it took.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

_KERNEL_DIR = Path(__file__).parent / "cpu"
SOURCES = tuple(
    _KERNEL_DIR / name
    for name in (
        "paged_decode.cpp",
        "paged_prefill.cpp",
        "small_matmul.cpp",
        "decode_glue.cpp",
        "decode_stack.cpp",
        "int8_matmul.cpp",
        "panel_matmul.cpp",
        "greedy.cpp",
        "lora.cpp",
    )
)
# What a build usually takes where none was timed here yet: a 2-core VM compiles for about two
# minutes. Once one build finished, its own time is quoted instead (`<cache>/last_build_s`).
TYPICAL_BUILD = "about 2 minutes on 2 cores"


@functools.cache
def cpu_fields() -> dict[str, str]:
    """The first CPU's fields of /proc/cpuinfo ("model name", "flags", ...); {} where absent."""
    fields: dict[str, str] = {}
    try:
        with Path("/proc/cpuinfo").open() as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_flags() -> str:
    """The instruction-set flags (x86 "flags", Arm "Features")."""
    fields = cpu_fields()
    return fields.get("flags") or fields.get("Features", "")


def cache_root() -> Path:
    """The folder holding finished builds (created on first use)."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(base) / "inferq"


@functools.cache
def build_name(cflags: tuple[str, ...]) -> str:
    """The CPU kernels' build: a hash of their sources, flags, this CPU's flags and torch."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *sorted(_KERNEL_DIR.glob("*.h"))):
        digest.update(source.read_bytes())
    digest.update(" ".join(cflags).encode())
    digest.update(cpu_flags().encode())
    digest.update(metadata.version("torch").encode())  # no torch import: set-up checks are quick
    return f"inferq_cpu_{digest.hexdigest()[:16]}"


def built_library(cflags: tuple[str, ...]) -> Path:
    """Where this build's library is kept (it may not exist yet)."""
    return cache_root() / f"{build_name(cflags)}.so"


def build_estimate() -> str:
    """How long a build usually takes here, for the messages that announce one."""
    try:
        seconds = float((cache_root() / "last_build_s").read_text())
    except (OSError, ValueError):
        return TYPICAL_BUILD
    return f"about {seconds:.0f} s here last time"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_or_build(cflags: tuple[str, ...]) -> bool:
    """Load the kernels into this process, building them first if no process did on this
    machine; True when this call built them. Raises when building is impossible (no compiler
    or ninja) or the library does not load."""
    import torch

    library = built_library(cflags)
    if not library.exists():
        with _locked(library.with_suffix(".lock")):
            if not library.exists():  # another process may have built it while we waited
                _build(cflags, library)
                return True  # cpp_extension.load loaded the fresh build into this process
    torch.ops.load_library(str(library))
    return False


def _build(cflags: tuple[str, ...], library: Path) -> None:
    from torch.utils import cpp_extension

    name = build_name(cflags)
    logger.warning(
        "building the CPU kernels (C++, once per machine, kernel source and torch version; "
        "%s); `python -m kernels.cpu_build` builds them ahead of time",
        build_estimate(),
    )
    started = time.perf_counter()
    build_dir = cache_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch's own lock file outlives a build killed midway and would stall every later one;
    # under our flock no other build of this library runs, so a lock there is stale
    (build_dir / "lock").unlink(missing_ok=True)
    cpp_extension.load(
        name=name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=list(cflags),
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    partial = library.with_suffix(f".so.{os.getpid()}")
    shutil.copyfile(build_dir / f"{name}.so", partial)
    os.replace(partial, library)  # readers see the whole library or none
    seconds = time.perf_counter() - started
    (cache_root() / "last_build_s").write_text(f"{seconds:.1f}\n")
    shutil.rmtree(build_dir, ignore_errors=True)  # objects: only the library is loaded again
    logger.warning("built the CPU kernels in %.0f s: %s", seconds, library)


def main() -> int:
    """Build the kernels now unless this machine has them; say which, and how long it took."""
    from kernels.cpu_abi import CFLAGS

    logger.setLevel(logging.ERROR)  # the lines below say it once, to stdout
    library = built_library(CFLAGS)
    if library.exists():
        print(f"CPU kernels: built already ({library})", flush=True)
        return 0
    from kernels import cpu_ops

    print(
        f"CPU kernels: building (C++, once per machine and kernel version; {build_estimate()}) ...",
        flush=True,
    )
    started = time.perf_counter()
    if not cpu_ops.cpu_kernels_available():
        print("CPU kernels: cannot be built here; the engine uses plain torch", file=sys.stderr)
        return 0  # the engine still runs, only slower: setup goes on
    print(f"CPU kernels: built in {time.perf_counter() - started:.0f} s ({library})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
