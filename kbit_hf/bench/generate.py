"""End-to-end generation benchmark: load time, memory, prefill and decode speed of one model under several
quantization methods, eager and with the static cache (which makes `generate` compile the decode step and replay it
as CUDA graphs).

Method. The model comes from a local checkpoint folder, or from a named architecture shape with random bf16 weights
that is written once to a local folder (so every method pays the same `from_pretrained` path: read, convert,
quantize; a shape whose per-expert conversion in `save_pretrained` does not fit the device is written under the
model's own tensor names, which load without converting). Methods run back to back in one process; each is loaded, measured and freed before the next. For each
(mode, batch): one full warm-up `generate` (compilation and graph capture happen here and are reported separately),
then `--repeats` timed `generate` calls of N new tokens with a streamer that timestamps every token as it reaches the
host (transformers synchronises once per step on CUDA anyway, to check for stopping). Time to first token = call
start to first token (prefill tokens/s = batch * prompt / that); decode tokens/s = batch / median time between
consecutive tokens (steady state); end-to-end tokens/s = batch * N / call time. Medians over the repeats.
`min_new_tokens` = `max_new_tokens` so random weights never stop early. Memory: `torch.cuda` allocator statistics
(resident after load, peak during load, peak during generation), relative to what was allocated before loading.

`--tp-plan auto` runs tensor parallel over the processes of `torchrun --nproc-per-node N -m kbit_hf.bench generate
...`: every process loads its shards on its own GPU and runs the same `generate`; rank 0 reports its timings, and
memory summed over the processes.

`--defer-stop` turns on transformers' `DeferredStopCheck` on CUDA as well (transformers 5.x enables it on mps
only): the host reads the stop flag and the streamed token one step late, through non-blocking copies, instead of
synchronising with the device every step, so it can queue step n+1 while the device runs step n. Every method runs
under the same setting; the report records it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from .. import format as fmt

# Named architecture shapes (the published configs' sizes; weights are random). `layers` slices the depth.
SHAPES = {
    "llama-3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                 max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                                 tie_word_embeddings=False)),
    "llama-3-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                  num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                  max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                                  tie_word_embeddings=False)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=False)),  # q / k / v with biases
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                                        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                        tie_word_embeddings=False)),
    "mixtral-8x7b": ("mixtral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=32768,
                                     rope_theta=1000000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "gpt-oss-20b": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                                    num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                                    num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
                                    max_position_embeddings=131072, attention_bias=True, swiglu_limit=7.0,
                                    tie_word_embeddings=False)),
    # small shapes for trying the benchmark on a laptop or CPU
    "tiny-llama": ("llama", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024,
                                 tie_word_embeddings=False)),
    "tiny-qwen3-moe": ("qwen3_moe", dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=64, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                                         mlp_only_layers=[], vocab_size=1000, max_position_embeddings=1024,
                                         tie_word_embeddings=False)),
}

METHOD_HELP = ("bf16, kbit2..kbit5 (kbit4-head etc.: the output head quantized too), bnb-nf4"
               " (bitsandbytes), torchao-int4 (torchao int4 weight-only, group 128)")


def shape_config(name: str, layers: int | None = None):
    """A transformers config for a named shape, optionally cut to `layers` decoder layers."""
    import transformers

    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    model_type, fields = SHAPES[name]
    fields = dict(fields)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be >= 1, got {layers}")
        fields["num_hidden_layers"] = layers
    return transformers.AutoConfig.for_model(model_type, **fields)


def ensure_checkpoint(name: str, layers: int | None, root: str, device: str) -> str:
    """Write a random-weight bf16 checkpoint of a named shape under `root` (once; reused when it matches)."""
    import transformers

    config = shape_config(name, layers)
    folder = os.path.join(root, f"{name}-{config.num_hidden_layers}L")
    marker = os.path.join(folder, "kbit_bench_shape.json")
    spec = {"shape": name, "config": config.to_diff_dict()}
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == json.loads(json.dumps(spec)):
                return folder
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # some families leave expert weights uninitialised: make every matrix random
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    try:
        model.save_pretrained(folder, max_shard_size=SHARD_BYTES)
    except torch.OutOfMemoryError:
        # save_pretrained converts fused experts back to per-expert tensors on the device, a copy the largest shapes
        # do not leave room for (Qwen3-30B-A3B's 61 GB on an 80 GB GPU): write the model's own tensor names instead
        print(f"save_pretrained ran out of device memory: writing {folder} under the model's own tensor names",
              file=sys.stderr, flush=True)
        for name in os.listdir(folder):
            os.remove(os.path.join(folder, name))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        save_own_names(model, folder)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with open(marker, "w") as f:
        json.dump(spec, f)
    return folder


SHARD_BYTES = 4 << 30  # of the random-weight checkpoints


def save_own_names(model, folder: str) -> None:
    """A checkpoint of the model's state dict under its own tensor names (from_pretrained loads those without
    converting), copied to the host one shard of SHARD_BYTES at a time, with its safetensors index and config.json."""
    from safetensors.torch import save_file

    shard_bytes, shards, current, size = SHARD_BYTES, [], {}, 0
    for name, tensor in model.state_dict().items():
        current[name] = tensor
        size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        host = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in shard.items()}  # copies: no sharing
        save_file(host, os.path.join(folder, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(host, file))
        total += sum(t.numel() * t.element_size() for t in host.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    model.config.save_pretrained(folder)


@dataclass
class Method:
    name: str
    unavailable: str | None = None  # why it cannot run here

    def quantization_config(self):
        if self.name == "bf16":
            return None
        if self.name.startswith("kbit"):
            from ..config import KbitConfig

            # "kbit4-head": the output head quantized too
            return KbitConfig(k=int(self.name[4]), quantize_lm_head=self.name.endswith("-head"))
        if self.name == "bnb-nf4":
            from transformers import BitsAndBytesConfig

            return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=torch.bfloat16)
        if self.name == "torchao-int4":
            from torchao.quantization import Int4WeightOnlyConfig
            from transformers import TorchAoConfig

            # the tile-packed format runs on tinygemm (aten._weight_int4pack_mm), which every torch build has;
            # torchao's default "plain" format needs fbgemm-gpu-genai
            return TorchAoConfig(Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))
        raise ValueError(self.name)


def parse_methods(text: str) -> list[Method]:
    methods = []
    for name in (m.strip() for m in text.split(",") if m.strip()):
        if name == "bf16" or name in {f"kbit{k}{head}" for k in fmt.SUPPORTED_K for head in ("", "-head")}:
            methods.append(Method(name))
        elif name == "bnb-nf4":
            methods.append(Method(name, _import_error("bitsandbytes")))
        elif name == "torchao-int4":
            methods.append(Method(name, _import_error("torchao")))
        else:
            raise ValueError(f"unknown method {name!r}; expected {METHOD_HELP}")
    return methods


def _import_error(module: str) -> str | None:
    try:
        __import__(module)
        return None
    except Exception as exc:  # any import failure means "not available here"
        return f"{module} not importable ({type(exc).__name__}: {exc})"


def _cuda_indices(device) -> list[int]:
    """The GPUs a run on `device` uses: its index, or every visible GPU for plain "cuda" (a device_map may spread
    the model over several; the others then hold nothing)."""
    if device.type != "cuda":
        return []
    return [device.index] if device.index is not None else list(range(torch.cuda.device_count()))


def _sync(device):
    for i in _cuda_indices(device):
        torch.cuda.synchronize(i)


def _mem(device) -> dict:
    idx = _cuda_indices(device)
    return {"allocated": sum(torch.cuda.memory_allocated(i) for i in idx),
            "peak": sum(torch.cuda.max_memory_allocated(i) for i in idx)}


def _reset_peak(device):
    for i in _cuda_indices(device):
        torch.cuda.reset_peak_memory_stats(i)


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _summed(n: int) -> int:
    """n summed over the processes of a tensor-parallel run (n itself otherwise)."""
    if not torch.distributed.is_initialized():
        return n
    t = torch.tensor([n], dtype=torch.int64, device="cuda" if torch.cuda.is_available() else "cpu")
    torch.distributed.all_reduce(t)
    return int(t.item())


def _free(device):
    gc.collect()
    try:
        torch._dynamo.reset()  # drops compiled graphs and their CUDA-graph memory pools
    except Exception:
        pass
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _StepTimer:
    """A `generate` streamer that only records when each token reached the host (first put = the prompt)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _generate(model, ids, new_tokens: int, static: bool, logits: bool = False, streamer=None):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                  attention_mask=torch.ones_like(ids), streamer=streamer)
    if static:
        kwargs["cache_implementation"] = "static"
    if logits:
        kwargs.update(output_logits=True, return_dict_in_generate=True)
    return model.generate(ids, **kwargs)


