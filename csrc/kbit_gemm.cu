// kbit_gemm.cu: the tensor-core GEMM over the bit planes (docs/format.md) for steps of more than 64 tokens on GPUs
// without the tiled layout's wgmma GEMM (mma.sync m16n8k16, sm_80+): y [M, out] = x [M, in] W^T (+ bias), x / bias / y
// fp16 or bf16, fp32 accumulation. kernels.linear runs it where dispatch.linear_uses_planes_gemm (long rows at 65-128
// tokens: kbit_hf/backends/cuda/dispatch.py); the launch shape: kbit_dispatch.h.
//
// - A CTA computes 128 weight rows (blockIdx.x) x BN = 64 or 128 tokens (blockIdx.y) over its share of the k range
//   (blockIdx.z of `splits`; splits > 1 leave fp32 partial sums in a workspace, summed by gemm_reduce_kernel). The k
//   range runs in groups of 128 (4 blocks).
// - Two warp roles. 8 decode warps copy each group with cp.async into a ring of `stages` shared-memory stages,
//   stages - 1 groups ahead (the group's activations, BN token rows of 256 bytes; its packed words, 128 rows x 4 K
//   words as they lie in memory; its scale codes, plain loads stored a phase later), then decode its weights into one
//   of two bf16 / fp16 tiles of 128 rows x 128 k: decode thread t copies (words and scale code) and decodes blocks t
//   and t + 256 of the group (row b / 4, block b % 4), folding the block's K planes into pair indices (fold_block) and
//   looking each element pair up in a pair table of (cb[even bits], cb[odd bits]) x PRE (R replicas, lane l reads
//   replica l % R), one HMUL2 applying the block scale. 8 MMA warps of 64 rows (warp & 1) x BN / 4 tokens (warp >> 1)
//   multiply the tile by the activations with ldmatrix.x4 fragments (tokens as the MMA's n, NT = BN / 32 tiles of 8 per
//   warp).
// - Phase i, between CTA barriers i and i + 1: the MMA warps multiply group i while the decode warps copy group
//   i + stages - 1 and decode group i + 1, into the stage and tile that group i - 1 freed at barrier i. A decode thread
//   reads only the words and scale codes it copied itself, so its own cp.async wait orders them; the CTA barrier
//   (__syncthreads, which the two roles reach at the same instruction, each phase's work in a warp-uniform branch)
//   publishes the activations and the decoded tile to the MMA warps.
// - Rows past M or out, k past in and blocks past nb are zeros. Both tiles store 16-byte unit u of row r at
//   u ^ (r & 7): the eight rows of each ldmatrix read distinct bank groups.
// - Epilogue: the sums times the tensor scale and POST (+ bias), rounded to the activation dtype; neighbouring lanes
//   swap one value so that each stores two adjacent outputs of one token.
// - Numerics are the GEMV's: weights cb x d rounded to the activation dtype (PRE / POST for fp16), fp32 sums.
#include "kbit_api.h"
#include "kbit_common.cuh"
#include "kbit_dispatch.h"

#include <cuda_runtime.h>

using namespace kbit;

