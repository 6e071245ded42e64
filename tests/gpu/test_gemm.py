"""GPU tests of the tensor-core GEMM over the tiled layout (csrc/kbit_tiled.cu, gemm_tiled_kernel; M > 64 in
kernels.linear): against float64 on fresh random inputs into NaN-poisoned outputs, for every K and dtype, token
counts around the 128- and 256-token CTA tiles, a layer of one tile and one item, a partial CTA, layers whose k range
is split through the workspace ((2000, 2304), (4096, 1024), (6144, 4096) at few tokens) and layers of many CTAs, bias,
determinism, CUDA-graph capture and the path KbitLinear takes."""

import functools

import pytest
import torch

from kbit_hf import format as fmt
from kbit_hf.backends import reference
from kbit_hf.backends.cuda import dispatch, kernels, library
from kbit_hf.backends.cuda.tiled import TILED_K, tile
from .test_kernels import GEMV_REL_W, _assert_linear_close, _captured, _quantize_on_gpu, _ref_linear64


pytestmark = pytest.mark.cuda

# (16, 256): one tile, one item (no k split possible); (272, 768): 17 tiles, a partial CTA; (2000, 2304): a k split
# of items that do not divide evenly; (4096, 1024): 32 CTAs; (6144, 4096): 48 CTAs, 16 items each; (4144, 512): 33
# CTAs, the last with 3 of its 8 tiles, no k split at 1000 tokens (the staged epilogue)
GEMM_SHAPES = [(16, 256), (272, 768), (2000, 2304), (4096, 1024), (6144, 4096), (4144, 512)]


def _sm90a():
    return dispatch.wgmma_runs_on(torch.cuda.current_device())


@functools.lru_cache(maxsize=64)  # every (shape, k): consecutive tests change k and shape first
def _quantized(shape, k, seed, absmax_format="e4m4"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    w[1, 32:64] *= 1e-5  # a subnormal e4m4 block scale
    return _quantize_on_gpu(w, fmt.nf0_codebook(k), k, absmax_format)


def _assert_replays(graph, x, y, want):
    """Replays `graph` on two fresh inputs written into x, with y poisoned first: y equals want() after each."""
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want())


def _assert_any_x_layout(run, in_f):
    """run(x) on a column slice (not contiguous) and on a view starting 2 elements in (not 16-byte aligned) equals
    run on a contiguous copy."""
    big = torch.randn(100, in_f + 8, device="cuda", dtype=torch.bfloat16)
    for x in (big[:, :in_f], big.view(-1)[2:2 + 100 * in_f].view(100, in_f)):
        want = run(x.contiguous().clone())
        assert torch.equal(run(x), want)


