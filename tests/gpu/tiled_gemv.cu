// tiled_gemv.cu: an experiment, not part of libkbit_cuda.so (built by tests/gpu/run_tiled.sh into its own library,
// driven by tests/gpu/bench_tiled.py). The fifth session's fastest large-layer GEMV, rebuilt on main so that its code
// survives: K = 4, M = 1..8 bf16 activations, e4m4 block scales, sm_90, over a repacked weight layout.
//
// Layout ("tiled nibbles"; out % 16 == 0, in % 256 == 0; T = out / 16 tiles, C = in / 128 chunks per row):
// - weights, 1 KB per (tile t, chunk c): byte ((t * C + c) * 32 + l) * 32 + 8 b + 4 h + j, for lane l = 4 g + q,
//   block b = 0..3 of the chunk, half h = 0..1, j = 0..3, is the pair index idx[e] | idx[e + 1] << 4 of row
//   16 t + g + 8 (j & 1) at element e = 128 c + 32 b + 8 q + 4 h + 2 (j >> 1). These are exactly lane l's A
//   fragment of m16n8k16 for the k slice (b, h), k slots 2q + 8 (j >> 1) + {0, 1} <-> those two elements, so a lane
//   reads its 32 bytes per chunk with two 16-byte shared loads. The activations of that k slice are then the 8
//   consecutive elements 128 c + 32 b + 8 q + 4 h .. + 3 twice over h: one 16-byte load per block and lane.
// - block scales (e4m4), 64 bytes per (t, c): byte ((t * C + c) * 16 + r) * 4 + b = block 4 c + b of row 16 t + r.
// Every k slice of one MMA lies inside one block of each row, so the block scale is applied in fp32 to the MMA's
// partial sums (4 FFMA per block and lane), not to the weights.
//
// Kernel: one persistent CTA of NW warps per SM owns whole tiles (an even split of the tiles over the grid); its
// items (2 chunks = 2 KB of weights + 128 B of scales, contiguous in the layout) are split into NW contiguous ranges,
// one per warp, so a warp streams one contiguous byte range. Each warp has a ring of S slots filled by bulk async
// copies (cp.async.bulk, one mbarrier per slot, lane 0 issues). The pair table (256 entries of two bf16 codebook
// values, 32 replicas) lies at the shared-window address 0x10000 + 256 * index + 4 * lane, so one PRMT of the index
// byte with (4 * lane | 0x0100) is the whole shared address of a lookup (conflict-free). Tiles fully inside a warp's
// range are stored by that warp; the first / last tile of each range goes through shared memory and is summed in
// warp order (deterministic, no atomics).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

// fixed shared-window addresses (the dynamic shared memory starts at or below BARS: checked in-kernel)
constexpr uint32_t BARS = 0x1000;    // NW * S mbarriers
constexpr uint32_t LOW = 0x1400;     // the first ring slots, below the table
constexpr uint32_t TABLE = 0x10000;  // the pair table (256 rows of 256 bytes, 128 used); after the main loop, the
                                     // boundary partials [NW][2][NT][32 lanes][4] floats
