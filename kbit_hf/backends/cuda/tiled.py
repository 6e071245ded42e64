"""The tiled layout: how large Linear weights (K = 2..5, e4m4 scales) sit in sm_90 GPU memory.

Checkpoints always hold the bit planes (kbit_hf/format.py); KbitLinear converts at load and on device moves
(kbit_hf/ops.py, `device_layout` / `bit_planes`), and `state_dict()` speaks the bit planes. A tiled weight is a
permutation of the bits of (packed, absmax) with the same byte counts: packed becomes uint8 [out, in * K / 8] (that
dtype marks it), absmax keeps its shape. The tiled GEMVs (csrc/kbit_tiled.cu) stream one (16-row tile, 128-element
chunk) unit after another with the TMA, each lane reading exactly its mma.sync A fragment.

Weights, 256 K bytes per (16-row tile t, 128-element chunk c), 8 K per lane l = 4 g + q (g < 8, q < 4).
K = 2, 4: byte ((t * C + c) * 32 + l) * 8 K + 2 K b + K h + 2 m + rh, for b < 4, h < 2, m < K / 2, rh < 2, holds
the 8 / K indices of row 16 t + g + 8 rh from element e = 128 c + 32 b + 8 q + 4 h + (8 / K) m on (index i at bits
K i): lane l's m16n8k16 A fragment of k slice (b, h). K = 4: byte 8 b + 4 h + j is the pair idx[e] | idx[e + 1] << 4
of row g + 8 (j & 1) at e = .. + 2 (j >> 1); K = 2: byte 4 b + 2 h + rh holds elements e .. e + 3 (two pairs).
K = 4 (and K = 5's low nibbles) swizzle the lane's two 16-byte halves: where g is odd, blocks 2, 3 come first (the
byte above at 8 (b ^ 2) + 4 h + j), so that the 16-byte shared-memory loads of a quarter warp (lanes l .. l + 7 at
32 l + 16 (g & 1)) hit distinct banks (without it each took 8 wavefronts instead of 4).
K = 5: a (tile, chunk) is 32 lanes x 32 bytes of the indices' low 4 bits, byte for byte K = 4's layout, then 32
lanes x 8 bytes of their high bits: bit 32 (b >> 1) + 16 h + 8 (b & 1) + 2 j + s of lane l's 64 (little-endian)
is bit 4 of index s of the pair in its low-nibble byte 8 b + 4 h + j (so the GEMV turns two pairs' high bits into
table-address bits with one shift, mask and add). K = 3: lane l's 24 bytes per chunk are 12 per block pair (2 gi,
2 gi + 1); byte 12 gi + 4 wi + j holds in bits 0..5 the pair idx[e] | idx[e + 1] << 3 of register (h, j) (as K = 4's
byte 8 b + 4 h + j) of (b, h) = (2 gi, 0), (2 gi, 1), (2 gi + 1, 0) for wi = 0, 1, 2, and in bits 6, 7 bits 2 wi,
2 wi + 1 of the pair of register (1, j) of block 2 gi + 1 (five integer operations gather those four). Block
scales, 64 bytes per (t, c): byte ((t * C + c) * 16 + r) * 4 + b is block 4 c + b of row 16 t + r.

`tile_reference` / `untile_reference` define the layout in pure PyTorch (the ground truth of the GPU kernels
kbit_tile / kbit_untile, and the CPU path); `tile` / `untile` run the GPU kernels on CUDA tensors.
"""

from __future__ import annotations

import torch

from ... import format as fmt
from . import dispatch, library

TILED_K = tuple(dispatch.TILED_MIN_NUMEL)


def is_tiled(packed: torch.Tensor) -> bool:
    return packed.dtype == torch.uint8


