"""Loading libkbit_cpu.so (csrc/cpu/, a plain C ABI: csrc/cpu/kbit_cpu_api.h) with ctypes, and its ABI check.

Importing this never fails: without the library (an install whose build failed, a source checkout never built)
`lib` is None, `load_error()` says why, and the CPU keeps the reference ops.
"""

from __future__ import annotations

import torch

from ..ctypes_library import I32 as _i32, I64 as _i64, LIB_DIR, PTR as _vp, open_library

# csrc/cpu/kbit_cpu.cpp KBIT_CPU_ABI_VERSION: a library built from other sources is refused
ABI_VERSION = 1

DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
ISA_NAMES = ("scalar", "avx2", "avx512")  # kbit_cpu_isa() codes

_SIGNATURES = {
    "kbit_cpu_isa": [],
    "kbit_cpu_set_isa": [_i32],
    "kbit_cpu_absmax": [_vp, _i32, _i64, _i64, _i64, _vp, _i32],
    "kbit_cpu_quantize": [_vp, _i32, _i64, _i64, _i64, _vp, _vp, _i32, _i32, _vp, _vp, _i32],
    "kbit_cpu_dequantize": [_vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _i64, _vp, _i32, _i32],
    "kbit_cpu_gemv": [_vp, _i32, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _i32, _vp, _i32],
    "kbit_cpu_expert_gemv": [_vp, _i32, _i64, _vp, _i64, _vp, _vp, _i32, _vp, _vp, _i32, _i64, _i64, _vp, _i32],
}

lib = None
_load_error: str | None = None
_lib_path: str | None = None
_isa = "scalar"  # kbit_cpu_isa(), cached: dispatch asks per call


def _load():
    global lib, _load_error, _lib_path, _isa
    # torch is imported first, so its OpenMP runtime (libgomp.so.1 in torch/lib) is the one the library binds to:
    # one thread pool for both
    path = LIB_DIR / "libkbit_cpu.so"
    lib, _load_error = open_library(path, "kbit_cpu_abi_version", ABI_VERSION, "kbit_cpu_error_string", _SIGNATURES)
    if lib is not None:
        _lib_path, _isa = str(path), ISA_NAMES[lib.kbit_cpu_isa()]


try:
    _load()
except Exception as exc:  # never let a broken library break `import kbit_hf`
    lib, _load_error = None, f"{type(exc).__name__}: {exc}"


def available() -> bool:
    """True when the compiled CPU library was loaded."""
    return lib is not None


def load_error() -> str | None:
    return _load_error


def library_path() -> str | None:
    return _lib_path


def isa() -> str:
    """The instruction set the kernels use on this CPU: "scalar", "avx2" or "avx512"."""
    return _isa


def set_isa(name: str) -> str:
    """Use at most the instruction set `name` (tests run every path on one machine); returns the one now in use."""
    global _isa
    _isa = ISA_NAMES[lib.kbit_cpu_set_isa(ISA_NAMES.index(name))]
    return _isa


def check(rc: int, what: str) -> None:
    """Raise for a non-zero return code of a library call."""
    if rc != 0:
        raise RuntimeError(f"kbit CPU {what} failed: {lib.kbit_cpu_error_string(rc).decode(errors='replace')}")
