"""The CUDA implementations of the kbit ops: thin ctypes calls into libkbit_cuda (kbit_hf/backends/cuda/library.py).

Every launch goes on torch's current stream of the tensors' device; the library never allocates or synchronises, so
the linear / dequantize paths can be captured in CUDA graphs (the GEMM's permuted x and k-split workspace come from
torch's caching allocator). Which path runs is decided in dispatch.py; `dequantize_out` and `linear_out` write into
given tensors without allocating, `gemm_out` into a given output, and `linear_out` can force one tiled GEMV variant,
for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from ... import format as fmt
from .. import reference
from . import dispatch, library
from .library import DTYPE_CODE, check
from .tiled import is_tiled

# the tiled GEMV variants linear_out can force (csrc/kbit_api.h, KBIT_TILED_*): per-warp ranges; batched, or batched
# with 1, 2 or 4 warps per tile; "...k2": batched with the k range split over clusters of 2 CTAs
TILED_KERNELS = {"auto": 0, "range": 1, "batch": 2, "batch1": 3, "batch2": 4, "batch4": 5}
TILED_KERNELS.update({f"{name}k2": code + 8 for name, code in tuple(TILED_KERNELS.items()) if code >= 2})
GEMM_MAX_ROWS = 65535 * 128  # the tiled GEMM's grid: at most 65535 CTA rows of 128 tokens

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream  # int handle of the current stream of a device index
except AttributeError:  # pragma: no cover - older/newer torch
    _raw_stream = None


def _stream_of_index(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def stream_of(device: torch.device) -> int:
    """The int handle of torch's current stream on `device` (every launch goes on it)."""
    return _stream_of_index(device.index if device.index is not None else torch.cuda.current_device())


_MULTI = None
_ON_CURRENT_DEVICE = contextlib.nullcontext()  # one GPU: the launch needs no device switch


def _multi_gpu() -> bool:
    global _MULTI
    if _MULTI is None:
        _MULTI = torch.cuda.device_count() > 1
    return _MULTI


class on_device:
    """Make `device` current for the launch when it is not already (multi-GPU); free in the common case."""

    __slots__ = ("idx", "prev")

    def __init__(self, device: torch.device):
        self.idx = device.index

    def __enter__(self):
        self.prev = None
        if self.idx is not None and _multi_gpu():
            cur = torch.cuda.current_device()
            if cur != self.idx:
                self.prev = cur
                torch.cuda.set_device(self.idx)

    def __exit__(self, *exc):
        if self.prev is not None:
            torch.cuda.set_device(self.prev)


def _absmax_fp16(absmax: torch.Tensor) -> int:
    return 1 if fmt.absmax_format_of(absmax) == "fp16" else 0


def _cb(codebook: torch.Tensor, device: torch.device, k: int) -> torch.Tensor:
    if codebook.device != device or codebook.dtype != torch.float32 or not codebook.is_contiguous():
        codebook = codebook.to(device=device, dtype=torch.float32).contiguous()
    fmt.check_codebook_size(codebook, k)
    return codebook


def _need(what: str, *tensors) -> None:
    """The entry points below pass raw device pointers to the library: it must be loaded, and the tensors must live
    on one CUDA device (None entries are skipped)."""
    if library.lib is None:
        raise RuntimeError(f"kbit CUDA {what}: the compiled CUDA library is not loaded ({library.load_error()}); "
                           "the torch.ops.kbit ops fall back to the reference, or reinstall with a CUDA toolkit")
    dev = tensors[0].device
    for t in tensors:
        if t is not None and (t.device.type != "cuda" or t.device != dev):
            raise ValueError(f"kbit CUDA {what}: every tensor must be on one CUDA device; got {t.device} and {dev}")


