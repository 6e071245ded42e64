"""Calibrated kbit quantization: GPTQ-style error feedback inside the kbit format.

`quantize(model_or_path, KbitConfig(k=3), calibration=texts)` runs calibration tokens through the model one decoder
layer at a time (inputs from the layers already quantized), accumulates H = X^T X of every quantized linear layer's
input (per expert for fused MoE experts, from the tokens routed to it), and picks each layer's codebook indices column
by column: every column takes its nearest codebook entry after the rounding errors of the columns before it were
spread over the columns not yet quantized through the Cholesky factor of H^-1 (GPTQ). Block scales and per-tensor
scales are ordinary kbit scales, so the result is an ordinary kbit model (KbitLinear / KbitMoE holding bit planes):
it saves, loads with from_pretrained and decodes exactly like a round-to-nearest one.

The defaults, measured on SmolLM2-135M at K = 3 (perplexity on 4096 tokens of the pydoc text / of held-out stdlib
docstrings: fp32 14.70 / 19.99, round to nearest 34.03 / 45.72; calibrated on 8192 tokens of other docstrings):
  order="block_act"        blocks of 32 columns by decreasing sum of H's diagonal, columns inside a block likewise:
                           each block stays contiguous, so its scale can be chosen when the block is reached
                           (natural order: 21.46 / 29.91)
  scales="dynamic_search"  a block's scale is chosen when the block is reached, from the weights as error feedback
                           left them: its absmax's e4m4 code or one of 9 neighbours, whichever rounds the block with
                           the least H_jj-weighted error (fixed round-to-nearest scales with act order: 20.77 / 30.20,
                           in natural order 26.97 / 37.31; the updated block's absmax without search 21.92 / 30.67)
  sequential=False         all groups of a layer calibrated on the float layer's inputs: 18.63 / 25.23 (seed 1:
                           18.46 / 25.69); group by group through the quantized ones: 18.76 / 26.65 (18.57 / 26.85)
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from . import format as fmt
from .config import KbitConfig
from . import ops
from .modules import KbitLinear, KbitMoE, is_fused_experts

DEFAULT_N_TOKENS = 8192
DEFAULT_SEQ_LEN = 512
DEFAULT_DAMP = 0.01
# tokens per forward batch of calibration windows: bounds activation memory, amortises per-call overhead
_BATCH_TOKENS = 4096
# columns per lazy batch of error feedback (GPTQ's 128: 4 kbit blocks); later columns get one matmul per batch
_LAZY = 128
# an expert seeing fewer tokens than this has too little data for a Hessian: it keeps round-to-nearest
DEFAULT_MIN_EXPERT_TOKENS = 32
# block-scale codes the scale search tries, as steps from the round-to-nearest e4m4 code (0 first: ties keep it)
E4M4_STEPS = (0, -1, -2, -3, -4, -5, -6, -7, -8, 1)
# fp16 block scales: shrink factors of the absmax instead
FP16_FACTORS = tuple([1.0] + [round(1.0 - 0.03 * i, 2) for i in range(1, 11)] + [1.03])
ORDERS = ("natural", "act", "block_act")
SCALES = ("rtn", "search", "dynamic", "dynamic_search")
SECTION_TITLE = "## kbit calibration"
# rows per step of the static scale search: bounds its [candidates, rows, in] temporaries
_SEARCH_ROWS = 512
# rows sampled for the report's error figures
_ERROR_ROWS = 256


class _Stop(Exception):
    """Raised from a hook to end a forward pass once the wanted inputs were seen."""


# ---------------------------------------------------------------------------------------------------------------
# Error feedback for one matrix (or rows of several matrices sharing an input)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class KbitRows:
    """The chosen encoding of `rows` rows: indices [rows, in], block-scale codes [rows, nb] (stored dtype), the
    per-row per-tensor scale [rows] and the values they decode to [rows, in] (float32)."""

    idx: torch.Tensor
    codes: torch.Tensor
    row_scale: torch.Tensor
    values: torch.Tensor


def _blocked(w: torch.Tensor) -> torch.Tensor:
    """[rows, in] -> [rows, nb, 32], zero padded (as the format pads)."""
    rows, n = w.shape
    pad = fmt.n_blocks(n) * fmt.BLOCK - n
    return nn.functional.pad(w, (0, pad)).view(rows, -1, fmt.BLOCK) if pad else w.view(rows, -1, fmt.BLOCK)


def row_scales(w: torch.Tensor, segments: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(block absmax [rows, nb], per-row power-of-two scale [rows]) where rows are `segments` stacked matrices, each
    with its own per-tensor scale computed exactly as reference.quantize does."""
    blk = _blocked(w).abs().amax(-1)
    s = torch.cat([fmt.tensor_scale(part).expand(n) for part, n in zip(blk.split(list(segments)), segments)])
    return blk, s


def _encode(a: torch.Tensor, absmax_format: str) -> torch.Tensor:
    if absmax_format == "e4m4":
        a = a.clamp(max=fmt.E4M4_MAX)  # error feedback can grow a block past the range its original absmax set
    return fmt.encode_absmax(a, absmax_format)


def _safe(d: torch.Tensor) -> torch.Tensor:
    """Divisor for y = (w / s) / d: d, or inf where d == 0, so such blocks give y = 0 as the format says."""
    return torch.where(d > 0, d, torch.full_like(d, math.inf))


