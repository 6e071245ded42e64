"""Driver for an ncu profile of the dequantize kernels: 8192 x 8192 -> bf16, for each K given, three calls of the
bit-plane kernel, then three of the tiled one:
ncu --clock-control none --kernel-name regex:dequant --section ... python3 tests/gpu/profile_dequant.py 2,3,4,5
"""
import sys

import torch

from kbit_hf import cuda_backend as cuda
from kbit_hf.bench.kernels import _kbit_weights

assert cuda.available(), cuda.load_error()
n = 8192
for k in (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "4").split(",")):
    p, a, s, cb = _kbit_weights(n, n, k)
    wt, at = cuda.tile(p, a, n, k)
    y = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for w, sc in ((p, a), (wt, at)):
        for _ in range(3):
            cuda.dequantize_out(w, sc, s, cb, k, n, y)
torch.cuda.synchronize()
print("ok")
