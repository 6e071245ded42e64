"""What the GPU allows for the shapes the kbit kernels are judged on: times of kernels that only move bytes
(tools/floor_kernels.cu), measured with the kernel benchmark's method (one CUDA graph per case, buffers
rotated over > 4x L2, median per call). Best over a few grid sizes. Prints microseconds and % of the SM copy
bandwidth of the same run.

usage (from the repository root):
    nvcc -arch=sm_90 -O3 -shared -Xcompiler -fPIC -cudart static -o /tmp/libfloor.so tools/floor_kernels.cu
    PYTHONPATH=. python tools/bench_floor.py /tmp/libfloor.so [json_out]
FLOOR_TILES=1: only the GEMV's load pattern (floor_tileread); FLOOR_TILES_CASES="warps:depth:CTAs per SM:rows,...",
    rows 16 or 8.
FLOOR_ITEMS=1: the tiled range GEMV's stream of items without its decode (floor_itemread), against a plain read of
    the same bytes; FLOOR_ITEMS_CASES="mode:slots:warps,...": mode 0 bulk copies + the GEMV's slot reads, 1 bulk
    copies alone, 2 register loads; + 4: the items dealt to the warps in turn.
"""

import ctypes
import json
import os
import sys

import torch

from kbit_hf.bench.kernels import _n_copies, _time_graph, copy_bandwidth


def main():
    lib = ctypes.CDLL(sys.argv[1])
    for f in (lib.floor_empty, lib.floor_read, lib.floor_write, lib.floor_expand):
        f.restype = ctypes.c_int
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth(30)
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # noqa: E731
    rows = []

    def report(name, nbytes, fns):
        us = _time_graph(fns, 30)
        pct = 100 * nbytes / (us * 1e-6) / bw if nbytes else None
        rows.append({"case": name, "us": us, "bytes": nbytes, "pct_copy": pct})
        print(f"{name:44} {us:9.2f} us" + (f"  {pct:5.1f}% of copy" if pct else ""), flush=True)

    if os.environ.get("FLOOR_TILES"):
        tile_reads(lib, sink, stream, report)
    elif os.environ.get("FLOOR_ITEMS"):
        item_reads(lib, sms, sink, stream, report)
    else:
        floor_cases(lib, sms, sink, stream, report)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows}, f, indent=1)


