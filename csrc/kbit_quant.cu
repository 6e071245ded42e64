// kbit_quant.cu: quantize and dequantize kernels + their C ABI entry points.
//
// quantize (three launches + a memset on one stream, no workspace: `scale` holds the per-tensor max meanwhile)
//   pass 1  one warp per 32-element block (grid-stride): lane i loads element i, warp max-reduce of |w|; each warp
//           keeps a running max per expert and atomicMax-es it (as uint bits, all values >= 0) into scale[e].
//   pass 2  one warp per block: recompute the block max, derive the power-of-two scale from scale[e] (= the max),
//           E4M4/fp16-encode the block scale on the device, y = (w/s)/d with IEEE division, index = number of
//           codebook midpoints < y (midpoints in registers), then k __ballot_sync bit planes; lane j < k stores
//           word j, lane 0 the scale byte.
//   pass 3  scale[e] = power-of-two scale (one thread per expert).
// dequantize
//   2 threads per block, thread h decodes elements 8h..8h+7 and 16+8h..16+8h+7: it loads the k words of its block
//   (same 16-byte / 8-byte / 4-byte words for the 2 threads, two 128-byte lines per warp for k=4), transposes the bit
//   planes to nibbles (3 PRMT + 3 delta swaps per 8 elements), looks the codebook up with __shfl_sync (lane l holds
//   codebook[l % 2^k]), and writes two 16-byte stores (bf16/fp16 when in % 8 == 0): lanes h = 0, 1 of one block
//   fill one 32-byte sector per store instruction. Value = (cb * d) * scale in fp32.
#include "kbit_api.h"
#include "kbit_common.cuh"
#include "kbit_dispatch.h"

#include <cuda_runtime.h>

using namespace kbit;

namespace {

template <typename T>
__device__ __forceinline__ float load_w(const T* w, size_t i) {
  return Cvt<T>::to_f(w[i]);
}

template <typename T>
__global__ void __launch_bounds__(256) quant_absmax_kernel(const T* __restrict__ w, int64_t E, int64_t out,
                                                           int64_t in, int64_t nb, float* __restrict__ amax) {
  const int lane = threadIdx.x & 31;
  const int64_t nwarps = (int64_t)gridDim.x * (blockDim.x >> 5);
  const int64_t total = E * out * nb;
  int64_t cur_e = -1;
  float run = 0.f;
  for (int64_t blk = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); blk < total; blk += nwarps) {
    int64_t row = blk / nb, b = blk - row * nb;
    int64_t e = row / out;
    int64_t col = b * BLOCK + lane;
    float v = col < in ? fabsf(load_w(w, row * in + col)) : 0.f;
    v = warp_max(v);
    if (e != cur_e) {
      if (cur_e >= 0 && lane == 0) atomicMax(reinterpret_cast<unsigned int*>(amax + cur_e), __float_as_uint(run));
      cur_e = e;
      run = 0.f;
    }
    run = fmaxf(run, v);
  }
  if (cur_e >= 0 && lane == 0) atomicMax(reinterpret_cast<unsigned int*>(amax + cur_e), __float_as_uint(run));
}

__device__ __forceinline__ float pow2_scale(float amax) {
  // == format.tensor_scale: 2^(ceil(log2(amax)) - 4), 1 for an all-zero tensor.
  if (!(amax > 0.f)) return 1.f;
  return ldexpf(1.f, (int)ceilf(log2f(amax)) - 4);
}

