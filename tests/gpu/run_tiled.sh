#!/usr/bin/env bash
# Device run of the tiled-nibble GEMV experiment (tests/gpu/tiled_gemv.cu, tests/gpu/bench_tiled.py): build its
# library unless TILED_LIB names a carried one, check and time it against main's GEMV (KBIT_CUDA_LIB or the in-tree
# build), then memcheck the checks. Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT="${OUT:-/tmp/kbit_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
t0=$(date +%s)
. "$(dirname "$0")/build_lib.sh"
LIB=${TILED_LIB:-}
if [ -z "$LIB" ]; then
  LIB=/tmp/libtiled.so
  nvcc -arch=sm_90 -O3 -std=c++17 -shared -Xcompiler -fPIC -cudart static -o $LIB tests/gpu/tiled_gemv.cu || exit 1
fi
timeout 400 python3 tests/gpu/bench_tiled.py "$LIB" --tag ${TAG:-tiled} --json "$OUT/tiled.json" ${TILED_ARGS:-} 2>&1 \
  | tee "$OUT/tiled.log"
echo "bench: $(( $(date +%s) - t0 )) s"
if [ "${SKIP_SAN:-0}" != 1 ]; then
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tests/gpu/bench_tiled.py "$LIB" \
    --shapes 1024x4096 --m 1 --variants 16x1,8x1 --repeats 1 >"$OUT/sanitizer.log" 2>&1
  echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|CHECK|layout|check:" "$OUT/sanitizer.log" | tail -6
fi
