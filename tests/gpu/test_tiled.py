"""GPU tests of the tiled layout (kbit_hf/backends/cuda/tiled.py, csrc/kbit_tiled.cu): the tile / untile kernels
against tile_reference, the dequantize bitwise against the bit-plane kernel, the GEMV (M = 1..64; the library's choice
and each variant forced through kernels.linear_out) against float64, CUDA graphs, and KbitLinear / from_pretrained
holding large K = 2..5 layers tiled on sm_90."""

import functools

import pytest
import torch

from kbit_hf import format as fmt
from kbit_hf import ops
from kbit_hf.backends import reference
from kbit_hf.backends.cuda import kernels
from kbit_hf.backends.cuda.tiled import TILED_K, tile, tile_reference, untile
from .test_kernels import GEMV_REL_W, _assert_linear_close, _captured, _quantize_on_gpu, _ref_linear64

# (2000, 2304): tiles that do not split evenly over the SMs; (272, 768): fewer tiles than SMs, 3 items per tile
TILED_SHAPES = [(16, 256), (48, 512), (272, 768), (2000, 2304), (4096, 1024), (6144, 4096)]


def _sm90():
    return torch.cuda.get_device_capability()[0] >= 9


@functools.lru_cache(maxsize=64)  # every (shape, k): consecutive tests change k and shape first
def _quantized(shape, k=4):
    g = torch.Generator().manual_seed(shape[0] * 3 + shape[1])
    w = torch.randn(shape, generator=g)
    w[1, 32:64] *= 1e-5  # a subnormal e4m4 block scale
    return _quantize_on_gpu(w, fmt.nf0_codebook(k), k, "e4m4")


@pytest.mark.parametrize("k", TILED_K)
@pytest.mark.parametrize("shape", TILED_SHAPES, ids=str)
def test_tile_kernels_match_the_format(shape, k):
    p, a, _ = _quantized(shape, k)
    wt, at = tile(p.cuda(), a.cuda(), shape[1], k)
    rw, ra = tile_reference(p, a, shape[1], k)
    assert torch.equal(wt.cpu(), rw) and torch.equal(at.cpu(), ra)
    p2, a2 = untile(wt, at, shape[1], k)
    assert torch.equal(p2.cpu(), p) and torch.equal(a2.cpu(), a)


@pytest.mark.parametrize("k", TILED_K)
@pytest.mark.parametrize("shape", TILED_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=str)
def test_dequantize_tiled_is_bitwise_the_bit_plane_kernel(shape, dtype, k):
    p, a, s = (t.cuda() for t in _quantized(shape, k))
    cb = fmt.nf0_codebook(k).cuda()
    wt, at = tile(p, a, shape[1], k)
    got = kernels.dequantize(wt, at, s, cb, k, shape[1], dtype)
    assert torch.equal(got, kernels.dequantize(p, a, s, cb, k, shape[1], dtype))
    assert torch.equal(torch.ops.kbit.dequantize(wt, at, s, cb, k, shape[1], dtype), got)


@pytest.mark.parametrize("k", TILED_K)
def test_dequantize_grid_stride(k):
    """8192 x 8192: both dequantize kernels cap their grids (K = 3..5 bit planes at 64 blocks per SM, the tiled
    kernel at 64), so most threads take two or more blocks; both bitwise the reference."""
    g = torch.Generator(device="cuda").manual_seed(k)
    w = torch.randn(8192, 8192, device="cuda", generator=g, dtype=torch.bfloat16)
    cb = fmt.nf0_codebook(k).cuda()
    p, a, s = kernels.quantize(w, cb, k, "e4m4")
    want = reference.dequantize(p, a, s, cb, k, 8192).to(torch.bfloat16)
    assert torch.equal(kernels.dequantize(p, a, s, cb, k, 8192, torch.bfloat16), want)
    wt, at = tile(p, a, 8192, k)
    assert torch.equal(kernels.dequantize(wt, at, s, cb, k, 8192, torch.bfloat16), want)


@pytest.fixture(params=("auto", "range", "batch1", "batch2", "batch4", "batchk2"))
def tiled_kernel(request):
    """The tiled GEMV kernel (a kernels.TILED_KERNELS name): the library's choice, or forced through linear_out
    (csrc/kbit_api.h, kbit_gemv_tiled_kernel): the range kernel, or the batched kernel with 1, 2 or 4 consumer warps
    per tile (6144x4096 has 3 tiles per SM: two rounds at 4), or with the k range split over clusters of 2 CTAs (warps
    per tile by the cluster's tiles: 4 on 16x256, 1 on 6144x4096; on 16x256 one CTA of each cluster has no items)."""
    return request.param