template <typename T, int K>
__global__ void __launch_bounds__(256) quant_pack_kernel(const T* __restrict__ w, int64_t E, int64_t out, int64_t in,
                                                         int64_t nb, const float* __restrict__ codebook,
                                                         int absmax_fp16, const float* __restrict__ amax,
                                                         uint32_t* __restrict__ packed, void* __restrict__ absmax) {
  constexpr int NC = 1 << K;
  const int lane = threadIdx.x & 31;
  float mid[NC - 1];
#pragma unroll
  for (int i = 0; i < NC - 1; ++i) mid[i] = __fmul_rn(__fadd_rn(codebook[i], codebook[i + 1]), 0.5f);
  const int64_t nwarps = (int64_t)gridDim.x * (blockDim.x >> 5);
  const int64_t total = E * out * nb;
  for (int64_t blk = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); blk < total; blk += nwarps) {
    int64_t row = blk / nb, b = blk - row * nb;
    int64_t e = row / out;
    int64_t col = b * BLOCK + lane;
    float v = col < in ? load_w(w, row * in + col) : 0.f;
    float bmax = warp_max(fabsf(v));
    float s = pow2_scale(amax[e]);
    float a = __fdiv_rn(bmax, s);
    float d;
    if (absmax_fp16) {
      __half h = __float2half_rn(a);
      if (a > 0.f && __half2float(h) == 0.f) h = __ushort_as_half((unsigned short)1);  // 2^-24
      d = __half2float(h);
      if (lane == 0) reinterpret_cast<__half*>(absmax)[blk] = h;
    } else {
      uint32_t code = e4m4_encode(a);
      if (a > 0.f && code == 0) code = 1;
      d = e4m4_decode(code);
      if (lane == 0) reinterpret_cast<uint8_t*>(absmax)[blk] = (uint8_t)code;
    }
    float y = d > 0.f ? __fdiv_rn(__fdiv_rn(v, s), d) : 0.f;
    uint32_t idx = 0;
#pragma unroll
    for (int i = 0; i < NC - 1; ++i) idx += (mid[i] < y) ? 1u : 0u;
    uint32_t mine = 0;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      uint32_t word = __ballot_sync(0xFFFFFFFFu, (idx >> j) & 1u);
      if (lane == j) mine = word;
    }
    if (lane < K) packed[blk * K + lane] = mine;
  }
}

__global__ void quant_scale_kernel(float* scale, int64_t E) {
  int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (e < E) scale[e] = pow2_scale(scale[e]);
}

// ---- dequantize ----
// The block's K words. K = 3..5 load them as streaming loads (ld.global.cs, evict first): with the grid cap of
// dequant_blocks_per_sm, on the H200 K = 3 reads 88-90% of copy instead of 80%, K = 4 89-90% instead of 81-82%, K = 5
// 88% instead of 78%; on the H100 1.01-1.05x. K = 2 keeps the ordinary load: on the H200 its streaming loads read
// 81.7-86.8% of copy (mean 85.0%), the ordinary ones 82.4-88.4% (86.0%).
template <int K>
__device__ __forceinline__ void load_block_words(const uint32_t* __restrict__ p, uint32_t (&wd)[5]) {
  if constexpr (K == 4) {
    uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
    wd[0] = v.x; wd[1] = v.y; wd[2] = v.z; wd[3] = v.w; wd[4] = 0;
  } else if constexpr (K == 2) {
    uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    wd[0] = v.x; wd[1] = v.y; wd[2] = 0; wd[3] = 0; wd[4] = 0;
  } else {
#pragma unroll
    for (int j = 0; j < 5; ++j) wd[j] = j < K ? __ldcs(p + j) : 0u;
  }
}

