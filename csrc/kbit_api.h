/* kbit_api.h: the plain C ABI of libkbit_cuda.so (loaded by kbit_hf/backends/cuda/library.py through ctypes).
 *
 * No torch types cross this boundary: tensors are raw device pointers plus sizes, dtypes are small integers
 * (0 = float32, 1 = float16, 2 = bfloat16), streams are cudaStream_t passed as void*. Every function only
 * launches work on the given stream (no allocation, no synchronisation), so all of them are CUDA-graph
 * capturable, and returns 0 or a cudaError_t code (kbit_error_string turns it into text). All tensors must be
 * contiguous. Shapes: weight [E, out, in]; packed uint32 [E, out, nb*k]; absmax uint8 or fp16 [E, out, nb];
 * scale float32 [E]; codebook float32 [2^k], nb = ceil(in / 32).
 */
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KBIT_API __attribute__((visibility("default")))

KBIT_API int kbit_abi_version(void);
KBIT_API const char* kbit_error_string(int code);

/* quantize: weight (dtype w_dtype) -> packed, absmax, scale. scale doubles as scratch for the per-tensor max. */
KBIT_API int kbit_quantize(const void* weight, int w_dtype, int64_t E, int64_t out, int64_t in,
                           const float* codebook, int k, int absmax_fp16, uint32_t* packed, void* absmax,
                           float* scale, void* stream);

/* dequantize -> y [E, out, in] in y_dtype. */
KBIT_API int kbit_dequantize(const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                             const float* codebook, int k, int64_t E, int64_t out, int64_t in, void* y,
                             int y_dtype, void* stream);

/* fused dequant-GEMV: y[m, o] = sum_i x[m, i] * W[o, i] (+ bias[o]), m < M, 1 <= M <= 64, x/bias/y in x_dtype
 * (float16 or bfloat16), fp32 accumulation. E == 1 (packed [out, nb*k]). */
KBIT_API int kbit_gemv(const void* x, int x_dtype, int64_t M, const uint32_t* packed, const void* absmax,
                       int absmax_fp16, const float* scale, const float* codebook, int k, int64_t out, int64_t in,
                       const void* bias, void* y, void* stream);

/* GEMV for experts: y[n, o] = x[n] @ W[ids[n]]^T, rows with ids outside [0, E) are zero. ids int64 [N]. The library
 * picks a per-row kernel or a grouped one (rows sorted by expert on the device, each expert tile read once per up to
 * 64 of its rows), which needs a workspace of kbit_expert_gemv_workspace(N, E) bytes (-1: bad sizes). */
KBIT_API int64_t kbit_expert_gemv_workspace(int64_t N, int64_t E);
KBIT_API int kbit_expert_gemv(const void* x, int x_dtype, int64_t N, const int64_t* ids, int64_t E,
                              const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                              const float* codebook, int k, int64_t out, int64_t in, void* y, void* workspace,
                              int64_t workspace_bytes, void* stream);
/* kbit_expert_gemv with the kernel forced, for tests and benchmarks: KBIT_EXPERT_AUTO (the library's choice), PER_ROW,
 * GROUPED (up to EXPERT_GROUPED_MAX_E = 8192 experts). */
enum { KBIT_EXPERT_AUTO = 0, KBIT_EXPERT_PER_ROW = 1, KBIT_EXPERT_GROUPED = 2 };
KBIT_API int kbit_expert_gemv_kernel(const void* x, int x_dtype, int64_t N, const int64_t* ids, int64_t E,
                                     const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                                     const float* codebook, int k, int64_t out, int64_t in, void* y, void* workspace,
                                     int64_t workspace_bytes, int kernel, void* stream);

/* Fused MoE experts for few tokens, in the expert GEMV's per-row geometry. Row n = t * top_k + j of token t runs expert
 * ids[n] (int64 [T * top_k]); ids outside [0, E) contribute nothing. x, bias, weights, h and y in x_dtype (float16 or
 * bfloat16); the bit planes as kbit_expert_gemv reads them.
 * kbit_moe_gate_up: h[n, i] = the gating of g = W[ids[n]] @ x[t] + bias[ids[n]] (W [E, out = 2I, in], bias [E, 2I] or
 *   null): KBIT_GATE_SILU: SiLU(g[i]) * g[I + i]; KBIT_GATE_CLAMPED (gpt-oss): a = min(g[2i], limit),
 *   b = clamp(g[2i + 1], -limit, limit), (b + 1) * a * sigmoid(alpha * a). h [T * top_k, I]; zero rows for ids
 *   outside [0, E).
 * kbit_moe_down: y[t, o] = sum_j weights[t, j] * ((W[ids[n]] @ h[n])[o] + bias[ids[n], o]) (W [E, out, in], bias
 *   [E, out] or null, weights [T, top_k]); y [T, out]. */
