"""The tiled layout (kbit_hf/backends/cuda/tiled.py): its byte definition and the round trip to the bit planes; and
KbitLinear's in-memory layout machinery (kbit_hf/ops.py): state_dict, load_state_dict, save_pretrained and device
moves speak the bit planes whatever layout a backend holds. The GPU kernels over the tiled layout are checked in
tests/gpu/test_tiled.py."""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kbit_hf import KbitConfig, KbitLinear, ops
from kbit_hf import format as fmt
from kbit_hf.backends import reference
from kbit_hf.backends.cuda import tiled
from kbit_hf.backends.cuda.tiled import TILED_K
from tiny_models import VOCAB, tiny_model


def _quantized(out_f, in_f, seed=0, k=4):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    w[0, :32] *= 1e-4  # a subnormal e4m4 block scale
    return reference.quantize(w, fmt.nf0_codebook(k), k, "e4m4")


def _tiled_by_definition(packed, absmax, out_f, in_f, k):
    """The layout byte by byte, exactly as tiled.py words it (slow; small shapes only)."""
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
    """K = 3 as tiled.py words it: lane byte 12 gi + 4 wi + j holds in bits 0..5 the pair of register (h, j) of block
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
    """K = 4 in words: byte 8 b + 4 h + j is the pair idx[e] | idx[e + 1] << 4 of row g + 8 (j & 1) at
    e = 128 c + 32 b + 8 q + 4 h + 2 (j >> 1); where g is odd at 8 (b ^ 2) + 4 h + j (the lane's 16-byte halves
    swapped)."""
    packed, absmax, _ = _quantized(16, 256)
    idx = fmt.unpack_bitplanes(packed, 4).flatten(-2)
    wt = tiled.tile_reference(packed, absmax, 256, 4)[0].flatten()
    for c, g, q, b, h, j in ((0, 0, 0, 0, 0, 0), (1, 7, 3, 3, 1, 3), (1, 2, 1, 2, 0, 1), (0, 5, 2, 1, 1, 2)):
        r, e = g + 8 * (j & 1), 128 * c + 32 * b + 8 * q + 4 * h + 2 * (j >> 1)
        bs = b ^ 2 if g % 2 else b
        assert int(wt[(c * 32 + 4 * g + q) * 32 + 8 * bs + 4 * h + j]) == int(idx[r, e]) | int(idx[r, e + 1]) << 4


@pytest.mark.parametrize("k", TILED_K)
@pytest.mark.parametrize("out_f,in_f", [(16, 256), (32, 512)])
def test_tile_matches_the_definition_and_round_trips(out_f, in_f, k):
    packed, absmax, _ = _quantized(out_f, in_f, k=k)
    wt, at = tiled.tile_reference(packed, absmax, in_f, k)
    want_w, want_a = _tiled_by_definition(packed, absmax, out_f, in_f, k)
    assert wt.dtype == torch.uint8 and wt.shape == (out_f, in_f * k // 8) and at.shape == absmax.shape
    assert torch.equal(wt, want_w) and torch.equal(at, want_a)
    p2, a2 = tiled.untile_reference(wt, at, in_f, k)
    assert torch.equal(p2, packed) and torch.equal(a2, absmax)


@pytest.mark.parametrize("k", TILED_K)
def test_tile_round_trip_many_tiles(k):
    packed, absmax, _ = _quantized(4096, 512, k=k)  # several row chunks of tiled._tile_rows
    p2, a2 = tiled.untile_reference(*tiled.tile_reference(packed, absmax, 512, k), 512, k)
    assert torch.equal(p2, packed) and torch.equal(a2, absmax)


def test_tile_refuses_what_the_layout_cannot_hold():
    packed, absmax, _ = _quantized(16, 256)
    with pytest.raises(ValueError, match="cannot tile"):
        tiled.tile_reference(packed, absmax, 255, 4)
    p3, a3, _ = reference.quantize(torch.randn(20, 256), fmt.nf0_codebook(4), 4, "e4m4")  # out % 16 != 0
    with pytest.raises(ValueError, match="cannot tile"):
        tiled.tile_reference(p3, a3, 256, 4)
    p4, a4, _ = reference.quantize(torch.randn(16, 256), fmt.nf0_codebook(4), 4, "fp16")
    with pytest.raises(ValueError, match="cannot tile"):
        tiled.tile_reference(p4, a4, 256, 4)
    with pytest.raises(ValueError, match="cannot tile"):  # K = 4 planes called K = 2
        tiled.tile_reference(packed, absmax, 256, 2)
    with pytest.raises(ValueError, match="not a tiled"):
        tiled.untile_reference(packed, absmax, 256, 4)


class _ReversedRows:
    """A stand-in backend layout for CPU tests: the rows of packed / absmax in reverse order, packed as int32."""

    name = "reversed rows"

    def holds(self, packed):
        return packed.dtype == torch.int32

    def wants(self, out_features, in_features, k, absmax_format, device):
        return torch.device(device).type == "cpu" and out_features % 16 == 0

    def from_planes(self, packed, absmax, in_features, k):
        return packed.view(torch.int32).flip(0), absmax.flip(0)

    def to_planes(self, packed, absmax, in_features, k):
        return packed.flip(0).view(torch.uint32), absmax.flip(0)


@pytest.fixture
def reversed_rows(monkeypatch):
    monkeypatch.setattr(ops, "_LAYOUTS", [_ReversedRows()])


def _layer(out_f=32, in_f=256, bias=True, k=4):
    layer = KbitLinear(in_f, out_f, bias, k, "e4m4", fmt.nf0_codebook(k), pre_quantized=False, dtype=torch.bfloat16)
    w = torch.randn(out_f, in_f, dtype=torch.bfloat16)
    for name, t in layer.quantize_param("weight", w).items():
        setattr(layer, name, torch.nn.Parameter(t, requires_grad=False))
    if bias:
        layer.bias = torch.nn.Parameter(torch.randn(out_f, dtype=torch.bfloat16), requires_grad=False)
    return layer


def test_kbit_linear_layout_state_dict_and_load(reversed_rows):
    layer = _layer()
    sd0 = {k: v.clone() for k, v in layer.state_dict().items()}
    assert layer.layout == "bit planes"
    layer.use_device_layout_()
    assert layer.layout == "reversed rows" and "layout=reversed rows" in repr(layer)
    sd = layer.state_dict()
    assert set(sd) == set(sd0) and all(torch.equal(sd[k], sd0[k]) and sd[k].dtype == sd0[k].dtype for k in sd)
    # load_state_dict into a layer held in the layout: the bit planes go in, the layer keeps the layout
    other = _layer()
    other.use_device_layout_()
    other.load_state_dict(sd0)
    assert other.layout == "reversed rows" and all(torch.equal(other.state_dict()[k], sd0[k]) for k in sd0)
    small = _layer(out_f=24)  # a weight the layout does not want keeps the bit planes
    small.use_device_layout_()
    assert small.layout == "bit planes"


def test_kbit_linear_dtype_cast_keeps_the_layout_and_format_dtypes(reversed_rows):
    layer = _layer()
    planes = layer.weight.clone()
    layer.use_device_layout_()
    layer.to(torch.float16)
    assert layer.layout == "reversed rows" and layer.weight_codebook.dtype == torch.float32
    assert layer.weight_absmax.dtype == torch.uint8 and layer.bias.dtype == torch.float16
    assert torch.equal(ops.bit_planes(layer.weight, layer.weight_absmax, 256, 4)[0], planes)


def test_save_pretrained_of_a_model_in_a_backend_layout_writes_bit_planes(tmp_path, monkeypatch):
    fp = tmp_path / "fp"
    tiny_model("llama", hidden_size=256, intermediate_size=512, head_dim=32).save_pretrained(fp)
    model = AutoModelForCausalLM.from_pretrained(fp, quantization_config=KbitConfig(k=4), device_map="cpu")
    model.save_pretrained(tmp_path / "planes")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref_logits = model(ids).logits
    monkeypatch.setattr(ops, "_LAYOUTS", [_ReversedRows()])
    layers = [m for m in model.modules() if isinstance(m, KbitLinear)]
    for m in layers:
        m.use_device_layout_()
    assert all(m.layout == "reversed rows" for m in layers)
    model.save_pretrained(tmp_path / "held")
    a = load_file(os.path.join(tmp_path / "planes", "model.safetensors"))
    b = load_file(os.path.join(tmp_path / "held", "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    monkeypatch.setattr(ops, "_LAYOUTS", [])
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "held", device_map="cpu")
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref_logits)
