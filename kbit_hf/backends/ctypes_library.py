"""Opening one of the compiled libraries (libkbit_cuda.so, libkbit_cpu.so: plain C ABIs) with ctypes: the ABI check
and the function signatures, shared by backends/cuda/library.py and backends/cpu/library.py."""

from __future__ import annotations

import ctypes
from pathlib import Path

I32, I64, F32, PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p

# where `pip install .` puts the libraries (CMakeLists.txt: install ... DESTINATION kbit_hf/_lib)
LIB_DIR = Path(__file__).resolve().parents[1] / "_lib"


def open_library(path: Path, abi_function: str, abi_version: int, error_function: str,
                 signatures: dict[str, list], restypes: dict[str, type] | None = None):
    """(handle, None) for a library at `path` whose `abi_function()` returns `abi_version`, with `error_function`
    (int -> char*) and every function of `signatures` (name -> argument types; return type int unless `restypes`
    says otherwise) declared; else (None, why)."""
    if not path.is_file():
        return None, f"{path}: not found"
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as exc:  # e.g. no libcuda on this machine
        return None, f"{path}: {exc}"
    abi = getattr(handle, abi_function)
    abi.restype, abi.argtypes = I32, []
    if abi() != abi_version:
        return None, f"{path}: ABI version {abi()} != {abi_version} (rebuild the package)"
    err = getattr(handle, error_function)
    err.restype, err.argtypes = ctypes.c_char_p, [I32]
    for name, args in signatures.items():
        fn = getattr(handle, name)
        fn.restype = (restypes or {}).get(name, I32)
        fn.argtypes = args
    return handle, None
