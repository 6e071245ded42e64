"""Exercise every kbit CUDA kernel once on small odd shapes (for `compute-sanitizer --tool memcheck`).

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu/sanitize_driver.py
"""

import itertools

import torch

from kbit_hf import cuda_backend as cuda
from kbit_hf import format as fmt


def main():
    assert cuda.available(), cuda.load_error()
    n = 0
    for k in fmt.SUPPORTED_K:
        cb = fmt.nf_codebook(k).cuda()
        # (37, 2088), (2, 20, 2080): the folded tiles at M <= 4 (a partial tile and step; 2088: a partial block too)
        for shape in [(1, 7), (3, 33), (9, 100), (2, 3, 64), (17, 520), (20, 4104), (37, 2088), (2, 20, 2080)]:
            for wdt in (torch.float32, torch.float16, torch.bfloat16):
                for af in fmt.ABSMAX_FORMATS:
                    w = torch.randn(shape, device="cuda").to(wdt)
                    p, a, s = cuda.quantize(w, cb, k, af)
                    n += 1
                    for odt in (torch.float32, torch.float16, torch.bfloat16):
                        cuda.dequantize(p, a, s, cb, k, shape[-1], odt)
                        n += 1
            if len(shape) == 2:
                for xdt in (torch.bfloat16, torch.float16):
                    for M in (1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65):
                        x = torch.randn(M, shape[-1], device="cuda", dtype=xdt)
                        bias = torch.randn(shape[0], device="cuda", dtype=xdt)
                        cuda.linear(x, p, a, s, cb, k, shape[-1], bias)
                        cuda.linear(x, p, a, s, cb, k, shape[-1], None)
                        n += 2
            else:
                for xdt in (torch.bfloat16, torch.float16):
                    x = torch.randn(5, shape[-1], device="cuda", dtype=xdt)
                    ids = torch.tensor([0, 1, -1, 2, 1], device="cuda")
                    cuda.expert_linear(x, ids, p, a, s, cb, k, shape[-1])
                    n += 1
    # the tiled layout (K = 2..5, e4m4; the GEMV on sm_90 only): tile, untile, dequantize, GEMV for each token-tile
    # count
    for k, shape in itertools.product(fmt.TILED_K, [(48, 512), (272, 768)]):
        cb = fmt.nf0_codebook(k).cuda()
        p, a, s = cuda.quantize(torch.randn(shape, device="cuda"), cb, k, "e4m4")
        wt, at = cuda.tile(p, a, shape[1], k)
        cuda.untile(wt, at, shape[1], k)
        n += 2
        for odt in (torch.float32, torch.float16, torch.bfloat16):
            cuda.dequantize(wt, at, s, cb, k, shape[1], odt)
            n += 1
        if cuda.tiled_supported(torch.device("cuda")):
            # each tiled GEMV kernel forced (the batched one also with its k split over clusters of 2 CTAs)
            for kernel in ("range", "batch1", "batch2", "batch4", "batch1k2", "batch2k2", "batch4k2"):
                cuda.tiled_kernel = cuda.TILED_KERNELS[kernel]
                for xdt in (torch.bfloat16, torch.float16):
                    for M in (1, 8, 9, 17, 33, 64):
                        x = torch.randn(M, shape[1], device="cuda", dtype=xdt)
                        cuda.linear(x, wt, at, s, cb, k, shape[1], torch.randn(shape[0], device="cuda", dtype=xdt))
                        n += 1
            cuda.tiled_kernel = cuda.TILED_KERNELS["auto"]
    torch.cuda.synchronize()
    print(f"sanitize_driver: {n} kernel calls OK")


if __name__ == "__main__":
    main()