def _round(w: torch.Tensor, s: torch.Tensor, d: torch.Tensor, d_safe: torch.Tensor, cb: torch.Tensor,
           mid: torch.Tensor):
    """(indices, decoded values) of w against block scale d and per-row scale s (broadcast), in the float32 operations
    of the format: y = (w / s) / d, nearest codebook entry, value = (c[idx] * d) * s."""
    idx = torch.searchsorted(mid, ((w / s) / d_safe).contiguous())
    return idx, (cb[idx] * d) * s


def _candidates(a: torch.Tensor, absmax_format: str, search: bool) -> torch.Tensor:
    """Block-scale codes to try for normalised absmax a: [1, ...] (the round-to-nearest code) or [C, ...]; the first
    is always the round-to-nearest code, so ties keep it."""
    code = _encode(a, absmax_format).unsqueeze(0)
    if not search:
        return code
    if absmax_format == "e4m4":  # neighbouring codes: 1/32..1/16 apart, 8 steps down reach 0.6-0.75x
        steps = torch.tensor(E4M4_STEPS, device=a.device).view(-1, *([1] * a.dim()))
        cand = (code.long() + steps).clamp(1, 255)
        return torch.where(code == 0, 0, cand).to(torch.uint8)  # an all-zero block stays zero
    return torch.stack([_encode(a * f, absmax_format) for f in FP16_FACTORS])


def choose_scales(w: torch.Tensor, s: torch.Tensor, weight: torch.Tensor | None, cb: torch.Tensor,
                  absmax_format: str, search: bool) -> torch.Tensor:
    """Block-scale codes for blocks w [rows, nb, L] with per-row scale s [rows]: the round-to-nearest code of the
    absmax, or (search) the candidate code whose rounding error, weighted per column by `weight` [nb, L], is
    smallest."""
    a = w.abs().amax(-1) / s.view(-1, 1)
    cand = _candidates(a, absmax_format, search)
    if cand.shape[0] == 1:
        return cand[0]
    mid = fmt.codebook_midpoints(cb)
    d = fmt.decode_absmax(cand).unsqueeze(-1)  # [C, rows, nb, 1]
    _, q = _round(w, s.view(-1, 1, 1), d, _safe(d), cb, mid)
    err = (w - q).square()
    err = (err * weight).sum(-1) if weight is not None else err.sum(-1)
    best = err.argmin(0, keepdim=True)  # the first of equal errors: the round-to-nearest code
    return cand.gather(0, best)[0]


