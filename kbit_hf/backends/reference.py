"""Pure-PyTorch reference implementation of every kbit op: the ground truth.

The compiled kernels are tested against it, and it runs wherever no compiled kernel applies (the CPU, or CUDA
without the compiled library), on any device torch supports. It reads the checkpoint layout (bit planes, see
kbit_hf/format.py) only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import format as fmt

# Rows quantized/dequantized per step: bounds the int64/fp32 temporaries to a few hundred MB on big matrices.
_ROW_ELEMENTS = 1 << 22


def _row_chunks(rows: int, in_features: int):
    step = max(1, _ROW_ELEMENTS // max(1, in_features))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _blocked(w: torch.Tensor) -> torch.Tensor:
    """float32 [rows, in] -> [rows, nb, 32], zero padded."""
    rows, inp = w.shape
    pad = fmt.n_blocks(inp) * fmt.BLOCK - inp
    if pad:
        w = F.pad(w, (0, pad))
    return w.view(rows, -1, fmt.BLOCK)


def quantize(
    weight: torch.Tensor, codebook: torch.Tensor, k: int, absmax_format: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [..., out, in] (any float dtype) -> (packed uint32, absmax uint8|fp16, scale float32 [...])."""
    fmt.check_weight_to_quantize(weight, codebook, k, absmax_format)
    *lead, out, inp = weight.shape
    shapes = fmt.packed_shapes(tuple(weight.shape), k)
    w3 = weight.reshape(-1, out, inp)
    codebook = codebook.to(weight.device, torch.float32)
    packed = torch.empty((w3.shape[0], out, shapes["packed"][-1]), dtype=torch.uint32, device=weight.device)
    absmax = torch.empty((w3.shape[0], out, shapes["absmax"][-1]), dtype=fmt.ABSMAX_DTYPES[absmax_format],
                         device=weight.device)
    scale = torch.empty(w3.shape[0], dtype=torch.float32, device=weight.device)
    for e in range(w3.shape[0]):
        # Pass 1: block absmax of the whole matrix, which fixes its power-of-two scale.
        blk = torch.cat([_blocked(w3[e, a:b].float()).abs().amax(-1) for a, b in _row_chunks(out, inp)])
        s = fmt.tensor_scale(blk)
        scale[e] = s
        # Pass 2: scale codes, then indices against the *decoded* scale (so scale rounding is accounted for).
        for a, b in _row_chunks(out, inp):
            codes = fmt.encode_absmax(blk[a:b] / s, absmax_format)
            d = fmt.decode_absmax(codes).unsqueeze(-1)
            wb = _blocked(w3[e, a:b].float()) / s
            y = torch.where(d > 0, wb / d.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(wb))
            packed[e, a:b] = fmt.pack_bitplanes(fmt.nearest_index(y, codebook), k)
            absmax[e, a:b] = codes
    return packed.view(shapes["packed"]), absmax.view(shapes["absmax"]), scale.view(shapes["scale"])


