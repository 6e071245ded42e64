// floor_kernels.cu: reference kernels that only move bytes, to measure what the GPU allows for the shapes the kbit
// kernels are judged on (tools/bench_floor.py). Plain C ABI, no torch: built with nvcc into a small .so.
//   floor_empty   an empty kernel: the cost of one graph node.
//   floor_read    grid-stride, each thread 4 independent 16-byte loads per iteration, XOR-reduced; the result is
//                 stored only if it equals a value it cannot equal, so the loads are not dead.
//   floor_write   grid-stride 16-byte stores.
//   floor_expand  the dequantize access pattern: output 16-byte chunk j = a function of input chunk j / R, so R
//                 neighbouring threads read the same 16 bytes (one line per warp) and the write stream is R times
//                 the read stream (R = 4: K = 4 to bf16, R = 8: K = 2).
//   floor_tileread the GEMV's load pattern without its decode: a CTA per tile of a K = 4 packed matrix, W warps
//                 splitting the input dimension in steps, `depth` steps in flight per warp (a register ring), their
//                 scale bytes too; dynamic shared memory caps the resident CTAs per SM as the GEMV's registers do.
//                 rows = 16: the M <= 8 kernel's pattern (lane 4g + q: blocks q, q + 4 of rows g, g + 8, steps of 8
//                 blocks); rows = 8: blocks q, q + 4, q + 8, q + 12 of row g (the same bytes per lane, twice the run
//                 per row, steps of 16 blocks).
//   floor_itemread the tiled range GEMV's stream of items without its decode (sm_90): one persistent CTA of W warps
//                 per SM, the items (iw bytes of weights and 128 of scales, in two arrays as in the tiled layout) split
//                 evenly over the CTAs and into W contiguous ranges per CTA. mode 0: each warp streams its range
//                 through S shared-memory slots filled by cp.async.bulk (two copies per item, one mbarrier per slot,
//                 lane 0 issues), every lane reading the slot as the GEMV does (its 8 K bytes per chunk by 16-byte
//                 loads at lane * 8 K, 4 scale words) and refilling it at once; mode 1: the same with no reads of the
//                 slot (the bulk copies alone); mode 2: no shared memory, each lane loads 16-byte words straight into
//                 registers (lane * 16 + 512 j: whole lines per instruction) and its scale word, S items ahead.
//                 mode + 4: the CTA's items dealt to its warps in turn (warp w: c0 + w, c0 + w + W, ...) instead of in
//                 W contiguous ranges, so that the items in flight at a time are neighbours in memory.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace {
#include "../csrc/kbit_sm90.cuh"  // mbarriers, bulk copies, shared loads
__global__ void empty_kernel() {}

__global__ void __launch_bounds__(256) read_kernel(const uint4* __restrict__ p, int64_t n, unsigned* sink) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  unsigned acc = 0;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    uint4 a = __ldcs(p + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u && threadIdx.x == 1023) *sink = acc;  // never true: blockDim.x <= 256
}

__global__ void __launch_bounds__(256) write_kernel(uint4* __restrict__ p, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    p[i] = make_uint4((unsigned)i, 1u, 2u, 3u);
}

template <int R>
__global__ void __launch_bounds__(256) expand_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
    const uint4 v = __ldg(src + j / R);
    const unsigned s = (unsigned)(j % R);
    dst[j] = make_uint4(v.x + s, v.y ^ s, v.z - s, v.w | s);
  }
}

// (whole steps only: the benchmark's shapes have a multiple of 16 blocks per row; see the file header)
template <int D, int ROWS>
__global__ void __launch_bounds__(256) tileread_kernel(const uint32_t* __restrict__ packed,
                                                       const uint8_t* __restrict__ absmax, int64_t out, int nb,
                                                       unsigned* sink) {
  // ROWS = 16: lane 4g + q reads blocks q, q + 4 of rows g, g + 8 (128 bytes per row per step);
  // ROWS = 8: blocks q, q + 4, q + 8, q + 12 of row g (256 bytes per row per step, steps of 16 blocks)
  constexpr int SB = ROWS == 16 ? 8 : 16;  // blocks per step
  const int W = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int64_t o0 = (int64_t)blockIdx.x * ROWS;
  const int64_t r0 = o0 + g < out ? o0 + g : out - 1;
  const int64_t r1 = ROWS == 16 ? (o0 + g + 8 < out ? o0 + g + 8 : out - 1) : r0;
  const uint4* p0 = reinterpret_cast<const uint4*>(packed + r0 * nb * 4) + q;
  const uint4* p1 = reinterpret_cast<const uint4*>(packed + r1 * nb * 4) + q + (ROWS == 16 ? 0 : 8);
  const uint8_t* a0 = absmax + r0 * nb + q;
  const uint8_t* a1 = absmax + r1 * nb + q + (ROWS == 16 ? 0 : 8);
  const int nfs = nb / SB;
  uint4 buf[D][4];
  unsigned sc[D];
  auto load = [&](int i, int st) {
    const int b = st * SB;
    buf[i][0] = __ldcs(p0 + b);
    buf[i][1] = __ldcs(p0 + b + 4);
    buf[i][2] = __ldcs(p1 + b);
    buf[i][3] = __ldcs(p1 + b + 4);
    sc[i] = __ldcs(a0 + b) ^ (__ldcs(a0 + b + 4) << 8) ^ (__ldcs(a1 + b) << 16) ^ (__ldcs(a1 + b + 4) << 24);
  };
#pragma unroll
  for (int i = 0; i < D; ++i)
    if (warp + i * W < nfs) load(i, warp + i * W);
  unsigned acc = 0;
  for (int base = warp; base < nfs; base += D * W) {
#pragma unroll
    for (int i = 0; i < D; ++i) {
      const int st = base + i * W;
      if (st < nfs) {
#pragma unroll
        for (int j = 0; j < 4; ++j) acc ^= buf[i][j].x ^ buf[i][j].y ^ buf[i][j].z ^ buf[i][j].w;
        acc ^= sc[i];
        if (st + D * W < nfs) load(i, st + D * W);
      }
    }
  }
  if (acc == 0x9E3779B9u && threadIdx.x == 1023) *sink = acc;  // never true: blockDim.x <= 256
}

