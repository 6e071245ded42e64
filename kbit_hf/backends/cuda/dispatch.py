"""Which CUDA path runs: every rule of the Python side in one table. (Inside a fused GEMV, the variant for the
batch size, shape and GPU is the library's choice: csrc/kbit_dispatch.h. docs/design.md explains both.)

| rule | why |
|---|---|
| `linear`: fused GEMV for 1 <= M <= GEMV_MAX_M rows of fp16/bf16 | the GEMV reads the packed weight once and is bound by those bytes |
| `linear`, tiled weight, compute capability 9.0, GEMV_MAX_M < M <= GEMM_MAX_M rows of fp16/bf16 (GEMM_MAX_M_MID, GEMM_MAX_M_SMALL on smaller layers): the tiled tensor-core GEMM | decodes each weight tile once per 128-256 tokens in registers; no bf16 copy of the weight in memory; above those rows dequantize + cuBLAS is faster (numbers below) |
| `linear`, bit-plane weight of K <= PLANES_GEMM_MAX_K and at least PLANES_GEMM_MIN_IN inputs (a multiple of 8), GEMV_MAX_M < M <= PLANES_GEMM_MAX_M rows of fp16/bf16, a GPU whose shared memory holds the kernel (sm_80, sm_90): the bit-plane tensor-core GEMM | decodes each 128-row tile once per 64-128 tokens into shared memory and multiplies it with mma.sync; faster than dequantize + cuBLAS only there (numbers below) |
| `linear`, anything else: dequantize + cuBLAS | the fallback (other bit-plane shapes and GPUs, fp32 activations) |
| `expert_linear`, fp16 / bf16, at least EXPERT_GEMM_MIN_ROWS rows per expert on average, in_features % 64 == 0, compute capability 9.0: the library's grouped expert GEMM (tensor cores, decoded in registers) | reads each expert tile once per 64-256 of its rows and feeds the tensor cores; faster than the GEMV from about 12 rows per expert and than dequantize + grouped_mm everywhere (numbers below) |
| `expert_linear`, bf16, at least EXPERT_GROUPED_MM_MIN_ROWS rows per expert on average, compute capability >= 9.0 (where the GEMM does not run): every expert dequantized to bf16, then `torch._grouped_mm` | with that many rows per expert the tensor-core grouped GEMM outruns the GEMV-class kernel by more than the dequantization costs (numbers below) |
| `expert_linear`, other fp16 / bf16: the library's expert kernel (per-row, or rows grouped by expert: its choice) | sorts the rows by expert on the device (no host sync, capturable) and reads each expert tile once per up to 64 of its rows |
| `expert_linear`, fp32 activations: one `linear` per expert present | the reference-precision path; one host sync |
| KbitMoE, fp16 / bf16, inference, one token or at most E / 4 rows (tokens x top-k; E / 2 from 64 experts: `moe_fused`), SiLU or gpt-oss gating: the whole experts block as two library kernels (`moe_experts`: gate_up with the gating in its epilogue, down with the routing-weighted sum over the top-k) | each row reads its expert's tile: one token's rows name distinct experts, and while rows share one only now and then that costs less than sorting the rows by expert; fusing drops the rows' repeat, the gating and the weighted sum (numbers below) |
| tiled layout: e4m4 scales, out % 16 == 0, in % 256 == 0, out * in >= TILED_MIN_NUMEL[K], sm_90 | the tiled GEMV streams whole tiles with the TMA; on smaller layers a persistent kernel's start costs more than it saves |
"""

from __future__ import annotations

import torch

from . import library

GEMV_MAX_M = 64  # the fused GEMVs take 1..64 activation rows
GEMV_DTYPES = (torch.bfloat16, torch.float16)

# Measured against the bit planes on an H100: 4096 x 4096 tiled is 1.04-1.19x faster at M = 1..8 for K = 3, 4 and
# 1.00-1.42x at M = 1..64 for K = 5, while K = 2 loses there (0.93x at M = 1); K = 5 also gains on 2048 x 4096.
TILED_MIN_NUMEL = {2: 4096 * 4096 + 1, 3: 4096 * 4096, 4: 4096 * 4096, 5: 2048 * 4096}
TILE_ROWS, TILE_IN = 16, 256  # the tiled layout's unit: 16 rows x 256 inputs (two 128-element chunks)

