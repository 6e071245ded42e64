"""The CUDA backend: the compiled library's kernels as the "cuda" implementations of the kbit ops.

  library.py   loading libkbit_cuda.so (ctypes) and its ABI check
  dispatch.py  which path runs: every kernel-selection rule of the Python side, one line of why each
  kernels.py   the op implementations (ctypes calls on torch's current stream)
  tiled.py     the tiled in-memory layout of large weights on sm_90, and its conversions

Without the compiled library the "cuda" kernels are the reference ops, behind one warning the first time a CUDA
tensor arrives.
"""

from __future__ import annotations

import warnings

from ... import ops
from .. import reference
from . import dispatch, kernels, library
from .library import available, library_path, load_error
from .tiled import TiledLayout

__all__ = ["available", "load_error", "library_path", "register"]

_warned = False


def _warn_once():
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(
            "kbit_hf: CUDA tensors but no compiled kbit CUDA library "
            f"({library.load_error() or 'not built'}); using the slow pure-PyTorch reference. Reinstall kbit_hf with a "
            "CUDA toolkit (nvcc) on the PATH to build the kernels (README, Install).",
            RuntimeWarning,
            stacklevel=3,
        )


def _with_warning(fn):
    def impl(*args, **kwargs):
        _warn_once()
        return fn(*args, **kwargs)

    return impl


def register() -> None:
    """Register this backend with kbit_hf.ops (called once by `import kbit_hf`)."""
    if library.available():
        ops.register_backend("cuda", quantize=kernels.quantize, dequantize=kernels.dequantize, linear=kernels.linear,
                             expert_linear=kernels.expert_linear, eager_linear=kernels.linear,
                             eager_expert_linear=kernels.expert_linear, moe_experts=kernels.moe_experts,
                             fuses_moe=dispatch.moe_fused, router_topk=kernels.router_topk)
        ops.register_layout(TiledLayout())
    else:
        ops.register_backend("cuda", quantize=_with_warning(reference.quantize),
                             dequantize=_with_warning(reference.dequantize), linear=_with_warning(reference.linear),
                             expert_linear=_with_warning(reference.expert_linear))
