"""The CUDA kernels of the bit-plane layout (kbit_hf/backends/cuda/kernels.py) against the pure-PyTorch reference
(kbit_hf/backends/reference.py): quantize and dequantize bit for bit, the fused GEMVs within their rounding."""

import functools

import pytest
import torch

from kbit_hf import format as fmt
from kbit_hf.backends import reference
from kbit_hf.backends.cuda import dispatch, kernels, library

pytestmark = pytest.mark.cuda

KS = (2, 3, 4, 5)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (lead dims..., out, in): in not a multiple of 32 / 8, out = 1, experts
SHAPES = [(1, 32), (1, 7), (3, 50), (17, 1000), (5, 33), (64, 4096), (130, 264), (2, 5, 70), (4, 8, 96)]


def _weights(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))  # heavy-ish tails
    w[..., 0, :3] = 0  # zero block entries
    if shape[-2] > 2:
        w[..., 1, :] = 0  # an all-zero row (absmax 0)
    return w.to(dtype)


def _assert_same_quantized(ref, got):
    """(packed, absmax, scale) from the GPU equal the reference's bit for bit, dtypes and shapes included."""
    for name, r, g in zip(("packed", "absmax", "scale"), ref, got):
        assert g.dtype == r.dtype and g.shape == r.shape, name
        g = g.cpu()
        if r.dtype == torch.uint32:
            r, g = r.view(torch.int32), g.view(torch.int32)
        assert torch.equal(g, r), f"{name} differs at {(g != r).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("absmax_format", fmt.ABSMAX_FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_bitexact(k, dtype, absmax_format, shape):
    cb = fmt.nf_codebook(k)
    w = _weights(shape, dtype, seed=k * 1000 + len(shape) + shape[-1])
    ref = reference.quantize(w, cb, k, absmax_format)
    _assert_same_quantized(ref, kernels.quantize(w.cuda(), cb.cuda(), k, absmax_format))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_rejects_non_finite_weights(dtype):
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = torch.randn(3, 40, 70, device="cuda").to(dtype)
        w[2, 39, 69] = bad
        with pytest.raises(ValueError, match="1 NaN/Inf"):
            kernels.quantize(w, fmt.nf_codebook(4).cuda(), 4, "e4m4")