def _tiled_linear(x, wt, at, s, cb, k, in_f, bias=None, kernel="auto"):
    """x @ W^T + bias for a tiled weight: `kernels.linear` for "auto" (the path KbitLinear runs: the library's choice
    of GEMV, dequantize + cuBLAS above 64 rows), else the GEMV variant `kernel` forced through `kernels.linear_out`
    into a NaN-poisoned output."""
    if kernel == "auto":
        return kernels.linear(x, wt, at, s, cb, k, in_f, bias)
    y = torch.full((x.shape[0], wt.shape[0]), float("nan"), dtype=x.dtype, device=x.device)
    return kernels.linear_out(x, wt, at, s, cb, k, in_f, bias, y, tiled_kernel=kernel)


@pytest.mark.parametrize("k", TILED_K)
@pytest.mark.parametrize("shape", TILED_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("M", (1, 2, 5, 8, 9, 16, 17, 32, 33, 40, 64, 65))
def test_gemv_tiled(shape, dtype, M, tiled_kernel, k):
    if not _sm90():
        pytest.skip("the tiled GEMV is sm_90")
    if M == 65 and tiled_kernel != "auto":
        pytest.skip("M = 65 is the dequantize + cuBLAS path")
    out_f, in_f = shape
    cb = fmt.nf0_codebook(k)
    p, a, s = _quantized(shape, k)
    g = torch.Generator().manual_seed(out_f + in_f + M)
    x = torch.randn(M, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype) if M % 2 else None
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f, bias)
    wt, at = tile(p.cuda(), a.cuda(), in_f, k)
    xb, bb, cb_, s_ = x.cuda(), None if bias is None else bias.cuda(), cb.cuda(), s.cuda()
    y = _tiled_linear(xb, wt, at, s_, cb_, k, in_f, bb, tiled_kernel)  # M = 65: dequantize (tiled) + cuBLAS
    _assert_linear_close(y, ref, mag, dtype, rel_w=GEMV_REL_W[dtype])
    assert torch.equal(_tiled_linear(xb, wt, at, s_, cb_, k, in_f, bb, tiled_kernel), y)  # deterministic
    if tiled_kernel != "auto":  # the forced variant ran into a NaN-poisoned output: checked above
        return
    _assert_linear_close(torch.ops.kbit.linear(xb, wt, at, s_, cb_, k, in_f, bb), ref, mag, dtype,
                         rel_w=GEMV_REL_W[dtype])
    if M <= 64:
        out = torch.full((M, out_f), float("nan"), dtype=dtype, device="cuda")
        kernels.linear_out(xb, wt, at, s_, cb_, k, in_f, bb, out)
        assert torch.equal(out, y)


@pytest.mark.parametrize("k", TILED_K)
@pytest.mark.parametrize("x_scale", (2.0**-30, 2.0**-12, 2.0**12), ids=str)
@pytest.mark.parametrize("M", (1, 9, 20, 64))
def test_gemv_tiled_activation_range(x_scale, M, tiled_kernel, k):
    """Very small and large bf16 activations (bf16 carries the block scales as raw bits against a table scaled by
    2^32: kbit_tiled.cu, TiledScales), on a weight whose rows 0..15 have only subnormal e4m4 block scales. (fp16
    decodes each scale as the other kernels do; its outputs for these rows would be fp16 subnormals.)"""
    if not _sm90():
        pytest.skip("the tiled GEMV is sm_90")
    dtype = torch.bfloat16
    out_f, in_f = 272, 768
    g = torch.Generator().manual_seed(M)
    w = torch.randn(out_f, in_f, generator=g)
    w[:16] *= 1e-5
    cb = fmt.nf0_codebook(k)
    p, a, s = reference.quantize(w, cb, k, "e4m4")
    assert (a[:16].int() < 16).all() and (a[16:].int() >= 16).all()  # rows 0..15: every block scale subnormal
    x = (torch.randn(M, in_f, generator=g) * x_scale).to(dtype)
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f, None)
    wt, at = tile(p.cuda(), a.cuda(), in_f, k)
    y = _tiled_linear(x.cuda(), wt, at, s.cuda(), cb.cuda(), k, in_f, None, tiled_kernel)
    _assert_linear_close(y, ref, mag, dtype, rel_w=GEMV_REL_W[dtype])
    # the small rows on their own scale: their outputs are about 1e-5 of the others'
    _assert_linear_close(y[:, :16], ref[:, :16], mag[:, :16], dtype, rel_w=GEMV_REL_W[dtype])