// the slot's weights and scale words, by two bulk copies that complete on the slot's barrier
__device__ __forceinline__ void fl_fetch(uint32_t dst, const uint8_t* w, uint32_t iw, const uint8_t* a, uint32_t bar) {
  mbar_expect_tx(bar, iw + 128);
  bulk_copy(dst, w, iw, bar);
  bulk_copy(dst + iw, a, 128u, bar);
}
__device__ __forceinline__ uint4 fl_lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

// (see the file header) IW: weight bytes per item (512 K); MODE 0 / 1: S slots per warp; MODE 2: S items in registers;
// DEAL: items dealt in turn (mode + 4)
template <int MODE, int S, int IW, bool DEAL>
__global__ void __launch_bounds__(512, 1) itemread_kernel(const uint8_t* __restrict__ w, const uint8_t* __restrict__ a,
                                                          int items, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr uint32_t IB = IW + 128;
  const int NW = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
  const int c0 = (int)((int64_t)items * blockIdx.x / gridDim.x);
  const int n = (int)((int64_t)items * (blockIdx.x + 1) / gridDim.x) - c0;
  // this warp's j-th item is u0 + j * du, j < nj
  const int u0 = DEAL ? c0 + warp : c0 + n * warp / NW, du = DEAL ? NW : 1;
  const int nj = DEAL ? (n > warp ? (n - warp + NW - 1) / NW : 0) : c0 + n * (warp + 1) / NW - u0;
  auto item = [&](int j) { return (int64_t)(u0 + j * du); };
  unsigned acc = 0;
  if constexpr (MODE == 2) {
    constexpr int J = IW / 512;
    uint4 buf[S][J];
    uint32_t sc[S];
    auto load = [&](int i, int u) {
#pragma unroll
      for (int j = 0; j < J; ++j) buf[i][j] = __ldcs(reinterpret_cast<const uint4*>(w + item(u) * IW + 512 * j) + lane);
      sc[i] = __ldcs(reinterpret_cast<const uint32_t*>(a + item(u) * 128) + lane);
    };
#pragma unroll
    for (int i = 0; i < S; ++i)
      if (i < nj) load(i, i);
    for (int base = 0; base < nj; base += S) {
#pragma unroll
      for (int i = 0; i < S; ++i) {
        const int u = base + i;
        if (u < nj) {
#pragma unroll
          for (int j = 0; j < J; ++j) acc ^= buf[i][j].x ^ buf[i][j].y ^ buf[i][j].z ^ buf[i][j].w;
          acc ^= sc[i];
          if (u + S < nj) load(i, u + S);
        }
      }
    }
  } else {
    const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t bars = base + warp * S * 8, slots = base + ((NW * S * 8 + 127) & ~127u) + warp * S * IB;
    if (lane == 0) {
      for (int s = 0; s < S; ++s) mbar_init(bars + 8 * s, 1);
      for (int s = 0; s < S && s < nj; ++s)
        fl_fetch(slots + s * IB, w + item(s) * IW, IW, a + item(s) * 128, bars + 8 * s);
    }
    __syncwarp();
    uint32_t s = 0, phase = 0;
    for (int u = 0; u < nj; ++u) {
      const uint32_t bar = bars + 8 * s, sl = slots + s * IB;
      mbar_wait(bar, phase);
      if constexpr (MODE == 0) {
        constexpr uint32_t LB = IW / 64;  // bytes per lane and chunk
#pragma unroll
        for (int i = 0; i < IW / 512; ++i) {
          const uint4 v = fl_lds128(sl + (i / (IW / 1024)) * (IW / 2) + lane * LB + (i % (IW / 1024)) * 16);
          acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        acc ^= lds_at(sl + IW + g * 4) ^ lds_at(sl + IW + (g + 8) * 4) ^ lds_at(sl + IW + 64 + g * 4) ^
               lds_at(sl + IW + 64 + (g + 8) * 4);
        fence_proxy_async();
      }
      __syncwarp();
      if (lane == 0 && u + S < nj) fl_fetch(sl, w + item(u + S) * IW, IW, a + item(u + S) * 128, bar);
      if (++s == S) {
        s = 0;
        phase ^= 1u;
      }
    }
  }
  if (acc == 0x9E3779B9u && threadIdx.x == 1023) *sink = acc;  // never true: blockDim.x <= 512
}
}  // namespace

