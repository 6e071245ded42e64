// kbit_cpu.cpp: the C ABI of libkbit_cpu (kbit_cpu_api.h), the thread mapping of every entry point, the choice of
// instruction set, the scalar row kernels (the fallback, and the reference the SIMD ones are tested against), and
// quantize.
//
// Threads: every entry point splits its rows (of all matrices) into one contiguous range per OpenMP thread, in
// multiples of kRowGrain rows; calls too small to repay a team's start run on the calling thread alone.
#include "kbit_cpu_api.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kbit_cpu.h"

#define KBIT_CPU_ABI_VERSION 1

namespace kbit_cpu {

enum Error : int { OK = 0, BAD_K = 1, BAD_DTYPE = 2, BAD_SHAPE = 3 };

namespace {

constexpr int64_t kRowGrain = 4;
// Weights one call must decode per thread (in GEMV units) before a second thread joins: below, the team's start and
// barrier, a few microseconds, cost more than the thread saves.
constexpr int64_t kMinWeightsPerThread = 32 * 1024;

// ---- scalar row kernels ----------------------------------------------------------------------------------------
// Portable C++ (the fallback off x86, and the reference the SIMD paths are tested against): a block's indices 8 at
// a time through a 256-entry table spreading a byte's bits over 8 bytes, the values from the block's table of
// (codebook * d) * scale (the reference's float32 weights), the sums in 8 independent lanes the compiler can
// vectorize.

struct ByteSpread {
  uint64_t v[256];  // bit i of the index -> bit 0 of byte i
  constexpr ByteSpread() : v() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 8; ++i) v[b] |= uint64_t((b >> i) & 1) << (8 * i);
  }
};
constexpr ByteSpread kSpread{};

template <int K>
inline void scalar_indices(const uint32_t* words, uint8_t idx[kBlock]) {
  for (int g = 0; g < 4; ++g) {
    uint64_t spread = 0;
    for (int j = 0; j < K; ++j) spread |= kSpread.v[(words[j] >> (8 * g)) & 0xFF] << j;
    for (int i = 0; i < 8; ++i) idx[8 * g + i] = uint8_t(spread >> (8 * i));
  }
}

// The 32 weights of block b of row r (exact: the table holds (codebook * d) * scale).
template <int K>
inline void scalar_block(const Mat& w, const float* cb, int64_t r, int64_t b, float out[kBlock]) {
  uint8_t idx[kBlock];
  scalar_indices<K>(w.packed + (r * w.nb + b) * K, idx);
  float d = block_scale(w, r, b), table[1 << K];
  for (int i = 0; i < (1 << K); ++i) table[i] = (cb[i] * d) * w.scale;
  for (int i = 0; i < kBlock; ++i) out[i] = table[idx[i]];
}

template <int K>
void scalar_dequant(const Mat& w, const float* cb, int64_t r0, int64_t r1, void* y, int y_dtype) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < w.nb; ++b) {
      float v[kBlock];
      scalar_block<K>(w, cb, r, b, v);
      int n = int(std::min<int64_t>(kBlock, w.in - b * kBlock));
      int64_t at = r * w.in + b * kBlock;
      if (y_dtype == F32) {
        std::memcpy(static_cast<float*>(y) + at, v, sizeof(float) * n);
      } else {
        for (int i = 0; i < n; ++i) store_from_float(y, y_dtype, at + i, v[i]);
      }
    }
}

template <int K>
void scalar_gemv(const Mat& w, const float* cb, const float* x, int64_t ldx, int M, int64_t r0, int64_t r1, float* y,
                 int64_t ldy) {
  for (int64_t r = r0; r < r1; ++r) {
    float acc[kMaxM][8] = {};
    for (int64_t b = 0; b < w.nb; ++b) {
      float v[kBlock];
      scalar_block<K>(w, cb, r, b, v);
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * ldx + b * kBlock;
        for (int i = 0; i < kBlock; i += 8)
          for (int l = 0; l < 8; ++l) acc[m][l] += v[i + l] * xb[i + l];
      }
    }
    for (int m = 0; m < M; ++m) {
      float sum = 0.f;
      for (int l = 0; l < 8; ++l) sum += acc[m][l];
      y[m * ldy + r] = sum;
    }
  }
}

