"""How fast is a decode step without its decoder layers' GPU work? The floor that the host's work per token, the
embedding and the output head leave at batch 1, measured rather than estimated.

Loads the checkpoint as bf16 and as kbit K=4, then the K=4 model once more with every KbitLinear and KbitMoE replaced
by an "oracle" that returns a preallocated zero tensor, whatever its input. Under torch.compile the attention, norms
and routers that only fed those layers are then dead code and dropped too, so the oracle's step is the compiled graph
and transformers' generate loop with the embedding, the residual adds and the bf16 lm_head: no kernel can make a step
of the real model shorter. (The real model's kernel-by-kernel split: tools/profile_decode.py.) Each is measured like
`python -m kbit_hf.bench generate` (static cache, batch 1, median ms between streamed tokens), with transformers'
per-step host sync and with `--defer-stop`.

usage (from the repository root): PYTHONPATH=. python tools/decode_bound.py FOLDER [new_tokens] [json_out]
"""

import contextlib
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from kbit_hf.bench.generate import _free, _mem, deferred_stop_on_cuda, measure, parse_methods
from kbit_hf.modules import KbitLinear, KbitMoE


def zero_kbit_modules(model):
    """Every KbitLinear and KbitMoE returns a slice of one shared zero buffer per output width (enough rows for the
    prompt)."""
    bufs = {}
    n = 0
    for m in model.modules():
        if isinstance(m, (KbitLinear, KbitMoE)):
            width = m.out_features if isinstance(m, KbitLinear) else model.config.hidden_size
            buf = bufs.setdefault(width, torch.zeros(256, width, dtype=torch.bfloat16, device="cuda"))

            def fwd(x, *args, buf=buf, **kwargs):
                rows = x.numel() // x.shape[-1]
                return buf[:rows].view(*x.shape[:-1], buf.shape[-1])

            m.forward = fwd
            n += 1
    return n


def main():
    folder = sys.argv[1]
    new_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    out = sys.argv[3] if len(sys.argv) > 3 else None
    dev = torch.device("cuda")
    rows = []
    for name, oracle in (("bf16", False), ("kbit4", False), ("kbit4", True)):
        _free(dev)
        mem0 = _mem(dev)["allocated"]
        m = parse_methods(name)[0]
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda",
                                                     quantization_config=m.quantization_config()).eval()
        label = name + (" (decoder layers free)" if oracle else "")
        if oracle:
            print(f"{label}: {zero_kbit_modules(model)} KbitLinear / KbitMoE modules replaced", flush=True)
        for defer in (False, True):
            ctx = deferred_stop_on_cuda() if defer else contextlib.nullcontext()
            with ctx, torch.inference_mode():
                r = measure(model, dev, batch=1, prompt_len=64, new_tokens=new_tokens, static=True, repeats=3,
                            vocab=model.config.vocab_size, mem0=mem0)
            _free(dev)
            row = {"method": label, "defer_stop": defer, "ms_per_step": r["decode_ms_per_step"],
                   "tok_s": r["decode_tok_s"]}
            rows.append(row)
            print(row, flush=True)
        del model
    base = {d: next(r["ms_per_step"] for r in rows if r["method"] == "bf16" and r["defer_stop"] == d)
            for d in (False, True)}
    print(f"\n{'method':34} {'host sync':>10} {'ms/step':>8} {'tok/s':>8} {'vs bf16':>8}")
    for r in rows:
        print(f"{r['method']:34} {str(not r['defer_stop']):>10} {r['ms_per_step']:8.3f} {r['tok_s']:8.1f} "
              f"{base[r['defer_stop']] / r['ms_per_step']:7.2f}x")
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "new_tokens": new_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
