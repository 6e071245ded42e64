#!/usr/bin/env bash
# Warp-stall breakdown and per-SASS-instruction stall samples of the fused GEMV under ncu (driver:
# tools/profile_gemv.py; default 14336x4096, K = 4, M = 1, bf16, the layout KbitLinear holds on this GPU; arguments
# pass through to it: [OUTxIN] [K] [M]). Run from the repository root with the library built (tools/build_lib.sh)
# or KBIT_CUDA_LIB set. Writes $OUT/ncu_stalls_<TAG>.txt (stall ratios, warp state) and $OUT/sass_<TAG>.csv
# (per-instruction samples), and prints the 20 largest stall reasons.
#   TAG=m1 bash tools/ncu_stalls.sh
#   TAG=m64 bash tools/ncu_stalls.sh 14336x4096 4 64    (M = 64: the batched / token-tile kernels)
set -uo pipefail
OUT="${OUT:-/tmp/kbit_out}"; TAG=${TAG:-base}; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
m=$(for r in long_scoreboard short_scoreboard mio_throttle lg_throttle math_pipe_throttle wait not_selected selected \
  barrier dispatch_stall no_instruction branch_resolving tex_throttle drain imc_miss membar sleeping misc; do
  printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," $r; done)
timeout 200 ncu --clock-control none --kernel-name regex:gemv --launch-skip 3 --launch-count 1 \
  --metrics "${m%,}" --section SourceCounters --section WarpStateStats -o "$OUT/rep_$TAG" -f \
  python3 tools/profile_gemv.py "$@" >"$OUT/ncu_run_$TAG.txt" 2>&1
ncu -i "$OUT/rep_$TAG.ncu-rep" --page details --print-units base >"$OUT/ncu_stalls_$TAG.txt" 2>&1
ncu -i "$OUT/rep_$TAG.ncu-rep" --page source --csv --print-source sass >"$OUT/sass_$TAG.csv" 2>&1
rm -f "$OUT/rep_$TAG.ncu-rep"
grep -E "stalled|Warp Cycles" "$OUT/ncu_stalls_$TAG.txt" | sed 's/smsp__average_warps_issue_stalled_//' | sort -k3 -g -r | head -20