@pytest.mark.parametrize("k", KS)
def test_quantize_custom_codebook_and_scales(k):
    # a non-NF, asymmetric codebook; tiny and huge magnitudes in one tensor (E4M4 subnormals)
    cb = torch.sort(torch.rand(2**k, generator=torch.Generator().manual_seed(k)) * 2 - 1).values
    w = torch.randn(40, 160, generator=torch.Generator().manual_seed(7))
    w[3] *= 1e-5
    w[4] *= 1e4
    w[5, :32] = 1e-30
    for fmt_name in fmt.ABSMAX_FORMATS:
        got = kernels.quantize(w.cuda(), cb.cuda(), k, fmt_name)
        _assert_same_quantized(reference.quantize(w, cb, k, fmt_name), got)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("absmax_format", fmt.ABSMAX_FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_bitexact(k, out_dtype, absmax_format, shape):
    cb = fmt.nf_codebook(k)
    w = _weights(shape, torch.float32, seed=3 + k)
    p, a, s = reference.quantize(w, cb, k, absmax_format)
    ref = reference.dequantize(p, a, s, cb, k, shape[-1], out_dtype)
    out = torch.full(ref.shape, float("nan"), dtype=out_dtype, device="cuda")  # poison: every element must be written
    kernels.dequantize_out(p.cuda(), a.cuda(), s.cuda(), cb.cuda(), k, shape[-1], out)
    assert torch.equal(out.cpu(), ref)
    # through the custom op dispatcher too
    got = torch.ops.kbit.dequantize(p.cuda(), a.cuda(), s.cuda(), cb.cuda(), k, shape[-1], out_dtype)
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("k", (2, 5))
@pytest.mark.parametrize("dense", (True, False), ids=("dense", "ragged"))
def test_dequantize_grid_stride(k, dense):
    """More elements than one pass of the launch grid covers (128 blocks of 256 threads per SM, 16 elements per
    thread), so the grid-stride loop takes a second, partial turn: dense rows (in % 32 == 0) and ragged ones."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    one_pass = sms * 128 * 256 * 16
    inf = 8192 if dense else 8191
    out_f = one_pass // inf + 37
    cb = fmt.nf_codebook(k).cuda()
    w = torch.randn(out_f, inf, device="cuda", dtype=torch.bfloat16)
    p, a, s = kernels.quantize(w, cb, k, "e4m4")
    del w
    ref = reference.dequantize(p, a, s, cb, k, inf, torch.bfloat16)  # the pure-PyTorch reference, run on the GPU
    out = torch.full_like(ref, float("nan"))
    kernels.dequantize_out(p, a, s, cb, k, inf, out)
    assert torch.equal(out, ref)


@functools.lru_cache(maxsize=64)
def _weight32(p, a, s, codebook: tuple, k, inf):
    """The reference dequantization of one weight (float32 values, exact), run on the GPU. Cached per weight object
    (the cache holds it, so its identity stays its own): the tests' quantized weights are cached too, and
    reference.dequantize of a 6144 x 4096 weight takes seconds on the host."""
    cb = torch.tensor(codebook, dtype=torch.float32, device="cuda")
    return reference.dequantize(p.cuda(), a.cuda(), s.cuda(), cb, k, inf, torch.float32)


def _ref_linear64(x, p, a, s, cb, k, inf, bias=None):
    """float64 x @ W^T (+ bias) and the magnitudes |x| @ |W|^T (+ |bias|) that bound the rounding, W the reference
    dequantization; multiplied on the GPU, returned on the host."""
    w = _weight32(p, a, s, tuple(cb.tolist()), k, inf).double()
    xd = x.to("cuda", torch.float64)
    y, mag = xd @ w.T, xd.abs() @ w.abs().T
    if bias is not None:
        bd = bias.to("cuda", torch.float64)
        y, mag = y + bd, mag + bd.abs()
    return y.cpu(), mag.cpu()


def _assert_linear_close(y, ref, mag, dtype, rel_w=0.0, norm_check=True):
    eps = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}[dtype]
    err = (y.double().cpu() - ref).abs()
    # output rounding (one ulp) + fp32 accumulation + (dequant+cuBLAS path) weights rounded to the activation dtype
    tol = eps * ref.abs() + (1e-5 + rel_w) * mag + 1e-30
    assert bool((err <= tol).all()), f"max err {err.max().item()} vs tol {tol[err > tol][:3].tolist()}"
    # The per-element bound above is loose enough (~2^-7 of sum|x||w| in bf16) to pass a kernel that drops a block
    # or misreads 1 block scale in 16. Over >= 64 outputs of like rows the error's norm must also stay within
    # rounding: simulated, honest bf16 kernels stay near 0.0023 of the reference's norm and those bugs give
    # 0.012-0.048. (Not where one row dominates the norm: then it is one output's relative error, up to ~0.013.)
    if norm_check and ref.numel() >= 64:
        rel_norm = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9, torch.float32: 2.0**-14}[dtype]
        ratio = (err.norm() / ref.norm()).item()
        assert ratio <= rel_norm, f"relative error norm {ratio:.3g} > {rel_norm:.3g}"


# M <= 4 on (1, 4096), (300, 14336), (40, 4104), (37, 2088), (38, 2088) (and (4096, 4096) at K = 2, 3, M = 1 on an
# H100) runs the folded 8-row tiles (few rows, in >= 2048); 37 / 38 x 2088: a partial tile, step and block there,
# with fp16 block scales for K = 2, 5 / K = 4 (see _quantized)
GEMV_SHAPES = [(1, 32), (1, 4096), (7, 100), (33, 8), (256, 1000), (4096, 4096), (300, 14336), (64, 72), (40, 4104),
               (37, 1280), (37, 2088), (38, 2088)]
# The fused GEMV runs on the tensor cores: the weight reaches the MMA as activation-dtype values, cb and the block
# scale each rounded to bf16/fp16 and their product rounded once more (<= 3 roundings of 2^-9 / 2^-12 relative).
GEMV_REL_W = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _captured(fn):
    """A CUDA graph of fn(), after one warm-up call on a side stream (as torch recommends before capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _quantize_on_gpu(w, cb, k, absmax_format):
    """reference.quantize run on the GPU (the same pure-PyTorch ops), the results on the host: the tests' weights
    are inputs, and quantizing a 6144 x 4096 weight on the host took 9-20 s with the host's cores shared by the
    test workers."""
    return tuple(t.cpu() for t in reference.quantize(w.cuda(), cb.cuda(), k, absmax_format))


@functools.lru_cache(maxsize=64)  # every (shape, k) of the tests: consecutive tests change k and shape first
def _quantized(shape, k):
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1] + k)
    w = torch.randn(shape, generator=g)
    absmax_format = "fp16" if (shape[0] + k) % 3 == 0 else "e4m4"
    return _quantize_on_gpu(w, fmt.nf_codebook(k), k, absmax_format)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("M", (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64))
