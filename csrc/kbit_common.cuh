// kbit_common.cuh: device helpers shared by every kbit kernel (the bit-plane format: docs/format.md).
//
// Everything here is __host__ __device__ where possible so that the bit tricks can be unit-tested on the CPU (the
// host tests in tests/host compile them into a host program).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace kbit {

constexpr int BLOCK = 32;

// ---- launch helpers (host) ----
// The current device and its SM count, cached per device (the launchers size their grids by it). false: CUDA could
// not say (dev, sms unchanged).
inline bool current_device_sms(int& dev, int& sms) {
  static int cache[64] = {};
  int d = 0;
  if (cudaGetDevice(&d) != cudaSuccess || d < 0 || d >= 64) return false;
  if (cache[d] == 0 && cudaDeviceGetAttribute(&cache[d], cudaDevAttrMultiProcessorCount, d) != cudaSuccess) {
    cache[d] = 0;
    return false;
  }
  dev = d;
  sms = cache[d];
  return true;
}

// A grid-stride grid for `threads_needed` threads in blocks of `threads`: at most blocks_per_sm blocks per SM.
inline int grid_for_threads(int64_t threads_needed, int threads = 256, int blocks_per_sm = 16) {
  int dev = 0, sms = 132;
  current_device_sms(dev, sms);
  int64_t blocks = (threads_needed + threads - 1) / threads;
  const int64_t cap = (int64_t)sms * blocks_per_sm;  // enough resident blocks, grid-stride beyond that
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;
  return (int)blocks;
}

// ---- grouped experts: rows sorted by expert (kbit_gemv.cu) ----
// Counting sort of N rows by expert id on the device (one CTA, no host sync): order [N] lists the rows bucket by
// bucket, offsets [E + 2] the buckets' starts (bucket E: ids outside [0, E)), offsets[E + 1] = N. E <= 8192.
void expert_route(const int64_t* ids, int64_t N, int64_t E, int* order, int* offsets, cudaStream_t st);

// One warp: work item w -> (bucket, first sorted row, rows) in item[0..2], for the expert GEMV's grouped mode and the
// expert GEMM. Each bucket's rows are cut into chunks of at most mt, numbered bucket by bucket; item[2] = 0 past the
// last one.
__device__ __forceinline__ void find_item(const int* __restrict__ offsets, int buckets, int mt, int w, int lane,
                                          int* item) {
  int base = 0;
  for (int b0 = 0; b0 < buckets; b0 += 32) {
    const int b = b0 + lane;
    int off = 0, n = 0;
    if (b < buckets) {
      off = offsets[b];
      n = offsets[b + 1] - off;
    }
    const int c = (n + mt - 1) / mt;
    int s = c;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int t = __shfl_up_sync(0xFFFFFFFFu, s, d);
      if (lane >= d) s += t;
    }
    const int first = base + s - c;
    const unsigned hit = __ballot_sync(0xFFFFFFFFu, c > 0 && w >= first && w < first + c);
    if (hit) {
      if (lane == __ffs(hit) - 1) {
        const int ch = w - first;
        item[0] = b;
        item[1] = off + ch * mt;
        item[2] = min(mt, n - ch * mt);
      }
      return;
    }
    base += __shfl_sync(0xFFFFFFFFu, s, 31);
  }
  if (lane == 0) item[2] = 0;
}