@contextlib.contextmanager
def deferred_stop_on_cuda():
    """transformers' `DeferredStopCheck` for CUDA devices too, for the duration of the block: transformers' own
    `is_supported` decides, with a CUDA device presented to it as mps (its only device condition), so its other
    conditions (no assistant model; a returned cache must be croppable) stay transformers'."""
    from transformers.generation import utils as gen_utils

    cls = getattr(gen_utils, "DeferredStopCheck", None)
    if cls is None:
        import transformers

        raise RuntimeError(f"--defer-stop needs transformers' DeferredStopCheck; transformers "
                           f"{transformers.__version__} has none")
    original = cls.__dict__["is_supported"]

    def is_supported(device, cache, cache_is_returned, is_assistant):
        device = torch.device("mps") if device.type == "cuda" else device
        return original.__func__(device, cache, cache_is_returned, is_assistant)

    cls.is_supported = staticmethod(is_supported)
    try:
        yield
    finally:
        cls.is_supported = original


def _timed(fn, device) -> tuple[float, object]:
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def measure(model, device, *, batch: int, prompt_len: int, new_tokens: int, static: bool, repeats: int,
            vocab: int, mem0: int) -> dict:
    """Speed and memory of one (mode, batch) on a loaded model."""
    g = torch.Generator().manual_seed(1234 + batch)
    ids = torch.randint(10, vocab - 10, (batch, prompt_len), generator=g).to(device)
    _reset_peak(device)
    warm_s, warm_out = _timed(lambda: _generate(model, ids, new_tokens, static), device)
    ttfts, steps, totals = [], [], []
    out = None
    for _ in range(repeats):
        timer = _StepTimer()
        _sync(device)
        t0 = time.perf_counter()
        out = _generate(model, ids, new_tokens, static, streamer=timer)
        _sync(device)
        totals.append(time.perf_counter() - t0)
        tok = timer.times[1:]  # times[0]: the prompt was handed over
        if len(tok) != new_tokens:
            raise RuntimeError(f"streamer saw {len(tok)} tokens, expected {new_tokens}")
        ttfts.append(tok[0] - t0)
        steps.append(statistics.median(b - a for a, b in zip(tok, tok[1:])))
    ttft, step, total = statistics.median(ttfts), statistics.median(steps), statistics.median(totals)
    peak = _mem(device)["peak"] - mem0
    # Logits of the first decode step (the prefill and the first token are the same in both modes, so eager and
    # static runs see identical inputs here): compared across modes by _compare_modes.
    first_decode_logits = _generate(model, ids, 2, static, logits=True).logits[1].float().cpu()
    return {
        "batch": batch, "mode": "static" if static else "eager", "warmup_s": warm_s,
        "ttft_ms": ttft * 1e3, "prefill_tok_s": batch * prompt_len / ttft,
        "decode_tok_s": batch / step, "decode_ms_per_step": step * 1e3,
        "e2e_tok_s": batch * new_tokens / total, "total_s": total, "peak_gen_bytes": peak,
        "warm_tokens_equal": bool(torch.equal(out, warm_out)), "first_decode_logits": first_decode_logits,
    }


