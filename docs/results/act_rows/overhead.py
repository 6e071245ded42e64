"""Breakdown of the host cost of one eager kbit GEMV call (microseconds per call, best of 5 x 300)."""
import time, torch, kbit_hf
print("kbit_hf from", kbit_hf.__file__)
from kbit_hf import cuda_backend as cb_, format as fmt
from kbit_hf.ops import linear_forward
from kbit_hf.bench.kernels import _kbit_weights

def best(fn, n=300):
    for _ in range(20): fn()
    torch.cuda.synchronize()
    b = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n): fn()
        b = min(b, (time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return b

import re, pathlib
src = pathlib.Path(".kwt/oldpy/kbit_hf/cuda_backend.py").read_text()
def grab(name):
    i = src.index(f"def {name}(")
    j = src.index("\ndef ", i + 1)
    return src[i:j]
ns = dict(vars(cb_))
exec(grab("_gemv_call").replace("def _gemv_call(", "def _gemv_call_old(") + "\n" +
     grab("linear").replace("def linear(", "def linear_old(").replace("_gemv_call(", "_gemv_call_old("), ns)
linear_old = ns["linear_old"]
for (out_f, in_f) in ((256, 256), (4096, 4096)):
    k = 4
    p, a, s, cb = _kbit_weights(out_f, in_f, k)
    if cb_.holds_tiled(out_f, in_f, k, 'e4m4', torch.device('cuda')):
        p, a = cb_.tile(p, a, in_f, k)
    dc = cb_._DTYPE_CODE[torch.bfloat16]
    x = torch.randn(1, 1, in_f, device="cuda", dtype=torch.bfloat16)
    x2 = x.view(1, in_f)
    y = torch.empty(1, out_f, device="cuda", dtype=torch.bfloat16)
    dev = x.device
    L = cb_._lib
    tiled = p.dtype == torch.uint8
    ptrs = [t.data_ptr() for t in (x, p, a, s, cb, y)]
    st = cb_._stream(dev)
    if tiled:
        raw = lambda: L.kbit_gemv_tiled(ptrs[0], dc, 1, ptrs[1], ptrs[2], ptrs[3], ptrs[4], k, out_f, in_f, 0, ptrs[5], 0, st)
    else:
        raw = lambda: L.kbit_gemv(ptrs[0], dc, 1, ptrs[1], ptrs[2], 0, ptrs[3], ptrs[4], k, out_f, in_f, 0, ptrs[5], st)
    print(f"{out_f}x{in_f} tiled={tiled} dtype code check {cb_._DTYPE_CODE[torch.bfloat16]}")
    rows = [
        ("ctypes kbit_abi_version()", lambda: L.kbit_abi_version()),
        ("ctypes GEMV call, invalid k (no launch)", lambda: L.kbit_gemv(ptrs[0], dc, 1, ptrs[1], ptrs[2], 0, ptrs[3], ptrs[4], 7, out_f, in_f, 0, ptrs[5], st)),
        ("torch y.zero_() (a torch launch)", lambda: y.zero_()),
        ("raw GEMV ctypes call, int args", raw),
        ("_gemv_call (data_ptr + stream)", lambda: cb_._gemv_call(x2, 1, p, a, s, cb, k, out_f, in_f, None, y, st)),
        ("_stream(dev)", lambda: cb_._stream(dev)),
        ("6 x data_ptr()", lambda: (x.data_ptr(), p.data_ptr(), a.data_ptr(), s.data_ptr(), cb.data_ptr(), y.data_ptr())),
        ("x.device", lambda: x.device),
        ("tiled_supported(x.device)", lambda: cb_.tiled_supported(x.device)),
        ("torch.empty", lambda: torch.empty((1, out_f), dtype=torch.bfloat16, device=dev)),
        ("torch.empty like x.new_empty", lambda: x.new_empty((1, 1, out_f))),
        ("cuda_backend.linear (new)", lambda: cb_.linear(x, p, a, s, cb, k, in_f)),
        ("linear of HEAD (old)", lambda: linear_old(x, p, a, s, cb, k, in_f)),
        ("cuda_backend.linear (new) again", lambda: cb_.linear(x, p, a, s, cb, k, in_f)),
        ("linear of HEAD (old) again", lambda: linear_old(x, p, a, s, cb, k, in_f)),
        ("ops.linear_forward", lambda: linear_forward(x, p, a, s, cb, k, in_f, None)),
    ]
    yo, yn = linear_old(x, p, a, s, cb, k, in_f), cb_.linear(x, p, a, s, cb, k, in_f)
    assert torch.equal(yo, yn), "old and new linear differ"
    with torch.no_grad():
        for name, fn in rows:
            print(f"  {name:40s} {best(fn):7.2f} us")
