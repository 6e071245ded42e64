"""The storage format: codebooks, E4M4, bit planes, padding, extreme scales, determinism."""

import pytest
import torch

from kbit_hf import format as fmt
from kbit_hf.backends import reference as ref


@pytest.mark.parametrize("k", fmt.SUPPORTED_K)
def test_nf_codebook_values(k):
    cb = fmt.nf_codebook(k)
    assert cb.dtype == torch.float32 and cb.numel() == 2**k
    assert torch.all(cb[1:] > cb[:-1])
    assert cb[0].item() == -1.0 and cb[-1].item() == 1.0
    torch.testing.assert_close(cb, -cb.flip(0), rtol=0, atol=1e-7)  # symmetric
    # Phi^-1((i + 0.5) / 2^k) / max, against an independent float64 computation via erfinv.
    p = (torch.arange(2**k, dtype=torch.float64) + 0.5) / 2**k
    q = torch.erfinv(2 * p - 1) * 2**0.5
    torch.testing.assert_close(cb, (q / q.abs().max()).float(), rtol=0, atol=1e-6)


def test_nf4_matches_known_values():
    # Phi^-1(31/32) = 1.862731867..., Phi^-1(17/32) = 0.078412413...
    cb = fmt.nf_codebook(4)
    assert abs(cb[8].item() - 0.078412413 / 1.862731867) < 1e-6


def test_e4m4_table_definition():
    t = fmt.e4m4_table()
    for code in range(256):
        e, m = code >> 4, code & 15
        want = m / 16 * 2.0**-10 if e == 0 else (1 + m / 16) * 2.0 ** (e - 11)
        assert t[code].item() == want
    assert t[1].item() == fmt.E4M4_MIN == 2.0**-14 and t[255].item() == fmt.E4M4_MAX == 31.0
    assert torch.all(t[1:] > t[:-1])


def test_e4m4_round_trip_and_rounding():
    t = fmt.e4m4_table()
    assert torch.equal(fmt.e4m4_encode(t).long(), torch.arange(256))
    mid = (t[:-1] + t[1:]) / 2
    # just below / above each midpoint go to the nearer code; exactly on it goes to the even code
    below = torch.nextafter(mid, torch.zeros_like(mid))
    above = torch.nextafter(mid, torch.full_like(mid, 100.0))
    codes = torch.arange(255)
    assert torch.equal(fmt.e4m4_encode(below).long(), codes)
    assert torch.equal(fmt.e4m4_encode(above).long(), codes + 1)
    on = fmt.e4m4_encode(mid).long()
    assert torch.equal(on, torch.where(codes % 2 == 0, codes, codes + 1))
    # dense sweep: encode picks a nearest value everywhere in range
    x = torch.rand(100_000) * 31
    err = (fmt.e4m4_decode(fmt.e4m4_encode(x)) - x).abs()
    best = (t.view(1, -1) - x.view(-1, 1)).abs().min(dim=1).values
    assert torch.equal(err, best)


@pytest.mark.parametrize("bad", [-1.0, 31.5, float("nan"), float("inf")])
def test_e4m4_rejects_out_of_range(bad):
    with pytest.raises(ValueError, match="E4M4"):
        fmt.e4m4_encode(torch.tensor([1.0, bad]))


@pytest.mark.parametrize("k", fmt.SUPPORTED_K)
def test_bitplane_round_trip(k):
    idx = torch.randint(0, 2**k, (5, 7, 32))
    packed = fmt.pack_bitplanes(idx, k)
    assert packed.dtype == torch.uint32 and packed.shape == (5, 7 * k)
    assert torch.equal(fmt.unpack_bitplanes(packed, k), idx)


def test_bitplane_layout_is_ballot_order():
    # block of 32 indices; word j holds bit j of every index, element i at bit i
    idx = torch.zeros(1, 1, 32, dtype=torch.int64)
    idx[0, 0, 0] = 0b101  # element 0: bits 0 and 2
    idx[0, 0, 31] = 0b010  # element 31: bit 1
    words = fmt.pack_bitplanes(idx, 3).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert words.tolist() == [[1, 1 << 31, 1]]
    idx5 = torch.zeros(1, 1, 32, dtype=torch.int64)
    idx5[0, 0, 0] = 0b00100  # element 0: bit 2
    idx5[0, 0, 31] = 0b01000  # element 31: bit 3
    words = fmt.pack_bitplanes(idx5, 5).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert words.tolist() == [[0, 0, 1, 1 << 31, 0]]


