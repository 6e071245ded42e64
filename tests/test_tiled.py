"""The tiled layout (kbit_hf/format.py, "The tiled layout"): its byte definition, the round trip to the bit planes,
the reference ops on it, and KbitLinear's state_dict / save_pretrained staying in the bit planes while tiled. The
GPU kernels over it are checked in tests/gpu/test_kernels.py."""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kbit_hf import KbitConfig, KbitLinear
from kbit_hf import format as fmt
from kbit_hf import reference
from tiny_models import VOCAB, tiny_model


def _quantized(out_f, in_f, seed=0, k=4):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    w[0, :32] *= 1e-4  # a subnormal e4m4 block scale
    return reference.quantize(w, fmt.nf0_codebook(k), k, "e4m4")


def _tiled_by_definition(packed, absmax, out_f, in_f, k):
    """The layout byte by byte, exactly as format.py words it (slow; small shapes only)."""
    idx = fmt.unpack_bitplanes(packed, k).flatten(-2)
    if k == 3:
        return _tiled_k3_by_definition(idx, absmax, out_f, in_f)
    kb = 4 if k == 5 else k  # K = 5: K = 4's bytes of the low nibbles, then the high bits
    C, n = in_f // 128, 8 // kb
    wt = torch.zeros(out_f * in_f * k // 8, dtype=torch.uint8)
    at = torch.empty(out_f * in_f // 32, dtype=torch.uint8)
    for t in range(out_f // 16):
        for c in range(C):
            for g in range(8):
                for q in range(4):
                    for b in range(4):
                        for h in range(2):
                            for m in range(kb // 2):
                                for rh in range(2):
                                    r, e = 16 * t + g + 8 * rh, 128 * c + 32 * b + 8 * q + 4 * h + n * m
                                    byte = sum((int(idx[r, e + i]) & 15) << (kb * i) for i in range(n))
                                    chunk, lane = (t * C + c) * 256 * k, 4 * g + q
                                    bs = b ^ 2 if kb == 4 and g % 2 else b  # K = 4, 5: odd g swaps the halves
                                    wt[chunk + lane * 8 * kb + 2 * kb * bs + kb * h + 2 * m + rh] = byte
                                    for s in range(2 if k == 5 else 0):  # bit 4 of index s of the pair (j = 2 m + rh)
                                        bit = 32 * (b >> 1) + 16 * h + 8 * (b & 1) + 2 * (2 * m + rh) + s
                                        wt[chunk + 1024 + lane * 8 + bit // 8] |= (int(idx[r, e + s]) >> 4) << bit % 8
            for r in range(16):
                for b in range(4):
                    at[((t * C + c) * 16 + r) * 4 + b] = absmax[16 * t + r, 4 * c + b]
    return wt.view(out_f, -1), at.view(out_f, -1)


def _tiled_k3_by_definition(idx, absmax, out_f, in_f):
    """K = 3 as format.py words it: lane byte 12 gi + 4 wi + j holds in bits 0..5 the pair of register (h, j) of block
    b, (b, h) = (2 gi, 0), (2 gi, 1), (2 gi + 1, 0) for wi = 0, 1, 2, and in bits 6, 7 bits 2 wi, 2 wi + 1 of the pair
    of register (1, j) of block 2 gi + 1."""
    C = in_f // 128
    wt = torch.zeros(out_f * in_f * 3 // 8, dtype=torch.uint8)

    def pair(t, c, g, q, b, h, j):
        r, e = 16 * t + g + 8 * (j & 1), 128 * c + 32 * b + 8 * q + 4 * h + 2 * (j >> 1)
        return int(idx[r, e]) | int(idx[r, e + 1]) << 3

    for t in range(out_f // 16):
        for c in range(C):
            for g in range(8):
                for q in range(4):
                    for gi in range(2):
                        for wi in range(3):
                            for j in range(4):
                                b, h = 2 * gi + (wi == 2), int(wi == 1)
                                spare = pair(t, c, g, q, 2 * gi + 1, 1, j)
                                byte = pair(t, c, g, q, b, h, j) | ((spare >> 2 * wi) & 3) << 6
                                wt[(t * C + c) * 768 + (4 * g + q) * 24 + 12 * gi + 4 * wi + j] = byte
    at = absmax.view(out_f // 16, 16, C, 4).permute(0, 2, 1, 3).reshape(out_f, -1)
    return wt.view(out_f, -1), at


def test_k4_layout_pairs():
    """K = 4 in the words of the ninth session: byte 8 b + 4 h + j is the pair idx[e] | idx[e + 1] << 4 of row
    g + 8 (j & 1) at e = 128 c + 32 b + 8 q + 4 h + 2 (j >> 1); where g is odd at 8 (b ^ 2) + 4 h + j (twenty-fifth
    session: the lane's 16-byte halves swapped)."""
    packed, absmax, _ = _quantized(16, 256)
    idx = fmt.unpack_bitplanes(packed, 4).flatten(-2)
    wt = fmt.tile(packed, absmax, 256, 4)[0].flatten()
    for c, g, q, b, h, j in ((0, 0, 0, 0, 0, 0), (1, 7, 3, 3, 1, 3), (1, 2, 1, 2, 0, 1), (0, 5, 2, 1, 1, 2)):
        r, e = g + 8 * (j & 1), 128 * c + 32 * b + 8 * q + 4 * h + 2 * (j >> 1)
        bs = b ^ 2 if g % 2 else b
        assert int(wt[(c * 32 + 4 * g + q) * 32 + 8 * bs + 4 * h + j]) == int(idx[r, e]) | int(idx[r, e + 1]) << 4


@pytest.mark.parametrize("k", fmt.TILED_K)
@pytest.mark.parametrize("out_f,in_f", [(16, 256), (32, 512)])
def test_tile_matches_the_definition_and_round_trips(out_f, in_f, k):
    packed, absmax, _ = _quantized(out_f, in_f, k=k)
    wt, at = fmt.tile(packed, absmax, in_f, k)
    want_w, want_a = _tiled_by_definition(packed, absmax, out_f, in_f, k)
    assert wt.dtype == torch.uint8 and wt.shape == (out_f, in_f * k // 8) and at.shape == absmax.shape
    assert torch.equal(wt, want_w) and torch.equal(at, want_a)
    p2, a2 = fmt.untile(wt, at, in_f, k)
    assert torch.equal(p2, packed) and torch.equal(a2, absmax)


@pytest.mark.parametrize("k", fmt.TILED_K)
def test_tile_round_trip_many_tiles(k):
    packed, absmax, _ = _quantized(4096, 512, k=k)  # several row chunks of format._tile_rows
    p2, a2 = fmt.untile(*fmt.tile(packed, absmax, 512, k), 512, k)
    assert torch.equal(p2, packed) and torch.equal(a2, absmax)


def test_tile_refuses_what_the_layout_cannot_hold():
    packed, absmax, _ = _quantized(16, 256)
    with pytest.raises(ValueError, match="cannot tile"):
        fmt.tile(packed, absmax, 255, 4)
    p3, a3, _ = reference.quantize(torch.randn(20, 256), fmt.nf0_codebook(4), 4, "e4m4")  # out % 16 != 0
    with pytest.raises(ValueError, match="cannot tile"):
        fmt.tile(p3, a3, 256, 4)
    p4, a4, _ = reference.quantize(torch.randn(16, 256), fmt.nf0_codebook(4), 4, "fp16")
    with pytest.raises(ValueError, match="cannot tile"):
        fmt.tile(p4, a4, 256, 4)
    with pytest.raises(ValueError, match="cannot tile"):  # K = 4 planes called K = 2
        fmt.tile(packed, absmax, 256, 2)
    with pytest.raises(ValueError, match="not a tiled"):
        fmt.untile(packed, absmax, 256, 4)


@pytest.mark.parametrize("k", fmt.TILED_K)
def test_reference_ops_read_the_tiled_layout(k):
    packed, absmax, scale = _quantized(48, 768, k=k)
    cb = fmt.nf0_codebook(k)
    wt, at = fmt.tile(packed, absmax, 768, k)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(reference.dequantize(wt, at, scale, cb, k, 768, dtype),
                           reference.dequantize(packed, absmax, scale, cb, k, 768, dtype))
    x = torch.randn(3, 768, dtype=torch.bfloat16)
    assert torch.equal(reference.linear(x, wt, at, scale, cb, k, 768), reference.linear(x, packed, absmax, scale, cb,
                                                                                           k, 768))
    for other in set(fmt.TILED_K) - {k}:  # a tiled weight read as another K
        with pytest.raises(ValueError, match=f"not a tiled K = {other}"):
            reference.dequantize(wt, at, scale, fmt.nf0_codebook(other), other, 768)


def _layer(out_f=32, in_f=256, bias=True, k=4):
    layer = KbitLinear(in_f, out_f, bias, k, "e4m4", fmt.nf0_codebook(k), pre_quantized=False, dtype=torch.bfloat16)
    w = torch.randn(out_f, in_f, dtype=torch.bfloat16)
    for name, t in layer.quantize_param("weight", w).items():
        setattr(layer, name, torch.nn.Parameter(t, requires_grad=False))
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(out_f, dtype=torch.bfloat16), requires_grad=False)
    return layer


@pytest.mark.parametrize("k", fmt.TILED_K)
def test_kbit_linear_tiled_forward_and_state_dict(k):
    layer = _layer(k=k)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    y0 = layer(x)
    want = x.float() @ layer.dequantized_weight(torch.float32).T + layer.bias.float()
    torch.testing.assert_close(y0.float(), want, rtol=2**-7, atol=1e-2)  # one bf16 rounding of an fp32 result
    sd0 = {k: v.clone() for k, v in layer.state_dict().items()}
    assert not layer.tileable()  # on the CPU the layer keeps the bit planes unless forced
    assert layer.tile_(force=True) and layer.is_tiled and layer.weight.dtype == torch.uint8 and layer.is_packed
    assert torch.equal(layer(x), y0)
    sd = layer.state_dict()
    assert set(sd) == set(sd0) and all(torch.equal(sd[k], sd0[k]) and sd[k].dtype == sd0[k].dtype for k in sd)
    # load_state_dict into a tiled layer: the bit planes go in, the layer stays tiled
    other = _layer(k=k)
    other.tile_(force=True)
    other.load_state_dict(sd0)
    assert other.is_tiled and torch.equal(other(x), y0)
    layer.untile_()
    assert not layer.is_tiled and torch.equal(layer.weight, sd0["weight"]) and torch.equal(layer(x), y0)


def test_kbit_linear_does_not_tile_what_the_layout_cannot_hold():
    assert not _layer(out_f=24).tile_(force=True)  # out % 16
    assert not _layer(in_f=160).tile_(force=True)  # in % 256


def test_save_pretrained_of_a_tiled_model_writes_bit_planes(tmp_path):
    fp = tmp_path / "fp"
    tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=32).save_pretrained(fp)
    # on the CPU (a GPU machine would otherwise load to CUDA): both logits below then come from the reference ops
    model = AutoModelForCausalLM.from_pretrained(fp, quantization_config=KbitConfig(k=4), device_map="cpu")
    model.save_pretrained(tmp_path / "planes")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_logits = model(ids).logits
    layers = [m for m in model.modules() if isinstance(m, KbitLinear)]
    tiled = [m.tile_(force=True) for m in layers]  # all but o_proj (in = 4 heads x 32 = 128)
    assert sum(tiled) == len(layers) - model.config.num_hidden_layers
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref_logits)
    model.save_pretrained(tmp_path / "tiled")
    a = load_file(os.path.join(tmp_path / "planes", "model.safetensors"))
    b = load_file(os.path.join(tmp_path / "tiled", "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "tiled", device_map="cpu")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref_logits)
