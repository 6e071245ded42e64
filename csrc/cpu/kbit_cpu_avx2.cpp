// kbit_cpu_avx2.cpp: the AVX2 row kernels (compiled with -mavx2 -mfma -mf16c; run only where the CPU has all
// three: kbit_cpu.cpp best_isa).
//
// Decoding one block (32 weights): per bit plane j, word j broadcast to every byte lane of its element
// (VPSHUFB), masked with the element's bit and compared: 32 index bytes after 5 K instructions, widened to four
// vectors of 8 dword indices. VPERMPS looks them up in the block's table (codebook * d) * scale, 8 entries per
// register (K = 4, 5: two or four registers and VBLENDVPS on the high index bits): the reference's exact float32
// weights, so dequantize is bit-exact and the GEMVs multiply exact weights.
#include <immintrin.h>

#include <algorithm>

#include "kbit_cpu.h"

namespace kbit_cpu {
namespace {

template <int K>
struct Decoder {
  static constexpr int T = K <= 3 ? 1 : (K == 4 ? 2 : 4);  // table registers of 8 entries
  __m256i spread, bit;  // byte i <- byte i / 8 of the broadcast word; byte i = 1 << (i % 8)
  __m256 cb[T], scale;

  Decoder(const float* c, float s) {
    alignas(32) uint8_t sp[32], bt[32];
    for (int i = 0; i < 32; ++i) {
      sp[i] = uint8_t(i / 8);  // VPSHUFB indexes within 16-byte lanes, each holding 4 copies of the word
      bt[i] = uint8_t(1 << (i % 8));
    }
    spread = _mm256_load_si256(reinterpret_cast<const __m256i*>(sp));
    bit = _mm256_load_si256(reinterpret_cast<const __m256i*>(bt));
    alignas(32) float t[32] = {};
    std::copy(c, c + (1 << K), t);
    for (int i = 0; i < T; ++i) cb[i] = _mm256_load_ps(t + 8 * i);
    scale = _mm256_set1_ps(s);
  }