def _tile_rows(out: int, in_features: int):
    rows = dispatch.TILE_ROWS
    step = max(rows, (2**22 // max(1, in_features)) // rows * rows)  # bounded int64 temporaries
    return ((a, min(a + step, out)) for a in range(0, out, step))


def _k3_pairs(idx: torch.Tensor) -> torch.Tensor:
    """K = 3 indices [rows, in] -> pairs idx[e] | idx[e + 1] << 3 as [t, c, lane, gi, b & 1, h, j] (block b = 2 gi +
    (b & 1), register (h, j) of the lane's A fragment, as K = 4's pairs)."""
    rows, in_features = idx.shape
    v = idx.view(rows // 16, 2, 8, in_features // 128, 4, 4, 2, 2, 2)  # t, rh, g, c, b, q, h, j >> 1, s
    pair = v[..., 0] | v[..., 1] << 3
    return pair.permute(0, 3, 2, 5, 4, 6, 7, 1).reshape(rows // 16, in_features // 128, 32, 2, 2, 2, 4)


def _swizzle_halves(x: torch.Tensor, kb: int) -> torch.Tensor:
    """[t, c, g, q, b, ...] -> block b ^ 2 at position b for odd g, where the lane's bytes are K = 4's (kb = 4; its own
    inverse). Other kb: x."""
    if kb != 4:
        return x
    x = x.reshape(x.shape[0], x.shape[1], 4, 2, *x.shape[3:])  # t, c, g >> 1, g & 1, q, b, ...
    return torch.stack([x[:, :, :, 0], x[:, :, :, 1].roll(2, 4)], 3).flatten(2, 3)


def _tiled_bytes(idx: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [rows, in] (rows % 16 == 0) -> their tiled bytes [rows, in * k / 8]."""
    rows, in_features = idx.shape
    if k == 3:  # lane byte 12 gi + 4 wi + j: the pair of (b & 1, h) = (0, 0), (0, 1), (1, 0); bits 6, 7: (1, 1)'s
        p = _k3_pairs(idx)
        direct = torch.stack([p[..., 0, 0, :], p[..., 0, 1, :], p[..., 1, 0, :]], -2)  # t, c, lane, gi, wi, j
        wi = torch.arange(3, device=idx.device).view(3, 1)
        spare = (p[..., 1, 1, :].unsqueeze(-2) >> 2 * wi) & 3
        return (direct | spare << 6).to(torch.uint8).reshape(rows, -1)
    kb = 4 if k == 5 else k  # index bits in the main bytes (K = 5: the low nibbles)
    n, C = 8 // kb, in_features // 128
    shifts = torch.arange(0, 8, kb, device=idx.device)
    v = (idx & 15 if k == 5 else idx).view(rows // 16, 2, 8, C, 4, 4, 2, kb // 2, n)  # t, rh, g, c, b, q, h, m, index
    main = (v << shifts).sum(-1).permute(0, 3, 2, 5, 4, 6, 7, 1)  # t, c, g, q, b, h, m, rh
    main = _swizzle_halves(main, kb).reshape(rows // 16, C, -1)  # t, c, (g, q, bytes)
    if k == 5:
        hi = (idx >> 4).view(rows // 16, 2, 8, C, 2, 2, 4, 2, 2, 2)  # t, rh, g, c, b >> 1, b & 1, q, h, j >> 1, s
        # -> t, c, g, q, b >> 1, h, b & 1 (the lane's bytes), then bits j >> 1, rh, s (bit 4 (j >> 1) + 2 rh + s)
        hi = hi.permute(0, 3, 2, 6, 4, 7, 5, 8, 1, 9).reshape(rows // 16, C, 256, 8)
        high = (hi << torch.arange(8, device=idx.device)).sum(-1)
        main = torch.cat([main, high], -1)
    return main.to(torch.uint8).reshape(rows, -1)


def _tiled_indices(wt: torch.Tensor, in_features: int, k: int) -> torch.Tensor:
    """Inverse of _tiled_bytes: tiled bytes [rows, in * k / 8] -> indices [rows, in] (int64)."""
    rows = wt.shape[0]
    kb = 4 if k == 5 else k
    C = in_features // 128
    if k == 3:
        b = wt.reshape(rows // 16, C, 32, 2, 3, 4).long()  # t, c, lane, gi, wi, j
        wi = torch.arange(3, device=wt.device).view(3, 1)
        spare = (((b >> 6) & 3) << 2 * wi).sum(-2)
        p = torch.stack([b[..., 0, :] & 63, b[..., 1, :] & 63, b[..., 2, :] & 63, spare], -2)  # (b & 1, h) order
        p = p.view(rows // 16, C, 8, 4, 4, 2, 2, 2).permute(0, 7, 2, 1, 4, 3, 5, 6)  # t, rh, g, c, b, q, h, j >> 1
        return torch.stack([p & 7, p >> 3], -1).reshape(rows, in_features)
    shifts = torch.arange(0, 8, kb, device=wt.device)
    w = wt.reshape(rows // 16, C, 256 * k).long()
    byte = _swizzle_halves(w[..., :256 * kb].reshape(rows // 16, C, 8, 4, 4, 2, kb // 2, 2), kb)
    byte = byte.permute(0, 7, 2, 1, 4, 3, 5, 6)
    idx = (byte.unsqueeze(-1) >> shifts) & ((1 << kb) - 1)  # t, rh, g, c, b, q, h, m, index
    if k == 5:
        bits = (w[..., 256 * kb:].reshape(rows // 16, C, 256, 1) >> torch.arange(8, device=wt.device)) & 1
        # t, c, g, q, b >> 1, h, b & 1, j >> 1, rh, s -> t, rh, g, c, (b >> 1, b & 1), q, h, j >> 1, s
        bits = bits.reshape(rows // 16, C, 8, 4, 2, 2, 2, 2, 2, 2).permute(0, 8, 2, 1, 4, 6, 3, 5, 7, 9)
        idx = idx | bits.reshape(idx.shape) << 4
    return idx.reshape(rows, in_features)


def tile_reference(packed: torch.Tensor, absmax: torch.Tensor, in_features: int,
                   k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bit planes uint32 [out, in / 32 * k] + e4m4 absmax [out, nb] -> the tiled layout (K = 2..5; see above)."""
    out = packed.shape[0]
    fits = dispatch.tiled_layout_fits(out, in_features, k, "e4m4")
    if packed.dtype != torch.uint32 or absmax.dtype != torch.uint8 or not fits \
            or tuple(packed.shape) != (out, in_features // 32 * k) or tuple(absmax.shape) != (out, in_features // 32):
        raise ValueError(f"cannot tile packed {packed.dtype} {tuple(packed.shape)} / absmax {absmax.dtype} "
                         f"{tuple(absmax.shape)} for k={k}, in_features={in_features} (K in {TILED_K}, e4m4, "
                         f"out % {dispatch.TILE_ROWS}, in % {dispatch.TILE_IN})")
    C = in_features // 128
    wt = torch.empty((out, in_features * k // 8), dtype=torch.uint8, device=packed.device)
    for a, b in _tile_rows(out, in_features):
        wt[a:b] = _tiled_bytes(fmt.unpack_bitplanes(packed[a:b], k).flatten(-2), k)
    at = absmax.view(out // 16, 16, C, 4).permute(0, 2, 1, 3).reshape(out, -1).clone()
    return wt, at


def untile_reference(wt: torch.Tensor, at: torch.Tensor, in_features: int,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `tile_reference`: -> (packed uint32 [out, in / 32 * k], absmax uint8 [out, nb])."""
    out = wt.shape[0]
    if wt.dtype != torch.uint8 or tuple(wt.shape) != (out, in_features * k // 8) \
            or not dispatch.tiled_layout_fits(out, in_features, k, "e4m4"):
        raise ValueError(f"not a tiled K = {k} weight for in_features={in_features}: {wt.dtype} {tuple(wt.shape)}")
    C = in_features // 128
    packed = torch.empty((out, in_features // 32 * k), dtype=torch.uint32, device=wt.device)
    for a, b in _tile_rows(out, in_features):
        idx = _tiled_indices(wt[a:b], in_features, k)
        packed[a:b] = fmt.pack_bitplanes(idx.reshape(b - a, in_features // 32, 32), k)
    absmax = at.view(out // 16, C, 16, 4).permute(0, 2, 1, 3).reshape(out, -1).clone()
    return packed, absmax


class TiledLayout:
    """The ops.Layout of KbitLinear weights held tiled on sm_90 (dispatch.holds_tiled says which)."""

    name = "tiled"

    def holds(self, packed: torch.Tensor) -> bool:
        return is_tiled(packed)

    def wants(self, out_features, in_features, k, absmax_format, device) -> bool:
        return dispatch.holds_tiled(out_features, in_features, k, absmax_format, device)

    def from_planes(self, packed, absmax, in_features, k):
        return tile(packed, absmax, in_features, k)

    def to_planes(self, packed, absmax, in_features, k):
        return untile(packed, absmax, in_features, k)


def tile(packed, absmax, in_features, k):
    """tile_reference, on the GPU for CUDA tensors (bitwise the same bytes)."""
    return _relayout("kbit_tile", tile_reference, packed, absmax, in_features, k, to_tiled=True)


def untile(wt, at, in_features, k):
    """untile_reference, on the GPU for CUDA tensors (bitwise the same bytes)."""
    return _relayout("kbit_untile", untile_reference, wt, at, in_features, k, to_tiled=False)


def _relayout(kernel, reference_fn, w, a, in_features, k, to_tiled):
    """Bit planes (uint32 [out, in / 32 * k]) <-> tiled (uint8 [out, in * k / 8]). CPU tensors, and what the layout
    cannot hold, go to the reference (which raises the error that names the problem)."""
    from .kernels import on_device, stream_of

    out = w.shape[0]
    planes, tiled = (torch.uint32, in_features // 32 * k), (torch.uint8, in_features * k // 8)
    src, dst = (planes, tiled) if to_tiled else (tiled, planes)
    if (library.lib is None or not w.is_cuda or w.dtype != src[0] or a.dtype != torch.uint8
            or tuple(w.shape) != (out, src[1]) or tuple(a.shape) != (out, in_features // 32)
            or not dispatch.tiled_layout_fits(out, in_features, k, "e4m4")):
        return reference_fn(w, a, in_features, k)
    fn = getattr(library.lib, kernel)
    w, a = w.contiguous(), a.contiguous()
    w2 = torch.empty((out, dst[1]), dtype=dst[0], device=w.device)
    a2 = torch.empty_like(a)
    with on_device(w.device):
        rc = fn(w.data_ptr(), a.data_ptr(), k, out, in_features, w2.data_ptr(), a2.data_ptr(), stream_of(w.device))
    library.check(rc, kernel)
    return w2, a2