// ---- dtypes shared with the C ABI ----
enum DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// ---- E4M4 (4 exponent bits, bias 11, 4 mantissa bits, subnormals, unsigned) ----
// decode: e == 0 -> m/16 * 2^-10 ; else (1 + m/16) * 2^(e-11). Pure bit arithmetic, exact.
__host__ __device__ __forceinline__ float e4m4_decode(uint32_t code) {
  uint32_t e = code >> 4, m = code & 15u;
  if (e == 0) return (float)m * (1.0f / 16384.0f);  // m * 2^-14, exact
  uint32_t bits = ((e + 116u) << 23) | (m << 19);  // 116 = 127 - 11
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// the same value in three instructions (the GEMVs' hot loops): the code's bits placed as a float's exponent and
// mantissa make 2^-116 times the value for every code, subnormal codes included
__device__ __forceinline__ float e4m4_decode_fast(uint32_t code) { return __uint_as_float(code << 19) * 0x1p116f; }

// encode: round a float in [0, 31] to the nearest code, an exact tie to the even code (== format.e4m4_encode).
__host__ __device__ __forceinline__ uint32_t e4m4_encode(float a) {
  if (a < (1.0f / 1024.0f)) {
    // subnormal range: code = m = rint(a * 2^14) (exact scaling, rint = ties to even); 16 is 2^-10, the first normal.
    float t = a * 16384.0f;
#ifdef __CUDA_ARCH__
    return (uint32_t)__float2int_rn(t);
#else
    return (uint32_t)nearbyintf(t);  // default rounding mode: to nearest even
#endif
  }
  uint32_t bits;
  memcpy(&bits, &a, 4);
  uint32_t ee = (bits >> 23) - 116u;  // biased E4M4 exponent (>= 1 here)
  uint32_t code = (ee << 4) | ((bits >> 19) & 15u);
  uint32_t rem = bits & 0x7FFFFu;
  if (rem > 0x40000u || (rem == 0x40000u && (code & 1u))) code += 1;  // carry into the exponent is right
  return code;
}

// ---- bit-plane transpose ----
// Input: the k words of one block (word j = bit j of the 32 indices) and s in 0..3. Output: a 32-bit word whose
// nibble e (bits 4e..4e+3) is the index of element 8*s + e, for k <= 4 (planes >= k are passed as 0).
// Cost: 3 PRMT + 3 delta swaps (12 ALU ops) for 8 elements.
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, sel);
#else
  uint64_t v = ((uint64_t)b << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((v >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
#endif
}

__host__ __device__ __forceinline__ uint32_t delta_swap(uint32_t x, int delta, uint32_t mask) {
  uint32_t t = ((x >> delta) ^ x) & mask;
  return x ^ t ^ (t << delta);
}

// sel = s | ((s + 4) << 4), precomputed per thread.
__host__ __device__ __forceinline__ uint32_t planes_to_nibbles(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3,
                                                               uint32_t sel) {
  // r = [byte s of w0, byte s of w2, byte s of w1, byte s of w3]: bit position p = 8*i + e with the byte index
  // i = (j0 << 1) | j1 of plane j; three index-bit swaps (4<->2, 3<->1, 2<->0) move bit (j, e) to 4*e + j.
  uint32_t lo = byte_perm(w0, w2, sel);
  uint32_t hi = byte_perm(w1, w3, sel);
  uint32_t r = byte_perm(lo, hi, 0x5410);
  r = delta_swap(r, 12, 0x0000F0F0u);
  r = delta_swap(r, 6, 0x00CC00CCu);
  r = delta_swap(r, 3, 0x0A0A0A0Au);
  return r;
}

// ---- element conversions ----
template <typename T> struct Cvt;
template <> struct Cvt<float> {
  __device__ static __forceinline__ float to_f(float v) { return v; }
  __device__ static __forceinline__ float from_f(float v) { return v; }
};
template <> struct Cvt<__half> {
  __device__ static __forceinline__ float to_f(__half v) { return __half2float(v); }
  __device__ static __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
};
template <> struct Cvt<__nv_bfloat16> {
  __device__ static __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
};

// two packed 16-bit values -> two floats
template <typename T> __device__ __forceinline__ void unpack2(uint32_t u, float& lo, float& hi);
template <> __device__ __forceinline__ void unpack2<__nv_bfloat16>(uint32_t u, float& lo, float& hi) {
  lo = __uint_as_float(u << 16);
  hi = __uint_as_float(u & 0xFFFF0000u);
}
template <> __device__ __forceinline__ void unpack2<__half>(uint32_t u, float& lo, float& hi) {
  __half2 h = *reinterpret_cast<__half2*>(&u);
  float2 f = __half22float2(h);
  lo = f.x;
  hi = f.y;
}

// block scale (stored E4M4 byte or fp16) -> float
__device__ __forceinline__ float load_absmax(const void* absmax, size_t i, int absmax_fp16) {
  if (absmax_fp16) return __half2float(reinterpret_cast<const __half*>(absmax)[i]);
  return e4m4_decode(reinterpret_cast<const uint8_t*>(absmax)[i]);
}

// named barrier of n threads (ids 1..15; 0 is __syncthreads). bar.sync is the aligned form: every warp of the n
// threads must reach it at the same instruction.
__device__ __forceinline__ void bar_group(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// Index (0..2^k-1) of element 8*s+e, given nib = planes_to_nibbles(...) and for k == 5 q4 = word4 >> 8s.
// Only the low 5 bits of the result matter when it is used as a __shfl_sync source lane with the codebook
// replicated across the 32 lanes (lane l holds codebook[l % 2^k]), so for k <= 4 no mask is needed.
template <int K, int E>
__device__ __forceinline__ uint32_t elem_lane(uint32_t nib, uint32_t q4) {
  if constexpr (K == 5) {
    return ((nib >> (4 * E)) & 15u) | (((q4 >> E) & 1u) << 4);
  } else {
    return nib >> (4 * E);
  }
}

// ---- tensor-core MMA m16n8k16 (fp32 accumulate) per activation dtype, and the GEMVs' weight-side helpers ----
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

// The K bit planes of a 32-element block folded into pair indices, for pair offset s = 0..3: K <= 4: fold[0], whose
// byte B is the 2K-bit index of the element pair (8 B + 2 s, 8 B + 2 s + 1) (bits 2 j, 2 j + 1 = plane j of the two
// elements); K = 5: fold[0] / fold[1] hold those of bytes 0, 2 / 1, 3 in 16-bit fields. w: at least K words.
template <int K, int N>
__host__ __device__ __forceinline__ void fold_planes(const uint32_t (&w)[N], int s, uint32_t (&fold)[2]) {
  static_assert(N >= K, "plane words");
  uint32_t t = 0, to = 0;
  constexpr uint32_t M = K <= 4 ? 0x03030303u : 0x00030003u;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    const uint32_t v = (2 * s - 2 * j >= 0) ? (w[j] >> (2 * s - 2 * j)) : (w[j] << (2 * j - 2 * s));
    t |= v & (M << (2 * j));
    if constexpr (K == 5) to |= (w[j] >> (8 + 2 * s - 2 * j)) & (M << (2 * j));
  }
  fold[0] = t;
  fold[1] = to;
}

// fold_planes for s = 0..3 of one block: f[s] (K <= 4) has in byte B the 2K-bit index of the pair (8 B + 2 s,
// 8 B + 2 s + 1); K = 5: f[s] / f[4 + s] hold those of bytes 0, 2 / 1, 3 in 16-bit fields
template <int K>
__host__ __device__ __forceinline__ void fold_block(const uint32_t (&w)[K], uint32_t (&f)[K == 5 ? 8 : 4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t fold[2];
    fold_planes<K>(w, s, fold);
    f[s] = fold[0];
    if constexpr (K == 5) f[4 + s] = fold[1];
  }
}

// The k bits of a call become the template argument K: f(std::integral_constant<int, K>) for k = 2..5, or
// cudaErrorInvalidValue.
template <typename F>
int with_k(int k, F&& f) {
  if (k == 4) return f(std::integral_constant<int, 4>{});
  if (k == 2) return f(std::integral_constant<int, 2>{});
  if (k == 5) return f(std::integral_constant<int, 5>{});
  if (k == 3) return f(std::integral_constant<int, 3>{});
  return (int)cudaErrorInvalidValue;
}

// The bit-plane pair tables' entry p: (cb[i0], cb[i1]) * PRE in T, i0 / i1 = the even / odd bits of p (the index of an
// element pair as the planes fold into it: bits 2 j, 2 j + 1 = plane j of the two elements)
template <typename T, int K>
__device__ __forceinline__ uint32_t pair_entry(const float* __restrict__ cb, int p) {
  uint32_t i0 = 0, i1 = 0;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    i0 |= ((p >> (2 * j)) & 1u) << j;
    i1 |= ((p >> (2 * j + 1)) & 1u) << j;
  }
  return Mma<T>::pack(__ldg(cb + i0) * Mma<T>::PRE, __ldg(cb + i1) * Mma<T>::PRE);
}

// block scale code -> d * PRE as a packed pair in the activation dtype
template <typename T>
__device__ __forceinline__ uint32_t scale_pair(uint32_t sc, int fp16) {
  float d;
  if (fp16) d = __half2float(__ushort_as_half((unsigned short)sc));
  else d = e4m4_decode_fast(sc);
  d *= Mma<T>::PRE;
  return Mma<T>::pack(d, d);
}

// PRMT (byte permute). Selector nibbles must have bit 3 clear (PRMT's sign-replicate mode); only bits 0..15 count.
__host__ __device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
#ifdef __CUDA_ARCH__
  // inline PTX, not __byte_perm: the intrinsic is defined on 3-bit selector nibbles, so the compiler masks every
  // non-constant selector with 0x7777 first (one LOP3 per lookup)
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
  return r;
#else
  const uint64_t v = ((uint64_t)b << 32) | a;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= (uint32_t)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  return r;
#endif
}