def _inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + damp * mean(diag H) * I)^-1 (float64 inside), retrying with 10x the dampening
    when H is too ill-conditioned."""
    h = h.double()
    mean = float(h.diagonal().mean())
    for attempt in range(6):
        hd = h.clone()
        hd.diagonal().add_(damp * (10**attempt) * mean)
        chol, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            u, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(chol), upper=True)
            if int(info) == 0:
                return u.float()
    raise RuntimeError("the calibration Hessian is not positive definite even with 1e5x the dampening; "
                       "check the calibration inputs for NaN/Inf")


def _processing_order(diag: torch.Tensor, n: int, order: str) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """(column permutation, [(block, start, end)] in permuted positions; empty when blocks are not contiguous)."""
    nb = fmt.n_blocks(n)
    if order == "act":
        return torch.argsort(diag, descending=True, stable=True), []
    cols = [torch.arange(b * fmt.BLOCK, min(n, (b + 1) * fmt.BLOCK), device=diag.device) for b in range(nb)]
    if order == "block_act":
        weight = torch.stack([diag[c].sum() for c in cols])
        blocks = torch.argsort(weight, descending=True, stable=True).tolist()
        cols = [cols[b][torch.argsort(diag[cols[b]], descending=True, stable=True)] for b in range(nb)]
    else:
        blocks = list(range(nb))
    perm = torch.cat([cols[b] for b in blocks])
    spans, pos = [], 0
    for b in blocks:
        spans.append((b, pos, pos + cols[b].numel()))
        pos += cols[b].numel()
    return perm, spans


def gptq_rows(w: torch.Tensor, h: torch.Tensor, codebook: torch.Tensor, absmax_format: str, *,
              segments: Sequence[int] | None = None, damp: float = DEFAULT_DAMP, order: str = "block_act",
              scales: str = "dynamic_search") -> KbitRows:
    """kbit encoding of w [rows, in] (float32) minimising ||X (W - Wq)^T||^2 for inputs X with X^T X = h [in, in].

    `segments` gives the row counts of stacked matrices that share this input (each keeps its own per-tensor scale,
    computed from its original weights as reference.quantize does). With h = identity, order="natural" and
    scales="rtn" the result is exactly round-to-nearest.
    """
    if order not in ORDERS:
        raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
    if scales not in SCALES:
        raise ValueError(f"scales: expected one of {SCALES}, got {scales!r}")
    if order == "act" and scales.startswith("dynamic"):
        raise ValueError("order='act' interleaves the columns of different blocks, so block scales must be fixed "
                         "before the columns are processed: use scales='rtn' or 'search' with it")
    w = w.float()
    fmt.check_finite(w)
    rows, n = w.shape
    segments = list(segments) if segments is not None else [rows]
    cb = codebook.to(w.device, torch.float32)
    mid = fmt.codebook_midpoints(cb)
    _, s = row_scales(w, segments)
    s_col = s.unsqueeze(1)

    h = h.to(w.device, torch.float32).clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0  # inputs that never fire: nothing to trade against, their columns keep round-to-nearest
    diag = h.diagonal().clone()
    perm, spans = _processing_order(diag, n, order)
    with _one_thread(w.device):  # a 2-thread LAPACK call ran 15x slower on a busy 2-core machine
        u = _inverse_cholesky(h[perm][:, perm], damp)
    dynamic = scales.startswith("dynamic")
    search = scales.endswith("search")
    diag_p = diag[perm]  # the scale search weighs a column's rounding error by its input's energy H_jj

    nb = fmt.n_blocks(n)
    col_block = torch.arange(n, device=w.device) // fmt.BLOCK
    if dynamic:
        codes = torch.empty((rows, nb), dtype=fmt.ABSMAX_DTYPES[absmax_format], device=w.device)
        d_perm = torch.empty((rows, n), dtype=torch.float32, device=w.device)
    else:
        imp = nn.functional.pad(diag, (0, nb * fmt.BLOCK - n))
        codes = torch.cat([choose_scales(_blocked(part), s_part, imp.view(nb, fmt.BLOCK), cb, absmax_format, search)
                           for part, s_part in zip(w.split(_SEARCH_ROWS), s.split(_SEARCH_ROWS))])
        d_perm = fmt.decode_absmax(codes)[:, col_block[perm]]
    d_safe = _safe(d_perm)

    # lazy batches: whole blocks when block scales are chosen on the way, else _LAZY columns
    if spans:
        batches, start = [], 0
        while start < len(spans):
            end = start
            while end < len(spans) and spans[end][2] - spans[start][1] <= _LAZY:
                end += 1
            batches.append((spans[start][1], spans[end - 1][2], spans[start:end]))
            start = end
    else:
        batches = [(a, min(n, a + _LAZY), []) for a in range(0, n, _LAZY)]

    wp = w[:, perm].clone()
    idx_p = torch.empty((rows, n), dtype=torch.long, device=w.device)
    with _one_thread(w.device):
        for b1, b2, batch_spans in batches:
            w1 = wp[:, b1:b2].clone()
            err1 = torch.empty((rows, b2 - b1), dtype=torch.float32, device=w.device)
            u1 = u[b1:b2, b1:b2]
            u1_diag = u1.diagonal().tolist()
            starts = {a - b1: (blk, e - b1) for blk, a, e in batch_spans}
            for i in range(b2 - b1):
                if dynamic and i in starts:
                    blk, e = starts[i]
                    code = choose_scales(w1[:, i:e].unsqueeze(1), s, diag_p[b1 + i: b1 + e].view(1, -1), cb,
                                         absmax_format, search).squeeze(1)
                    codes[:, blk] = code
                    d_perm[:, b1 + i: b1 + e] = fmt.decode_absmax(code).unsqueeze(1)
                    d_safe[:, b1 + i: b1 + e] = _safe(d_perm[:, b1 + i: b1 + e])
                x = w1[:, i]
                _, q = _round(x, s, d_perm[:, b1 + i], d_safe[:, b1 + i], cb, mid)
                e_i = (x - q) / u1_diag[i]
                if i + 1 < b2 - b1:
                    w1[:, i + 1:].addr_(e_i, u1[i, i + 1:], alpha=-1.0)
                err1[:, i] = e_i
            # column i of w1 is final once column i was rounded: the batch's indices in one call, as the loop chose them
            idx_p[:, b1:b2] = torch.searchsorted(mid, ((w1 / s_col) / d_safe[:, b1:b2]).contiguous())
            if b2 < n:
                wp[:, b2:].addmm_(err1, u[b1:b2, b2:], alpha=-1.0)
    inv = torch.argsort(perm)
    idx = idx_p[:, inv]
    d = d_perm[:, inv]
    return KbitRows(idx=idx, codes=codes, row_scale=s, values=(cb[idx] * d) * s_col)


@contextlib.contextmanager
def _one_thread(device: torch.device):
    """The column loop is thousands of small ops: on the CPU, intra-op threads cost more in synchronisation than they
    save (2 threads ran it 60x slower than 1 on a busy 2-core machine). Restores the thread count afterwards."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def pack_rows(enc: KbitRows, k: int, codebook: torch.Tensor) -> torch.Tensor:
    """Bit planes [rows, nb * k] of the chosen indices; padded positions hold the index of 0, as the format pads."""
    rows, n = enc.idx.shape
    nb = fmt.n_blocks(n)
    full = torch.empty((rows, nb * fmt.BLOCK), dtype=torch.long, device=enc.idx.device)
    full[:, n:] = fmt.nearest_index(torch.zeros(1, device=enc.idx.device), codebook.to(enc.idx.device))
    full[:, :n] = enc.idx
    return fmt.pack_bitplanes(full.view(rows, nb, fmt.BLOCK), k)