// DENSE: one tensor (E == 1) whose rows are whole blocks (in % 32 == 0) and y 16-byte aligned: element (blk, 8s)
// lands at y + 32 blk + 8 s and the per-tensor scale is loop-invariant, so the loop needs no 64-bit divisions
// (two per 8 elements otherwise, which held the kernel at ~75% of the SM copy bandwidth on an H100).
// Two threads per block, each storing the halves (8h.., 16+8h..) so that every store instruction writes whole sectors,
// and a grid of dequant_blocks_per_sm blocks per SM, grid-stride beyond: 89-93% of the SM copy on an H100 for K = 2..5,
// against 80-85% with 4 threads per block, two items per thread and 32 blocks per SM.
template <int K, typename TO, bool DENSE>
__global__ void __launch_bounds__(256) dequant_kernel(const uint32_t* __restrict__ packed, const void* __restrict__ absmax,
                                                      int absmax_fp16, const float* __restrict__ scale,
                                                      const float* __restrict__ codebook, int64_t E, int64_t out,
                                                      int64_t in, int64_t nb, TO* __restrict__ y, int vec) {
  constexpr int NC = 1 << K;
  const int lane = threadIdx.x & 31;
  const float cb = codebook[lane & (NC - 1)];
  const float sc0 = DENSE ? scale[0] : 0.f;
  const int64_t total = E * out * nb * 2;  // one thread per (block, half h)
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  // Loop bounds are uniform per warp so that every lane takes part in the shuffles.
  for (int64_t t0 = (int64_t)blockIdx.x * blockDim.x + (threadIdx.x & ~31); t0 < total; t0 += stride) {
    const int64_t t = t0 + lane;
    const bool valid = t < total;
    const int64_t blk = valid ? (t >> 1) : 0;
    uint32_t wd[5];
    load_block_words<K>(packed + blk * K, wd);
    const float d = load_absmax(absmax, blk, absmax_fp16);
    int64_t row = 0, b = blk, e = 0;
    if constexpr (!DENSE) {
      row = blk / nb;
      b = blk - row * nb;
      e = row / out;
    }
    const float sc = DENSE ? sc0 : scale[e];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t s = (uint32_t)(t & 1) + 2 * half;  // elements 8s..8s+7 of the block
      const uint32_t nib = planes_to_nibbles(wd[0], wd[1], wd[2], wd[3], s | ((s + 4) << 4));
      const uint32_t q4 = wd[4] >> (8 * s);
      float v[8];
#define KBIT_DQ(E_)                                                                  \
  {                                                                                  \
    float c = __shfl_sync(0xFFFFFFFFu, cb, (int)elem_lane<K, E_>(nib, q4));          \
    v[E_] = __fmul_rn(__fmul_rn(c, d), sc);                                          \
  }
      KBIT_DQ(0) KBIT_DQ(1) KBIT_DQ(2) KBIT_DQ(3) KBIT_DQ(4) KBIT_DQ(5) KBIT_DQ(6) KBIT_DQ(7)
#undef KBIT_DQ
      if (!valid) continue;
      const int64_t c0 = b * BLOCK + 8 * s;
      if (!DENSE && c0 >= in) continue;
      TO* dst = y + row * in + c0;  // DENSE: row = 0 and b = blk
      if (DENSE || vec) {  // in % 8 == 0 and y 16-byte aligned: the 8 elements are all inside the row
        if constexpr (sizeof(TO) == 2) {
          uint32_t pk[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) pk[i] = Mma<TO>::pack(v[2 * i], v[2 * i + 1]);
          // streaming store (evict first): on the H200 K = 2 reads 86-87% of copy instead of 77-78%, K = 3..5 the
          // same
          __stcs(reinterpret_cast<uint4*>(dst), make_uint4(pk[0], pk[1], pk[2], pk[3]));
        } else {
          reinterpret_cast<float4*>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
          reinterpret_cast<float4*>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (c0 + i < in) dst[i] = Cvt<TO>::from_f(v[i]);
      }
    }
  }
}

template <typename T>
int quantize_t(const T* w, int64_t E, int64_t out, int64_t in, const float* cb, int k, int fp16, uint32_t* packed,
               void* absmax, float* scale, cudaStream_t st) {
  const int64_t nb = (in + 31) / 32;
  const int64_t total = E * out * nb;
  cudaError_t err = cudaMemsetAsync(scale, 0, sizeof(float) * E, st);
  if (err != cudaSuccess) return (int)err;
  if (total > 0) {
    int g = grid_for_threads(total * 32);  // one warp per block
    quant_absmax_kernel<T><<<g, 256, 0, st>>>(w, E, out, in, nb, scale);
    switch (k) {
      case 2: quant_pack_kernel<T, 2><<<g, 256, 0, st>>>(w, E, out, in, nb, cb, fp16, scale, packed, absmax); break;
      case 3: quant_pack_kernel<T, 3><<<g, 256, 0, st>>>(w, E, out, in, nb, cb, fp16, scale, packed, absmax); break;
      case 4: quant_pack_kernel<T, 4><<<g, 256, 0, st>>>(w, E, out, in, nb, cb, fp16, scale, packed, absmax); break;
      case 5: quant_pack_kernel<T, 5><<<g, 256, 0, st>>>(w, E, out, in, nb, cb, fp16, scale, packed, absmax); break;
      default: return (int)cudaErrorInvalidValue;
    }
  }
  if (E > 0) quant_scale_kernel<<<(unsigned)((E + 127) / 128), 128, 0, st>>>(scale, E);
  return (int)cudaGetLastError();
}

