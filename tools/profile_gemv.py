"""Driver for an ncu profile of the fused GEMV: bf16 activations, the weight in the layout KbitLinear holds it in on
this GPU (tiled where dispatch.holds_tiled says so, else the bit planes), 5 calls of kernels.linear. tools/ncu_stalls.sh
runs it under ncu; by hand:

    PYTHONPATH=. ncu --clock-control none --kernel-name regex:gemv --launch-skip 3 --launch-count 1 --section ... \\
        python tools/profile_gemv.py [OUTxIN] [K] [M]

Defaults: 14336x4096, K = 4, M = 1.
"""

import sys

import torch

from kbit_hf import format as fmt
from kbit_hf import ops
from kbit_hf.backends.cuda import kernels, library


def main():
    assert library.available(), library.load_error()
    out, inp = (int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "14336x4096").split("x"))
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    m = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    w = torch.randn(out, inp, device="cuda", dtype=torch.bfloat16)
    cb = fmt.nf0_codebook(k).cuda()
    packed, absmax, scale = kernels.quantize(w, cb, k, "e4m4")
    packed, absmax = ops.device_layout(packed, absmax, out, inp, k, "e4m4")  # what KbitLinear holds on this GPU
    x = torch.randn(m, inp, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        y = kernels.linear(x, packed, absmax, scale, cb, k, inp)
    torch.cuda.synchronize()
    print(f"ok: {out}x{inp} K={k} M={m}, layout {ops.layout_name(packed)}, y {tuple(y.shape)}")


if __name__ == "__main__":
    main()