def _check_shapes(packed, absmax, scale, k, in_features):
    if is_tiled(packed):  # uint8 [out, in * k / 8] (tiled.py)
        out, words = packed.shape[-2:]
        if (packed.dim() != 2 or words * 8 != in_features * k or tuple(absmax.shape) != (out, in_features // 32)
                or scale.numel() != 1 or not dispatch.tiled_layout_fits(out, in_features, k, "e4m4")
                or absmax.dtype != torch.uint8):
            raise ValueError(f"not a tiled K = {k} weight for in_features={in_features}: packed "
                             f"{tuple(packed.shape)}, absmax {absmax.dtype} {tuple(absmax.shape)}")
        return
    fmt.check_fits(packed, absmax, scale, k, in_features)


# ---- quantize / dequantize -------------------------------------------------------------------------------------

def quantize_out(weight, codebook, k, absmax_format, packed, absmax, scale):
    """Quantize `weight` [..., out, in] (fp32/fp16/bf16, CUDA) into preallocated packed / absmax / scale."""
    _need("quantize", weight, packed, absmax, scale)
    fmt.check_k(k)
    fmt.check_absmax_format(absmax_format)
    if weight.dtype not in DTYPE_CODE:
        weight = weight.float()
    weight = weight.contiguous()
    *lead, out, inp = weight.shape
    cb = _cb(codebook, weight.device, k)
    with on_device(weight.device):
        rc = library.lib.kbit_quantize(weight.data_ptr(), DTYPE_CODE[weight.dtype], math.prod(lead), out, inp,
                                       cb.data_ptr(), k, 1 if absmax_format == "fp16" else 0, packed.data_ptr(),
                                       absmax.data_ptr(), scale.data_ptr(), stream_of(weight.device))
    check(rc, "quantize")
    return packed, absmax, scale


def quantize(weight, codebook, k, absmax_format):
    if weight.dim() < 2 or 0 in weight.shape:
        raise ValueError(f"kbit quantizes matrices [..., out, in] with at least one element; got a tensor of shape "
                         f"{tuple(weight.shape)}")
    fmt.check_finite(weight)
    return quantize_out(weight, codebook, k, absmax_format,
                        *fmt.empty_quantized(tuple(weight.shape), k, absmax_format, weight.device))


def dequantize_out(packed, absmax, scale, codebook, k, in_features, out):
    """Dequantize into `out` [..., out_features, in_features] (fp32/fp16/bf16, contiguous)."""
    _need("dequantize", packed, absmax, scale, out)
    fmt.check_k(k)
    *lead, rows, _ = packed.shape
    dev = packed.device
    cb = _cb(codebook, dev, k)
    if not is_tiled(packed):
        _absmax_fp16(absmax)  # validates the block scales' dtype
    with on_device(dev):
        rc = _dequantize_call(packed, absmax, scale, cb, k, math.prod(lead), rows, in_features, out, stream_of(dev))
    check(rc, "dequantize")
    return out


def _dequantize_call(packed, absmax, scale, codebook, k, lead, rows, in_features, out, stream):
    """The one ctypes call of a dequantization into `out` (operands checked by the caller: hot path)."""
    if packed.dtype == torch.uint8:  # the tiled layout
        return library.lib.kbit_dequantize_tiled(packed.data_ptr(), absmax.data_ptr(), scale.data_ptr(),
                                                 codebook.data_ptr(), k, rows, in_features, out.data_ptr(),
                                                 DTYPE_CODE[out.dtype], stream)
    return library.lib.kbit_dequantize(packed.data_ptr(), absmax.data_ptr(), 1 if absmax.dtype == torch.float16 else 0,
                                       scale.data_ptr(), codebook.data_ptr(), k, lead, rows, in_features,
                                       out.data_ptr(), DTYPE_CODE[out.dtype], stream)


def dequantize(packed, absmax, scale, codebook, k, in_features, dtype=torch.float32):
    _check_shapes(packed, absmax, scale, k, in_features)
    packed, absmax, scale = packed.contiguous(), absmax.contiguous(), scale.contiguous()
    kernel_dtype = dtype if dtype in DTYPE_CODE else torch.float32  # other float dtypes: decode to fp32, then cast
    out = torch.empty((*packed.shape[:-1], in_features), dtype=kernel_dtype, device=packed.device)
    return dequantize_out(packed, absmax, scale, codebook, k, in_features, out).to(dtype)


# ---- linear ----------------------------------------------------------------------------------------------------

def _gemv_call(x, M, packed, absmax, scale, codebook, k, out_f, in_features, bias, y, stream, kernel=0):
    """The one ctypes call of the fused GEMV (x fp16/bf16, codebook fp32 on x's device; no checks: hot path)."""
    lib = library.lib
    if packed.dtype == torch.uint8:  # the tiled layout
        args = (x.data_ptr(), DTYPE_CODE[x.dtype], M, packed.data_ptr(), absmax.data_ptr(), scale.data_ptr(),
                codebook.data_ptr(), k, out_f, in_features, 0 if bias is None else bias.data_ptr(), y.data_ptr())
        if kernel:
            return lib.kbit_gemv_tiled_kernel(*args, kernel, stream)
        return lib.kbit_gemv_tiled(*args, stream)
    return lib.kbit_gemv(x.data_ptr(), DTYPE_CODE[x.dtype], M, packed.data_ptr(), absmax.data_ptr(),
                         1 if absmax.dtype == torch.float16 else 0, scale.data_ptr(), codebook.data_ptr(), k, out_f,
                         in_features, 0 if bias is None else bias.data_ptr(), y.data_ptr(), stream)


def linear_out(x, packed, absmax, scale, codebook, k, in_features, bias, out, tiled_kernel: str = "auto"):
    """Fused dequant-GEMV into `out` [M, out_features]: x [M, in] contiguous fp16/bf16, 1 <= M <= 64, bias None or
    x's dtype. No allocation, no synchronisation (CUDA-graph safe). A tiled weight needs an sm_90 device;
    `tiled_kernel` (a TILED_KERNELS name) forces one tiled GEMV variant (tests, benchmarks)."""
    _need("linear_out", x, packed, absmax, scale, bias, out)
    dev = x.device
    if is_tiled(packed):
        if not dispatch.tiled_gemv_runs_on(dev.index if dev.index is not None else torch.cuda.current_device()):
            raise RuntimeError(f"the tiled GEMV needs an sm_90 GPU; {dev} is not one (convert with ops.bit_planes)")
        if x.data_ptr() & 15:
            raise ValueError("the tiled GEMV reads x in 16-byte words: x must start at a 16-byte aligned address "
                             f"(its storage offset is {x.storage_offset()} elements); pass an aligned copy")
    if tiled_kernel not in TILED_KERNELS:
        raise ValueError(f"tiled_kernel: {tiled_kernel!r} is not one of {sorted(TILED_KERNELS)}")
    _absmax_fp16(absmax)  # validates the scale dtype
    with on_device(dev):
        rc = _gemv_call(x, x.shape[0], packed, absmax, scale, _cb(codebook, dev, k), k, packed.shape[0], in_features,
                        bias, out, stream_of(dev), TILED_KERNELS[tiled_kernel])
    check(rc, "gemv")
    return out


def _gemm_operands(name, x, packed, bias, out, in_features):
    """(M, out_features) after checking a GEMM's x, bias and out against the weight."""
    if x.dtype not in dispatch.GEMV_DTYPES or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"{name} takes fp16/bf16 x and a bias of x's dtype; got x {x.dtype}, bias "
                         f"{None if bias is None else bias.dtype}")
    M, out_f = x.shape[0], packed.shape[0]
    if x.dim() != 2 or x.shape[1] != in_features or tuple(out.shape) != (M, out_f) or out.dtype != x.dtype \
            or not out.is_contiguous():
        raise ValueError(f"{name}: x must be [M, {in_features}] and out a contiguous [M, {out_f}] of x's dtype; "
                         f"got x {tuple(x.shape)}, out {out.dtype} {tuple(out.shape)}")
    return M, out_f


