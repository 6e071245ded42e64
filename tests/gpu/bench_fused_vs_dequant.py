"""The fused GEMV (the library's choice of kernel) against the dequantize + cuBLAS path at the token counts where either
could run, with the kernel benchmark's method (CUDA graph over rotating weight copies, median of 30), weights in the
tiled layout. The dequantized weight goes to one reused bf16 buffer, so on layers whose bf16 weight fits in L2 the
dequantize + cuBLAS figure is optimistic.

    python tests/gpu/bench_fused_vs_dequant.py out.json 14336x4096,4096x14336 4 16,32,64
"""

import json
import sys

import torch

from kbit_hf import cuda_backend as cuda
from kbit_hf.bench.kernels import _kbit_weights, _n_copies, _time_graph


def main():
    out_json, shapes, ks, ms = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    torch.manual_seed(0)
    rows = []
    for sh in shapes.split(","):
        o, i = (int(v) for v in sh.split("x"))
        for k in (int(v) for v in ks.split(",")):
            p0, a0, s0, cb = _kbit_weights(o, i, k)
            kbytes = p0.numel() * 4 + a0.numel()
            copies = [(p0, a0)] + [(p0.clone(), a0.clone()) for _ in range(_n_copies(kbytes) - 1)]
            copies = [cuda.tile(c[0], c[1], i, k) for c in copies]
            wbuf = torch.empty(o, i, device="cuda", dtype=torch.bfloat16)
            for M in (int(v) for v in ms.split(",")):
                x = torch.randn(M, i, device="cuda", dtype=torch.bfloat16)
                y = torch.empty(M, o, device="cuda", dtype=torch.bfloat16)
                fused = _time_graph([lambda c=c: cuda.linear_out(x, c[0], c[1], s0, cb, k, i, None, y)
                                     for c in copies], 30)

                def dequant_mm(c):
                    cuda.dequantize_out(c[0], c[1], s0, cb, k, i, wbuf)
                    torch.mm(x, wbuf.t(), out=y)

                dm = _time_graph([lambda c=c: dequant_mm(c) for c in copies], 30)
                rows.append({"shape": sh, "k": k, "M": M, "fused_us": fused, "dequant_mm_us": dm})
                print(f"{sh:>12} K={k} M={M:2d} fused {fused:8.2f} us, dequantize + cuBLAS {dm:8.2f} us "
                      f"({fused / dm:4.2f}x)", flush=True)
            del copies, wbuf
            torch.cuda.empty_cache()
    with open(out_json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
