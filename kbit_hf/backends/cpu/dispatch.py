"""Which CPU path runs: every rule of the Python side in one table (inside a kernel, the instruction set is the
library's: the best the CPU has, csrc/cpu/kbit_cpu.cpp best_isa). Measured on 2 cores of an AMD EPYC (Zen 5), torch
2.13 with MKL; the measurements are below.

| rule | why |
|---|---|
| `linear`: fused GEMV for 1 <= M <= GEMV_MAX_M[isa] rows of x | it decodes each weight once for all M rows |
| `linear`, more rows: dequantize to fp32, then torch's fp32 matmul | from there a BLAS's GEMM catches up |
| `expert_linear`: one call for N <= E * GEMV_MAX_M[isa] rows | the library groups rows by expert: no Python loop |
| `expert_linear`, more rows: one `linear` per expert present | an expert's rows are then a matmul, as in `linear` |

GEMV_MAX_M, fused against dequantize + matmul (fp32 x; 1536x576 / 576x1536 / 4096x4096):
  avx512 (2 threads): 2.16 / 1.84 / 2.82x faster at 16, 1.62 / 1.42 / 1.73x at 32, 1.38 / 1.21 / 1.26x at 64,
          1.23 / 1.08 / 1.00x at 128. Kept at 32: a BLAS faster per row than MKL is on this CPU (MKL on Intel's
          AVX-512 cores, say) would take over sooner (not measured).
  avx2 (1 thread): 0.98 / 1.43x at 16 (1536x576 / 4096x4096), 0.78 / 1.02x at 32.
  scalar (1 thread): 1.02x at 8, 0.59x at 16 (1536x576).
expert_linear, one call against one `linear` per expert (avx512, one thread): 8 experts of 1536x576 1.63x at N = 8,
1.32x at 256; 64 experts of 768x256 2.95x at 8, 1.30x at 1024.
"""

from __future__ import annotations

import torch

from . import library

GEMV_MAX_M = {"avx512": 32, "avx2": 16, "scalar": 8}
GEMV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # library.DTYPE_CODE: what the kernels read and write


def linear_max_m() -> int:
    """The most rows of x the fused GEMV takes on this CPU's instruction set."""
    return GEMV_MAX_M[library.isa()]


def linear_uses_gemv(M: int, dtype: torch.dtype) -> bool:
    return 0 < M <= linear_max_m() and dtype in GEMV_DTYPES


def expert_linear_uses_gemv(N: int, num_experts: int, dtype: torch.dtype) -> bool:
    return N <= num_experts * linear_max_m() and dtype in GEMV_DTYPES
