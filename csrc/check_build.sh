#!/usr/bin/env bash
# Compile every CUDA source in csrc/ for the target architectures (sm_80, sm_86, sm_89, sm_90) and link the
# shared library, without a GPU, with warnings as errors and a check of the exported C ABI. Run it before landing a
# csrc/ change: CI (.ci/run) builds the library through `pip install` (CMake, no -Werror) and fails if it is missing.
# Usage: csrc/check_build.sh [output_dir]     (env NVCC, KBIT_CUDA_ARCHS="80 86 89 90", JOBS)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$(mktemp -d)}"
mkdir -p "$out"
NVCC="${NVCC:-nvcc}"
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "check_build: nvcc not found" >&2
  exit 1
fi
archs="${KBIT_CUDA_ARCHS:-80 86 89 90}"
gencode=()
for a in $archs; do
  sass=$a
  [ "$a" = 90 ] && sass=90a  # the GEMM's wgmma needs the architecture-specific target (as CMakeLists.txt)
  gencode+=("-gencode=arch=compute_${sass},code=sm_${sass}" "-gencode=arch=compute_${a},code=compute_${a}")
done
flags=(-O3 -std=c++17 --expt-relaxed-constexpr -Xcompiler -fPIC -Xcompiler -fvisibility=hidden -Werror all-warnings "${gencode[@]}")
pids=()
objs=()
for src in "$here"/*.cu; do
  obj="$out/$(basename "${src%.cu}").o"
  objs+=("$obj")
  echo "check_build: $NVCC ${src#$here/} for sm_{${archs// /,}}"
  "$NVCC" "${flags[@]}" -c "$src" -o "$obj" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if [ "$rc" != 0 ]; then echo "check_build: FAILED" >&2; exit 1; fi
"$NVCC" -shared "${gencode[@]}" -cudart static -o "$out/libkbit_cuda.so" "${objs[@]}"
# the C ABI symbols must be exported
for sym in kbit_abi_version kbit_error_string kbit_quantize kbit_dequantize kbit_gemv kbit_expert_gemv kbit_tile \
    kbit_untile kbit_dequantize_tiled kbit_gemv_tiled kbit_gemv_tiled_kernel kbit_gemm_tiled kbit_gemm_tiled_workspace kbit_gemm_tiled_available; do
  nm -D --defined-only "$out/libkbit_cuda.so" | grep -q " T $sym\$" || { echo "check_build: $sym not exported" >&2; exit 1; }
done
echo "check_build: OK ($out/libkbit_cuda.so)"