def _gemm(x, wt, at, s, cb, k, in_f, bias):
    y = torch.full((x.shape[0], wt.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    return kernels.gemm_out(x, wt, at, s, cb, k, in_f, bias, y)


@pytest.mark.parametrize("k", TILED_K)
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("M", (1, 17, 65, 127, 128, 129, 300, 1000, 4096))
def test_gemm_tiled(shape, dtype, M, k):
    if not _sm90a():
        pytest.skip("the tiled GEMM is sm_90a")
    out_f, in_f = shape
    cb = fmt.nf0_codebook(k)
    p, a, s = _quantized(shape, k, out_f * 7 + in_f + k)
    g = torch.Generator().manual_seed(out_f + in_f + M + k)
    x = torch.randn(M, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype) if M % 2 else None
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f, bias)
    wt, at = tile(p.cuda(), a.cuda(), in_f, k)
    xb, bb, cb_, s_ = x.cuda(), None if bias is None else bias.cuda(), cb.cuda(), s.cuda()
    y = _gemm(xb, wt, at, s_, cb_, k, in_f, bb)
    _assert_linear_close(y, ref, mag, dtype, rel_w=GEMV_REL_W[dtype])
    assert torch.equal(_gemm(xb, wt, at, s_, cb_, k, in_f, bb), y)  # deterministic, k split included
    if dispatch.linear_uses_gemm(M, dtype, out_f, in_f):  # the path KbitLinear runs
        assert torch.equal(kernels.linear(xb, wt, at, s_, cb_, k, in_f, bb), y)
        assert torch.equal(torch.ops.kbit.linear(xb, wt, at, s_, cb_, k, in_f, bb), y)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("M", (100, 257))
def test_gemm_tiled_epilogue_without_k_split(dtype, M):
    """Enough CTAs that the k range is not split at 128 and at 256 tokens per CTA (the staged epilogue of both
    widths), a partial last CTA and token tile, a bias; and an output view that is not 16-byte aligned."""
    if not _sm90a():
        pytest.skip("the tiled GEMM is sm_90a")
    (out_f, in_f), k = (16912, 256), 4
    assert library.lib.kbit_gemm_tiled_workspace(M, out_f, in_f) == -(-M * in_f * 2 // 256) * 256  # x only
    cb = fmt.nf0_codebook(k)
    p, a, s = _quantized((out_f, in_f), k, 11)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f, bias)
    wt, at = tile(p.cuda(), a.cuda(), in_f, k)
    xb, bb, cb_, s_ = x.cuda(), bias.cuda(), cb.cuda(), s.cuda()
    y = _gemm(xb, wt, at, s_, cb_, k, in_f, bb)
    _assert_linear_close(y, ref, mag, dtype, rel_w=GEMV_REL_W[dtype])
    buf = torch.full((M * out_f + 1,), float("nan"), dtype=dtype, device="cuda")
    y_odd = buf[1:].view(M, out_f)  # 2 bytes past an aligned start
    assert kernels.gemm_out(xb, wt, at, s_, cb_, k, in_f, bb, y_odd) is y_odd
    assert torch.equal(y_odd, y) and torch.isnan(buf[0])


@pytest.mark.parametrize("x_scale", (2.0**-30, 2.0**12), ids=str)
def test_gemm_tiled_activation_range(x_scale):
    """Tiny and large bf16 activations against rows whose block scales are all subnormal (the A operands carry the
    block scales as raw bf16 bits against a table scaled by 2^32: TiledScales)."""
    if not _sm90a():
        pytest.skip("the tiled GEMM is sm_90a")
    out_f, in_f, k = 272, 768, 4
    g = torch.Generator().manual_seed(3)
    w = torch.randn(out_f, in_f, generator=g)
    w[:16] *= 1e-5
    cb = fmt.nf0_codebook(k)
    p, a, s = reference.quantize(w, cb, k, "e4m4")
    x = (torch.randn(200, in_f, generator=g) * x_scale).to(torch.bfloat16)
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f, None)
    wt, at = tile(p.cuda(), a.cuda(), in_f, k)
    y = _gemm(x.cuda(), wt, at, s.cuda(), cb.cuda(), k, in_f, None)
    _assert_linear_close(y, ref, mag, torch.bfloat16, rel_w=GEMV_REL_W[torch.bfloat16], norm_check=False)


def test_gemm_tiled_strided_and_unaligned_input():
    """A column slice (not contiguous) and a view starting 2 elements in (not 16-byte aligned) give the same result
    as a contiguous copy."""
    if not _sm90a():
        pytest.skip("the tiled GEMM is sm_90a")
    out_f, in_f, k = 272, 512, 3
    p, a, s = (t.cuda() for t in _quantized((out_f, in_f), k, 5))
    cb = fmt.nf0_codebook(k).cuda()
    wt, at = tile(p, a, in_f, k)
    _assert_any_x_layout(lambda x: _gemm(x, wt, at, s, cb, k, in_f, None), in_f)


