"""The CPU implementations of the kbit ops: thin ctypes calls into libkbit_cpu (kbit_hf/backends/cpu/library.py).

Each call runs on torch's intra-op thread count (torch.get_num_threads()). Which path runs is decided in
dispatch.py; quantize and dequantize are bit-exact with the reference, linear and expert_linear equal it up to the
order of the fp32 sums.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ... import format as fmt
from .. import reference
from . import dispatch, library
from .library import DTYPE_CODE, check

_KSET = frozenset(fmt.SUPPORTED_K)


def _cb(codebook: torch.Tensor, k: int) -> torch.Tensor:
    if codebook.device.type != "cpu" or codebook.dtype != torch.float32 or not codebook.is_contiguous():
        codebook = codebook.to(device="cpu", dtype=torch.float32).contiguous()
    fmt.check_codebook_size(codebook, k)
    return codebook


def _fp16(absmax: torch.Tensor) -> int:
    return 1 if fmt.absmax_format_of(absmax) == "fp16" else 0


def _check_planes(packed, absmax, scale, k, in_features, *others) -> None:
    """What the library reads fits: bit planes of k, in_features; these and `others` (None skipped) on the CPU."""
    for t in (packed, absmax, scale, *others):
        if t is not None and not t.is_cpu:
            raise ValueError(f"kbit CPU kernels: every tensor must be on the CPU; got one on {t.device}")
    if packed.dtype != torch.uint32:
        raise ValueError(f"the CPU kernels read the bit-plane layout (uint32 packed); got {packed.dtype} "
                         f"{tuple(packed.shape)}: convert with kbit_hf.ops.bit_planes first")
    fmt.check_fits(packed, absmax, scale, k, in_features)
    fmt.absmax_format_of(absmax)


# ---- quantize / dequantize -------------------------------------------------------------------------------------

def quantize(weight, codebook, k, absmax_format):
    """weight [..., out, in] -> (packed, absmax, scale), byte for byte reference.quantize."""
    fmt.check_weight_to_quantize(weight, codebook, k, absmax_format)
    if not weight.is_cpu:
        raise ValueError(f"kbit CPU kernels: every tensor must be on the CPU; got one on {weight.device}")
    if weight.dtype not in DTYPE_CODE:
        weight = weight.float()  # the reference's w.float()
    weight = weight.contiguous()
    *lead, out, inp = weight.shape
    E = math.prod(lead)
    threads = torch.get_num_threads()
    amax = torch.empty(E, dtype=torch.float32)
    check(library.lib.kbit_cpu_absmax(weight.data_ptr(), DTYPE_CODE[weight.dtype], E, out, inp, amax.data_ptr(),
                                      threads), "quantize")
    # the power-of-two scale by the reference's own float32 operations (format.tensor_scale)
    scale = fmt.tensor_scale(amax.view(E, 1, 1)).contiguous()
    packed, absmax, _ = fmt.empty_quantized(tuple(weight.shape), k, absmax_format, "cpu")
    cb = _cb(codebook, k)  # every tensor whose pointer the library gets is held by a name until it returns
    check(library.lib.kbit_cpu_quantize(weight.data_ptr(), DTYPE_CODE[weight.dtype], E, out, inp, scale.data_ptr(),
                                        cb.data_ptr(), k, 1 if absmax_format == "fp16" else 0, packed.data_ptr(),
                                        absmax.data_ptr(), threads), "quantize")
    return packed, absmax, scale.view(tuple(lead))


def dequantize_out(packed, absmax, scale, codebook, k, in_features, out):
    """Dequantize into `out` [..., out_features, in_features] (fp32/fp16/bf16, contiguous), bit-exact."""
    fmt.check_k(k)
    _check_planes(packed, absmax, scale, k, in_features, out)
    if out.dtype not in DTYPE_CODE or tuple(out.shape) != (*packed.shape[:-1], in_features) \
            or not (out.is_contiguous() and packed.is_contiguous() and absmax.is_contiguous()):
        raise ValueError(f"dequantize_out: out must be a contiguous {list(DTYPE_CODE)} tensor of shape "
                         f"{(*packed.shape[:-1], in_features)} and the weight contiguous; got out {out.dtype} "
                         f"{tuple(out.shape)}")
    scale, cb = scale.float().contiguous(), _cb(codebook, k)
    *lead, rows, _ = packed.shape
    rc = library.lib.kbit_cpu_dequantize(packed.data_ptr(), absmax.data_ptr(), _fp16(absmax), scale.data_ptr(),
                                         cb.data_ptr(), k, math.prod(lead), rows, in_features, out.data_ptr(),
                                         DTYPE_CODE[out.dtype], torch.get_num_threads())
    check(rc, "dequantize")
    return out


def dequantize(packed, absmax, scale, codebook, k, in_features, dtype=torch.float32):
    fmt.check_k(k)
    fmt.check_codebook_size(codebook, k)
    _check_planes(packed, absmax, scale, k, in_features)
    packed, absmax = packed.contiguous(), absmax.contiguous()
    kernel_dtype = dtype if dtype in DTYPE_CODE else torch.float32  # other dtypes: decode to fp32, then cast
    out = torch.empty((*packed.shape[:-1], in_features), dtype=kernel_dtype)
    if out.numel() == 0:
        return out.to(dtype)
    return dequantize_out(packed, absmax, scale, codebook, k, in_features, out).to(dtype)


# ---- linear ----------------------------------------------------------------------------------------------------

def linear_out(x, packed, absmax, scale, codebook, k, in_features, bias, out):
    """Fused dequant-GEMV into `out` [M, out_features] in x's dtype: x [M, in] contiguous fp32/bf16/fp16, any
    M >= 1 (made for few rows), bias None or fp32/bf16/fp16. No allocation visible to the caller."""
    fmt.check_k(k)
    _check_planes(packed, absmax, scale, k, in_features, x, bias, out)
    if x.dtype not in DTYPE_CODE or out.dtype != x.dtype or (bias is not None and bias.dtype not in DTYPE_CODE):
        raise ValueError(f"linear_out: x and out in one of {list(DTYPE_CODE)}, bias None or one of them; got x "
                         f"{x.dtype}, out {out.dtype}, bias {None if bias is None else bias.dtype}")
    M = x.shape[0]
    if x.dim() != 2 or x.shape[1] != in_features or tuple(out.shape) != (M, packed.shape[0]) or M < 1:
        raise ValueError(f"linear_out: x {tuple(x.shape)} and out {tuple(out.shape)} do not fit a weight "
                         f"[{packed.shape[0]}, {in_features}]")
    if not (x.is_contiguous() and out.is_contiguous() and packed.is_contiguous() and absmax.is_contiguous()
            and (bias is None or bias.is_contiguous())):
        raise ValueError("linear_out: every tensor must be contiguous")
    scale, cb = scale.float(), _cb(codebook, k)
    rc = library.lib.kbit_cpu_gemv(x.data_ptr(), DTYPE_CODE[x.dtype], M, packed.data_ptr(), absmax.data_ptr(),
                                   _fp16(absmax), scale.data_ptr(), cb.data_ptr(), k,
                                   packed.shape[0], in_features, 0 if bias is None else bias.data_ptr(),
                                   DTYPE_CODE[bias.dtype] if bias is not None else 0, out.data_ptr(),
                                   torch.get_num_threads())
    check(rc, "gemv")
    return out


def linear(x, packed, absmax, scale, codebook, k, in_features, bias=None):
    """y = x @ W^T + bias on the CPU: the fused GEMV where dispatch.linear_uses_gemv, else dequantize + matmul."""
    # Lean eager fast path (dispatch.linear_uses_gemv, inlined): the per-token decode call, once per layer and token,
    # so the common case (what KbitLinear holds: contiguous bit planes on the CPU, a fp32 codebook) takes the fewest
    # Python operations; every pointer the library reads is checked to fit.
    code = DTYPE_CODE.get(x.dtype)
    if code is not None and x.is_cpu and k in _KSET and in_features > 0 and x.shape[-1] == in_features:
        M = x.numel() // in_features
        nb = (in_features + 31) >> 5
        out_f = packed.shape[0]
        if 0 < M <= dispatch.linear_max_m() and packed.dtype == torch.uint32 and packed.shape == (out_f, nb * k) \
                and (absmax.dtype == torch.uint8 or absmax.dtype == torch.float16) and absmax.shape == (out_f, nb) \
                and scale.dtype == torch.float32 and scale.numel() == 1 and codebook.numel() == 1 << k \
                and packed.is_cpu and absmax.is_cpu and scale.is_cpu \
                and (bias is None or (bias.dtype in DTYPE_CODE and bias.shape == (out_f,) and bias.is_cpu)):
            if not x.is_contiguous():
                x = x.contiguous()
            if not (packed.is_contiguous() and absmax.is_contiguous()):
                packed, absmax = packed.contiguous(), absmax.contiguous()
            if codebook.dtype != torch.float32 or not codebook.is_cpu or not codebook.is_contiguous():
                codebook = _cb(codebook, k)
            if bias is not None and not bias.is_contiguous():
                bias = bias.contiguous()
            y = x.new_empty((*x.shape[:-1], out_f))
            rc = library.lib.kbit_cpu_gemv(x.data_ptr(), code, M, packed.data_ptr(), absmax.data_ptr(),
                                           1 if absmax.dtype == torch.float16 else 0, scale.data_ptr(),
                                           codebook.data_ptr(), k, out_f, in_features,
                                           0 if bias is None else bias.data_ptr(),
                                           0 if bias is None else DTYPE_CODE[bias.dtype], y.data_ptr(),
                                           torch.get_num_threads())
            if rc:
                check(rc, "gemv")
            return y
    # Any other M (prefill) or dtype: the bit-exact fp32 weight, then torch's fp32 matmul (what the reference
    # computes, without its slow decode).
    w = dequantize(packed, absmax, scale, codebook, k, in_features, torch.float32)
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def expert_linear(x, expert_ids, packed, absmax, scale, codebook, k, in_features):
    """Row r = x[r] @ W[expert_ids[r]]^T; ids outside [0, E) give zero rows."""
    fmt.check_k(k)
    _check_planes(packed, absmax, scale, k, in_features, x, expert_ids)
    N = x.shape[0]
    E, out_f = packed.shape[0], packed.shape[1]
    if N == 0:
        return x.new_zeros((0, out_f))
    if dispatch.expert_linear_uses_gemv(N, E, x.dtype):
        x, ids = x.contiguous(), expert_ids.to(dtype=torch.int64).contiguous()
        packed, absmax, scale = packed.contiguous(), absmax.contiguous(), scale.float().contiguous()
        cb = _cb(codebook, k)
        y = torch.empty((N, out_f), dtype=x.dtype)
        rc = library.lib.kbit_cpu_expert_gemv(x.data_ptr(), DTYPE_CODE[x.dtype], N, ids.data_ptr(), E,
                                              packed.data_ptr(), absmax.data_ptr(), _fp16(absmax), scale.data_ptr(),
                                              cb.data_ptr(), k, out_f, in_features, y.data_ptr(),
                                              torch.get_num_threads())
        check(rc, "expert gemv")
        return y
    # Many rows: one linear per expert present (the linear rule picks fused or dequantize + matmul by its rows).
    y = torch.zeros((N, out_f), dtype=x.dtype)
    for e, rows in reference.rows_by_expert(expert_ids, E):
        y[rows] = linear(x[rows], packed[e], absmax[e], scale[e], codebook, k, in_features).to(x.dtype)
    return y
