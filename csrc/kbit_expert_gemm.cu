// kbit_expert_gemm.cu: the grouped expert GEMM over the bit planes (docs/format.md) for MoE layers with many rows
// per expert (prefill): y[n] = x[n] @ W[ids[n]]^T for N rows and experts W [E, out, in], on the tensor cores (wgmma,
// sm_90a), fp32 accumulation. Which expert path a call runs: kbit_hf/backends/cuda/dispatch.py.
//
// - Rows are counting-sorted by expert on the device (expert_route), then gathered in that order (gather_rows: xs[r]
//   = x[order[r]], so each expert's rows are contiguous for the TMA); no host sync, CUDA-graph capturable.
// - The product runs transposed, y^T = W x^T: the weight is wgmma's register operand A, the activations its
//   shared-memory operand B. A CTA is 128 weight rows of one expert (blockIdx.x) by a work item of at most BN = 64,
//   128 or 256 of that expert's sorted rows (blockIdx.y, find_item): two consumer warpgroups (warp w decodes rows
//   16 w .. 16 w + 15 of the 128) and a producer warpgroup, one lane of which fills EG_STAGES stages of 32 KB with
//   TMA boxes of 64 k x BN rows (128-byte swizzle, wgmma's K-major layout; rows past N are zero-filled, rows of the
//   next expert are computed and never stored).
// - Decode, from the bit planes straight into wgmma's A fragment (the m16n8k16 one per warp). Each 128-element
//   group of k is gathered permuted (gather_rows_kernel) so that lane 4 g + q's A registers of the group's 8 k16
//   slices are the 16 element pairs of one block, block q of the group, of rows g and g + 8: slice 2 kb + h, column
//   pair j holds pair 4 kb + 2 h + j (a last half group of 64, where in % 128 == 64: lanes q and q ^ 1 share block
//   q / 2, lane q its pairs 8 (q & 1) ..). The lane loads that block's K words and scale for both rows (D groups
//   ahead, D register sets used in turn: 8 / 4 / 2 at 64 / 128 / 256 rows per item), folds the K planes into four
//   words f_s whose byte B is the 2K-bit index of pair 4 B + s (K = 5: 16-bit fields, eight words), and per step kb
//   looks up byte kb of each f_s: one PRMT of it with the lane's table offset is the address of a conflict-free
//   lookup in a pair table of (cb[even index bits], cb[odd]) x PRE, 32 replicas 256 bytes apart per entry (K = 5: a
//   shift and a mask, 16 replicas); one HMUL2 applies the block scale. Step kb's wgmmas run while step kb + 1 is
//   decoded into the other register set (wgmma.wait_group 1).
// - Epilogue: the sums times the expert's tensor scale (and POST), rounded to the activation dtype, stored at the
//   rows' original places (order): staged through shared memory as 16-byte chunks (wgmma_store_staged) where out is
//   a multiple of 8 and y 16-byte aligned, else one output at a time. Rows whose ids are outside [0, E) are zeros.
// - Numerics are the expert GEMV's: weights rounded to the activation dtype as cb x d (PRE / POST for fp16), fp32
//   sums in k order.
#include "kbit_api.h"
#include "kbit_common.cuh"
#include "kbit_dispatch.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <type_traits>

using namespace kbit;