enum { KBIT_GATE_SILU = 1, KBIT_GATE_CLAMPED = 2 };
KBIT_API int kbit_moe_gate_up(const void* x, int x_dtype, int64_t T, int64_t top_k, const int64_t* ids, int64_t E,
                              const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                              const float* codebook, int k, int64_t out, int64_t in, const void* bias, int gate,
                              float alpha, float limit, void* h, void* stream);
KBIT_API int kbit_moe_down(const void* h, int x_dtype, int64_t T, int64_t top_k, const int64_t* ids,
                           const void* weights, int64_t E, const uint32_t* packed, const void* absmax, int absmax_fp16,
                           const float* scale, const float* codebook, int k, int64_t out, int64_t in,
                           const void* bias, void* y, void* stream);

/* A MoE router's selection from its logits [tokens, E] (float32, float16 or bfloat16; E <= KBIT_ROUTER_MAX_E,
 * 1 <= k <= min(E, 32)): ids int64 [tokens, k] in descending order of weight (ties: the lower id), weights [tokens, k]
 * in weights_dtype. KBIT_ROUTER_SOFTMAX_TOPK: the softmax over E (fp32), its k largest, divided by their sum when
 * renorm (Qwen3-MoE, Mixtral); KBIT_ROUTER_TOPK_SOFTMAX: the k largest logits, then the softmax over them (gpt-oss). */
enum { KBIT_ROUTER_SOFTMAX_TOPK = 1, KBIT_ROUTER_TOPK_SOFTMAX = 2, KBIT_ROUTER_MAX_E = 2048 };
KBIT_API int kbit_router_topk(const void* logits, int dtype, int64_t tokens, int64_t E, int64_t k, int mode,
                              int renorm, int64_t* ids, void* weights, int weights_dtype, void* stream);

/* The tiled layout of large K = 2..5 Linear weights (kbit_hf/backends/cuda/tiled.py, docs/design.md; out % 16 == 0,
 * in % 256 == 0, e4m4 block scales): wt uint8 [out, in * k / 8], at uint8 [out, in / 32], a permutation of packed
 * uint32 [out, in / 32 * k] and absmax uint8 [out, in / 32]. k: 2..5. */
KBIT_API int kbit_tile(const uint32_t* packed, const void* absmax, int k, int64_t out, int64_t in, void* wt, void* at,
                       void* stream);
KBIT_API int kbit_untile(const void* wt, const void* at, int k, int64_t out, int64_t in, uint32_t* packed, void* absmax,
                         void* stream);
KBIT_API int kbit_dequantize_tiled(const void* wt, const void* at, const float* scale, const float* codebook, int k,
                                   int64_t out, int64_t in, void* y, int y_dtype, void* stream);
/* fused GEMV over the tiled layout, 1 <= M <= 64, x/bias/y float16 or bfloat16 (x 16-byte aligned); sm_90 only
 * (cudaErrorNotSupported on other devices). The library picks the kernel. */
KBIT_API int kbit_gemv_tiled(const void* x, int x_dtype, int64_t M, const void* wt, const void* at,
                             const float* scale, const float* codebook, int k, int64_t out, int64_t in,
                             const void* bias, void* y, void* stream);

/* kbit_gemv_tiled with the kernel forced, for tests and benchmarks. kernel: KBIT_TILED_AUTO (the library's choice, as
 * kbit_gemv_tiled), KBIT_TILED_RANGE / KBIT_TILED_BATCH the per-warp-range or the batched kernel, KBIT_TILED_BATCH1 /
 * 2 / 4 the batched kernel with 1, 2 or 4 warps per tile; a BATCH code + KBIT_TILED_KS2: the batched kernel with its
 * k range split over clusters of 2 CTAs. */