def relative_error(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) / tr(W H W^T): the layer-output error on the calibration inputs, relative."""
    diff = (w - q).float()
    num = float(((diff @ h) * diff).sum())
    den = float(((w.float() @ h) * w.float()).sum())
    return num / den if den > 0 else 0.0


def error_sample(w: torch.Tensor, enc: KbitRows, h: torch.Tensor, codebook: torch.Tensor,
                 absmax_format: str) -> tuple[float, float]:
    """(round-to-nearest, chosen) relative layer-output error on up to _ERROR_ROWS evenly spaced rows: a diagnostic
    for the report, cheap next to the quantization itself."""
    rows = torch.arange(0, w.shape[0], max(1, w.shape[0] // _ERROR_ROWS), device=w.device)
    ws, s = w[rows].float(), enc.row_scale[rows]
    cb = codebook.to(w.device, torch.float32)
    blocks = _blocked(ws)
    d = fmt.decode_absmax(choose_scales(blocks, s, None, cb, absmax_format, False)).unsqueeze(-1)
    _, rtn = _round(blocks, s.view(-1, 1, 1), d, _safe(d), cb, fmt.codebook_midpoints(cb))
    rtn = rtn.flatten(1)[:, : w.shape[1]]
    return relative_error(ws, rtn, h), relative_error(ws, enc.values[rows], h)


# ---------------------------------------------------------------------------------------------------------------
# Calibration data
# ---------------------------------------------------------------------------------------------------------------


def _is_int_seq(x) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


def calibration_tokens(calibration, tokenizer=None) -> tuple[torch.Tensor, str]:
    """All calibration token ids as one 1-D int64 stream, and a one-line description of them.

    Accepts a string, a sequence of strings (joined with blank lines, as kbit_hf.eval joins the pydoc topics), a 1-D
    or 2-D integer tensor, or a (sequence of) list(s) of ints.
    """
    if calibration is None:
        raise ValueError("calibration is required: a text, a list of texts or token ids")
    if isinstance(calibration, str) or (isinstance(calibration, (list, tuple)) and calibration
                                        and all(isinstance(t, str) for t in calibration)):
        texts = [calibration] if isinstance(calibration, str) else list(calibration)
        text = "\n\n".join(texts)
        if not text.strip():
            raise ValueError("calibration text is empty")
        if tokenizer is None:
            raise ValueError("calibration is text, so a tokenizer is needed: pass tokenizer=..., or a model path that "
                             "holds one")
        ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        ids = torch.tensor(ids, dtype=torch.long)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
        what = f"{len(texts)} text(s), {len(text)} characters, sha256 {digest}"
    elif isinstance(calibration, torch.Tensor):
        if calibration.is_floating_point() or calibration.is_complex() or calibration.dim() not in (1, 2):
            raise ValueError(f"calibration token ids must be a 1-D or 2-D integer tensor, got {calibration.dtype} "
                             f"{tuple(calibration.shape)}")
        ids = calibration.detach().to("cpu", torch.long).flatten()
        what = "token ids"
    elif _is_int_seq(calibration) or (isinstance(calibration, (list, tuple))
                                      and all(_is_int_seq(c) for c in calibration)):
        flat = list(calibration) if _is_int_seq(calibration) else [v for c in calibration for v in c]
        ids = torch.tensor(flat, dtype=torch.long)
        what = "token ids"
    else:
        raise ValueError(f"calibration must be a text, a list of texts or token ids, got {type(calibration).__name__}")
    if ids.numel() == 0:
        raise ValueError("calibration data is empty (0 tokens)")
    if what == "token ids":
        digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:12]
        what = f"token ids, sha256 {digest}"
    return ids, what


def calibration_windows(ids: torch.Tensor, n_tokens: int, seq_len: int, seed: int) -> torch.Tensor:
    """n_tokens // seq_len windows [n, seq_len] of `ids`: aligned, non-overlapping windows of the stream picked by a
    generator seeded with `seed`, in stream order."""
    for name, v in (("n_tokens", n_tokens), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if n_tokens < seq_len:
        raise ValueError(f"n_tokens={n_tokens} is less than one window of seq_len={seq_len}")
    n_windows = n_tokens // seq_len
    available = ids.numel() // seq_len
    if available < n_windows:
        raise ValueError(f"calibration data has {ids.numel()} tokens, too short for n_tokens={n_tokens} "
                         f"({n_windows} windows of seq_len={seq_len}): pass more text or a smaller n_tokens")
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(available, generator=g)[:n_windows].sort().values
    return ids[: available * seq_len].view(available, seq_len)[pick]


# ---------------------------------------------------------------------------------------------------------------
# Model plumbing
# ---------------------------------------------------------------------------------------------------------------


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The ModuleList of decoder layers: the largest ModuleList with num_hidden_layers entries."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(cfg, "num_hidden_layers", None)
    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and (n is None or len(module) == n):
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[2]:
                best = (name, module, size)
    if best is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (a ModuleList of "
                         f"num_hidden_layers={n} modules)")
    return best[0], best[1]


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _capture_layer_inputs(model, layers: nn.ModuleList, windows: torch.Tensor, batch: int, device):
    """(hidden states entering layer 0 per batch, [per layer: (args, kwargs) per batch]) from one pass through the
    embeddings; every layer is replaced by a recorder (masks and rotary embeddings may differ by layer type)."""
    inputs: list[torch.Tensor] = []
    calls: list[list[tuple[tuple, dict]]] = [[] for _ in layers]
    last = len(layers) - 1

    def recorder(i):
        def forward(*args, **kwargs):
            hs = args[0] if args else kwargs.pop("hidden_states")
            calls[i].append((_to(tuple(args[1:]), device), _to(kwargs, device)))
            if i == 0:
                inputs.append(hs.to(device))
            if i == last:
                raise _Stop
            return hs
        return forward

    home = next(model.parameters()).device
    for i, layer in enumerate(layers):
        layer.forward = recorder(i)
    try:
        for start in range(0, windows.shape[0], batch):
            try:
                model(input_ids=windows[start:start + batch].to(home), use_cache=False)
            except _Stop:
                pass
    finally:
        for layer in layers:
            del layer.forward
    return inputs, calls


def _run_layer(layer, hs, args, kwargs):
    out = layer(hs, *args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out


def _feed_hooks(layer, inputs, calls) -> None:
    """Run `layer` on every captured input for the forward hooks it carries (a hook may stop a run with _Stop)."""
    for hs, (a, kw) in zip(inputs, calls):
        try:
            _run_layer(layer, hs, a, kw)
        except _Stop:
            pass


def _mark_loaded(module: nn.Module) -> None:
    # the quantizer's load checks take a parameter without this flag for one the checkpoint failed to provide
    for p in module.parameters(recurse=False):
        p._is_hf_initialized = True


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _kbit_linear(orig: nn.Linear, packed, codes, scale, codebook, config: KbitConfig, k: int) -> KbitLinear:
    dev = orig.weight.device
    new = KbitLinear(orig.in_features, orig.out_features, orig.bias is not None, k, config.absmax_format,
                     codebook, pre_quantized=True, dtype=orig.weight.dtype, device="meta")
    new.weight = _frozen(packed.to(dev))
    new.weight_absmax = _frozen(codes.to(dev))
    new.weight_scale = _frozen(scale.reshape(()).to(dev))
    new.weight_codebook = _frozen(codebook.to(dev, torch.float32).clone())
    if orig.bias is not None:
        new.bias = _frozen(orig.bias.detach().clone())
    _mark_loaded(new)
    return new


def _rtn_linear(orig: nn.Linear, codebook, config: KbitConfig, k: int) -> KbitLinear:
    packed, codes, scale = ops.quantize(orig.weight.detach(), codebook.to(orig.weight.device), k,
                                        config.absmax_format)
    return _kbit_linear(orig, packed, codes, scale, codebook, config, k)


def _experts_weight_oi(orig: nn.Module, name: str) -> torch.Tensor:
    w = getattr(orig, name).detach()
    return w.transpose(-1, -2) if getattr(orig, "is_transposed", False) else w


def _set_expert_tensors(moe: KbitMoE, name: str, packed, codes, scales, codebook) -> None:
    dev = packed.device
    setattr(moe, name, _frozen(packed))
    setattr(moe, name + "_absmax", _frozen(codes))
    setattr(moe, name + "_scale", _frozen(scales))
    setattr(moe, name + "_codebook", _frozen(codebook.to(dev, torch.float32).clone()))


def _routing(args, kwargs):
    """(hidden_states [T, H], expert ids [T, top_k]) from a fused experts module's call."""
    hs = args[0] if args else kwargs["hidden_states"]
    if len(args) > 1:
        ids = args[1]
    else:
        ids = kwargs.get("top_k_index", kwargs.get("router_indices"))
    return hs.reshape(-1, hs.shape[-1]), ids.reshape(hs.reshape(-1, hs.shape[-1]).shape[0], -1)


