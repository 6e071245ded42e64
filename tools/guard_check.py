"""Host cost of TorchDynamo's guard check on a compiled kbit model against the same model in fp32, on the CPU.

A compiled decode step (static cache, CUDA graphs) runs the guard check on the host before every replay, and the
GPU waits for it while `generate` synchronises each step; its cost grows with the tensors and attributes the
compiled forward reads. This builds a tiny random model of one family (tests/tiny_models.py) with L decoder layers,
compiles it with fullgraph=True, and prints the guard check's time per call (TorchDynamo Cache Lookup under the
profiler: fastest and median of several rounds of 100 calls), for fp32 and for K = 4.

usage (from the repository root):
  PYTHONPATH=.:tests python tools/guard_check.py [--family llama] [--layers 16] [--rounds 6]
"""

import argparse
import gc
import statistics
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from kbit_hf import KbitConfig
from tiny_models import FAMILIES, tiny_model


def guard_check_us(model, ids, rounds: int, calls: int = 100) -> tuple[float, float]:
    """(fastest, median) microseconds of one guard check over `rounds` profiled rounds of `calls` compiled calls."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    times = []
    with torch.inference_mode():
        for _ in range(3):
            compiled(ids, use_cache=False)
        gc.collect()
        gc.disable()  # a collection inside a round would be charged to whatever it interrupts
        try:
            for _ in range(rounds):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(calls):
                        compiled(ids, use_cache=False)
                events = [e for e in prof.key_averages() if e.key == "TorchDynamo Cache Lookup"]
                if not events:
                    raise RuntimeError("the profile has no 'TorchDynamo Cache Lookup' event: did the model compile?")
                times.append(events[0].cpu_time_total / events[0].count)
        finally:
            gc.enable()
    return min(times), statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="llama", choices=sorted(FAMILIES))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    ids = torch.randint(0, 300, (1, 1))
    with tempfile.TemporaryDirectory() as folder:
        tiny_model(args.family, dtype=torch.float32, num_hidden_layers=args.layers).save_pretrained(folder)
        for name, config in (("fp32", None), ("kbit K=4", KbitConfig(k=4))):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map="cpu",
                                                         quantization_config=config).eval()
            tensors = sum(1 for _ in model.parameters()) + sum(1 for _ in model.buffers())
            fastest, median = guard_check_us(model, ids, args.rounds)
            print(f"{args.family}, {args.layers} layers, {name}: guard check {fastest:.1f} us fastest, "
                  f"{median:.1f} us median; {tensors} tensors")


if __name__ == "__main__":
    main()