@pytest.mark.parametrize("k", TILED_K)
@pytest.mark.parametrize("kernel", ("batch1", "batch2", "batch4", "batch1k2", "batch2k2", "batch4k2"))
@pytest.mark.parametrize("M", (9, 24, 64))
def test_gemv_tiled_batched_rounds(kernel, M, k):
    """The batched kernel over several rounds of tiles per CTA (or cluster of CTAs), the last one partial and odd: 1.5
    rounds of 8 tiles per SM plus 3 (TILED_SHAPES stay within one round except at 4 warps per tile); each variant
    forced through linear_out."""
    if not _sm90():
        pytest.skip("the tiled GEMV is sm_90")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out_f, in_f = 16 * (12 * sms + 3), 512
    cb = fmt.nf0_codebook(k)
    p, a, s = _quantized((out_f, in_f), k)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, in_f, generator=g).to(torch.bfloat16)
    bias = torch.randn(out_f, generator=g).to(torch.bfloat16)
    ref, mag = _ref_linear64(x, p, a, s, cb, k, in_f, bias)
    wt, at = tile(p.cuda(), a.cuda(), in_f, k)
    y = _tiled_linear(x.cuda(), wt, at, s.cuda(), cb.cuda(), k, in_f, bias.cuda(), kernel)
    _assert_linear_close(y, ref, mag, torch.bfloat16, rel_w=GEMV_REL_W[torch.bfloat16])


@pytest.mark.parametrize("M", (1, 20))
def test_gemv_tiled_unaligned_activations(M):
    """x starting 2 elements into its storage (contiguous, not 16-byte aligned): linear computes on an aligned copy,
    linear_out (no allocation) refuses it with an error that names the problem."""
    if not _sm90():
        pytest.skip("the tiled GEMV is sm_90")
    out_f, in_f = 272, 768
    p, a, s = _quantized((out_f, in_f))
    cb = fmt.nf0_codebook(4)
    wt, at = tile(p.cuda(), a.cuda(), in_f, 4)
    x = torch.randn(M * in_f + 2, device="cuda", dtype=torch.bfloat16)[2:].view(M, in_f)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    y = kernels.linear(x, wt, at, s.cuda(), cb.cuda(), 4, in_f)
    assert torch.equal(y, kernels.linear(x.clone(), wt, at, s.cuda(), cb.cuda(), 4, in_f))
    with pytest.raises(ValueError, match="16-byte aligned"):
        kernels.linear_out(x, wt, at, s.cuda(), cb.cuda(), 4, in_f, None, torch.empty_like(y))


@pytest.mark.parametrize("k", TILED_K)
def test_tiled_cuda_graph_capture(k):
    if not _sm90():
        pytest.skip("the tiled GEMV is sm_90")
    out_f, in_f = 6144, 4096
    p, a, s = (t.cuda() for t in _quantized((out_f, in_f), k))
    cb = fmt.nf0_codebook(k).cuda()
    wt, at = tile(p, a, in_f, k)
    x = torch.randn(3, in_f, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(3, out_f, device="cuda", dtype=torch.bfloat16)
    graph = _captured(lambda: kernels.linear_out(x, wt, at, s, cb, k, in_f, None, y))
    x.copy_(torch.randn_like(x))
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, kernels.linear(x, wt, at, s, cb, k, in_f))