void scalar_dequant_rows(int k, const Mat& w, const float* cb, int64_t r0, int64_t r1, void* y, int y_dtype) {
  switch (k) {
    case 2: return scalar_dequant<2>(w, cb, r0, r1, y, y_dtype);
    case 3: return scalar_dequant<3>(w, cb, r0, r1, y, y_dtype);
    case 4: return scalar_dequant<4>(w, cb, r0, r1, y, y_dtype);
    default: return scalar_dequant<5>(w, cb, r0, r1, y, y_dtype);
  }
}

void scalar_gemv_rows(int k, const Mat& w, const float* cb, const float* x, int64_t ldx, int M, int64_t r0,
                      int64_t r1, float* y, int64_t ldy) {
  switch (k) {
    case 2: return scalar_gemv<2>(w, cb, x, ldx, M, r0, r1, y, ldy);
    case 3: return scalar_gemv<3>(w, cb, x, ldx, M, r0, r1, y, ldy);
    case 4: return scalar_gemv<4>(w, cb, x, ldx, M, r0, r1, y, ldy);
    default: return scalar_gemv<5>(w, cb, x, ldx, M, r0, r1, y, ldy);
  }
}

// ---- scalar quantize (bit-exact with reference.quantize) ---------------------------------------------------------

template <int K>
void scalar_quantize(const QuantJob& q, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < q.nb; ++b) {
      float v[kBlock];
      int n = int(std::min<int64_t>(kBlock, q.in - b * kBlock));
      float amax = 0.f;
      for (int i = 0; i < kBlock; ++i) {
        v[i] = i < n ? load_as_float(q.weight, q.w_dtype, r * q.in + b * kBlock + i) : 0.f;
        amax = std::max(amax, std::fabs(v[i]));
      }
      float a = amax / q.scale, d;
      if (q.absmax_fp16) {
        uint16_t h = float_to_half(a);
        if (a > 0.f && h == 0) h = 1;  // the smallest subnormal, 2^-24
        static_cast<uint16_t*>(q.absmax)[r * q.nb + b] = h;
        d = half_to_float(h);
      } else {
        uint8_t c = e4m4_encode(a);
        static_cast<uint8_t*>(q.absmax)[r * q.nb + b] = c;
        d = kE4m4.v[c];
      }
      uint32_t words[K] = {};
      for (int i = 0; i < kBlock; ++i) {
        float y = d > 0.f ? (v[i] / q.scale) / d : 0.f;
        int idx = 0;  // the number of codebook midpoints strictly below y
        for (int step = 1 << (K - 1); step > 0; step >>= 1)
          if (q.cmid[idx + step - 1] < y) idx += step;
        for (int j = 0; j < K; ++j) words[j] |= uint32_t((idx >> j) & 1) << i;
      }
      for (int j = 0; j < K; ++j) q.packed[(r * q.nb + b) * K + j] = words[j];
    }
  }
}

void scalar_quantize_rows(int k, const QuantJob& q, int64_t r0, int64_t r1) {
  switch (k) {
    case 2: return scalar_quantize<2>(q, r0, r1);
    case 3: return scalar_quantize<3>(q, r0, r1);
    case 4: return scalar_quantize<4>(q, r0, r1);
    default: return scalar_quantize<5>(q, r0, r1);
  }
}

void copy_x(const float* x, int64_t nb, float* xp) { std::memcpy(xp, x, sizeof(float) * nb * kBlock); }

const Kernels kScalar = {scalar_dequant_rows, scalar_quantize_rows, copy_x, scalar_gemv_rows};

// ---- instruction set -------------------------------------------------------------------------------------------

int best_isa() {
#if defined(KBIT_CPU_X86)
  __builtin_cpu_init();
#if defined(KBIT_CPU_HAVE_AVX512)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
      && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni"))
    return AVX512;
#endif
#if defined(KBIT_CPU_HAVE_AVX2)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return AVX2;
#endif
#endif
  return SCALAR;
}

const int kBestIsa = best_isa();
std::atomic<int> g_isa{kBestIsa};

const Kernels& kernels() {
  int isa = g_isa.load(std::memory_order_relaxed);
  (void)isa;
#if defined(KBIT_CPU_HAVE_AVX512)
  if (isa == AVX512) return avx512_kernels();
#endif
#if defined(KBIT_CPU_HAVE_AVX2)
  if (isa == AVX2) return avx2_kernels();
#endif
  return kScalar;
}

