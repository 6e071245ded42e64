// kbit_cpu_avx512.cpp: the AVX-512 row kernels (compiled with -mavx512f/bw/vl/dq/vbmi -mgfni; run only where
// the CPU has all of them: kbit_cpu.cpp best_isa).
//
// Indices: a block's K words are 4K contiguous bytes, loaded with a mask. One VPERMB builds, in each qword, the
// 8 x 8 bit matrix whose byte 7 - j is the byte of word j that holds bit plane j of 8 elements; one GF2P8AFFINEQB
// against a one-hot selector transposes every qword at once, leaving one index per byte (format.md:
// idx = sum_j bit i of word j << j). Values: VPERMPS / VPERMT2PS look the indices up in a table built once per
// block.
//
// Dequantize decodes one block at a time: two VPERMB + GF2P8AFFINEQB pairs put index i of 16 elements in dword i,
// looked up in (codebook * d) * scale: exactly the reference's float32 weights, stored in element order.
// The GEMVs decode two blocks (64 weights) at a time: one VPERMB + GF2P8AFFINEQB give all 64 index bytes, and
// dword lane i of the result, shifted right by 8 s, holds index 4i + s in its low byte (the lookups ignore the
// bits above), so four shifts replace three shuffles; x is stored in that order (pack_x). K <= 4 looks up both
// blocks' 16-entry tables (codebook * scale) * d at once (VPERMT2PS; the unused bit-plane-4 row of the matrix is
// set for the second block, so bit 4 of its indices picks its table); K = 5 looks up codebook * scale and multiplies
// by the two block scales. (codebook * scale) * d is the reference's (codebook * d) * scale (scale is a power of
// two) wherever the weight is a normal float32.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kbit_cpu.h"

namespace kbit_cpu {
namespace {

// The decoded scale d of block i of a matrix (F16C converts fp16 exactly).
inline float scale_at(const void* absmax, int fp16, int64_t i) {
  return fp16 ? _cvtsh_ss(static_cast<const uint16_t*>(absmax)[i]) : kE4m4.v[static_cast<const uint8_t*>(absmax)[i]];
}

template <int K>
struct Decoder {
  __m512i sel[2];  // VPERMB selectors of elements 0..15 and 16..31
  __m512i onehot;  // GF2P8AFFINEQB operand: in qword q, byte 0 = 1 << 2(q % 4), byte 4 = 1 << (2(q % 4) + 1)
  __m512 cb0, cb1;  // codebook entries 0..15, 16..31 (K = 5)
  __m512 scale;

  Decoder(const float* cb, float s) {
    alignas(64) uint8_t b[2][64], o[64] = {};
    for (int h = 0; h < 2; ++h)
      for (int q = 0; q < 8; ++q)
        for (int byte = 0; byte < 8; ++byte) {
          int j = 7 - byte, g = 2 * h + q / 4;  // qword q of half h covers elements 16h + 2q, 16h + 2q + 1
          b[h][q * 8 + byte] = uint8_t(j < K ? 4 * j + g : 63);  // byte 63 is past the loaded words: zero
        }
    for (int q = 0; q < 8; ++q) {
      o[q * 8] = uint8_t(1 << (2 * (q % 4)));
      o[q * 8 + 4] = uint8_t(1 << (2 * (q % 4) + 1));
    }
    sel[0] = _mm512_load_si512(b[0]);
    sel[1] = _mm512_load_si512(b[1]);
    onehot = _mm512_load_si512(o);
    cb0 = _mm512_maskz_loadu_ps(__mmask16((1u << (K < 4 ? (1 << K) : 16)) - 1), cb);
    cb1 = K == 5 ? _mm512_loadu_ps(cb + 16) : _mm512_setzero_ps();
    scale = _mm512_set1_ps(s);
  }

