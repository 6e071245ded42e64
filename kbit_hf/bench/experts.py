"""`kbit-bench experts`: one MoE experts block (gate_up, gating, down, the routing-weighted sum; the router excluded)
at T tokens, kbit against bf16 experts through `torch._grouped_mm`, on named expert shapes with random weights and
uniformly random routing. Every shape runs Qwen3-MoE's experts module (SwiGLU gating): the shapes differ in experts,
top-k and widths only.

Each figure is a CUDA graph of the whole block replayed (bench.kernels' method); the weights of one layer already
exceed 4x the L2 size for the shapes here, so every call reads them from DRAM. kbit runs KbitMoE's forward with the
library's choice of expert path ("kbit"), and the same block with each path forced: the library's per-row and grouped
GEMV kernels, its grouped tensor-core GEMM ("gemm"), and every expert dequantized to bf16 followed by
torch._grouped_mm ("dq+gmm").
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import _time_graph

# name: (experts, top-k, hidden, expert width) of the model's MoE layers
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "gpt-oss-20b": (32, 4, 2880, 2880),
}
PER_ROW_MAX_N = 8192  # the per-row kernel re-reads an expert per row: beyond this it only costs benchmark time


def _kbit_moe(E, H, inter, k, device="cuda"):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from ..config import KbitConfig
    from ..modules import KbitMoE

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=inter, num_experts=E, hidden_act="silu")
    with torch.device(device):
        orig = Qwen3MoeExperts(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in orig.parameters():
            p.normal_(0.0, 0.02)
    moe = KbitMoE(orig, k, "e4m4", KbitConfig(k=k).codebook_tensor(k), pre_quantized=False)
    for name in moe.quantized_names:
        for n, t in moe.quantize_param(name, getattr(orig, name).data).items():
            setattr(moe, n, nn.Parameter(t, requires_grad=False))
    # bf16 baseline weights, [E, in, out] views of the [E, out, in] parameters (what transformers passes)
    return moe, orig.gate_up_proj.data, orig.down_proj.data


def _bf16_block(x, ids, weights, w_gu, w_d):
    """The bf16 experts block as transformers' grouped_mm path runs it: sort rows by expert, two grouped GEMMs."""
    T, topk = ids.shape
    E = w_gu.shape[0]
    flat = ids.reshape(-1)
    sorted_ids, order = flat.sort()
    offs = torch.searchsorted(sorted_ids, torch.arange(1, E + 1, device=x.device, dtype=sorted_ids.dtype))
    xs = x[order // topk]
    h = torch._grouped_mm(xs, w_gu.transpose(-2, -1), offs=offs.to(torch.int32))
    g, u = h.chunk(2, dim=-1)
    d = torch._grouped_mm(F.silu(g) * u, w_d.transpose(-2, -1), offs=offs.to(torch.int32))
    out = torch.empty_like(d)
    out[order] = d
    return (out.float().view(T, topk, -1) * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def _kbit_block(moe, x, ids, weights, kernel):
    """KbitMoE's forward with the expert kernel forced."""
    from ..backends.cuda import kernels

    T, topk = ids.shape
    flat = ids.reshape(-1)
    xr = x.repeat_interleave(topk, dim=0)

    def proj(name, a):
        return kernels.expert_linear(a, flat, getattr(moe, name), getattr(moe, name + "_absmax"),
                                     getattr(moe, name + "_scale"), getattr(moe, name + "_codebook"), moe.k,
                                     moe.in_features[name], kernel=kernel)

    h = moe._apply_gate(proj("gate_up_proj", xr))
    d = proj("down_proj", h)
    return (d.float().view(T, topk, -1) * weights.unsqueeze(-1)).sum(1).to(x.dtype)


def _measure(name: str, tokens: list[int], k: int, repeats: int) -> list[dict]:
    from ..backends.cuda import dispatch

    E, topk, H, inter = SHAPES[name]
    moe, w_gu, w_d = _kbit_moe(E, H, inter, k)
    rows = []
    for T in tokens:
        g = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        ids = torch.rand(T, E, device="cuda", generator=g).topk(topk, dim=-1).indices
        weights = torch.rand(T, topk, device="cuda", generator=g).softmax(-1)
        row = {"shape": name, "tokens": T, "rows": T * topk}
        with torch.inference_mode():
            if T <= 64:  # the benchmark times a correct block: kbit against its own dequantized weights
                ref = _bf16_block(x, ids, weights, moe.dequantized_weight("gate_up_proj", torch.bfloat16),
                                  moe.dequantized_weight("down_proj", torch.bfloat16))
                y = moe(x, ids, weights)
                err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 2e-2:
                    raise SystemExit(f"{name} T={T}: the kbit block differs from its dequantized bf16 block: {err}")
            row["bf16"] = _time_graph([lambda: _bf16_block(x, ids, weights, w_gu, w_d)], repeats)
            row["kbit"] = _time_graph([lambda: moe(x, ids, weights)], repeats)
            if T * topk <= PER_ROW_MAX_N:
                row["per_row"] = _time_graph([lambda: _kbit_block(moe, x, ids, weights, "per_row")], repeats)
            row["grouped"] = _time_graph([lambda: _kbit_block(moe, x, ids, weights, "grouped")], repeats)
            if (T * topk >= E and dispatch.expert_gemm_fits(H) and dispatch.expert_gemm_fits(inter)
                    and dispatch.wgmma_runs_on(torch.cuda.current_device())):
                row["gemm"] = _time_graph([lambda: _kbit_block(moe, x, ids, weights, "gemm")], repeats)
            if dispatch.grouped_mm_runs_on(torch.cuda.current_device()):
                row["grouped_mm"] = _time_graph([lambda: _kbit_block(moe, x, ids, weights, "grouped_mm")], repeats)
        row["ratio"] = row["bf16"] / row["kbit"]
        rows.append(row)

        def f(key):
            return f"{row[key]:9.1f}" if key in row else f"{'-':>9}"

        print(f"{name:>14} {T:6d} {f('bf16')} {f('kbit')} {f('per_row')} {f('grouped')} {f('gemm')} {f('grouped_mm')}  "
              f"{row['ratio']:.2f}", flush=True)
    return rows


def run(args) -> int:
    from ..backends.cuda import library

    if not torch.cuda.is_available() or library.lib is None:
        raise SystemExit("kbit-bench experts needs a CUDA GPU and the compiled library")
    tokens = [int(t) for t in args.tokens.split(",")]
    report = {"device": torch.cuda.get_device_name(), "k": args.k, "torch": torch.__version__, "rows": []}
    print(f"{report['device']}, K = {args.k}: one experts block, microseconds")
    print(f"{'shape':>14} {'T':>6} {'bf16':>9} {'kbit':>9} {'per-row':>9} {'grouped':>9} {'gemm':>9} {'dq+gmm':>9}  "
          "bf16/kbit")
    for name in args.shapes.split(","):
        report["rows"] += _measure(name, tokens, args.k, args.repeats)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


def add_arguments(p) -> None:
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b", help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--tokens", default="1,16,64,512,2048,8192", help="comma-separated tokens per call")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20, help="graph replays; the median is reported")
    p.add_argument("--json", default=None)
