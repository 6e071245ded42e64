# Build libkbit_cuda in-tree through CMake (sm_90 unless KBIT_CUDA_ARCHS says otherwise) and install it into
# kbit_hf/_lib, from the repository root. Sourced by tools/gpu_check.sh; also runs on its own:
#   bash tools/build_lib.sh
# Skipped when KBIT_CUDA_LIB names a prebuilt library, or with REBUILD=0 when one is already installed. The CMake log
# goes to $OUT/build.log (default /tmp/kbit_out).
OUT="${OUT:-/tmp/kbit_out}"; mkdir -p "$OUT"
t0=${t0:-$(date +%s)}
if [ -z "${KBIT_CUDA_LIB:-}" ] && { [ ! -f kbit_hf/_lib/libkbit_cuda.so ] || [ "${REBUILD:-1}" = 1 ]; }; then
  KBIT_CUDA_ARCHS=${KBIT_CUDA_ARCHS:-90} cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 \
    && cmake --build build >>"$OUT/build.log" 2>&1 && cmake --install build --prefix . >>"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