template <int K, typename TO>
int dequant_launch(const uint32_t* packed, const void* absmax, int fp16, const float* scale, const float* cb,
                   int64_t E, int64_t out, int64_t in, int64_t nb, void* y, cudaStream_t st) {
  const int64_t threads_needed = E * out * nb * 2;
  if (threads_needed == 0) return 0;
  int vec = (in % 8 == 0) && ((reinterpret_cast<uintptr_t>(y) & 15) == 0);
  // grid-stride beyond (8192^2 elements on 132 SMs: K = 2 one item per thread, K = 3..5 two; see dequant_kernel)
  const int blocks = grid_for_threads(threads_needed, 256, dequant_blocks_per_sm(K));
  if (vec && E == 1 && in % BLOCK == 0)
    dequant_kernel<K, TO, true><<<(unsigned)blocks, 256, 0, st>>>(packed, absmax, fp16, scale, cb, E, out, in, nb,
                                                                   reinterpret_cast<TO*>(y), vec);
  else
    dequant_kernel<K, TO, false><<<(unsigned)blocks, 256, 0, st>>>(packed, absmax, fp16, scale, cb, E, out, in, nb,
                                                                    reinterpret_cast<TO*>(y), vec);
  return (int)cudaGetLastError();
}

template <typename TO>
int dequant_k(int k, const uint32_t* packed, const void* absmax, int fp16, const float* scale, const float* cb,
              int64_t E, int64_t out, int64_t in, void* y, cudaStream_t st) {
  const int64_t nb = (in + 31) / 32;
  switch (k) {
    case 2: return dequant_launch<2, TO>(packed, absmax, fp16, scale, cb, E, out, in, nb, y, st);
    case 3: return dequant_launch<3, TO>(packed, absmax, fp16, scale, cb, E, out, in, nb, y, st);
    case 4: return dequant_launch<4, TO>(packed, absmax, fp16, scale, cb, E, out, in, nb, y, st);
    case 5: return dequant_launch<5, TO>(packed, absmax, fp16, scale, cb, E, out, in, nb, y, st);
  }
  return (int)cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

// the version of this C ABI (kbit_api.h and the tiled layout's bytes); a loader refuses a library of another version
int kbit_abi_version(void) { return 17; }

const char* kbit_error_string(int code) { return cudaGetErrorString((cudaError_t)code); }

int kbit_quantize(const void* weight, int w_dtype, int64_t E, int64_t out, int64_t in, const float* codebook, int k,
                  int absmax_fp16, uint32_t* packed, void* absmax, float* scale, void* stream) {
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  switch (w_dtype) {
    case F32: return quantize_t(reinterpret_cast<const float*>(weight), E, out, in, codebook, k, absmax_fp16, packed, absmax, scale, st);
    case F16: return quantize_t(reinterpret_cast<const __half*>(weight), E, out, in, codebook, k, absmax_fp16, packed, absmax, scale, st);
    case BF16: return quantize_t(reinterpret_cast<const __nv_bfloat16*>(weight), E, out, in, codebook, k, absmax_fp16, packed, absmax, scale, st);
  }
  return (int)cudaErrorInvalidValue;
}

int kbit_dequantize(const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                    const float* codebook, int k, int64_t E, int64_t out, int64_t in, void* y, int y_dtype,
                    void* stream) {
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  switch (y_dtype) {
    case F32: return dequant_k<float>(k, packed, absmax, absmax_fp16, scale, codebook, E, out, in, y, st);
    case F16: return dequant_k<__half>(k, packed, absmax, absmax_fp16, scale, codebook, E, out, in, y, st);
    case BF16: return dequant_k<__nv_bfloat16>(k, packed, absmax, absmax_fp16, scale, codebook, E, out, in, y, st);
  }
  return (int)cudaErrorInvalidValue;
}

}  // extern "C"