def test_gemv(k, dtype, M, shape):
    out_f, in_f = shape
    cb = fmt.nf_codebook(k)
    g = torch.Generator().manual_seed(out_f * 7 + in_f + M + k)
    p, a, s = _quantized(shape, k)
    x = torch.randn(M, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype) if out_f % 2 else None
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f, bias)
    out = torch.full((M, out_f), float("nan"), dtype=dtype, device="cuda")
    cb_, p_, a_, s_ = cb.cuda(), p.cuda(), a.cuda(), s.cuda()
    kernels.linear_out(x.cuda(), p_, a_, s_, cb_, k, in_f, None if bias is None else bias.cuda(), out)
    rel_w = GEMV_REL_W[dtype]
    _assert_linear_close(out, ref, mag, dtype, rel_w=rel_w)
    y = torch.ops.kbit.linear(x.cuda(), p_, a_, s_, cb_, k, in_f, None if bias is None else bias.cuda())
    _assert_linear_close(y, ref, mag, dtype, rel_w=rel_w)
    from kbit_hf.ops import linear_forward

    y = linear_forward(x.cuda().view(M, 1, in_f), p_, a_, s_, cb_, k, in_f, None if bias is None else bias.cuda())
    assert y.shape == (M, 1, out_f)
    _assert_linear_close(y.view(M, out_f), ref, mag, dtype, rel_w=rel_w)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("M", (1, 4, 5, 20, 40))
@pytest.mark.parametrize("shape", ((70, 1024), (37, 2080)), ids=str)
def test_gemv_misaligned_x(k, M, shape):
    """Activations 2 bytes off a 16-byte boundary (in % 8 == 0): the checked activation loads on every step
    (37 x 2080 at M <= 4: the folded tiles)."""
    (out_f, in_f), dtype = shape, torch.bfloat16
    cb = fmt.nf_codebook(k)
    g = torch.Generator().manual_seed(5 * M + k)
    p, a, s = reference.quantize(torch.randn(out_f, in_f, generator=g), cb, k, "e4m4")
    buf = torch.randn(M * in_f + 1, generator=g).to(dtype).cuda()
    x = buf[1:].view(M, in_f)
    assert x.data_ptr() % 16 != 0
    ref, mag = _ref_linear64(x.cpu(), p, a, s, cb, k, in_f)
    out = torch.full((M, out_f), float("nan"), dtype=dtype, device="cuda")
    kernels.linear_out(x, p.cuda(), a.cuda(), s.cuda(), cb.cuda(), k, in_f, None, out)
    _assert_linear_close(out, ref, mag, dtype, rel_w=GEMV_REL_W[dtype])


@pytest.mark.parametrize("M", (1, 8, 9, 40))
def test_gemv_refuses_rows_past_2_30(M):
    """Both fused kernels (M <= 8 and token tiles) keep 32-bit in-row offsets: the launcher refuses in > 2^30 with
    cudaErrorInvalidConfiguration (9) before reading anything (the small buffers here are never touched)."""
    x = torch.zeros(M, 64, dtype=torch.bfloat16, device="cuda")
    y = torch.zeros(M, 1, dtype=torch.bfloat16, device="cuda")
    p = torch.zeros(1, 8, dtype=torch.int32, device="cuda")
    a = torch.zeros(1, 2, dtype=torch.uint8, device="cuda")
    s = torch.ones((), device="cuda")
    cb = fmt.nf_codebook(4).cuda()
    rc = library.lib.kbit_gemv(x.data_ptr(), 2, M, p.data_ptr(), a.data_ptr(), 0, s.data_ptr(), cb.data_ptr(), 4,
                               1, 2**30 + 32, 0, y.data_ptr(), torch.cuda.current_stream().cuda_stream)
    assert rc == 9
    torch.cuda.synchronize()  # and nothing was launched that could fault