_sm90: dict[int, bool] = {}
_wgmma: dict[int, bool] = {}


def tiled_gemv_runs_on(index: int) -> bool:
    """The tiled GEMV runs on CUDA device `index` (sm_90 or newer: bulk async copies). Cached: asked per call."""
    ok = _sm90.get(index)
    if ok is None:
        ok = _sm90[index] = library.lib is not None and torch.cuda.get_device_capability(index)[0] >= 9
    return ok


def wgmma_runs_on(index: int) -> bool:
    """The library's wgmma GEMMs (the tiled GEMM, the grouped expert GEMM) run on CUDA device `index`: compute
    capability 9.0 exactly and a library built with sm_90a machine code, as the library says. Cached: asked per
    call."""
    ok = _wgmma.get(index)
    if ok is None:
        ok = library.lib is not None and torch.cuda.get_device_capability(index) == (9, 0)
        if ok:
            with torch.cuda.device(index):
                ok = library.lib.kbit_wgmma_available() == 1
        _wgmma[index] = ok
    return ok


def tiled_layout_fits(out_features: int, in_features: int, k: int, absmax_format: str) -> bool:
    return k in TILED_MIN_NUMEL and absmax_format == "e4m4" and out_features % TILE_ROWS == 0 \
        and in_features % TILE_IN == 0


def holds_tiled(out_features: int, in_features: int, k: int, absmax_format: str, device) -> bool:
    """A KbitLinear weight of this shape and format is held tiled on `device`."""
    device = torch.device(device)
    if device.type != "cuda" or library.lib is None:
        return False
    return (tiled_layout_fits(out_features, in_features, k, absmax_format)
            and out_features * in_features >= TILED_MIN_NUMEL[k]
            and tiled_gemv_runs_on(device.index if device.index is not None else torch.cuda.current_device()))


def linear_uses_gemv(M: int, dtype: torch.dtype) -> bool:
    return 0 < M <= GEMV_MAX_M and dtype in GEMV_DTYPES


# The tiled GEMM runs up to GEMM_MAX_M rows on the largest layers (at least GEMM_LARGE_NUMEL weights), up to
# GEMM_MAX_M_MID on layers of more than GEMM_SMALL_NUMEL, and up to GEMM_MAX_M_SMALL on those; above, dequantize + cuBLAS
# is faster. Time ratio bf16 / kbit, K = 4 (GEMM | dequantize + cuBLAS):
#   H100:  4096x4096    M=256 0.63 | 0.58   M=512 0.58 | 0.66   M=1024 0.69 | 0.76
#          14336x4096   M=512 0.81 | 0.63   M=1024 0.74 | 0.77  M=2048 0.83 | 0.81   M=4096 0.78 | 0.84
#          4096x14336   M=512 0.70 | 0.61   M=1024 0.75 | 0.75  M=2048 0.78 | 0.86
#          28672x8192   M=1024 0.89 | 0.73  M=2048 0.93 | 0.81  M=4096 0.90 | 0.97
#   H200:  4096x4096    M=256 0.72 | 0.61   M=512 0.65 | 0.67   M=1024 0.83 | 0.78
#          6144x4096    M=256 0.64 | 0.54   M=512 0.76 | 0.68   M=1024 0.71 | 0.80
#          14336x4096   M=512 0.91 | 0.70   M=1024 0.79 | 0.80
#          4096x14336   M=512 0.78 | 0.68   M=1024 0.87 | 0.84
#          28672x8192   M=1024 0.81 | 0.76 and 0.82 | 0.83 (two runs of an older GEMM; the H100's 0.89 | 0.73 decides)
# (H200 6144x4096 at 512, 4096x4096 and 4096x14336 at 1024 favour the GEMM with the current kernel; the H100 is not
# measured there with it, so the rule keeps dequantize + cuBLAS)
GEMM_MAX_M, GEMM_MAX_M_MID, GEMM_MAX_M_SMALL = 1024, 512, 256
GEMM_SMALL_NUMEL, GEMM_LARGE_NUMEL = 6144 * 4096, 28672 * 8192


