"""CUDA backend: loads libkbit_cuda.so (plain C ABI, see csrc/kbit_api.h) with ctypes and registers its kernels as
the "cuda" implementations of the torch.ops.kbit.* custom ops.

- Library found: `torch.library.register_kernel(op, "cuda", ...)` for quantize / dequantize / linear /
  expert_linear, plus eager fast paths (`linear`, `expert_linear`) that kbit_hf.ops.linear_forward calls directly
  (a ctypes launch skips the custom-op dispatcher's Python cost), and allocation-free `*_out` variants.
- Library missing (CPU-only install, no CUDA toolkit at build time): importing this module never fails; the CUDA
  kernels registered are the reference ops, behind one clear warning the first time a CUDA tensor arrives.

Every launch goes on torch's current stream of the tensor's device; the library never allocates or synchronises,
so the linear / dequantize paths can be captured in CUDA graphs. The library is looked up at $KBIT_CUDA_LIB, then
kbit_hf/_lib/libkbit_cuda.so.
"""

from __future__ import annotations

import ctypes
import math
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from . import format as fmt
from . import ops as _ops
from . import reference

__all__ = [
    "available",
    "load_error",
    "library_path",
    "quantize",
    "quantize_out",
    "dequantize",
    "dequantize_out",
    "linear",
    "linear_out",
    "expert_linear",
    "GEMV_MAX_M",
    "EXPERT_GEMV_MAX_N",
    "TILED_KERNELS",
    "TILED_MIN_NUMEL",
    "tiled_supported",
    "holds_tiled",
    "tile",
    "untile",
]

GEMV_MAX_M = 64  # the fused dequant-GEMV handles up to this many activation rows; more -> dequantize + cuBLAS
# csrc/kbit_quant.cu kbit_abi_version(); 2: kbit_gemv takes M <= 64; 3: the tiled layout; 4: kernel arg; 5: the tiled
# functions take k (K = 2 tiled); 6: K = 5 tiled; 7: K = 3 tiled; 8: the batched kernel's k split (KBIT_TILED_KS2);
# 9: the K = 4, 5 tiled layout's swizzled halves (format._swizzle_halves: a tiled tensor's bytes must match format.py's)
_ABI_VERSION = 9
# expert GEMV (one kernel, each row reads its expert's weights) up to this many rows; more -> per-expert matmuls
# after one host sync. A MoE prefill of 64 tokens x top-8 is 512 rows: the per-expert loop launches several kernels
# for each expert present and is launch-bound there, while re-reading an expert's weights per row mostly hits L2.
EXPERT_GEMV_MAX_N = 1024

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_lib = None
_load_error: str | None = None
_lib_path: str | None = None


def _candidates():
    env = os.environ.get("KBIT_CUDA_LIB")
    if env:
        yield Path(env)
    yield Path(__file__).resolve().parent / "_lib" / "libkbit_cuda.so"


def _load():
    global _lib, _load_error, _lib_path
    errors = []
    for path in _candidates():
        if not path.is_file():
            errors.append(f"{path}: not found")
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:  # e.g. no libcuda on this machine
            errors.append(f"{path}: {exc}")
            continue
        vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.kbit_abi_version.restype = i32
        lib.kbit_abi_version.argtypes = []
        lib.kbit_error_string.restype = ctypes.c_char_p
        lib.kbit_error_string.argtypes = [i32]
        for name, args in {
            "kbit_quantize": [vp, i32, i64, i64, i64, vp, i32, i32, vp, vp, vp, vp],
            "kbit_dequantize": [vp, vp, i32, vp, vp, i32, i64, i64, i64, vp, i32, vp],
            "kbit_gemv": [vp, i32, i64, vp, vp, i32, vp, vp, i32, i64, i64, vp, vp, vp],
            "kbit_expert_gemv": [vp, i32, i64, vp, i64, vp, vp, i32, vp, vp, i32, i64, i64, vp, vp],
            "kbit_tile": [vp, vp, i32, i64, i64, vp, vp, vp],
            "kbit_untile": [vp, vp, i32, i64, i64, vp, vp, vp],
            "kbit_dequantize_tiled": [vp, vp, vp, vp, i32, i64, i64, vp, i32, vp],
            "kbit_gemv_tiled": [vp, i32, i64, vp, vp, vp, vp, i32, i64, i64, vp, vp, i32, vp],
        }.items():
            fn = getattr(lib, name)
            fn.restype = i32
            fn.argtypes = args
        if lib.kbit_abi_version() != _ABI_VERSION:
            errors.append(f"{path}: ABI version {lib.kbit_abi_version()} != {_ABI_VERSION} (rebuild the package)")
            continue
        _lib, _lib_path = lib, str(path)
        return
    _load_error = "; ".join(errors)


