# Sourced by the device scripts (run_device.sh, run_generate.sh, run_variants.sh), with OUT and t0 set: build
# libkbit_cuda in-tree through CMake (sm_90 unless KBIT_CUDA_ARCHS says otherwise) and install it into kbit_hf/_lib.
# Skipped when KBIT_CUDA_LIB names a carried prebuilt library, or with REBUILD=0 when one is already installed.
if [ -z "${KBIT_CUDA_LIB:-}" ] && { [ ! -f kbit_hf/_lib/libkbit_cuda.so ] || [ "${REBUILD:-1}" = 1 ]; }; then
  KBIT_CUDA_ARCHS=${KBIT_CUDA_ARCHS:-90} cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >"$OUT/build.log" 2>&1 \
    && cmake --build build >>"$OUT/build.log" 2>&1 && cmake --install build --prefix . >>"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
