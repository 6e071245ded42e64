"""The ctypes binding's guards, on the CPU (no GPU needed): without the compiled library every entry point of
kbit_hf.cuda_backend says so by name, and with one it refuses tensors that are not on one CUDA device before any
pointer reaches the library."""

import pytest
import torch

from kbit_hf import cuda_backend as cb
from kbit_hf import format as fmt
from kbit_hf import reference


def _calls():
    cbk = fmt.nf0_codebook(4)
    w = torch.randn(16, 256)
    p, a, s = reference.quantize(w, cbk, 4, "e4m4")
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    ids = torch.zeros(2, dtype=torch.int64)
    return {
        "quantize": lambda: cb.quantize(w, cbk, 4, "e4m4"),
        "dequantize": lambda: cb.dequantize(p, a, s, cbk, 4, 256),
        "linear": lambda: cb.linear(x, p, a, s, cbk, 4, 256),
        "linear_out": lambda: cb.linear_out(x, p, a, s, cbk, 4, 256, None, torch.empty(2, 16, dtype=x.dtype)),
        "expert_linear": lambda: cb.expert_linear(x, ids, p[None], a[None], s[None], cbk, 4, 256),
    }, (p, a)


def test_entry_points_without_the_library_name_the_problem(monkeypatch):
    monkeypatch.setattr(cb, "_lib", None)
    monkeypatch.setattr(cb, "_load_error", "libkbit_cuda.so: not found")
    calls, (p, a) = _calls()
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"cuda_backend\.{name}: the compiled CUDA library is not loaded "
                                               r"\(libkbit_cuda.so: not found\)"):
            call()
    # the layout conversions fall back to the reference
    assert all(torch.equal(u, v) for u, v in zip(cb.tile(p, a, 256, 4), fmt.tile(p, a, 256, 4)))


def test_entry_points_refuse_tensors_off_the_gpu(monkeypatch):
    monkeypatch.setattr(cb, "_lib", object())  # a library that must never be called with these tensors
    calls, _ = _calls()
    for name, call in calls.items():
        with pytest.raises(ValueError, match=rf"cuda_backend\.{name}: every tensor must be on one CUDA device; got "
                                             "cpu"):
            call()