@pytest.mark.parametrize("k", (2, 4, 5))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", (9, 65, 300))
def test_linear_large_m(k, dtype, M):
    out_f, in_f = 192, 520
    cb = fmt.nf_codebook(k)
    g = torch.Generator().manual_seed(M + k)
    w = torch.randn(out_f, in_f, generator=g)
    p, a, s = reference.quantize(w, cb, k, "e4m4")
    x = torch.randn(M, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f, bias)
    y = torch.ops.kbit.linear(x.cuda(), p.cuda(), a.cuda(), s.cuda(), cb.cuda(), k, in_f, bias.cuda())
    assert y.dtype == dtype
    rel_w = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 1e-5}[dtype]
    _assert_linear_close(y, ref, mag, dtype, rel_w=rel_w)


def _expert_ref(x, ids, p, a, s, cb, k, in_f):
    """fp64 reference rows x[n] @ W[ids[n]]^T (zeros for ids outside [0, E)) and the magnitudes |x| @ |W|^T."""
    wd = reference.dequantize(p, a, s, cb, k, in_f, torch.float32).double()
    ref = torch.zeros(x.shape[0], wd.shape[1], dtype=torch.float64)
    mag = torch.zeros_like(ref)
    for e in range(wd.shape[0]):
        rows = ids == e
        ref[rows] = x[rows].double() @ wd[e].T
        mag[rows] = x[rows].double().abs() @ wd[e].abs().T
    return ref, mag


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32), ids=str)
@pytest.mark.parametrize("N", (1, 5, 64, 100, 1100))
@pytest.mark.parametrize("path", ("auto", "per_row", "grouped", "grouped_mm", "loop"))
@pytest.mark.parametrize("shape", ((40, 136), (20, 2080)), ids=str)
def test_expert_linear(k, dtype, N, path, shape):
    """Every expert path for every N: the library's per-row and grouped kernels, dequantize + torch._grouped_mm, the
    per-expert loop (one linear per expert present: the GEMV up to 64 rows, dequantize + cuBLAS above), each forced,
    and dispatch's own choice through the op and the eager entry. 20 x 2080 with few rows: the folded 8-row tiles (a
    partial tile and step), with fp16 block scales. Outputs are poisoned before each call; ids include -1 and E
    (expert-parallel sentinels: zero rows)."""
    if dtype == torch.float32 and path in ("per_row", "grouped"):
        pytest.skip("the library's kernels take fp16 / bf16 activations")
    if path == "grouped_mm" and (dtype != torch.bfloat16 or shape[0] % 8 or not dispatch.grouped_mm_runs_on(0)):
        pytest.skip("torch._grouped_mm: bf16, rows of 16-byte multiples, compute capability >= 9.0")
    E, (out_f, in_f) = 6, shape
    cb = fmt.nf_codebook(k)
    g = torch.Generator().manual_seed(N + k)
    w = torch.randn(E, out_f, in_f, generator=g)
    p, a, s = reference.quantize(w, cb, k, "e4m4" if in_f < 2048 else "fp16")
    x = torch.randn(N, in_f, generator=g).to(dtype)
    ids = torch.randint(-1, E + 1, (N,), generator=g)  # includes -1 and E (EP sentinels)
    ids[0] = -1 if N > 1 else 2
    if N >= 64:
        ids[ids == 3] = 4  # an expert with no rows
    args = (x.cuda(), ids.cuda(), p.cuda(), a.cuda(), s.cuda(), cb.cuda(), k, in_f)
    # poison the block the caching allocator will hand out for the output (0xFFFF: NaN in fp16 / bf16)
    torch.empty(N * out_f * 4, dtype=torch.uint8, device="cuda").fill_(0xFF)
    if path != "auto":
        outs = [kernels.expert_linear(*args, kernel=path)]
    else:
        from kbit_hf.ops import expert_linear_forward

        outs = [torch.ops.kbit.expert_linear(*args), expert_linear_forward(*args)]
    ref, mag = _expert_ref(x, ids, p, a, s, cb, k, in_f)
    valid = (ids >= 0) & (ids < E)
    # bf16 / fp16 rows may run the fused GEMV on either path (per row, or <= 64 rows of one expert)
    rel_w = 1e-5 if dtype == torch.float32 else GEMV_REL_W[dtype]
    for yy in outs:
        assert bool((yy[~valid.cuda()] == 0).all())
        _assert_linear_close(yy[valid.cuda()], ref[valid], mag[valid], dtype, rel_w=rel_w)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("N", (1, 65, 127, 128, 1000, 4096))
