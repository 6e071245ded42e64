#!/usr/bin/env bash
# Pipe utilisation, issue activity and memory throughput of the fused GEMV (M=1, bf16) for a few shapes and K: which
# execution pipe binds. Assumes a library (KBIT_CUDA_LIB or kbit_hf/_lib). Writes $OUT/ncu_pipes_<shape>_k<K>.txt.
#   bash tests/gpu/ncu_pipes.sh "14336x4096:4 4096x4096:4 14336x4096:5"
set -uo pipefail
OUT="${OUT:-/tmp/kbit_out}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for case in ${1:-"14336x4096:4 4096x4096:4 14336x4096:5 14336x4096:2"}; do
  shape=${case%:*}; k=${case#*:}; f="$OUT/ncu_pipes_${shape}_k$k"
  timeout 120 ncu --clock-control none --kernel-name regex:gemv --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section Occupancy \
    --section MemoryWorkloadAnalysis -o "$f" -f python3 tests/gpu/profile_gemv.py "$shape" "$k" > "$f.run.txt" 2>&1
  ncu -i "$f.ncu-rep" --page details --print-details all --print-units base > "$f.txt" 2>&1
  [ -f "$f.ncu-rep" ] || tail -5 "$f.run.txt"
  rm -f "$f.ncu-rep" "$f.run.txt"
  echo "== $shape K=$k"
  grep -iE "Duration|DRAM Throughput|Issue Slots Busy|Executed Ipc A|pipe|Achieved Occupancy" "$f.txt" | sed -E 's/ +/ /g' | head -30
done