// Programmatic dependent launch (kbit_tiled.cu's launch_config): the tiled GEMVs and the tiled GEMM's three kernels
// are launched so that they may start while the kernel before them on the stream drains. Before pdl_wait a kernel
// reads no memory, since that kernel may be writing any of it (even the weights, as the tile kernel does): it sets up
// shared memory and asks bytes into L2 (a prefetch cannot return stale data). pdl_launch_dependents lets the next
// kernel be scheduled: its CTAs take an SM as this kernel's CTA there exits (a GEMV or GEMM CTA fills the SM), so its
// start overlaps this kernel's tail. Without the launch attribute both are no-ops.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---- k-split GEMMs (kbit_tiled.cu, kbit_gemm.cu) ----
// y = (the sum of the splits' fp32 partial sums ws [splits, n], in split order) x the tensor scale (+ bias), n = M x out
template <typename T>
__global__ void gemm_reduce_kernel(const float* __restrict__ ws, int splits, int64_t n, int64_t out,
                                   const float* __restrict__ scale, const T* __restrict__ bias, T* __restrict__ y) {
  pdl_wait();  // a no-op unless launched with programmatic stream serialization (the tiled GEMM's)
  const float sc = __ldg(scale);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float s = 0.f;
    for (int p = 0; p < splits; ++p) s += ws[p * n + i];
    float r = s * sc;
    if (bias != nullptr) r += Cvt<T>::to_f(bias[i % out]);
    y[i] = Cvt<T>::from_f(r);
  }
}

// ---- cp.async (sm_80+) ----
// 16 bytes; src_bytes < 16 (0 included) copies that many and zero-fills the rest
// (the "memory" clobbers keep the compiler from moving plain shared-memory accesses across the copies and the wait)
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, uint32_t src_bytes = 16) {
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
// 8 bytes; src_bytes 0 or 4 zero-fill the rest
__device__ __forceinline__ void cp_async8(void* smem, const void* gmem, uint32_t src_bytes = 8) {
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
// 4 bytes; src_bytes 0 zero-fills
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, uint32_t src_bytes = 4) {
  const uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

}  // namespace kbit
