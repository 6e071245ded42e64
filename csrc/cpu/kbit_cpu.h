// kbit_cpu.h: what the translation units of libkbit_cpu share: the format's scalar rules (E4M4 and fp16 block
// scales, float rounding to bf16 / fp16) and the table of row kernels each instruction set provides.
//
// Every helper here has internal linkage (an unnamed namespace): the ISA translation units are compiled with
// -mavx2 / -mavx512*, and a shared inline copy could otherwise be merged into the scalar path and fault on older CPUs.
#pragma once
#include <cstdint>
#include <cstring>

namespace kbit_cpu {

enum Dtype : int { F32 = 0, F16 = 1, BF16 = 2 };
enum Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2 };
constexpr int kBlock = 32;
constexpr int kMaxM = 8;  // x rows one pass of a GEMV row kernel takes; more rows: several passes

// One bit-plane matrix [out, in] (format.md): row r's words at packed + r * nb * K, its block scales at
// absmax + r * nb (bytes for e4m4, fp16 bits otherwise).
struct Mat {
  const uint32_t* packed;
  const void* absmax;
  int absmax_fp16;
  float scale;
  int64_t in, nb;
};

// What quantize needs for one matrix (rows [r0, r1) of it per call).
struct QuantJob {
  const void* weight;  // [out, in] in w_dtype
  int w_dtype;
  int64_t in, nb;
  float scale;         // the matrix's power-of-two scale
  int absmax_fp16;
  const float* cmid;   // the 2^K - 1 codebook midpoints (c[i] + c[i + 1]) * 0.5f (format.codebook_midpoints)
  uint32_t* packed;    // [out, nb * K]
  void* absmax;        // [out, nb]
};

// Row kernels of one instruction set. Each covers rows [r0, r1) of one matrix on the calling thread.
//   dequant_rows: row r -> y + r * in in y_dtype (bit-exact: (codebook[idx] * d) * scale in float32)
//   quantize_rows: bit-exact with reference.quantize (null: the scalar one)
//   pack_x:       one float32 row of nb * 32 elements, zero past `in` -> the order gemv_rows reads
//   gemv_rows:    y[m * ldy + r] = sum_i x[m * ldx + i] * W[r, i] in fp32, 1 <= M <= kMaxM, x rows from pack_x
//                 (the padded elements of the last block then add exact zeros)
struct Kernels {
  void (*dequant_rows)(int k, const Mat& w, const float* codebook, int64_t r0, int64_t r1, void* y, int y_dtype);
  void (*quantize_rows)(int k, const QuantJob& q, int64_t r0, int64_t r1);
  void (*pack_x)(const float* x, int64_t nb, float* xp);
  void (*gemv_rows)(int k, const Mat& w, const float* codebook, const float* x, int64_t ldx, int M, int64_t r0,
                    int64_t r1, float* y, int64_t ldy);
};

const Kernels& scalar_kernels();
const Kernels& avx2_kernels();
const Kernels& avx512_kernels();

namespace {

constexpr float pow2(int e) {
  float v = 1.f;
  for (; e > 0; --e) v *= 2.f;
  for (; e < 0; ++e) v *= 0.5f;
  return v;
}

// E4M4 (format.md): e == 0 -> m / 16 * 2^-10, else (1 + m / 16) * 2^(e - 11); every value exact in float32.
struct E4m4Table {
  float v[256];
  constexpr E4m4Table() : v() {
    for (int c = 0; c < 256; ++c) {
      int e = c >> 4, m = c & 15;
      v[c] = e == 0 ? float(m) / 16.f * pow2(-10) : (1.f + float(m) / 16.f) * pow2(e - 11);
    }
  }
};
constexpr E4m4Table kE4m4{};

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// E4M4 encoding (format.md): the nearest code, an exact tie to the even code; a nonzero value never encodes to 0.
// The codes are the float32 grid of 5 significant bits from 2^-10 up and multiples of 2^-14 below, in increasing
// order, so this is round-to-nearest-even onto that grid: of the float's top 4 mantissa bits, or of a * 2^14.
// 0 <= a <= 31 (a block absmax over the power-of-two scale is at most 16).
inline uint8_t e4m4_encode(float a) {
  if (!(a > 0.f)) return 0;
  if (a < pow2(-10)) {
    float x = a * pow2(14);  // exact
    int m = int(x);
    float frac = x - float(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1))) ++m;
    return uint8_t(m > 0 ? m : 1);
  }
  uint32_t u = float_bits(a);
  uint32_t code = ((u + 0x3FFFFu + ((u >> 19) & 1u)) >> 19) - ((127u - 11u) << 4);
  return uint8_t(code < 255u ? code : 255u);
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
  if (e == 0) return bits_float(sign) + (sign ? -1.f : 1.f) * float(m) * pow2(-24);  // zero or subnormal: exact
  if (e == 31) return bits_float(sign | 0x7F800000u | (m << 13));
  return bits_float(sign | ((e + 112) << 23) | (m << 13));
}

// Round to nearest even (what torch's .to(torch.float16) does), overflow to infinity, NaN stays NaN.
inline uint16_t float_to_half(float f) {
  uint32_t u = float_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // rounds to >= 65536: infinity
  if (a < 0x38800000u) {  // below 2^-14: a subnormal half, the value rounded to a multiple of 2^-24
    float r = bits_float(a) * pow2(24);  // exact; then round half to even in integer arithmetic
    uint32_t i = uint32_t(r);
    float frac = r - float(i);
    if (frac > 0.5f || (frac == 0.5f && (i & 1))) ++i;
    return uint16_t(sign | i);
  }
  uint32_t lsb = (a >> 13) & 1;
  return uint16_t(sign | ((a - 0x38000000u + 0xFFFu + lsb) >> 13));
}

// Round to nearest even; every NaN becomes 0x7FC0 (torch's c10::BFloat16 rule).
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1)) >> 16);
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

inline float load_as_float(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case F16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case BF16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

inline void store_from_float(void* p, int dtype, int64_t i, float v) {
  switch (dtype) {
    case F16: static_cast<uint16_t*>(p)[i] = float_to_half(v); break;
    case BF16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

// The decoded scale d of block b of row r (float32, exact).
inline float block_scale(const Mat& w, int64_t r, int64_t b) {
  int64_t i = r * w.nb + b;
  return w.absmax_fp16 ? half_to_float(static_cast<const uint16_t*>(w.absmax)[i])
                       : kE4m4.v[static_cast<const uint8_t*>(w.absmax)[i]];
}

}  // namespace
}  // namespace kbit_cpu