// ---- threads ---------------------------------------------------------------------------------------------------

int team_size(int threads, int64_t weights) {
  int t = threads;
#ifdef _OPENMP
  if (t <= 0) t = omp_get_max_threads();
#endif
  return int(std::max<int64_t>(1, std::min<int64_t>(std::max(t, 1), weights / kMinWeightsPerThread)));
}

// f(r0, r1) on one contiguous range of [0, rows) per thread.
template <class F>
void parallel_rows(int64_t rows, int threads, const F& f) {
  if (threads <= 1 || rows <= kRowGrain) {
    f(int64_t(0), rows);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
  {
    int64_t n = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t step = (rows + n * kRowGrain - 1) / (n * kRowGrain) * kRowGrain;
    int64_t r0 = std::min(rows, t * step), r1 = std::min(rows, r0 + step);
    if (r0 < r1) f(r0, r1);
  }
#else
  f(int64_t(0), rows);
#endif
}

bool valid_dtype(int d) { return d == F32 || d == F16 || d == BF16; }
int dtype_size(int d) { return d == F32 ? 4 : 2; }

Mat matrix(const uint32_t* packed, const void* absmax, int fp16, const float* scale, int k, int64_t e, int64_t out,
           int64_t in) {
  int64_t nb = (in + kBlock - 1) / kBlock;
  return Mat{packed + e * out * nb * k,
             static_cast<const uint8_t*>(absmax) + e * out * nb * (fp16 ? 2 : 1), fp16, scale[e], in, nb};
}

// x [M, in] in x_dtype -> float32 [M, nb * 32] in the order the kernels read (pack_x), zero past in.
void load_x(const Kernels& kern, const void* x, int x_dtype, int64_t M, int64_t in, int64_t ldx, const int64_t* rows,
            float* buf) {
  std::vector<float> row(size_t(ldx), 0.f);
  for (int64_t m = 0; m < M; ++m) {
    int64_t src = (rows ? rows[m] : m) * in;
    if (x_dtype == F32) {
      std::memcpy(row.data(), static_cast<const float*>(x) + src, sizeof(float) * in);
    } else {
      for (int64_t i = 0; i < in; ++i) row[size_t(i)] = load_as_float(x, x_dtype, src + i);
    }
    kern.pack_x(row.data(), ldx / kBlock, buf + m * ldx);
  }
}

// GEMV of M rows of xf (float32 [M, ldx]) with rows [r0, r1) of w: yf[m * ldy + r]. More than kMaxM rows take
// several passes, over tiles of kTileRows weight rows so that the later passes find the packed rows in cache.
void gemv_range(const Kernels& kern, int k, const Mat& w, const float* cb, const float* xf, int64_t ldx, int64_t M,
                int64_t r0, int64_t r1, float* yf, int64_t ldy) {
  constexpr int64_t kTileRows = 64;
  if (M <= kMaxM) return kern.gemv_rows(k, w, cb, xf, ldx, int(M), r0, r1, yf, ldy);
  for (int64_t t = r0; t < r1; t += kTileRows)
    for (int64_t m0 = 0; m0 < M; m0 += kMaxM)
      kern.gemv_rows(k, w, cb, xf + m0 * ldx, ldx, int(std::min<int64_t>(kMaxM, M - m0)), t,
                     std::min(r1, t + kTileRows), yf + m0 * ldy, ldy);
}

// Scratch of the calling thread, reused across calls (the OpenMP team only reads and writes it inside the call),
// 64-byte aligned: the AVX-512 kernels load x one cache line at a time.
float* scratch_floats(int which, int64_t n) {
  thread_local std::vector<float> bufs[2];
  std::vector<float>& v = bufs[which];
  if (int64_t(v.size()) < n + 16) v.resize(size_t(n + 16));
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

}  // namespace

const Kernels& scalar_kernels() { return kScalar; }

}  // namespace kbit_cpu

using namespace kbit_cpu;

