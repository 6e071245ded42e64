"""Check and time the tiled-nibble GEMV experiment (tests/gpu/tiled_gemv.cu, its own library) against main's GEMV.

    nvcc -arch=sm_90 -O3 -std=c++17 -shared -Xcompiler -fPIC -cudart static -o libtiled.so tests/gpu/tiled_gemv.cu
    python tests/gpu/bench_tiled.py libtiled.so --json out.json

Checks first (any failure exits 1): the repacked layout against a PyTorch construction of the same layout from the
bit planes, then the GEMV output against a float64 reference of the dequantized weight (M = 1..50) for every
(warps, stages) variant, and each launch twice (bitwise equal). Then times main's GEMV and each variant with the
kernel benchmark's method (CUDA graph, weights rotated past 4x L2, median).
"""

import argparse
import ctypes
import json
import sys

import torch

from kbit_hf import cuda_backend as cuda
from kbit_hf import format as fmt
from kbit_hf.bench.kernels import _kbit_weights, _n_copies, _time_graph, copy_bandwidth

# (warps, stages) instantiated per token-tile count NT = ceil(M / 8) (tiled_gemv.cu, tiled_gemv())
VARIANTS = {1: [(8, 2), (12, 2), (16, 1), (16, 2), (20, 1), (24, 1)], 2: [(8, 1), (8, 2), (16, 1), (16, 2)],
            4: [(8, 1), (8, 2), (16, 1)], 8: [(4, 2), (8, 1), (8, 2)]}


def n_tiles(M):
    return 1 if M <= 8 else 2 if M <= 16 else 4 if M <= 32 else 8