def dequantize(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    scale: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    in_features: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize` up to rounding: -> [..., out, in_features] in `dtype` (bit planes only)."""
    fmt.check_k(k)
    fmt.check_codebook_size(codebook, k)
    if packed.dtype != torch.uint32:
        raise ValueError(f"the reference ops read the bit-plane layout (uint32 packed); got {packed.dtype} "
                         f"{tuple(packed.shape)}: convert with kbit_hf.ops.bit_planes first")
    fmt.check_fits(packed, absmax, scale, k, in_features)
    *lead, out, words = packed.shape
    nb = fmt.n_blocks(in_features)
    p3 = packed.reshape(-1, out, words)
    a3 = absmax.reshape(-1, out, nb)
    s1 = scale.reshape(-1).float()
    cb = codebook.to(packed.device, torch.float32)
    result = torch.empty((p3.shape[0], out, in_features), dtype=dtype, device=packed.device)
    for e in range(p3.shape[0]):
        for a, b in _row_chunks(out, in_features):
            idx = fmt.unpack_bitplanes(p3[e, a:b], k)  # [rows, nb, 32]
            w = (cb[idx] * fmt.decode_absmax(a3[e, a:b]).unsqueeze(-1)) * s1[e]
            result[e, a:b] = w.flatten(-2)[:, :in_features].to(dtype)
    return result.view(*lead, out, in_features)


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    scale: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    in_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W^T (+ bias), computed in float32 and returned in x's dtype."""
    w = dequantize(packed, absmax, scale, codebook, k, in_features, torch.float32)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def expert_linear(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    scale: torch.Tensor,
    codebook: torch.Tensor,
    k: int,
    in_features: int,
) -> torch.Tensor:
    """Row r of the result is x[r] @ W[expert_ids[r]]^T; rows whose id is outside [0, E) (EP sentinels) are zero."""
    y = torch.zeros((x.shape[0], packed.shape[1]), dtype=x.dtype, device=x.device)
    for e, rows in rows_by_expert(expert_ids, packed.shape[0]):
        y[rows] = linear(x[rows], packed[e], absmax[e], scale[e], codebook, k, in_features)
    return y


def rows_by_expert(expert_ids: torch.Tensor, num_experts: int):
    """(e, the indices of the rows routed to expert e) for every expert some row names; ids outside [0, E) are
    skipped. One host sync."""
    valid = (expert_ids >= 0) & (expert_ids < num_experts)
    for e in torch.unique(expert_ids[valid]).tolist():
        yield e, (expert_ids == e).nonzero().squeeze(-1)


def gate_activation(g: torch.Tensor, gate: str, alpha: float, limit: float) -> torch.Tensor:
    """The gated activation of the gate_up rows g [N, 2I] (what `kbit::moe_experts` fuses): "silu": SiLU(gate) * up,
    gate the first I columns and up the last I (Qwen3-MoE, Mixtral); "clamped": gpt-oss's SwiGLU, gate the even
    columns and up the odd ones, gate clamped above at `limit`, up to [-limit, limit], (up + 1) * gate *
    sigmoid(alpha * gate)."""
    if gate == "silu":
        a, b = g.chunk(2, dim=-1)
        return F.silu(a) * b
    if gate == "clamped":
        a, b = g[..., ::2].clamp(max=limit), g[..., 1::2].clamp(-limit, limit)
        return (b + 1) * (a * torch.sigmoid(alpha * a))
    raise ValueError(f"moe_experts: gate must be 'silu' or 'clamped', got {gate!r}")


def moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: tuple,
    gate_up_bias: torch.Tensor | None,
    down: tuple,
    down_bias: torch.Tensor | None,
    k: int,
    gate: str,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """A MoE experts block: token t's rows run experts top_k_index[t] (ids outside [0, E) contribute nothing), each
    gate_up row (+ bias) gated (gate_activation) and rounded to x's dtype, then down (+ bias), summed over the top-k
    weighted by top_k_weights (in x's dtype), in float32; returned in x's dtype. gate_up / down: (packed, absmax,
    scale, codebook) of weights [E, 2I, H] and [E, H_out, I]."""
    T, top_k = top_k_index.shape
    E = gate_up[0].shape[0]
    inter = gate_up[0].shape[1] // 2
    ids = top_k_index.reshape(-1)
    valid = ((ids >= 0) & (ids < E)).unsqueeze(-1)
    safe = ids.clamp(0, E - 1)
    g = expert_linear(x.float().repeat_interleave(top_k, dim=0), ids, *gate_up, k, x.shape[-1])
    if gate_up_bias is not None:
        g = g + gate_up_bias[safe].float()
    h = (gate_activation(g, gate, alpha, limit).to(x.dtype) * valid).float()
    d = expert_linear(h, ids, *down, k, inter)
    if down_bias is not None:
        d = d + down_bias[safe].float()
    w = top_k_weights.reshape(-1, 1).to(x.dtype).float() * valid
    return (d * w).view(T, top_k, -1).sum(dim=1).to(x.dtype)


def router_topk(logits: torch.Tensor, k: int, mode: str, renorm: bool, out_dtype: torch.dtype):
    """A MoE router's (weights, ids) [T, k] from its logits [T, E], as transformers' routers compute them:
    "softmax_topk": the float32 softmax over E, its k largest (divided by their sum when `renorm`); "topk_softmax":
    the k largest logits, then the softmax over them (in the logits' dtype). Weights returned in `out_dtype`."""
    if mode == "softmax_topk":
        w, ids = torch.topk(F.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
        if renorm:
            w = w / w.sum(dim=-1, keepdim=True)
    elif mode == "topk_softmax":
        w, ids = torch.topk(logits, k, dim=-1)
        w = F.softmax(w, dim=-1, dtype=w.dtype)
    else:
        raise ValueError(f"router_topk: mode must be 'softmax_topk' or 'topk_softmax', got {mode!r}")
    return w.to(out_dtype), ids