def gemm_out(x, packed, absmax, scale, codebook, k, in_features, bias, out):
    """Tensor-core GEMM over a tiled weight into `out` [M, out_features]: x [M, in] fp16/bf16 (any M >= 1), bias
    None or x's dtype. Needs a compute capability 9.0 GPU. A workspace (x in the kernel's k order, and partial sums
    where the layer splits its k range) comes from torch's caching allocator: CUDA-graph safe."""
    _need("gemm_out", x, packed, absmax, scale, bias, out)
    _check_shapes(packed, absmax, scale, k, in_features)
    dev = x.device
    if not is_tiled(packed):
        raise ValueError("gemm_out needs a tiled weight (uint8 packed; see ops.device_layout)")
    if not dispatch.wgmma_runs_on(dev.index if dev.index is not None else torch.cuda.current_device()):
        raise RuntimeError(f"the tiled GEMM needs a compute capability 9.0 GPU; {dev} is not one")
    M, out_f = _gemm_operands("gemm_out", x, packed, bias, out, in_features)
    if not 1 <= M <= GEMM_MAX_ROWS:
        raise ValueError(f"gemm_out takes 1..{GEMM_MAX_ROWS} rows of x; got {M}")
    x = x.contiguous()
    if x.data_ptr() & 15:  # the library's k-order copy reads x in 16-byte words
        x = x.clone()
    target = out
    if out.data_ptr() & 15:  # the GEMM stores 16-byte chunks: an aligned buffer, copied into `out` after
        out = torch.empty_like(out)
    if bias is not None:
        bias = bias.contiguous()
    # every tensor whose pointer is passed stays referenced until the launch: a temporary freed before it could be
    # handed to the next allocation on the stream and overwritten first
    packed, absmax, scale, cb = packed.contiguous(), absmax.contiguous(), scale.contiguous(), _cb(codebook, dev, k)
    with on_device(dev):
        nbytes = _gemm_workspace(M, out_f, in_features, dev.index)
        rc = _gemm_call(x, M, packed, absmax, scale, cb, k, out_f, in_features, bias, out, nbytes, stream_of(dev))
    check(rc, "gemm")
    if target is not out:
        target.copy_(out)
    return target


