#!/usr/bin/env bash
# One device call: build (sm_90), then time the fused GEMV under several environment variants, each in its own process
# (the library reads its knobs once), and print a side-by-side table. Logs and JSON go to $OUT.
#   VARIANTS="base: pf:KBIT_GEMV_PF=1000000 pfd2:KBIT_GEMV_PFD=2" BENCH="--k 4 --m 1,4" bash tests/gpu/run_variants.sh
# CHECK=1 runs the bench's float64 output check in every variant; NCU="tag ..." profiles those variants' K=4 M=1
# 14336x4096 kernel (tests/gpu/profile_gemv.py) with the warp-state, scheduler and memory sections.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/kbit_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | tee "$OUT/device.txt"
t0=$(date +%s)
. "$(dirname "$0")/build_lib.sh"  # in-tree build unless KBIT_CUDA_LIB is carried
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
files=()
for v in ${VARIANTS:-base:}; do
  tag=${v%%:*}; envs=${v#*:}
  chk=""; [ "${CHECK:-0}" = 1 ] && chk="--check"
  env $(echo "$envs" | tr ',' ' ') timeout 240 python3 tests/gpu/bench_gemv_impl.py --tag "$tag" $chk \
    --json "$OUT/$tag.json" ${BENCH:-} >"$OUT/$tag.log" 2>&1 || { echo "variant $tag failed"; tail -5 "$OUT/$tag.log"; }
  [ -f "$OUT/$tag.json" ] && files+=("$OUT/$tag.json")
  grep -E "check|FAIL" "$OUT/$tag.log" | head -3
  echo "$tag: $(( $(date +%s) - t0 )) s"
done
for v in ${NCU:-}; do
  envs=""; for w in ${VARIANTS:-}; do [ "${w%%:*}" = "$v" ] && envs=${w#*:}; done
  env $(echo "$envs" | tr ',' ' ') timeout 180 ncu --clock-control none --kernel-name regex:gemv --launch-skip 3 \
    --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section LaunchStats python3 tests/gpu/profile_gemv.py >"$OUT/ncu_$v.txt" 2>&1
  echo "ncu $v rc=$? $(( $(date +%s) - t0 )) s"
done
[ ${#files[@]} -gt 0 ] && python3 tests/gpu/bench_gemv_impl.py --compare "${files[@]}" | tee "$OUT/compare.txt"