@pytest.mark.parametrize("shape", [(272, 768), (6144, 4096)], ids=str)
def test_gemm_tiled_cuda_graph(shape):
    """Captured (with its k-split workspace allocated inside the capture), replayed on new inputs."""
    if not _sm90a():
        pytest.skip("the tiled GEMM is sm_90a")
    out_f, in_f, k = shape[0], shape[1], 4
    p, a, s = (t.cuda() for t in _quantized(shape, k, 11))
    cb = fmt.nf0_codebook(k).cuda()
    wt, at = tile(p, a, in_f, k)
    x = torch.randn(160, in_f, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(160, out_f, device="cuda", dtype=torch.bfloat16)
    graph = _captured(lambda: y.copy_(kernels.linear(x, wt, at, s, cb, k, in_f)))
    _assert_replays(graph, x, y, lambda: _gemm(x, wt, at, s, cb, k, in_f, None))


def test_gemm_tiled_errors():
    if not _sm90a():
        pytest.skip("the tiled GEMM is sm_90a")
    p, a, s = (t.cuda() for t in _quantized((272, 768), 4, 1))
    cb = fmt.nf0_codebook(4).cuda()
    wt, at = tile(p, a, 768, 4)
    x = torch.randn(100, 768, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out a contiguous"):
        kernels.gemm_out(x, wt, at, s, cb, 4, 768, None, torch.empty(100, 271, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp16/bf16"):
        kernels.gemm_out(x.float(), wt, at, s, cb, 4, 768, None, torch.empty(100, 272, device="cuda"))
    with pytest.raises(ValueError, match="tiled weight"):
        kernels.gemm_out(x, p, a, s, cb, 4, 768, None, torch.empty(100, 272, device="cuda", dtype=torch.bfloat16))


def test_gemm_runs_on_every_compute_capability_9_0_gpu():
    """The library is built as sm_90a wherever it is built for sm_90, so an H100 / H200 must run the GEMM (not fall
    back in silence)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("compute capability 9.0 only")
    assert dispatch.wgmma_runs_on(torch.cuda.current_device())


def test_gemm_tiled_refuses_too_many_tokens():
    """More tokens than 65535 CTA rows: an error code before anything is read or launched."""
    if not _sm90a():
        pytest.skip("the tiled GEMM is sm_90a")
    from kbit_hf.backends.cuda import library

    p, a, s = (t.cuda() for t in _quantized((272, 768), 4, 1))
    wt, at = tile(p, a, 768, 4)
    x = torch.empty(16, 768, device="cuda", dtype=torch.bfloat16)  # its pointer only: nothing is read
    cb = fmt.nf0_codebook(4).cuda()
    rc = library.lib.kbit_gemm_tiled(x.data_ptr(), 2, 65535 * 256 + 1, wt.data_ptr(), at.data_ptr(), s.data_ptr(),
                                     cb.data_ptr(), 4, 272, 768, 0, x.data_ptr(), 0, 0,
                                     kernels.stream_of(x.device))
    assert rc != 0
    with pytest.raises(ValueError, match="rows of x"):
        kernels.gemm_out(x[:0], wt, at, s, cb, 4, 768, None, torch.empty(0, 272, device="cuda", dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("M", (100, 300))
def test_linear_over_a_tiled_weight_takes_any_x_layout(dtype, M):
    """kernels.linear's eager path over a tiled weight (the GEMM at 100 tokens, dequantize + cuBLAS at 300 on a layer
    this small): x contiguous, a column slice, a view starting 2 elements in, and 3-D, with a bias, equals the GEMM
    into a poisoned output or the dequantized weight through F.linear; a weight whose block scales do not fit is
    refused."""
    if not _sm90a():
        pytest.skip("the tiled GEMM is sm_90a")
    out_f, in_f, k = 272, 768, 4
    p, a, s = (t.cuda() for t in _quantized((out_f, in_f), k, M))
    cb = fmt.nf0_codebook(k).cuda()
    wt, at = tile(p, a, in_f, k)
    g = torch.Generator(device="cuda").manual_seed(M)
    big = torch.randn(M, in_f + 8, device="cuda", dtype=dtype, generator=g)
    bias = torch.randn(out_f, device="cuda", dtype=dtype, generator=g)
    x = big[:, :in_f].contiguous()
    if dispatch.linear_uses_gemm(M, dtype, out_f, in_f):
        want = _gemm(x, wt, at, s, cb, k, in_f, bias)
    else:
        want = torch.nn.functional.linear(x, kernels.dequantize(wt, at, s, cb, k, in_f, dtype), bias)
    buf = torch.empty(M * in_f + 8, device="cuda", dtype=dtype)
    shifted = buf[2:2 + M * in_f].view(M, in_f).copy_(x)
    for view in (x, big[:, :in_f], shifted):
        assert torch.equal(kernels.linear(view, wt, at, s, cb, k, in_f, bias), want)
    y3 = kernels.linear(x.view(2, M // 2, in_f), wt, at, s, cb, k, in_f, bias)
    assert y3.shape == (2, M // 2, out_f) and torch.equal(y3.view(M, out_f), want)
    with pytest.raises(ValueError, match="not a tiled K = 4 weight"):
        kernels.linear(x, wt, at[:, :-1], s, cb, k, in_f, bias)