# the bit-plane GEMM's launch shapes gemm_planes_out can force (csrc/kbit_api.h, kbit_gemm_planes_kernel): tokens per
# CTA, stages
PLANES_GEMM_SHAPES = {"auto": (0, 0), **{f"bn{bn}s{st}": (bn, st) for bn in (64, 128) for st in (3, 4)}}


def gemm_planes_out(x, packed, absmax, scale, codebook, k, in_features, bias, out, shape: str = "auto"):
    """Tensor-core GEMM over bit-plane weights into `out` [M, out_features] (mma.sync; GPUs whose shared memory holds
    it, dispatch.planes_gemm_runs_on: sm_80, sm_90): x [M, in] fp16/bf16 with in % 8 == 0, bias None or x's dtype.
    Where the layer splits its k range, a workspace is allocated (from torch's caching allocator: CUDA-graph safe).
    `shape` (a PLANES_GEMM_SHAPES name) forces the tokens per CTA and the stages (tests, benchmarks)."""
    _need("gemm_planes_out", x, packed, absmax, scale, bias, out)
    _check_shapes(packed, absmax, scale, k, in_features)
    dev = x.device
    if is_tiled(packed):
        raise ValueError("gemm_planes_out takes bit-plane weights (uint32 packed); this one is tiled (gemm_out)")
    M, out_f = _gemm_operands("gemm_planes_out", x, packed, bias, out, in_features)
    if in_features % 8:
        raise ValueError(f"gemm_planes_out reads x in 16-byte words: in_features must be a multiple of 8, got "
                         f"{in_features}")
    if shape not in PLANES_GEMM_SHAPES:
        raise ValueError(f"shape: {shape!r} is not one of {sorted(PLANES_GEMM_SHAPES)}")
    if not x.is_contiguous() or x.data_ptr() & 15:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh allocation: 16-byte aligned
    if bias is not None:
        bias = bias.contiguous()
    # every tensor whose pointer is passed stays referenced until the launch (see gemm_out)
    packed, absmax, scale, cb = packed.contiguous(), absmax.contiguous(), scale.contiguous(), _cb(codebook, dev, k)
    bn, stages = PLANES_GEMM_SHAPES[shape]
    with on_device(dev):
        lib = library.lib
        nbytes = lib.kbit_gemm_planes_workspace(M, out_f, in_features, k, bn)
        if nbytes < 0:
            raise RuntimeError(f"kbit CUDA gemm: no bit-plane GEMM for {dev} (M={M}, {out_f} x {in_features}, k={k}, "
                               f"shape {shape}): operation not supported")
        ws = torch.empty(nbytes, dtype=torch.uint8, device=dev) if nbytes else None
        rc = lib.kbit_gemm_planes_kernel(x.data_ptr(), DTYPE_CODE[x.dtype], M, packed.data_ptr(), absmax.data_ptr(),
                                         _absmax_fp16(absmax), scale.data_ptr(), cb.data_ptr(), k, out_f, in_features,
                                         0 if bias is None else bias.data_ptr(), out.data_ptr(),
                                         0 if ws is None else ws.data_ptr(), nbytes, bn, stages, stream_of(dev))
    check(rc, "gemm (bit planes)")
    return out


_KSET = frozenset(fmt.SUPPORTED_K)
# (M, out, in, device) -> bytes; bounded: KbitLinear's calls have M <= dispatch.GEMM_MAX_M
_GEMM_WORKSPACE: dict[tuple[int, int, int, int], int] = {}


def _gemm_workspace(M: int, out_f: int, in_features: int, device_index: int) -> int:
    """The tiled GEMM's workspace bytes for M rows of a layer on one GPU, cached."""
    key = (M, out_f, in_features, device_index)
    nbytes = _GEMM_WORKSPACE.get(key)
    if nbytes is None:
        with torch.cuda.device(device_index):
            nbytes = library.lib.kbit_gemm_tiled_workspace(M, out_f, in_features)
        if nbytes < 0:
            raise RuntimeError(f"kbit CUDA gemm: the library has no tiled GEMM for cuda:{device_index} (M={M}, "
                               f"{out_f} x {in_features})")
        _GEMM_WORKSPACE[key] = nbytes
    return nbytes