extern "C" {
int floor_itemread(const void* w, const void* a, int items, int iw, int mode, int s, int warps, int grid,
                   unsigned* sink, void* stream) {
  cudaStream_t st = (cudaStream_t)stream;
  auto go = [&](auto kern) {
    const int smem = (mode & 3) == 2 ? 0 : ((warps * s * 8 + 127) & ~127) + warps * s * (iw + 128);
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
      return (int)cudaGetLastError();
    kern<<<grid, warps * 32, smem, st>>>((const uint8_t*)w, (const uint8_t*)a, items, sink);
    return (int)cudaGetLastError();
  };
#define FLOOR_ITEMREAD(M, S, IW)                                                            \
  if (mode == M && s == S && iw == IW) return go(itemread_kernel<M, S, IW, false>);         \
  if (mode == M + 4 && s == S && iw == IW) return go(itemread_kernel<M, S, IW, true>);
#define FLOOR_ITEMREAD_S(M, IW) \
  FLOOR_ITEMREAD(M, 1, IW) FLOOR_ITEMREAD(M, 2, IW) FLOOR_ITEMREAD(M, 3, IW) FLOOR_ITEMREAD(M, 4, IW)
  FLOOR_ITEMREAD_S(0, 2048) FLOOR_ITEMREAD_S(1, 2048) FLOOR_ITEMREAD_S(2, 2048)
  FLOOR_ITEMREAD_S(0, 1024) FLOOR_ITEMREAD_S(1, 1024) FLOOR_ITEMREAD_S(2, 1024)
#undef FLOOR_ITEMREAD_S
#undef FLOOR_ITEMREAD
  return (int)cudaErrorInvalidValue;
}
int floor_empty(int grid, void* stream) {
  empty_kernel<<<grid, 128, 0, (cudaStream_t)stream>>>();
  return (int)cudaGetLastError();
}
int floor_read(const void* p, int64_t bytes, unsigned* sink, int grid, void* stream) {
  read_kernel<<<grid, 256, 0, (cudaStream_t)stream>>>((const uint4*)p, bytes / 16, sink);
  return (int)cudaGetLastError();
}
int floor_write(void* p, int64_t bytes, int grid, void* stream) {
  write_kernel<<<grid, 256, 0, (cudaStream_t)stream>>>((uint4*)p, bytes / 16);
  return (int)cudaGetLastError();
}
int floor_tileread(const void* packed, const void* absmax, int64_t out, int64_t in, int warps, int depth, int rows,
                   int smem, unsigned* sink, void* stream) {
  const unsigned grid = (unsigned)((out + rows - 1) / rows);
  const int nb = (int)(in / 32);
  const auto* p = (const uint32_t*)packed;
  const auto* a = (const uint8_t*)absmax;
  cudaStream_t st = (cudaStream_t)stream;
  auto go = [&](auto kern) {
    if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess)
      return (int)cudaGetLastError();
    kern<<<grid, warps * 32, smem, st>>>(p, a, out, nb, sink);
    return (int)cudaGetLastError();
  };
  if (rows == 8) {
    if (depth == 1) return go(tileread_kernel<1, 8>);
    if (depth == 2) return go(tileread_kernel<2, 8>);
    return (int)cudaErrorInvalidValue;
  }
  if (rows != 16) return (int)cudaErrorInvalidValue;
  if (depth == 1) return go(tileread_kernel<1, 16>);
  if (depth == 2) return go(tileread_kernel<2, 16>);
  if (depth == 4) return go(tileread_kernel<4, 16>);
  return (int)cudaErrorInvalidValue;
}
int floor_expand(const void* src, void* dst, int64_t dst_bytes, int r, int grid, void* stream) {
  if (r == 4) expand_kernel<4><<<grid, 256, 0, (cudaStream_t)stream>>>((const uint4*)src, (uint4*)dst, dst_bytes / 16);
  else if (r == 8) expand_kernel<8><<<grid, 256, 0, (cudaStream_t)stream>>>((const uint4*)src, (uint4*)dst, dst_bytes / 16);
  else return (int)cudaErrorInvalidValue;
  return (int)cudaGetLastError();
}
}