  inline __m256 lookup(const __m256* t, __m256i i) const {
    if (T == 1) return _mm256_permutevar8x32_ps(t[0], i);
    __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(i, 28));  // sign bit = index bit 3
    __m256 lo = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[0], i), _mm256_permutevar8x32_ps(t[1], i), b3);
    if (T == 2) return lo;
    __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[2], i), _mm256_permutevar8x32_ps(t[3], i), b3);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(i, 27)));
  }

  // The 32 weights of the block whose words start at p, scale d: elements 8q .. 8q + 7 in w[q].
  inline void weights(const uint32_t* p, float d, __m256 w[4]) const {
    __m256i idx = _mm256_setzero_si256();
#pragma GCC unroll 5
    for (int j = 0; j < K; ++j) {
      __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(int(p[j])), spread);
      v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
      idx = _mm256_or_si256(idx, _mm256_and_si256(v, _mm256_set1_epi8(char(1 << j))));
    }
    __m128i lo = _mm256_castsi256_si128(idx), hi = _mm256_extracti128_si256(idx, 1);
    __m256 dv = _mm256_set1_ps(d), t[T];
    for (int i = 0; i < T; ++i) t[i] = _mm256_mul_ps(_mm256_mul_ps(cb[i], dv), scale);
    w[0] = lookup(t, _mm256_cvtepu8_epi32(lo));
    w[1] = lookup(t, _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = lookup(t, _mm256_cvtepu8_epi32(hi));
    w[3] = lookup(t, _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
};

inline __m128i to_bf16(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Store 8 floats at element i of y in y_dtype.
inline void store8(void* y, int y_dtype, int64_t i, __m256 v) {
  if (y_dtype == F32) {
    _mm256_storeu_ps(static_cast<float*>(y) + i, v);
  } else {
    __m128i h = y_dtype == BF16 ? to_bf16(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(y) + i), h);
  }
}

// Dequantize: rows [r0, r1); the last, partial block of a row goes through a stack buffer.
template <int K>
void dequant(const Mat& w, const float* cb, int64_t r0, int64_t r1, void* y, int y_dtype) {
  Decoder<K> dec(cb, w.scale);
  for (int64_t r = r0; r < r1; ++r) {
    const uint32_t* p = w.packed + r * w.nb * K;
    int64_t base = r * w.in;
    for (int64_t b = 0; b < w.nb; ++b, p += K) {
      __m256 v[4];
      dec.weights(p, block_scale(w, r, b), v);
      int n = int(std::min<int64_t>(kBlock, w.in - b * kBlock));
      if (n == kBlock) {
        for (int q = 0; q < 4; ++q) store8(y, y_dtype, base + b * kBlock + 8 * q, v[q]);
      } else {
        alignas(32) float t[kBlock];
        for (int q = 0; q < 4; ++q) _mm256_store_ps(t + 8 * q, v[q]);
        for (int i = 0; i < n; ++i) store_from_float(y, y_dtype, base + b * kBlock + i, t[i]);
      }
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

constexpr int kPrefetchBytes = 1024;  // as in the AVX-512 GEMV

// GEMV of MT = 1..8 x rows: each block is decoded once; one x row keeps four accumulators (the FMA latency),
// more rows one each (two or four were no faster: the decode is the bound). The packed rows are prefetched ahead.
template <int K, int MT>
void gemv_mt(const Mat& w, const Decoder<K>& dec, const float* x, int64_t ldx, int64_t r0, int64_t r1, float* y,
             int64_t ldy) {
  constexpr int A = MT == 1 ? 4 : 1;
  for (int64_t r = r0; r < r1; ++r) {
    const uint32_t* p = w.packed + r * w.nb * K;
    __m256 acc[MT][A];
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.nb; ++b, p += K) {
      _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
      __m256 v[4];
      dec.weights(p, block_scale(w, r, b), v);
      const float* xb = x + b * kBlock;
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
          acc[m][q % A] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(xb + m * ldx + 8 * q), acc[m][q % A]);
    }
    for (int m = 0; m < MT; ++m) {
      __m256 s = acc[m][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[m][a]);
      y[m * ldy + r] = hsum(s);
    }
  }
}

template <int K>
void gemv(const Mat& w, const float* cb, const float* x, int64_t ldx, int M, int64_t r0, int64_t r1, float* y,
          int64_t ldy) {
  Decoder<K> dec(cb, w.scale);
  switch (M) {
    case 1: return gemv_mt<K, 1>(w, dec, x, ldx, r0, r1, y, ldy);
    case 2: return gemv_mt<K, 2>(w, dec, x, ldx, r0, r1, y, ldy);
    case 3: return gemv_mt<K, 3>(w, dec, x, ldx, r0, r1, y, ldy);
    case 4: return gemv_mt<K, 4>(w, dec, x, ldx, r0, r1, y, ldy);
    case 5: return gemv_mt<K, 5>(w, dec, x, ldx, r0, r1, y, ldy);
    case 6: return gemv_mt<K, 6>(w, dec, x, ldx, r0, r1, y, ldy);
    case 7: return gemv_mt<K, 7>(w, dec, x, ldx, r0, r1, y, ldy);
    default: return gemv_mt<K, 8>(w, dec, x, ldx, r0, r1, y, ldy);
  }
}

void dequant_rows(int k, const Mat& w, const float* cb, int64_t r0, int64_t r1, void* y, int y_dtype) {
  switch (k) {
    case 2: return dequant<2>(w, cb, r0, r1, y, y_dtype);
    case 3: return dequant<3>(w, cb, r0, r1, y, y_dtype);
    case 4: return dequant<4>(w, cb, r0, r1, y, y_dtype);
    default: return dequant<5>(w, cb, r0, r1, y, y_dtype);
  }
}

void gemv_rows(int k, const Mat& w, const float* cb, const float* x, int64_t ldx, int M, int64_t r0, int64_t r1,
               float* y, int64_t ldy) {
  switch (k) {
    case 2: return gemv<2>(w, cb, x, ldx, M, r0, r1, y, ldy);
    case 3: return gemv<3>(w, cb, x, ldx, M, r0, r1, y, ldy);
    case 4: return gemv<4>(w, cb, x, ldx, M, r0, r1, y, ldy);
    default: return gemv<5>(w, cb, x, ldx, M, r0, r1, y, ldy);
  }
}

void copy_x(const float* x, int64_t nb, float* xp) { std::copy(x, x + nb * kBlock, xp); }

const Kernels kAvx2 = {dequant_rows, nullptr, copy_x, gemv_rows};

}  // namespace

const Kernels& avx2_kernels() { return kAvx2; }

}  // namespace kbit_cpu