constexpr uint32_t RING = 0x20000;   // the other ring slots
constexpr uint32_t ITEM_W = 2048, ITEM_A = 128, SLOT = ITEM_W + ITEM_A;
constexpr uint32_t NLOW = (TABLE - LOW) / SLOT;
// window address of ring slot i (warp * S + s)
__host__ __device__ constexpr uint32_t slot_addr(uint32_t i) { return i < NLOW ? LOW + i * SLOT : RING + (i - NLOW) * SLOT; }
__host__ __device__ constexpr uint32_t smem_end(uint32_t nslots) { return nslots <= NLOW ? RING : slot_addr(nslots); }

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
}
__device__ __forceinline__ uint32_t lds_at(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ uint4 lds128_at(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ void mma(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#endif
}
__device__ __forceinline__ float e4m4(uint32_t code) { return __uint_as_float(code << 19) * 0x1p116f; }

// one tile's 16 x 8 fragment of token tile nt (this lane's 4 values) times the tensor scale into y (out % 16 == 0)
__device__ __forceinline__ void store_tile(__nv_bfloat16* y, int64_t out, int M, int64_t t, int nt, int lane,
                                           float sc, const float (&v)[4]) {
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = 8 * nt + 2 * q + (i & 1);
    if (m < M) y[(int64_t)m * out + 16 * t + g + 8 * (i >> 1)] = __float2bfloat16_rn(v[i] * sc);
  }
}

// NT tiles of 8 tokens (M <= 8 NT): the A operand of a k slice is looked up once and feeds NT MMAs. NT = 1 loads the
// item's activations before waiting for its weights; NT > 1 loads each block's at use (fewer registers).
template <int NW, int S, int NT>
__global__ void __launch_bounds__(NW * 32, 1) tiled_gemv_kernel(const __nv_bfloat16* __restrict__ x, int M,
                                                                 const uint8_t* __restrict__ wt,
                                                                 const uint8_t* __restrict__ at,
                                                                 const float* __restrict__ scale,
                                                                 const float* __restrict__ codebook, int64_t out,
                                                                 int in, __nv_bfloat16* __restrict__ y) {
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  unsigned char* win = smem - base;  // win + window address = generic pointer
  static_assert(BARS + NW * S * 8 <= LOW && NW * 2 * NT * 512 <= RING - TABLE, "shared-memory map");
  uint32_t dsz;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dsz));
  if (base > BARS || base + dsz < smem_end(NW * S)) __trap();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int64_t T = out / 16;
  const int IPT = in / 256;  // items per tile
  const int64_t t0 = T * blockIdx.x / gridDim.x, t1 = T * (blockIdx.x + 1) / gridDim.x;
  const int64_t n = (t1 - t0) * IPT;  // the CTA's items
  const int64_t u0 = n * warp / NW, u1 = n * (warp + 1) / NW;
  const uint8_t* wsrc = wt + (t0 * IPT) * ITEM_W;
  const uint8_t* asrc = at + (t0 * IPT) * ITEM_A;
  const uint32_t wbar = BARS + warp * S * 8;
  if (lane == 0) {
    for (int s = 0; s < S; ++s) mbar_init(wbar + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int s = 0; s < S && u0 + s < u1; ++s) {
      mbar_expect_tx(wbar + 8 * s, SLOT);
      bulk_copy(slot_addr(warp * S + s), wsrc + (u0 + s) * ITEM_W, ITEM_W, wbar + 8 * s);
      bulk_copy(slot_addr(warp * S + s) + ITEM_W, asrc + (u0 + s) * ITEM_A, ITEM_A, wbar + 8 * s);
    }
  }
  // pair table: entry P = (cb[P & 15], cb[P >> 4]) in bf16, 32 replicas of 4 bytes: 8 16-byte stores per entry
  for (int i = threadIdx.x; i < 256 * 8; i += NW * 32) {
    const int P = i >> 3;
    __nv_bfloat162 v = __floats2bfloat162_rn(__ldg(codebook + (P & 15)), __ldg(codebook + (P >> 4)));
    const uint32_t w = *reinterpret_cast<uint32_t*>(&v);
    *reinterpret_cast<uint4*>(win + TABLE + 256 * P + 16 * (i & 7)) = make_uint4(w, w, w, w);
  }
  __syncthreads();
  const float sc = scale[0];
  const uint32_t cl = 0x0100u | ((uint32_t)lane << 2);
  // token 8 nt + g of this lane's B column (rows past M: zeros)
  const __nv_bfloat16* xg[NT];
  bool xon[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    xon[nt] = 8 * nt + g < M;
    xg[nt] = x + (int64_t)(xon[nt] ? 8 * nt + g : 0) * in + 8 * q;
  }
  // tile boundaries of this warp's range: the first tile's partial stays in accf until every warp is done
  const int64_t tf = u0 < u1 ? u0 / IPT : -1, tl = u0 < u1 ? (u1 - 1) / IPT : -1;
  float acc[NT][4], accf[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = accf[nt][i] = 0.f;
  int64_t cur = tf;
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t t = u / IPT;
    const int v = (int)(u - t * IPT);
    if (t != cur) {  // the previous tile is done: keep the first one, store a middle one
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (cur == tf) {
#pragma unroll
          for (int i = 0; i < 4; ++i) accf[nt][i] = acc[nt][i];
        } else {
          store_tile(y, out, M, t0 + cur, nt, lane, sc, acc[nt]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
      }
      cur = t;
    }
    // NT = 1: activations of the item's 8 blocks (elements 256 v + 32 kb + 8 q .. + 7), before the wait
    uint4 xv1[NT == 1 ? 8 : 1];
    if constexpr (NT == 1) {
#pragma unroll
      for (int kb = 0; kb < 8; ++kb) {
        xv1[kb] = make_uint4(0u, 0u, 0u, 0u);
        if (xon[0]) xv1[kb] = __ldg(reinterpret_cast<const uint4*>(xg[0] + 256 * v + 32 * kb));
      }
    }
    const uint32_t k = (uint32_t)(u - u0), s = k % S;
    mbar_wait(wbar + 8 * s, (k / S) & 1u);
    const uint32_t sl = slot_addr(warp * S + s);
    uint4 wv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) wv[i] = lds128_at(sl + (i >> 1) * 1024 + lane * 32 + (i & 1) * 16);
    const uint32_t a0 = lds_at(sl + ITEM_W + g * 4), a1 = lds_at(sl + ITEM_W + (g + 8) * 4);
    const uint32_t a2 = lds_at(sl + ITEM_W + 64 + g * 4), a3 = lds_at(sl + ITEM_W + 64 + (g + 8) * 4);
    // every lane has read the slot: refill it (generic-proxy reads before the async-proxy write)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0 && u + S < u1) {
      mbar_expect_tx(wbar + 8 * s, SLOT);
      bulk_copy(sl, wsrc + (u + S) * ITEM_W, ITEM_W, wbar + 8 * s);
      bulk_copy(sl + ITEM_W, asrc + (u + S) * ITEM_A, ITEM_A, wbar + 8 * s);
    }
    const uint32_t w[16] = {wv[0].x, wv[0].y, wv[0].z, wv[0].w, wv[1].x, wv[1].y, wv[1].z, wv[1].w,
                            wv[2].x, wv[2].y, wv[2].z, wv[2].w, wv[3].x, wv[3].y, wv[3].z, wv[3].w};
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {  // block kb of the item: chunk kb / 4, block kb % 4
      const uint32_t sg = kb < 4 ? a0 : a2, sh = kb < 4 ? a1 : a3;
      const int bb = kb & 3;
      uint32_t A[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 4; ++j) A[h][j] = lds_at(prmt(w[2 * kb + h], cl, 0x6504u | (uint32_t)j << 4));
      const float s0 = e4m4((sg >> (8 * bb)) & 0xFFu), s1 = e4m4((sh >> (8 * bb)) & 0xFFu);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint4 xv;
        if constexpr (NT == 1) {
          xv = xv1[kb];
        } else {
          xv = make_uint4(0u, 0u, 0u, 0u);
          if (xon[nt]) xv = __ldg(reinterpret_cast<const uint4*>(xg[nt] + 256 * v + 32 * kb));
        }
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        mma(d, A[0][0], A[0][1], A[0][2], A[0][3], xv.x, xv.y);
        mma(d, A[1][0], A[1][1], A[1][2], A[1][3], xv.z, xv.w);
        acc[nt][0] = fmaf(s0, d[0], acc[nt][0]);
        acc[nt][1] = fmaf(s0, d[1], acc[nt][1]);
        acc[nt][2] = fmaf(s1, d[2], acc[nt][2]);
        acc[nt][3] = fmaf(s1, d[3], acc[nt][3]);
      }
    }
  }
  // the last tile: the first one too when the range has one tile, else straight out unless it is shared
  if (u0 < u1 && cur == tf) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) accf[nt][i] = acc[nt][i];
  }
  __syncthreads();  // every lookup is done: the table's space takes the boundary partials
  const uint32_t red = TABLE;
  auto red_at = [&](int w2, int side, int nt, int i) {
    return reinterpret_cast<float*>(win + red + ((((w2 * 2 + side) * NT + nt) * 32 + lane) * 4 + i) * 4);
  };
  if (u0 < u1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        *red_at(warp, 0, nt, i) = accf[nt][i];
        *red_at(warp, 1, nt, i) = acc[nt][i];
      }
  }
  __syncthreads();
  // boundary tiles: warp w sums the tiles it is the first warp to touch (its first tile unless warp w - 1 touched it,
  // and its last tile when that differs from its first), over the warps touching them, in warp order; a later warp
  // can only touch such a tile as its first tile
  if (u0 >= u1) return;
  for (int side = 0; side < 2; ++side) {
    const int64_t t = side ? tl : tf;
    if (side == 1 && tl == tf) break;
    if (side == 0) {  // does an earlier warp touch tf? (ranges are contiguous and ordered)
      bool earlier = false;
      for (int w2 = warp - 1; w2 >= 0; --w2) {
        const int64_t b0 = n * w2 / NW, b1 = n * (w2 + 1) / NW;
        if (b0 < b1) {
          earlier = (b1 - 1) / IPT == t;
          break;
        }
      }
      if (earlier) continue;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float vv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) vv[i] = *red_at(warp, side, nt, i);
      for (int w2 = warp + 1; w2 < NW; ++w2) {
        const int64_t b0 = n * w2 / NW, b1 = n * (w2 + 1) / NW;
        if (b0 >= b1) continue;
        if (b0 / IPT != t) break;  // w2's first tile is past t: no later warp touches t
#pragma unroll
        for (int i = 0; i < 4; ++i) vv[i] += *red_at(w2, 0, nt, i);
      }
      store_tile(y, out, M, t0 + t, nt, lane, sc, vv);
    }
  }
}