def tiled_layout_reference(packed, absmax, out_f, in_f):
    """The layout of tiled_gemv.cu built with PyTorch from the bit planes (see the file's header)."""
    idx = fmt.unpack_bitplanes(packed.cpu(), 4).flatten(-2)[:, :in_f]  # [out, in] int64
    T, C = out_f // 16, in_f // 128
    # element e = 128 c + 32 b + 8 q + 4 h + 2 m (+1), row 16 t + g + 8 r; byte order [t][c][g][q][b][h][m][r]
    v = idx.view(T, 2, 8, C, 4, 4, 2, 2, 2)  # t, r, g, c, b, q, h, m, pair
    pair = v[..., 0] | (v[..., 1] << 4)  # t, r, g, c, b, q, h, m
    wt = pair.permute(0, 3, 2, 5, 4, 6, 7, 1).contiguous().to(torch.uint8).view(-1)
    a = absmax.cpu().view(T, 16, C, 4).permute(0, 2, 1, 3).contiguous().view(-1)
    return wt, a


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--shapes", default="1024x4096,4096x4096,6144x4096,14336x4096,4096x14336,28672x8192")
    ap.add_argument("--m", default="1,4,16,32")
    ap.add_argument("--variants", default=None, help="e.g. 16x1,16x2 (else every variant of each M)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tag", default="")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    assert cuda.available(), cuda.load_error()
    lib = ctypes.CDLL(a.lib)
    lib.tiled_repack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 3
    lib.tiled_gemv.argtypes = ([ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2
                               + [ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p])
    only = None if a.variants is None else {tuple(int(v) for v in s.split("x")) for s in a.variants.split(",")}

    def variants(M):
        return [v for v in VARIANTS[n_tiles(M)] if only is None or v in only]

    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

    def repack(p, am, out_f, in_f):
        wt = torch.empty(out_f * in_f // 2, dtype=torch.uint8, device="cuda")
        at = torch.empty(out_f * in_f // 32, dtype=torch.uint8, device="cuda")
        rc = lib.tiled_repack(p.data_ptr(), am.data_ptr(), out_f, in_f, wt.data_ptr(), at.data_ptr(), stream())
        assert rc == 0, rc
        return wt, at

    def gemv(x, wt, at, s, cb, out_f, in_f, y, nw, st):
        return lib.tiled_gemv(x.data_ptr(), x.shape[0], wt.data_ptr(), at.data_ptr(), s.data_ptr(), cb.data_ptr(),
                              out_f, in_f, y.data_ptr(), nw, st, 0, stream())

    torch.manual_seed(0)
    ok = True
    # 1. layout
    for out_f, in_f in ((16, 256), (48, 512), (272, 768)):
        p, am, s, cb = _kbit_weights(out_f, in_f, 4)
        wt, at = repack(p, am, out_f, in_f)
        rw, ra = tiled_layout_reference(p, am, out_f, in_f)
        good = torch.equal(wt.cpu(), rw) and torch.equal(at.cpu(), ra)
        ok &= good
        print(f"[{a.tag}] layout {out_f}x{in_f}: {'ok' if good else 'MISMATCH'}", flush=True)
    # 2. GEMV against float64 (and twice: deterministic)
    worst = 0.0
    for out_f, in_f in ((16, 256), (48, 512), (272, 768), (1024, 4096), (4096, 1024), (2000, 2304)):
        p, am, s, cb = _kbit_weights(out_f, in_f, 4)
        wt, at = repack(p, am, out_f, in_f)
        wref = cuda.dequantize(p, am, s, cb, 4, in_f, torch.float32).double()
        for M in (1, 3, 8, 12, 32, 50):
            x = torch.randn(M, in_f, device="cuda", dtype=torch.bfloat16)
            ref = x.double() @ wref.t()
            for nw, st in variants(M):
                y1 = torch.full((M, out_f), float("nan"), device="cuda", dtype=torch.bfloat16)
                y2 = torch.full_like(y1, float("nan"))
                rc = gemv(x, wt, at, s, cb, out_f, in_f, y1, nw, st) or gemv(x, wt, at, s, cb, out_f, in_f, y2, nw, st)
                torch.cuda.synchronize()
                err = ((y1.double() - ref).norm() / ref.norm()).item() if rc == 0 else float("inf")
                worst = max(worst, err)
                if rc != 0 or not err < 1e-2 or not torch.equal(y1, y2):
                    ok = False
                    print(f"[{a.tag}] CHECK FAILED {out_f}x{in_f} M={M} {nw}x{st}: rc {rc} err {err:.3g} "
                          f"equal {torch.equal(y1, y2)}", flush=True)
    print(f"[{a.tag}] gemv check: worst relative error {worst:.3g}", flush=True)
    if not ok:
        sys.exit(1)
    # 3. timing
    bw = copy_bandwidth(a.repeats)
    print(f"[{a.tag}] device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    for sh in a.shapes.split(","):
        out_f, in_f = (int(v) for v in sh.split("x"))
        p0, a0, s0, cb = _kbit_weights(out_f, in_f, 4)
        kbytes = p0.numel() * 4 + a0.numel()
        n = _n_copies(kbytes)
        copies = [(p0, a0)] + [(p0.clone(), a0.clone()) for _ in range(n - 1)]
        tiled = [repack(p, am, out_f, in_f) for p, am in copies]
        for M in (int(v) for v in a.m.split(",")):
            x = torch.randn(M, in_f, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, out_f, device="cuda", dtype=torch.bfloat16)
            nbytes = kbytes + M * in_f * 2 + M * out_f * 2
            us = _time_graph([lambda c=c: cuda.linear_out(x, c[0], c[1], s0, cb, 4, in_f, None, y) for c in copies],
                             a.repeats)
            best = (us, "v6")
            line = f"v6 {us:7.2f}"
            rows.append({"shape": sh, "M": M, "impl": "v6", "us": us, "pct_copy": 100 * nbytes / (us * 1e-6) / bw})
            for nw, st in variants(M):
                ut = _time_graph([lambda c=c: gemv(x, c[0], c[1], s0, cb, out_f, in_f, y, nw, st) for c in tiled],
                                 a.repeats)
                rows.append({"shape": sh, "M": M, "impl": f"{nw}x{st}", "us": ut,
                             "pct_copy": 100 * nbytes / (ut * 1e-6) / bw})
                line += f" | {nw}x{st} {ut:7.2f}"
                best = min(best, (ut, f"{nw}x{st}"))
            print(f"[{a.tag}] {sh:>11} M={M}: {line} | best {best[1]} {us / best[0]:.2f}x v6, "
                  f"{100 * nbytes / (best[0] * 1e-6) / bw:.0f}% of copy", flush=True)
        del copies, tiled
        torch.cuda.empty_cache()
    if a.json:
        json.dump({"tag": a.tag, "device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows},
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