def run_method(method: Method, folder: str, device, args, progress, after_run=None) -> dict:
    """Load one method, measure every (mode, batch), free it. after_run(result so far) follows each measurement."""
    from transformers import AutoModelForCausalLM

    from .. import _register  # noqa: F401  (registers KbitConfig with transformers)

    res = {"method": method.name, "runs": []}
    if method.unavailable:
        res["error"] = method.unavailable
        progress.update(len(args.modes) * len(args.batch))
        return res
    _free(device)
    mem0 = _mem(device)["allocated"]
    _reset_peak(device)
    try:
        place = {"tp_plan": args.tp_plan} if args.tp_plan else {"device_map": args.device_map or str(device)}
        load_s, model = _timed(lambda: AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.bfloat16, quantization_config=method.quantization_config(), **place), device)
    except Exception as exc:
        res["error"] = f"load failed: {type(exc).__name__}: {exc}"
        progress.update(len(args.modes) * len(args.batch))
        return res
    model.eval()
    m = _mem(device)
    res.update(load_s=load_s, resident_bytes=_summed(m["allocated"] - mem0), load_peak_bytes=_summed(m["peak"] - mem0))
    vocab = model.config.get_text_config().vocab_size
    for mode in args.modes:
        for batch in args.batch:
            progress.set_postfix_str(f"{method.name} {mode} batch {batch}")
            try:
                with torch.inference_mode():
                    r = measure(model, device, batch=batch, prompt_len=args.prompt_len,
                                new_tokens=args.new_tokens, static=mode == "static", repeats=args.repeats,
                                vocab=vocab, mem0=mem0)
                res["runs"].append(r)
            except Exception as exc:
                res["runs"].append({"batch": batch, "mode": mode,
                                    "error": f"{type(exc).__name__}: {str(exc)[:500]}"})
            progress.update(1)
            if after_run is not None:
                after_run(res)
            if mode == "static":  # a new batch size recompiles anyway; free the old graphs' pools first
                _free(device)
    del model
    _free(device)
    return res