@dataclass
class _Group:
    names: list[str]  # module names relative to the layer; one name for an experts module
    experts: bool = False


def _discover_groups(layer, targets: dict[str, nn.Module], hs, args, kwargs) -> tuple[list[_Group], list[str]]:
    """Targets in the order the layer calls them, linears grouped when they read the same input tensor (q/k/v,
    gate/up); and the targets never called."""
    order: list[tuple[str, Any]] = []
    seen = set()
    handles = []

    def hook(name):
        def pre(module, a, kw):
            if name not in seen:
                seen.add(name)
                order.append((name, a[0] if a else next(iter(kw.values()))))
        return pre

    for name, module in targets.items():
        handles.append(module.register_forward_pre_hook(hook(name), with_kwargs=True))
    try:
        _run_layer(layer, hs, args, kwargs)
    finally:
        for h in handles:
            h.remove()
    groups: list[_Group] = []
    prev_x = None
    for name, x in order:
        experts = not isinstance(targets[name], nn.Linear)
        if not experts and groups and not groups[-1].experts and x is prev_x:
            groups[-1].names.append(name)
        else:
            groups.append(_Group([name], experts))
        prev_x = x
    return groups, [n for n in targets if n not in seen]


class _Hessian:
    def __init__(self, n: int, device):
        self.h = torch.zeros((n, n), dtype=torch.float32, device=device)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.h.addmm_(x.t(), x)
        self.count += x.shape[0]

    def mean(self) -> torch.Tensor:
        return self.h / max(1, self.count)


@dataclass
class _Report:
    groups: list[dict] = field(default_factory=list)
    rtn_modules: list[str] = field(default_factory=list)
    experts_total: int = 0
    experts_rtn: int = 0


# ---------------------------------------------------------------------------------------------------------------
# The calibration loop
# ---------------------------------------------------------------------------------------------------------------


