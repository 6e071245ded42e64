"""Where does a decode step's time go, and the prompt's? Loads a model with one method, warms `generate` up (static
cache: compiled + CUDA graphs, or eager), then profiles a generate of N new tokens and one of 1 token and prints, per
decode step (the difference of the two, over N - 1 steps): GPU time and launches by kernel, the summed GPU busy time
and kernel count, the wall time per step, and the host (CPU) self time by op; and for the prompt (the 1-token
generate, whose time is the time to first token): its wall time, GPU busy time, kernels, and the host time spent in
the CUDA calls that can wait for the GPU.

usage (from the repository root):
  PYTHONPATH=. python tools/profile_decode.py METHOD [--model SHAPE --layers L | --checkpoint FOLDER]
         [--mode static|eager] [--batch B[,B...]] [--new-tokens N] [--prompt-len P]
METHOD: one of `kbit-bench generate --methods` (bf16, kbit4, kbit2-head, bnb-nf4, ...). A named shape gets a
random-weight checkpoint under --workdir, as `kbit-bench generate` writes it. Several batch sizes share one load.
"""

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from kbit_hf.bench.generate import add_model_arguments, ensure_checkpoint, parse_methods


def per_step(prof_n, prof_1, steps, kind):
    """{name: (time, calls)} per decode step of the kernels (kind "gpu") or the host ops ("cpu"): the N-token
    profile minus the 1-token one."""
    device, attr = {"gpu": (DeviceType.CUDA, "self_device_time_total"),
                    "cpu": (DeviceType.CPU, "self_cpu_time_total")}[kind]
    events = lambda prof: [e for e in prof.key_averages() if e.device_type == device]  # noqa: E731
    one = {e.key: (getattr(e, attr), e.count) for e in events(prof_1)}
    rows = {}
    for e in events(prof_n):
        t0, c0 = one.get(e.key, (0.0, 0))
        t, c = (getattr(e, attr) - t0) / steps, (e.count - c0) / steps
        if t > 0 and c > 0:
            rows[e.key] = (t, c)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("method")
    add_model_arguments(p)
    p.add_argument("--mode", choices=("static", "eager"), default="static")
    p.add_argument("--batch", default="1", help="comma-separated batch sizes, profiled one after the other")
    p.add_argument("--new-tokens", type=int, default=17)
    p.add_argument("--prompt-len", type=int, default=64)
    args = p.parse_args()
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (the profile is an N-token generate minus a 1-token one)")
    folder = args.checkpoint or ensure_checkpoint(args.model, args.layers, args.workdir, "cuda")
    m = parse_methods(args.method)[0]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                 quantization_config=m.quantization_config()).eval()
    for batch in (int(b) for b in args.batch.split(",")):
        torch._dynamo.reset()  # each batch size compiles its own graph, as it would in a fresh process
        profile_batch(model, args, batch)


def profile_batch(model, args, batch: int) -> None:
    ids = torch.randint(10, 1000, (batch, args.prompt_len), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    if args.mode == "static":
        kw["cache_implementation"] = "static"
    n, steps = args.new_tokens, args.new_tokens - 1

    def gen(k):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    with torch.inference_mode():
        gen(n)
        gen(n)
        t1, tn = min(gen(1) for _ in range(3)), min(gen(n) for _ in range(3))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof_n:
            gen(n)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof_1:
            gen(1)
    gpu = per_step(prof_n, prof_1, steps, "gpu")
    busy, kernels = sum(t for t, _ in gpu.values()), sum(c for _, c in gpu.values())
    print(f"\n== {args.method} {args.mode}, batch {batch}: per decode step (mean of {steps}), wall "
          f"{(tn - t1) / steps * 1e3:.3f} ms, GPU busy {busy:.0f} us in {kernels:.0f} kernels")
    print(f"{'us/step':>9} {'calls':>6} {'us/call':>8}  kernel")
    for name, (t, c) in sorted(gpu.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"{t:9.1f} {c:6.1f} {t / c:8.2f}  {name[:110]}")
    cpu = per_step(prof_n, prof_1, steps, "cpu")
    print(f"host self time per step (under the profiler): {sum(t for t, _ in cpu.values()):.0f} us")
    print(f"{'us/step':>9} {'calls':>6}  op")
    for name, (t, c) in sorted(cpu.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"{t:9.1f} {c:6.1f}  {name[:110]}")
    print_prompt(prof_1, t1, args, batch)


# CUDA runtime calls in which the host can wait for the GPU (synchronizations, copies): where they take time, host and
# GPU work run one after the other instead of overlapping
WAITING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def print_prompt(prof_1, wall: float, args, batch: int) -> None:
    """The 1-token generate (the prompt's forward, the first token's sampling): wall time, GPU busy time and its
    kernels, and the host's time in CUDA calls that can wait."""
    events = prof_1.key_averages()
    gpu = [e for e in events if e.device_type == DeviceType.CUDA and e.count]
    busy = sum(e.self_device_time_total for e in gpu)
    print(f"\n== {args.method} {args.mode}, batch {batch}: the {args.prompt_len}-token prompt (a 1-token generate), "
          f"wall {wall * 1e3:.3f} ms, GPU busy {busy / 1e3:.3f} ms in {sum(e.count for e in gpu)} kernels")
    print(f"{'us':>9} {'calls':>6}  kernel")
    for e in sorted(gpu, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"{e.self_device_time_total:9.1f} {e.count:6d}  {e.key[:110]}")
    waits = [e for e in events if e.device_type == DeviceType.CPU and e.key.startswith(WAITING_CALLS)]
    print("host time in CUDA calls that can wait: " + (", ".join(
        f"{e.key} {e.self_cpu_time_total:.0f} us ({e.count} calls)" for e in waits) or "none"))


if __name__ == "__main__":
    main()
