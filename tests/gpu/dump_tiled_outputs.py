"""Dump the tiled GEMV's outputs on fixed random inputs for the library in KBIT_CUDA_LIB, or compare two dumps bitwise:
the check that a kernel change which should not move a bit (a register decode instead of the table, a predicated
load) does not.

    KBIT_CUDA_LIB=old/libkbit_cuda.so python tests/gpu/dump_tiled_outputs.py old.pt --kernel range
    KBIT_CUDA_LIB=new/libkbit_cuda.so python tests/gpu/dump_tiled_outputs.py new.pt --kernel range
    python tests/gpu/dump_tiled_outputs.py --compare old.pt new.pt
"""

import argparse

import torch

SHAPES = {"range": ((4096, 4096), (2064, 4352), (14336, 4096)), "batch": ((4096, 4096), (2064, 4352))}
TOKENS = {"range": (1, 2, 3, 4, 5, 8, 9, 12, 16, 17, 32), "batch": (9, 12, 16, 17, 25, 32, 33, 41, 64)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("--kernel", choices=("range", "batch"), default="range", help="the tiled GEMV kernel, forced")
    ap.add_argument("--compare", nargs=2, default=None)
    a = ap.parse_args()
    if (a.out is None) == (a.compare is None):
        ap.error("give either an output file or --compare A B")
    if a.compare:
        ref, new = (torch.load(p) for p in a.compare)
        assert ref.keys() == new.keys(), "the dumps hold different cases"
        differ = [k for k in ref if not torch.equal(ref[k], new[k])]
        print(f"{a.compare[1]} bitwise equal to {a.compare[0]}: {not differ} ({len(ref)} outputs)", *differ[:5])
        raise SystemExit(1 if differ else 0)
    from kbit_hf import cuda_backend as cuda, format as fmt

    cuda.tiled_kernel = cuda.TILED_KERNELS[a.kernel]
    torch.manual_seed(1)
    res = {}
    for (o, i) in SHAPES[a.kernel]:
        for k in (2, 3, 4, 5):
            cb = fmt.nf_codebook(k).cuda()
            p, sa, s = cuda.quantize(torch.randn(o, i, device="cuda"), cb, k, "e4m4")
            pt, at = cuda.tile(p, sa, i, k)
            for dt in (torch.bfloat16, torch.float16):
                for M in TOKENS[a.kernel]:
                    x = torch.randn(M, i, device="cuda", dtype=dt)
                    y = torch.empty(M, o, device="cuda", dtype=dt)
                    cuda.linear_out(x, pt, at, s, cb, k, i, None, y)
                    res[f"{o}x{i} K={k} {dt} M={M}"] = y.cpu()
    torch.save(res, a.out)
    print(f"{len(res)} outputs saved to {a.out}")


if __name__ == "__main__":
    main()
