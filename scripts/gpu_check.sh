#!/usr/bin/env bash
# The CUDA checks and benchmark, for a machine with an NVIDIA GPU (torch + triton installed).
#   bash scripts/gpu_check.sh tests            # kernel tests and the CUDA engine tests
#   bash scripts/gpu_check.sh bench [FLAGS]    # bench/suites/gpu.py FLAGS, results appended to $OUT/gpu.md
#   bash scripts/gpu_check.sh all [FLAGS]      # both in one go: the tests' summary and the bench
#                                              # (sync and async scheduling, the chosen prefill
#                                              # path vs SDPA, piecewise graphs on and off) in
#                                              # $OUT/gpu.md
# Wheels in .whl/ (packages the machine lacks, e.g. pydantic) are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/inferq-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
stage=${1:-tests}
shift || true
run_tests() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  # Kernel tests compile a Triton kernel per shape for the GPU: spread them over the host's
  # cores when pytest-xdist is there. Engine tests take a share of GPU memory each: one at a time.
  # -v names each test as it ends, so a run stopped at a lease's limit still says what failed.
  local parallel=()
  python3 -c "import xdist" 2>/dev/null && parallel=(-n 8)
  python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow" -rfE --tb=short \
    "${parallel[@]}" tests/kernels --ignore tests/kernels/test_cpu_build.py \
    --ignore tests/kernels/test_cpu_lora_add.py --ignore tests/kernels/test_cpu_quant_matmul.py \
    2>&1 | tee "$OUT/pytest_kernels.log"
  python3 -m pytest -v -p no:cacheprovider -o addopts="" -m "not slow" -rfE --tb=short \
    tests/engine/test_cuda_path.py tests/engine/test_sampler.py \
    tests/engine/test_async_scheduling.py tests/engine/test_cuda_piecewise.py \
    tests/engine/test_piecewise_graphs.py tests/engine/test_prefill_select.py \
    tests/engine/test_model_parity.py tests/engine/test_cuda_graphs.py \
    "tests/engine/test_lora.py::test_adapters_on_cuda_take_the_triton_kernel_and_match_peft" \
    "$@" 2>&1 | tee "$OUT/pytest.log"
}
run_bench() {
  python3 bench/suites/gpu.py --out "$OUT/gpu.md" "$@" 2>&1 | tee "$OUT/bench.log"
}
case "$stage" in
  tests)
    run_tests "$@"
    ;;
  bench)
    run_bench "$@"
    ;;
  all)
    run_tests
    { echo "## CUDA tests $(date -u '+%Y-%m-%d %H:%M')"; echo; echo '```'
      tail -n 15 "$OUT/pytest_kernels.log" "$OUT/pytest.log"; echo '```'; echo; } >>"$OUT/gpu.md"
    run_bench "$@"
    ;;
  *)
    echo "usage: $0 tests|bench|all [args]" >&2
    exit 2
    ;;
esac