  // The 32 weights of the block whose words start at p, scale d: elements 0..15 in w0, 16..31 in w1.
  inline void weights(const uint32_t* p, float d, __m512& w0, __m512& w1) const {
    __m512i words = _mm512_maskz_loadu_epi32(__mmask16((1u << K) - 1), p);
    __m512i i0 = _mm512_gf2p8affine_epi64_epi8(onehot, _mm512_permutexvar_epi8(sel[0], words), 0);
    __m512i i1 = _mm512_gf2p8affine_epi64_epi8(onehot, _mm512_permutexvar_epi8(sel[1], words), 0);
    __m512 dv = _mm512_set1_ps(d);
    __m512 t0 = _mm512_mul_ps(_mm512_mul_ps(cb0, dv), scale);
    if (K == 5) {
      __m512 t1 = _mm512_mul_ps(_mm512_mul_ps(cb1, dv), scale);
      w0 = _mm512_permutex2var_ps(t0, i0, t1);
      w1 = _mm512_permutex2var_ps(t0, i1, t1);
    } else {
      w0 = _mm512_permutexvar_ps(i0, t0);
      w1 = _mm512_permutexvar_ps(i1, t0);
    }
  }
};

inline __m256i to_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// Store n <= 16 floats at element i of y in y_dtype.
inline void store16(void* y, int y_dtype, int64_t i, __m512 v, int n) {
  __mmask16 m = __mmask16(n >= 16 ? 0xFFFF : (1u << n) - 1);
  if (y_dtype == F32) {
    _mm512_mask_storeu_ps(static_cast<float*>(y) + i, m, v);
  } else {
    __m256i h = y_dtype == BF16 ? to_bf16(v) : _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + i, m, h);
  }
}

// Dequantize: rows [r0, r1), each decoded block stored at once (masked stores for the last, partial block).
template <int K>
void dequant(const Mat& w, const float* cb, int64_t r0, int64_t r1, void* y, int y_dtype) {
  Decoder<K> dec(cb, w.scale);
  for (int64_t r = r0; r < r1; ++r) {
    const uint32_t* p = w.packed + r * w.nb * K;
    int64_t base = r * w.in;
    for (int64_t b = 0; b < w.nb; ++b, p += K) {
      __m512 w0, w1;
      dec.weights(p, scale_at(w.absmax, w.absmax_fp16, r * w.nb + b), w0, w1);
      int n = int(std::min<int64_t>(kBlock, w.in - b * kBlock));
      store16(y, y_dtype, base + b * kBlock, w0, n);
      if (n > 16) store16(y, y_dtype, base + b * kBlock + 16, w1, n - 16);
    }
  }
}

template <int K>
struct PairDecoder {
  __m512i sel;     // VPERMB: qword q (elements 8q .. 8q + 7) byte 7 - j <- byte q % 4 of word j of block q / 4
  __m512i onehot;  // byte b of every qword = 1 << b
  __m512i fill;    // the bytes past the loaded words: zero, byte 63 = 0xFF (K <= 4: block 1's bit-4 row)
  __m512 cbs0, cbs1;  // codebook * scale, entries 0..15 and 16..31 (zero where the codebook has none)

  PairDecoder(const float* cb, float s) {
    alignas(64) uint8_t b[64], o[64], f[64] = {};
    for (int q = 0; q < 8; ++q)
      for (int byte = 0; byte < 8; ++byte) {
        int j = 7 - byte, blk = q / 4;
        b[q * 8 + byte] = uint8_t(j < K ? (blk * K + j) * 4 + q % 4 : (K <= 4 && j == 4 && blk ? 63 : 62));
        o[q * 8 + byte] = uint8_t(1 << byte);
      }
    f[63] = K <= 4 ? 0xFF : 0;
    sel = _mm512_load_si512(b);
    onehot = _mm512_load_si512(o);
    fill = _mm512_load_si512(f);
    __m512 sv = _mm512_set1_ps(s);
    cbs0 = _mm512_mul_ps(_mm512_maskz_loadu_ps(__mmask16((1u << (K < 4 ? 1 << K : 16)) - 1), cb), sv);
    cbs1 = K == 5 ? _mm512_mul_ps(_mm512_loadu_ps(cb + 16), sv) : _mm512_setzero_ps();
  }

