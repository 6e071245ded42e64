// kbit_gemv.cu: fused dequantize + GEMV for the decode path (M = 1..8 activation rows, fp16/bf16, fp32 accumulate)
// on the tensor cores (mma.sync m16n8k16, sm_80+), and the grouped (per-row expert) GEMV used by KbitMoE.
//
// v2 design (see docs/kernels.md for the measurements):
// - A CTA owns one tile of 16 output rows (blockIdx.y = token for the expert variant) and W = 4 or 8 warps that
//   split the input dimension: warp w handles steps w, w + W, ..., a step being 8 consecutive 32-element blocks;
//   the W partial tiles are summed through shared memory in a fixed order (deterministic, no atomics, no workspace).
// - The weight tile is the MMA's A operand (16 rows x k16), the activations its B operand (k16 x n8: tokens 0..M-1,
//   zero past M), fp32 accumulators. The k order inside an MMA is free (A and B only have to agree), so lane
//   4g + q owns whole blocks: in a step, blocks b0 + q and b0 + 4 + q of rows g and g + 8. It loads their K packed
//   words itself (one 16-byte load per row and block for K = 4, every packed byte read once, no shuffles), and the
//   32 activations of the same block for token g (M <= g: zeros).
// - Decode: for s = 0..3 the K bit planes are folded into one word t_s = OR_j ((w_j >> (2s - 2j)) & (0x03030303 << 2j))
//   whose byte B is the 2K-bit index of the element pair (8B + 2s, 8B + 2s + 1) (bits 2j / 2j+1 = bit j of the
//   even / odd element); K = 5 uses two words with 16-bit fields. One LDS.32 per pair reads both weights (a packed
//   bf16x2 / f16x2) from a per-CTA pair table of 2^(2K) entries built from the codebook at kernel start, replicated
//   R = 32 times for K <= 3 (lane l reads replica l: conflict-free), 8 times for K = 4, 5. The block scale is
//   applied to the pair with one HMUL2 (bf16x2 / f16x2), so 16 pairs of one block feed 8 MMAs with no per-block
//   epilogue.
// - Numerics: the MMA needs the weights in the activation dtype, so cb is rounded to bf16/fp16, the block scale to
//   bf16 (exact for e4m4 scales) and the product cb * d once more; for fp16, cb and d are pre-multiplied by 16 each
//   (the fp16 product cb*d*256 stays normal for every e4m4 scale) and the result multiplied by 2^-8 at the end.
//   Accumulation is fp32; the result times the per-tensor scale plus bias is rounded to the activation dtype.
#include "kbit_api.h"
#include "kbit_common.cuh"

#include <cuda_runtime.h>
#include <cstdlib>

using namespace kbit;

namespace {

constexpr int TILE = 16;        // output rows per CTA
constexpr int STEP = 8;         // 32-element blocks per warp step
constexpr int MAX_WARPS = 8;

template <int K>
struct Cfg {
  static constexpr int NP = 1 << (2 * K);  // pair-table entries
  // replicas (lane l reads replica l % R, so lanes never conflict with lanes of another replica): K = 2, 3: 32
  // (conflict-free); K = 4: 8 (8 KB; 32 replicas measured slower on 14336x4096 and 4096x4096, see docs/kernels.md);
  // K = 5: 8 (32 KB; 2 replicas were 3-5% slower)
  static constexpr int R = K <= 3 ? 32 : 8;
  static constexpr int WORDS = NP * R;
  static constexpr int LR = R == 32 ? 5 : R == 16 ? 4 : R == 8 ? 3 : R == 4 ? 2 : R == 2 ? 1 : 0;
  static constexpr int L = LR + 2;                                // bit offset of the pair index in a byte address
  static constexpr uint32_t AMASK = (uint32_t)(NP - 1) << L;
};

template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  __device__ static __forceinline__ void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  __device__ static __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));  // a*b + (-0) == a*b
    return d;
  }
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static constexpr float PRE = 1.0f;   // codebook and block scale multiplied by PRE each before rounding
  static constexpr float POST = 1.0f;  // result multiplied by POST = 1 / PRE^2
};
template <> struct Mma<__half> {
  __device__ static __forceinline__ void run(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  __device__ static __forceinline__ uint32_t mul2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
  }
  __device__ static __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static constexpr float PRE = 16.0f;
  static constexpr float POST = 1.0f / 256.0f;
};

template <int SH>
__device__ __forceinline__ uint32_t shr(uint32_t v) {
  if constexpr (SH >= 0) return v >> SH;
  else return v << (-SH);
}

__device__ __forceinline__ uint32_t lds(const char* tb, uint32_t off) {
  return *reinterpret_cast<const uint32_t*>(tb + off);
}