enum {
  KBIT_TILED_AUTO = 0,
  KBIT_TILED_RANGE = 1,
  KBIT_TILED_BATCH = 2,
  KBIT_TILED_BATCH1 = 3,
  KBIT_TILED_BATCH2 = 4,
  KBIT_TILED_BATCH4 = 5,
  KBIT_TILED_KS2 = 8
};
KBIT_API int kbit_gemv_tiled_kernel(const void* x, int x_dtype, int64_t M, const void* wt, const void* at,
                                    const float* scale, const float* codebook, int k, int64_t out, int64_t in,
                                    const void* bias, void* y, int kernel, void* stream);

/* Tensor-core GEMM over the tiled layout for M > 64 tokens: y [M, out] = x [M, in] W^T (+ bias), x/bias/y float16 or
 * bfloat16, x and y 16-byte aligned, fp32 accumulation; compute capability 9.0 only (cudaErrorNotSupported elsewhere).
 * Needs a workspace of kbit_gemm_tiled_workspace(M, out, in) bytes (-1: bad shape or no device), 256-byte aligned, on
 * the current device: x copied into the kernel's k order, and partial sums where the layer has too few tiles to fill
 * the GPU (the library then splits the k range). */
KBIT_API int64_t kbit_gemm_tiled_workspace(int64_t M, int64_t out, int64_t in);
/* 1 when the wgmma GEMMs (kbit_gemm_tiled, kbit_expert_gemm) run on the current device: compute capability 9.0 and
 * this library built with sm_90a code. */
KBIT_API int kbit_wgmma_available(void);
KBIT_API int kbit_gemm_tiled(const void* x, int x_dtype, int64_t M, const void* wt, const void* at, const float* scale,
                             const float* codebook, int k, int64_t out, int64_t in, const void* bias, void* y,
                             void* workspace, int64_t workspace_bytes, void* stream);

/* Grouped expert GEMM on the tensor cores for many rows per expert: y[n, o] = x[n] @ W[ids[n]]^T, rows with ids outside
 * [0, E) are zero; the bit planes as kbit_expert_gemv reads them; x/y float16 or bfloat16, x 16-byte aligned, in a
 * multiple of 64, fp32 accumulation; compute capability 9.0 only (cudaErrorNotSupported elsewhere). Sorts and gathers
 * the rows on the device (no host sync) in a workspace of kbit_expert_gemm_workspace(N, E, in) bytes, 256-byte
 * aligned. */
KBIT_API int64_t kbit_expert_gemm_workspace(int64_t N, int64_t E, int64_t in);
KBIT_API int kbit_expert_gemm(const void* x, int x_dtype, int64_t N, const int64_t* ids, int64_t E,
                              const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                              const float* codebook, int k, int64_t out, int64_t in, void* y, void* workspace,
                              int64_t workspace_bytes, void* stream);

/* Tensor-core GEMM over the bit planes for M > 64 tokens (mma.sync; GPUs with 155-203 KB of shared memory per block:
 * sm_80, sm_90): y [M, out] = x [M, in] W^T (+ bias), x/bias/y float16 or bfloat16, x 16-byte aligned, in a multiple
 * of 8, fp32 accumulation; the planes and scales as kbit_gemv reads them (E == 1). Where the layer has too few CTAs to
 * fill the GPU the library splits the k range and needs a workspace of kbit_gemm_planes_workspace(M, out, in, k, 0)
 * bytes (0: none; -1: bad shape, or no launch shape fits the current device). cudaErrorNotSupported: the device's
 * shared memory cannot hold the kernel's stages. */
KBIT_API int64_t kbit_gemm_planes_workspace(int64_t M, int64_t out, int64_t in, int k, int bn);
KBIT_API int kbit_gemm_planes(const void* x, int x_dtype, int64_t M, const uint32_t* packed, const void* absmax,
                              int absmax_fp16, const float* scale, const float* codebook, int k, int64_t out,
                              int64_t in, const void* bias, void* y, void* workspace, int64_t workspace_bytes,
                              void* stream);
/* kbit_gemm_planes with the launch shape forced, for tests and benchmarks: bn 64 or 128 tokens per CTA, stages 3 or 4;
 * 0 keeps the library's choice of each. Its workspace: kbit_gemm_planes_workspace with the same bn. */
KBIT_API int kbit_gemm_planes_kernel(const void* x, int x_dtype, int64_t M, const uint32_t* packed,
                                     const void* absmax, int absmax_fp16, const float* scale, const float* codebook,
                                     int k, int64_t out, int64_t in, const void* bias, void* y, void* workspace,
                                     int64_t workspace_bytes, int bn, int stages, void* stream);

#ifdef __cplusplus
}
#endif
