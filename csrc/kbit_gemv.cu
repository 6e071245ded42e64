// kbit_gemv.cu: fused dequantize + GEMV for the decode path (M = 1..4 activation rows, fp16/bf16, fp32 accumulate),
// and the grouped (per-row expert) GEMV used by KbitMoE.
//
// Thread mapping: one warp per output row o (8 warps = 256 threads per CTA; blockIdx.y = token for the expert
// variant). Within a warp, lane = 4*q + s: each step the warp covers 8 consecutive 32-element blocks
// (q = 0..7) and thread s handles elements 8s..8s+7 of block q. The k packed words of a block are read once per
// warp (the 4 threads of a block load the same 16 bytes for k=4, so one warp load touches exactly one 128-byte line
// of packed weights: each weight byte is read from DRAM once), the block scale byte once per block, x as one
// 16-byte load of 8 activations per row (L1/L2 resident). U = 8 steps of weights are loaded before any is used to keep
// enough bytes in flight
// (activations are loaded next to their use: L1 hits). Decode in registers: bit planes -> nibbles (3 PRMT + 3 delta swaps per 8 elements),
// codebook lookup via __shfl_sync from a register (lane l holds codebook[l % 2^k]), scale byte decoded with bit
// arithmetic. Per block: partial = sum(cb[idx] * x) in fp32, acc += d * partial; at the end a warp reduction,
// times the per-tensor scale, plus bias, rounded to the activation dtype.
#include "kbit_api.h"
#include "kbit_common.cuh"

#include <cuda_runtime.h>

using namespace kbit;

namespace {

constexpr int WARPS = 8;
constexpr int U = 8;  // 32-element blocks per thread group in flight per step

template <int K>
__device__ __forceinline__ void load_words(const uint32_t* __restrict__ p, bool ok, uint32_t (&wd)[5]) {
  wd[0] = wd[1] = wd[2] = wd[3] = wd[4] = 0u;
  if (!ok) return;
  if constexpr (K == 4) {
    uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
    wd[0] = v.x; wd[1] = v.y; wd[2] = v.z; wd[3] = v.w;
  } else if constexpr (K == 2) {
    uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
    wd[0] = v.x; wd[1] = v.y;
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) wd[j] = __ldcs(p + j);
  }
}

// 8 activations x[c0 .. c0+7] as 4 packed pairs; zero past `in`.
template <typename T>
__device__ __forceinline__ uint4 load_x8(const T* __restrict__ xr, int c0, int in, int vec) {
  if (c0 >= in) return make_uint4(0, 0, 0, 0);
  if (vec) return __ldg(reinterpret_cast<const uint4*>(xr + c0));
  uint16_t h[8];
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xr);
#pragma unroll
  for (int i = 0; i < 8; ++i) h[i] = (c0 + i < in) ? xs[c0 + i] : (uint16_t)0;
  return make_uint4(h[0] | ((uint32_t)h[1] << 16), h[2] | ((uint32_t)h[3] << 16), h[4] | ((uint32_t)h[5] << 16),
                    h[6] | ((uint32_t)h[7] << 16));
}