// Fold the K planes of one row-block into pair-table byte offsets and look the 16 pairs up: a[p] = the two weights
// (elements 2p, 2p+1) of pair p, times d2.
template <int K, typename T>
__device__ __forceinline__ void decode_block(const uint32_t (&w)[5], uint32_t d2, uint32_t c4, const char* tb,
                                             uint32_t (&a)[16]) {
  using C = Cfg<K>;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    if constexpr (K <= 4) {
      uint32_t t = 0;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const uint32_t v = (2 * s - 2 * j >= 0) ? (w[j] >> (2 * s - 2 * j)) : (w[j] << (2 * j - 2 * s));
        t |= v & (0x03030303u << (2 * j));
      }
#pragma unroll
      for (int B = 0; B < 4; ++B) {
        const int sh = 8 * B - C::L;
        const uint32_t v = sh >= 0 ? (t >> (sh >= 0 ? sh : 0)) : (t << (sh < 0 ? -sh : 0));
        a[4 * B + s] = Mma<T>::mul2(lds(tb, (v & C::AMASK) | c4), d2);
      }
    } else {
      // 16-bit fields: te holds the pairs of bytes 0 and 2, to those of bytes 1 and 3
      uint32_t te = 0, to = 0;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        const uint32_t ve = (2 * s - 2 * j >= 0) ? (w[j] >> (2 * s - 2 * j)) : (w[j] << (2 * j - 2 * s));
        te |= ve & (0x00030003u << (2 * j));
        to |= (w[j] >> (8 + 2 * s - 2 * j)) & (0x00030003u << (2 * j));
      }
#pragma unroll
      for (int f = 0; f < 2; ++f) {
        const int sh = 16 * f - C::L;
        const uint32_t ve = sh >= 0 ? (te >> (sh >= 0 ? sh : 0)) : (te << (sh < 0 ? -sh : 0));
        const uint32_t vo = sh >= 0 ? (to >> (sh >= 0 ? sh : 0)) : (to << (sh < 0 ? -sh : 0));
        a[4 * (2 * f) + s] = Mma<T>::mul2(lds(tb, (ve & C::AMASK) | c4), d2);
        a[4 * (2 * f + 1) + s] = Mma<T>::mul2(lds(tb, (vo & C::AMASK) | c4), d2);
      }
    }
  }
}

// Packed words and scale of one row-block. CHECK: blocks at or past nb give zeros.
template <int K, bool CHECK>
__device__ __forceinline__ void load_block(const uint32_t* __restrict__ wrow, const void* __restrict__ arow, int fp16,
                                           int blk, int nb, uint32_t (&w)[5], uint32_t& sc) {
#pragma unroll
  for (int j = 0; j < 5; ++j) w[j] = 0u;
  sc = 0u;
  if (CHECK && blk >= nb) return;
  const uint32_t* p = wrow + blk * K;
  if constexpr (K == 4) {
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (K == 2) {
    const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = __ldcs(p + j);
  }
  if (fp16) sc = __ldcs(reinterpret_cast<const unsigned short*>(arow) + blk);
  else sc = __ldcs(reinterpret_cast<const unsigned char*>(arow) + blk);
}

// block scale code -> d * PRE as a packed pair in the activation dtype
template <typename T>
__device__ __forceinline__ uint32_t scale_pair(uint32_t sc, int fp16) {
  float d;
  if (fp16) d = __half2float(__ushort_as_half((unsigned short)sc));
  else d = __uint_as_float(sc << 19) * 0x1p116f;  // exact e4m4 decode, subnormal codes included
  d *= Mma<T>::PRE;
  return Mma<T>::pack(d, d);
}

// the 32 activations of block blk of one token as 16 pairs; CHECK: element-wise bounds (and any alignment)
template <typename T, bool CHECK>
__device__ __forceinline__ void load_x(const T* __restrict__ xr, bool on, int blk, int in, uint32_t (&xw)[16]) {
#pragma unroll
  for (int i = 0; i < 16; ++i) xw[i] = 0u;
  if (!on) return;
  const int c0 = blk * BLOCK;
  if (!CHECK) {
    const uint4* p = reinterpret_cast<const uint4*>(xr + c0);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = __ldg(p + i);
      xw[4 * i] = v.x; xw[4 * i + 1] = v.y; xw[4 * i + 2] = v.z; xw[4 * i + 3] = v.w;
    }
  } else {
    const unsigned short* xs = reinterpret_cast<const unsigned short*>(xr);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int c = c0 + 2 * i;
      const uint32_t lo = c < in ? xs[c] : 0u;
      const uint32_t hi = c + 1 < in ? xs[c + 1] : 0u;
      xw[i] = lo | (hi << 16);
    }
  }
}