namespace {

constexpr int PG_MMA_WARPS = 8, PG_DEC_WARPS = 8, PG_THREADS = 32 * (PG_MMA_WARPS + PG_DEC_WARPS), PG_ROWS = 128;
constexpr int PG_DEC_THREADS = 32 * PG_DEC_WARPS;
static_assert(PG_DEC_THREADS * 2 == PG_ROWS * 4, "two blocks of each group per decode thread");
constexpr int PG_TILE = PG_ROWS * 256;  // one decoded weight tile: 128 rows x 128 k x 2 bytes

// pair table: 2^(2K) entries of R replicas (lane l reads replica l % R: conflict-free for R = 32)
template <int K>
struct PgTable {
  static constexpr int NP = 1 << (2 * K), R = K <= 3 ? 32 : K == 4 ? 16 : 8;
  static constexpr int L = R == 32 ? 7 : R == 16 ? 6 : 5;  // log2(4 R): bytes per entry
  static constexpr int BYTES = NP * R * 4;
};

// one stage: activations, packed words, scale codes (2 bytes each)
template <int K>
__host__ __device__ constexpr int pg_stage_bytes(int BN) {
  return BN * 256 + PG_ROWS * 4 * K * 4 + PG_ROWS * 4 * 2;
}
template <int K>
__host__ __device__ constexpr int pg_smem_bytes(int BN, int stages) {
  return PgTable<K>::BYTES + 2 * PG_TILE + stages * pg_stage_bytes<K>(BN);
}

__device__ __forceinline__ uint32_t pg_unit(int u, int r) { return (uint32_t)(u ^ (r & 7)); }

// pair 4 B + s of a block from its folded planes f (byte B of f[s]; K = 5: 10-bit fields, bytes 0, 2 in f[s], 1, 3
// in f[4 + s])
template <int K, int B>
__device__ __forceinline__ uint32_t pg_lookup(const unsigned char* tb, const uint32_t (&f)[K == 5 ? 8 : 4], int s,
                                              uint32_t c4) {
  using P = PgTable<K>;
  // the index moved to bit L, masked and or-ed with the replica offset: a shift and one LOP3
  constexpr int SH = K <= 4 ? 8 * B - P::L : 16 * (B >> 1) - P::L;
  constexpr uint32_t MASK = (K <= 4 ? 0xFFu : 0x3FFu) << P::L;
  const uint32_t v = K <= 4 ? f[s] : (B & 1 ? f[4 + s] : f[s]);
  const uint32_t t = SH >= 0 ? v >> (SH >= 0 ? SH : 0) : v << (SH < 0 ? -SH : 0);
  return *reinterpret_cast<const uint32_t*>(tb + ((t & MASK) | c4));
}

// 16-byte unit 4 blk + B of a decoded tile row: pairs 4 B .. 4 B + 3 of the block, times its scale pair d2
template <typename T, int K, int B>
__device__ __forceinline__ void pg_store_unit(unsigned char* wt, const unsigned char* tb, int row, int blk,
                                              const uint32_t (&f)[K == 5 ? 8 : 4], uint32_t d2, uint32_t c4) {
  uint4 v;
  v.x = Mma<T>::mul2(pg_lookup<K, B>(tb, f, 0, c4), d2);
  v.y = Mma<T>::mul2(pg_lookup<K, B>(tb, f, 1, c4), d2);
  v.z = Mma<T>::mul2(pg_lookup<K, B>(tb, f, 2, c4), d2);
  v.w = Mma<T>::mul2(pg_lookup<K, B>(tb, f, 3, c4), d2);
  *reinterpret_cast<uint4*>(wt + row * 256 + pg_unit(4 * blk + B, row) * 16) = v;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

template <typename T, int K, int NT>
__global__ void __launch_bounds__(PG_THREADS, 1)
    gemm_planes_kernel(const T* __restrict__ x, int M, const uint32_t* __restrict__ packed,
                       const void* __restrict__ absmax, int fp16, const float* __restrict__ scale,
                       const float* __restrict__ codebook, const T* __restrict__ bias, int out, int in, int stages,
                       int wcopy, T* __restrict__ y, float* __restrict__ ws, int splits) {
  constexpr int BN = 32 * NT, FW = K == 5 ? 8 : 4;
  using P = PgTable<K>;
  constexpr int SX = 0, SW = BN * 256, SS = SW + PG_ROWS * 4 * K * 4, STAGE = pg_stage_bytes<K>(BN);
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* tb = smem;
  unsigned char* wtile = smem + P::BYTES;
  unsigned char* ring = wtile + 2 * PG_TILE;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  const int r0 = PG_ROWS * blockIdx.x, n0 = BN * blockIdx.y, split = blockIdx.z;
  const int nb = (in + 31) / 32, groups = (nb + 3) / 4;
  const int G0 = (int)((int64_t)split * groups / splits), G1 = (int)((int64_t)(split + 1) * groups / splits);
  const int n = G1 - G0;

  for (int i = tid; i < P::NP * P::R; i += PG_THREADS)
    reinterpret_cast<uint32_t*>(tb)[i] = pair_entry<T, K>(codebook, i / P::R);
  __syncthreads();

  const bool decoder = warp >= PG_MMA_WARPS;  // warp-uniform: the role
  // ---- decode warps: the copies, then each group's weights into a tile (thread dt of 256) ----
  const int dt = tid - 32 * PG_MMA_WARPS;
  const int64_t row_words = (int64_t)nb * K;
  // activations: unit xu of token rows xr + 16 c; packed words and scale codes: blocks b = dt + 256 e (e = 0, 1) of
  // the group, rows drow + 64 e, block dblk, the blocks this thread decodes
  const int xr = dt >> 4, xu = dt & 15, xrows = min(BN / 16, max(0, (M - n0 - xr + 15) / 16));
  const T* xp = xrows > 0 ? x + (int64_t)(n0 + xr) * in + 8 * xu : x;
  const int64_t xstride = (int64_t)16 * in;
  const uint32_t xdst = SX + xr * 256 + pg_unit(xu, xr) * 16;  // + 4096 per 16 rows: the swizzle repeats
  const int drow = dt >> 2, dblk = dt & 3;
  const bool ok0 = r0 + drow < out, ok1 = r0 + drow + 64 < out;
  const uint32_t* wp = ok0 ? packed + (int64_t)(r0 + drow) * row_words : packed;  // row drow + 64: + 64 row_words
  const unsigned char* ap =
      reinterpret_cast<const unsigned char*>(absmax) + (ok0 ? ((size_t)(r0 + drow) * nb) << fp16 : 0);
  uint32_t sc[2];
  auto copy_group = [&](int G, int s) {  // cp.async into stage s; scale codes into sc
    unsigned char* st = ring + s * STAGE;
    const bool kvalid = 128 * G + 8 * xu < in;  // in % 8 == 0: a unit is all inside or all past
#pragma unroll
    for (int c = 0; c < BN / 16; ++c) {
      const bool v = kvalid && c < xrows;
      cp_async16(st + xdst + 4096 * c, v ? xp + c * xstride + 128 * G : x, v ? 16 : 0);
    }
    // block (drow + 64 e, dblk): K words, one 16- (K = 4) or 8-byte (K = 2) copy where wcopy allows, else K of 4
    const int bg = 4 * G + dblk;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const bool v = (e ? ok1 : ok0) && bg < nb;
      const uint32_t* src = v ? wp + (int64_t)e * 64 * row_words + (int64_t)bg * K : packed;
      unsigned char* dst = st + SW + (dt + PG_DEC_THREADS * e) * K * 4;
      if (K == 4 && wcopy == 16) {
        cp_async16(dst, src, v ? 16 : 0);
      } else if (K == 2 && wcopy == 8) {
        cp_async8(dst, src, v ? 8 : 0);
      } else {
#pragma unroll
        for (int j = 0; j < K; ++j) cp_async4(dst + 4 * j, v ? src + j : packed, v ? 4 : 0);
      }
      const unsigned char* a = ap + ((((size_t)e * 64 * nb) + bg) << fp16);
      sc[e] = !v ? 0u : fp16 ? (uint32_t)*reinterpret_cast<const unsigned short*>(a) : (uint32_t)*a;
    }
  };
  auto put_scales = [&](int s) {
    unsigned short* d = reinterpret_cast<unsigned short*>(ring + s * STAGE + SS) + dt;
    d[0] = (unsigned short)sc[0];
    d[PG_DEC_THREADS] = (unsigned short)sc[1];
  };
  const uint32_t c4 = 4u * (uint32_t)(lane % P::R);
  auto decode = [&](int i) {  // group i (stage i % stages) into tile i % 2
    const unsigned char* st = ring + (i % stages) * STAGE;
    unsigned char* wt = wtile + (i & 1) * PG_TILE;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int b = dt + PG_DEC_THREADS * e, row = b >> 2, blk = b & 3;  // the blocks this thread copied
      const uint32_t* w_s = reinterpret_cast<const uint32_t*>(st + SW) + b * K;
      uint32_t w[K];
      if constexpr (K == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(w_s);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
      } else if constexpr (K == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(w_s);
        w[0] = v.x; w[1] = v.y;
      } else {
#pragma unroll
        for (int j = 0; j < K; ++j) w[j] = w_s[j];
      }
      uint32_t f[FW];
      fold_block<K>(w, f);
      const uint32_t d2 = scale_pair<T>(reinterpret_cast<const unsigned short*>(st + SS)[b], fp16);
      pg_store_unit<T, K, 0>(wt, tb, row, blk, f, d2, c4);
      pg_store_unit<T, K, 1>(wt, tb, row, blk, f, d2, c4);
      pg_store_unit<T, K, 2>(wt, tb, row, blk, f, d2, c4);
      pg_store_unit<T, K, 3>(wt, tb, row, blk, f, d2, c4);
    }
  };
  auto wait_landed = [&]() {  // the oldest stages - 1 committed copy groups but the last stages - 2 have landed
    if (stages == 3) cp_async_wait<1>();
    else cp_async_wait<2>();
  };
  // ---- MMA warps: 64 rows (warp & 1) x BN / 4 tokens (warp >> 1) ----
  float acc[4][NT][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][t][c] = 0.f;
  const uint32_t wtile_s = (uint32_t)__cvta_generic_to_shared(wtile), ring_s = (uint32_t)__cvta_generic_to_shared(ring);
  const int wr = warp & 1, wt = warp >> 1;
  // ldmatrix lanes: A rows 64 wr + 16 i + (lane & 15), unit 2 kk + lane / 16; B tokens BN / 4 wt + 8 t + 8 (lane / 16)
  // + (lane & 7), unit 2 kk + (lane / 8) % 2
  const int a_row = 64 * wr + (lane & 15), a_hi = lane >> 4;
  const int b_tok = (BN / 4) * wt + ((lane >> 4) << 3) + (lane & 7), b_hi = (lane >> 3) & 1;
  // the phases of the file's header comment: one __syncthreads each, reached by both roles
  const int ahead = stages - 1;
  if (decoder) {
    for (int i = 0; i < ahead; ++i) {
      if (i < n) {
        copy_group(G0 + i, i);
        put_scales(i);
      }
      cp_async_commit();
    }
    wait_landed();  // this thread's copies of group 0 have landed
    if (n > 0) decode(0);
  }
  __syncthreads();
  for (int i = 0; i < n; ++i) {
    if (decoder) {
      const int ic = i + ahead;
      if (ic < n) copy_group(G0 + ic, ic % stages);
      cp_async_commit();
      wait_landed();  // this thread's copies of group i + 1 have landed
      if (i + 1 < n) decode(i + 1);
      if (ic < n) put_scales(ic % stages);  // read by decode(ic), phases later
    } else {
      const uint32_t wbase = wtile_s + (i & 1) * PG_TILE, xbase = ring_s + (i % stages) * STAGE + SX;
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        uint32_t a[4][4], b[NT][2];
#pragma unroll
        for (int ti = 0; ti < 4; ++ti) {
          const int r = a_row + 16 * ti;
          ldmatrix_x4(wbase + r * 256 + pg_unit(2 * kk + a_hi, r) * 16, a[ti]);
        }
#pragma unroll
        for (int t = 0; t < NT; t += 2) {
          const int r = b_tok + 8 * t;
          uint32_t v[4];
          ldmatrix_x4(xbase + r * 256 + pg_unit(2 * kk + b_hi, r) * 16, v);
          b[t][0] = v[0]; b[t][1] = v[1]; b[t + 1][0] = v[2]; b[t + 1][1] = v[3];
        }
#pragma unroll
        for (int ti = 0; ti < 4; ++ti)
#pragma unroll
          for (int t = 0; t < NT; ++t) Mma<T>::run(acc[ti][t], a[ti][0], a[ti][1], a[ti][2], a[ti][3], b[t][0], b[t][1]);
      }
    }
    __syncthreads();  // group i multiplied: its tile and stage are free
  }
  if (decoder) {
    cp_async_wait<0>();
    return;
  }

  // epilogue: acc[i][t] = (row 16 i + g, tokens 2 q, 2 q + 1), (row + 8, the same tokens)
  const float post = Mma<T>::POST * (splits == 1 ? __ldg(scale) : 1.f);
  const bool pairs = splits == 1 && (out & 1) == 0 && ((uintptr_t)y & 3) == 0;  // 4-byte stores
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int o = r0 + 64 * wr + 16 * i + g + 8 * rr, n = n0 + (BN / 4) * wt + 8 * t + 2 * q;
        const float v0 = acc[i][t][2 * rr] * post, v1 = acc[i][t][2 * rr + 1] * post;
        if (pairs) {
          // lanes g and g ^ 1 swap: the even one stores rows (o, o + 1) of token n, the odd one of token n + 1
          const float recv = __shfl_xor_sync(0xFFFFFFFFu, (g & 1) ? v0 : v1, 4);
          const int oe = o & ~1, ne = n + (g & 1);
          float lo = (g & 1) ? recv : v0, hi = (g & 1) ? v1 : recv;
          if (oe < out && ne < M) {
            if (bias != nullptr) {
              lo += Cvt<T>::to_f(bias[oe]);
              hi += Cvt<T>::to_f(bias[oe + 1]);
            }
            *reinterpret_cast<uint32_t*>(y + (int64_t)ne * out + oe) = Mma<T>::pack(lo, hi);
          }
        } else if (o < out) {
          if (splits > 1) {
            float* part = ws + (int64_t)split * M * out;
            if (n < M) part[(int64_t)n * out + o] = v0;
            if (n + 1 < M) part[(int64_t)(n + 1) * out + o] = v1;
          } else {
            const float bo = bias != nullptr ? Cvt<T>::to_f(bias[o]) : 0.f;
            if (n < M) y[(int64_t)n * out + o] = Cvt<T>::from_f(v0 + bo);
            if (n + 1 < M) y[(int64_t)(n + 1) * out + o] = Cvt<T>::from_f(v1 + bo);
          }
        }
      }
}

