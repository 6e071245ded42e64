"""Eager MoE decode cost, piece by piece: host time per call (no sync) and wall time per call (synchronized), for a
whole one-token forward, one MoE block (router + experts) and the experts module alone, bf16 against kbit; then the
time per decode step of a hand-written greedy loop and of `generate`.

usage: python tests/gpu/profile_moe_eager.py FOLDER [methods, default bf16,kbit4]
"""

import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kbit_hf.bench.generate import parse_methods


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test of the script only


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, n=50):
    for _ in range(5):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n  # host time per call (the GPU may still be running)
    sync()
    queued = (time.perf_counter() - t) / n
    t = time.perf_counter()
    for _ in range(n):
        fn()
        sync()
    synced = (time.perf_counter() - t) / n
    return host * 1e3, queued * 1e3, synced * 1e3


def _wall(fn):
    sync()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    folder = sys.argv[1]
    methods = parse_methods(sys.argv[2] if len(sys.argv) > 2 else "bf16,kbit4")
    print(f"{'method':>8} {'piece':>14} {'host ms':>8} {'queued ms':>10} {'synced ms':>10}")
    for m in methods:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map=DEV,
                                                     quantization_config=m.quantization_config()).eval()
        moe = model.model.layers[0].mlp
        with torch.inference_mode():
            ids = torch.randint(10, 1000, (1, 64), device=DEV)
            cache = DynamicCache(config=model.config)
            model(ids, past_key_values=cache, use_cache=True)
            tok = torch.randint(10, 1000, (1, 1), device=DEV)
            pos = torch.tensor([[64]], device=DEV)

            def fwd():  # one decode step without growing the cache past its first extra token
                cache.crop(64)
                model(tok, past_key_values=cache, use_cache=True, position_ids=pos)

            x = torch.randn(1, 1, model.config.hidden_size, device=DEV, dtype=torch.bfloat16)
            h = x.view(-1, x.shape[-1])
            rows = [("forward", fwd), ("moe block", lambda: moe(x))]
            if hasattr(moe, "experts") and hasattr(moe, "gate"):
                out = moe.gate(h)
                # transformers 5 routers return (logits, weights, indices) or logits; take top-k ourselves
                lg = out[0] if isinstance(out, tuple) else out
                w, idx = torch.topk(torch.softmax(lg.float(), -1), model.config.num_experts_per_tok, dim=-1)
                w = w.to(x.dtype)
                rows.append(("experts", lambda: moe.experts(h, idx, w)))
            for name, fn in rows:
                hst, q, s = timed(fn)
                print(f"{m.name:>8} {name:>14} {hst:8.3f} {q:10.3f} {s:10.3f}", flush=True)

            # whole decode steps: a hand-written greedy loop, and `generate` (per-step slope between 1 and n tokens)
            def loop(n=16):
                c = DynamicCache(config=model.config)
                out = model(ids, past_key_values=c, use_cache=True, logits_to_keep=1)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                for _ in range(n):
                    out = model(nxt, past_key_values=c, use_cache=True, logits_to_keep=1)
                    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                sync()

            def gen(n):
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
                sync()

            for name, fn0, fn1, steps in (("greedy loop", lambda: loop(0), lambda: loop(16), 16),
                                          ("generate", lambda: gen(1), lambda: gen(17), 16)):
                fn0(), fn1()
                t0 = min(_wall(fn0) for _ in range(3))
                t1 = min(_wall(fn1) for _ in range(3))
                print(f"{m.name:>8} {name:>14} per step {(t1 - t0) / steps * 1e3:8.3f} ms", flush=True)
        del model


if __name__ == "__main__":
    main()