def linear_uses_gemm(M: int, dtype: torch.dtype, out_features: int, in_features: int) -> bool:
    """For a tiled weight on a device where wgmma_runs_on."""
    numel = out_features * in_features
    most = (GEMM_MAX_M if numel >= GEMM_LARGE_NUMEL else GEMM_MAX_M_SMALL if numel <= GEMM_SMALL_NUMEL
            else GEMM_MAX_M_MID)
    return GEMV_MAX_M < M <= most and dtype in GEMV_DTYPES


# The bit-plane GEMM (kernels.gemm_planes_out, mma.sync) runs for bit-plane weights of K <= PLANES_GEMM_MAX_K and at
# least PLANES_GEMM_MIN_IN inputs at GEMV_MAX_M < M <= PLANES_GEMM_MAX_M rows; elsewhere dequantize + cuBLAS is as fast
# or faster. Microseconds, H200, at M = 65 / 128 (bit-plane GEMM K = 2, 3, 4, 5 | dequantize + cuBLAS, K = 4):
#   4096x14336   68.4 71.0 71.0 91.6 | 77.9     68.2 71.5 70.3 91.1 | 79.4
#   8192x28672   251 261 255 335 | 287          248 258 249 334 | 284
#   28672x8192   288 305 298 391 | 278          274 296 287 376 | 285
#   rows of 4096 inputs (14336x4096, 6144x4096, 4096x4096) tie or lose at 65-128 rows, and from 256 rows dequantize +
#   cuBLAS is 1.4-2.7x faster everywhere (docs/performance.md's H200 table: an earlier build of the kernel)
# Its decode is bound by the SMs' issue rate and dequantize + cuBLAS by memory bandwidth at these rows, so GPUs with
# less bandwidth per SM (the A100) should favour it more (not measured). It needs 155-203 KB of shared memory per CTA:
# sm_80 and sm_90, not sm_86 / sm_89 (99 KB), which keep dequantize + cuBLAS.
PLANES_GEMM_MAX_M, PLANES_GEMM_MIN_IN, PLANES_GEMM_MAX_K = 128, 14336, 4


def linear_uses_planes_gemm(M: int, dtype: torch.dtype, in_features: int, k: int) -> bool:
    """For a bit-plane weight on a device where planes_gemm_runs_on."""
    return (GEMV_MAX_M < M <= PLANES_GEMM_MAX_M and dtype in GEMV_DTYPES and in_features >= PLANES_GEMM_MIN_IN
            and in_features % 8 == 0 and k <= PLANES_GEMM_MAX_K)


_planes_gemm: dict[tuple[int, int], bool] = {}


def planes_gemm_runs_on(index: int, k: int) -> bool:
    """The library's bit-plane GEMM runs for K = k on CUDA device `index` (its shared memory holds the kernel's
    stages, as the library says). Cached: asked per call."""
    ok = _planes_gemm.get((index, k))
    if ok is None:
        ok = library.lib is not None and torch.cuda.get_device_capability(index)[0] >= 8
        if ok:
            with torch.cuda.device(index):
                ok = library.lib.kbit_gemm_planes_workspace(128, 128, 256, k, 0) >= 0
        _planes_gemm[(index, k)] = ok
    return ok


# One experts block (kbit-bench experts) on an H100, K = 4, microseconds, the library's grouped kernel | dequantize +
# grouped_mm, by mean rows per expert:
#   Qwen3-30B-A3B (128 experts)  32 rows 748 | 1399   128 rows 2944 | 2354   512 rows 10284 | 5542
#   Mixtral-8x7B (8 experts)     16 rows 793 | 2520   128 rows 3338 | 3181   512 rows 12323 | 5955
#   gpt-oss-20b (32 experts)     8 rows 491 | 1525    64 rows 2103 | 1709
# Interpolated, the two cross near 85 (Qwen3), 120 (Mixtral) and 50 (gpt-oss-20b) rows. The rule runs only where the
# expert GEMM does not (inputs not a multiple of 64, GPUs other than compute capability 9.0).
EXPERT_GROUPED_MM_MIN_ROWS = 48