try:
    _load()
except Exception as exc:  # never let a broken library break `import kbit_hf`
    _lib, _load_error = None, f"{type(exc).__name__}: {exc}"


def available() -> bool:
    """True when the compiled CUDA library was loaded (a GPU may still be absent)."""
    return _lib is not None


def load_error() -> str | None:
    return _load_error


def library_path() -> str | None:
    return _lib_path


# ---------------------------------------------------------------------------------------------------------------
# helpers

try:
    _raw_stream = torch._C._cuda_getCurrentRawStream  # int handle of the current stream of a device index
except AttributeError:  # pragma: no cover - older/newer torch
    _raw_stream = None


def _stream_of(index: int) -> int:
    """The int handle of the current stream of CUDA device `index` (every launch goes on it)."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _stream(device: torch.device) -> int:
    return _stream_of(device.index if device.index is not None else torch.cuda.current_device())


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = _lib.kbit_error_string(rc).decode(errors="replace")
        raise RuntimeError(f"kbit CUDA {what} failed: {msg} (cudaError {rc})")


_MULTI = None


def _multi_gpu() -> bool:
    global _MULTI
    if _MULTI is None:
        _MULTI = torch.cuda.device_count() > 1
    return _MULTI


class _on_device:
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
    if absmax.dtype == torch.uint8:
        return 0
    if absmax.dtype == torch.float16:
        return 1
    raise ValueError(f"absmax tensor has dtype {absmax.dtype}; expected uint8 (e4m4) or float16 (fp16)")


def _cb(codebook: torch.Tensor, device: torch.device, k: int) -> torch.Tensor:
    if codebook.device != device or codebook.dtype != torch.float32 or not codebook.is_contiguous():
        codebook = codebook.to(device=device, dtype=torch.float32).contiguous()
    fmt.check_codebook_size(codebook, k)
    return codebook


def _need(what: str, *tensors) -> None:
    """The entry points below pass raw device pointers to the library: it must be loaded, and the tensors must live
    on one CUDA device (None entries are skipped)."""
    if _lib is None:
        raise RuntimeError(f"kbit_hf.cuda_backend.{what}: the compiled CUDA library is not loaded ({_load_error}); "
                           "the torch.ops.kbit ops fall back to the reference, or reinstall with a CUDA toolkit")
    dev = tensors[0].device
    for t in tensors:
        if t is not None and (t.device.type != "cuda" or t.device != dev):
            raise ValueError(f"kbit_hf.cuda_backend.{what}: every tensor must be on one CUDA device; got {t.device} "
                             f"and {dev}")


def _check_shapes(packed, absmax, scale, k, in_features):
    *lead, out, words = packed.shape
    nb = fmt.n_blocks(in_features)
    if fmt.is_tiled(packed):  # uint8 [out, in * k / 8] (format.tile)
        if (lead or words * 8 != in_features * k or tuple(absmax.shape) != (out, nb) or scale.numel() != 1
                or not fmt.tileable(out, in_features, k, "e4m4") or absmax.dtype != torch.uint8):
            raise ValueError(f"not a tiled K = {k} weight for in_features={in_features}: packed "
                             f"{tuple(packed.shape)}, absmax {absmax.dtype} {tuple(absmax.shape)}")
        return
    if words != nb * k or tuple(absmax.shape) != (*lead, out, nb) or tuple(scale.shape) != tuple(lead):
        raise ValueError(
            f"kbit tensors do not fit together for k={k}, in_features={in_features}: packed {tuple(packed.shape)}, "
            f"absmax {tuple(absmax.shape)}, scale {tuple(scale.shape)}"
        )


# ---------------------------------------------------------------------------------------------------------------
# allocation-free entry points (the library writes into the given tensors)


# ---------------------------------------------------------------------------------------------------------------
# the tiled layout of large K = 2..5 Linear weights (format.tile; csrc/kbit_tiled.cu)

# KbitLinear tiles a weight of K bits with at least TILED_MIN_NUMEL[K] elements. Measured against the bit planes
# (H100, fifteenth session, docs/results/small_layers): 4096 x 4096 tiled is 1.04-1.19x faster at M = 1..8 for K = 3,
# 4 and 1.00-1.42x at every M = 1..64 for K = 5, K = 3 losing 5-13% at M = 9..32; K = 2 loses (0.93x at M = 1). K = 5
# also gains on 2048 x 4096 and 3072 x 3072 (1.01-1.49x at M = 1..32); smaller layers, and K = 4 on 3072 x 3072
# (0.91x), keep the bit planes: a persistent kernel's start costs more than they take.
TILED_MIN_NUMEL = {2: 4096 * 4096 + 1, 3: 4096 * 4096, 4: 4096 * 4096, 5: 2048 * 4096}
_tiled_ok: dict[int, bool] = {}


def tiled_supported(device) -> bool:
    """The tiled GEMV runs on this device: the library is loaded, the GPU is sm_90 or newer (bulk async copies), and
    KBIT_TILED is not 0 (a benchmark knob: KbitLinear then keeps the bit planes)."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if _lib is None or device.type != "cuda":
        return False
    return _tiled_at(device.index if device.index is not None else torch.cuda.current_device())


