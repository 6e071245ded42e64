"""The kbit storage format: codebooks, E4M4 scales and bit-plane packing (pure PyTorch).

This module is the contract between the quantizer, the kernels and checkpoints; docs/format.md describes the
same rules in prose. Everything here is deterministic and exact: the CUDA kernels reproduce it bit for bit.

Layout of a weight W[..., out, in] (leading dims = experts):
  blocks   32 consecutive elements of a row; the last block of a row is zero-padded when in % 32 != 0.
  packed   uint32 [..., out, n_blocks * k]: word j of block b holds bit j of the 32 indices, element i at bit i.
  absmax   uint8 E4M4 code (or float16) [..., out, n_blocks]: the block's max |w| divided by `scale`.
  scale    float32 [...]: a per-tensor (per-expert) power of two that puts the largest block absmax in (8, 16],
           so every block scale lands inside E4M4's [2^-14, 31] (or float16's normal range).
  codebook float32 [2^k], sorted, in [-1, 1].
Decoded weight: codebook[idx] * absmax_value * scale  (evaluated in float32 in that order).
"""

from __future__ import annotations

import torch

BLOCK = 32
SUPPORTED_K = (2, 3, 4, 5)
ABSMAX_FORMATS = ("e4m4", "fp16")
ABSMAX_DTYPES = {"e4m4": torch.uint8, "fp16": torch.float16}  # stored dtype of the block scales

# E4M4: 4 exponent bits, 4 mantissa bits, bias 11, IEEE-style subnormals, no sign, no inf/nan.
E4M4_BIAS = 11
E4M4_MAX = 31.0  # e=15, m=15: (1 + 15/16) * 2^4
E4M4_MIN = 2.0**-14  # e=0, m=1: 1/16 * 2^-10
# The per-tensor scale puts the largest block absmax at (2^(TOP-1), 2^TOP]. 16 leaves headroom below 31 and
# 2^18 of dynamic range below it for the other blocks of the same tensor.
SCALE_TOP_EXP = 4


def n_blocks(in_features: int) -> int:
    return (in_features + BLOCK - 1) // BLOCK


def nf_codebook(k: int) -> torch.Tensor:
    """Normal-float codebook: Phi^-1((i + 0.5) / 2^k) for i in 0..2^k-1, divided by the largest magnitude."""
    n = 2**k
    # Explicit CPU: this may run inside transformers' meta-device init context.
    p = (torch.arange(n, dtype=torch.float64, device="cpu") + 0.5) / n
    q = torch.special.ndtri(p)
    q = q / q.abs().max()
    return q.to(torch.float32)