namespace {

#include "kbit_sm90.cuh"

constexpr int EG_WARPS = 8, EG_THREADS = EG_WARPS * 32 + 128, EG_STAGES = 4;
// registers per thread after setmaxnreg: the producer warpgroup gives its own to the consumers
constexpr int EG_PRODUCER_REGS = 40, EG_CONSUMER_REGS = 232;
static_assert((EG_PRODUCER_REGS + 2 * EG_CONSUMER_REGS) * 128 <= 65536, "register file");
// shared-window addresses: barriers, the work item and its rows, stage 0, the pair table, stages 1..
constexpr uint32_t EG_BARS = 0x1000, EG_ITEM = 0x1100, EG_ROWS = 0x1200, EG_TABLE = 0x10000, EG_STAGE = 0x8000;
constexpr uint32_t EG_FULL = EG_BARS, EG_EMPTY = EG_BARS + 8 * EG_STAGES;
__host__ __device__ constexpr uint32_t eg_stage_addr(int s) {
  return s == 0 ? 0x2000u : 0x20000u + (uint32_t)(s - 1) * EG_STAGE;
}
constexpr uint32_t EG_SMEM_END = eg_stage_addr(EG_STAGES - 1) + EG_STAGE;
static_assert(EG_EMPTY + 8 * EG_STAGES <= EG_ITEM && EG_ROWS + 4 * 128 <= eg_stage_addr(0) &&
                  eg_stage_addr(0) + EG_STAGE <= EG_TABLE && EG_SMEM_END <= 227 * 1024,
              "expert GEMM shared-memory map");
// a TMA box: BN rows of 64 k (128 bytes); a stage holds 32 KB of boxes, eg_stage_blocks 32-element blocks of k
constexpr uint32_t eg_box(int BN) { return (uint32_t)BN * 128; }
constexpr int eg_stage_blocks(int BN) { return (int)(EG_STAGE / eg_box(BN)) * 2; }

// the pair table: entry p = (cb[even bits of p], cb[odd bits of p]) x PRE in T, replica r at EG_TABLE + 256 p + 4 r
// (K <= 4, 32 replicas) or EG_TABLE + 64 p + 4 r (K = 5, 16)
template <int K>
struct EgTable {
  static constexpr int NP = 1 << (2 * K), R = K == 5 ? 16 : 32, ROW = K == 5 ? 64 : 256;
  static_assert(NP * ROW <= 0x10000, "pair table window");
};
template <typename T, int K>
__device__ __forceinline__ void eg_build_table(unsigned char* win, const float* __restrict__ cb) {
  using P = EgTable<K>;
  constexpr int STORES = P::R / 4;  // 16-byte stores per entry: its replicas are contiguous
  for (int i = threadIdx.x; i < P::NP * STORES; i += blockDim.x) {
    const int p = i / STORES;
    const uint32_t v = pair_entry<T, K>(cb, p);
    *reinterpret_cast<uint4*>(win + EG_TABLE + P::ROW * p + 16 * (i % STORES)) = make_uint4(v, v, v, v);
  }
}

// One lane's share of a group of 4 blocks (128 k): block 4 G + q of rows g and g + 8, its K words w[row][plane] and
// block scale code sc[row]
template <int K>
struct EgGroup {
  uint32_t w[2][K];
  uint32_t sc[2];
};

// the K words of one block (K = 2, 4: one 8- or 16-byte load; K = 3, 5: 4-byte loads)
template <int K>
__device__ __forceinline__ void eg_load_block(const uint32_t* p, uint32_t (&w)[K]) {
  if constexpr (K == 4) {
    const uint4 u = ldg128_now(p);
    w[0] = u.x; w[1] = u.y; w[2] = u.z; w[3] = u.w;
  } else if constexpr (K == 2) {
    const uint2 u = ldg64_now(p);
    w[0] = u.x; w[1] = u.y;
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = ldg32_now(p + j);
  }
}

// A registers of step kb (k slices 2 kb, 2 kb + 1 of the group) of one row: slice h, j = 0 / 1 is pair 4 kb + 2 h + j
// of the lane's block (x is gathered in that order: gather_rows_kernel), byte kb of fold 2 h + j
template <typename T, int K>
__device__ __forceinline__ void eg_lookup(const uint32_t (&f)[K == 5 ? 8 : 4], int kb, uint32_t d2, uint32_t cl,
                                          int row, uint32_t (&a)[2][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int s = 2 * h + j;
      uint32_t addr;
      if constexpr (K <= 4) {
        addr = prmt(f[s], cl, 0x6504u | (uint32_t)kb << 4);
      } else {
        constexpr uint32_t M = 0x3FFu << 6;  // the 10-bit index at bit 6: 64 bytes per entry
        const uint32_t t = (kb & 1) ? f[4 + s] : f[s];
        addr = ((kb >> 1 ? t >> 10 : t << 6) & M) | cl;
      }
      a[h][2 * j + row] = Mma<T>::mul2(lds_at(addr), d2);
    }
}

template <typename T, int K, int BN>
__global__ void __launch_bounds__(EG_THREADS, 1)
    expert_gemm_kernel(const __grid_constant__ CUtensorMap xmap, const int* __restrict__ order,
                       const int* __restrict__ offsets, int E, const uint32_t* __restrict__ packed,
                       const void* __restrict__ absmax, int fp16, const float* __restrict__ scale,
                       const float* __restrict__ codebook, int out, int in, T* __restrict__ y) {
#if !KBIT_WGMMA
  __trap();  // sm_90a only: the launcher refuses other devices
#endif
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  unsigned char* win = smem - base;
  {
    uint32_t dsz;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dsz));
    if (base > EG_BARS || base + dsz < EG_SMEM_END) __trap();
  }
  const int lane = threadIdx.x & 31, warp = __shfl_sync(0xFFFFFFFFu, (int)threadIdx.x >> 5, 0);
  int* item = reinterpret_cast<int*>(win + EG_ITEM);  // expert, first sorted row, rows
  int* rows = reinterpret_cast<int*>(win + EG_ROWS);  // the item's original row indices
  if (warp == 0) find_item(offsets, E + 1, BN, (int)blockIdx.y, lane, item);
  __syncthreads();
  const int e = item[0], r0 = item[1], n = item[2];
  if (n <= 0) return;  // past the last work item
  for (int i = threadIdx.x; i < n; i += blockDim.x) rows[i] = order[r0 + i];
  const int o_cta = 128 * (int)blockIdx.x;
  if (e == E) {  // ids outside [0, E): zero rows
    __syncthreads();
    const int w = min(128, out - o_cta);
    for (int i = threadIdx.x; i < n * w; i += blockDim.x)
      y[(int64_t)rows[i / w] * out + o_cta + i % w] = Cvt<T>::from_f(0.f);
    return;
  }
  const int nb = in / 32, npairs = nb / 2;
  constexpr uint32_t BOX = eg_box(BN);
  constexpr int SB = eg_stage_blocks(BN);
  const int steps = (nb + SB - 1) / SB;
  if (threadIdx.x == 0) {
    for (int s = 0; s < EG_STAGES; ++s) {
      mbar_init(EG_FULL + 8 * s, 1);
      mbar_init(EG_EMPTY + 8 * s, EG_WARPS);
    }
  }
  eg_build_table<T, K>(win, codebook);
  __syncthreads();
  if (warp >= EG_WARPS) {  // the producer warpgroup: one lane issues the copies
#if KBIT_WGMMA
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(EG_PRODUCER_REGS));
#endif
    if (warp == EG_WARPS && lane == 0) {
      for (int j = 0; j < steps; ++j) {
        const int s = j % EG_STAGES;
        if (j >= EG_STAGES) mbar_wait(EG_EMPTY + 8 * s, (j / EG_STAGES - 1) & 1);
        const int p0 = j * SB / 2, boxes = min(SB / 2, npairs - p0);
        mbar_expect_tx(EG_FULL + 8 * s, (uint32_t)boxes * BOX);
        for (int b = 0; b < boxes; ++b)
          tma_load_2d(eg_stage_addr(s) + b * BOX, &xmap, 64 * (p0 + b), r0, EG_FULL + 8 * s);
      }
    }
    return;
  }
