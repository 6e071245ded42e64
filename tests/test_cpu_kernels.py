"""The compiled CPU kernels (csrc/cpu/, kbit_hf/backends/cpu/) against the reference: quantize and dequantize bit
for bit, the fused GEMVs within fp32 accumulation error, on odd shapes, every K, both block-scale formats, fp32
and bf16 activations, every instruction-set path this CPU runs; and a tiny model decoding the same greedy tokens
with the kernels as with the reference."""

import math
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from kbit_hf import KbitConfig, ops
from kbit_hf import format as fmt
from kbit_hf.backends import reference
from kbit_hf.backends.cpu import dispatch, kernels, library
from conftest import ReferenceOnCpu
from tiny_models import VOCAB, tiny_model

needs_lib = pytest.mark.skipif(not library.available(), reason=f"no CPU library: {library.load_error()}")
KS = (2, 3, 4, 5)
FORMATS = ("e4m4", "fp16")
SHAPES = ((37, 100), (1, 45), (33, 64), (5, 200))  # in not a multiple of 32 (and one that is), out odd


def test_library_is_built_where_a_compiler_is():
    """pip install builds libkbit_cpu.so with the C++ compiler (CMakeLists.txt); without a compiler there is none."""
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on the PATH")
    assert library.available(), f"a C++ compiler is installed but the CPU library did not load: {library.load_error()}"
    # the SIMD paths were compiled and the loader picked the best this CPU has (Linux: /proc/cpuinfo's flags)
    flags = set()
    if os.path.isfile("/proc/cpuinfo"):
        flags = set(next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")),
                         []))
    best = library.set_isa(library.ISA_NAMES[-1])
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vbmi", "gfni"} <= flags:
        assert best == "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        assert best == "avx2"


@pytest.fixture(params=library.ISA_NAMES)
def isa(request):
    """Each instruction-set path this CPU has (the best one last in use again afterwards)."""
    if not library.available():
        pytest.skip(f"no CPU library: {library.load_error()}")
    best = library.set_isa(library.ISA_NAMES[-1])  # capped at what the CPU has
    if library.set_isa(request.param) != request.param:
        library.set_isa(best)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    library.set_isa(best)