def _compare_modes(results: list[dict]) -> None:
    """Static (compiled, CUDA graphs) against eager, per (method, batch): max |logit difference| at the first decode
    step relative to the largest eager logit. (Generated tokens are no check on random weights: their logits are
    nearly flat, so any rounding difference flips later tokens, bf16 against itself included.)"""
    for res in results:
        by = {(r["mode"], r["batch"]): r for r in res.get("runs", []) if "first_decode_logits" in r}
        for (mode, batch), r in by.items():
            eager = by.get(("eager", batch))
            if mode == "static" and eager is not None:
                a, b = r["first_decode_logits"], eager["first_decode_logits"]
                r["static_vs_eager_logit_rel_err"] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _fmt_err(e):
    return f"{e:.1e}" if e is not None else "-"


def _fmt_gb(b):
    return f"{b / 1e9:.2f}" if b is not None else "-"


def table(report: dict) -> str:
    lines = []
    base = {}
    for res in report["results"]:
        if res["method"] == "bf16":
            for r in res.get("runs", []):
                if "decode_tok_s" in r:
                    base[(r["mode"], r["batch"])] = r["decode_tok_s"]
    hdr = (f"{'method':<13} {'load s':>7} {'resident GB':>11} {'load peak GB':>12} {'mode':<7} {'batch':>5} "
           f"{'TTFT ms':>8} {'prefill tok/s':>13} {'decode tok/s':>12} {'vs bf16':>8} {'e2e tok/s':>9} {'peak GB':>8} "
           f"{'warm-up s':>9} "
           f"{'logits vs eager':>15}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    for res in report["results"]:
        head = (f"{res['method']:<13} {res.get('load_s', float('nan')):7.1f} {_fmt_gb(res.get('resident_bytes')):>11} "
                f"{_fmt_gb(res.get('load_peak_bytes')):>12}")
        if "error" in res:
            lines.append(f"{res['method']:<13} {res['error']}")
            continue
        for r in res["runs"]:
            if "error" in r:
                lines.append(f"{head} {r['mode']:<7} {r['batch']:>5} error: {r['error'][:120]}")
            else:
                b = base.get((r["mode"], r["batch"]))
                vs = f"{r['decode_tok_s'] / b:7.2f}x" if b else f"{'-':>8}"
                # --defer-stop: tokens reach the streamer a step late, so the first-token time is no TTFT (the JSON
                # keeps the raw figures)
                ttft, pre = ((f"{'-':>8}", f"{'-':>13}") if report.get("defer_stop") else
                             (f"{r['ttft_ms']:8.1f}", f"{r['prefill_tok_s']:13.0f}"))
                lines.append(f"{head} {r['mode']:<7} {r['batch']:>5} {ttft} {pre} "
                             f"{r['decode_tok_s']:12.1f} {vs} {r['e2e_tok_s']:9.1f} {_fmt_gb(r['peak_gen_bytes']):>8} "
                             f"{r['warmup_s']:9.1f} {_fmt_err(r.get('static_vs_eager_logit_rel_err')):>15}")
            head = " " * len(head)
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Bar chart of decode tokens/s per method, one group per (mode, batch), plus resident memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in report["results"] if "error" not in r]
    keys = sorted({(r["mode"], r["batch"]) for res in results for r in res["runs"] if "decode_tok_s" in r},
                  key=lambda k: (k[0] != "eager", k[1]))
    if not results or not keys:
        return
    fig, (ax, axm) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(results)
    for i, res in enumerate(results):
        by = {(r["mode"], r["batch"]): r.get("decode_tok_s", 0.0) for r in res["runs"]}
        xs = [j + i * width for j in range(len(keys))]
        ax.bar(xs, [by.get(k, 0.0) for k in keys], width, label=res["method"])
        for x, k in zip(xs, keys):
            if by.get(k):
                ax.annotate(f"{by[k]:.0f}", (x, by[k]), ha="center", va="bottom", fontsize=6)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
    ax.set_xticklabels([f"{m}\nbatch {b}" for m, b in keys])
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title(f"{report['model']} on {report['device']}: decode speed")
    axm.bar([r["method"] for r in results], [r["resident_bytes"] / 1e9 for r in results],
            color=[f"C{i}" for i in range(len(results))])
    axm.set_ylabel("resident GPU memory after load (GB)")
    axm.tick_params(axis="x", rotation=45)
    axm.set_title("model memory")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def run(args) -> int:
    from tqdm.auto import tqdm

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.tp_plan:
        device = _start_tensor_parallel(args)
    methods = parse_methods(args.methods)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.modes:
        if m not in ("eager", "static"):
            raise ValueError(f"unknown mode {m!r}; expected eager and/or static")
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.new_tokens < 3:
        raise ValueError("--new-tokens must be >= 3 (decode speed is the median time between generated tokens)")
    if args.checkpoint:
        folder, model_name = args.checkpoint, os.path.basename(os.path.normpath(args.checkpoint))
    else:
        t = time.perf_counter()
        print(f"writing / reusing the random-weight checkpoint of {args.model} under {args.workdir} ...", flush=True)
        writer = _rank() == 0
        if writer:
            folder = ensure_checkpoint(args.model, args.layers, args.workdir, str(device))
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # the other processes of a tensor-parallel run find what rank 0 wrote
            if not writer:
                folder = ensure_checkpoint(args.model, args.layers, args.workdir, str(device))
        model_name = os.path.basename(folder)
        print(f"checkpoint ready: {folder} ({time.perf_counter() - t:.0f} s)", flush=True)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    import transformers

    if args.device_map and device.type == "cuda" and torch.cuda.device_count() > 1:
        dev_name = f"{torch.cuda.device_count()} x {dev_name}, device_map={args.device_map}"
    if args.tp_plan:
        dev_name = f"{torch.distributed.get_world_size()} x {dev_name}, tp_plan={args.tp_plan}"
    report = {"model": model_name, "checkpoint": folder, "device": dev_name, "torch": torch.__version__,
              "transformers": transformers.__version__, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "repeats": args.repeats, "defer_stop": bool(args.defer_stop),
              "results": []}
    total = len(methods) * len(args.modes) * len(args.batch)
    defer = deferred_stop_on_cuda() if args.defer_stop else contextlib.nullcontext()

    def keep(partial=None):  # the results so far survive a later crash or a killed process
        if args.json and _rank() == 0:
            _write_json({**report, "results": report["results"] + ([partial] if partial else [])}, args.json)

    with defer, tqdm(total=total, desc="generate benchmark", unit="run", disable=_rank() != 0) as progress:
        for method in methods:
            report["results"].append(run_method(method, folder, device, args, progress, after_run=keep))
            keep()
    _compare_modes(report["results"])
    if _rank() != 0:
        return 0
    print()
    print(f"{model_name} on {dev_name}; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens; "
          f"tokens/s count all sequences of the batch; decode = steady state (median step), e2e = whole call"
          + ("; stop check deferred by one step (--defer-stop)" if args.defer_stop else ""))
    print(table(report))
    if args.json:
        _write_json(report, args.json)
        print(f"JSON: {args.json}")
    if args.png:
        try:
            plot(report, args.png)
            print(f"chart: {args.png}")
        except ImportError:
            print("matplotlib not installed: no chart (pip install matplotlib, or "
                  "`python -m kbit_hf.bench plot RESULTS.json OUT.png` elsewhere)")
    return 0


