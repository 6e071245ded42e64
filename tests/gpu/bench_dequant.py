"""Dequantize A/B tool: checks both dequantize kernels bitwise against the reference, then times them on 8192 x 8192
-> bf16 (the kernel benchmark's method: CUDA graph, rotating outputs, median of 30), K = 2..5, bit planes and tiled.

    KBIT_CUDA_LIB=.../libkbit_cuda.so python tests/gpu/bench_dequant.py TAG out.json

Run each library in its own process, alternating, and compare within one device session (docs/results/dq_stream).
"""

import json
import sys

import torch

from kbit_hf import cuda_backend as cuda
from kbit_hf import format as fmt
from kbit_hf import reference as ref
from kbit_hf.bench.kernels import _kbit_weights, _time_graph, copy_bandwidth


def check():
    # bit planes, E = 1 and in % 32 == 0 (the kernel's dense path; 8192 x 8192: grid-stride), against the reference
    for o, i in [(1, 32), (37, 96), (333, 4096), (8192, 8192)]:
        for k in fmt.SUPPORTED_K:
            cb = fmt.nf_codebook(k).cuda()
            p, a, s = cuda.quantize(torch.randn(o, i, device="cuda", dtype=torch.bfloat16), cb, k, "e4m4")
            want = ref.dequantize(p, a, s, cb, k, i)
            for dt in (torch.bfloat16, torch.float16):
                assert torch.equal(cuda.dequantize(p, a, s, cb, k, i, dt), want.to(dt)), (o, i, k, dt)
    # tiled, odd tile counts, every output dtype
    for o, i in [(16, 256), (48, 768), (272, 256)]:
        for k in fmt.TILED_K:
            cb = fmt.nf_codebook(k).cuda()
            p, a, s = cuda.quantize(torch.randn(o, i, device="cuda", dtype=torch.bfloat16), cb, k, "e4m4")
            wt, at = cuda.tile(p, a, i, k)
            want = ref.dequantize(p, a, s, cb, k, i)
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                assert torch.equal(cuda.dequantize(wt, at, s, cb, k, i, dt), want.to(dt)), (o, i, k, dt)


def main():
    tag, out_json = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    check()
    print(tag, "check ok")
    bw = copy_bandwidth(20)
    res = {"tag": tag, "copy_bw_Bps": bw, "lib": cuda.library_path(), "device": torch.cuda.get_device_name(), "rows": []}
    n = 8192
    for k in fmt.SUPPORTED_K:
        p, a, s, cb = _kbit_weights(n, n, k)
        nbytes = p.numel() * 4 + a.numel() + n * n * 2
        outs = [torch.empty(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        layouts = [("planes", p, a)]
        if k in fmt.TILED_K:
            layouts.append(("tiled", *cuda.tile(p, a, n, k)))
        first = None
        for lay, w, sc in layouts:
            us = _time_graph([lambda o=o: cuda.dequantize_out(w, sc, s, cb, k, n, o) for o in outs], 30)
            torch.cuda.synchronize()
            if first is None:
                first = outs[0].clone()
            else:  # the tiled kernel bitwise the bit-plane one on 8192 x 8192 (grid-stride)
                assert torch.equal(outs[0].view(torch.int16), first.view(torch.int16)), (k, "tiled != planes")
            pct = 100 * nbytes / (us * 1e-6) / bw
            res["rows"].append({"k": k, "layout": lay, "us": us, "pct_copy": pct})
            print(f"{tag} K={k} {lay:6s} {us:7.2f} us {pct:5.1f}%", flush=True)
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