int max_smem_optin(int dev) {
  static int cache[64] = {};
  if (dev < 0 || dev >= 64) return 0;
  if (cache[dev] == 0 && cudaDeviceGetAttribute(&cache[dev], cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    cache[dev] = 0;
  return cache[dev];
}

// the launch shape of a call (kbit_dispatch.h); bn / stages > 0 force them
template <int K>
bool gemm_planes_shape(int64_t M, int64_t out, int64_t in, int dev, int sms, int bn, int stages,
                       GemmPlanesShape& sh) {
  const int smem = max_smem_optin(dev);
  auto bytes = [](int b, int s) { return pg_smem_bytes<K>(b, s); };
  sh = gemm_planes_choose(M, out, in, sms, smem, bytes);
  if (bn > 0 || stages > 0) {
    if (bn > 0) sh.bn = bn;
    if (stages > 0) sh.stages = stages;
    sh.splits = gemm_planes_splits(M, out, in, sms, sh.bn);
  }
  return (sh.bn == 64 || sh.bn == 128) && sh.stages >= 3 && sh.stages <= 4 && bytes(sh.bn, sh.stages) <= smem;
}

template <typename T, int K>
int gemm_planes_launch(const T* x, int64_t M, const uint32_t* packed, const void* absmax, int fp16,
                       const float* scale, const float* cb, const T* bias, int64_t out, int64_t in, T* y, float* ws,
                       int64_t ws_bytes, int bn, int stages, cudaStream_t st) {
  int dev = 0, sms = 0;
  if (!current_device_sms(dev, sms)) return (int)cudaErrorInvalidDevice;
  GemmPlanesShape sh;
  if (!gemm_planes_shape<K>(M, out, in, dev, sms, bn, stages, sh)) return (int)cudaErrorNotSupported;
  if (sh.splits > 1 && ws_bytes < gemm_planes_workspace_bytes(sh, M, out)) return (int)cudaErrorInvalidValue;
  if ((M + sh.bn - 1) / sh.bn > 65535) return (int)cudaErrorInvalidConfiguration;  // grid.y
  const auto kernel = sh.bn == 128 ? gemm_planes_kernel<T, K, 4> : gemm_planes_kernel<T, K, 2>;
  const int smem = pg_smem_bytes<K>(sh.bn, sh.stages);
  static int smem_set[2][64] = {};  // per tokens per CTA and device: the dynamic shared memory allowed so far
  int& allowed = smem_set[sh.bn == 128][dev];
  if (smem > allowed) {
    const cudaError_t ea = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (ea != cudaSuccess) return (int)ea;
    allowed = smem;
  }
  // the widest copy of a block's K words that every row's alignment allows (rows of nb K words)
  const int wcopy = K == 4 && ((uintptr_t)packed & 15) == 0 ? 16 : K == 2 && ((uintptr_t)packed & 7) == 0 ? 8 : 4;
  const dim3 grid((unsigned)((out + PG_ROWS - 1) / PG_ROWS), (unsigned)((M + sh.bn - 1) / sh.bn), (unsigned)sh.splits);
  kernel<<<grid, PG_THREADS, smem, st>>>(x, (int)M, packed, absmax, fp16 ? 1 : 0, scale, cb, bias, (int)out, (int)in,
                                          sh.stages, wcopy, y, ws, sh.splits);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || sh.splits == 1) return (int)e;
  gemm_reduce_kernel<T><<<grid_for_threads(M * out, 256, 8), 256, 0, st>>>(ws, sh.splits, M * out, out, scale, bias, y);
  return (int)cudaGetLastError();
}

bool planes_args_ok(int64_t M, int64_t out, int64_t in, const void* x) {
  return M >= 1 && M <= ((int64_t)1 << 30) && out >= 1 && out <= ((int64_t)1 << 30) && in >= 8 && in % 8 == 0 &&
         in <= ((int64_t)1 << 30) && !((uintptr_t)x & 15) && M * out < ((int64_t)1 << 62);
}

}  // namespace