  // The 64 weights of blocks b, b + 1 (words at p, scales d0, d1): w[s] lane i = element 4i + s.
  inline void weights(const uint32_t* p, float d0, float d1, __m512 w[4]) const {
    __m512i words = _mm512_mask_loadu_epi32(fill, __mmask16((1u << (2 * K)) - 1), p);
    __m512i R = _mm512_gf2p8affine_epi64_epi8(onehot, _mm512_permutexvar_epi8(sel, words), 0);
    __m512i v[4] = {R, _mm512_srli_epi32(R, 8), _mm512_srli_epi32(R, 16), _mm512_srli_epi32(R, 24)};
    if (K == 5) {
      __m512 dv = _mm512_mask_broadcastss_ps(_mm512_set1_ps(d0), 0xFF00, _mm_set_ss(d1));
      for (int q = 0; q < 4; ++q) w[q] = _mm512_mul_ps(_mm512_permutex2var_ps(cbs0, v[q], cbs1), dv);
    } else {
      __m512 t0 = _mm512_mul_ps(cbs0, _mm512_set1_ps(d0)), t1 = _mm512_mul_ps(cbs0, _mm512_set1_ps(d1));
      for (int q = 0; q < 4; ++q) w[q] = _mm512_permutex2var_ps(t0, v[q], t1);
    }
  }
};

// pack_x: each pair of blocks (64 elements) as 4 x 16: x[64g + 16s + i] = element 64g + 4i + s; an odd last
// block stays in element order.
void pack_x(const float* x, int64_t nb, float* xp) {
  int64_t g = 0;
  for (; 2 * g + 2 <= nb; ++g)
    for (int s = 0; s < 4; ++s)
      for (int i = 0; i < 16; ++i) xp[64 * g + 16 * s + i] = x[64 * g + 4 * i + s];
  std::copy(x + 64 * g, x + nb * kBlock, xp + 64 * g);
}

// GEMV of MT = 1..8 x rows (pack_x order): each pair of blocks is decoded once and feeds 4 MT FMAs; one x row
// keeps four accumulators, more rows two each (enough independent FMA chains to hide their latency). The packed
// rows are prefetched kPrefetchBytes ahead (through the next rows): in a model's decode loop the weights come from
// DRAM between other ops, and without it SmolLM2's 1536 x 576 layer took 104 us instead of 33 (one thread).
constexpr int kPrefetchBytes = 1024;  // 512 .. 2048 measured the same

template <int K, int MT>
void gemv_mt(const Mat& w, const PairDecoder<K>& pd, const Decoder<K>& dec, const float* x, int64_t ldx, int64_t r0,
             int64_t r1, float* y, int64_t ldy) {
  constexpr int A = MT == 1 ? 4 : 2;
  const int64_t nb = w.nb, pairs = nb / 2;
  const void* absmax = w.absmax;
  const int fp16 = w.absmax_fp16;
  for (int64_t r = r0; r < r1; ++r) {
    const uint32_t* p = w.packed + r * nb * K;
    __m512 acc[MT][A];
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < A; ++a) acc[m][a] = _mm512_setzero_ps();
    for (int64_t g = 0; g < pairs; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(p + 2 * g * K) + kPrefetchBytes, _MM_HINT_T0);
      __m512 v[4];
      pd.weights(p + 2 * g * K, scale_at(absmax, fp16, r * nb + 2 * g), scale_at(absmax, fp16, r * nb + 2 * g + 1),
                 v);
      const float* xg = x + 64 * g;
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m)
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q)
          acc[m][q % A] = _mm512_fmadd_ps(v[q], _mm512_loadu_ps(xg + m * ldx + 16 * q), acc[m][q % A]);
    }
    if (nb & 1) {
      __m512 v0, v1;
      dec.weights(p + (nb - 1) * K, scale_at(absmax, fp16, r * nb + nb - 1), v0, v1);
      const float* xb = x + (nb - 1) * kBlock;
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        acc[m][0] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(xb + m * ldx), acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xb + m * ldx + 16), acc[m][1]);
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      __m512 s = acc[m][0];
      for (int a = 1; a < A; ++a) s = _mm512_add_ps(s, acc[m][a]);
      y[m * ldy + r] = _mm512_reduce_add_ps(s);
    }
  }
}

template <int K>
void gemv(const Mat& w, const float* cb, const float* x, int64_t ldx, int M, int64_t r0, int64_t r1, float* y,
          int64_t ldy) {
  PairDecoder<K> pd(cb, w.scale);
  Decoder<K> dec(cb, w.scale);
  switch (M) {
    case 1: return gemv_mt<K, 1>(w, pd, dec, x, ldx, r0, r1, y, ldy);
    case 2: return gemv_mt<K, 2>(w, pd, dec, x, ldx, r0, r1, y, ldy);
    case 3: return gemv_mt<K, 3>(w, pd, dec, x, ldx, r0, r1, y, ldy);
    case 4: return gemv_mt<K, 4>(w, pd, dec, x, ldx, r0, r1, y, ldy);
    case 5: return gemv_mt<K, 5>(w, pd, dec, x, ldx, r0, r1, y, ldy);
    case 6: return gemv_mt<K, 6>(w, pd, dec, x, ldx, r0, r1, y, ldy);
    case 7: return gemv_mt<K, 7>(w, pd, dec, x, ldx, r0, r1, y, ldy);
    default: return gemv_mt<K, 8>(w, pd, dec, x, ldx, r0, r1, y, ldy);
  }
}