def _gemm_call(x, M, packed, absmax, scale, codebook, k, out_f, in_features, bias, y, nbytes, stream):
    """The one ctypes call of the tiled GEMM into `y` (operands checked by the caller: hot path), with a workspace of
    `nbytes` from torch's caching allocator (x in the kernel's k order, any partial sums), referenced until the
    launch."""
    ws = x.new_empty((nbytes,), dtype=torch.uint8)
    return library.lib.kbit_gemm_tiled(x.data_ptr(), DTYPE_CODE[x.dtype], M, packed.data_ptr(), absmax.data_ptr(),
                                       scale.data_ptr(), codebook.data_ptr(), k, out_f, in_features,
                                       0 if bias is None else bias.data_ptr(), y.data_ptr(), ws.data_ptr(), nbytes,
                                       stream)


def _lean_call(x, M, packed, absmax, scale, codebook, k, out_f, in_features, bias, tiled, di, y_shape):
    """One library call for an eager linear whose operands are checked (see linear): the fused GEMV, the tiled GEMM
    or, where dispatch.py picks neither, the dequantization before cuBLAS. Returns (rc, y, what): y of `y_shape`
    (M rows of out_f) for the kernels, the dequantized weight for cuBLAS."""
    stream = _stream_of_index(di)
    if dispatch.linear_uses_gemv(M, x.dtype):
        y = x.new_empty(y_shape)
        return _gemv_call(x, M, packed, absmax, scale, codebook, k, out_f, in_features, bias, y, stream), y, "gemv"
    if tiled and dispatch.linear_uses_gemm(M, x.dtype, out_f, in_features) and dispatch.wgmma_runs_on(di):
        y = x.new_empty(y_shape)  # a fresh allocation: 16-byte aligned, as the GEMM's stores need
        nbytes = _gemm_workspace(M, out_f, in_features, di)
        return _gemm_call(x, M, packed, absmax, scale, codebook, k, out_f, in_features, bias, y, nbytes, stream), \
            y, "gemm"
    w = x.new_empty((out_f, in_features))
    return _dequantize_call(packed, absmax, scale, codebook, k, 1, out_f, in_features, w, stream), w, "dequantize"


def linear(x, packed, absmax, scale, codebook, k, in_features, bias=None):
    """y = x @ W^T + bias on CUDA: the fused GEMV where dispatch.linear_uses_gemv, the tiled GEMM where
    dispatch.linear_uses_gemm (tiled weights), the bit-plane GEMM where dispatch.linear_uses_planes_gemm (bit-plane
    weights), else dequantize + cuBLAS."""
    # Lean eager path: each Python operation here is host time per layer and call, and an eager prefill of a few
    # hundred tokens is bound by it (the GPU idles between launches), so the common case (fp16 / bf16 x, a 2-D
    # weight of the stored shape on x's device) checks with plain comparisons and makes one library call; anything
    # else takes the checked path below.
    if library.lib is not None and x.is_cuda and k in _KSET and packed.dim() == 2 and x.dtype in dispatch.GEMV_DTYPES:
        shape = x.shape
        M = x.numel() // in_features if in_features > 0 else 0
        tiled = packed.dtype == torch.uint8
        di = x.get_device()
        if shape[-1] == in_features and M > 0 and packed.get_device() == di and absmax.get_device() == di \
                and scale.get_device() == di and (bias is None or (bias.dtype == x.dtype and bias.get_device() == di)) \
                and (not tiled or dispatch.tiled_gemv_runs_on(di)) \
                and (tiled or not dispatch.linear_uses_planes_gemm(M, x.dtype, in_features, k)):
            out_f = packed.shape[0]
            if packed.shape[1] != ((in_features * k) >> 3 if tiled else ((in_features + 31) >> 5) * k) \
                    or absmax.shape != (out_f, (in_features + 31) >> 5) or scale.numel() != 1 \
                    or (absmax.dtype != torch.uint8 and (tiled or absmax.dtype != torch.float16)):
                _check_shapes(packed, absmax, scale, k, in_features)
                _absmax_fp16(absmax)
            if bias is not None and bias.shape != (out_f,):
                raise ValueError(f"kbit linear: bias has shape {tuple(bias.shape)}, the layer has {out_f} outputs")
            if not x.is_contiguous():
                x = x.contiguous()
            if tiled and x.data_ptr() & 15:  # the tiled kernels read x in 16-byte words: an aligned copy
                x = x.clone()
            if not (packed.is_contiguous() and absmax.is_contiguous()):
                packed, absmax = packed.contiguous(), absmax.contiguous()
            if not codebook.is_cuda or codebook.dtype != torch.float32 or codebook.get_device() != di \
                    or codebook.numel() != 1 << k:
                codebook = _cb(codebook, x.device, k)
            if bias is not None and not bias.is_contiguous():
                bias = bias.contiguous()
            with on_device(x.device) if _multi_gpu() else _ON_CURRENT_DEVICE:
                rc, y, what = _lean_call(x, M, packed, absmax, scale, codebook, k, out_f, in_features, bias, tiled,
                                         di, (*shape[:-1], out_f))
            if rc:
                check(rc, what)
            if what == "dequantize":  # cuBLAS with fp32 accumulation on the weight in x's dtype
                return F.linear(x, y, bias)
            return y
    _need("linear", x, packed, absmax, scale, bias)
    M = x.numel() // in_features if in_features > 0 else 0
    if x.shape[-1] == in_features and (bias is None or bias.dtype == x.dtype):
        if is_tiled(packed):
            gemm = (gemm_out if dispatch.linear_uses_gemm(M, x.dtype, packed.shape[0], in_features)
                    and dispatch.wgmma_runs_on(x.get_device()) else None)
        else:
            gemm = (gemm_planes_out if dispatch.linear_uses_planes_gemm(M, x.dtype, in_features, k)
                    and dispatch.planes_gemm_runs_on(x.get_device(), k) else None)
        if gemm is not None:
            y = x.new_empty((M, packed.shape[0]))
            return gemm(x.reshape(M, in_features), packed, absmax, scale, codebook, k, in_features, bias,
                        y).reshape(*x.shape[:-1], -1)
    # Any other M (prefill) or dtype: dequantize on the GPU, then cuBLAS with fp32 accumulation. fp16/bf16
    # activations use a weight in their own dtype (the tensor-core path); fp32 activations a fp32 weight.
    wdtype = x.dtype if x.dtype in dispatch.GEMV_DTYPES else torch.float32
    w = dequantize(packed, absmax, scale, codebook, k, in_features, wdtype)
    if x.dtype == wdtype:
        return F.linear(x, w, None if bias is None else bias.to(wdtype))
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


