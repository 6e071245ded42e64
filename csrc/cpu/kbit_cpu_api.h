/* kbit_cpu_api.h: the plain C ABI of libkbit_cpu.so (loaded by kbit_hf/backends/cpu/library.py through ctypes).
 *
 * No torch types cross this boundary: tensors are raw host pointers plus sizes, dtypes are small integers
 * (0 = float32, 1 = float16, 2 = bfloat16). Every function runs on the calling thread plus an OpenMP team of
 * `threads` (<= 0: the OpenMP default), allocates nothing the caller sees, and returns 0 or an error code
 * (kbit_cpu_error_string turns it into text). All tensors must be contiguous. Shapes: weight [E, out, in]; packed
 * uint32 [E, out, nb*k]; absmax uint8 (e4m4) or fp16 [E, out, nb]; scale float32 [E]; codebook float32 [2^k],
 * nb = ceil(in / 32). Results are those of kbit_hf/backends/reference.py: quantize and dequantize bit for bit, the
 * GEMVs up to the order of their fp32 sums.
 */
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KBIT_CPU_API __attribute__((visibility("default")))

KBIT_CPU_API int kbit_cpu_abi_version(void);
KBIT_CPU_API const char* kbit_cpu_error_string(int code);

/* The instruction set the kernels use: 0 = scalar, 1 = AVX2 (+FMA, F16C), 2 = AVX-512 (F, BW, VL, DQ, VBMI, GFNI).
 * kbit_cpu_isa() is the one in use (the best this CPU has, chosen when the library loads); kbit_cpu_set_isa lowers
 * it (tests run every path on one machine), capped at what the CPU has, and returns the one now in use. */
KBIT_CPU_API int kbit_cpu_isa(void);
KBIT_CPU_API int kbit_cpu_set_isa(int isa);

/* amax[e] = max |weight[e]| over the whole matrix (finite weights; quantize's first pass). */
KBIT_CPU_API int kbit_cpu_absmax(const void* weight, int w_dtype, int64_t E, int64_t out, int64_t in, float* amax,
                                 int threads);

/* quantize with the per-matrix power-of-two scale given (format.tensor_scale of kbit_cpu_absmax's result):
 * weight -> packed, absmax. */
KBIT_CPU_API int kbit_cpu_quantize(const void* weight, int w_dtype, int64_t E, int64_t out, int64_t in,
                                   const float* scale, const float* codebook, int k, int absmax_fp16,
                                   uint32_t* packed, void* absmax, int threads);

/* dequantize -> y [E, out, in] in y_dtype: (codebook[idx] * block scale) * scale in float32, then rounded. */
KBIT_CPU_API int kbit_cpu_dequantize(const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                                     const float* codebook, int k, int64_t E, int64_t out, int64_t in, void* y,
                                     int y_dtype, int threads);

/* fused dequant-GEMV: y[m, o] = sum_i x[m, i] * W[o, i] (+ bias[o]), 0 <= m < M (any M >= 1; made for few rows),
 * x and y in x_dtype, bias in bias_dtype (or NULL), fp32 accumulation. E == 1 (packed [out, nb*k]). */
KBIT_CPU_API int kbit_cpu_gemv(const void* x, int x_dtype, int64_t M, const uint32_t* packed, const void* absmax,
                               int absmax_fp16, const float* scale, const float* codebook, int k, int64_t out,
                               int64_t in, const void* bias, int bias_dtype, void* y, int threads);

/* experts: y[n, o] = x[n] @ W[ids[n]]^T, rows with ids outside [0, E) are zero. ids int64 [N]; x, y in x_dtype. */
KBIT_CPU_API int kbit_cpu_expert_gemv(const void* x, int x_dtype, int64_t N, const int64_t* ids, int64_t E,
                                      const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                                      const float* codebook, int k, int64_t out, int64_t in, void* y, int threads);

#ifdef __cplusplus
}
#endif