#if KBIT_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(EG_CONSUMER_REGS));
#endif
  const int g = lane >> 2, q = lane & 3;
  const int o0 = o_cta + 16 * warp;  // this warp's first row
  // (a warp past the last row decodes the clamped last row's weights: its wgmma rows are never stored)
  const bool active = o0 < out;
  const uint32_t cl = K == 5 ? EG_TABLE | (uint32_t)(lane & 15) * 4 : 0x0100u | (uint32_t)lane * 4;
  // rows g and g + 8, clamped into the expert (rows past `out` compute values that are never stored)
  const int64_t rg = (int64_t)e * out + min(o0 + g, out - 1), rh = (int64_t)e * out + min(o0 + g + 8, out - 1);
  const uint32_t* wg = packed + rg * nb * K;
  const uint32_t* wh = packed + rh * nb * K;
  const unsigned char* ag = reinterpret_cast<const unsigned char*>(absmax) + rg * nb * (fp16 ? 2 : 1);
  const unsigned char* ah = reinterpret_cast<const unsigned char*>(absmax) + rh * nb * (fp16 ? 2 : 1);
  // groups of 4 blocks, and where in % 128 == 64 a last half group of 2 (lanes q, q ^ 1 share block q / 2: lane q
  // takes its pairs 8 (q & 1) ..; its steps read bytes 2 (q & 1) + kb of the folds)
  const int nfull = nb / 4, ngroups = (nb + 3) / 4;
  const int tail_byte = 2 * (q & 1);
  // group G's words and scale codes: block 4 G + q (the half group: 4 G + q / 2) of both rows
  auto load_group = [&](int G, EgGroup<K>& r) {
    const int blk = 4 * G + (G < nfull ? q : q >> 1);
    eg_load_block<K>(wg + blk * K, r.w[0]);
    eg_load_block<K>(wh + blk * K, r.w[1]);
    if (fp16) {
      r.sc[0] = ldg16_now(ag + 2 * blk);
      r.sc[1] = ldg16_now(ah + 2 * blk);
    } else {
      r.sc[0] = ldg8_now(ag + blk);
      r.sc[1] = ldg8_now(ah + blk);
    }
  };
  // the folded indices and scale pairs of a group's two rows, and the A registers of its step kb
  uint32_t fold[2][K == 5 ? 8 : 4], d2[2];
  auto prepare = [&](const EgGroup<K>& r) {
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      fold_block<K>(r.w[row], fold[row]);
      d2[row] = scale_pair<T>(r.sc[row], fp16);
    }
  };
  // byte: kb in a whole group, tail_byte + kb in the half group
  auto decode = [&](int byte, uint32_t(&a)[2][4]) {
#pragma unroll
    for (int row = 0; row < 2; ++row) eg_lookup<T, K>(fold[row], byte, d2[row], cl, row, a);
  };
  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  // the weights of the next D groups are in flight: D x 4 steps of wgmmas cover a load's latency (fewer rows per
  // work item: shorter steps, more groups)
  constexpr int D = BN == 64 ? 8 : BN == 128 ? 4 : 2;
  EgGroup<K> buf[D];
