"""Worker of tests/test_tensor_parallel.py, run by torchrun: load a model with tp_plan="auto", then rank 0 writes
what the test checks (logits, greedy tokens, the shards' widths, the error of a save) to OUT, or the load's error.

usage: torchrun --nproc-per-node 2 tests/tp_worker.py FOLDER OUT [k [PLAN]]
(k: quantize on the fly with KbitConfig(k), 0: load as saved; PLAN: a JSON file of a tp_plan dict, else "auto")
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import kbit_hf
from kbit_hf.modules import KbitLinear, KbitMoE, local_view


def main(folder: str, out: str, k: int | None, plan_file: str | None) -> None:
    rank = int(os.environ["RANK"])
    kw = {"quantization_config": kbit_hf.KbitConfig(k=k)} if k else {}
    plan = json.load(open(plan_file)) if plan_file else "auto"
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, tp_plan=plan, dtype=torch.float32, **kw)
    except Exception as e:  # the test checks the message
        if rank == 0:
            torch.save({"error": f"{type(e).__name__}: {e}"}, out)
        return
    device = model.device
    ids = torch.arange(3, 3 + 2 * 12).view(2, 12) % model.config.vocab_size
    with torch.no_grad():
        logits = model(ids.to(device)).logits.float().cpu()
        tokens = model.generate(ids.to(device), max_new_tokens=6, do_sample=False).cpu()
    widths = {name: (m.local_out_features, m.local_in_features, m.out_features, m.in_features, m.layout)
              for name, m in model.named_modules() if isinstance(m, KbitLinear)}
    widths.update({name: (dict(m.in_features), local_view(m.gate_up_proj_absmax).shape[1] if m.has_gate else None)
                   for name, m in model.named_modules() if isinstance(m, KbitMoE)})
    try:
        model.save_pretrained(out + ".saved")
        save_error = None
    except NotImplementedError as e:
        save_error = str(e)
    if rank == 0:
        torch.save({"logits": logits, "tokens": tokens, "widths": widths, "save_error": save_error}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None,
         sys.argv[4] if len(sys.argv) > 4 else None)
    if dist.is_initialized():
        dist.barrier()  # both ranks are done with the group
    # On the CPU (gloo, torch 2.13) a rank now and then aborts in a background thread while the interpreter shuts down
    # after everything above is done (about 1 launch in 30): leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