extern "C" {

KBIT_API int64_t kbit_gemm_planes_workspace(int64_t M, int64_t out, int64_t in, int k, int bn) {
  int dev = 0, sms = 0;
  if (!planes_args_ok(M, out, in, nullptr) || !current_device_sms(dev, sms)) return -1;
  int64_t bytes = -1;
  with_k(k, [&](auto kc) {
    GemmPlanesShape sh;
    if (gemm_planes_shape<kc.value>(M, out, in, dev, sms, bn, 0, sh)) bytes = gemm_planes_workspace_bytes(sh, M, out);
    return 0;
  });
  return bytes;
}

KBIT_API int kbit_gemm_planes_kernel(const void* x, int x_dtype, int64_t M, const uint32_t* packed,
                                     const void* absmax, int absmax_fp16, const float* scale, const float* codebook,
                                     int k, int64_t out, int64_t in, const void* bias, void* y, void* workspace,
                                     int64_t workspace_bytes, int bn, int stages, void* stream) {
  if (!planes_args_ok(M, out, in, x)) return (int)cudaErrorInvalidValue;
  cudaStream_t st = (cudaStream_t)stream;
  float* ws = (float*)workspace;
  return with_k(k, [&](auto kc) {
    constexpr int K = kc.value;
    if (x_dtype == BF16)
      return gemm_planes_launch<__nv_bfloat16, K>((const __nv_bfloat16*)x, M, packed, absmax, absmax_fp16, scale,
                                                  codebook, (const __nv_bfloat16*)bias, out, in, (__nv_bfloat16*)y,
                                                  ws, workspace_bytes, bn, stages, st);
    if (x_dtype == F16)
      return gemm_planes_launch<__half, K>((const __half*)x, M, packed, absmax, absmax_fp16, scale, codebook,
                                           (const __half*)bias, out, in, (__half*)y, ws, workspace_bytes, bn, stages, st);
    return (int)cudaErrorInvalidValue;
  });
}

KBIT_API int kbit_gemm_planes(const void* x, int x_dtype, int64_t M, const uint32_t* packed, const void* absmax,
                              int absmax_fp16, const float* scale, const float* codebook, int k, int64_t out,
                              int64_t in, const void* bias, void* y, void* workspace, int64_t workspace_bytes,
                              void* stream) {
  return kbit_gemm_planes_kernel(x, x_dtype, M, packed, absmax, absmax_fp16, scale, codebook, k, out, in, bias, y,
                                 workspace, workspace_bytes, 0, 0, stream);
}

}  // extern "C"
