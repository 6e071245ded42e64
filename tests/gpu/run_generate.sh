#!/usr/bin/env bash
# One device-machine session for the generation work: in-tree build (sm_90), the static-cache / CUDA-graph
# integration tests, then `python -m kbit_hf.bench generate` with GEN_ARGS. Carry `.pkgs` (bitsandbytes, torchao
# unpacked wheels) to compare against them. Logs and results go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/.pkgs:$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/kbit_out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv 2>&1 | tee "$OUT/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import bitsandbytes, torchao; print('bitsandbytes', bitsandbytes.__version__, 'torchao', torchao.__version__)" 2>&1 | tail -1
python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>&1 | tail -1
t0=$(date +%s)
. "$(dirname "$0")/build_lib.sh"  # in-tree build unless KBIT_CUDA_LIB is carried
if [ -n "${TESTS:-}" ]; then
  timeout 400 python3 -m pytest -q -m cuda -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/pytest.log" | tail -15
  echo "tests: $(( $(date +%s) - t0 )) s"
fi
if [ -n "${GEN_ARGS:-}" ]; then
  python3 -m kbit_hf.bench generate --workdir /tmp/kbit_ckpt $GEN_ARGS 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" \
    | tee "$OUT/generate.log"
  echo "generate: $(( $(date +%s) - t0 )) s"
fi
