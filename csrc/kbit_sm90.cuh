// kbit_sm90.cuh: the sm_90 instructions the tiled kernels and the grouped expert GEMM share: mbarriers, bulk and
// tensor (TMA) copies, clusters, wgmma (sm_90a), the GEMMs' staged epilogue and the driver's tensor-map encoder
// (programmatic dependent launch: kbit_common.cuh, which the split reduction shares).
// Included inside each translation unit's anonymous namespace, after <cuda.h>, <cuda_runtime.h> and <type_traits>.
#pragma once

// a 32-bit load at a shared-window address
__device__ __forceinline__ uint32_t lds_at(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
// a 16-byte load at a shared-window address
__device__ __forceinline__ uint4 lds128_at(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
// The asynchronous-copy and mbarrier instructions below are sm_90's; for older targets they compile to nothing
// (the kernel traps there, and the launcher refuses those devices).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KBIT_SM90 1
#else
#define KBIT_SM90 0
#endif
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if KBIT_SM90
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if KBIT_SM90
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
#endif
}
// generic-proxy reads of shared memory before a later async-proxy write of it
__device__ __forceinline__ void fence_proxy_async() {
#if KBIT_SM90
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
#if KBIT_SM90
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
#if KBIT_SM90
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if KBIT_SM90
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#endif
}
// Thread block clusters (the batched kernel's k split, KS > 1): this CTA's rank in its cluster; a barrier of every
// thread of the cluster (release / acquire: shared-memory writes before it are seen by the cluster's reads after it);
// four floats of CTA rank's shared memory at the address addr has in this CTA's.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#if KBIT_SM90
  asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
__device__ __forceinline__ void cluster_sync() {
#if KBIT_SM90
  asm volatile("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr, uint32_t rank) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if KBIT_SM90
  uint32_t ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(ra)
               : "memory");
#endif
  return v;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KBIT_WGMMA 1
#else
#define KBIT_WGMMA 0
#endif
// 1 in the image the device runs when it is sm_90a machine code (elsewhere the GEMMs trap: wgmma_gemm_available)
__device__ int gemm_image_has_wgmma = KBIT_WGMMA;

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
#if KBIT_SM90
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
#endif
}
// wgmma's shared-memory descriptor of a K-major operand in 128-byte swizzled rows: 8-row groups 1024 bytes apart
__device__ __forceinline__ uint64_t swizzled_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)1 << 16 | (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}
__device__ __forceinline__ void wgmma_fence() {
#if KBIT_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if KBIT_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
// until at most N of this warpgroup's committed wgmma groups are pending
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if KBIT_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// read-only global loads issued where they are written
__device__ __forceinline__ uint4 ldg128_now(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ldg64_now(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ldg32_now(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ldg8_now(const void* p) {
  unsigned short v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ldg16_now(const void* p) {
  unsigned short v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
// the compiler must not move accesses to the accumulators across the asynchronous wgmmas
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// one wgmma, A from registers and B from shared memory; TY: the activation dtype's PTX name, "bf16" or "f16"
#define KBIT_WGMMA_N128(TY) \
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))
// d[64] += A (this warp's 16 rows of the warpgroup's 64, m16n8k16 A-fragment registers) x B (16 k x 128 tokens)
template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
#if KBIT_WGMMA
  if constexpr (std::is_same<T, __nv_bfloat16>::value) KBIT_WGMMA_N128("bf16");
  else KBIT_WGMMA_N128("f16");
#endif
}
#define KBIT_WGMMA_N256(TY) \
  asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, 1, 1, 1, 0;" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))
// the same for 256 tokens: d[128]
template <typename T>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], const uint32_t (&a)[4], uint64_t desc) {
#if KBIT_WGMMA
  if constexpr (std::is_same<T, __nv_bfloat16>::value) KBIT_WGMMA_N256("bf16");
  else KBIT_WGMMA_N256("f16");
#endif
}
#define KBIT_WGMMA_N64(TY) \
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;" \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc))
// the same for 64 tokens: d[32]
template <typename T>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
#if KBIT_WGMMA
  if constexpr (std::is_same<T, __nv_bfloat16>::value) KBIT_WGMMA_N64("bf16");
  else KBIT_WGMMA_N64("f16");
#endif
}
// d += A x B for BN = 64, 128 or 256 tokens
template <typename T, int BN>
__device__ __forceinline__ void wgmma_tokens(float (&d)[BN / 2], const uint32_t (&a)[4], uint64_t desc) {
  static_assert(BN == 64 || BN == 128 || BN == 256, "wgmma token widths");
  if constexpr (BN == 256) wgmma_m64n256k16<T>(d, a, desc);
  else if constexpr (BN == 128) wgmma_m64n128k16<T>(d, a, desc);
  else wgmma_m64n64k16<T>(d, a, desc);
}