// Quantize (bit-exact with reference.quantize): one block per step, 16 elements per vector. The block scale is
// encoded in scalar code (kbit_cpu.h); y = (w / scale) / d with IEEE divisions (w / scale as w * (1 / scale) where
// that is a normal float: the same correctly rounded value, scale being a power of two); the index is the count
// of codebook midpoints below y, by binary lifting over a table of them (K compare-and-add steps, VPERMPS /
// VPERMT2PS); bit plane j of 16 indices is one VPTESTMD mask.
inline __m512 load16(const void* w, int dtype, int64_t i, int n) {
  __mmask16 m = __mmask16(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);  // zeros past the row: the padding
  if (dtype == F32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(w) + i);
  __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(w) + i);
  if (dtype == F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int K>
void quantize(const QuantJob& q, int64_t r0, int64_t r1) {
  alignas(64) float mids[32];
  for (int i = 0; i < 32; ++i) mids[i] = i < (1 << K) - 1 ? q.cmid[i] : __builtin_inff();  // never below y
  const __m512 mid0 = _mm512_load_ps(mids), mid1 = _mm512_load_ps(mids + 16);
  const float inv = 1.f / q.scale;
  const bool by_inverse = std::fpclassify(inv) == FP_NORMAL;
  const __m512 sv = _mm512_set1_ps(by_inverse ? inv : q.scale);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t b = 0; b < q.nb; ++b) {
      int64_t i0 = r * q.in + b * kBlock;
      int n = int(std::min<int64_t>(kBlock, q.in - b * kBlock));
      __m512 v[2] = {load16(q.weight, q.w_dtype, i0, n), load16(q.weight, q.w_dtype, i0 + 16, n - 16)};
      float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1]))) / q.scale, d;
      if (q.absmax_fp16) {
        uint16_t h = uint16_t(_cvtss_sh(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        if (a > 0.f && h == 0) h = 1;  // the smallest subnormal, 2^-24
        static_cast<uint16_t*>(q.absmax)[r * q.nb + b] = h;
        d = _cvtsh_ss(h);
      } else {
        uint8_t c = e4m4_encode(a);
        static_cast<uint8_t*>(q.absmax)[r * q.nb + b] = c;
        d = kE4m4.v[c];
      }
      uint32_t words[K] = {};
      for (int h = 0; h < 2; ++h) {
        __m512 y = by_inverse ? _mm512_mul_ps(v[h], sv) : _mm512_div_ps(v[h], sv);
        y = d > 0.f ? _mm512_div_ps(y, _mm512_set1_ps(d)) : _mm512_setzero_ps();
        __m512i idx = _mm512_setzero_si512();
        for (int step = 1 << (K - 1); step > 0; step >>= 1) {
          __m512i at = _mm512_add_epi32(idx, _mm512_set1_epi32(step - 1));
          __m512 m = K == 5 ? _mm512_permutex2var_ps(mid0, at, mid1) : _mm512_permutexvar_ps(at, mid0);
          idx = _mm512_mask_add_epi32(idx, _mm512_cmp_ps_mask(m, y, _CMP_LT_OQ), idx, _mm512_set1_epi32(step));
        }
        for (int j = 0; j < K; ++j)
          words[j] |= uint32_t(_mm512_test_epi32_mask(idx, _mm512_set1_epi32(1 << j))) << (16 * h);
      }
      for (int j = 0; j < K; ++j) q.packed[(r * q.nb + b) * K + j] = words[j];
    }
  }
}

void quantize_rows(int k, const QuantJob& q, int64_t r0, int64_t r1) {
  switch (k) {
    case 2: return quantize<2>(q, r0, r1);
    case 3: return quantize<3>(q, r0, r1);
    case 4: return quantize<4>(q, r0, r1);
    default: return quantize<5>(q, r0, r1);
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

const Kernels kAvx512 = {dequant_rows, quantize_rows, pack_x, gemv_rows};

}  // namespace

const Kernels& avx512_kernels() { return kAvx512; }

}  // namespace kbit_cpu