def quantize(model_or_path, config: KbitConfig, calibration=None, *, tokenizer=None,
             n_tokens: int = DEFAULT_N_TOKENS, seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0, device=None,
             out: str | os.PathLike | None = None, damp: float = DEFAULT_DAMP, order: str = "block_act",
             scales: str = "dynamic_search", sequential: bool = False,
             min_expert_tokens: int = DEFAULT_MIN_EXPERT_TOKENS, batch_size: int | None = None,
             calibration_name: str | None = None, progress: bool = True):
    """Quantize a model to kbit with calibration (GPTQ-style error feedback in the kbit format).

    Args:
        model_or_path: a float transformers causal LM (quantized in place: its linears are replaced) or a folder /
            hub id to load one from (in its checkpoint dtype, on the CPU).
        config: the KbitConfig (k, codebook, absmax_format, modules_to_not_convert, quantize_lm_head, module_k) to
            produce; with module_k every module is calibrated at its own k (linears sharing an input are grouped by
            k).
        calibration: a text, a list of texts (joined with blank lines) or token ids (1-D/2-D tensor or lists).
        tokenizer: tokenizes text calibration; default: the one in model_or_path when it is a folder.
        n_tokens, seq_len: calibration windows: n_tokens // seq_len aligned windows of seq_len tokens, picked from
            the calibration stream by `seed`. A stream shorter than n_tokens is a ValueError.
        device: where each decoder layer is calibrated ("cuda", "cpu"; default cuda when available). One layer's
            float weights and the calibration activations are held there at a time; the model stays where it is.
        out: also save the quantized model (save_pretrained), the tokenizer and a model card there.
        damp: dampening of H, as a fraction of its mean diagonal.
        order: "block_act" (blocks by decreasing H diagonal, columns within a block likewise), "natural", or "act"
            (columns by decreasing H diagonal across blocks; needs fixed scales).
        scales: "dynamic_search" (block scale chosen when its block is reached, searched by H-weighted error),
            "dynamic" (absmax of the updated block), "search" (searched on the original weights, fixed first), or
            "rtn" (round-to-nearest scales of the original weights, fixed first).
        sequential: calibrate each group of linears sharing an input (q/k/v, o, gate/up, down) on inputs computed
            through the groups of the layer already quantized; default: every group of a layer on the inputs of the
            float layer (one pass; measured as good or better). Fused experts always see their quantized gate_up.
        min_expert_tokens: experts routed fewer calibration tokens keep round-to-nearest.
        batch_size: calibration windows per forward (default: 4096 tokens' worth).
        calibration_name: how the model card names the calibration data (default: a description with its hash).
        progress: tqdm progress bars.

    Returns the model with KbitLinear / KbitMoE modules, ready for inference and save_pretrained.
    `model.kbit_calibration` (also saved in config.json as `kbit_calibration`) describes the calibration.
    """
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .quantizer import KbitHfQuantizer

    if not isinstance(config, KbitConfig):
        raise ValueError(f"config must be a kbit_hf.KbitConfig, got {type(config).__name__}")
    if config.dequantize:
        raise ValueError("config.dequantize=True is for loading kbit checkpoints back to float; leave it False")
    if not (isinstance(damp, (int, float)) and damp > 0):
        raise ValueError(f"damp must be a positive number, got {damp!r}")
    if order not in ORDERS or scales not in SCALES:
        raise ValueError(f"order must be one of {ORDERS} and scales one of {SCALES}; got {order!r}, {scales!r}")
    if order == "act" and scales.startswith("dynamic"):
        raise ValueError("order='act' needs block scales fixed first: scales='rtn' or 'search'")
    t_start = time.perf_counter()
    if isinstance(model_or_path, (str, os.PathLike)):
        path = os.fspath(model_or_path)
        if tokenizer is None and _needs_tokenizer(calibration):
            tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", device_map={"": "cpu"})
    elif isinstance(model_or_path, nn.Module):
        model = model_or_path
    else:
        raise ValueError(f"model_or_path must be a transformers model or a folder, got {type(model_or_path).__name__}")
    if getattr(model, "hf_quantizer", None) is not None or any(isinstance(m, (KbitLinear, KbitMoE))
                                                               for m in model.modules()):
        raise ValueError("the model is already quantized; calibrate from the float model")
    ids, described = calibration_tokens(calibration, tokenizer)
    windows = calibration_windows(ids, n_tokens, seq_len, seed)
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available()
                                                                          else "cpu")
    batch = batch_size or max(1, _BATCH_TOKENS // seq_len)

    hfq = KbitHfQuantizer(copy.deepcopy(config), pre_quantized=False)
    hfq.modules_to_not_convert = hfq._skip_list(model)
    codebooks: dict[int, torch.Tensor] = {}

    def codebook(name: str) -> tuple[int, torch.Tensor]:
        """(k, codebook) of the module with this dotted name: config.module_k decides k, as from_pretrained does."""
        k = config.k_for(name)
        if k not in codebooks:
            codebooks[k] = config.codebook_tensor(k)
        return k, codebooks[k]

    layers_name, layers = _decoder_layers(model)
    was_training = model.training
    model.eval()
    report = _Report()
    with torch.no_grad():
        inputs, calls = _capture_layer_inputs(model, layers, windows, batch, device)
        bar = tqdm(range(len(layers)), desc=f"kbit calibrate k={config.k}", unit="layer", disable=not progress)
        for i in bar:
            layer = layers[i]
            prefix = f"{layers_name}.{i}."
            home = next(layer.parameters()).device
            layer.to(device)
            targets = {}
            for name, module in layer.named_modules():
                if name and hfq._should_convert(prefix + name) and (
                        (isinstance(module, nn.Linear) and not isinstance(module, KbitLinear))
                        or is_fused_experts(module)):
                    targets[name] = module
            if targets:
                args0, kw0 = calls[i][0]
                groups, uncalled = _discover_groups(layer, targets, inputs[0], args0, kw0)
                report.rtn_modules += [prefix + n for n in uncalled]
                _calibrate_layer(layer, groups, inputs, calls[i], codebook, config, report, prefix,
                                 damp=damp, order=order, scales=scales, sequential=sequential,
                                 min_expert_tokens=min_expert_tokens)
            if i + 1 < len(layers):
                inputs = [_run_layer(layer, h, a, kw) for h, (a, kw) in zip(inputs, calls[i])]
            layer.to(home)
            calls[i] = []
        # what the layers did not hold (or never called) keeps round-to-nearest, as from_pretrained would quantize it
        for name, module in list(model.named_modules()):
            if not name or not hfq._should_convert(name):
                continue
            k, cb = codebook(name)
            if isinstance(module, nn.Linear) and not isinstance(module, KbitLinear):
                model.set_submodule(name, _rtn_linear(module, cb, config, k))
            elif is_fused_experts(module) and not isinstance(module, KbitMoE):
                moe = KbitMoE(module, k, config.absmax_format, cb, pre_quantized=False)
                for pname in moe.quantized_names:
                    for key, t in moe.quantize_param(pname, getattr(module, pname).detach()).items():
                        setattr(moe, key, _frozen(t))
                _mark_loaded(moe)
                model.set_submodule(name, moe)
            else:
                continue
            if name not in report.rtn_modules:
                report.rtn_modules.append(name)
    model.train(was_training)
    elapsed = time.perf_counter() - t_start

    info = _describe(config, calibration_name or described, windows, seq_len, seed, damp, order, scales, sequential,
                     min_expert_tokens, device, elapsed, report)
    _finalize(model, hfq, info)
    if out is not None:
        save(model, out, tokenizer)
    return model


def _needs_tokenizer(calibration) -> bool:
    return isinstance(calibration, str) or (isinstance(calibration, (list, tuple)) and bool(calibration)
                                            and all(isinstance(t, str) for t in calibration))


def _calibrate_layer(layer, groups: list[_Group], inputs, calls, codebook, config: KbitConfig, report: _Report,
                     prefix: str, *, damp, order, scales, sequential, min_expert_tokens) -> None:
    linear_groups = [g for g in groups if not g.experts]
    if not sequential and linear_groups:
        hess = _collect_linear(layer, linear_groups, inputs, calls, stop=False)
        for g in linear_groups:
            _quantize_linear_group(layer, g, hess[g.names[0]], codebook, config, report, prefix, damp, order, scales)
    for g in groups:
        if g.experts:
            _quantize_experts(layer, g.names[0], inputs, calls, codebook, config, report, prefix, damp, order, scales,
                              min_expert_tokens)
        elif sequential:
            hess = _collect_linear(layer, [g], inputs, calls, stop=True)
            _quantize_linear_group(layer, g, hess[g.names[0]], codebook, config, report, prefix, damp, order, scales)


def _collect_linear(layer, groups: list[_Group], inputs, calls, stop: bool) -> dict[str, _Hessian]:
    """H of the input of each group's first linear over all calibration batches (stop: end each forward there)."""
    hess: dict[str, _Hessian] = {}
    handles = []
    for g in groups:
        module = layer.get_submodule(g.names[0])
        hess[g.names[0]] = _Hessian(module.in_features, module.weight.device)

        def pre(mod, a, kw, name=g.names[0]):
            hess[name].add(a[0] if a else kw["input"])
            if stop:
                raise _Stop
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        _feed_hooks(layer, inputs, calls)
    finally:
        for h in handles:
            h.remove()
    return hess


def _quantize_linear_group(layer, g: _Group, hess: _Hessian, codebook, config, report, prefix, damp, order,
                           scales) -> None:
    """The linears of a group share one input and so one H; those of equal k (config.module_k) are encoded together
    (each keeps its own per-tensor scale), one call per k."""
    h = hess.mean()
    by_k: dict[int, list[str]] = {}
    for n in g.names:
        by_k.setdefault(codebook(prefix + n)[0], []).append(n)
    for names in by_k.values():
        k, cb = codebook(prefix + names[0])
        modules = [layer.get_submodule(n) for n in names]
        w = torch.cat([m.weight.detach().float() for m in modules])
        enc = gptq_rows(w, h, cb, config.absmax_format, segments=[m.out_features for m in modules], damp=damp,
                        order=order, scales=scales)
        packed = pack_rows(enc, k, cb)
        err_rtn, err = error_sample(w, enc, h, cb, config.absmax_format)
        report.groups.append({"modules": [prefix + n for n in names], "k": k, "tokens": hess.count,
                              "rel_err_rtn": err_rtn, "rel_err": err})
        r0 = 0
        for name, m in zip(names, modules):
            r1 = r0 + m.out_features
            layer.set_submodule(name, _kbit_linear(m, packed[r0:r1], enc.codes[r0:r1], enc.row_scale[r0], cb, config,
                                                   k))
            r0 = r1


def _quantize_experts(layer, name: str, inputs, calls, codebook, config, report, prefix, damp, order, scales,
                      min_expert_tokens) -> None:
    """Fused experts: gate_up (or up) from per-expert H of the tokens routed to each expert, then down from the
    inputs the quantized gate_up produces; experts with fewer than min_expert_tokens tokens keep round-to-nearest."""
    orig = layer.get_submodule(name)
    k, codebook = codebook(prefix + name)
    moe = KbitMoE(orig, k, config.absmax_format, codebook, pre_quantized=True)
    e_count = moe.num_experts
    first = moe.quantized_names[0]  # gate_up_proj or up_proj
    second = "down_proj"
    for pname in (first, second):
        w_all = _experts_weight_oi(orig, pname).float()
        n_in = w_all.shape[-1]
        hess = [_Hessian(n_in, w_all.device) for _ in range(e_count)]

        def pre(mod, a, kw, pname=pname, hess=hess):
            x, ids = _routing(a, kw)
            if pname == first:
                for e in range(e_count):
                    rows = (ids == e).any(-1)
                    if bool(rows.any()):
                        hess[e].add(x[rows])
            else:
                top_k = ids.shape[-1]
                flat = ids.reshape(-1)
                xr = x.repeat_interleave(top_k, dim=0)
                hmid = moe._apply_gate(moe._proj(first, xr, flat)) if moe.has_gate else moe.act_fn(
                    moe._proj(first, xr, flat))
                for e in range(e_count):
                    rows = flat == e
                    if bool(rows.any()):
                        hess[e].add(hmid[rows])
            raise _Stop

        handle = orig.register_forward_pre_hook(pre, with_kwargs=True)
        try:
            _feed_hooks(layer, inputs, calls)
        finally:
            handle.remove()
        packed, codes, scl = [], [], []
        err_rtn, err_q, fallback = [], [], 0
        for e in range(e_count):
            w = w_all[e]
            if hess[e].count < min_expert_tokens:
                p, a, s = ops.quantize(w, codebook.to(w.device), k, config.absmax_format)
                fallback += 1
            else:
                h = hess[e].mean()
                enc = gptq_rows(w, h, codebook, config.absmax_format, damp=damp, order=order, scales=scales)
                p, a, s = pack_rows(enc, k, codebook), enc.codes, enc.row_scale[0]
                e_rtn, e_q = error_sample(w, enc, h, codebook, config.absmax_format)
                err_rtn.append(e_rtn)
                err_q.append(e_q)
            packed.append(p)
            codes.append(a)
            scl.append(s.reshape(()))
        _set_expert_tensors(moe, pname, torch.stack(packed), torch.stack(codes), torch.stack(scl), codebook)
        report.experts_total += e_count
        report.experts_rtn += fallback
        report.groups.append({"modules": [f"{prefix}{name}.{pname}"], "tokens": sum(h.count for h in hess),
                              "experts_rtn": fallback,
                              "rel_err_rtn": sum(err_rtn) / len(err_rtn) if err_rtn else None,
                              "rel_err": sum(err_q) / len(err_q) if err_q else None})
    _mark_loaded(moe)
    layer.set_submodule(name, moe)


def _describe(config, what, windows, seq_len, seed, damp, order, scales, sequential, min_expert_tokens, device,
              elapsed, report: _Report) -> dict:
    errs = [(g["rel_err_rtn"], g["rel_err"]) for g in report.groups if g.get("rel_err") is not None]
    return {
        "method": "gptq-kbit",
        "calibration": what,
        "n_tokens": int(windows.numel()),
        "seq_len": seq_len,
        "windows": int(windows.shape[0]),
        "seed": seed,
        "damp": damp,
        "order": order,
        "scales": scales,
        "sequential": sequential,
        "min_expert_tokens": min_expert_tokens,
        "experts": report.experts_total,
        "experts_round_to_nearest": report.experts_rtn,
        "modules_round_to_nearest": list(report.rtn_modules),
        "mean_rel_err_rtn": sum(e[0] for e in errs) / len(errs) if errs else None,
        "mean_rel_err": sum(e[1] for e in errs) / len(errs) if errs else None,
        "device": str(device),
        "seconds": round(elapsed, 1),
        "groups": report.groups,
    }


def _finalize(model, hfq, info: dict) -> None:
    """What from_pretrained's quantizer does after loading (config, checks, layouts, tags, model-card hooks)."""
    for module in model.modules():
        if isinstance(module, (KbitLinear, KbitMoE)):
            _mark_loaded(module)
    model.is_quantized = True
    model.quantization_method = "kbit"
    model.hf_quantizer = hfq
    hfq.postprocess_model(model)
    model.kbit_calibration = info
    # config.json keeps the summary (no per-group errors); the quantization_config stays the plain format contract
    model.config.kbit_calibration = {k: v for k, v in info.items() if k != "groups"}


def card_section(info: dict) -> str:
    experts = ""
    if info.get("experts"):
        experts = (f" {info['experts_round_to_nearest']} of {info['experts']} expert matrices saw fewer than "
                   f"{info['min_expert_tokens']} calibration tokens and kept round-to-nearest.")
    err = ""
    if info.get("mean_rel_err") is not None:
        err = (f" Mean relative layer-output error on the calibration inputs: {info['mean_rel_err']:.4g} "
               f"(round-to-nearest: {info['mean_rel_err_rtn']:.4g}).")
    return (f"{SECTION_TITLE}\n\n"
            f"The kbit indices and block scales were chosen with calibration (GPTQ-style error feedback inside the "
            f"kbit format, `kbit_hf.quantize`) on {info['calibration']}: {info['n_tokens']} tokens in "
            f"{info['windows']} windows of {info['seq_len']} (seed {info['seed']}), dampening {info['damp']}, order "
            f"{info['order']}, block scales {info['scales']}, sequential {info['sequential']}; {info['seconds']} s on "
            f"{info['device']}.{experts}{err} The stored format is the ordinary kbit format: it loads and decodes "
            f"like any kbit checkpoint.\n")


def save(model, out, tokenizer=None) -> None:
    """save_pretrained(out) plus the tokenizer and a model-card section on the calibration."""
    out = os.fspath(out)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    readme = os.path.join(out, "README.md")
    text = open(readme, encoding="utf-8").read() if os.path.exists(readme) else ""
    if SECTION_TITLE in text:  # a folder saved before: replace the section, keep the rest
        head, _, tail = text.partition(SECTION_TITLE)
        rest = tail.split("\n## ", 1)
        text = head.rstrip() + ("\n\n## " + rest[1] if len(rest) > 1 else "")
    with open(readme, "w", encoding="utf-8") as f:
        f.write(text.rstrip() + "\n\n" + card_section(model.kbit_calibration))


__all__ = ["quantize", "save", "gptq_rows", "pack_rows", "calibration_tokens", "calibration_windows", "KbitRows",
           "relative_error", "DEFAULT_N_TOKENS", "DEFAULT_SEQ_LEN"]
