"""Run every kbit CUDA kernel family on small, odd shapes, for compute-sanitizer (tools/gpu_check.sh runs both):

    PYTHONPATH=. compute-sanitizer --tool memcheck --error-exitcode 1 python tools/sanitize_driver.py
    PYTHONPATH=. compute-sanitizer --tool racecheck --error-exitcode 1 python tools/sanitize_driver.py --sync

Bit planes (K = 2..5, both block-scale formats): quantize, dequantize, the fused GEMV (M <= 8, the token tiles up to
M = 64, the folded 8-row tiles), dequantize + cuBLAS (M = 65), the bit-plane GEMM (M = 70, every launch shape), the
per-row expert GEMV, the grouped expert path, (on sm_90) the grouped expert GEMM, the fused experts block (both
gatings, with and without biases) and the router selection kernel.
Tiled layout (K = 2..5, e4m4): tile, untile, dequantize, and on sm_90 the tiled GEMV and GEMM, the library's choice
through kernels.linear and every GEMV variant of kernels.TILED_KERNELS forced through kernels.linear_out. Prints the calls per
family; the sanitizer's exit code says whether any of them misbehaved. Arguments narrow the run (--help). Under
racecheck pass --sync: its host memory grows with the launches queued ahead of the GPU (past 120 GiB without it).
"""

import argparse
import itertools
from collections import Counter

import torch

from kbit_hf import format as fmt
from kbit_hf.backends.cuda import dispatch, kernels, library
from kbit_hf.backends.cuda.tiled import TILED_K, tile, untile

# (37, 2088), (2, 20, 2080): the folded tiles at M <= 4 (a partial tile and step; 2088: a partial block too)
PLANE_SHAPES = [(1, 7), (3, 33), (9, 100), (2, 3, 64), (17, 520), (20, 4104), (37, 2088), (2, 20, 2080)]
GEMV_M = (1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65)  # 65: dequantize + cuBLAS
# (48, 512): fewer tiles than SMs; (272, 768): 17 tiles of 3 chunks
TILED_SHAPES = [(48, 512), (272, 768)]
TILED_M = (1, 8, 9, 17, 33, 64)
# the library's choice above 64 rows on TILED_SHAPES: the tiled GEMM at 65 and 130 (128 and 256 tokens per CTA,
# partial token tiles), dequantize + cuBLAS at 300 and 2000 (small layers); and the GEMM forced on GEMM_SHAPES: 272 x
# 2304's k range is split (4 splits of 9 items) through the workspace and gemm_reduce_kernel; 16912 x 256 fills the
# GPU without a split (the staged epilogue; its last CTA holds 1 tile)
GEMM_M = (65, 130, 300, 2000)
GEMM_SHAPES = [(272, 2304), (16912, 256)]
GEMM_FORCED_M = (65, 130, 300)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
X_DTYPES = (torch.bfloat16, torch.float16)


SYNC = False  # --sync / -v: wait for each step's kernels before the next step is launched
VERBOSE = False  # -v: print each step as it starts (after the sync, so a crash is placed exactly)


def _step(what: str) -> None:
    if SYNC or VERBOSE:
        torch.cuda.synchronize()
    if VERBOSE:
        print(what, flush=True)