#pragma unroll
  for (int d = 0; d < D; ++d)
    if (d < ngroups) load_group(d, buf[d]);
  uint32_t a[2][2][4];
  prepare(buf[0]);
  decode(nfull > 0 ? 0 : tail_byte, a[0]);
  // group G (registers r; the next group's in rn): step kb's wgmmas, then step kb + 1 decoded into the other set
  auto group = [&](int G, EgGroup<K>& r, EgGroup<K>& rn) {
    const int b0 = G < nfull ? 0 : tail_byte;
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      const int blk = 4 * G + kb;  // the step's 32 k of the stage
      if (blk >= nb) break;        // the half group's last two
      const int j = blk / SB;      // the stage's step
      if (blk % SB == 0) mbar_wait(EG_FULL + 8 * (j % EG_STAGES), (j / EG_STAGES) & 1);
      wgmma_fence();
      const uint32_t st = eg_stage_addr(j % EG_STAGES) + ((blk % SB) >> 1) * BOX + (blk & 1) * 64;
      wgmma_tokens<T, BN>(acc, a[kb & 1][0], swizzled_desc(st));
      wgmma_tokens<T, BN>(acc, a[kb & 1][1], swizzled_desc(st + 32));
      wgmma_commit();
      wgmma_wait<1>();
      // the step before j is done with when its last block's wgmmas are (its first block's wgmmas just issued)
      if (blk % SB == 0 && j > 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(EG_EMPTY + 8 * ((j - 1) % EG_STAGES));
      }
      if (kb < 3) {
        if (blk + 1 < nb) decode(b0 + kb + 1, a[(kb + 1) & 1]);
      } else if (G + 1 < ngroups) {
        prepare(rn);
        decode(G + 1 < nfull ? 0 : tail_byte, a[0]);
        if (G + D < ngroups) load_group(G + D, r);  // this group's registers are free now
      }
    }
  };
  for (int G0 = 0; G0 < ngroups; G0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d)
      if (G0 + d < ngroups) group(G0 + d, buf[d], buf[(d + 1) % D]);
  }
  wgmma_wait<0>();
  fence_acc(acc);
  __syncwarp();
  if (lane == 0) mbar_arrive(EG_EMPTY + 8 * ((steps - 1) % EG_STAGES));
  // acc[4 nt + i]: row o0 + g + 8 (i >> 1), the item's row 8 nt + 2 q + (i & 1)
  const float sc = __ldg(scale + e) * Mma<T>::POST;
  if (out % 8 == 0 && ((uintptr_t)y & 15) == 0) {
    // past this barrier no wgmma of either warpgroup reads the stages: warpgroup w stages its outputs in stage 1 + w
    static_assert(2 * BN * 128 <= 3 * EG_STAGE, "the epilogue's staging fits stages 1..3");
    bar_group(1, EG_WARPS * 32);
    const int wgi = warp >> 2, o_base = o_cta + 64 * wgi;
    wgmma_store_staged<T, BN>(acc, eg_stage_addr(1) + (uint32_t)(wgi * BN * 128), sc, 0.f, 0.f, warp & 3, lane,
                              (int)threadIdx.x & 127, 2 + wgi, [&](int m, int c) -> T* {
                                const int o = o_base + 8 * c;
                                return m < n && o < out ? y + (int64_t)rows[m] * out + o : nullptr;
                              });
    return;
  }
  if (!active) return;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) {
    const int m = 8 * (i >> 2) + 2 * q + (i & 1), o = o0 + g + 8 * ((i >> 1) & 1);
    if (m < n && o < out) y[(int64_t)rows[m] * out + o] = Cvt<T>::from_f(acc[i] * sc);
  }
}