@pytest.mark.parametrize(
    "layouts,kernel,M",
    [("tttttt", "range", 1), ("tttttt", "range", 9), ("tttttt", "range", 40), ("tttttt", "batch", 24),
     ("tttttt", "batchk2", 24), ("tttttt", "batch1k2", 40), ("pppppp", "auto", 1), ("pppppp", "auto", 5),
     ("tpptpt", "auto", 1), ("tpptpt", "auto", 8)],
    ids=str,
)
def test_gemv_chain_ping_pong(layouts, kernel, M):
    """GEMVs back to back on one stream, each reading the output of the one before and writing over that one's input
    (two buffers); layouts: t tiled, p bit planes (tpptpt: each after the other, as k_proj after q_proj). With
    programmatic dependent launch (kbit_tiled.cu, pdl_wait) a tiled GEMV may start while the one before drains (1024 x
    1024 leaves most SMs without tiles, so it does): it must neither read its input early nor overwrite the input of
    the one before. Eager and replayed from a CUDA graph, bitwise against the same GEMVs each followed by a device
    synchronization (no overlap). `kernel`: the tiled GEMV variant linear_out runs (the bit planes ignore it)."""
    if "t" in layouts and not _sm90():
        pytest.skip("the tiled GEMV is sm_90")
    k, n, depth = 4, 1024, len(layouts)
    cb = fmt.nf0_codebook(k).cuda()
    layers = []
    for layout in layouts:
        p, a, s = kernels.quantize(torch.randn(n, n, device="cuda") / 32, cb, k, "e4m4")
        layers.append((*tile(p, a, n, k), s) if layout == "t" else (p, a, s))
    bufs = [torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]

    def chain(sync=False):
        for i, (w, a, s) in enumerate(layers):
            kernels.linear_out(bufs[i % 2], w, a, s, cb, k, n, None, bufs[(i + 1) % 2], tiled_kernel=kernel)
            if sync:
                torch.cuda.synchronize()

    def expected(x0):
        bufs[0].copy_(x0)
        chain(sync=True)
        return bufs[depth % 2].clone()

    x0 = torch.randn(M, n, device="cuda").bfloat16()
    ref = expected(x0)
    assert ref.isfinite().all() and ref.abs().max() > 0
    bufs[0].copy_(x0)
    bufs[1].fill_(float("nan"))
    chain()
    assert torch.equal(bufs[depth % 2], ref)
    graph = _captured(chain)
    for _ in range(3):
        x0 = torch.randn(M, n, device="cuda").bfloat16()
        ref = expected(x0)
        bufs[0].copy_(x0)
        bufs[1].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bufs[depth % 2], ref)


def _layer(out_f, in_f, dtype=torch.bfloat16, k=4):
    from kbit_hf import KbitLinear

    layer = KbitLinear(in_f, out_f, True, k, "e4m4", fmt.nf0_codebook(k), pre_quantized=False, dtype=dtype,
                       device="cuda")
    for name, t in layer.quantize_param("weight", torch.randn(out_f, in_f, device="cuda", dtype=dtype)).items():
        setattr(layer, name, torch.nn.Parameter(t, requires_grad=False))
    layer.bias = torch.nn.Parameter(torch.randn(out_f, device="cuda", dtype=dtype), requires_grad=False)
    return layer


def _held_tiled(layer) -> bool:
    """Put the layer's weight in the layout the backends want on its device; True when that is the tiled layout."""
    layer.use_device_layout_()
    return layer.layout == "tiled"


def _hold_bit_planes(layer) -> None:
    """Put a KbitLinear's weight back in the bit planes, whatever layout it is held in (the bit-plane kernels then run
    its forward)."""
    p, a = ops.bit_planes(layer.weight, layer.weight_absmax, layer.in_features, layer.k)
    layer.weight, layer.weight_absmax = (torch.nn.Parameter(t, requires_grad=False) for t in (p, a))
    assert layer.layout == "bit planes"


@pytest.mark.parametrize("k", TILED_K)
def test_kbit_linear_tiles_large_layers_on_sm90(k):
    big = _layer(6144, 4096, k=k)
    assert _held_tiled(big) == _sm90()
    # smaller layers by K (dispatch.TILED_MIN_NUMEL): 4096 x 4096 tiled for K = 3..5, 2048 x 4096 for K = 5 only
    assert _held_tiled(_layer(4096, 4096, k=k)) == (_sm90() and k != 2)
    assert _held_tiled(_layer(2048, 4096, k=k)) == (_sm90() and k == 5)
    assert not _held_tiled(_layer(1024, 4096, k=k))
    assert not _held_tiled(_layer(6144 + 8, 4096, k=k))  # out % 16
    if not _sm90():
        return
    sd = big.state_dict()  # the bit planes
    assert sd["weight"].dtype == torch.uint32 and sd["weight"].shape == fmt.packed_shapes((6144, 4096), k)["packed"]
    for M in (1, 16, 100):
        x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
        y = big(x)
        ref, mag = _ref_linear64(x.cpu(), sd["weight"].cpu(), sd["weight_absmax"].cpu(), sd["weight_scale"].cpu(),
                                 sd["weight_codebook"].cpu(), k, 4096, sd["bias"].cpu())
        _assert_linear_close(y, ref, mag, torch.bfloat16, rel_w=GEMV_REL_W[torch.bfloat16])