def bit_planes(calls: Counter, ks) -> None:
    for k in ks:
        print(f"bit planes, K = {k}", flush=True)
        cb = fmt.nf_codebook(k).cuda()
        for shape, af in itertools.product(PLANE_SHAPES, fmt.ABSMAX_FORMATS):
            _step(f"  {shape}, {af} scales")
            for wdt in DTYPES:  # the weights quantized last (bf16) feed the GEMVs below
                p, a, s = kernels.quantize(torch.randn(shape, device="cuda").to(wdt), cb, k, af)
                calls["quantize"] += 1
                for odt in DTYPES:
                    kernels.dequantize(p, a, s, cb, k, shape[-1], odt)
                    calls["dequantize"] += 1
            if len(shape) == 2:
                for xdt, M in itertools.product(X_DTYPES, GEMV_M):
                    x = torch.randn(M, shape[-1], device="cuda", dtype=xdt)
                    bias = torch.randn(shape[0], device="cuda", dtype=xdt) if af == "e4m4" else None
                    kernels.linear(x, p, a, s, cb, k, shape[-1], bias)
                    calls["gemv" if M <= dispatch.GEMV_MAX_M else "dequantize + cuBLAS"] += 1
                if shape[-1] % 8 == 0 and dispatch.planes_gemm_runs_on(torch.cuda.current_device(), k):
                    # the bit-plane GEMM: the library's launch shape and every forced one that fits the device
                    x = torch.randn(70, shape[-1], device="cuda", dtype=torch.bfloat16)
                    y = torch.empty(70, shape[0], device="cuda", dtype=torch.bfloat16)
                    for launch in kernels.PLANES_GEMM_SHAPES:
                        try:
                            kernels.gemm_planes_out(x, p, a, s, cb, k, shape[-1], None, y, launch)
                            calls["gemm planes"] += 1
                        except RuntimeError as exc:
                            assert "not supported" in str(exc).lower(), exc
                continue
            for xdt, kernel in itertools.product(X_DTYPES, ("per_row", "grouped")):
                x = torch.randn(5, shape[-1], device="cuda", dtype=xdt)
                ids = torch.tensor([0, 1, -1, 2, 1], device="cuda")  # -1: an expert-parallel sentinel
                kernels.expert_linear(x, ids, p, a, s, cb, k, shape[-1], kernel=kernel)
                calls[f"expert gemv, {kernel}"] += 1
            for n in (70, 600):  # grouped work items of 16 .. 64 rows
                x = torch.randn(n, shape[-1], device="cuda", dtype=torch.bfloat16)
                ids = torch.randint(-1, shape[0] + 1, (n,), device="cuda")
                kernels.expert_linear(x, ids, p, a, s, cb, k, shape[-1], kernel="grouped")
                calls["expert gemv, grouped"] += 1
            if dispatch.wgmma_runs_on(torch.cuda.current_device()):
                _expert_gemm(calls, k, cb, af)
            if shape == PLANE_SHAPES[-1]:
                _moe_experts(calls, k, cb, af)
            if af == "e4m4":  # the per-expert loop (dequantize + cuBLAS)
                x = torch.randn(70, shape[-1], device="cuda", dtype=torch.float32)
                ids = torch.randint(-1, shape[0] + 1, (70,), device="cuda")
                kernels.expert_linear(x, ids, p, a, s, cb, k, shape[-1])
                calls["expert linear, per-expert loop"] += 1


def _moe_experts(calls: Counter, k, cb, af) -> None:
    """The fused experts block: 2 and 3 tokens of top-3 over 5 experts (sentinel ids included), hidden 100 (a partial
    block), intermediate 37 (a partial tile and block) and 248 (a full step of 8 blocks whose last is partial), 36
    outputs (a partial 16-row tile)."""
    E, hidden, out_f = 5, 100, 36
    for xdt, gate, T, inter in itertools.product(X_DTYPES, kernels.MOE_GATES, (2, 3), (37, 248)):
        gu = kernels.quantize(torch.randn(E, 2 * inter, hidden, device="cuda"), cb, k, af) + (cb,)
        dn = kernels.quantize(torch.randn(E, out_f, inter, device="cuda"), cb, k, af) + (cb,)
        x = torch.randn(T, hidden, device="cuda", dtype=xdt)
        ids = torch.randint(-1, E + 1, (T, 3), device="cuda")
        w = torch.rand(T, 3, device="cuda", dtype=xdt)
        biases = (torch.randn(E, 2 * inter, device="cuda", dtype=xdt), torch.randn(E, out_f, device="cuda", dtype=xdt))
        gb, db = biases if gate == "clamped" else (None, None)
        kernels.moe_experts(x, ids, w, *gu, gb, *dn, db, k, gate, 1.702, 7.0)
        calls["moe experts (2 kernels)"] += 1
    for (E, top_k, T), mode in itertools.product(((5, 3, 9), (128, 8, 1), (2048, 32, 5)), kernels.ROUTER_MODES):
        kernels.router_topk(torch.randn(T, E, device="cuda", dtype=torch.bfloat16), top_k, mode, True, torch.float32)
        calls["router top-k"] += 1


def _expert_gemm(calls: Counter, k, cb, af) -> None:
    """The grouped expert GEMM (sm_90a): 40 rows (a partial 128-row CTA and 16-row tile), 2.5 groups of k (a half
    group), 64 / 128 / 256 rows per work item, ids outside [0, E)."""
    E, out_f, in_f = 3, 40, 320
    p, a, s = kernels.quantize(torch.randn(E, out_f, in_f, device="cuda"), cb, k, af)
    for xdt, n in itertools.product(X_DTYPES, (70, 300, 700)):
        x = torch.randn(n, in_f, device="cuda", dtype=xdt)
        ids = torch.randint(-1, E + 1, (n,), device="cuda")
        kernels.expert_linear(x, ids, p, a, s, cb, k, in_f, kernel="gemm")
        calls["expert gemm"] += 1


