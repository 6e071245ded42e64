// kbit_router.cu: a MoE router's top-k selection and routing weights from its logits, one kernel for what torch runs
// as softmax, top-k (a select and a sort) and the renormalisation.
//
// - One warp per token, four tokens per CTA. The warp copies the token's E logits (as fp32) into its slice of shared
//   memory, reduces their max (and, softmax first, the sum of exp(l - max)), then runs k rounds of a warp argmax
//   (ties: the lower expert id, as a stable descending sort orders them); each round's winner is marked NaN so that
//   later rounds skip it, and lane r keeps round r's expert and logit.
// - Weights, lane r < k: softmax first: p = exp(l - max) / sum over all E, optionally divided by the sum over the k;
//   top-k first (gpt-oss): the softmax over the k selected logits, rounded to the logits' dtype (torch's softmax in
//   that dtype). Computed in fp32, then rounded to the output dtype.
#include "kbit_api.h"
#include "kbit_common.cuh"

#include <cuda_runtime.h>

using namespace kbit;

namespace {

constexpr int ROUTER_WARPS = 4;

__device__ __forceinline__ void argmax_merge(float& v, int& i, float v2, int i2) {
  if (i2 >= 0 && (i < 0 || v2 > v || (v2 == v && i2 < i))) {
    v = v2;
    i = i2;
  }
}

template <typename T, typename W>
__global__ void __launch_bounds__(ROUTER_WARPS * 32)
    router_topk_kernel(const T* __restrict__ logits, int tokens, int E, int k, int mode, int renorm,
                       int64_t* __restrict__ ids, W* __restrict__ weights) {
  extern __shared__ float vals[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t = blockIdx.x * ROUTER_WARPS + warp;
  if (t >= tokens) return;
  float* v = vals + (size_t)warp * E;
  float mx = -INFINITY;
  for (int i = lane; i < E; i += 32) {
    v[i] = Cvt<T>::to_f(logits[(int64_t)t * E + i]);
    mx = fmaxf(mx, v[i]);
  }
  for (int d = 16; d > 0; d >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, d));
  float sum = 0.f;
  if (mode == KBIT_ROUTER_SOFTMAX_TOPK) {
    for (int i = lane; i < E; i += 32) sum += expf(v[i] - mx);
    for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, d);
  }
  __syncwarp();
  float mine = -INFINITY;
  int mine_id = 0;
  for (int r = 0; r < k; ++r) {
    float best = -INFINITY;
    int bi = -1;
    for (int i = lane; i < E; i += 32)
      if (!isnan(v[i])) argmax_merge(best, bi, v[i], i);
    for (int d = 16; d > 0; d >>= 1) {
      const float b2 = __shfl_xor_sync(0xFFFFFFFFu, best, d);
      const int i2 = __shfl_xor_sync(0xFFFFFFFFu, bi, d);
      argmax_merge(best, bi, b2, i2);
    }
    if (bi < 0) bi = 0;  // fewer than k non-NaN logits
    if (lane == r) {
      mine = best;
      mine_id = bi;
    }
    __syncwarp();
    if (lane == 0) v[bi] = NAN;
    __syncwarp();
  }
  // weights of the k selected (lanes >= k contribute nothing)
  const float top = __shfl_sync(0xFFFFFFFFu, mine, 0);  // the largest selected logit
  float p = 0.f;
  if (lane < k) p = mode == KBIT_ROUTER_SOFTMAX_TOPK ? expf(mine - mx) / sum : expf(mine - top);
  if (mode == KBIT_ROUTER_TOPK_SOFTMAX || renorm) {
    float s = p;
    for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xFFFFFFFFu, s, d);
    p /= s;
  }
  if (mode == KBIT_ROUTER_TOPK_SOFTMAX) p = Cvt<T>::to_f(Cvt<T>::from_f(p));  // a softmax in the logits' dtype
  if (lane < k) {
    ids[(int64_t)t * k + lane] = mine_id;
    weights[(int64_t)t * k + lane] = Cvt<W>::from_f(p);
  }
}

template <typename T, typename W>
int launch(const void* logits, int64_t tokens, int64_t E, int64_t k, int mode, int renorm, int64_t* ids, void* weights,
           cudaStream_t st) {
  const int64_t ctas = (tokens + ROUTER_WARPS - 1) / ROUTER_WARPS;
  router_topk_kernel<T, W><<<(unsigned)ctas, ROUTER_WARPS * 32, ROUTER_WARPS * E * sizeof(float), st>>>(
      reinterpret_cast<const T*>(logits), (int)tokens, (int)E, (int)k, mode, renorm, ids,
      reinterpret_cast<W*>(weights));
  return (int)cudaGetLastError();
}

template <typename T>
int launch_w(int w_dtype, const void* logits, int64_t tokens, int64_t E, int64_t k, int mode, int renorm, int64_t* ids,
             void* weights, cudaStream_t st) {
  switch (w_dtype) {
    case F32: return launch<T, float>(logits, tokens, E, k, mode, renorm, ids, weights, st);
    case F16: return launch<T, __half>(logits, tokens, E, k, mode, renorm, ids, weights, st);
    case BF16: return launch<T, __nv_bfloat16>(logits, tokens, E, k, mode, renorm, ids, weights, st);
  }
  return (int)cudaErrorInvalidValue;
}

}  // namespace

extern "C" int kbit_router_topk(const void* logits, int dtype, int64_t tokens, int64_t E, int64_t k, int mode,
                                int renorm, int64_t* ids, void* weights, int weights_dtype, void* stream) {
  if (logits == nullptr || ids == nullptr || weights == nullptr || tokens < 0 || E < 1 || E > KBIT_ROUTER_MAX_E ||
      k < 1 || k > 32 || k > E || (mode != KBIT_ROUTER_SOFTMAX_TOPK && mode != KBIT_ROUTER_TOPK_SOFTMAX) ||
      tokens > (int64_t)0x7FFFFFFF)
    return (int)cudaErrorInvalidValue;
  if (tokens == 0) return 0;
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  switch (dtype) {
    case F32: return launch_w<float>(weights_dtype, logits, tokens, E, k, mode, renorm, ids, weights, st);
    case F16: return launch_w<__half>(weights_dtype, logits, tokens, E, k, mode, renorm, ids, weights, st);
    case BF16: return launch_w<__nv_bfloat16>(weights_dtype, logits, tokens, E, k, mode, renorm, ids, weights, st);
  }
  return (int)cudaErrorInvalidValue;
}