def _start_tensor_parallel(args) -> torch.device:
    """This process's GPU in a torchrun launch, with the process group transformers' tensor parallel joins."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise ValueError("--tp-plan needs several processes: launch with torchrun --nproc-per-node N -m kbit_hf.bench "
                         "generate ...")
    if args.device_map or args.device:
        raise ValueError("--tp-plan places each shard on its process's GPU: drop --device-map / --device")
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return device


def _write_json(report, path):
    slim = {**report, "results": [{**res, "runs": [{k: v for k, v in r.items() if k != "first_decode_logits"}
                                                   for r in res.get("runs", [])]} for res in report["results"]]}
    with open(path, "w") as f:
        json.dump(slim, f, indent=1)


def add_model_arguments(p) -> None:
    """--model / --layers / --checkpoint / --workdir: the model every kbit-bench command loads."""
    p.add_argument("--model", default="llama-3-8b", help=f"named shape with random weights: {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, default=None, help="cut the named shape to this many decoder layers")
    p.add_argument("--checkpoint", default=None, help="a local checkpoint folder instead of a named shape")
    p.add_argument("--workdir", default=os.path.join(os.path.expanduser("~"), ".cache", "kbit_hf", "bench"),
                   help="where random-weight checkpoints are written")


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--methods", default="bf16,kbit4,kbit2,bnb-nf4,torchao-int4", help=METHOD_HELP)
    p.add_argument("--modes", default="eager,static", help="eager and/or static (static cache, compiled decode)")
    p.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2, help="timed repeats after the warm-up (median)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--device-map", default=None,
                   help='a from_pretrained device_map instead of --device, e.g. "balanced" to spread the layers over '
                        "every visible GPU (memory is summed over them)")
    p.add_argument("--tp-plan", default=None, choices=["auto"],
                   help="tensor parallel over the processes of torchrun (torchrun --nproc-per-node N -m "
                        "kbit_hf.bench generate --tp-plan auto ...); memory is summed over them")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--png", default=None, help="draw the decode-speed chart here (needs matplotlib)")
    p.add_argument("--defer-stop", action="store_true",
                   help="transformers' DeferredStopCheck on CUDA too: no host synchronisation per decode step")


def plot_main(args) -> int:
    with open(args.json_in) as f:
        report = json.load(f)
    plot(report, args.png_out)
    print(table(report))
    print(f"chart: {args.png_out}")
    return 0


