"""`kbit-bench train`: the speed and memory of a LoRA training step (QLoRA) on a named model shape with random
weights: forward + backward + AdamW step of rank-r LoRA adapters on every linear layer of the decoder, gradient
checkpointing on, bf16 compute, the base weights frozen in their quantized form. Methods as `generate`'s (bf16 LoRA,
kbit K=x, bitsandbytes NF4); tokens/s counts batch x sequence tokens per optimizer step."""

from __future__ import annotations

import json
import statistics
import time

import torch

from .generate import _free, _mem, _reset_peak, _sync, add_model_arguments, ensure_checkpoint, parse_methods

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _enable_checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # transformers' newer name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def run_method(method, folder: str, device, args) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from .. import _register  # noqa: F401  (registers KbitConfig with transformers)

    res = {"method": method.name}
    if method.unavailable:
        res["error"] = method.unavailable
        return res
    _free(device)
    mem0 = _mem(device)["allocated"]
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=str(device),
                                                     quantization_config=method.quantization_config())
        _enable_checkpointing(model)
        model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS,
                                                 lora_dropout=0.0))
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        vocab = model.config.get_text_config().vocab_size
        g = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g).to(device)

        def step():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        model.train()
        for _ in range(args.warmup):
            step()
        _sync(device)
        _reset_peak(device)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = step()
            _sync(device)
            times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        res.update(step_s=s, tokens_per_s=args.batch * args.seq_len / s, loss=float(loss.detach()),
                   peak_bytes=_mem(device)["peak"] - mem0, trainable=sum(p.numel() for p in params))
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    model = opt = None
    _free(device)
    return res


def run(args) -> int:
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.seq_len < 2:
        raise SystemExit(f"kbit-bench train: --steps >= 1, --warmup >= 0, --batch >= 1 and --seq-len >= 2; got "
                         f"{args.steps}, {args.warmup}, {args.batch}, {args.seq_len}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    folder = args.checkpoint or ensure_checkpoint(args.model, args.layers, args.workdir, str(device))
    report = {"model": args.checkpoint or args.model, "layers": args.layers, "batch": args.batch,
              "seq_len": args.seq_len, "rank": args.rank, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "methods": []}
    for method in parse_methods(args.methods):
        report["methods"].append(run_method(method, folder, device, args))
    base = next((m for m in report["methods"] if "tokens_per_s" in m and m["method"] == "bnb-nf4"), None)
    print(f"\nLoRA r={args.rank} training step on {report['model']}"
          f"{f' ({args.layers} layers)' if args.layers else ''}, {report['device']}: batch {args.batch} x "
          f"{args.seq_len} tokens, gradient checkpointing, AdamW; median of {args.steps} steps")
    print(f"{'method':<10} {'step ms':>9} {'tokens/s':>10} {'vs bnb-nf4':>10} {'peak GB':>8}")
    for m in report["methods"]:
        if "error" in m:
            print(f"{m['method']:<10} {m['error']}")
            continue
        vs = f"{m['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        print(f"{m['method']:<10} {m['step_s'] * 1e3:9.1f} {m['tokens_per_s']:10.0f} {vs:>10} "
              f"{m['peak_bytes'] / 1e9:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--methods", default="bf16,kbit4,bnb-nf4")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None)