def _weight(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.rand(shape[-2:], generator=g).add_(0.1)  # uneven block scales


def _random(shape, dtype, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    assert bool((x != 0).all())
    return x.to(dtype)


def _assert_close(got, want, x, w):
    """got equals want up to the order of fp32 sums (a bound from |x| @ |W|^T), plus one rounding of the output to
    x's dtype where that is not fp32."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got).any()
    bound = 8 * x.shape[-1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    if got.dtype != torch.float32:
        bound = bound + 2.0**-7 * want.double().abs()
    err = (got.double() - want.double()).abs()
    assert bool((err <= bound + 1e-30).all()), f"max error {err.max().item():.3g} over the bound"


# ---- quantize / dequantize -------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("absmax_format", FORMATS)
@pytest.mark.parametrize("wdtype", (torch.float32, torch.bfloat16, torch.float16))
def test_quantize_is_bit_exact(isa, k, absmax_format, wdtype):
    cb = fmt.nf0_codebook(k)
    for i, shape in enumerate(SHAPES + ((3, 7, 70),)):  # the last: experts [E, out, in], one scale each
        for mag in (1.0, 1e-6, 1e4, 1e-39):  # the last: subnormal weights and scale
            w = (_weight(shape, i) * mag).to(wdtype)
            got, want = kernels.quantize(w, cb, k, absmax_format), reference.quantize(w, cb, k, absmax_format)
            for g, r in zip(got, want):
                assert g.dtype == r.dtype and g.shape == r.shape and torch.equal(g, r), (shape, mag)


def test_quantize_edge_values(isa):
    """Exact zeros, an all-zero block, ties between codebook entries, a block far below the tensor's largest."""
    cb = fmt.nf_codebook(3)
    mid = fmt.codebook_midpoints(cb)
    w = torch.zeros(4, 96)
    w[0, :7] = mid[:7] * 8  # block absmax 8 * max |mid|: values on the midpoints after scaling
    w[1, 32:64] = torch.linspace(-1e-5, 1e-5, 32)
    w[2] = torch.randn(96) * 3
    w[3, 5] = -0.0
    for absmax_format in FORMATS:
        for g, r in zip(kernels.quantize(w, cb, 3, absmax_format), reference.quantize(w, cb, 3, absmax_format)):
            assert torch.equal(g, r)


def test_block_scales_round_like_the_reference(isa):
    """Every E4M4 value up to 16, every midpoint between two (ties go to the even code) and the floats next to each
    midpoint, as block absmaxes of a tensor whose scale is 1; the same values for fp16 block scales."""
    e4m4 = fmt.e4m4_table()
    values = e4m4[e4m4 <= 16]
    mids = ((values[:-1].double() + values[1:].double()) / 2).float()
    near = torch.cat([torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(99.0))])
    tiny = torch.tensor([2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14 * 1.5, 65504 / 2.0**13])  # fp16 edges
    a = torch.cat([values, mids, near, tiny, torch.tensor([16.0])]).clamp(max=16)
    w = torch.zeros(1, 32 * a.numel())
    w[0, ::32] = a  # one value per block: the block's absmax
    w[0, 1::32] = -a / 3
    for absmax_format in FORMATS:
        for g, r in zip(kernels.quantize(w, fmt.nf0_codebook(3), 3, absmax_format),
                        reference.quantize(w, fmt.nf0_codebook(3), 3, absmax_format)):
            assert torch.equal(g, r), absmax_format


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("absmax_format", FORMATS)
def test_dequantize_is_bit_exact(isa, k, absmax_format):
    cb = fmt.nf0_codebook(k)
    for i, shape in enumerate(SHAPES + ((3, 7, 70), (5, 90))):
        mag = 1e-39 if i == len(SHAPES) + 1 else 1.0  # the last: subnormal weights and scale
        p, a, s = reference.quantize(_weight(shape, i) * mag, cb, k, absmax_format)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = reference.dequantize(p, a, s, cb, k, shape[-1], dtype)
            out = torch.full(want.shape, float("nan"), dtype=dtype)
            kernels.dequantize_out(p, a, s, cb, k, shape[-1], out)
            assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               want.view(torch.int16 if dtype != torch.float32 else torch.int32)), (shape, dtype)
            assert torch.equal(kernels.dequantize(p, a, s, cb, k, shape[-1], dtype), want)
    # dtypes the kernel does not write: decoded to fp32, then cast
    p, a, s = reference.quantize(_weight((5, 40), 9), cb, k, absmax_format)
    assert torch.equal(kernels.dequantize(p, a, s, cb, k, 40, torch.float64),
                       reference.dequantize(p, a, s, cb, k, 40, torch.float64))


# ---- linear ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("absmax_format", FORMATS)
@pytest.mark.parametrize("xdtype", (torch.float32, torch.bfloat16))
def test_linear_matches_reference(isa, k, absmax_format, xdtype):
    cb = fmt.nf0_codebook(k)
    for i, (out_f, in_f) in enumerate(SHAPES):
        p, a, s = reference.quantize(_weight((out_f, in_f), i), cb, k, absmax_format)
        w = reference.dequantize(p, a, s, cb, k, in_f)
        for M in (1, 3, 17, 65):
            x = _random((M, in_f), xdtype, 10 * i + M)
            for bias in (None, _random((out_f,), xdtype, 7 * i + M)):
                want = reference.linear(x, p, a, s, cb, k, in_f, bias)
                xb = x.float() if bias is None else torch.cat([x.float(), torch.ones(M, 1)], 1)
                wb = w if bias is None else torch.cat([w, bias.float()[:, None]], 1)
                out = torch.full((M, out_f), float("nan"), dtype=xdtype)  # the fused kernel at every M
                _assert_close(kernels.linear_out(x, p, a, s, cb, k, in_f, bias, out), want, xb, wb)
                _assert_close(kernels.linear(x, p, a, s, cb, k, in_f, bias), want, xb, wb)  # the dispatch rule
                y = kernels.linear(x.view(1, M, in_f), p, a, s, cb, k, in_f, bias)  # leading dims kept
                assert y.shape == (1, M, out_f) and torch.equal(y[0], kernels.linear(x, p, a, s, cb, k, in_f, bias))


