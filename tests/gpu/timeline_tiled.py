"""Per-warp timeline of the tiled range GEMV at M = 1 (experiment builds only: csrc/kbit_tiled.cu compiled with
-DKBIT_TILED_TIMELINE records %globaltimer stamps per CTA and warp, and the SM clock at the epilogue's start and end;
KBIT_CUDA_LIB names that library). For each shape, runs the GEMV eagerly over rotating weight copies (no L2 reuse)
and prints, in microseconds from the first CTA's start: when CTAs start, when the pair table is ready, when each
warp's first item arrived, when warps leave the main loop, the epilogue's start and the end; then the epilogue's
length in SM cycles (every warp, and warp 0, whose range starts a tile: it sums and stores that tile, by part). Per
CTA: when its slowest warp leaves the loop, and the spread of its warps' loop ends. Each figure is the median over
--launches launches; --save keeps every launch's raw stamps.

    KBIT_CUDA_LIB=.../libkbit_cuda.so python tests/gpu/timeline_tiled.py 14336x4096 28672x8192 --k 4
"""

import argparse
import ctypes

import torch

STAMPS = 11  # csrc/kbit_tiled.cu, TIMELINE_STAMPS


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p / 100 * len(v)))]


def one_launch(fn, sms):
    buf = (ctypes.c_ulonglong * (256 * 32 * STAMPS))()
    assert fn(ctypes.addressof(buf), 256 * 32 * STAMPS) == 0
    t = torch.tensor(list(buf), dtype=torch.float64).view(256, 32, STAMPS)[:sms]
    nw = int((t[:, :, 0] > 0).sum(1).max())
    t = t[:, :nw]
    t0 = t[:, :, 0][t[:, :, 0] > 0].min()
    g = (t[:, :, :6] - t0) / 1e3  # us from the first CTA's start
    cycles = t[:, :, 7] - t[:, :, 6]
    w0 = t[:, 0]  # warp 0 stores its first tile: its epilogue by part (stamps 6, 8, 9, 10, 7)
    figures = {
        "CTA start": g[:, 0, 0], "table ready": g[:, 0, 1], "first item in": g[:, :, 2].flatten(),
        "loop end": g[:, :, 3].flatten(), "CTA's last loop end": g[:, :, 3].max(1).values,
        "spread in a CTA": g[:, :, 3].max(1).values - g[:, :, 3].min(1).values,
        "epilogue start": g[:, 0, 4], "end": g[:, :, 5].flatten(),
        "epilogue cycles": cycles.flatten(), "  warp 0": cycles[:, 0], "    run counted": w0[:, 8] - w0[:, 6],
        "    summed": w0[:, 9] - w0[:, 8], "    stored": w0[:, 10] - w0[:, 9], "    to the end": w0[:, 7] - w0[:, 10],
    }
    return nw, t, {k: (min(v.tolist()), pct(v.tolist(), 50), max(v.tolist())) for k, v in figures.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["14336x4096", "28672x8192"])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--save", help="a folder: every launch's raw stamps ([launch][CTA][warp][stamp]: ns of "
                                   "%%globaltimer or SM cycles) go to SHAPE_KK.pt there")
    a = ap.parse_args()
    from kbit_hf import cuda_backend as cuda
    from kbit_hf.bench.kernels import _kbit_weights, _n_copies

    assert cuda.available(), cuda.load_error()
    fn = cuda._lib.kbit_tiled_timeline
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for sh in a.shapes:
        out_f, in_f = (int(v) for v in sh.split("x"))
        p0, a0, s0, cb = _kbit_weights(out_f, in_f, a.k)
        copies = [cuda.tile(p0, a0, in_f, a.k)]
        copies += [cuda.tile(p0.clone(), a0.clone(), in_f, a.k) for _ in range(_n_copies(p0.numel() * 4) - 1)]
        x = torch.randn(1, in_f, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, out_f, device="cuda", dtype=torch.bfloat16)
        runs, raw = [], []
        for _ in range(a.launches):
            for rep in range(2 * len(copies)):
                wt, at = copies[rep % len(copies)]
                cuda.linear_out(x, wt, at, s0, cb, a.k, in_f, None, y)
            torch.cuda.synchronize()
            nw, stamps, figures = one_launch(fn, sms)
            runs.append(figures)
            raw.append(stamps)
        items = out_f // 16 * (in_f // 256) / sms / nw
        print(f"{sh} K={a.k} M=1, {sms} CTAs x {nw} warps, {items:.1f} items per warp; min / median / max over warps "
              f"(us from the start, or SM cycles), each the median of {a.launches} launches:")
        for name in runs[0]:
            m = [sorted(r[name][i] for r in runs)[len(runs) // 2] for i in range(3)]
            print(f"  {name:>20}: {m[0]:8.2f} {m[1]:8.2f} {m[2]:8.2f}")
        if a.save:
            torch.save(torch.stack(raw), f"{a.save}/{sh}_K{a.k}.pt")
        del copies


if __name__ == "__main__":
    main()
