"""Where does a decode step's time go? Loads a checkpoint with one method, warms `generate` up (static cache:
compiled + CUDA graphs, or eager), then profiles `generate` and prints the GPU time per decode step by kernel,
the summed GPU busy time per step, the wall time per step, and the host (CPU) self time by op.

usage (from the repository root): PYTHONPATH=. python tools/profile_decode.py FOLDER METHOD [static|eager] [new_tokens]
METHOD: one of `python -m kbit_hf.bench generate --methods` (bf16, kbit4, kbit2-head, bnb-nf4, ...)
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from kbit_hf.bench.generate import parse_methods


def main():
    folder, method = sys.argv[1], sys.argv[2]
    static = (sys.argv[3] if len(sys.argv) > 3 else "static") == "static"
    n = int(sys.argv[4]) if len(sys.argv) > 4 else 33
    m = parse_methods(method)[0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                 quantization_config=m.quantization_config()).eval()
    ids = torch.randint(10, 1000, (1, 64), device="cuda")
    kw = dict(min_new_tokens=n, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    if static:
        kw["cache_implementation"] = "static"

    def gen(k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=k, **{**kw, "min_new_tokens": k})
        torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.inference_mode():
        gen(n)
        gen(n)
        t1, tn = min(gen(1) for _ in range(3)), min(gen(n) for _ in range(3))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            gen(n)
            gen(1)
    steps = n - 1
    print(f"\n== {method} {'static' if static else 'eager'}: wall per decode step {(tn - t1) / steps * 1e3:.3f} ms")
    # GPU time of the n-token run minus the 1-token run = decode steps only
    ev = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in ev)
    print(f"GPU busy (both profiled runs, us): {total:.0f}; kernels: {sum(e.count for e in ev)}")
    rows = sorted(ev, key=lambda e: -e.self_device_time_total)[:30]
    print(f"{'us total':>10} {'count':>7} {'us/call':>8}  name")
    for e in rows:
        print(f"{e.self_device_time_total:10.0f} {e.count:7d} {e.self_device_time_total / e.count:8.2f}  {e.key[:110]}")
    # host side: where the Python / dispatcher time of the profiled runs goes (self CPU time by op)
    cpu = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    print(f"host self time of the profiled runs: {sum(e.self_cpu_time_total for e in cpu):.0f} us")
    print(f"{'us self':>10} {'count':>7} {'us/call':>8}  op")
    for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:25]:
        print(f"{e.self_cpu_time_total:10.0f} {e.count:7d} {e.self_cpu_time_total / e.count:8.2f}  {e.key[:110]}")


if __name__ == "__main__":
    main()