// One step: U groups of 8 blocks starting at block b0. CHECK = false: all blocks are full and inside the row and x
// is 16-byte aligned (no bounds logic at all); CHECK = true: the tail, with bounds checks on blocks and columns.
template <int K, int M, typename T, bool CHECK, bool AF16>
__device__ __forceinline__ void gemv_step(const T* const (&xm)[M], const uint32_t* __restrict__ wrow,
                                          const void* __restrict__ arow, int b0, int nb, int in, int vec, float cb,
                                          uint32_t s, uint32_t q, uint32_t sel, float (&acc)[M]) {
  uint32_t wd[U][5];
  float d[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int b = b0 + u * 8 + (int)q;
    const bool ok = !CHECK || b < nb;
    load_words<K>(wrow + b * K, ok, wd[u]);
    if (AF16) d[u] = ok ? __half2float(reinterpret_cast<const __half*>(arow)[b]) : 0.f;
    else d[u] = ok ? e4m4_decode(__ldcs(reinterpret_cast<const uint8_t*>(arow) + b)) : 0.f;
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int b = b0 + u * 8 + (int)q;
    const int c0 = b * BLOCK + 8 * (int)s;
    uint4 xv[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (!CHECK) xv[m] = __ldg(reinterpret_cast<const uint4*>(xm[m] + c0));
      else xv[m] = (b < nb) ? load_x8(xm[m], c0, in, vec) : make_uint4(0, 0, 0, 0);
    }
    const uint32_t nib = planes_to_nibbles(wd[u][0], wd[u][1], wd[u][2], wd[u][3], sel);
    const uint32_t q4 = wd[u][4] >> (8 * s);
    float c[8];
#define KBIT_CB(E_) c[E_] = __shfl_sync(0xFFFFFFFFu, cb, (int)elem_lane<K, E_>(nib, q4));
    KBIT_CB(0) KBIT_CB(1) KBIT_CB(2) KBIT_CB(3) KBIT_CB(4) KBIT_CB(5) KBIT_CB(6) KBIT_CB(7)
#undef KBIT_CB
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const uint32_t xw[4] = {xv[m].x, xv[m].y, xv[m].z, xv[m].w};
      float p = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float lo, hi;
        unpack2<T>(xw[i], lo, hi);
        p = fmaf(c[2 * i], lo, p);
        p = fmaf(c[2 * i + 1], hi, p);
      }
      acc[m] = fmaf(d[u], p, acc[m]);
    }
  }
}

template <int K, int M, typename T, bool AF16>
__device__ __forceinline__ void gemv_row(const T* const (&xm)[M], const uint32_t* __restrict__ wrow,
                                         const void* __restrict__ arow, int nb, int in, int vec, float cb, uint32_t s,
                                         uint32_t q, uint32_t sel, float (&acc)[M]) {
  int b0 = 0;
  if (vec) {
    const int nfull = in / BLOCK;  // blocks whose 32 columns all lie inside the row
#pragma unroll 1
    for (; b0 + 8 * U <= nfull; b0 += 8 * U)
      gemv_step<K, M, T, false, AF16>(xm, wrow, arow, b0, nb, in, vec, cb, s, q, sel, acc);
  }
#pragma unroll 1
  for (; b0 < nb; b0 += 8 * U) gemv_step<K, M, T, true, AF16>(xm, wrow, arow, b0, nb, in, vec, cb, s, q, sel, acc);
}

// x rows: x + m * in (m < M). ids != nullptr: expert mode (M == 1), token n = blockIdx.y, expert ids[n].
template <int K, int M, typename T>
__global__ void __launch_bounds__(WARPS * 32, (M <= 2 && K < 5 ? 3 : 2)) gemv_kernel(
    const T* __restrict__ x, const uint32_t* __restrict__ packed, const void* __restrict__ absmax, int absmax_fp16,
    const float* __restrict__ scale, const float* __restrict__ codebook, const T* __restrict__ bias,
    T* __restrict__ y, int64_t out, int in, int nb, const int64_t* __restrict__ ids, int64_t E, int vec) {
  constexpr int NC = 1 << K;
  const int lane = threadIdx.x & 31;
  const int64_t o = (int64_t)blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (o >= out) return;  // whole warp
  int64_t e = 0;
  const T* xr = x;
  T* yr = y;
  if (ids != nullptr) {
    const int64_t n = blockIdx.y;
    const int64_t id = ids[n];
    yr = y + n * out;
    if (id < 0 || id >= E) {
      if (lane == 0) yr[o] = Cvt<T>::from_f(0.f);
      return;
    }
    e = id;
    xr = x + n * (int64_t)in;
  }
  const float cb = __ldg(codebook + (lane & (NC - 1)));
  const uint32_t s = lane & 3, q = lane >> 2;
  const uint32_t sel = s | ((s + 4) << 4);
  const int64_t row = e * out + o;
  const uint32_t* __restrict__ wrow = packed + row * nb * K;
  const T* xm[M];
#pragma unroll
  for (int m = 0; m < M; ++m) xm[m] = xr + (int64_t)m * in;

  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  if (absmax_fp16)
    gemv_row<K, M, T, true>(xm, wrow, reinterpret_cast<const __half*>(absmax) + row * nb, nb, in, vec, cb, s, q, sel, acc);
  else
    gemv_row<K, M, T, false>(xm, wrow, reinterpret_cast<const uint8_t*>(absmax) + row * nb, nb, in, vec, cb, s, q, sel,
                             acc);
  const float sc = scale[e];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float v = warp_sum(acc[m]);
    if (lane == 0) {
      v *= sc;
      if (bias != nullptr) v += Cvt<T>::to_f(bias[o]);
      yr[(int64_t)m * out + o] = Cvt<T>::from_f(v);
    }
  }
}