@pytest.mark.parametrize("shape", ((40, 320), (136, 2880), (256, 1024), (24, 64), (36, 320)), ids=str)
def test_expert_gemm(k, dtype, N, shape):
    """The grouped tensor-core expert GEMM against the fp64 reference: `out` not a multiple of the 128-row CTA (40,
    136) nor of 16 (40, 24) nor of 8 (36: the epilogue's one-output-at-a-time path; the others stage 16-byte chunks
    through shared memory), `in` with a last half group of 64 (320, 2880, 64: nothing else), fp16 block scales
    (2880), an expert with no rows, one expert with most rows, ids outside [0, E) (zero rows), 64, 128 and 256 rows
    per work item. The output is poisoned before the call."""
    if not dispatch.wgmma_runs_on(0):
        pytest.skip("the expert GEMM needs compute capability 9.0 and sm_90a code")
    E, (out_f, in_f) = 6, shape
    cb = fmt.nf_codebook(k)
    g = torch.Generator().manual_seed(N * 7 + k + out_f)
    w = torch.randn(E, out_f, in_f, generator=g)
    p, a, s = reference.quantize(w, cb, k, "fp16" if in_f == 2880 else "e4m4")
    s = s * torch.rand(E, generator=g).add(0.5)  # a distinct tensor scale per expert
    x = torch.randn(N, in_f, generator=g).to(dtype)
    ids = torch.randint(-1, E + 1, (N,), generator=g)  # includes -1 and E (EP sentinels)
    ids[ids == 3] = 4  # an expert with no rows
    if N >= 128:
        ids[: N // 2] = 1  # an expert with most rows (several work items)
    torch.empty(N * out_f * 4, dtype=torch.uint8, device="cuda").fill_(0xFF)
    y = kernels.expert_linear(x.cuda(), ids.cuda(), p.cuda(), a.cuda(), s.cuda(), cb.cuda(), k, in_f, kernel="gemm")
    ref, mag = _expert_ref(x, ids, p, a, s, cb, k, in_f)
    valid = (ids >= 0) & (ids < E)
    assert bool((y[~valid.cuda()] == 0).all())
    _assert_linear_close(y[valid.cuda()], ref[valid], mag[valid], dtype, rel_w=GEMV_REL_W[dtype])


def test_expert_gemm_refuses_bad_input():
    """Shapes the GEMM does not take are refused with the reason, not computed wrong."""
    if not dispatch.wgmma_runs_on(0):
        pytest.skip("the expert GEMM needs compute capability 9.0 and sm_90a code")
    k, E, out_f, in_f = 4, 2, 32, 160
    cb = fmt.nf_codebook(k).cuda()
    p, a, s = kernels.quantize(torch.randn(E, out_f, in_f, device="cuda"), cb, k, "e4m4")
    x = torch.randn(70, in_f, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(70, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="in_features=160"):
        kernels.expert_linear(x, ids, p, a, s, cb, k, in_f, kernel="gemm")
    with pytest.raises(ValueError, match="torch.float32"):
        kernels.expert_linear(x.float(), ids, p, a, s, cb, k, in_f, kernel="gemm")


@pytest.mark.parametrize("N", (9, 70, 300))
def test_expert_linear_grouped_rows_independent_of_order(N):
    """The grouped kernel's sort leaves the rows of one expert in any order, so the rows sharing a work item vary; a
    row's result must not depend on them: permuting the rows permutes the output bitwise."""
    k, E, out_f, in_f = 4, 3, 96, 520
    cb = fmt.nf_codebook(k).cuda()
    g = torch.Generator().manual_seed(N)
    p, a, s = (t.cuda() for t in reference.quantize(torch.randn(E, out_f, in_f, generator=g), cb.cpu(), k, "e4m4"))
    x = torch.randn(N, in_f, generator=g).to(torch.bfloat16).cuda()
    ids = torch.randint(0, E, (N,), generator=g).cuda()
    perm = torch.randperm(N, generator=g).cuda()
    y = kernels.expert_linear(x, ids, p, a, s, cb, k, in_f, kernel="grouped")
    yp = kernels.expert_linear(x[perm], ids[perm], p, a, s, cb, k, in_f, kernel="grouped")
    assert torch.equal(yp, y[perm])


@pytest.mark.parametrize("N", (0, 1, 7, 9, 4000))
def test_expert_linear_grouped_many_experts(N):
    """The grouped kernel's sort with more experts than rows and more buckets than one scan chunk (E = 1500, > 1024
    threads): every row lands in its expert's group. Compared bitwise with the per-row kernel: at under 8 rows per
    expert both run 8-row tiles in the same decode mode."""
    k, E, out_f, in_f = 3, 1500, 32, 64
    cb = fmt.nf_codebook(k).cuda()
    g = torch.Generator().manual_seed(N)
    p, a, s = (t.cuda() for t in reference.quantize(torch.randn(E, out_f, in_f, generator=g), cb.cpu(), k, "e4m4"))
    x = torch.randn(N, in_f, generator=g).to(torch.float16).cuda()
    ids = torch.randint(-2, E + 2, (N,), generator=g).cuda()
    y = kernels.expert_linear(x, ids, p, a, s, cb, k, in_f, kernel="grouped")
    y1 = torch.cat([kernels.expert_linear(x[i : i + 1000], ids[i : i + 1000], p, a, s, cb, k, in_f, kernel="per_row")
                    for i in range(0, N, 1000)]) if N else y
    assert torch.equal(y, y1)


@pytest.mark.parametrize("path", ("per_row", "grouped", "gemm", "grouped_mm"))
def test_expert_linear_in_a_cuda_graph(path):
    """Every expert path captures (no host sync) and, replayed on new routing and activations, matches eager: the
    grouped kernels' sort and the grouped_mm path's offsets are recomputed on the device at every replay."""
    if path == "grouped_mm" and not dispatch.grouped_mm_runs_on(0):
        pytest.skip("torch._grouped_mm needs compute capability >= 9.0")
    if path == "gemm" and not dispatch.wgmma_runs_on(0):
        pytest.skip("the expert GEMM needs compute capability 9.0 and sm_90a code")
    k, E, out_f, in_f, N = 4, 5, 64, 256, 200
    cb = fmt.nf_codebook(k).cuda()
    p, a, s = kernels.quantize(torch.randn(E, out_f, in_f, device="cuda"), cb, k, "e4m4")
    x = torch.randn(N, in_f, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(-1, E, (N,), device="cuda")
    y = torch.empty(N, out_f, device="cuda", dtype=torch.bfloat16)

    def step():
        y.copy_(kernels.expert_linear(x, ids, p, a, s, cb, k, in_f, kernel=path))

    graph = _captured(step)
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        ids.copy_(torch.randint(-1, E + 1, (N,), device="cuda", generator=g))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, kernels.expert_linear(x, ids, p, a, s, cb, k, in_f, kernel=path)), seed


@pytest.mark.parametrize("shape", ((512, 1024), (1024, 4096)), ids=str)  # 1024 x 4096: the folded tiles
def test_cuda_graph_capture(shape):
    k, (out_f, in_f) = 4, shape
    cb = fmt.nf_codebook(k).cuda()
    w = torch.randn(out_f, in_f, device="cuda")
    p, a, s = kernels.quantize(w, cb, k, "e4m4")
    x = torch.randn(2, in_f, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(2, out_f, device="cuda", dtype=torch.bfloat16)
    wd = torch.empty(out_f, in_f, device="cuda", dtype=torch.bfloat16)

    def step():
        kernels.linear_out(x, p, a, s, cb, k, in_f, None, y)
        kernels.dequantize_out(p, a, s, cb, k, in_f, wd)

    graph = _captured(step)
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    wd.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(wd, kernels.dequantize(p, a, s, cb, k, in_f, torch.bfloat16))
    assert torch.equal(y, kernels.linear(x, p, a, s, cb, k, in_f))


@pytest.mark.parametrize("absmax_format", fmt.ABSMAX_FORMATS)
def test_reference_linear_cuda_graph_capture(absmax_format):
    """The reference linear is what CUDA tensors run without the compiled library (kbit_hf/backends/cuda/__init__.py,
    register), also inside a captured decode step (static cache): after a warm-up call it must copy nothing from the
    host (format._on). (Without the library no tiled layout is registered: the reference sees bit planes only.)"""
    k, out_f, in_f = 3, 48, 512
    cb = fmt.nf_codebook(k).cuda()
    p, a, s = reference.quantize(torch.randn(out_f, in_f, device="cuda"), cb, k, absmax_format)
    x = torch.randn(3, in_f, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(3, out_f, device="cuda", dtype=torch.bfloat16)

    def step():
        y.copy_(reference.linear(x, p, a, s, cb, k, in_f))

    graph = _captured(step)
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, reference.linear(x, p, a, s, cb, k, in_f))


@pytest.mark.parametrize("M", (1, 24))
def test_gemv_chain_reads_the_previous_output(M):
    """GEMVs that each read the previous one's output, back to back on one stream (each must see the output of the
    kernel before it), eager and replayed from a CUDA graph into NaN-poisoned buffers with new inputs; against a
    float64 chain of the dequantized weights."""
    k, n, depth = 4, 1024, 6
    cb = fmt.nf_codebook(k).cuda()
    layers = [kernels.quantize(torch.randn(n, n, device="cuda") / 32, cb, k, "e4m4") for _ in range(depth)]
    ws = [kernels.dequantize(p, a, s, cb, k, n, torch.float64) for p, a, s in layers]
    bufs = [torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for _ in range(depth + 1)]

    def chain():
        for i, (p, a, s) in enumerate(layers):
            kernels.linear_out(bufs[i], p, a, s, cb, k, n, None, bufs[i + 1])

    def check():
        ref = bufs[0].double()
        for i, w in enumerate(ws):
            ref = ref @ w.T  # each step from the kernel's own (rounded) input, so errors do not compound
            got = bufs[i + 1].double()
            mag = bufs[i].double().abs() @ w.abs().T
            assert ((got - ref).abs() <= 2**-6 * mag + 1e-6).all(), f"layer {i}"  # weights + output rounding
            ref = got

    bufs[0].copy_(torch.randn(M, n, device="cuda"))
    chain()
    check()
    graph = _captured(chain)
    for _ in range(3):
        bufs[0].copy_(torch.randn(M, n, device="cuda"))
        for b in bufs[1:]:
            b.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check()


def test_huge_tensor():
    """> 2^31 elements: 64-bit indexing in quantize and dequantize."""
    free, _ = torch.cuda.mem_get_info()
    out_f, in_f, k = 65539, 32800, 2  # 2.15e9 elements, in % 32 != 0
    if free < 16 * 2**30:
        pytest.skip("needs 16 GiB of free GPU memory")
    cb = fmt.nf_codebook(k).cuda()
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
    w[-1, -1] = 100.0  # the tensor max sits in the checked tail rows, so their reference scale is the tensor's
    p, a, s = kernels.quantize(w, cb, k, "e4m4")
    tail = slice(out_f - 3, out_f)
    rp, ra, rs = reference.quantize(w[tail].cpu(), cb.cpu(), k, "e4m4")
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(p[tail].cpu().view(torch.int32), rp.view(torch.int32))
    assert torch.equal(a[tail].cpu(), ra)
    del w
    y = kernels.dequantize(p, a, s, cb, k, in_f, torch.bfloat16)
    ref = reference.dequantize(rp, ra, rs, cb.cpu(), k, in_f, torch.bfloat16)
    assert torch.equal(y[tail].cpu(), ref)
    head = reference.dequantize(p[:2].cpu(), a[:2].cpu(), s.cpu(), cb.cpu(), k, in_f, torch.bfloat16)
    assert torch.equal(y[:2].cpu(), head)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("absmax_format", fmt.ABSMAX_FORMATS)
def test_gemv_scales_and_tails(k, dtype, absmax_format):
    """Rows with tiny (subnormal e4m4) and large block scales, out % 16 != 0, in % 32 != 0, M = 1..64."""
    out_f, in_f = 37, 1000
    cb = fmt.nf_codebook(k)
    g = torch.Generator().manual_seed(11 * k)
    w = torch.randn(out_f, in_f, generator=g)
    w[3] *= 1e-4
    w[4, :64] *= 1e-5
    w[5] *= 30
    w[6] = 0
    p, a, s = reference.quantize(w, cb, k, absmax_format)
    for M in (1, 3, 8, 12, 32, 45, 64):
        x = torch.randn(M, in_f, generator=g).to(dtype)
        ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f)
        out = torch.full((M, out_f), float("nan"), dtype=dtype, device="cuda")
        kernels.linear_out(x.cuda(), p.cuda(), a.cuda(), s.cuda(), cb.cuda(), k, in_f, None, out)
        # row 5 (x30) dominates the norm, so a bound on it would be one output's relative error: per element only
        _assert_linear_close(out, ref, mag, dtype, rel_w=GEMV_REL_W[dtype], norm_check=False)