// xs[r] = x[order[r]] with each 128-element group of k in the decode's order: natural pair P = 8 S + 4 j + q (k slice
// S, A-fragment column pair j of lane quad position q) holds pair 16 q + 2 S + j of the group, so lane q's block of a
// group feeds its A registers; a last half group (in % 128 == 64) holds pair 8 (q & 1) + 2 S + j of block q / 2. One
// thread per pair of activations.
template <typename T>
__global__ void gather_rows_kernel(const T* __restrict__ x, const int* __restrict__ order, int64_t N, int in,
                                   T* __restrict__ xs) {
  const int per_row = in / 2, full_pairs = in / 128 * 64;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < N * per_row;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / per_row;
    const int c = (int)(i % per_row), P = c & 63, S = P >> 3, j = (P >> 2) & 1, q = P & 3;
    // a whole group: block q, its pair 2 S + j; the half group (32 pairs, S < 4): block q / 2, pair 8 (q & 1) + 2 S + j
    const int src = (c & ~63) + (c < full_pairs ? 16 * q + 2 * S + j : 16 * (q >> 1) + 8 * (q & 1) + 2 * S + j);
    const uint32_t* xr = reinterpret_cast<const uint32_t*>(x + (int64_t)order[r] * in);
    reinterpret_cast<uint32_t*>(xs + r * in)[c] = __ldg(xr + src);
  }
}

// rows per work item: the smallest of 64, 128, 256 that holds the mean rows per expert
inline int expert_gemm_tokens(int64_t N, int64_t E) { return N <= 64 * E ? 64 : N <= 128 * E ? 128 : 256; }

// workspace: order [N], offsets [E + 2] (ints), then xs [N, in] at a 256-byte boundary
inline int64_t xs_offset(int64_t N, int64_t E) { return ((N + E + 2) * (int64_t)sizeof(int) + 255) / 256 * 256; }

template <typename T, int K, int BN>
int launch_bn(const CUtensorMap& map, const int* order, const int* offsets, int64_t N, int64_t E,
              const uint32_t* packed, const void* absmax, int fp16, const float* scale, const float* cb, int64_t out,
              int64_t in, T* y, int dev, cudaStream_t st) {
  const auto kernel = expert_gemm_kernel<T, K, BN>;
  static bool attr_set[64] = {};
  if (!attr_set[dev]) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)EG_SMEM_END);
    if (e != cudaSuccess) return (int)e;
    attr_set[dev] = true;
  }
  // work items: each non-empty bucket's last chunk may be partial
  const int64_t items = (N + BN - 1) / BN + (E + 1 < N ? E + 1 : N);
  if (items > 65535) return (int)cudaErrorInvalidConfiguration;
  const dim3 grid((unsigned)((out + 127) / 128), (unsigned)items);
  kernel<<<grid, EG_THREADS, EG_SMEM_END, st>>>(map, order, offsets, (int)E, packed, absmax, fp16, scale, cb, (int)out,
                                                (int)in, y);
  return (int)cudaGetLastError();
}

