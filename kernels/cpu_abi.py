"""What the CPU kernels' C++ sources and their build read from Python: the constants the build
defines (-D, and so part of its hash) and its compiler flags. Free of torch, so a set-up command
can tell whether this machine has the build without importing it (kernels.cpu_build)."""

from __future__ import annotations

import enum

# From this many rows of x on, quant_matmul dequantizes tiles of the weight to fp32 and runs
# at::addmm (compute-bound prefill); below it the weights stream once through registers
# (memory-bound decode). Measured with bench/micro/quant_matmul.py on an AVX2 Zen 3: at 8 rows the
# streaming path is ~10% faster, at 16 the GEMM path ~15%, at 32+ far faster. The build passes it
# to the C++ op as its default (kernels/cpu/small_matmul.cpp); decode_layers is given it per call.
QUANT_GEMM_MIN_ROWS = 16

# How decode_layers reads its flat linear spec: per linear, this many optional tensors (a, b, c,
# input_order, bias) and ints (kind, p0, p1, p2); see kernels/cpu/decode_stack.cpp for each kind.
LINEAR_SLOTS = 5
LINEAR_INTS = 4


class LinearKind(enum.IntEnum):
    """How decode_layers runs one linear layer. The C++ enum (kernels/cpu/decode_stack.cpp)
    takes its values from here: the build defines INFERQ_LINEAR_<NAME> for each member."""

    ATEN = 0
    ONEDNN = 1
    MKL = 2
    QUANT = 3
    W8A8 = 4
    PANELS = 5
    GATED_PANELS = 6


# What the C++ sources read from here, as -D defines of the build (and so of its hash).
_DEFINES = (
    *(f"-DINFERQ_LINEAR_{kind.name}={kind.value}" for kind in LinearKind),
    f"-DINFERQ_LINEAR_SLOTS={LINEAR_SLOTS}",
    f"-DINFERQ_LINEAR_INTS={LINEAR_INTS}",
    f"-DINFERQ_QUANT_GEMM_MIN_ROWS={QUANT_GEMM_MIN_ROWS}",
)

# -ffast-math lets the compiler vectorize the softmax's exp; the kernels never see inf or NaN
# inputs (attention reads only the valid part of each context). -fopenmp makes at::parallel_for
# split work across torch's threads (without it the header falls back to one thread); the
# OpenMP runtime itself is torch's own libgomp, already loaded with libtorch_cpu.
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", *_DEFINES)
