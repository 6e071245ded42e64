"""Loading libkbit_cuda.so (csrc/, a plain C ABI: csrc/kbit_api.h) with ctypes, and its ABI check.

Importing this never fails: without the library (a CPU-only install, no CUDA toolkit at build time, no driver)
`lib` is None and `load_error()` says why. The one user-facing switch is the environment variable KBIT_CUDA_LIB:
a path loads that library instead of the packaged one, `off` turns the compiled kernels off (reference ops).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

# csrc/kbit_quant.cu kbit_abi_version(): a library built from other sources is refused
ABI_VERSION = 11

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_vp, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "kbit_quantize": [_vp, _i32, _i64, _i64, _i64, _vp, _i32, _i32, _vp, _vp, _vp, _vp],
    "kbit_dequantize": [_vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _i64, _vp, _i32, _vp],
    "kbit_gemv": [_vp, _i32, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp],
    "kbit_expert_gemv": [_vp, _i32, _i64, _vp, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _vp],
    "kbit_tile": [_vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp],
    "kbit_untile": [_vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp],
    "kbit_dequantize_tiled": [_vp, _vp, _vp, _vp, _i32, _i64, _i64, _vp, _i32, _vp],
    "kbit_gemv_tiled": [_vp, _i32, _i64, _vp, _vp, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp],
    "kbit_gemv_tiled_kernel": [_vp, _i32, _i64, _vp, _vp, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _i32, _vp],
    "kbit_gemm_tiled_workspace": [_i64, _i64, _i64],
    "kbit_gemm_tiled": [_vp, _i32, _i64, _vp, _vp, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp, _i64, _vp],
}
_RESTYPES = {"kbit_gemm_tiled_workspace": _i64}  # the others return an int status

lib = None
_load_error: str | None = None
_lib_path: str | None = None


def _candidates():
    env = os.environ.get("KBIT_CUDA_LIB")
    if env:
        yield Path(env)
    else:
        yield Path(__file__).resolve().parents[2] / "_lib" / "libkbit_cuda.so"


def _load():
    global lib, _load_error, _lib_path
    if os.environ.get("KBIT_CUDA_LIB", "").lower() == "off":
        _load_error = "turned off by KBIT_CUDA_LIB=off"
        return
    errors = []
    for path in _candidates():
        if not path.is_file():
            errors.append(f"{path}: not found")
            continue
        try:
            handle = ctypes.CDLL(str(path))
        except OSError as exc:  # e.g. no libcuda on this machine
            errors.append(f"{path}: {exc}")
            continue
        handle.kbit_abi_version.restype = _i32
        handle.kbit_abi_version.argtypes = []
        if handle.kbit_abi_version() != ABI_VERSION:
            errors.append(f"{path}: ABI version {handle.kbit_abi_version()} != {ABI_VERSION} (rebuild the package)")
            continue
        handle.kbit_error_string.restype = ctypes.c_char_p
        handle.kbit_error_string.argtypes = [_i32]
        for name, args in _SIGNATURES.items():
            fn = getattr(handle, name)
            fn.restype = _RESTYPES.get(name, _i32)
            fn.argtypes = args
        lib, _lib_path = handle, str(path)
        return
    _load_error = "; ".join(errors)


try:
    _load()
except Exception as exc:  # never let a broken library break `import kbit_hf`
    lib, _load_error = None, f"{type(exc).__name__}: {exc}"


def available() -> bool:
    """True when the compiled CUDA library was loaded (a GPU may still be absent)."""
    return lib is not None


def load_error() -> str | None:
    return _load_error


def library_path() -> str | None:
    return _lib_path


def check(rc: int, what: str) -> None:
    """Raise for a non-zero return code of a library call."""
    if rc != 0:
        msg = lib.kbit_error_string(rc).decode(errors="replace")
        raise RuntimeError(f"kbit CUDA {what} failed: {msg} (cudaError {rc})")