EXPERT_KERNELS = {"per_row": 1, "grouped": 2}  # csrc/kbit_api.h KBIT_EXPERT_* (0: the library's choice)


def expert_linear(x, expert_ids, packed, absmax, scale, codebook, k, in_features, kernel: str = "auto"):
    """Row r = x[r] @ W[expert_ids[r]]^T; ids outside [0, E) give zero rows. `kernel` forces a path (tests,
    benchmarks): "per_row" / "grouped" (the library's GEMV kernels), "gemm" (its grouped tensor-core GEMM),
    "grouped_mm", "loop"; "auto": dispatch.py's choice, and the library's between its GEMV kernels."""
    _need("expert_linear", x, packed, absmax, scale)
    N = x.shape[0]
    E, out_f = packed.shape[0], packed.shape[1]
    fmt.check_k(k)
    if N == 0:
        return x.new_zeros((0, out_f))
    if kernel not in ("auto", "gemm", "grouped_mm", "loop", *EXPERT_KERNELS):
        raise ValueError(
            f"expert_linear: kernel must be auto, per_row, grouped, gemm, grouped_mm or loop, got {kernel!r}")
    path = kernel
    if kernel == "auto":
        path = dispatch.expert_linear_path(N, E, out_f, in_features, x.dtype, x.get_device())
    elif kernel in EXPERT_KERNELS:
        path = "kernel"
    if path == "grouped_mm":
        return _expert_grouped_mm(x, expert_ids, packed, absmax, scale, codebook, k, in_features)
    if path == "loop":
        return _expert_loop(x, expert_ids, packed, absmax, scale, codebook, k, in_features)
    if path == "gemm" and (x.dtype not in dispatch.GEMV_DTYPES or not dispatch.expert_gemm_fits(in_features)
                           or not dispatch.wgmma_runs_on(x.get_device())):
        raise ValueError(f"expert_linear: the expert GEMM takes fp16 / bf16 x, in_features a multiple of 64 and a "
                         f"compute capability 9.0 GPU; got {x.dtype}, in_features={in_features} on {x.device}")
    _check_shapes(packed, absmax, scale, k, in_features)
    x = x.contiguous()
    dev = x.device
    ids = expert_ids.to(device=dev, dtype=torch.int64).contiguous()
    y = torch.empty((N, out_f), dtype=x.dtype, device=dev)
    # the library's workspace: the rows sorted by expert (and, for the GEMM, their activations in that order)
    ws_bytes = (library.lib.kbit_expert_gemm_workspace(N, E, in_features) if path == "gemm"
                else library.lib.kbit_expert_gemv_workspace(N, E))
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)
    # referenced until the launch (see gemm_out)
    packed, absmax, scale, cb = packed.contiguous(), absmax.contiguous(), scale.contiguous(), _cb(codebook, dev, k)
    args = (x.data_ptr(), DTYPE_CODE[x.dtype], N, ids.data_ptr(), E, packed.data_ptr(), absmax.data_ptr(),
            _absmax_fp16(absmax), scale.data_ptr(), cb.data_ptr(), k, out_f, in_features, y.data_ptr(), ws.data_ptr(),
            ws_bytes)
    with on_device(dev):
        if path == "gemm":
            rc = library.lib.kbit_expert_gemm(*args, stream_of(dev))
        else:
            rc = library.lib.kbit_expert_gemv_kernel(*args, EXPERT_KERNELS.get(kernel, 0), stream_of(dev))
    check(rc, "expert gemm" if path == "gemm" else "expert gemv")
    return y