@pytest.mark.parametrize("k", TILED_K)
def test_kbit_linear_device_moves_choose_the_layout(k):
    """.cpu() holds the bit planes, .cuda() the tiled layout where KbitLinear holds the weight tiled (as
    from_pretrained places it); the bit planes come back unchanged and the outputs stay within the GEMV tolerance of
    the reference."""
    layer = _layer(6144, 4096, k=k)
    sd = {n: t.cpu() for n, t in layer.state_dict().items()}  # the bit planes
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    ref, mag = _ref_linear64(x.cpu(), sd["weight"], sd["weight_absmax"], sd["weight_scale"], sd["weight_codebook"], k,
                             4096, sd["bias"])
    layer.cpu()
    assert layer.layout == "bit planes" and torch.equal(layer.weight, sd["weight"])
    layer.cuda()
    assert (layer.layout == "tiled") == _sm90()
    _assert_linear_close(layer(x), ref, mag, torch.bfloat16, rel_w=GEMV_REL_W[torch.bfloat16])
    layer.to(torch.bfloat16)  # a dtype cast keeps the layout
    assert (layer.layout == "tiled") == _sm90()
    tiled = {n: t.clone() for n, t in layer.named_buffers()} | {n: t.clone() for n, t in layer.named_parameters()}
    layer.to(torch.float16)  # ... and the kbit tensors' dtypes and values; the bias follows the cast
    assert (layer.layout == "tiled") == _sm90() and layer.bias.dtype == torch.float16
    for n, t in list(layer.named_buffers()) + list(layer.named_parameters()):
        if n != "bias":
            assert t.dtype == tiled[n].dtype and torch.equal(t, tiled[n]), n
    _assert_linear_close(layer(x.half()), ref, mag, torch.float16, rel_w=GEMV_REL_W[torch.float16])
    layer.to(torch.bfloat16)
    layer.cpu()
    assert layer.layout == "bit planes" and torch.equal(layer.weight, sd["weight"])
    assert torch.equal(layer.weight_absmax, sd["weight_absmax"])


@pytest.mark.parametrize("k", TILED_K)
def test_from_pretrained_tiles_large_layers_and_saves_bit_planes(tmp_path, k):
    if not _sm90():
        pytest.skip("the tiled GEMV is sm_90")
    from transformers import AutoModelForCausalLM

    from kbit_hf import KbitConfig, KbitLinear
    from tiny_models import tiny_model

    fp = tmp_path / "fp"
    tiny_model("llama", hidden_size=4096, intermediate_size=4352, num_hidden_layers=1, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128).save_pretrained(fp)
    model = AutoModelForCausalLM.from_pretrained(fp, quantization_config=KbitConfig(k=k), device_map="cuda")
    tiled = {n for n, m in model.named_modules() if isinstance(m, KbitLinear) and m.layout == "tiled"}
    # the MLP's 4096 x 4352 layers; for K = 3..5 also q_proj and o_proj (4096 x 4096), never k_proj / v_proj (1024 x
    # 4096; dispatch.TILED_MIN_NUMEL)
    expected = {f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    if k != 2:
        expected |= {f"model.layers.0.self_attn.{p}" for p in ("q_proj", "o_proj")}
    assert tiled == expected
    ids = torch.randint(0, 64, (1, 5), device="cuda")
    with torch.no_grad():
        logits = model(ids).logits.float()
    model.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q", device_map="cuda")
    assert {n for n, m in again.named_modules() if isinstance(m, KbitLinear) and m.layout == "tiled"} == tiled
    with torch.no_grad():
        assert torch.equal(again(ids).logits.float(), logits)
    for m in again.modules():
        if isinstance(m, KbitLinear):
            _hold_bit_planes(m)
    with torch.no_grad():  # the bit-plane kernels: the same model within the GEMVs' rounding
        planes = again(ids).logits.float()
    assert ((planes - logits).norm() / logits.norm()).item() < 1e-2