# The library's grouped expert GEMM (tensor cores) from EXPERT_GEMM_MIN_ROWS rows per expert on average. One experts
# block on an H100, K = 4, microseconds, grouped expert GEMV | GEMM (| dequantize + grouped_mm), by mean rows per
# expert:
#   Qwen3-30B-A3B (128 experts)  8 rows 340 | 439   16 rows 540 | 478   32 rows 757 | 555 | 1374
#   Mixtral-8x7B (8 experts)     16 rows 803 | 777   32 rows 1155 | 795   512 rows 12410 | 4364 | 5696
# The two cross near 12 rows per expert; the GEMM beats dequantize + grouped_mm at every size measured (64 to 65536
# rows).
EXPERT_GEMM_MIN_ROWS = 12
EXPERT_GEMM_MAX_E = 8192  # the rows' sort counts its buckets in shared memory (csrc: EXPERT_GROUPED_MAX_E)


# The fused experts block for one token (its top-k rows name distinct experts, so each row reading its expert reads
# what a sort by expert would) and for several tokens of up to E / 2 rows on layers of at least MOE_MANY_EXPERTS
# experts, E / 4 on fewer. Rows then share an expert now and then, and the fused block reads it once per row; on
# Qwen3-30B-A3B's 128 small experts (2.5 MB at K = 4) that costs less than the per-projection path's sorts, row
# repeat, gating and sum up to E / 2 rows, on Mixtral-8x7B's 8 experts of 94 MB it does not (E / 2 = 4 rows). The
# threshold of 64 experts lies between the two measured shapes; gpt-oss-20b's 32 (13 MB) was not measured at E / 2.
# One experts block on an H100, K = 4, microseconds, fused | the per-row GEMV path | the grouped GEMV path (rows
# sorted by expert), by tokens (Qwen3-30B-A3B's 2-16 tokens in one later run):
#   Qwen3-30B-A3B (128 experts, top-8)  1: 25.7 | 41.5 | 49.5   2: 35.0 | 56.1 | 61.0   4: 59.4 | 75.6 | 85.8
#                                       8 (E / 2 rows): 101.6 | 115.0 | 118.3   16: 189.3 | 199.6 | 166.7
#   gpt-oss-20b (32 experts, top-4)     1: 50.2 | 63.8 | 72.2   2: 81.2 | 96.2 | 109.6  4: ... | 161.1 | 157.0
#   Mixtral-8x7B (8 experts, top-2)     1: 115.6 | 126.0 | 143.0  2 (E / 2): 212.8 | 217.1 | 197.1
#                                       4: 399.7 | 403.5 | 404.7
MOE_MANY_EXPERTS = 64


def moe_fused(tokens: int, top_k: int, experts: int, dtype: torch.dtype) -> bool:
    most_rows = experts // (2 if experts >= MOE_MANY_EXPERTS else 4)
    return dtype in GEMV_DTYPES and (tokens == 1 or 0 < tokens * top_k <= most_rows)


def expert_gemm_fits(in_features: int) -> bool:
    return in_features % 64 == 0  # the kernel decodes groups of 4 blocks and a last one of 2


def expert_linear_path(N: int, E: int, out_features: int, in_features: int, dtype: torch.dtype, index: int) -> str:
    """"gemm", "grouped_mm", "kernel" or "loop" (see the table above)."""
    if (dtype in GEMV_DTYPES and N >= EXPERT_GEMM_MIN_ROWS * E and E <= EXPERT_GEMM_MAX_E
            and expert_gemm_fits(in_features) and wgmma_runs_on(index)):
        return "gemm"
    if (dtype == torch.bfloat16 and N >= EXPERT_GROUPED_MM_MIN_ROWS * E and out_features % 8 == 0
            and in_features % 8 == 0 and grouped_mm_runs_on(index)):
        return "grouped_mm"
    return "kernel" if dtype in GEMV_DTYPES else "loop"


_grouped_mm: dict[int, bool] = {}


def grouped_mm_runs_on(index: int) -> bool:
    """torch._grouped_mm (bf16) runs on CUDA device `index`: compute capability 9.0 or newer. Cached."""
    ok = _grouped_mm.get(index)
    if ok is None:
        ok = _grouped_mm[index] = hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(index)[0] >= 9
    return ok
