"""Driver for an ncu profile of the fused GEMV (bf16; default 14336x4096, K=4, M=1; the tiled layout where KbitLinear
would hold the weight in it):
ncu --clock-control none --kernel-name regex:gemv --launch-skip 3 --launch-count 1 --section ... \
    python3 tests/gpu/profile_gemv.py [OUTxIN] [K] [M]
"""
import sys

import torch

import kbit_hf
from kbit_hf import cuda_backend, format as fmt

assert cuda_backend.available(), cuda_backend.load_error()
out, inp = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "14336x4096").split("x"))
k = int(sys.argv[2]) if len(sys.argv) > 2 else 4
m = int(sys.argv[3]) if len(sys.argv) > 3 else 1
w = torch.randn(out, inp, device="cuda", dtype=torch.bfloat16)
cb = fmt.nf0_codebook(k).cuda()
packed, absmax, scale = cuda_backend.quantize(w, cb, k, "e4m4")
if cuda_backend.holds_tiled(out, inp, k, "e4m4", w.device):  # what KbitLinear holds (KBIT_TILED=0: the bit planes)
    packed, absmax = cuda_backend.tile(packed, absmax, inp, k)
x = torch.randn(m, inp, device="cuda", dtype=torch.bfloat16)
for _ in range(5):
    y = cuda_backend.linear(x, packed, absmax, scale, cb, k, inp)
torch.cuda.synchronize()
print("ok", y.shape, kbit_hf.__version__)