template <typename T, int K>
int launch(const T* x, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed, const void* absmax, int fp16,
           const float* scale, const float* cb, int64_t out, int64_t in, T* y, void* ws, cudaStream_t st) {
  int dev = 0, sms = 0;
  if (!current_device_sms(dev, sms)) return (int)cudaErrorInvalidDevice;
  if (!wgmma_gemm_available(dev)) return (int)cudaErrorNotSupported;
  int* order = reinterpret_cast<int*>(ws);
  int* offsets = order + N;
  T* xs = reinterpret_cast<T*>(reinterpret_cast<char*>(ws) + xs_offset(N, E));
  expert_route(ids, N, E, order, offsets, st);
  gather_rows_kernel<T><<<grid_for_threads(N * (in / 2), 256, 8), 256, 0, st>>>(x, order, N, (int)in, xs);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return (int)e;
  const int BN = expert_gemm_tokens(N, E);
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)in, (cuuint64_t)N}, strides[1] = {(cuuint64_t)in * sizeof(T)};
  const cuuint32_t box[2] = {64, (cuuint32_t)BN}, estr[2] = {1, 1};
  if (encode_tiled()(&map, std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                          : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                     2, xs, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return (int)cudaErrorInvalidValue;
  if (BN == 64)
    return launch_bn<T, K, 64>(map, order, offsets, N, E, packed, absmax, fp16, scale, cb, out, in, y, dev, st);
  if (BN == 128)
    return launch_bn<T, K, 128>(map, order, offsets, N, E, packed, absmax, fp16, scale, cb, out, in, y, dev, st);
  return launch_bn<T, K, 256>(map, order, offsets, N, E, packed, absmax, fp16, scale, cb, out, in, y, dev, st);
}

template <typename T>
int launch_k(int k, const void* x, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed,
             const void* absmax, int fp16, const float* scale, const float* cb, int64_t out, int64_t in, void* y,
             void* ws, cudaStream_t st) {
  const T* xt = reinterpret_cast<const T*>(x);
  T* yt = reinterpret_cast<T*>(y);
  switch (k) {
    case 2: return launch<T, 2>(xt, N, ids, E, packed, absmax, fp16, scale, cb, out, in, yt, ws, st);
    case 3: return launch<T, 3>(xt, N, ids, E, packed, absmax, fp16, scale, cb, out, in, yt, ws, st);
    case 4: return launch<T, 4>(xt, N, ids, E, packed, absmax, fp16, scale, cb, out, in, yt, ws, st);
    case 5: return launch<T, 5>(xt, N, ids, E, packed, absmax, fp16, scale, cb, out, in, yt, ws, st);
  }
  return (int)cudaErrorInvalidValue;
}

}  // namespace

extern "C" {

KBIT_API int64_t kbit_expert_gemm_workspace(int64_t N, int64_t E, int64_t in) {
  if (N < 0 || E < 1 || in < 0) return -1;
  return xs_offset(N, E) + N * in * 2;
}

KBIT_API int kbit_expert_gemm(const void* x, int x_dtype, int64_t N, const int64_t* ids, int64_t E,
                              const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                              const float* codebook, int k, int64_t out, int64_t in, void* y, void* workspace,
                              int64_t workspace_bytes, void* stream) {
  if (N == 0 || out == 0) return 0;
  if (N < 0 || E < 1 || E > EXPERT_GROUPED_MAX_E || N > 0x7FFFFFFF || out < 1 || out > 0x7FFFFFFF || in < 64 ||
      in % 64 != 0 || in > (1 << 24) || ids == nullptr || workspace == nullptr ||
      workspace_bytes < kbit_expert_gemm_workspace(N, E, in))
    return (int)cudaErrorInvalidValue;
  const uintptr_t align = k == 4 ? 15 : k == 2 ? 7 : 3;
  if ((reinterpret_cast<uintptr_t>(packed) & align) != 0 || (reinterpret_cast<uintptr_t>(absmax) & 1) != 0 ||
      (reinterpret_cast<uintptr_t>(x) & 15) != 0 || (reinterpret_cast<uintptr_t>(workspace) & 255) != 0)
    return (int)cudaErrorMisalignedAddress;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (x_dtype == BF16)
    return launch_k<__nv_bfloat16>(k, x, N, ids, E, packed, absmax, absmax_fp16, scale, codebook, out, in, y,
                                   workspace, st);
  if (x_dtype == F16)
    return launch_k<__half>(k, x, N, ids, E, packed, absmax, absmax_fp16, scale, codebook, out, in, y, workspace, st);
  return (int)cudaErrorInvalidValue;
}

}  // extern "C"