template <int K, int M, typename T>
int launch(const void* x, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed, const void* absmax,
           int fp16, const float* scale, const float* cb, int64_t out, int64_t in, const void* bias, void* y,
           cudaStream_t st) {
  if (out == 0 || N == 0) return 0;
  const int64_t nb = (in + 31) / 32;
  const int vec = (in % 8 == 0) && ((reinterpret_cast<uintptr_t>(x) & 15) == 0);
  dim3 grid((unsigned)((out + WARPS - 1) / WARPS), (unsigned)(ids ? N : 1));
  if (grid.y > 65535u || in > (int64_t)1 << 30) return (int)cudaErrorInvalidConfiguration;
  gemv_kernel<K, M, T><<<grid, WARPS * 32, 0, st>>>(reinterpret_cast<const T*>(x), packed, absmax, fp16, scale, cb,
                                                    reinterpret_cast<const T*>(bias), reinterpret_cast<T*>(y), out,
                                                    (int)in, (int)nb, ids, E, vec);
  return (int)cudaGetLastError();
}

template <int K, typename T>
int launch_m(int64_t M, const void* x, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed,
             const void* absmax, int fp16, const float* scale, const float* cb, int64_t out, int64_t in,
             const void* bias, void* y, cudaStream_t st) {
  switch (M) {
    case 1: return launch<K, 1, T>(x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
    case 2: return launch<K, 2, T>(x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
    case 3: return launch<K, 3, T>(x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
    case 4: return launch<K, 4, T>(x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
  }
  return (int)cudaErrorInvalidValue;
}

template <typename T>
int launch_k(int k, int64_t M, const void* x, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed,
             const void* absmax, int fp16, const float* scale, const float* cb, int64_t out, int64_t in,
             const void* bias, void* y, cudaStream_t st) {
  switch (k) {
    case 2: return launch_m<2, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
    case 3: return launch_m<3, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
    case 4: return launch_m<4, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
    case 5: return launch_m<5, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
  }
  return (int)cudaErrorInvalidValue;
}

int dispatch(int x_dtype, int k, int64_t M, const void* x, int64_t N, const int64_t* ids, int64_t E,
             const uint32_t* packed, const void* absmax, int fp16, const float* scale, const float* cb, int64_t out,
             int64_t in, const void* bias, void* y, void* stream) {
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (x_dtype == BF16)
    return launch_k<__nv_bfloat16>(k, M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
  if (x_dtype == F16) return launch_k<__half>(k, M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
  return (int)cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

int kbit_gemv(const void* x, int x_dtype, int64_t M, const uint32_t* packed, const void* absmax, int absmax_fp16,
              const float* scale, const float* codebook, int k, int64_t out, int64_t in, const void* bias, void* y,
              void* stream) {
  return dispatch(x_dtype, k, M, x, 1, nullptr, 1, packed, absmax, absmax_fp16, scale, codebook, out, in, bias, y,
                  stream);
}

int kbit_expert_gemv(const void* x, int x_dtype, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed,
                     const void* absmax, int absmax_fp16, const float* scale, const float* codebook, int k,
                     int64_t out, int64_t in, void* y, void* stream) {
  if (ids == nullptr) return (int)cudaErrorInvalidValue;
  return dispatch(x_dtype, k, 1, x, N, ids, E, packed, absmax, absmax_fp16, scale, codebook, out, in, nullptr, y,
                  stream);
}

}  // extern "C"