extern "C" {

int kbit_cpu_abi_version(void) { return KBIT_CPU_ABI_VERSION; }

const char* kbit_cpu_error_string(int code) {
  switch (code) {
    case OK: return "no error";
    case BAD_K: return "k must be 2, 3, 4 or 5";
    case BAD_DTYPE: return "unsupported dtype code (0 = float32, 1 = float16, 2 = bfloat16)";
    case BAD_SHAPE: return "negative or empty size";
    default: return "unknown error";
  }
}

int kbit_cpu_isa(void) { return g_isa.load(); }

int kbit_cpu_set_isa(int isa) {
  int now = std::max(int(SCALAR), std::min(isa, kBestIsa));
  g_isa.store(now);
  return now;
}

int kbit_cpu_absmax(const void* weight, int w_dtype, int64_t E, int64_t out, int64_t in, float* amax, int threads) {
  if (!valid_dtype(w_dtype)) return BAD_DTYPE;
  if (E < 0 || out < 0 || in < 0) return BAD_SHAPE;
  int64_t rows = E * out;
  std::vector<float> row_max(size_t(std::max<int64_t>(rows, 1)), 0.f);
  parallel_rows(rows, team_size(threads, rows * in), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float m = 0.f;
      if (w_dtype == F32) {
        const float* p = static_cast<const float*>(weight) + r * in;
#pragma omp simd reduction(max : m)  // finite weights (checked by the caller): any order gives the same max
        for (int64_t i = 0; i < in; ++i) m = std::max(m, std::fabs(p[i]));
      } else {
        for (int64_t i = 0; i < in; ++i) m = std::max(m, std::fabs(load_as_float(weight, w_dtype, r * in + i)));
      }
      row_max[size_t(r)] = m;
    }
  });
  for (int64_t e = 0; e < E; ++e)
    amax[e] = out ? *std::max_element(row_max.begin() + e * out, row_max.begin() + (e + 1) * out) : 0.f;
  return OK;
}

int kbit_cpu_quantize(const void* weight, int w_dtype, int64_t E, int64_t out, int64_t in, const float* scale,
                      const float* codebook, int k, int absmax_fp16, uint32_t* packed, void* absmax, int threads) {
  if (k < 2 || k > 5) return BAD_K;
  if (!valid_dtype(w_dtype)) return BAD_DTYPE;
  if (E < 0 || out < 0 || in <= 0) return BAD_SHAPE;
  int64_t nb = (in + kBlock - 1) / kBlock, rows = E * out;
  float cmid[31];  // as format.codebook_midpoints: (c[i] + c[i + 1]) * 0.5 in float32
  for (int i = 0; i + 1 < (1 << k); ++i) cmid[i] = (codebook[i] + codebook[i + 1]) * 0.5f;
  const Kernels& kern = kernels();
  auto quantize_rows = kern.quantize_rows ? kern.quantize_rows : scalar_quantize_rows;
  // quantizing a weight costs about as much as decoding 16 in a GEMV
  parallel_rows(rows, team_size(threads, rows * in * 16), [&](int64_t r0, int64_t r1) {
    // a range may span matrices: split it at their boundaries (each has its own scale)
    for (int64_t r = r0; r < r1;) {
      int64_t e = r / out, stop = std::min(r1, (e + 1) * out);
      QuantJob q{static_cast<const char*>(weight) + e * out * in * dtype_size(w_dtype), w_dtype, in, nb, scale[e],
                 absmax_fp16, cmid, packed + e * out * nb * k,
                 static_cast<char*>(absmax) + e * out * nb * (absmax_fp16 ? 2 : 1)};
      quantize_rows(k, q, r - e * out, stop - e * out);
      r = stop;
    }
  });
  return OK;
}

int kbit_cpu_dequantize(const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                        const float* codebook, int k, int64_t E, int64_t out, int64_t in, void* y, int y_dtype,
                        int threads) {
  if (k < 2 || k > 5) return BAD_K;
  if (!valid_dtype(y_dtype)) return BAD_DTYPE;
  if (E < 0 || out < 0 || in <= 0) return BAD_SHAPE;
  const Kernels& kern = kernels();
  int64_t rows = E * out;
  parallel_rows(rows, team_size(threads, rows * in), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1;) {
      int64_t e = r / out, stop = std::min(r1, (e + 1) * out);
      Mat w = matrix(packed, absmax, absmax_fp16, scale, k, e, out, in);
      void* ye = static_cast<char*>(y) + e * out * in * dtype_size(y_dtype);
      kern.dequant_rows(k, w, codebook, r - e * out, stop - e * out, ye, y_dtype);
      r = stop;
    }
  });
  return OK;
}

