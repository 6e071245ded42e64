"""Kernel micro-benchmarks.

Method: every measured call is captured into a CUDA graph (no launch gaps, no Python), weights rotate among enough
copies that more than 4x the L2 size is touched between two uses of one copy (so each call reads DRAM), and the
reported time is the median over `repeats` replays of (graph time / calls in the graph). Bandwidth figures count the
bytes a call must move (weights + scales read once, activations read, output written) and are given as % of the
measured device-to-device copy bandwidth (bytes read + written, 1 GiB copy) of the same run.
"""

from __future__ import annotations

import json
import math
import statistics

import torch
import torch.nn.functional as F

from .. import format as fmt


def _l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20)


def _n_copies(bytes_per_copy: int) -> int:
    return max(2, math.ceil(4 * _l2_bytes() / max(1, bytes_per_copy)) + 1)


def _time_graph(fn_list, repeats: int) -> float:
    """Capture fn_list (callables, one call each) into one graph; median microseconds per call over replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in fn_list:  # warm-up (cuBLAS handles, workspaces) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fn_list:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fn_list))
    del g
    return statistics.median(times)


def copy_bandwidth(repeats: int, detail: dict | None = None) -> float:
    """bytes/s of a 1 GiB device-to-device copy, counting read + write: the faster of the copy engine
    (`copy_`, a memcpy node in the graph) and an SM kernel (elementwise, float32). On Hopper the SM copy is the
    faster one by far (the copy engine reached only 2.41 TB/s on an H100 and 2.69 TB/s on an H200), and it is what
    a kernel can reach, so it is the reference for "% of copy bandwidth". `detail` receives both figures."""
    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    memcpy_us = _time_graph([lambda: dst.copy_(src)], repeats)
    sf, df = src.view(torch.float32), dst.view(torch.float32)
    kernel_us = _time_graph([lambda: torch.neg(sf, out=df)], repeats)
    del src, dst, sf, df
    bw = {"memcpy": 2 * n / (memcpy_us * 1e-6), "sm_kernel": 2 * n / (kernel_us * 1e-6)}
    if detail is not None:
        detail.update(bw)
    return max(bw.values())


def bf16_tensor_rate(repeats: int) -> float:
    """bf16 cuBLAS FLOP/s on an 8192^3 product (the tensor cores' measured rate)."""
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    us = _time_graph([lambda: torch.mm(a, b, out=c)], max(3, repeats // 10))
    return 2 * n**3 / (us * 1e-6)


def _kbit_weights(out_f, in_f, k, device="cuda"):
    from ..backends.cuda import dispatch, kernels as cuda, library, tiled

    cb = fmt.nf_codebook(k).to(device)
    w = torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16)
    p, a, s = cuda.quantize(w, cb, k, "e4m4")
    return p, a, s, cb


def _bf16_weight_copies(out_f, in_f, device="cuda"):
    """Rotating bf16 weight copies for the bf16 cuBLAS reference (together > 4x L2, see _n_copies)."""
    return [torch.randn(out_f, in_f, device=device, dtype=torch.bfloat16)
            for _ in range(_n_copies(out_f * in_f * 2))]


def _tinygemm_weights(out_f, in_f, device="cuda"):
    # int4 weights packed two per byte [n, k/2] -> tinygemm layout; group size 32; bf16 scales and zeros
    q = torch.randint(0, 16, (out_f, in_f), dtype=torch.int32, device=device)
    packed_u8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    wp = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
    sz = torch.randn(in_f // 32, out_f, 2, device=device, dtype=torch.bfloat16) * 0.01
    return wp, sz


def _have_bnb():
    try:
        import bitsandbytes  # noqa: F401
        import bitsandbytes.functional  # noqa: F401

        return True
    except Exception:
        return False


def run(args) -> int:
    if not torch.cuda.is_available():
        print("kernels benchmark: no CUDA device")
        return 1
    from ..backends.cuda import dispatch, kernels as cuda, library, tiled

    if not library.available():
        print(f"kernels benchmark: kbit CUDA library not available ({library.load_error()})")
        return 1
    torch.manual_seed(0)
    dev_name = torch.cuda.get_device_name()
    repeats = args.repeats
    copies = {}
    bw = copy_bandwidth(repeats, copies)
    l2 = _l2_bytes()
    print(f"device: {dev_name}; torch {torch.__version__}; L2 {l2 / 2**20:.0f} MiB; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s (read+write; copy engine {copies['memcpy'] / 1e12:.2f}, SM kernel "
          f"{copies['sm_kernel'] / 1e12:.2f})")
    results = {"device": dev_name, "torch": torch.__version__, "copy_bw_Bps": bw, "copy_bw_detail_Bps": copies,
               "gemv": [], "dequantize": []}
    ks = [int(v) for v in args.k.split(",")]

    # ---- dequantize ----
    do, di = (int(v) for v in args.dequant_shape.split("x"))
    print(f"\ndequantize {do}x{di} ({do * di / 2**20:.0f}M elements) -> bf16")
    print(f"{'K':>3} {'us':>9} {'GB/s':>8} {'% copy':>7}")
    for k in ks:
        p, a, s, cb = _kbit_weights(do, di, k)
        nbytes = p.numel() * 4 + a.numel() + do * di * 2
        outs = [torch.empty(do, di, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        fns = [lambda o=o: cuda.dequantize_out(p, a, s, cb, k, di, o) for o in outs]
        us = _time_graph(fns, repeats)
        pct = 100 * nbytes / (us * 1e-6) / bw
        print(f"{k:>3} {us:9.1f} {nbytes / us / 1e3:8.0f} {pct:6.1f}%")
        results["dequantize"].append({"k": k, "shape": [do, di], "us": us, "pct_copy": pct})
        if dispatch.holds_tiled(do, di, k, "e4m4", torch.device("cuda")):  # KbitLinear holds it tiled
            wt, at = tiled.tile(p, a, di, k)
            us = _time_graph([lambda o=o: cuda.dequantize_out(wt, at, s, cb, k, di, o) for o in outs], repeats)
            pct = 100 * nbytes / (us * 1e-6) / bw
            print(f"{f'{k} tiled':>3} {us:9.1f} {nbytes / us / 1e3:8.0f} {pct:6.1f}%")
            results["dequantize"].append({"k": k, "layout": "tiled", "shape": [do, di], "us": us, "pct_copy": pct})
            del wt, at
        del p, a, s, outs, fns
    torch.cuda.empty_cache()

    # ---- GEMV ----
    have_bnb = _have_bnb()
    ms = [int(v) for v in args.m.split(",")]
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
    tc_rate = bf16_tensor_rate(repeats)
    results["bf16_tensor_flops"] = tc_rate
    hdr = (f"{'shape':>12} {'M':>4} {'kernel':>14} {'us':>8} {'% copy':>7} {'vs bf16':>8} {'vs tinygemm':>11}"
           f" {'of floor':>8}")
    print(f"\ny[M, out] = x[M, in] @ W^T (bf16 activations): the fused GEMV to M = {dispatch.GEMV_MAX_M}, the tiled "
          "or bit-plane GEMM above; % copy = bytes moved / time / copy bandwidth; floor = max(weight bytes / copy "
          f"bandwidth, 2 M out in / bf16 rate {tc_rate / 1e12:.0f} TFLOP/s)")
    if not have_bnb:
        print("(bitsandbytes not importable: NF4 column skipped)")
    print(hdr)
    for out_f, in_f in shapes:
        for M in ms:
            rows = []
            x = torch.randn(M, in_f, device="cuda", dtype=torch.bfloat16)

            def floor(kbytes):
                """kbit's floor: its weight bytes at copy bandwidth, or its flops at the measured bf16 rate"""
                return max(kbytes / bw, 2 * M * out_f * in_f / tc_rate) * 1e6
            io_bytes = M * in_f * 2 + M * out_f * 2
            # bf16 cuBLAS
            wbytes = out_f * in_f * 2
            ws = _bf16_weight_copies(out_f, in_f)
            ys = torch.empty(M, out_f, device="cuda", dtype=torch.bfloat16)
            us_bf16 = _time_graph([lambda w=w: torch.mm(x, w.t(), out=ys) for w in ws], repeats)
            rows.append(("bf16 cuBLAS", us_bf16, wbytes + io_bytes, None))
            del ws
            # tinygemm int4, group 32
            us_tg = None
            try:
                tg = [_tinygemm_weights(out_f, in_f) for _ in range(_n_copies(out_f * in_f // 2 + in_f // 32 * out_f * 4))]
                tbytes = out_f * in_f // 2 + (in_f // 32) * out_f * 4
                us_tg = _time_graph([lambda t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], 32, t[1]) for t in tg],
                                    repeats)
                rows.append(("tinygemm g32", us_tg, tbytes + io_bytes, None))
                del tg
            except Exception as exc:  # pragma: no cover
                print(f"   tinygemm failed: {type(exc).__name__}: {exc}")
            if have_bnb:
                try:
                    import bitsandbytes.functional as bnbf

                    copies = []
                    for _ in range(_n_copies(out_f * in_f // 2)):
                        wq, st = bnbf.quantize_4bit(torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16),
                                                    quant_type="nf4", blocksize=64)
                        copies.append((wq, st))
                    nbytes = out_f * in_f // 2 + out_f * in_f // 64 * 4
                    if M == 1:
                        us_bnb = _time_graph([lambda c=c: bnbf.gemv_4bit(x, c[0].t(), state=c[1]) for c in copies],
                                             repeats)
                        rows.append(("bnb nf4 g64", us_bnb, nbytes + io_bytes, None))
                    del copies
                except Exception as exc:  # pragma: no cover
                    print(f"   bitsandbytes failed: {type(exc).__name__}: {exc}")
            # kbit
            for k in ks:
                p0, a0, s0, cb = _kbit_weights(out_f, in_f, k)
                kbytes = p0.numel() * 4 + a0.numel()
                copies = [(p0, a0)] + [(p0.clone(), a0.clone()) for _ in range(_n_copies(kbytes) - 1)]
                y = torch.empty(M, out_f, device="cuda", dtype=torch.bfloat16)
                held_tiled = dispatch.holds_tiled(out_f, in_f, k, "e4m4", torch.device("cuda"))
                # the fused GEMV up to GEMV_MAX_M rows; above, the tiled GEMM (where the layer is held tiled and the
                # GPU runs it) or the path linear takes (dequantize + cuBLAS)
                gemm = M > dispatch.GEMV_MAX_M
                fused = cuda.gemm_out if gemm else cuda.linear_out
                if held_tiled and (not gemm or dispatch.wgmma_runs_on(torch.cuda.current_device())):
                    # KbitLinear holds this weight in the tiled layout: time that, and the bit planes too
                    tcopies = [tiled.tile(c[0], c[1], in_f, k) for c in copies]
                    us = _time_graph([lambda c=c: fused(x, c[0], c[1], s0, cb, k, in_f, None, y) for c in tcopies],
                                     repeats)
                    rows.append((f"kbit K={k}", us, kbytes + io_bytes, floor(kbytes)))
                    del tcopies
                    held_tiled = True
                else:
                    held_tiled = False
                # the bit planes (what GPUs other than sm_90 hold): the fused GEMV, or above it the bit-plane GEMM
                planes = (cuda.linear_out if not gemm else cuda.gemm_planes_out
                          if in_f % 8 == 0 and dispatch.planes_gemm_runs_on(torch.cuda.current_device(), k) else None)
                if planes is not None:
                    us = _time_graph([lambda c=c: planes(x, c[0], c[1], s0, cb, k, in_f, None, y) for c in copies],
                                     repeats)
                    rows.append((f"K={k} planes" if held_tiled or gemm else f"kbit K={k}", us, kbytes + io_bytes,
                                 floor(kbytes)))
                if k == 4 and M > 8:  # the fallback path: dequantize + cuBLAS
                    wbuf = torch.empty(out_f, in_f, device="cuda", dtype=torch.bfloat16)
                    us_dq = _time_graph([lambda c=c: torch.mm(x, cuda.dequantize_out(c[0], c[1], s0, cb, k, in_f, wbuf)
                                                              .t(), out=y) for c in copies], repeats)
                    rows.append(("K=4 dq+cuBLAS", us_dq, kbytes + io_bytes, None))
                    del wbuf
                del copies, p0, a0
            for name, us, nbytes, floor_us in rows:
                pct = 100 * nbytes / (us * 1e-6) / bw
                vs_bf16 = us_bf16 / us
                vs_tg = (us_tg / us) if us_tg else float("nan")
                of_floor = f"{us / floor_us:8.2f}x" if floor_us else ""
                print(f"{f'{out_f}x{in_f}':>12} {M:>4} {name:>14} {us:8.2f} {pct:6.1f}% {vs_bf16:7.2f}x {vs_tg:10.2f}x"
                      f"{of_floor}")
                results["gemv"].append({"shape": [out_f, in_f], "M": M, "kernel": name, "us": us, "pct_copy": pct,
                                        "speedup_vs_bf16": vs_bf16, "speedup_vs_tinygemm": vs_tg,
                                        "floor_us": floor_us})
            torch.cuda.empty_cache()
    print("\nPython cost of one eager call (host microseconds, best of 5 x 300 calls, kbit K=4 256x256 M=1)")
    results["python_overhead_us"] = python_overhead()
    for name, us in results["python_overhead_us"].items():
        print(f"{name:>40} {us:7.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def python_overhead(n: int = 300) -> dict:
    """Host-side microseconds per eager call (no sync inside the loop: the launch queue absorbs the kernels)."""
    import time

    from ..backends.cuda import dispatch, kernels as cuda, library, tiled
    from ..ops import linear_forward

    k, out_f, in_f = 4, 256, 256
    p, a, s, cb = _kbit_weights(out_f, in_f, k)
    x = torch.randn(1, 1, in_f, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(1, out_f, device="cuda", dtype=torch.bfloat16)
    res = {}
    with torch.no_grad():
        for name, fn in (
            ("linear_forward (ctypes fast path)", lambda: linear_forward(x, p, a, s, cb, k, in_f, None)),
            ("linear_out (no allocation)", lambda: cuda.linear_out(x.view(1, in_f), p, a, s, cb, k, in_f, None, y)),
            ("torch.ops.kbit.linear (dispatcher)", lambda: torch.ops.kbit.linear(x, p, a, s, cb, k, in_f, None)),
            ("torch.empty alone", lambda: torch.empty((1, out_f), dtype=torch.bfloat16, device="cuda")),
        ):
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(n):
                    fn()
                best = min(best, (time.perf_counter() - t) / n * 1e6)
                torch.cuda.synchronize()
            res[name] = best
    return res
