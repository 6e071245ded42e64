"""GPU tests of the tensor-core GEMM over the bit planes (csrc/kbit_gemm.cu, gemm_planes_kernel; M > 64 in
kernels.linear for weights held as bit planes): against float64 on fresh random inputs into NaN-poisoned outputs, for
every K, dtype and scale format; token counts around the 64- and 128-token CTA tiles; inputs that are not a multiple of
the 128-element group or of the 32-element block; odd output counts; layers whose k range is split through the
workspace; every forced launch shape; bias, determinism and CUDA-graph capture."""

import pytest
import torch

from kbit_hf import format as fmt
from kbit_hf.backends.cuda import dispatch, kernels
from .test_gemm import _assert_any_x_layout, _assert_replays, _quantized, _ref_linear64
from .test_kernels import GEMV_REL_W, _assert_linear_close, _captured

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _runs_here():
    if not dispatch.planes_gemm_runs_on(torch.cuda.current_device(), 4):
        pytest.skip("the bit-plane GEMM needs sm_80 / sm_90 shared memory")

# (16, 256): one partial CTA, 2 groups; (127, 776): odd outputs, in % 32 == 8 (a partial last block and group);
# (272, 1000): in % 128 == 104; (2000, 2304): a k split that does not divide the groups evenly; (4096, 1024): 32 CTAs
SHAPES = [(16, 256), (127, 776), (272, 1000), (2000, 2304), (4096, 1024)]


def _gemm(x, p, a, s, cb, k, in_f, bias, shape="auto"):
    y = torch.full((x.shape[0], p.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    return kernels.gemm_planes_out(x, p, a, s, cb, k, in_f, bias, y, shape)


@pytest.mark.parametrize("k", (2, 3, 4, 5))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("M", (65, 127, 128, 129, 300, 1000))
def test_gemm_planes(shape, dtype, M, k):
    out_f, in_f = shape
    cb = fmt.nf0_codebook(k)
    fmt_ = "fp16" if (M + k) % 3 == 0 else "e4m4"
    p, a, s = _quantized(shape, k, out_f * 7 + in_f + k, fmt_)
    g = torch.Generator().manual_seed(out_f + in_f + M + k)
    x = torch.randn(M, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype) if M % 2 else None
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f, bias)
    p_, a_, s_, cb_ = p.cuda(), a.cuda(), s.cuda(), cb.cuda()
    xb, bb = x.cuda(), None if bias is None else bias.cuda()
    y = _gemm(xb, p_, a_, s_, cb_, k, in_f, bb)
    _assert_linear_close(y, ref, mag, dtype, rel_w=GEMV_REL_W[dtype])
    assert torch.equal(_gemm(xb, p_, a_, s_, cb_, k, in_f, bb), y)  # deterministic, k split included


@pytest.mark.parametrize("k", (2, 4, 5))
@pytest.mark.parametrize("M", (64, 65, 128, 129))
def test_linear_runs_planes_gemm(k, M):
    """kernels.linear (and the custom op) runs the bit-plane GEMM on long rows at 65..128 tokens for K <= 4: bitwise
    the kernel's result there; outside the rule (64: the GEMV, 129 or K = 5: dequantize + cuBLAS) the reference's."""
    out_f, in_f = 144, 14344  # in % 32 == 8: a partial last block and group
    cb = fmt.nf0_codebook(k)
    p, a, s = _quantized((out_f, in_f), k, 13 + k)
    g = torch.Generator().manual_seed(M + k)
    x = torch.randn(M, in_f, generator=g).to(torch.bfloat16)
    bias = torch.randn(out_f, generator=g).to(torch.bfloat16)
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f, bias)
    xb, p_, a_, s_, cb_, bb = x.cuda(), p.cuda(), a.cuda(), s.cuda(), cb.cuda(), bias.cuda()
    y = kernels.linear(xb, p_, a_, s_, cb_, k, in_f, bb)
    _assert_linear_close(y, ref, mag, torch.bfloat16, rel_w=GEMV_REL_W[torch.bfloat16])
    assert torch.equal(torch.ops.kbit.linear(xb, p_, a_, s_, cb_, k, in_f, bb), y)
    uses = dispatch.linear_uses_planes_gemm(M, torch.bfloat16, in_f, k)
    assert uses == (M in (65, 128) and k <= 4)
    if uses:
        assert torch.equal(_gemm(xb, p_, a_, s_, cb_, k, in_f, bb), y)


