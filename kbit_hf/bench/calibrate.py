"""`kbit-bench calibrate`: wall time and peak accelerator memory of calibrated quantization (kbit_hf.calibrate) of a
named model shape with random weights and random calibration tokens. Quality needs real weights and text
(`python -m kbit_hf.eval perplexity --calibrated`); this measures the cost: the model stays on the CPU and one
decoder layer at a time is calibrated on the device."""

from __future__ import annotations

import json
import time

import torch

from .generate import _free, _mem, _reset_peak, add_model_arguments, ensure_checkpoint


def run(args) -> int:
    from transformers import AutoModelForCausalLM

    from ..calibrate import quantize
    from ..config import KbitConfig

    if not 1 <= args.seq_len <= args.tokens:
        raise SystemExit(f"kbit-bench calibrate: --seq-len must be 1..--tokens ({args.tokens}); got {args.seq_len}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    folder = args.checkpoint or ensure_checkpoint(args.model, args.layers, args.workdir, "cpu")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0))
    _free(device)
    _reset_peak(device)
    mem0 = _mem(device)["allocated"]
    t0 = time.perf_counter()
    quantize(model, KbitConfig(k=args.k), calibration=ids, n_tokens=args.tokens, seq_len=args.seq_len,
             device=str(device), calibration_name="random tokens")
    seconds = time.perf_counter() - t0
    peak = _mem(device)["peak"] - mem0
    layers = model.config.get_text_config().num_hidden_layers
    report = {"model": args.checkpoint or args.model, "layers": layers, "k": args.k, "tokens": args.tokens,
              "seq_len": args.seq_len, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "seconds": seconds, "seconds_per_layer": seconds / layers, "peak_device_bytes": peak}
    print(f"calibrated K={args.k} {report['model']} ({layers} decoder layers) on {report['device']} with "
          f"{args.tokens} tokens in windows of {args.seq_len}: {seconds:.1f} s ({seconds / layers:.1f} s per layer), "
          f"peak device memory {peak / 1e9:.2f} GB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens (kbit_hf.calibrate's default)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--device", default=None, help="where layers are calibrated (default: cuda if available)")
    p.add_argument("--json", default=None)