@pytest.mark.parametrize("k", fmt.SUPPORTED_K)
@pytest.mark.parametrize("absmax_format", fmt.ABSMAX_FORMATS)
@pytest.mark.parametrize("shape", [(1, 32), (3, 100), (17, 64), (4, 5, 70)])
def test_quantize_matches_definition(k, absmax_format, shape):
    """Independent element-wise check of the rules in docs/format.md."""
    w = torch.randn(shape, dtype=torch.float32)
    cb = fmt.nf_codebook(k)
    packed, absmax, scale = ref.quantize(w, cb, k, absmax_format)
    *lead, out, inp = shape
    nb = fmt.n_blocks(inp)
    assert packed.shape == (*lead, out, nb * k) and absmax.shape == (*lead, out, nb) and scale.shape == tuple(lead)
    deq = ref.dequantize(packed, absmax, scale, cb, k, inp)
    w3, d3, s1 = w.reshape(-1, out, inp), deq.reshape(-1, out, inp), scale.reshape(-1)
    for e in range(w3.shape[0]):
        s = s1[e].item()
        blk_max = torch.nn.functional.pad(w3[e].abs(), (0, nb * 32 - inp)).view(out, nb, 32).amax(-1)
        assert 8 < blk_max.max().item() / s <= 16 and float(torch.log2(s1[e])).is_integer()
        a = fmt.decode_absmax(absmax.reshape(-1, out, nb)[e])
        # the block scale is the representable value nearest to blk_max / s (e4m4: any of the 256 codes; fp16: IEEE
        # round to nearest)
        target = blk_max / s
        if absmax_format == "e4m4":
            nearest_code = (fmt.e4m4_table()[None, None, :] - target[..., None]).abs().min(-1).values
            assert torch.equal((a - target).abs(), nearest_code)
        else:
            assert torch.equal(a, target.half().float())
        for r in range(out):
            for j in range(inp):
                b = j // 32
                y = (w3[e, r, j] / s) / a[r, b]
                nearest = (cb - y).abs().min()
                got = d3[e, r, j] / (a[r, b] * s)
                assert abs((got - y).abs() - nearest) < 1e-5


@pytest.mark.parametrize("k", fmt.SUPPORTED_K)
@pytest.mark.parametrize("factor", [1e-6, 1e4])
def test_extreme_scales_are_not_clipped_or_flushed(k, factor):
    cb = fmt.nf_codebook(k)
    w = torch.randn(64, 96)
    rel_1 = (ref.dequantize(*ref.quantize(w, cb, k, "e4m4"), cb, k, 96) - w).norm() / w.norm()
    ws = w * factor
    rel = (ref.dequantize(*ref.quantize(ws, cb, k, "e4m4"), cb, k, 96) - ws).norm() / ws.norm()
    assert abs(rel - rel_1) < 0.02 and rel < {2: 0.5, 3: 0.25, 4: 0.12, 5: 0.07}[k]


@pytest.mark.parametrize("exp", [-20, 13])  # ~1e-6 and ~1e4, as powers of two
def test_power_of_two_rescaling_is_exact(exp):
    w = torch.randn(16, 70)
    cb = fmt.nf_codebook(4)
    a = ref.quantize(w, cb, 4, "e4m4")
    b = ref.quantize(w * 2.0**exp, cb, 4, "e4m4")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and b[2].item() == a[2].item() * 2.0**exp


def test_tiny_blocks_next_to_large_ones_keep_their_sign():
    # One block 1e-7 times smaller than the tensor's largest: below E4M4's range after scaling. It is raised to the
    # smallest code instead of being flushed to zero.
    w = torch.randn(2, 64)
    w[1, 32:] *= 1e-7
    cb = fmt.nf_codebook(4)
    packed, absmax, scale = ref.quantize(w, cb, 4, "e4m4")
    assert absmax[1, 1].item() == 1
    w = torch.randn(2, 64)
    w[1, 32:] *= 2.0**-40  # fp16 scales: rounds to 0 in fp16, stored as the smallest subnormal 2^-24
    packed, absmax, scale = ref.quantize(w, cb, 4, "fp16")
    assert absmax.dtype == torch.float16 and absmax[1, 1].item() == 2.0**-24
    deq = ref.dequantize(packed, absmax, scale, cb, 4, 64)
    assert torch.all(torch.sign(deq[1, 32:]) == torch.sign(w[1, 32:]))


