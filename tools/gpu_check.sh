#!/usr/bin/env bash
# The GPU check of one device machine, from the repository root: build libkbit_cuda in-tree (tools/build_lib.sh,
# sm_90 unless KBIT_CUDA_ARCHS says otherwise), the GPU tests (tests/gpu), compute-sanitizer memcheck of
# tools/sanitize_driver.py, and the kernel benchmark (python -m kbit_hf.bench kernels). Logs and results go to $OUT
# (default /tmp/kbit_out). Exits non-zero when a step fails.
#   bash tools/gpu_check.sh [pytest arguments for tests/gpu ...]
# Environment:
#   SKIP_TESTS=1 / SKIP_SAN=1 / SKIP_BENCH=1   leave out the GPU tests / memcheck / kernel benchmark
#   BENCH_ARGS="--k 4 --m 1,8"                 arguments of the kernel benchmark
#   RACECHECK=1                                also compute-sanitizer racecheck of tools/sanitize_driver.py
#   RUN_ALL_CUDA=1                             also the CUDA-marked tests outside tests/gpu (pytest tests -m cuda)
#   GEN_ARGS="--model llama-3-8b --layers 4 --methods bf16,kbit4 --batch 1"
#                                              also python -m kbit_hf.bench generate $GEN_ARGS (checkpoints in
#                                              GEN_WORKDIR, default /tmp/kbit_ckpt; a .pkgs folder of unpacked
#                                              wheels, such as bitsandbytes / torchao to compare against, goes on
#                                              the PYTHONPATH)
#   KBIT_CUDA_LIB=path / REBUILD=0             use a prebuilt library / keep the installed one (build_lib.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/kbit_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1 | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
t0=$(date +%s)
. tools/build_lib.sh  # in-tree build unless KBIT_CUDA_LIB names a prebuilt library
python3 -c "from kbit_hf.backends.cuda import library as lib
print('library:', lib.available(), lib.library_path() or lib.load_error())"
failed=()
step() {  # step NAME RC: record a failed step, print the time so far
  [ "$2" = 0 ] || failed+=("$1 (rc=$2)")
  echo "$1: rc=$2, $(( $(date +%s) - t0 )) s"
}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  workers=()  # with pytest-xdist installed, one worker per two cores (tests/gpu/conftest.py shares the threads out)
  python3 -c "import xdist" 2>/dev/null && workers=(-n "$(( $(nproc) / 2 ))")
  timeout 480 python3 -m pytest tests/gpu -q -x -p no:cacheprovider "${workers[@]}" "$@" 2>&1 \
    | tee "$OUT/pytest_gpu.log" | tail -15
  step "gpu tests" "${PIPESTATUS[0]}"
fi
if [ "${SKIP_SAN:-0}" != 1 ]; then
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 python3 tools/sanitize_driver.py \
    >"$OUT/sanitizer.log" 2>&1
  rc=$?; tail -4 "$OUT/sanitizer.log"; step "memcheck" "$rc"
fi
if [ "${RACECHECK:-0}" = 1 ]; then
  timeout 580 compute-sanitizer --tool racecheck --error-exitcode 1 python3 tools/sanitize_driver.py --sync \
    >"$OUT/racecheck.log" 2>&1
  rc=$?; tail -4 "$OUT/racecheck.log"; step "racecheck" "$rc"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 300 python3 -m kbit_hf.bench kernels --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  step "kernel bench" "${PIPESTATUS[0]}"
fi
if [ "${RUN_ALL_CUDA:-0}" = 1 ]; then
  timeout 400 python3 -m pytest tests -q -m cuda --ignore=tests/gpu -p no:cacheprovider 2>&1 \
    | tee "$OUT/pytest_all_cuda.log" | tail -15
  step "cuda tests outside tests/gpu" "${PIPESTATUS[0]}"
fi
if [ -n "${GEN_ARGS:-}" ]; then
  [ -d .pkgs ] && export PYTHONPATH="$PWD/.pkgs:$PYTHONPATH"
  python3 -m kbit_hf.bench generate --workdir "${GEN_WORKDIR:-/tmp/kbit_ckpt}" $GEN_ARGS 2>&1 | tr '\r' '\n' \
    | grep --line-buffered -v "it/s\]$" | tee "$OUT/generate.log"
  step "generate bench" "${PIPESTATUS[0]}"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all steps passed"