struct Buf {
  uint32_t w[2][2][5];  // [owned block][row g / g+8][plane]
  uint32_t sc[2][2];
};

template <int K, bool CHECK>
__device__ __forceinline__ void load_step(Buf& b, const uint32_t* __restrict__ w0, const uint32_t* __restrict__ w1,
                                          const void* __restrict__ a0, const void* __restrict__ a1, int fp16, int b0,
                                          int q, int nb) {
#pragma unroll
  for (int ob = 0; ob < 2; ++ob) {
    const int blk = b0 + q + 4 * ob;
    load_block<K, CHECK>(w0, a0, fp16, blk, nb, b.w[ob][0], b.sc[ob][0]);
    load_block<K, CHECK>(w1, a1, fp16, blk, nb, b.w[ob][1], b.sc[ob][1]);
  }
}

template <int K, typename T, bool CHECK>
__device__ __forceinline__ void compute_step(const Buf& b, const T* __restrict__ xr, bool xon, int fp16, int b0, int q,
                                             int nb, int in, uint32_t c4, const char* tb, float (&acc)[4]) {
#pragma unroll
  for (int ob = 0; ob < 2; ++ob) {
    const int blk = b0 + q + 4 * ob;
    uint32_t xw[16];
    load_x<T, CHECK>(xr, xon && (!CHECK || blk < nb), blk, in, xw);
    uint32_t ag[16], ah[16];
    decode_block<K, T>(b.w[ob][0], scale_pair<T>(b.sc[ob][0], fp16), c4, tb, ag);
    decode_block<K, T>(b.w[ob][1], scale_pair<T>(b.sc[ob][1], fp16), c4, tb, ah);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int lo = 8 * h + s, hi = lo + 4;
        Mma<T>::run(acc, ag[lo], ah[lo], ag[hi], ah[hi], xw[lo], xw[hi]);
      }
  }
}

// x rows: x + m * in (m < M). ids != nullptr: expert mode (M == 1), token n = blockIdx.y, expert ids[n].
template <int K, typename T>
__global__ void __launch_bounds__(MAX_WARPS * 32, 2) gemv_kernel(
    const T* __restrict__ x, int M, const uint32_t* __restrict__ packed, const void* __restrict__ absmax, int fp16,
    const float* __restrict__ scale, const float* __restrict__ codebook, const T* __restrict__ bias,
    T* __restrict__ y, int64_t out, int in, int nb, const int64_t* __restrict__ ids, int64_t E, int vec) {
  using C = Cfg<K>;
  __shared__ __align__(16) uint32_t tbl[C::WORDS];
  __shared__ float red[MAX_WARPS][4][32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, W = blockDim.x >> 5;
  const int64_t o0 = (int64_t)blockIdx.x * TILE;
  int64_t e = 0;
  const T* xr = x;
  T* yr = y;
  if (ids != nullptr) {
    const int64_t n = blockIdx.y;
    const int64_t id = ids[n];
    yr = y + n * out;
    if (id < 0 || id >= E) {  // whole CTA: zero rows
      if (tid < TILE && o0 + tid < out) yr[o0 + tid] = Cvt<T>::from_f(0.f);
      return;
    }
    e = id;
    xr = x + n * (int64_t)in;
  }
  const int g = lane >> 2, q = lane & 3;
  const uint32_t c4 = (uint32_t)(lane & (C::R - 1)) * 4u;
  const char* tb = reinterpret_cast<const char*>(tbl);
  // rows g and g + 8 of the tile, clamped into the matrix (rows past `out` compute garbage that is never written)
  const int64_t r0 = e * out + (o0 + g < out ? o0 + g : out - 1);
  const int64_t r1 = e * out + (o0 + g + 8 < out ? o0 + g + 8 : out - 1);
  const int64_t rw = (int64_t)nb * K;
  const uint32_t* __restrict__ w0 = packed + r0 * rw;
  const uint32_t* __restrict__ w1 = packed + r1 * rw;
  const int as = fp16 ? 2 : 1;
  const void* a0 = reinterpret_cast<const char*>(absmax) + r0 * nb * as;
  const void* a1 = reinterpret_cast<const char*>(absmax) + r1 * nb * as;
  const bool xon = g < M;
  const T* xg = xr + (int64_t)(xon ? g : 0) * in;

  // full steps: 8 blocks whose 32 columns all lie inside the row (x 16-byte aligned); the first step's loads are
  // issued before the pair table is built
  const int nfs = vec ? (in / BLOCK) / STEP : 0;
  int st = warp;
  Buf cur;
  if (st < nfs) load_step<K, false>(cur, w0, w1, a0, a1, fp16, st * STEP, q, nb);
  // pair table: entry P holds (cb[i0], cb[i1]) * PRE, i0 / i1 = the even / odd bits of P, in R replicas
  for (int p = tid; p < C::NP; p += blockDim.x) {
    uint32_t i0 = 0, i1 = 0;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      i0 |= ((p >> (2 * j)) & 1u) << j;
      i1 |= ((p >> (2 * j + 1)) & 1u) << j;
    }
    const uint32_t v = Mma<T>::pack(__ldg(codebook + i0) * Mma<T>::PRE, __ldg(codebook + i1) * Mma<T>::PRE);
    if constexpr (C::R >= 4) {
#pragma unroll
      for (int r = 0; r < C::R; r += 4) *reinterpret_cast<uint4*>(&tbl[p * C::R + r]) = make_uint4(v, v, v, v);
    } else {
#pragma unroll
      for (int r = 0; r < C::R; ++r) tbl[p * C::R + r] = v;
    }
  }
  __syncthreads();

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (st < nfs) {
#pragma unroll 1
    for (; st < nfs; st += W) {
      Buf nxt;
      if (st + W < nfs) load_step<K, false>(nxt, w0, w1, a0, a1, fp16, (st + W) * STEP, q, nb);
      compute_step<K, T, false>(cur, xg, xon, fp16, st * STEP, q, nb, in, c4, tb, acc);
      cur = nxt;
    }
  }
  // the remaining blocks (fewer than 8, or all of them when x is not vector-loadable): checked, strided over warps
  for (int s2 = nfs + warp; s2 * STEP < nb; s2 += W) {
    Buf tl;
    load_step<K, true>(tl, w0, w1, a0, a1, fp16, s2 * STEP, q, nb);
    compute_step<K, T, true>(tl, xg, xon, fp16, s2 * STEP, q, nb, in, c4, tb, acc);
  }

  // reduce the W warps' tiles in a fixed order
#pragma unroll
  for (int i = 0; i < 4; ++i) red[warp][i][lane] = acc[i];
  __syncthreads();
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float v = red[0][i][lane];
    for (int w2 = 1; w2 < W; ++w2) v += red[w2][i][lane];
    acc[i] = v;
  }
  const float sc = scale[e] * Mma<T>::POST;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = 2 * q + (i & 1);
    const int64_t o = o0 + g + 8 * (i >> 1);
    if (m < M && o < out) {
      float v = acc[i] * sc;
      if (bias != nullptr) v += Cvt<T>::to_f(bias[o]);
      yr[(int64_t)m * out + o] = Cvt<T>::from_f(v);
    }
  }
}