MOE_GATES = {"silu": 1, "clamped": 2}  # csrc/kbit_api.h KBIT_GATE_*


def moe_experts_out(x, top_k_index, top_k_weights, gate_up: tuple, gate_up_bias, down: tuple, down_bias, k: int,
                    gate: str, alpha: float, limit: float, h, y):
    """The fused experts block (ops.moe_experts) into given tensors: h [T * top_k, I] (the gated activations), y [T,
    H_out], both x's dtype. x [T, H] fp16 / bf16; gate_up / down: (packed, absmax, scale, codebook) in bit planes.
    Two library kernels, no allocation, no synchronisation (CUDA-graph safe)."""
    gu_p, gu_a, gu_s, gu_cb = gate_up
    d_p, d_a, d_s, d_cb = down
    _need("moe_experts", x, top_k_index, top_k_weights, gu_p, gu_a, gu_s, gate_up_bias, d_p, d_a, d_s, down_bias, h,
          y)
    fmt.check_k(k)
    if x.dtype not in dispatch.GEMV_DTYPES:
        raise ValueError(f"moe_experts: the fused kernels take fp16 / bf16 activations, got {x.dtype}")
    if gate not in MOE_GATES:
        raise ValueError(f"moe_experts: gate must be one of {sorted(MOE_GATES)}, got {gate!r}")
    T, top_k = top_k_index.shape
    E, two_i = gu_p.shape[0], gu_p.shape[1]
    hidden, inter, out_f = x.shape[-1], two_i // 2, d_p.shape[1]
    _check_shapes(gu_p, gu_a, gu_s, k, hidden)
    _check_shapes(d_p, d_a, d_s, k, inter)
    if gu_p.dim() != 3 or d_p.dim() != 3 or d_p.shape[0] != E or two_i % 2:
        raise ValueError(f"moe_experts: gate_up {tuple(gu_p.shape)} and down {tuple(d_p.shape)} must be [E, 2I, .] "
                         "and [E, H_out, .] bit planes of the same E")
    want = {"x": (x, (T, hidden)), "top_k_weights": (top_k_weights, (T, top_k)), "h": (h, (T * top_k, inter)),
            "y": (y, (T, out_f)), "gate_up_bias": (gate_up_bias, (E, two_i)), "down_bias": (down_bias, (E, out_f))}
    for name, (t, shape) in want.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"moe_experts: {name} has shape {tuple(t.shape)}, expected {shape}")
    for name, t in (("h", h), ("y", y)):
        if t.dtype != x.dtype or not t.is_contiguous():
            raise ValueError(f"moe_experts: {name} must be a contiguous {x.dtype} tensor, got {t.dtype}")
    dev = x.device
    x = x.contiguous()
    ids = top_k_index.to(device=dev, dtype=torch.int64).contiguous()
    w = top_k_weights.to(device=dev, dtype=x.dtype).contiguous()
    gu_b = None if gate_up_bias is None else gate_up_bias.to(x.dtype).contiguous()
    d_b = None if down_bias is None else down_bias.to(x.dtype).contiguous()
    gu_p, gu_a, gu_s, d_p, d_a, d_s = (t.contiguous() for t in (gu_p, gu_a, gu_s, d_p, d_a, d_s))
    gu_cb, d_cb = _cb(gu_cb, dev, k), _cb(d_cb, dev, k)
    code, stream = DTYPE_CODE[x.dtype], stream_of(dev)
    with on_device(dev):
        rc = library.lib.kbit_moe_gate_up(x.data_ptr(), code, T, top_k, ids.data_ptr(), E, gu_p.data_ptr(),
                                          gu_a.data_ptr(), _absmax_fp16(gu_a), gu_s.data_ptr(), gu_cb.data_ptr(), k,
                                          two_i, hidden, 0 if gu_b is None else gu_b.data_ptr(), MOE_GATES[gate],
                                          float(alpha), float(limit), h.data_ptr(), stream)
        check(rc, "moe gate_up")
        rc = library.lib.kbit_moe_down(h.data_ptr(), code, T, top_k, ids.data_ptr(), w.data_ptr(), E, d_p.data_ptr(),
                                       d_a.data_ptr(), _absmax_fp16(d_a), d_s.data_ptr(), d_cb.data_ptr(), k, out_f,
                                       inter, 0 if d_b is None else d_b.data_ptr(), y.data_ptr(), stream)
    check(rc, "moe down")
    return y