def tile_reads(lib, sink, stream, report):
    """The GEMV's load pattern without its decode (floor_tileread), K = 4 bytes of the kernel benchmark's shapes."""
    lib.floor_tileread.restype = ctypes.c_int
    smem_per_sm = torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor
    cases = os.environ.get("FLOOR_TILES_CASES", "4:1:4:16,8:1:2:16,4:2:4:16,4:4:4:16,8:2:2:16,4:1:0:16,4:2:0:16,"
                                                "4:1:4:8,8:1:2:8,4:2:4:8,8:2:2:8")
    cases = [tuple(int(v) for v in c.split(":")) for c in cases.split(",")]
    for out_f, in_f in ((4096, 4096), (14336, 4096), (4096, 14336), (28672, 8192)):
        nb = in_f // 32
        nbytes = out_f * nb * 17
        n = _n_copies(nbytes)
        ws = [torch.empty(out_f, nb * 16, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(n)]
        aws = [torch.empty(out_f, nb, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(n)]
        for warps, depth, ctas, rows in cases:
            # ctas: resident CTAs per SM forced through dynamic shared memory (16 warps per SM, as the GEMV's
            # registers allow); 0: as many as fit. rows: the tile (floor_kernels.cu)
            smem = smem_per_sm // ctas - 1024 - 256 if ctas else 0
            report(f"tileread {out_f}x{in_f} {rows} rows D={depth} W={warps} {ctas or 'max'}/SM", nbytes,
                   [lambda w=w, a=a, warps=warps, depth=depth, rows=rows, smem=smem: lib.floor_tileread(
                       ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(a.data_ptr()), out_f, in_f, warps, depth, rows,
                       smem, ctypes.c_void_p(sink.data_ptr()), stream()) for w, a in zip(ws, aws)])
        del ws, aws


def item_reads(lib, sms, sink, stream, report):
    """The tiled range GEMV's stream of items (bulk copies into per-warp slots, or register loads), K = 4 items of
    the kernel benchmark's shapes and K = 2 items of 14336x4096, next to a plain read of the same bytes (floor_read)."""
    lib.floor_itemread.restype = ctypes.c_int
    cases = os.environ.get("FLOOR_ITEMS_CASES", "0:1:16,0:2:16,0:3:16,1:1:16,1:2:16,2:1:16,2:2:16,2:3:16,0:2:8,0:4:8,"
                                                "2:2:8,2:4:8")
    cases = [tuple(int(v) for v in c.split(":")) for c in cases.split(",")]
    names = {0: "bulk + slot reads", 1: "bulk copies alone", 2: "register loads"}
    names.update({m + 4: n + ", dealt" for m, n in names.items()})
    for label, items, iw in (("4096x4096 K=4", 4096, 2048), ("14336x4096 K=4", 14336, 2048),
                             ("14336x4096 K=2", 14336, 1024), ("28672x8192 K=4", 57344, 2048)):
        nbytes = items * (iw + 128)
        n = _n_copies(nbytes)
        ws = [torch.empty(items * iw, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(n)]
        aws = [torch.empty(items * 128, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(n)]
        for mult in (2, 4):
            g = sms * mult
            report(f"read {label}, weights alone ({items * iw / 1e6:.1f} MB) grid {mult}x", items * iw,
                   [lambda w=w, g=g: lib.floor_read(ctypes.c_void_p(w.data_ptr()), items * iw,
                                                    ctypes.c_void_p(sink.data_ptr()), g, stream()) for w in ws])
        for mode, slots, warps in cases:
            report(f"items {label} {names[mode]} S={slots} W={warps}", nbytes,
                   [lambda w=w, a=a, mode=mode, slots=slots, warps=warps: lib.floor_itemread(
                       ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(a.data_ptr()), items, iw, mode, slots, warps,
                       sms, ctypes.c_void_p(sink.data_ptr()), stream()) for w, a in zip(ws, aws)])
        del ws, aws


def floor_cases(lib, sms, sink, stream, report):
    """The empty kernel, pure reads, writes and the dequantize pattern."""
    report(f"empty kernel, {sms} CTAs", 0, [lambda: lib.floor_empty(sms, stream())] * 200)
    # packed K=4 bytes (4.25 bits per weight) of the kernel benchmark's GEMV shapes, plus a K=2 one
    for label, nbytes in (("1024x4096 K=4", 1024 * 4096 * 17 // 32), ("4096x4096 K=4", 4096 * 4096 * 17 // 32),
                          ("4096x4096 K=2", 4096 * 4096 * 9 // 32), ("14336x4096 K=4", 14336 * 4096 * 17 // 32),
                          ("28672x8192 K=4", 28672 * 8192 * 17 // 32)):
        nbytes = nbytes // 16 * 16
        bufs = [torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
                for _ in range(_n_copies(nbytes))]
        for mult in (1, 2, 4, 8):
            g = sms * mult
            report(f"read {label} ({nbytes / 1e6:.1f} MB), grid {mult}x SMs", nbytes,
                   [lambda b=b, g=g: lib.floor_read(ctypes.c_void_p(b.data_ptr()), nbytes,
                                                    ctypes.c_void_p(sink.data_ptr()), g, stream()) for b in bufs])
        del bufs
    # the dequantize benchmark's case: 8192x8192 to bf16 (134 MB written)
    out_bytes = 8192 * 8192 * 2
    dsts = [torch.empty(out_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for mult in (8, 32, 64, 128):
        g = sms * mult
        report(f"write 134 MB, grid {mult}x SMs", out_bytes,
               [lambda d=d, g=g: lib.floor_write(ctypes.c_void_p(d.data_ptr()), out_bytes, g, stream()) for d in dsts])
    for r, label in ((4, "K=4 ratio"), (8, "K=2 ratio")):
        src_bytes = out_bytes // r
        srcs = [torch.empty(src_bytes, dtype=torch.uint8, device="cuda").random_(0, 255) for _ in range(2)]
        for mult in (8, 32, 64, 128):
            g = sms * mult
            report(f"expand {src_bytes / 1e6:.0f} -> 134 MB ({label}), grid {mult}x", src_bytes + out_bytes,
                   [lambda s=s, d=d, g=g: lib.floor_expand(ctypes.c_void_p(s.data_ptr()), ctypes.c_void_p(d.data_ptr()),
                                                           out_bytes, r, g, stream()) for s, d in zip(srcs, dsts)])


if __name__ == "__main__":
    main()
