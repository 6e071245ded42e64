"""Time the per-row expert GEMV (KbitMoE's decode path, `cuda_backend.expert_linear`) on MoE expert shapes, with the
CUDA-graph method of `python -m kbit_hf.bench kernels`. Each call takes N rows routed to N distinct experts (N > E:
random experts); the calls of one graph walk every expert twice in two random orders, so between two uses of an
expert all E experts' bytes pass (more than L2 for the default shapes). Compare libraries or knobs from separate
processes, e.g.

    KBIT_GEMV_FOLD=0 python tests/gpu/bench_expert_gemv.py --tag v6 --json v6.json
    python tests/gpu/bench_expert_gemv.py --tag fold --json fold.json
    python tests/gpu/bench_gemv_impl.py --compare v6.json fold.json
"""

import argparse
import json

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128x768x2048,128x2048x768,8x14336x4096,8x4096x14336",
                    help="experts x out x in (defaults: Qwen3-30B-A3B and Mixtral-8x7B experts)")
    ap.add_argument("--rows", default="1,2,8,32")
    ap.add_argument("--k", default="4")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tag", default="")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from kbit_hf import cuda_backend as cuda
    from kbit_hf import format as fmt
    from kbit_hf.bench.kernels import _time_graph

    assert cuda.available(), cuda.load_error()
    torch.manual_seed(0)
    rows = []
    for sh in a.shapes.split(","):
        E, out_f, in_f = (int(v) for v in sh.split("x"))
        for k in (int(v) for v in a.k.split(",")):
            cb = fmt.nf_codebook(k).cuda()
            p, ab, s = cuda.quantize(torch.randn(E, out_f, in_f, device="cuda", dtype=torch.bfloat16), cb, k, "e4m4")
            for N in (int(v) for v in a.rows.split(",")):
                x = torch.randn(N, in_f, device="cuda", dtype=torch.bfloat16)
                if N <= E:
                    order = torch.cat([torch.randperm(E), torch.randperm(E)])
                    ids = [order[i : i + N].cuda() for i in range(0, 2 * E - N + 1, N)]
                else:
                    ids = [torch.randint(0, E, (N,)).cuda() for _ in range(4)]
                us = _time_graph([lambda i=i: cuda.expert_linear(x, i, p, ab, s, cb, k, in_f) for i in ids],
                                 a.repeats)
                rows.append({"shape": sh, "M": N, "k": k, "us": us})
                print(f"[{a.tag}] {sh:>14} N={N:<3} K={k} {us:8.2f} us", flush=True)
            del p, ab, s
            torch.cuda.empty_cache()
    if a.json:
        json.dump({"tag": a.tag, "device": torch.cuda.get_device_name(), "rows": rows}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