def nf0_codebook(k: int) -> torch.Tensor:
    """Normal-float with an exact zero (the bitsandbytes NF4 construction, for any k): 2^(k-1) positive quantiles
    Phi^-1(linspace(p, 1/2, 2^(k-1) + 1)[:-1]), 2^(k-1) - 1 negative ones -Phi^-1(linspace(p, 1/2, 2^(k-1))[:-1]),
    and 0, divided by the largest magnitude; p = ((1 - 1/(2(n-1))) + (1 - 1/(2n))) / 2 with n = 2^k
    (0.9677 for k = 4, bitsandbytes' offset). For k = 4 this is bitsandbytes' NF4 table."""
    n = 2**k
    p = ((1 - 1 / (2 * (n - 1))) + (1 - 1 / (2 * n))) / 2
    pos = torch.special.ndtri(torch.linspace(p, 0.5, n // 2 + 1, dtype=torch.float64, device="cpu")[:-1])
    neg = -torch.special.ndtri(torch.linspace(p, 0.5, n // 2, dtype=torch.float64, device="cpu")[:-1])
    values = torch.cat([neg, torch.zeros(1, dtype=torch.float64, device="cpu"), pos]).sort().values
    return (values / values.abs().max()).to(torch.float32)


NAMED_CODEBOOKS = {"nf": nf_codebook, "nf0": nf0_codebook}


def check_k(k: int) -> None:
    if k not in SUPPORTED_K:
        raise ValueError(f"k={k!r} is not supported (expected one of {SUPPORTED_K})")


def check_codebook_size(codebook: torch.Tensor, k: int) -> None:
    if codebook.numel() != 2**k:
        raise ValueError(f"codebook has {codebook.numel()} entries; k={k} needs {2**k}")


def check_codebook_values(codebook: torch.Tensor, what: str = "codebook") -> None:
    """What a codebook may hold: finite float32 values in [-1, 1] (they multiply each block's absmax), strictly
    increasing (the index search relies on it, and so must their float32 roundings)."""
    cb = codebook.to(torch.float32)
    if not (torch.isfinite(cb).all() and (cb.abs() <= 1).all() and (cb.diff() > 0).all()):
        raise ValueError(f"{what} must be finite, strictly increasing values in [-1, 1] (as float32), got "
                         f"{codebook.tolist()}")


def make_codebook(k: int, codebook: str | list[float] | tuple[float, ...]) -> torch.Tensor:
    """The float32 codebook tensor for a config value (a name in NAMED_CODEBOOKS or an explicit list)."""
    if isinstance(codebook, str):
        if codebook not in NAMED_CODEBOOKS:
            raise ValueError(f"codebook: unknown codebook name {codebook!r} (expected one of "
                             f"{sorted(NAMED_CODEBOOKS)} or a list of floats)")
        return NAMED_CODEBOOKS[codebook](k)
    values = torch.tensor([float(v) for v in codebook], dtype=torch.float32, device="cpu")
    if values.numel() != 2**k:
        raise ValueError(f"codebook: expected {2**k} values for k={k}, got {values.numel()}")
    return values


def e4m4_table() -> torch.Tensor:
    """All 256 E4M4 values in code order (increasing), float32, exact."""
    code = torch.arange(256, dtype=torch.int64)
    e = code >> 4
    m = (code & 15).to(torch.float64)
    sub = m / 16 * 2.0**-10
    norm = (1 + m / 16) * torch.pow(2.0, (e - E4M4_BIAS).to(torch.float64))
    return torch.where(e == 0, sub, norm).to(torch.float32)


_E4M4 = e4m4_table()
# Midpoints between neighbouring codes; each needs at most 6 significant bits, so float32 holds them exactly.
_E4M4_MID = ((_E4M4[:-1].double() + _E4M4[1:].double()) / 2).to(torch.float32)
_ON_DEVICE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _on(constant: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module constant on `device`, copied there once: the reference ops run on CUDA tensors when the compiled library
    is missing, also inside CUDA-graph capture (static-cache decoding), where a copy from the host is an error."""
    if constant.device == device:
        return constant
    key = (id(constant), device)
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = constant.to(device)
    return _ON_DEVICE[key]


def e4m4_decode(code: torch.Tensor) -> torch.Tensor:
    return _on(_E4M4, code.device)[code.long()]


def e4m4_encode(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values in [0, 31] to the nearest E4M4 code; an exact tie goes to the even code.

    Raises on negative, NaN or out-of-range input: callers normalise first, nothing is clipped silently.
    """
    x = x.float()
    if x.numel() and not bool(((x >= 0) & (x <= E4M4_MAX)).all()):
        bad = x[~((x >= 0) & (x <= E4M4_MAX))][0].item()
        raise ValueError(f"absmax {bad} is outside the E4M4 range [0, {E4M4_MAX}]")
    mid = _on(_E4M4_MID, x.device)
    lo = torch.searchsorted(mid, x, right=False)  # number of midpoints strictly below x
    tie = torch.searchsorted(mid, x, right=True) != lo  # x equals midpoint lo
    code = torch.where(tie & (lo % 2 == 1), lo + 1, lo)  # midpoint lo lies between codes lo and lo+1
    return code.to(torch.uint8)


def tensor_scale(block_absmax: torch.Tensor) -> torch.Tensor:
    """Per-tensor power-of-two factor: largest block absmax / scale lands in (8, 16]. Reduces over the last two dims."""
    amax = block_absmax.float().amax(dim=(-2, -1))
    exp = torch.ceil(torch.log2(amax)) - SCALE_TOP_EXP
    # amax == 0 (an all-zero tensor): any scale works; use 1.
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp))
    return torch.pow(2.0, exp).to(torch.float32)


def encode_absmax(a: torch.Tensor, absmax_format: str) -> torch.Tensor:
    """Store normalised block scales. A nonzero scale never rounds to zero: it is raised to the smallest code."""
    check_absmax_format(absmax_format)
    if absmax_format == "e4m4":
        code = e4m4_encode(a)
        return torch.where((a > 0) & (code == 0), torch.ones_like(code), code)
    h = a.to(torch.float16)
    tiny = torch.full_like(h, 2.0**-24)
    return torch.where((a > 0) & (h == 0), tiny, h)


def check_absmax_format(absmax_format: str) -> None:
    if absmax_format not in ABSMAX_FORMATS:
        raise ValueError(f"absmax_format: unknown format {absmax_format!r} (expected one of {ABSMAX_FORMATS})")


def decode_absmax(stored: torch.Tensor) -> torch.Tensor:
    return e4m4_decode(stored) if absmax_format_of(stored) == "e4m4" else stored.float()


def codebook_midpoints(codebook: torch.Tensor) -> torch.Tensor:
    """Decision thresholds (c[i] + c[i+1]) * 0.5 computed in float32, as the kernels compute them."""
    c = codebook.float()
    return (c[:-1] + c[1:]) * 0.5


def nearest_index(y: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codebook entry: the count of midpoints strictly below y (a tie goes to the lower index)."""
    return torch.searchsorted(codebook_midpoints(codebook).to(y.device), y.contiguous(), right=False)


def pack_bitplanes(idx: torch.Tensor, k: int) -> torch.Tensor:
    """idx int64 [..., nb, 32] in [0, 2^k) -> uint32 [..., nb * k] bit planes."""
    lanes = torch.arange(BLOCK, device=idx.device, dtype=torch.int64)
    planes = torch.arange(k, device=idx.device, dtype=torch.int64)
    bits = (idx.unsqueeze(-2) >> planes.view(k, 1)) & 1  # [..., nb, k, 32]
    words = (bits << lanes).sum(dim=-1)  # [..., nb, k], values < 2^32
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.flatten(-2).view(torch.uint32)


_BYTE_SHIFTS = torch.arange(8, dtype=torch.uint8)


def unpack_bitplanes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint32 [..., nb * k] -> int64 indices [..., nb, 32]."""
    # Works on little-endian bytes in uint8 (small temporaries): byte b of word j holds bit j of elements 8b..8b+7.
    planes = packed.contiguous().view(torch.uint8).unflatten(-1, (-1, k, 4))  # [..., nb, k, 4]
    bits = (planes.unsqueeze(-1) >> _on(_BYTE_SHIFTS, packed.device)) & 1  # [..., nb, k, 4, 8]
    idx = bits[..., 0, :, :].clone()
    for j in range(1, k):
        idx |= bits[..., j, :, :] << j
    return idx.flatten(-2).long()  # [..., nb, 32]


def bits_per_weight(k: int, absmax_format: str) -> float:
    return k + (8 if absmax_format == "e4m4" else 16) / BLOCK


def packed_shapes(shape: tuple[int, ...], k: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the stored tensors for a float weight of `shape` [..., out, in]."""
    *lead, out, inp = shape
    nb = n_blocks(inp)
    return {
        "packed": (*lead, out, nb * k),
        "absmax": (*lead, out, nb),
        "scale": tuple(lead),
        "codebook": (2**k,),
    }


def check_fits(packed: torch.Tensor, absmax: torch.Tensor, scale: torch.Tensor, k: int, in_features: int) -> None:
    """The stored tensors of one weight fit together for k and in_features (bit planes; see packed_shapes)."""
    *lead, out, words = packed.shape
    nb = n_blocks(in_features)
    if words != nb * k or tuple(absmax.shape) != (*lead, out, nb) or tuple(scale.shape) != tuple(lead):
        raise ValueError(
            f"kbit tensors do not fit together for k={k}, in_features={in_features}: packed {tuple(packed.shape)}, "
            f"absmax {tuple(absmax.shape)}, scale {tuple(scale.shape)} (expected packed {(*lead, out, nb * k)}, "
            f"absmax {(*lead, out, nb)}, scale {tuple(lead)})"
        )


def absmax_format_of(absmax: torch.Tensor) -> str:
    """The absmax_format of stored block scales, from their dtype."""
    for name, dtype in ABSMAX_DTYPES.items():
        if absmax.dtype == dtype:
            return name
    raise ValueError(f"absmax tensor has dtype {absmax.dtype}; expected uint8 (e4m4) or float16 (fp16)")


def empty_quantized(shape: tuple[int, ...], k: int, absmax_format: str, device=None):
    """Uninitialised (packed, absmax, scale) tensors for a float weight of `shape` [..., out, in]."""
    check_absmax_format(absmax_format)
    shapes = packed_shapes(shape, k)
    return (torch.empty(shapes["packed"], dtype=torch.uint32, device=device),
            torch.empty(shapes["absmax"], dtype=ABSMAX_DTYPES[absmax_format], device=device),
            torch.empty(shapes["scale"], dtype=torch.float32, device=device))


def check_finite(w: torch.Tensor, what: str = "weight") -> None:
    # aminmax is one reduction with no full-size temporaries (NaN propagates into both ends, +-Inf shows at one);
    # torch.isfinite(w) would build 2.5x w's bytes in temporaries (abs, two masks), which was the largest allocation
    # of an on-the-fly MoE load (a whole layer's fused experts at once)
    if w.numel() == 0:
        return
    lo, hi = torch.aminmax(w)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        n = int((~torch.isfinite(w)).sum())
        raise ValueError(f"{what} contains {n} NaN/Inf value(s); kbit cannot quantize non-finite weights")


__all__ = [
    "BLOCK",
    "SUPPORTED_K",
    "ABSMAX_FORMATS",
    "ABSMAX_DTYPES",
    "check_absmax_format",
    "E4M4_MAX",
    "E4M4_MIN",
    "n_blocks",
    "nf_codebook",
    "nf0_codebook",
    "NAMED_CODEBOOKS",
    "make_codebook",
    "e4m4_table",
    "e4m4_encode",
    "e4m4_decode",
    "tensor_scale",
    "encode_absmax",
    "decode_absmax",
    "codebook_midpoints",
    "nearest_index",
    "pack_bitplanes",
    "unpack_bitplanes",
    "check_k",
    "check_codebook_size",
    "check_codebook_values",
    "bits_per_weight",
    "packed_shapes",
    "check_fits",
    "absmax_format_of",
    "empty_quantized",
    "check_finite",
]


def check_weight_to_quantize(weight, codebook, k: int, absmax_format: str) -> None:
    """What every quantize implementation requires of its arguments: a non-empty floating-point matrix [..., out, in]
    of finite values within float32's range, a codebook of 2^k entries, a known block-scale format."""
    if weight.dim() < 2 or 0 in weight.shape:
        raise ValueError(f"kbit quantizes matrices [..., out, in] with at least one element; got a tensor of shape "
                         f"{tuple(weight.shape)}")
    if not weight.is_floating_point():
        raise ValueError(f"kbit quantizes floating-point weights; got {weight.dtype}")
    check_k(k)
    check_codebook_size(codebook, k)
    check_absmax_format(absmax_format)
    check_finite(weight)
    if weight.dtype == torch.float64 and bool(weight.abs().amax() > torch.finfo(torch.float32).max):
        raise ValueError("weight has values beyond float32's range (|w| > 3.4e38); kbit computes in float32")
