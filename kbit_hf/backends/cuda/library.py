"""Loading libkbit_cuda.so (csrc/, a plain C ABI: csrc/kbit_api.h) with ctypes, and its ABI check.

Importing this never fails: without the library (a CPU-only install, no CUDA toolkit at build time, no driver)
`lib` is None and `load_error()` says why. The one user-facing switch is the environment variable KBIT_CUDA_LIB:
a path loads that library instead of the packaged one, `off` turns the compiled kernels off (reference ops).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..ctypes_library import F32 as _f32, I32 as _i32, I64 as _i64, LIB_DIR, PTR as _vp, open_library

# csrc/kbit_quant.cu kbit_abi_version(): a library built from other sources is refused
ABI_VERSION = 17

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

_SIGNATURES = {
    "kbit_quantize": [_vp, _i32, _i64, _i64, _i64, _vp, _i32, _i32, _vp, _vp, _vp, _vp],
    "kbit_dequantize": [_vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _i64, _vp, _i32, _vp],
    "kbit_gemv": [_vp, _i32, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp],
    "kbit_expert_gemv_workspace": [_i64, _i64],
    "kbit_expert_gemv": [_vp, _i32, _i64, _vp, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _i64, _vp],
    "kbit_expert_gemv_kernel": [_vp, _i32, _i64, _vp, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _vp,
                                _i64, _i32, _vp],
    "kbit_moe_gate_up": [_vp, _i32, _i64, _i64, _vp, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _i32, _f32,
                         _f32, _vp, _vp],
    "kbit_moe_down": [_vp, _i32, _i64, _i64, _vp, _vp, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp],
    "kbit_router_topk": [_vp, _i32, _i64, _i64, _i64, _i32, _i32, _vp, _vp, _i32, _vp],
    "kbit_tile": [_vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp],
    "kbit_untile": [_vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp],
    "kbit_dequantize_tiled": [_vp, _vp, _vp, _vp, _i32, _i64, _i64, _vp, _i32, _vp],
    "kbit_gemv_tiled": [_vp, _i32, _i64, _vp, _vp, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp],
    "kbit_gemv_tiled_kernel": [_vp, _i32, _i64, _vp, _vp, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _i32, _vp],
    "kbit_gemm_tiled_workspace": [_i64, _i64, _i64],
    "kbit_wgmma_available": [],
    "kbit_gemm_tiled": [_vp, _i32, _i64, _vp, _vp, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp, _i64, _vp],
    "kbit_expert_gemm_workspace": [_i64, _i64, _i64],
    "kbit_expert_gemm": [_vp, _i32, _i64, _vp, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _i64, _vp],
    "kbit_gemm_planes_workspace": [_i64, _i64, _i64, _i32, _i32],
    "kbit_gemm_planes": [_vp, _i32, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp, _i64, _vp],
    "kbit_gemm_planes_kernel": [_vp, _i32, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _vp, _vp, _i64,
                                _i32, _i32, _vp],
}
# the others return an int status
_RESTYPES = {"kbit_gemm_tiled_workspace": _i64, "kbit_expert_gemv_workspace": _i64, "kbit_expert_gemm_workspace": _i64,
             "kbit_gemm_planes_workspace": _i64}

lib = None
_load_error: str | None = None
_lib_path: str | None = None


def _load():
    global lib, _load_error, _lib_path
    env = os.environ.get("KBIT_CUDA_LIB", "")
    if env.lower() == "off":
        _load_error = "turned off by KBIT_CUDA_LIB=off"
        return
    path = Path(env) if env else LIB_DIR / "libkbit_cuda.so"
    lib, _load_error = open_library(path, "kbit_abi_version", ABI_VERSION, "kbit_error_string", _SIGNATURES,
                                    _RESTYPES)
    _lib_path = str(path) if lib is not None else None


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
