#!/usr/bin/env bash
# One device-machine session: build in-tree (sm_90 only, to save time), GPU tests, memcheck, kernel benchmark.
# Logs go to $OUT (the device tool brings them back). Usage: bash tests/gpu/run_device.sh [pytest args...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/kbit_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/device.txt"
t0=$(date +%s)
. "$(dirname "$0")/build_lib.sh"  # in-tree build unless KBIT_CUDA_LIB is carried
python3 -c "import kbit_hf.cuda_backend as c; print('library:', c.available(), c.library_path())"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 480 python3 -m pytest tests/gpu -q -x -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
if [ "${SKIP_SAN:-0}" != 1 ]; then
  PYTHONPATH=$PWD timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu/sanitize_driver.py \
    >"$OUT/sanitizer.log" 2>&1; echo "memcheck rc=$?"; tail -4 "$OUT/sanitizer.log"
  echo "sanitizer: $(( $(date +%s) - t0 )) s"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 300 python3 -m kbit_hf.bench kernels --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  echo "bench: $(( $(date +%s) - t0 )) s"
fi
if [ "${RUN_ALL_CUDA:-0}" = 1 ]; then
  timeout 400 python3 -m pytest tests -q -m cuda -p no:cacheprovider 2>&1 | tee "$OUT/pytest_all_cuda.log" | tail -15
  echo "all cuda tests: $(( $(date +%s) - t0 )) s"
fi