// bit planes [out][nb * 4] + e4m4 absmax [out][nb] -> the tiled layout above; one thread per 4-byte word of weights
__global__ void repack_kernel(const uint32_t* __restrict__ packed, const uint8_t* __restrict__ absmax, int64_t out,
                              int in, uint32_t* __restrict__ wt, uint8_t* __restrict__ at) {
  const int C = in / 128, nb = in / 32;
  const int64_t nwords = out * (int64_t)in / 8;  // 2 weights per byte, 4 bytes per word
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nwords; i += (int64_t)gridDim.x * blockDim.x) {
    // word i = ((t * C + c) * 32 + l) * 8 + 2 b + h
    const int h = (int)(i & 1), b = (int)((i >> 1) & 3), l = (int)((i >> 3) & 31);
    const int64_t tc = i >> 8;
    const int c = (int)(tc % C);
    const int64_t t = tc / C;
    const int g = l >> 2, q = l & 3;
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t r = 16 * t + g + 8 * (j & 1);
      const int blk = 4 * c + b, e = 8 * q + 4 * h + 2 * (j >> 1);  // element inside the block
      const uint32_t* p = packed + (r * nb + blk) * 4;
      uint32_t i0 = 0, i1 = 0;
#pragma unroll
      for (int pl = 0; pl < 4; ++pl) {
        i0 |= ((p[pl] >> e) & 1u) << pl;
        i1 |= ((p[pl] >> (e + 1)) & 1u) << pl;
      }
      word |= (i0 | (i1 << 4)) << (8 * j);
    }
    wt[i] = word;
    if (l == 0 && h == 0) {  // scales of (t, c): 16 rows x 4 blocks, one thread per (t, c, b)
      for (int r = 0; r < 16; ++r) at[(tc * 16 + r) * 4 + b] = absmax[(16 * t + r) * nb + 4 * c + b];
    }
  }
}

}  // namespace

