"""Fused sibling projections (q / k / v, gate / up as one layer each) against the same layers run one by one, in one
process: loads a named shape once with K = 4, then times `generate`'s decode step (static cache) with the siblings
fused, split (kbit_hf.modules.split_siblings), and fused again, and prints the step and the host time of the compiled
step's largest items (torch.profiler over a 9-token generate).

usage (from the repository root, CUDA):
  PYTHONPATH=. python tools/siblings_ab.py [--model SHAPE --layers L | --checkpoint FOLDER] [--batch 1,16]
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from kbit_hf import KbitConfig
from kbit_hf.bench.generate import _generate, add_model_arguments, ensure_checkpoint, measure
from kbit_hf.modules import fuse_siblings, split_siblings

HOST_ITEMS = ("TorchDynamo Cache Lookup", "cudaGraphLaunch", "Call CompiledFxGraph", "Pregraph bytecode",
              "Torch-Compiled Region")


def host_items(model, batch: int) -> dict:
    ids = torch.randint(10, 1000, (batch, 64), device="cuda")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _generate(model, ids, 9, True)
    return {item: round(e.self_cpu_time_total / 8) for e in prof.key_averages() for item in HOST_ITEMS
            if item in e.key}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--batch", default="1,16")
    args = p.parse_args()
    folder = args.checkpoint or ensure_checkpoint(args.model, args.layers, args.workdir, "cuda")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                 quantization_config=KbitConfig(k=4)).eval()
    device, mem0 = torch.device("cuda"), torch.cuda.memory_allocated()
    for variant in ("fused", "split", "fused"):
        (fuse_siblings if variant == "fused" else split_siblings)(model)
        for batch in (int(b) for b in args.batch.split(",")):
            torch._dynamo.reset()  # each variant and batch compiles its own decode step
            r = measure(model, device, batch=batch, prompt_len=64, new_tokens=32, static=True, repeats=3,
                        vocab=model.config.vocab_size, mem0=mem0)
            print(f"{variant} batch {batch}: {r['decode_ms_per_step']:.3f} ms per step, "
                  f"{r['decode_tok_s']:.1f} tok/s; host us per step {host_items(model, batch)}", flush=True)


if __name__ == "__main__":
    main()