template <int K, typename T>
int launch(int64_t M, const void* x, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed,
           const void* absmax, int fp16, const float* scale, const float* cb, int64_t out, int64_t in,
           const void* bias, void* y, cudaStream_t st) {
  if (out == 0 || N == 0) return 0;
  if (M < 1 || M > 8) return (int)cudaErrorInvalidValue;
  const int64_t nb = (in + 31) / 32;
  const int vec = (in % 8 == 0) && ((reinterpret_cast<uintptr_t>(x) & 15) == 0);
  const int64_t tiles = (out + TILE - 1) / TILE;
  dim3 grid((unsigned)tiles, (unsigned)(ids ? N : 1));
  if (grid.y > 65535u || tiles > 0x7FFFFFFF || in > (int64_t)1 << 30) return (int)cudaErrorInvalidConfiguration;
  // enough warps for ~16 per SM on a 132-SM part: 8 per tile for few tiles of long rows, else 4
  const int64_t work = tiles * (int64_t)grid.y;
  int W = (work * 4 < 2048 && nb >= 16 * STEP) ? 8 : 4;
  static const int w_env = [] {  // tuning knob for benchmarks: KBIT_GEMV_WARPS = 1, 2, 4 or 8
    const char* v = getenv("KBIT_GEMV_WARPS");
    const int n = v ? atoi(v) : 0;
    return (n == 1 || n == 2 || n == 4 || n == 8) ? n : 0;
  }();
  if (w_env) W = w_env;
  gemv_kernel<K, T><<<grid, W * 32, 0, st>>>(reinterpret_cast<const T*>(x), (int)M, packed, absmax, fp16, scale, cb,
                                             reinterpret_cast<const T*>(bias), reinterpret_cast<T*>(y), out, (int)in,
                                             (int)nb, ids, E, vec);
  return (int)cudaGetLastError();
}

template <typename T>
int launch_k(int k, int64_t M, const void* x, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed,
             const void* absmax, int fp16, const float* scale, const float* cb, int64_t out, int64_t in,
             const void* bias, void* y, cudaStream_t st) {
  switch (k) {
    case 2: return launch<2, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
    case 3: return launch<3, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
    case 4: return launch<4, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
    case 5: return launch<5, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, st);
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