def _tiled_at(index: int) -> bool:
    """tiled_supported for CUDA device `index`, the library loaded (cached per device: the GEMV's eager fast path
    asks on every call)."""
    ok = _tiled_ok.get(index)
    if ok is None:
        ok = torch.cuda.get_device_capability(index)[0] >= 9 and os.environ.get("KBIT_TILED", "1") != "0"
        _tiled_ok[index] = ok
    return ok


def holds_tiled(out_features, in_features, k, absmax_format, device) -> bool:
    """KbitLinear holds a weight of this shape and format tiled on this device: the layout fits, the weight is large
    enough to gain from it, and the device runs the tiled GEMV."""
    return (fmt.tileable(out_features, in_features, k, absmax_format)
            and out_features * in_features >= TILED_MIN_NUMEL[k] and tiled_supported(device))


def tile(packed, absmax, in_features, k):
    """format.tile, on the GPU for CUDA tensors (bitwise the same bytes)."""
    return _relayout("kbit_tile", fmt.tile, packed, absmax, in_features, k, to_tiled=True)


def untile(wt, at, in_features, k):
    """format.untile, on the GPU for CUDA tensors (bitwise the same bytes)."""
    return _relayout("kbit_untile", fmt.untile, wt, at, in_features, k, to_tiled=False)


