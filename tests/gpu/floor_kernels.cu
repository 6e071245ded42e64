// floor_kernels.cu: reference kernels that only move bytes, to measure what the GPU allows for the shapes the kbit
// kernels are judged on (tests/gpu/bench_floor.py). Plain C ABI, no torch: built with nvcc into a small .so.
//   floor_empty   an empty kernel: the cost of one graph node.
//   floor_read    grid-stride, each thread 4 independent 16-byte loads per iteration, XOR-reduced; the result is
//                 stored only if it equals a value it cannot equal, so the loads are not dead.
//   floor_write   grid-stride 16-byte stores.
//   floor_expand  the dequantize access pattern: output 16-byte chunk j = a function of input chunk j / R, so R
//                 neighbouring threads read the same 16 bytes (one line per warp) and the write stream is R times
//                 the read stream (R = 4: K = 4 to bf16, R = 8: K = 2).
#include <cuda_runtime.h>
#include <cstdint>

namespace {
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
}  // namespace

extern "C" {
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
int floor_expand(const void* src, void* dst, int64_t dst_bytes, int r, int grid, void* stream) {
  if (r == 4) expand_kernel<4><<<grid, 256, 0, (cudaStream_t)stream>>>((const uint4*)src, (uint4*)dst, dst_bytes / 16);
  else if (r == 8) expand_kernel<8><<<grid, 256, 0, (cudaStream_t)stream>>>((const uint4*)src, (uint4*)dst, dst_bytes / 16);
  else return (int)cudaErrorInvalidValue;
  return (int)cudaGetLastError();
}
}
