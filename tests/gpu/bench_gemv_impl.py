"""Time the fused GEMV alone (CUDA-graph method of `python -m kbit_hf.bench kernels`) for one library or decode
configuration, so that two can be compared from separate processes in the same device session (K = 4 weights in the
layout KbitLinear holds them, tiled where eligible, unless --planes): the library by
KBIT_CUDA_LIB, the decode mode by KBIT_GEMV_CFG (see csrc/kbit_gemv.cu, launch()), e.g.

    KBIT_CUDA_LIB=old/libkbit_cuda.so python tests/gpu/bench_gemv_impl.py --tag old --json old.json
    KBIT_CUDA_LIB=new/libkbit_cuda.so python tests/gpu/bench_gemv_impl.py --tag new --json new.json
    KBIT_GEMV_CFG="*=t" python tests/gpu/bench_gemv_impl.py --tag table --json table.json
    python tests/gpu/bench_gemv_impl.py --compare old.json new.json table.json
"""

import argparse
import json

import torch

from kbit_hf.cuda_backend import TILED_KERNELS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336,28672x8192")
    ap.add_argument("--m", default="1,4")
    ap.add_argument("--k", default="2,3,4,5")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tag", default="")
    ap.add_argument("--tinygemm", action="store_true", help="also time tinygemm int4 g32 (aten._weight_int4pack_mm)")
    ap.add_argument("--bf16", action="store_true", help="also time bf16 cuBLAS (torch.mm)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--check", action="store_true", help="first check outputs against a float64 reference")
    ap.add_argument("--planes", action="store_true",
                    help="time the bit planes even where KbitLinear would hold the weight tiled (format.tile)")
    ap.add_argument("--tiled-kernel", choices=tuple(TILED_KERNELS), default="auto",
                    help="force one tiled GEMV kernel (cuda_backend.tiled_kernel) to compare them at the same M")
    ap.add_argument("--tiled-min-numel", type=int, default=None,
                    help="tile weights from this many elements on, every K (cuda_backend.TILED_MIN_NUMEL; 0: every "
                         "tileable shape)")
    ap.add_argument("--dequant-mm", action="store_true",
                    help="also time the dequantize + cuBLAS path on the same weights (row k: 'dqK'; the weight is "
                         "dequantized into one reused bf16 buffer, so layers whose bf16 weight fits in L2 read fast)")
    ap.add_argument("--resident", action="store_true",
                    help="one weight copy, called 20 times back to back (no rotation): where the layer fits in L2 "
                         "(14336x4096 K = 4 on an H200's 60 MB) this times the SM side without DRAM")
    ap.add_argument("--compare", nargs="+", default=None, help="print a side-by-side table of JSON files and exit")
    a = ap.parse_args()
    if a.compare:
        runs = [json.load(open(p)) for p in a.compare]
        refs = ("tinygemm", "bf16")  # reference kernels: a column each, from the first file that has them
        keys = [(r["shape"], r["M"], r["k"]) for r in runs[0]["rows"] if r["k"] not in refs]

        def ref_us(shape, M, name):
            return next((x["us"] for r in runs for x in r["rows"] if (x["shape"], x["M"], x["k"]) == (shape, M, name)),
                        float("nan"))

        print(f"{'shape':>12} {'M':>2} {'K':>2} " + " ".join(f"{r['tag']:>9}" for r in runs)
              + f" {'first/last':>10} {'tinygemm':>9} {'bf16':>9}")
        for key in keys:
            us = [next((x["us"] for x in r["rows"] if (x["shape"], x["M"], x["k"]) == key), float("nan")) for r in runs]
            print(f"{key[0]:>12} {key[1]:>2} {key[2]:>2} " + " ".join(f"{u:9.2f}" for u in us)
                  + f" {us[0] / us[-1]:9.2f}x {ref_us(key[0], key[1], 'tinygemm'):9.2f}"
                  + f" {ref_us(key[0], key[1], 'bf16'):9.2f}")
        return
    from kbit_hf import cuda_backend as cuda
    from kbit_hf.bench.kernels import (_bf16_weight_copies, _kbit_weights, _n_copies, _time_graph,
                                      _tinygemm_weights, copy_bandwidth)

    assert cuda.available(), cuda.load_error()
    cuda.tiled_kernel = cuda.TILED_KERNELS[a.tiled_kernel]
    if a.tiled_min_numel is not None:
        cuda.TILED_MIN_NUMEL = dict.fromkeys(cuda.TILED_MIN_NUMEL, a.tiled_min_numel)
    torch.manual_seed(0)
    if a.check:
        from kbit_hf import format as fmt

        worst = 0.0
        for k in (int(v) for v in a.k.split(",")):
            for (o, i) in ((40, 4104), (300, 4096), (33, 1000)):
                cb = fmt.nf_codebook(k).cuda()
                for af in fmt.ABSMAX_FORMATS:
                    p, sc_a, s = cuda.quantize(torch.randn(o, i, device="cuda"), cb, k, af)
                    wref = cuda.dequantize(p, sc_a, s, cb, k, i, torch.float32).double()
                    for dt in (torch.bfloat16, torch.float16):
                        for M in (1, 3, 8, 12, 32, 50):
                            x = torch.randn(M, i, device="cuda", dtype=dt)
                            y = cuda.linear(x, p, sc_a, s, cb, k, i, None).double()
                            ref = x.double() @ wref.t()
                            err = ((y - ref).norm() / ref.norm()).item()
                            worst = max(worst, err)
                            if not err < 1e-2:
                                print(f"[{a.tag}] CHECK FAILED K={k} {o}x{i} {af} {dt} M={M}: rel err {err:.3g}")
        print(f"[{a.tag}] check: worst relative error {worst:.3g}")
    bw = copy_bandwidth(a.repeats)
    print(f"[{a.tag}] device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s")
    rows = []
    for sh in a.shapes.split(","):
        out_f, in_f = (int(v) for v in sh.split("x"))
        if a.tinygemm:
            tbytes = out_f * in_f // 2 + (in_f // 32) * out_f * 4
            tg = [_tinygemm_weights(out_f, in_f) for _ in range(_n_copies(tbytes))]
            for M in (int(v) for v in a.m.split(",")):
                x = torch.randn(M, in_f, device="cuda", dtype=torch.bfloat16)
                us = _time_graph([lambda t=t: torch.ops.aten._weight_int4pack_mm(x, t[0], 32, t[1]) for t in tg],
                                 a.repeats)
                rows.append({"shape": sh, "M": M, "k": "tinygemm", "us": us})
                print(f"[{a.tag}] {sh:>12} M={M} tinygemm g32 {us:8.2f} us", flush=True)
            del tg
        if a.bf16:
            ws = _bf16_weight_copies(out_f, in_f)
            for M in (int(v) for v in a.m.split(",")):
                x = torch.randn(M, in_f, device="cuda", dtype=torch.bfloat16)
                y = torch.empty(M, out_f, device="cuda", dtype=torch.bfloat16)
                us = _time_graph([lambda w=w: torch.mm(x, w.t(), out=y) for w in ws], a.repeats)
                rows.append({"shape": sh, "M": M, "k": "bf16", "us": us})
                print(f"[{a.tag}] {sh:>12} M={M} bf16 cuBLAS {us:8.2f} us", flush=True)
            del ws
        for k in (int(v) for v in a.k.split(",")):
            p0, a0, s0, cb = _kbit_weights(out_f, in_f, k)
            kbytes = p0.numel() * 4 + a0.numel()
            ncopies = 1 if a.resident else _n_copies(kbytes)
            copies = [(p0, a0)] + [(p0.clone(), a0.clone()) for _ in range(ncopies - 1)]
            if not a.planes and cuda.holds_tiled(out_f, in_f, k, "e4m4", torch.device("cuda")):
                copies = [cuda.tile(c[0], c[1], in_f, k) for c in copies]  # the layout KbitLinear holds
            if a.resident:
                copies = copies * 20
            for M in (int(v) for v in a.m.split(",")):
                x = torch.randn(M, in_f, device="cuda", dtype=torch.bfloat16)
                y = torch.empty(M, out_f, device="cuda", dtype=torch.bfloat16)
                us = _time_graph([lambda c=c: cuda.linear_out(x, c[0], c[1], s0, cb, k, in_f, None, y)
                                  for c in copies], a.repeats)
                nbytes = kbytes + M * in_f * 2 + M * out_f * 2
                pct = 100 * nbytes / (us * 1e-6) / bw
                rows.append({"shape": sh, "M": M, "k": k, "us": us, "pct_copy": pct})
                print(f"[{a.tag}] {sh:>12} M={M} K={k} {us:8.2f} us {pct:5.1f}%", flush=True)
                if a.dequant_mm:
                    wbuf = torch.empty(out_f, in_f, device="cuda", dtype=torch.bfloat16)

                    def dequant_mm(c):
                        cuda.dequantize_out(c[0], c[1], s0, cb, k, in_f, wbuf)
                        torch.mm(x, wbuf.t(), out=y)

                    dm = _time_graph([lambda c=c: dequant_mm(c) for c in copies], a.repeats)
                    rows.append({"shape": sh, "M": M, "k": f"dq{k}", "us": dm})
                    print(f"[{a.tag}] {sh:>12} M={M} K={k} dequantize + cuBLAS {dm:8.2f} us ({us / dm:4.2f}x)",
                          flush=True)
                    del wbuf
            del copies, p0, a0
            torch.cuda.empty_cache()
    if a.json:
        json.dump({"tag": a.tag, "device": torch.cuda.get_device_name(), "copy_bw": bw, "rows": rows},
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
