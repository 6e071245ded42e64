"""Per-warp timeline of the tiled GEMV at M = 1 (experiment builds only: csrc/kbit_tiled.cu compiled with
-DKBIT_TILED_TIMELINE records %globaltimer stamps per CTA and warp; KBIT_CUDA_LIB names that library). For each shape, runs the GEMV eagerly
over rotating weight copies (no L2 reuse) and prints, in microseconds from the first CTA's start: when CTAs start,
when the pair table is ready, when each warp's first item arrived, when warps leave the main loop, and the end.

    KBIT_CUDA_LIB=.../libkbit_cuda.so python tests/gpu/timeline_tiled.py 14336x4096 28672x8192
"""

import ctypes
import sys

import torch


def pct(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p / 100 * len(v)))]


def main():
    from kbit_hf import cuda_backend as cuda
    from kbit_hf.bench.kernels import _kbit_weights, _n_copies

    assert cuda.available(), cuda.load_error()
    lib = cuda._lib
    fn = lib.kbit_tiled_timeline
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for sh in sys.argv[1:] or ["14336x4096", "28672x8192"]:
        out_f, in_f = (int(v) for v in sh.split("x"))
        p0, a0, s0, cb = _kbit_weights(out_f, in_f, 4)
        copies = [cuda.tile(p0, a0, in_f, 4)]
        copies += [cuda.tile(p0.clone(), a0.clone(), in_f, 4) for _ in range(_n_copies(p0.numel() * 4) - 1)]
        x = torch.randn(1, in_f, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, out_f, device="cuda", dtype=torch.bfloat16)
        for rep in range(3 * len(copies)):
            wt, at = copies[rep % len(copies)]
            cuda.linear_out(x, wt, at, s0, cb, 4, in_f, None, y)
        torch.cuda.synchronize()
        buf = (ctypes.c_ulonglong * (256 * 32 * 6))()
        assert fn(ctypes.addressof(buf), 256 * 32 * 6) == 0
        t = torch.tensor(list(buf), dtype=torch.float64).view(256, 32, 6)[:sms]
        nw = int((t[:, :, 0] > 0).sum(1).max())
        t = t[:, :nw]
        t0 = t[:, :, 0][t[:, :, 0] > 0].min()
        t = (t - t0) / 1e3  # us from the first CTA's start
        cta_start = t[:, 0, 0]
        ready = t[:, 0, 1]
        first = t[:, :, 2].flatten()
        loop_end = t[:, :, 3].flatten()
        loop = (t[:, :, 3] - t[:, :, 2]).flatten()
        epi0 = t[:, 0, 4]
        end = t[:, :, 5].flatten()
        end = end[end > -1e6]
        items = out_f // 16 * (in_f // 256) / sms / nw
        print(f"{sh} M=1, {sms} CTAs x {nw} warps, {items:.1f} items per warp; us (min / median / max):")
        for name, v in (("CTA start", cta_start), ("table ready", ready), ("first item in", first),
                        ("loop (per warp)", loop), ("loop end", loop_end), ("epilogue start", epi0), ("end", end)):
            v = v.tolist()
            print(f"  {name:>16}: {min(v):7.2f} {pct(v, 50):7.2f} {max(v):7.2f}")
        print(f"  per item in the loop: {pct(loop.tolist(), 50) / max(items - 1, 1):.3f} us (median warp)")
        # the CTAs that end last: where their time goes (-1e6 and below: a warp with no items stamped nothing)
        cta_end = t[:, :, 5].where(t[:, :, 5] > -1e6, torch.tensor(-1.0, dtype=t.dtype)).amax(1)
        print("  last CTAs: start / table / first item (min, max) / loop end (max) / epilogue start / end (max)")
        for c in cta_end.argsort(descending=True)[:4].tolist():
            fi = t[c, :, 2][t[c, :, 2] > -1e6]
            print(f"    CTA {c:3d}: {t[c, 0, 0]:5.2f} / {t[c, 0, 1]:5.2f} / {fi.min():5.2f}, {fi.max():5.2f} / "
                  f"{t[c, :, 3].amax():5.2f} / {t[c, 0, 4]:5.2f} / {cta_end[c]:5.2f}")
        del copies


if __name__ == "__main__":
    main()