@needs_lib
def test_linear_bias_in_another_dtype_and_strided_x():
    cb = fmt.nf0_codebook(4)
    p, a, s = reference.quantize(_weight((33, 70), 3), cb, 4, "e4m4")
    w = reference.dequantize(p, a, s, cb, 4, 70)
    x = _random((3, 140), torch.float32, 4)[:, ::2]  # not contiguous
    bias = _random((33,), torch.bfloat16, 5)
    want = reference.linear(x, p, a, s, cb, 4, 70, bias)
    _assert_close(kernels.linear(x, p, a, s, cb, 4, 70, bias), want, torch.cat([x, torch.ones(3, 1)], 1),
                  torch.cat([w, bias.float()[:, None]], 1))
    # fp16 activations go through the kernel too
    xh = x.half()
    _assert_close(kernels.linear(xh, p, a, s, cb, 4, 70), reference.linear(xh, p, a, s, cb, 4, 70), xh.float(), w)


@pytest.mark.parametrize("k", (3, 4))
@pytest.mark.parametrize("xdtype", (torch.float32, torch.bfloat16))
def test_expert_linear_matches_reference(isa, k, xdtype):
    cb = fmt.nf0_codebook(k)
    E, out_f, in_f = 3, 37, 100
    for absmax_format in FORMATS:
        p, a, s = reference.quantize(_weight((E, out_f, in_f), k), cb, k, absmax_format)
        w = reference.dequantize(p, a, s, cb, k, in_f)
        for N in (1, 5, 40, E * dispatch.linear_max_m() + 3):  # the last: grouped by expert in Python
            g = torch.Generator().manual_seed(N)
            ids = torch.randint(-1, E + 2, (N,), generator=g)  # -1, E, E + 1: sentinels, zero rows
            ids[0] = 1
            x = _random((N, in_f), xdtype, N)
            want = reference.expert_linear(x, ids, p, a, s, cb, k, in_f)
            got = kernels.expert_linear(x, ids, p, a, s, cb, k, in_f)
            valid = (ids >= 0) & (ids < E)
            assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))
            wr = w[ids.clamp(0, E - 1)]  # [N, out, in]: each row's weight
            bound = 8 * in_f * 2.0**-24 * torch.einsum("ni,noi->no", x.double().abs(), wr.double().abs())
            if xdtype != torch.float32:
                bound = bound + 2.0**-7 * want.double().abs()
            assert bool(((got.double() - want.double()).abs() <= bound + 1e-30).all()), N


class _CountingLibrary:
    """library.lib, recording which entry points each call reaches."""

    def __init__(self, lib):
        self._lib, self.calls = lib, []

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if not name.startswith("kbit_cpu_"):
            return fn

        def call(*args):
            self.calls.append(name)
            return fn(*args)

        return call