extern "C" {

int tiled_repack(const void* packed, const void* absmax, int64_t out, int64_t in, void* wt, void* at, void* stream) {
  if (out % 16 || in % 256) return (int)cudaErrorInvalidValue;
  repack_kernel<<<1024, 256, 0, (cudaStream_t)stream>>>((const uint32_t*)packed, (const uint8_t*)absmax, out, (int)in,
                                                        (uint32_t*)wt, (uint8_t*)at);
  return (int)cudaGetLastError();
}

// nw / stages pick the instantiation (NT = ceil(M / 8)); grid = 0: one CTA per SM
int tiled_gemv(const void* x, int M, const void* wt, const void* at, const float* scale, const float* codebook,
               int64_t out, int64_t in, void* y, int nw, int stages, int grid, void* stream) {
  if (out % 16 || in % 256 || M < 1 || M > 64) return (int)cudaErrorInvalidValue;
  int dev = 0, sms = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  const unsigned gr = (unsigned)(grid > 0 ? grid : sms);
  const int NT = M <= 8 ? 1 : M <= 16 ? 2 : M <= 32 ? 4 : 8;
  auto go = [&](auto kern, int NW, int S) -> int {
    const int dyn = (int)smem_end(NW * S);  // covers the window up to the last slot's end (checked in-kernel)
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
    if (e != cudaSuccess) return (int)e;
    kern<<<gr, NW * 32, dyn, (cudaStream_t)stream>>>((const __nv_bfloat16*)x, M, (const uint8_t*)wt,
                                                     (const uint8_t*)at, scale, codebook, out, (int)in,
                                                     (__nv_bfloat16*)y);
    return (int)cudaGetLastError();
  };
#define TG(NW, S, NT_) \
  if (nw == NW && stages == S && NT == NT_) return go(tiled_gemv_kernel<NW, S, NT_>, NW, S);
  TG(8, 2, 1) TG(12, 2, 1) TG(16, 1, 1) TG(16, 2, 1) TG(20, 1, 1) TG(24, 1, 1)
  TG(8, 1, 2) TG(8, 2, 2) TG(16, 1, 2) TG(16, 2, 2)
  TG(8, 1, 4) TG(8, 2, 4) TG(16, 1, 4)
  TG(4, 2, 8) TG(8, 1, 8) TG(8, 2, 8)
#undef TG
  return (int)cudaErrorInvalidValue;
}

}  // extern "C"