int kbit_cpu_gemv(const void* x, int x_dtype, int64_t M, const uint32_t* packed, const void* absmax, int absmax_fp16,
                  const float* scale, const float* codebook, int k, int64_t out, int64_t in, const void* bias,
                  int bias_dtype, void* y, int threads) {
  if (k < 2 || k > 5) return BAD_K;
  if (!valid_dtype(x_dtype) || (bias && !valid_dtype(bias_dtype))) return BAD_DTYPE;
  if (M < 0 || out < 0 || in <= 0) return BAD_SHAPE;
  const Kernels& kern = kernels();
  Mat w = matrix(packed, absmax, absmax_fp16, scale, k, 0, out, in);
  int64_t ldx = w.nb * kBlock;
  float* xf = scratch_floats(0, M * ldx);
  load_x(kern, x, x_dtype, M, in, ldx, nullptr, xf);
  // fp32 results without a bias go straight to y; otherwise through fp32 scratch, then bias and rounding
  bool direct = x_dtype == F32 && !bias;
  float* yf = direct ? static_cast<float*>(y) : scratch_floats(1, M * out);
  parallel_rows(out, team_size(threads, out * in * std::max<int64_t>(1, M / 4)), [&](int64_t r0, int64_t r1) {
    gemv_range(kern, k, w, codebook, xf, ldx, M, r0, r1, yf, out);
    if (direct) return;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = r0; r < r1; ++r)
        store_from_float(y, x_dtype, m * out + r, yf[m * out + r] + (bias ? load_as_float(bias, bias_dtype, r) : 0.f));
  });
  return OK;
}

int kbit_cpu_expert_gemv(const void* x, int x_dtype, int64_t N, const int64_t* ids, int64_t E,
                         const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                         const float* codebook, int k, int64_t out, int64_t in, void* y, int threads) {
  if (k < 2 || k > 5) return BAD_K;
  if (!valid_dtype(x_dtype)) return BAD_DTYPE;
  if (N < 0 || E < 0 || out < 0 || in <= 0) return BAD_SHAPE;
  const Kernels& kern = kernels();
  int64_t nb = (in + kBlock - 1) / kBlock, ldx = nb * kBlock;
  // rows sorted by expert (a counting sort; rows of other ids dropped): each expert's rows form one GEMV of M rows
  std::vector<int64_t> start(size_t(E + 1), 0), order;
  order.reserve(size_t(N));
  for (int64_t n = 0; n < N; ++n)
    if (ids[n] >= 0 && ids[n] < E) ++start[size_t(ids[n] + 1)];
  for (int64_t e = 0; e < E; ++e) start[size_t(e + 1)] += start[size_t(e)];
  order.resize(size_t(start[size_t(E)]));
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t n = 0; n < N; ++n)
      if (ids[n] >= 0 && ids[n] < E) order[size_t(fill[size_t(ids[n])]++)] = n;
  }
  int64_t V = int64_t(order.size());
  float* xf = scratch_floats(0, V * ldx);
  load_x(kern, x, x_dtype, V, in, ldx, order.data(), xf);
  float* yf = scratch_floats(1, V * out);
  int64_t present = 0;
  for (int64_t e = 0; e < E; ++e) present += start[size_t(e + 1)] > start[size_t(e)];
  parallel_rows(out, team_size(threads, out * in * std::max<int64_t>(1, present)), [&](int64_t r0, int64_t r1) {
    for (int64_t e = 0; e < E; ++e) {
      int64_t a = start[size_t(e)], b = start[size_t(e + 1)];
      if (a == b) continue;
      Mat w = matrix(packed, absmax, absmax_fp16, scale, k, e, out, in);
      gemv_range(kern, k, w, codebook, xf + a * ldx, ldx, b - a, r0, r1, yf + a * out, out);
    }
    for (int64_t v = 0; v < V; ++v)
      for (int64_t r = r0; r < r1; ++r) store_from_float(y, x_dtype, order[size_t(v)] * out + r, yf[v * out + r]);
  });
  // rows of ids outside [0, E): zeros
  for (int64_t n = 0; n < N; ++n)
    if (ids[n] < 0 || ids[n] >= E) std::memset(static_cast<char*>(y) + n * out * dtype_size(x_dtype), 0,
                                               size_t(out * dtype_size(x_dtype)));
  return OK;
}

}  // extern "C"
