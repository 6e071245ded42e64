"""kbit-quantize: calibrated kbit quantization of a model folder into a kbit checkpoint folder.

    kbit-quantize --model DIR --k 3 --calibration FILE --out DIR [--n-tokens N] [--seq-len L]

The checkpoint is an ordinary kbit folder (loads with `import kbit_hf` + `from_pretrained`); config.json's
`kbit_calibration` and the README's "kbit calibration" section say what it was calibrated on.

`python -m kbit_hf.eval perplexity --texts pydoc docstrings --k 3 4 --calibrated 3 4` measures SmolLM2-135M:
round-to-nearest and calibrated perplexity on two held-out texts, calibrated on a third (all offline; docs/quality.md).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
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


if __name__ == "__main__":
    main()