def test_zero_blocks_and_padding():
    w = torch.randn(3, 40)
    w[0] = 0
    cb = fmt.nf_codebook(3)
    packed, absmax, scale = ref.quantize(w, cb, 3, "e4m4")
    deq = ref.dequantize(packed, absmax, scale, cb, 3, 40)
    assert deq.shape == (3, 40) and torch.all(deq[0] == 0)
    # the padding of the last block never leaks: a 40-wide row and the same row padded with zeros agree
    wp = torch.nn.functional.pad(w, (0, 24))
    deq_p = ref.dequantize(*ref.quantize(wp, cb, 3, "e4m4"), cb, 3, 64)
    torch.testing.assert_close(deq_p[:, :40], deq)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_is_deterministic_and_dtype_exact(dtype):
    w = torch.randn(33, 77).to(dtype)
    cb = fmt.nf_codebook(4)
    a = ref.quantize(w, cb, 4, "e4m4")
    b = ref.quantize(w.float(), cb, 4, "e4m4")  # low-precision inputs are exact in float32
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_non_finite_weights_rejected(dtype):
    for bad in (float("nan"), float("inf"), float("-inf")):
        w = torch.randn(3, 4, 40).to(dtype)
        w[1, 2, 37] = bad
        with pytest.raises(ValueError, match="1 NaN/Inf"):
            ref.quantize(w, fmt.nf_codebook(4), 4, "e4m4")
    fmt.check_finite(torch.randn(3, 4, 40).to(dtype))
    fmt.check_finite(torch.empty(0, 32, dtype=dtype))


def test_dequantize_rejects_inconsistent_tensors():
    cb = fmt.nf_codebook(4)
    packed, absmax, scale = ref.quantize(torch.randn(8, 64), cb, 4, "e4m4")
    with pytest.raises(ValueError, match="do not fit"):
        ref.dequantize(packed[:, :4], absmax, scale, cb, 4, 64)
    with pytest.raises(ValueError, match="do not fit"):
        ref.dequantize(packed, absmax, scale, cb, 4, 100)


def test_bits_per_weight():
    assert fmt.bits_per_weight(4, "e4m4") == 4.25
    assert fmt.bits_per_weight(3, "fp16") == 3.5


def test_worked_example_in_docs():
    """The K=2 example at the end of docs/format.md."""
    w = ((torch.arange(32, dtype=torch.float32) - 16) / 16).view(1, 32)
    packed, absmax, scale = ref.quantize(w, fmt.nf_codebook(2), 2, "e4m4")
    assert scale.item() == 0.0625 and absmax.item() == 0xF0
    idx = fmt.unpack_bitplanes(packed, 2)[0, 0]
    assert idx[0].item() == 0 and idx[20].item() == 2
    assert idx[16].item() == 1  # y = 0 is exactly the midpoint of -0.27703 and 0.27703: a tie goes to the lower index
    words = packed.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    assert (words[0, 1].item() >> 20) & 1 == 1 and (words[0, 0].item() >> 20) & 1 == 0


def test_nf0_codebook():
    # k = 4 reproduces bitsandbytes' NF4 table
    nf4_bnb = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
               -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
               0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
               0.7229568362236023, 1.0]
    torch.testing.assert_close(fmt.nf0_codebook(4), torch.tensor(nf4_bnb), rtol=0, atol=2e-4)
    for k in fmt.SUPPORTED_K:
        cb = fmt.nf0_codebook(k)
        assert cb.numel() == 2**k and torch.all(cb[1:] > cb[:-1]) and 0.0 in cb.tolist()
        assert cb[0].item() == -1.0 and cb[-1].item() == 1.0
    assert torch.equal(fmt.make_codebook(3, "nf0"), fmt.nf0_codebook(3))


def test_reference_refuses_what_it_cannot_quantize_or_decode():
    cb = fmt.nf0_codebook(4)
    w = torch.randn(4, 40)
    with pytest.raises(ValueError, match="k=6 is not supported"):
        ref.quantize(w, fmt.nf_codebook(6), 6, "e4m4")
    with pytest.raises(ValueError, match="codebook has 8 entries; k=4 needs 16"):
        ref.quantize(w, cb[:8], 4, "e4m4")
    p, a, s = ref.quantize(w, cb, 4, "e4m4")
    with pytest.raises(ValueError, match="codebook has 8 entries; k=4 needs 16"):
        ref.dequantize(p, a, s, cb[:8], 4, 40)
    with pytest.raises(ValueError, match="floating-point weights; got torch.int32"):
        ref.quantize(torch.ones(4, 32, dtype=torch.int32), cb, 4, "e4m4")
    with pytest.raises(ValueError, match="at least one element"):
        ref.quantize(torch.randn(0, 32), cb, 4, "e4m4")
    with pytest.raises(ValueError, match="beyond float32's range"):
        ref.quantize(torch.randn(4, 64, dtype=torch.float64) * 1e300, cb, 4, "e4m4")
    # float64 inside float32's range quantizes as its float32 values do
    w64 = torch.randn(4, 64, dtype=torch.float64)
    assert all(torch.equal(u, v) for u, v in zip(ref.quantize(w64, cb, 4, "e4m4"),
                                                   ref.quantize(w64.float(), cb, 4, "e4m4")))