// The wgmma GEMMs' epilogue for one warpgroup of a y^T = W x^T product (its 64 weight rows x BN tokens; call it once
// no wgmma of the CTA reads the shared region any more): outputs acc * f + bias of the lane's rows (b0: row g, b1:
// row g + 8 of warp wgw's 16) in dtype T, staged through `region` (BN x 128 bytes) as [token][64 rows], 16-byte chunk
// c of token n at chunk c ^ (n % 8) (conflict-free both ways), by stmatrix.trans: an 8 x 8 block of the accumulator
// fragment, rows by tokens, lands as 8 token rows of 8 weight rows. Then, past the warpgroup's named barrier
// `barrier_id`, 16-byte chunks are stored where dst(n, c) says (rows 8 c .. 8 c + 7 of the 64, token n; nullptr: not
// stored), a warp covering 4 tokens' 128 contiguous bytes. Why: one 2-byte store per output straight from the
// fragment took about 14% of the tiled GEMM's warp samples under ncu (k = 14336).
template <typename T, int BN, typename Dst>
__device__ __forceinline__ void wgmma_store_staged(const float (&acc)[BN / 2], uint32_t region, float f, float b0,
                                                   float b1, int wgw, int lane, int wtid, int barrier_id, Dst dst) {
  const int j = lane & 7, mk = lane >> 3;  // the row of matrix mk this lane addresses
#pragma unroll
  for (int p = 0; p < BN / 16; ++p) {
    uint32_t r[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // matrix k: tokens 8 (2 p + k / 2) .., rows g + 8 (k % 2)
      const int i0 = 4 * (2 * p + (k >> 1)) + 2 * (k & 1);
      const float bb = k & 1 ? b1 : b0;
      r[k] = Mma<T>::pack(fmaf(acc[i0], f, bb), fmaf(acc[i0 + 1], f, bb));
    }
    const int n = 8 * (2 * p + (mk >> 1)) + j, c = 2 * wgw + (mk & 1);
#if KBIT_SM90
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(
                     region + 128 * n + 16 * (c ^ j)),
                 "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
#endif
  }
  bar_group(barrier_id, 128);
#pragma unroll 4
  for (int it = 0; it < BN / 16; ++it) {
    const int idx = 128 * it + wtid, n = idx >> 3, c = idx & 7;
    const uint4 v = lds128_at(region + 128 * n + 16 * (c ^ (n & 7)));
    T* d = dst(n, c);
    if (d != nullptr) *reinterpret_cast<uint4*>(d) = v;
  }
}

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
// the driver's cuTensorMapEncodeTiled, through the runtime (the library links no libcuda); null if unavailable
EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult r;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &r);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &r);
#endif
    if (e != cudaSuccess || r != cudaDriverEntryPointSuccess) return (EncodeTiledFn) nullptr;
    return reinterpret_cast<EncodeTiledFn>(p);
  }();
  return fn;
}

// The wgmma GEMMs run on device `dev`: compute capability 9.0, the library's image built as sm_90a (a library built
// for other architectures runs PTX there, where the kernels would trap), and the driver's tensor-map encoder found.
// Cached.
bool wgmma_gemm_available(int dev) {
  static int known[64] = {};  // 0: not asked yet, 1: yes, 2: no
  if (dev < 0 || dev >= 64) return false;
  if (known[dev] == 0) {
    int major = 0, minor = 0, wgmma = 0;
    const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
                    major == 9 && minor == 0 &&
                    cudaMemcpyFromSymbol(&wgmma, gemm_image_has_wgmma, sizeof wgmma) == cudaSuccess && wgmma == 1 &&
                    encode_tiled() != nullptr;
    if (!ok) (void)cudaGetLastError();  // a failed query must not surface as a later launch's error
    known[dev] = ok ? 1 : 2;
  }
  return known[dev] == 1;
}
