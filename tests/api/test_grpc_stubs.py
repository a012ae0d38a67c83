"""The committed gRPC stubs are what the .proto generates today, and the gRPC server stays a
producer (no engine, worker, kernels or torch behind it)."""

from __future__ import annotations

import subprocess
import sys

from producer_api.grpc import codegen


def test_the_committed_stubs_are_current():
    assert codegen.stale_stubs() == [], "run: python -m producer_api.grpc.codegen"


def test_the_grpc_server_loads_without_the_engine():
    code = (
        "import sys, producer_api.grpc.server, producer_api.grpc.stubs;"
        "banned = {'torch', 'engine', 'worker', 'kernels'};"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in banned))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