@needs_lib
def test_dispatch_rules(monkeypatch):
    assert set(dispatch.GEMV_DTYPES) == set(library.DTYPE_CODE)
    spy = _CountingLibrary(library.lib)
    monkeypatch.setattr(library, "lib", spy)
    cb = fmt.nf0_codebook(4)
    E, out_f, in_f = 3, 37, 100
    p, a, s = reference.quantize(_weight((E, out_f, in_f), 0), cb, 4, "e4m4")
    max_m = dispatch.linear_max_m()
    x = _random((E * max_m + 1, in_f), torch.float32, 1)
    for M, dtype, fused in ((1, torch.float32, True), (max_m, torch.bfloat16, True), (max_m + 1, torch.float32, False),
                            (2, torch.float64, False)):
        spy.calls.clear()
        kernels.linear(x[:M].to(dtype), p[0], a[0], s[0], cb, 4, in_f)
        assert spy.calls == (["kbit_cpu_gemv"] if fused else ["kbit_cpu_dequantize"]), (M, dtype)
    for N, one_call in ((E * max_m, True), (E * max_m + 1, False)):
        spy.calls.clear()
        kernels.expert_linear(x[:N], torch.arange(N) % E, p, a, s, cb, 4, in_f)
        assert (spy.calls == ["kbit_cpu_expert_gemv"]) == one_call, N


@needs_lib
def test_entry_points_check_their_inputs():
    cb = fmt.nf0_codebook(4)
    p, a, s = reference.quantize(_weight((8, 64), 0), cb, 4, "e4m4")
    x = _random((2, 64), torch.float32, 0)
    with pytest.raises(ValueError, match="do not fit together"):
        kernels.dequantize(p[:, :4], a, s, cb, 4, 64)
    with pytest.raises(ValueError, match="bit-plane layout"):
        kernels.dequantize(p.view(torch.uint8), a, s, cb, 4, 64)
    with pytest.raises(ValueError, match="do not fit a weight"):
        kernels.linear_out(x, p, a, s, cb, 4, 64, None, torch.empty(2, 9))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.linear_out(x, p, a, s, cb, 4, 64, None, torch.empty(8, 2).T)
    with pytest.raises(ValueError, match="entries"):
        kernels.linear(x, p, a, s, cb[:8], 4, 64)  # a wrong codebook leaves the fast path and is refused
    with pytest.raises(ValueError, match="must be on the CPU"):  # no pointer of another device reaches the library
        kernels.expert_linear(x, torch.zeros(2, dtype=torch.int64), p[None].to("meta"), a[None], s[None], cb, 4, 64)
    with pytest.raises(ValueError, match="must be on the CPU"):
        kernels.dequantize_out(p, a, s, cb, 4, 64, torch.empty(8, 64, device="meta"))


# ---- end to end ------------------------------------------------------------------------------------------------

@needs_lib
@pytest.mark.parametrize("family", ("llama", "qwen3_moe"))
def test_tiny_model_decodes_the_same_tokens(family, tmp_path):
    tiny_model(family, dtype=torch.float32).save_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))

    def run():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=KbitConfig(k=4))
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        return model.state_dict(), gen

    assert ops._EAGER_LINEAR.get("cpu") is kernels.linear
    sd, gen = run()
    with ReferenceOnCpu():
        assert "cpu" not in ops._EAGER_LINEAR
        sd_ref, gen_ref = run()
    assert ops._EAGER_LINEAR.get("cpu") is kernels.linear
    assert set(sd) == set(sd_ref) and all(torch.equal(sd[n], sd_ref[n]) for n in sd)  # quantize-on-load: same bytes
    assert torch.equal(gen, gen_ref)


@needs_lib
def test_thread_counts_give_the_same_result():
    """Rows are split between threads (ranges that cross the matrices of an expert tensor), never the sums of one row:
    any thread count gives the same bits, and quantize / dequantize stay the reference's."""
    cb = fmt.nf0_codebook(4)
    w = _weight((3, 101, 700), 1)
    want = reference.quantize(w, cb, 4, "e4m4")
    want_w = reference.dequantize(*want, cb, 4, 700)
    x = _random((3, 700), torch.float32, 2)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert all(torch.equal(g, r) for g, r in zip(kernels.quantize(w, cb, 4, "e4m4"), want))
            assert torch.equal(kernels.dequantize(*want, cb, 4, 700), want_w)
            results.append(kernels.linear(x, want[0][1], want[1][1], want[2][1], cb, 4, 700))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert math.isfinite(results[0].sum().item())