@pytest.mark.parametrize("k", (3, 4, 5))
@pytest.mark.parametrize("launch", sorted(set(kernels.PLANES_GEMM_SHAPES) - {"auto"}))
def test_gemm_planes_forced_shapes(launch, k):
    """Every launch shape the library may pick (64 or 128 tokens per CTA, 2..4 stages) on a layer with a k split and
    one without, where it fits in the device's shared memory."""
    for (out_f, in_f), M in (((2000, 2304), 200), ((4096, 1024), 1000)):
        cb = fmt.nf0_codebook(k)
        p, a, s = _quantized((out_f, in_f), k, 3 * k + out_f)
        x = torch.randn(M, in_f, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
        ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f)
        try:
            y = _gemm(x.cuda(), p.cuda(), a.cuda(), s.cuda(), cb.cuda(), k, in_f, None, launch)
        except RuntimeError as exc:  # the shape does not fit this device's shared memory
            assert "not supported" in str(exc).lower(), exc
            continue
        _assert_linear_close(y, ref, mag, torch.bfloat16, rel_w=GEMV_REL_W[torch.bfloat16])


def test_gemm_planes_large_m():
    """4096 tokens (32 CTA columns of 128) on a layer of 1040 rows (a partial row block)."""
    out_f, in_f, k = 1040, 512, 4
    cb = fmt.nf0_codebook(k)
    p, a, s = _quantized((out_f, in_f), k, 7)
    x = torch.randn(4096, in_f, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f)
    y = _gemm(x.cuda(), p.cuda(), a.cuda(), s.cuda(), cb.cuda(), k, in_f, None)
    _assert_linear_close(y, ref, mag, torch.bfloat16, rel_w=GEMV_REL_W[torch.bfloat16])


def test_gemm_planes_strided_and_unaligned_input():
    """A column slice (not contiguous) and a view starting 2 elements in (not 16-byte aligned) give the same result
    as a contiguous copy."""
    out_f, in_f, k = 272, 512, 3
    p, a, s = (t.cuda() for t in _quantized((out_f, in_f), k, 5))
    cb = fmt.nf0_codebook(k).cuda()
    _assert_any_x_layout(lambda x: _gemm(x, p, a, s, cb, k, in_f, None), in_f)


@pytest.mark.parametrize("shape", [(272, 776), (2048, 4096)], ids=str)
def test_gemm_planes_cuda_graph(shape):
    """Captured (with its k-split workspace allocated inside the capture: (2048, 4096) splits it), replayed on new
    inputs."""
    out_f, in_f, k = shape[0], shape[1], 4
    p, a, s = (t.cuda() for t in _quantized(shape, k, 11))
    cb = fmt.nf0_codebook(k).cuda()
    x = torch.randn(160, in_f, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(160, out_f, device="cuda", dtype=torch.bfloat16)
    graph = _captured(lambda: kernels.gemm_planes_out(x, p, a, s, cb, k, in_f, None, y))
    _assert_replays(graph, x, y, lambda: _gemm(x, p, a, s, cb, k, in_f, None))


def test_gemm_planes_errors():
    p, a, s = (t.cuda() for t in _quantized((272, 776), 4, 1))
    cb = fmt.nf0_codebook(4).cuda()
    x = torch.randn(100, 776, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out a contiguous"):
        kernels.gemm_planes_out(x, p, a, s, cb, 4, 776, None, torch.empty(100, 271, device="cuda",
                                                                         dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp16/bf16"):
        kernels.gemm_planes_out(x.float(), p, a, s, cb, 4, 776, None, torch.empty(100, 272, device="cuda"))
    with pytest.raises(ValueError, match="shape"):
        kernels.gemm_planes_out(x, p, a, s, cb, 4, 776, None, torch.empty(100, 272, device="cuda",
                                                                         dtype=torch.bfloat16), "bn32s3")
    p2, a2, s2 = (t.cuda() for t in _quantized((16, 100), 4, 2))
    with pytest.raises(ValueError, match="multiple of 8"):
        kernels.gemm_planes_out(torch.randn(100, 100, device="cuda", dtype=torch.bfloat16), p2, a2, s2, cb, 4, 100,
                                None, torch.empty(100, 16, device="cuda", dtype=torch.bfloat16))
    # linear falls back to dequantize + cuBLAS there
    y = kernels.linear(torch.randn(100, 100, device="cuda", dtype=torch.bfloat16), p2, a2, s2, cb, 4, 100)
    assert y.shape == (100, 16) and torch.isfinite(y).all()
