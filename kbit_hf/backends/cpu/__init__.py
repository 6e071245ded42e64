"""The CPU backend: the compiled library's kernels as the "cpu" implementations of the kbit ops.

  library.py   loading libkbit_cpu.so (ctypes) and its ABI check
  dispatch.py  which path runs: every kernel-selection rule of the Python side, one line of why each
  kernels.py   the op implementations (ctypes calls, torch's intra-op thread count)

Without the compiled library the CPU keeps the reference ops.
"""

from __future__ import annotations

from ... import ops
from . import kernels, library
from .library import available, isa, library_path, load_error

__all__ = ["available", "isa", "load_error", "library_path", "register"]


def register() -> None:
    """Register this backend with kbit_hf.ops (called once by `import kbit_hf`)."""
    if library.available():
        ops.register_backend("cpu", quantize=kernels.quantize, dequantize=kernels.dequantize, linear=kernels.linear,
                             expert_linear=kernels.expert_linear, eager_linear=kernels.linear,
                             eager_expert_linear=kernels.expert_linear)