def tiled(calls: Counter, ks, variants=None) -> None:
    gemv = dispatch.tiled_gemv_runs_on(torch.cuda.current_device())
    gemm = dispatch.wgmma_runs_on(torch.cuda.current_device())
    auto = variants is None or "auto" in variants
    forced = [name for name in kernels.TILED_KERNELS if name != "auto" and (variants is None or name in variants)]
    for k, (out_f, in_f) in itertools.product([k for k in ks if k in TILED_K], TILED_SHAPES):
        print(f"tiled, K = {k}, {out_f}x{in_f}", flush=True)
        cb = fmt.nf0_codebook(k).cuda()
        _step("  quantize")
        p, a, s = kernels.quantize(torch.randn(out_f, in_f, device="cuda"), cb, k, "e4m4")
        _step("  tile, untile, dequantize")
        wt, at = tile(p, a, in_f, k)
        untile(wt, at, in_f, k)
        calls["tile"] += 1
        calls["untile"] += 1
        for odt in DTYPES:
            kernels.dequantize(wt, at, s, cb, k, in_f, odt)
            calls["dequantize tiled"] += 1
        if not gemv:
            continue
        for xdt in X_DTYPES:
            bias = torch.randn(out_f, device="cuda", dtype=xdt)
            for M in TILED_M + GEMM_M if auto else ():  # the library's choice: GEMV, GEMM, dequantize + cuBLAS
                _step(f"  {xdt}, auto, M = {M}")
                x = torch.randn(M, in_f, device="cuda", dtype=xdt)
                kernels.linear(x, wt, at, s, cb, k, in_f, bias)
                calls["gemv tiled, auto" if M <= dispatch.GEMV_MAX_M
                      else "gemm tiled" if gemm and dispatch.linear_uses_gemm(M, xdt, out_f, in_f)
                      else "dequantize tiled + cuBLAS"] += 1
            for name, M in itertools.product(forced, TILED_M):
                _step(f"  {xdt}, {name}, M = {M}")
                x = torch.randn(M, in_f, device="cuda", dtype=xdt)
                y = torch.empty(M, out_f, device="cuda", dtype=xdt)
                kernels.linear_out(x, wt, at, s, cb, k, in_f, bias if M % 2 else None, y, tiled_kernel=name)
                calls[f"gemv tiled, {name}"] += 1
    if gemm and auto:
        for k, (out_f, in_f) in itertools.product([k for k in ks if k in TILED_K], GEMM_SHAPES):
            print(f"tiled GEMM, K = {k}, {out_f}x{in_f}", flush=True)
            cb = fmt.nf0_codebook(k).cuda()
            p, a, s = kernels.quantize(torch.randn(out_f, in_f, device="cuda"), cb, k, "e4m4")
            wt, at = tile(p, a, in_f, k)
            for xdt, M in itertools.product(X_DTYPES, GEMM_FORCED_M):
                _step(f"  {xdt}, gemm, M = {M}")
                x = torch.randn(M, in_f, device="cuda", dtype=xdt)
                y = torch.empty(M, out_f, device="cuda", dtype=xdt)
                bias = torch.randn(out_f, device="cuda", dtype=xdt) if M % 2 else None
                kernels.gemm_out(x, wt, at, s, cb, k, in_f, bias, y)
                split = library.lib.kbit_gemm_tiled_workspace(M, out_f, in_f) > -(-M * in_f * 2 // 256) * 256
                calls["gemm tiled, k split" if split else "gemm tiled, whole k"] += 1
    if not gemv:
        print("sanitize_driver: not an sm_90 device, the tiled GEMVs were not run")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", metavar="planes|tiled",
                        help="the bit-plane kernels and / or the tiled layout's (default both)")
    parser.add_argument("--k", type=int, action="append", choices=fmt.SUPPORTED_K, help="only this K (repeatable)")
    parser.add_argument("--tiled-kernel", action="append", choices=tuple(kernels.TILED_KERNELS),
                        help="only this tiled GEMV variant (repeatable; auto: kernels.linear)")
    parser.add_argument("--sync", action="store_true", help="synchronize after each step (racecheck needs it)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each step as it starts (implies --sync)")
    args = parser.parse_args()
    global SYNC, VERBOSE
    SYNC, VERBOSE = args.sync, args.verbose
    if set(args.parts) - {"planes", "tiled"}:
        parser.error(f"parts: {args.parts}; expected planes and / or tiled")
    assert torch.cuda.is_available(), "no CUDA device"
    assert library.available(), library.load_error()
    ks = args.k or fmt.SUPPORTED_K
    parts = args.parts or ("planes", "tiled")
    calls = Counter()
    if "planes" in parts:
        bit_planes(calls, ks)
    if "tiled" in parts:
        tiled(calls, ks, args.tiled_kernel)
    torch.cuda.synchronize()
    for family, n in calls.items():
        print(f"  {family:28} {n:5d}")
    print(f"sanitize_driver: {sum(calls.values())} kernel calls OK")


if __name__ == "__main__":
    main()