def _relayout(kernel, reference_fn, w, a, in_features, k, to_tiled):
    """Bit planes (uint32 [out, in / 32 * k]) <-> tiled (uint8 [out, in * k / 8]). CPU tensors, and what the layout
    cannot hold, go to the reference (which raises the error that names the problem)."""
    out = w.shape[0]
    planes, tiled = (torch.uint32, in_features // 32 * k), (torch.uint8, in_features * k // 8)
    src, dst = (planes, tiled) if to_tiled else (tiled, planes)
    if (_lib is None or not w.is_cuda or w.dtype != src[0] or a.dtype != torch.uint8
            or tuple(w.shape) != (out, src[1]) or tuple(a.shape) != (out, in_features // 32)
            or not fmt.tileable(out, in_features, k, "e4m4")):
        return reference_fn(w, a, in_features, k)
    kernel = getattr(_lib, kernel)
    w, a = w.contiguous(), a.contiguous()
    w2 = torch.empty((out, dst[1]), dtype=dst[0], device=w.device)
    a2 = torch.empty_like(a)
    with _on_device(w.device):
        rc = kernel(w.data_ptr(), a.data_ptr(), k, out, in_features, w2.data_ptr(), a2.data_ptr(), _stream(w.device))
    _check(rc, kernel.__name__)
    return w2, a2


def quantize_out(weight, codebook, k, absmax_format, packed, absmax, scale):
    """Quantize `weight` [..., out, in] (fp32/fp16/bf16, CUDA) into preallocated packed / absmax / scale."""
    _need("quantize", weight, packed, absmax, scale)
    fmt.check_k(k)
    if weight.dtype not in _DTYPE_CODE:
        weight = weight.float()
    weight = weight.contiguous()
    *lead, out, inp = weight.shape
    E = math.prod(lead)
    fmt.check_absmax_format(absmax_format)
    fp16 = 1 if absmax_format == "fp16" else 0
    cb = _cb(codebook, weight.device, k)
    with _on_device(weight.device):
        rc = _lib.kbit_quantize(weight.data_ptr(), _DTYPE_CODE[weight.dtype], E, out, inp, cb.data_ptr(), k, fp16,
                                packed.data_ptr(), absmax.data_ptr(), scale.data_ptr(), _stream(weight.device))
    _check(rc, "quantize")
    return packed, absmax, scale


def quantize(weight, codebook, k, absmax_format):
    if weight.dim() < 2:
        raise ValueError(f"kbit quantizes matrices [..., out, in]; got a tensor of shape {tuple(weight.shape)}")
    fmt.check_finite(weight)
    return quantize_out(weight, codebook, k, absmax_format,
                        *fmt.empty_quantized(tuple(weight.shape), k, absmax_format, weight.device))


def dequantize_out(packed, absmax, scale, codebook, k, in_features, out):
    """Dequantize into `out` [..., out_features, in_features] (fp32/fp16/bf16, contiguous)."""
    _need("dequantize", packed, absmax, scale, out)
    fmt.check_k(k)
    *lead, rows, _ = packed.shape
    E = math.prod(lead)
    dev = packed.device
    if fmt.is_tiled(packed):
        with _on_device(dev):
            rc = _lib.kbit_dequantize_tiled(packed.data_ptr(), absmax.data_ptr(), scale.data_ptr(),
                                            _cb(codebook, dev, k).data_ptr(), k, rows, in_features, out.data_ptr(),
                                            _DTYPE_CODE[out.dtype], _stream(dev))
        _check(rc, "dequantize (tiled)")
        return out
    with _on_device(dev):
        rc = _lib.kbit_dequantize(packed.data_ptr(), absmax.data_ptr(), _absmax_fp16(absmax), scale.data_ptr(),
                                  _cb(codebook, dev, k).data_ptr(), k, E, rows, in_features, out.data_ptr(),
                                  _DTYPE_CODE[out.dtype], _stream(dev))
    _check(rc, "dequantize")
    return out


def dequantize(packed, absmax, scale, codebook, k, in_features, dtype=torch.float32):
    _check_shapes(packed, absmax, scale, k, in_features)
    packed, absmax, scale = packed.contiguous(), absmax.contiguous(), scale.contiguous()
    # other float dtypes: decode to fp32, then cast
    kernel_dtype = dtype if dtype in _DTYPE_CODE else torch.float32
    out = torch.empty((*packed.shape[:-1], in_features), dtype=kernel_dtype, device=packed.device)
    return dequantize_out(packed, absmax, scale, codebook, k, in_features, out).to(dtype)


def linear_out(x, packed, absmax, scale, codebook, k, in_features, bias, out):
    """Fused dequant-GEMV into `out` [M, out_features]: x [M, in] contiguous fp16/bf16, 1 <= M <= 64, bias None or
    x's dtype. No allocation, no synchronisation (CUDA-graph safe). A tiled weight needs an sm_90 device."""
    _need("linear_out", x, packed, absmax, scale, bias, out)
    dev = x.device
    if fmt.is_tiled(packed):
        if not tiled_supported(dev):
            raise RuntimeError(f"the tiled GEMV needs an sm_90 GPU; {dev} is not one (format.untile the weight)")
        if x.data_ptr() & 15:
            raise ValueError("the tiled GEMV reads x in 16-byte words: x must start at a 16-byte aligned address "
                             f"(its storage offset is {x.storage_offset()} elements); pass an aligned copy")
    _absmax_fp16(absmax)  # validates the scale dtype
    with _on_device(dev):
        rc = _gemv_call(x, x.shape[0], packed, absmax, scale, _cb(codebook, dev, k), k, packed.shape[0], in_features,
                        bias, out, _stream(dev))
    _check(rc, "gemv")
    return out


_GEMV_DTYPES = (torch.bfloat16, torch.float16)
# which tiled GEMV kernel runs (csrc/kbit_api.h, KBIT_TILED_*): the library's choice, or one forced by tests and
# benchmarks (per-warp ranges; batched, or batched with 1, 2 or 4 warps per tile; "...k2": batched with the k range
# split over clusters of 2 CTAs, KBIT_TILED_KS2)
TILED_KERNELS = {"auto": 0, "range": 1, "batch": 2, "batch1": 3, "batch2": 4, "batch4": 5}
TILED_KERNELS.update({f"{name}k2": code + 8 for name, code in tuple(TILED_KERNELS.items()) if code >= 2})
tiled_kernel = TILED_KERNELS["auto"]


def _gemv_call(x, M, packed, absmax, scale, codebook, k, out_f, in_features, bias, y, stream):
    """The one ctypes call of the fused GEMV (x fp16/bf16, codebook fp32 on x's device; no checks: hot path)."""
    if packed.dtype == torch.uint8:  # the tiled layout (format.tile)
        return _lib.kbit_gemv_tiled(x.data_ptr(), _DTYPE_CODE[x.dtype], M, packed.data_ptr(), absmax.data_ptr(),
                                    scale.data_ptr(), codebook.data_ptr(), k, out_f, in_features,
                                    0 if bias is None else bias.data_ptr(), y.data_ptr(), tiled_kernel, stream)
    return _lib.kbit_gemv(x.data_ptr(), _DTYPE_CODE[x.dtype], M, packed.data_ptr(), absmax.data_ptr(),
                          1 if absmax.dtype == torch.float16 else 0, scale.data_ptr(), codebook.data_ptr(), k, out_f,
                          in_features, 0 if bias is None else bias.data_ptr(), y.data_ptr(), stream)


_KSET = frozenset(fmt.SUPPORTED_K)


def linear(x, packed, absmax, scale, codebook, k, in_features, bias=None):
    """y = x @ W^T + bias on CUDA: fused GEMV for <= 64 rows (fp16/bf16), else dequantize + cuBLAS."""
    # Lean eager fast path: this is the per-token decode call, and each Python operation here is host time per layer
    # and token, so the common case (a contiguous x on a single GPU) takes the fewest.
    if _lib is not None and x.is_cuda and x.dtype in _GEMV_DTYPES and k in _KSET and packed.dim() == 2:
        shape = x.shape
        M = x.numel() // in_features if in_features > 0 else 0
        if shape[-1] == in_features and 0 < M <= GEMV_MAX_M and (bias is None or bias.dtype == x.dtype):
            tiled = packed.dtype == torch.uint8
            di = x.get_device()
            if not tiled or _tiled_at(di):
                out_f = packed.shape[0]
                if packed.shape[1] != ((in_features * k) >> 3 if tiled else ((in_features + 31) >> 5) * k):
                    _check_shapes(packed, absmax, scale, k, in_features)
                if not x.is_contiguous():
                    x = x.contiguous()
                if tiled and x.data_ptr() & 15:  # the tiled GEMVs read x in 16-byte words: an aligned copy
                    x = x.clone()
                if not (packed.is_contiguous() and absmax.is_contiguous()):
                    packed, absmax = packed.contiguous(), absmax.contiguous()
                if not codebook.is_cuda or codebook.dtype != torch.float32:
                    codebook = _cb(codebook, x.device, k)
                if bias is not None and not bias.is_contiguous():
                    bias = bias.contiguous()
                y = x.new_empty((*shape[:-1], out_f))
                if _multi_gpu():
                    with _on_device(x.device):
                        rc = _gemv_call(x, M, packed, absmax, scale, codebook, k, out_f, in_features, bias, y,
                                        _stream_of(di))
                else:
                    rc = _gemv_call(x, M, packed, absmax, scale, codebook, k, out_f, in_features, bias, y,
                                    _stream_of(di))
                if rc:
                    _check(rc, "gemv")
                return y
    _need("linear", x, packed, absmax, scale, bias)
    # Any other M (prefill) or dtype: dequantize on the GPU, then cuBLAS with fp32 accumulation. fp16/bf16
    # activations use a weight in their own dtype (the tensor-core path); fp32 activations a fp32 weight.
    wdtype = x.dtype if x.dtype in _GEMV_DTYPES else torch.float32
    w = dequantize(packed, absmax, scale, codebook, k, in_features, wdtype)
    if x.dtype == wdtype:
        return F.linear(x, w, None if bias is None else bias.to(wdtype))
    y = F.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def expert_linear(x, expert_ids, packed, absmax, scale, codebook, k, in_features):
    """Row r = x[r] @ W[expert_ids[r]]^T; ids outside [0, E) give zero rows."""
    _need("expert_linear", x, packed, absmax, scale)
    N = x.shape[0]
    E, out_f = packed.shape[0], packed.shape[1]
    fmt.check_k(k)
    if N == 0:
        return x.new_zeros((0, out_f))
    # One kernel, one weight read per row: up to EXPERT_GEMV_MAX_N rows, or any count while a CUDA graph is being
    # captured (the grouped path below needs a host sync, which capture forbids).
    per_row = N <= EXPERT_GEMV_MAX_N or (N <= 65535 and torch.cuda.is_current_stream_capturing())
    if per_row and x.dtype in _GEMV_DTYPES:
        _check_shapes(packed, absmax, scale, k, in_features)
        x = x.contiguous()
        ids = expert_ids.to(device=x.device, dtype=torch.int64).contiguous()
        y = torch.empty((N, out_f), dtype=x.dtype, device=x.device)
        dev = x.device
        with _on_device(dev):
            rc = _lib.kbit_expert_gemv(x.data_ptr(), _DTYPE_CODE[x.dtype], N, ids.data_ptr(), E,
                                       packed.contiguous().data_ptr(), absmax.contiguous().data_ptr(),
                                       _absmax_fp16(absmax), scale.contiguous().data_ptr(),
                                       _cb(codebook, dev, k).data_ptr(), k, out_f, in_features, y.data_ptr(),
                                       _stream(dev))
        _check(rc, "expert gemv")
        return y
    # Many rows: group them by expert (one host sync), one linear per expert present.
    y = torch.zeros((N, out_f), dtype=x.dtype, device=x.device)
    valid = (expert_ids >= 0) & (expert_ids < E)
    for e in torch.unique(expert_ids[valid]).tolist():
        rows = (expert_ids == e).nonzero().squeeze(-1)
        y[rows] = linear(x[rows], packed[e], absmax[e], scale[e], codebook, k, in_features).to(x.dtype)
    return y


# ---------------------------------------------------------------------------------------------------------------
# registration with the custom ops

_warned = False


def _warn_once():
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "kbit_hf: CUDA tensors but no compiled kbit CUDA library "
            f"({_load_error or 'not built'}); using the slow pure-PyTorch reference. Reinstall kbit_hf with a CUDA "
            "toolkit (nvcc) on the PATH to build the kernels.",
            RuntimeWarning,
            stacklevel=3,
        )


def _register():
    if _lib is not None:
        impls = {
            "kbit::quantize": quantize,
            "kbit::dequantize": dequantize,
            "kbit::linear": linear,
            "kbit::expert_linear": expert_linear,
        }
    else:
        def _fallback(fn):
            def impl(*args, **kwargs):
                _warn_once()
                return fn(*args, **kwargs)

            return impl

        impls = {
            "kbit::quantize": _fallback(reference.quantize),
            "kbit::dequantize": _fallback(reference.dequantize),
            "kbit::linear": _fallback(reference.linear),
            "kbit::expert_linear": _fallback(reference.expert_linear),
        }
    for name, fn in impls.items():
        torch.library.register_kernel(name, "cuda", fn)
    if _lib is not None:
        _ops._CUDA_FAST_LINEAR = linear
        _ops._CUDA_FAST_EXPERT_LINEAR = expert_linear


try:
    _register()
except Exception as exc:  # pragma: no cover - never break the import
    warnings.warn(f"kbit_hf: could not register the CUDA kernels ({type(exc).__name__}: {exc})", RuntimeWarning)