def moe_experts(x, top_k_index, top_k_weights, gu_packed, gu_absmax, gu_scale, gu_codebook, gate_up_bias, d_packed,
                d_absmax, d_scale, d_codebook, down_bias, k, gate, alpha, limit):
    """ops.moe_experts on CUDA: the two fused kernels for fp16 / bf16 x, the reference otherwise."""
    gate_up, down = (gu_packed, gu_absmax, gu_scale, gu_codebook), (d_packed, d_absmax, d_scale, d_codebook)
    if x.dtype not in dispatch.GEMV_DTYPES:
        return reference.moe_experts(x, top_k_index, top_k_weights, gate_up, gate_up_bias, down, down_bias, k, gate,
                                     alpha, limit)
    T, top_k = top_k_index.shape
    h = torch.empty((T * top_k, gu_packed.shape[1] // 2), dtype=x.dtype, device=x.device)
    y = torch.empty((T, d_packed.shape[1]), dtype=x.dtype, device=x.device)
    return moe_experts_out(x, top_k_index, top_k_weights, gate_up, gate_up_bias, down, down_bias, k, gate, alpha,
                           limit, h, y)


ROUTER_MODES = {"softmax_topk": 1, "topk_softmax": 2}  # csrc/kbit_api.h KBIT_ROUTER_*
ROUTER_MAX_E = 2048  # KBIT_ROUTER_MAX_E: each warp holds its token's logits in shared memory


def router_topk(logits, k, mode, renorm, out_dtype):
    """ops.router_topk on CUDA: one library kernel (a warp per token) for up to ROUTER_MAX_E experts and k <= 32,
    the reference otherwise."""
    E = logits.shape[-1]
    if (mode not in ROUTER_MODES or not 1 <= k <= min(E, 32) or E > ROUTER_MAX_E or logits.dtype not in DTYPE_CODE
            or out_dtype not in DTYPE_CODE):
        return reference.router_topk(logits, k, mode, renorm, out_dtype)
    _need("router_topk", logits)
    x = logits.contiguous()
    tokens = x.numel() // E
    ids = torch.empty((*x.shape[:-1], k), dtype=torch.int64, device=x.device)
    w = torch.empty((*x.shape[:-1], k), dtype=out_dtype, device=x.device)
    with on_device(x.device):
        rc = library.lib.kbit_router_topk(x.data_ptr(), DTYPE_CODE[x.dtype], tokens, E, k, ROUTER_MODES[mode],
                                          int(renorm), ids.data_ptr(), w.data_ptr(), DTYPE_CODE[out_dtype],
                                          stream_of(x.device))
    check(rc, "router top-k")
    return w, ids


def _expert_grouped_mm(x, expert_ids, packed, absmax, scale, codebook, k, in_features):
    """Every expert dequantized to x's dtype, the rows sorted by expert on the device (ids outside [0, E) last, their
    rows zero), one torch._grouped_mm. No host sync."""
    E = packed.shape[0]
    ids = expert_ids.to(x.device)
    valid = (ids >= 0) & (ids < E)
    sorted_ids, order = torch.where(valid, ids, E).sort()
    ends = torch.searchsorted(sorted_ids, torch.arange(1, E + 1, device=x.device, dtype=sorted_ids.dtype))
    w = dequantize(packed, absmax, scale, codebook, k, in_features, x.dtype)
    ys = torch._grouped_mm(x[order], w.transpose(-2, -1), offs=ends.to(torch.int32))
    y = torch.empty_like(ys)
    y[order] = torch.where((sorted_ids < E).unsqueeze(-1), ys, 0)
    return y


def _expert_loop(x, expert_ids, packed, absmax, scale, codebook, k, in_features):
    """One linear per expert present (one host sync)."""
    y = torch.zeros((x.shape[0], packed.shape[1]), dtype=x.dtype, device=x.device)
    for e, rows in reference.rows_by_expert(expert_ids, packed.shape[0]):
        y[rows] = linear(x[rows], packed[e], absmax[e], scale[e], codebook, k, in_features).to(x.dtype)
    return y
