// kbit_gemv.cu: fused dequantize + GEMV over the bit planes (docs/format.md) for the decode path (M = 1..64 activation
// rows, fp16/bf16, fp32 accumulate) on the tensor cores (mma.sync m16n8k16, sm_80+), and the expert GEMV used by
// KbitMoE. Which variant a call runs: kbit_dispatch.h.
//
// - A CTA owns one tile of 16 output rows per row group (blockDim.y groups) and W = 1, 4 or 8 warps per group that
//   split the input dimension: warp w handles steps w, w + W, ..., a step being 8 consecutive 32-element blocks;
//   the W partial tiles are summed through shared memory in a fixed order (deterministic, no atomics, no workspace).
// - Experts (weights [E, out, in]): per-row mode, blockIdx.y = row n of x and y, expert ids[n]; or grouped mode, the
//   rows counting-sorted by expert on the device first (expert_route_kernel), blockIdx.y = a work item of up to 8 NT
//   rows of one expert (find_item), whose x rows the CTA gathers and whose y rows it scatters (srow), so an expert
//   tile is read once per item. Ids outside [0, E) give zero rows in both.
// - The weight tile is the MMA's A operand (16 rows x k16), the activations its B operand (k16 x n8: tokens 0..M-1,
//   zero past M), fp32 accumulators. The k order inside an MMA is free (A and B only have to agree), so lane
//   4g + q owns whole blocks: in a step, blocks b0 + q and b0 + 4 + q of rows g and g + 8. It loads their K packed
//   words itself (one 16-byte load per row and block for K = 4, two 8-byte and one 4-byte load for K = 5 at M <= 8,
//   every packed byte read once, no shuffles) one step ahead through pointers that the loop advances, and the 32
//   activations of the same block for token g at use (M <= g: zeros).
// - Decode, three modes (template MODE, per K: gemv_decode_mode):
//   * registers (MODE 1, K = 2, 3): the codebook values (times PRE, in the activation dtype) are held as byte planes
//     in registers (tl[n] / th[n]: low / high bytes of entries 4n..4n+3). A partial 4x4 bit transpose of planes 0..2
//     (15 instructions per row-block) gives Q_e (e = 0..3) whose nibble k is the 3-bit index of element 4k + e (bit 3
//     clear: PRMT reads it as sign-replicate); nibbles 0..3 / 4..7 (Q_e >> 16) select the group {e, e+4, e+8, e+12} /
//     16 + that. Per group: one PRMT over (tl[0], tl[1]) and one over (th[0], th[1]) look up the 4 low / high bytes
//     (entries 0..7); K = 4 repeats that over entries 8..15 and merges by plane 3 with one PRMT per byte plane
//     (selector nibble i = i + 4 * bit3 of element i); two PRMTs interleave the bytes into the bf16x2 / f16x2 pairs
//     (e, e + 4) and (e + 8, e + 12). The activations are paired the same way, one PRMT per pair from the loaded
//     (2i, 2i+1) words. No shared memory, no L1 traffic for the lookup.
//   * table (MODE 0, K = 5, and every K at NT = 8): for s = 0..3 the K bit planes are folded into one word
//     t_s = OR_j ((w_j >> (2s - 2j)) & (0x03030303 << 2j)) whose byte B is the 2K-bit index of the element pair
//     (8B + 2s, 8B + 2s + 1); K = 5 uses two words with 16-bit fields. One LDS.32 per pair reads both weights from a
//     per-CTA pair table of 2^(2K) bf16x2 / f16x2 entries built from the codebook at kernel start, replicated
//     R = 32 times for K <= 3 (lane l reads replica l: conflict-free), 8 times for K = 4, 5.
//   * hybrid (MODE 2, K = 4): the first owned block of each step through the registers, the second through the
//     table, which splits the lookup between the integer pipe (PRMT) and the shared-memory pipe (LDS).
//   The block scale is applied to each pair with one HMUL2 (bf16x2 / f16x2); e4m4 scales decode exactly as
//   uint_as_float(code << 19) * 2^116.
// - Folded tiles (M <= 4, few output rows: gemv_fold): a CTA owns 8 rows and a step 16 blocks; the MMA's rows 8..15
//   carry the step's second 8 blocks of the same 8 rows, their activations sit in B columns 4..7, and the two halves
//   are added in the epilogue. Twice the CTAs of the 16-row grid, the same decode and bytes per lane.
// - Token tiles (M = 9..64, template NT = 2, 4 or 8 tiles of 8 tokens): the same decode modes, each half row-block
//   decoded once for NT MMAs (register decode: the activations paired by PRMT); the CTA is blockDim.y row groups x
//   blockDim.x / 32 k-split warps, and the row groups of one split share each step's activations through two cp.async
//   stages in shared memory.
// - Numerics: every mode yields bitwise the same weight values. The MMA needs the weights in the activation dtype, so
//   cb is rounded to bf16/fp16, the block scale to bf16 (exact for e4m4 scales) and the product cb * d once more; for
//   fp16, cb and d are pre-multiplied by 16 each (the fp16 product cb*d*256 stays normal for every e4m4 scale) and the
//   result multiplied by 2^-8 at the end. Accumulation is fp32 (the register modes feed the MMA k slots in another
//   element order than the table, so the fp32 sums may round differently); the result times the per-tensor scale
//   plus bias is rounded to the activation dtype.
#include "kbit_api.h"
#include "kbit_common.cuh"
#include "kbit_dispatch.h"

#include <cuda_runtime.h>

using namespace kbit;

namespace {

constexpr int TILE = GEMV_TILE_ROWS;       // output rows per CTA
constexpr int STEP = GEMV_STEP_BLOCKS;     // 32-element blocks per warp step
constexpr int MAX_WARPS = GEMV_MAX_WARPS;

template <int K>
struct Cfg {
  static constexpr int NP = 1 << (2 * K);  // pair-table entries
  // replicas (lane l reads replica l % R, so lanes never conflict with lanes of another replica): K = 2, 3: 32
  // (conflict-free); K = 4: 8 (8 KB; 32 replicas are slower on 14336x4096 and 4096x4096); K = 5: 8 (32 KB;
  // 2 replicas are 3-5% slower)
  static constexpr int R = K <= 3 ? 32 : 8;
  static constexpr int WORDS = NP * R;
  static constexpr int LR = R == 32 ? 5 : R == 16 ? 4 : R == 8 ? 3 : R == 4 ? 2 : R == 2 ? 1 : 0;
  static constexpr int L = LR + 2;                                // bit offset of the pair index in a byte address
  static constexpr uint32_t AMASK = (uint32_t)(NP - 1) << L;
};

template <int SH>
__device__ __forceinline__ uint32_t shr(uint32_t v) {
  if constexpr (SH >= 0) return v >> SH;
  else return v << (-SH);
}

__device__ __forceinline__ uint32_t lds(const char* tb, uint32_t off) {
  return *reinterpret_cast<const uint32_t*>(tb + off);
}

// Fold the K planes of one row-block into pair-table byte offsets and look the 16 pairs up: a[p] = the two weights
// (elements 2p, 2p+1) of pair p, times d2. HALF = 0 / 1: only pairs 8 * HALF .. 8 * HALF + 7 (elements 16 * HALF ..
// 16 * HALF + 15), the others are left unset; -1: all.
template <int K, typename T, int HALF = -1>
__device__ __forceinline__ void decode_block(const uint32_t (&w)[5], uint32_t d2, uint32_t c4, const char* tb,
                                             uint32_t (&a)[16]) {
  using C = Cfg<K>;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    uint32_t fold[2];
    fold_planes<K>(w, s, fold);
    if constexpr (K <= 4) {
      const uint32_t t = fold[0];
#pragma unroll
      for (int B = 0; B < 4; ++B) {
        if (HALF >= 0 && (B >> 1) != HALF) continue;
        const int sh = 8 * B - C::L;
        const uint32_t v = sh >= 0 ? (t >> (sh >= 0 ? sh : 0)) : (t << (sh < 0 ? -sh : 0));
        a[4 * B + s] = Mma<T>::mul2(lds(tb, (v & C::AMASK) | c4), d2);
      }
    } else {
      // 16-bit fields: te holds the pairs of bytes 0 and 2, to those of bytes 1 and 3
      const uint32_t te = fold[0], to = fold[1];
#pragma unroll
      for (int f = 0; f < 2; ++f) {
        if (HALF >= 0 && f != HALF) continue;
        const int sh = 16 * f - C::L;
        const uint32_t ve = sh >= 0 ? (te >> (sh >= 0 ? sh : 0)) : (te << (sh < 0 ? -sh : 0));
        const uint32_t vo = sh >= 0 ? (to >> (sh >= 0 ? sh : 0)) : (to << (sh < 0 ? -sh : 0));
        a[4 * (2 * f) + s] = Mma<T>::mul2(lds(tb, (ve & C::AMASK) | c4), d2);
        a[4 * (2 * f + 1) + s] = Mma<T>::mul2(lds(tb, (vo & C::AMASK) | c4), d2);
      }
    }
  }
}

// ---- codebook lookup in registers (K = 2, 3, 4) ----
// x >> N as a multiply-high (IMAD.HI on the FMA pipe instead of SHF on the integer pipe, which the PRMTs fill)
template <int N>
__host__ __device__ __forceinline__ uint32_t shr_hi(uint32_t x) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(1u << (32 - N)));
  return r;
#else
  return x >> N;
#endif
}

__host__ __device__ __forceinline__ uint32_t bsel(uint32_t m, uint32_t a, uint32_t b) { return (a & m) | (b & ~m); }

// Codebook values (times PRE, rounded to the activation dtype) as byte planes: tl[n] byte b = low byte of entry
// 4n + b, th[n] the high bytes (entries 0..2^K-1; K = 2 uses tl[0] / th[0] only).
// Decode one row-block (K planes w) to 16 packed weight pairs, unscaled. Output order: a[8h + 2e + t] holds the
// elements (16h + e + 8t, 16h + e + 8t + 4), e = 0..3, h, t = 0..1 (low half = the first element).
//   Q_e (e = 0..3): nibble k = bits 0..2 (planes 0..2) of element 4k + e's index, bit 3 zero (a partial 4x4 bit
//   transpose: 2 interleave steps, 15 instructions for all four words). Nibbles 0..3 select elements e, e+4, e+8,
//   e+12, nibbles 4..7 (Q_e >> 16) elements 16 + those. One PRMT over (tl[0], tl[1]) looks up the four low bytes
//   of entries 0..7, one over (th[0], th[1]) the high bytes; K = 4 does the same over entries 8..15 (tl[2], tl[3])
//   and merges by plane 3 with one more PRMT per byte plane (selector nibble i = i + 4 * bit3). Two PRMTs
//   interleave low and high bytes into the two bf16x2 / f16x2 words.
// selectors of one row-block: Q[e] (lookup, planes 0..2) and, for K = 4, m[e] (merge by plane 3)
template <int K>
__host__ __device__ __forceinline__ void reg_selectors(const uint32_t (&w)[5], uint32_t (&Q)[4], uint32_t (&m)[4]) {
  const uint32_t D = bsel(0x55555555u, w[0], w[1] << 1);          // bit 2m: w0[2m], 2m+1: w1[2m]
  const uint32_t Dp = bsel(0x55555555u, shr_hi<1>(w[0]), w[1]);  // bit 2m: w0[2m+1], 2m+1: w1[2m+1]
  const uint32_t ev = w[2] & 0x55555555u, od = w[2] & 0xAAAAAAAAu;
  Q[0] = bsel(0x33333333u, D, ev << 2);
  Q[1] = bsel(0x33333333u, Dp, od << 1);
  Q[2] = bsel(0x33333333u, shr_hi<2>(D), ev);
  Q[3] = bsel(0x33333333u, shr_hi<2>(Dp), shr_hi<1>(od));
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    m[e] = 0u;
    if constexpr (K == 4) {
      // merge selector: nibble i = i + 4 * (plane-3 bit of element e + 4i)
      const uint32_t v = e <= 2 ? (w[3] << (2 - e)) : shr_hi<1>(w[3]);
#ifdef __CUDA_ARCH__
      asm("lop3.b32 %0, %1, 0x44444444, %2, 0xEA;" : "=r"(m[e]) : "r"(v), "r"(0x32103210u));  // (v & 0x4444..) | c
#else
      m[e] = (v & 0x44444444u) | 0x32103210u;
#endif
    }
  }
}

// group (h, e) of one row-block: a0 = elements (16h + e, 16h + e + 4), a1 = (16h + e + 8, 16h + e + 12), unscaled
template <int K, int H>
__host__ __device__ __forceinline__ void reg_group(uint32_t Qe, uint32_t me, const uint32_t (&tl)[4],
                                                   const uint32_t (&th)[4], uint32_t& a0, uint32_t& a1) {
  constexpr int T1 = K >= 3 ? 1 : 0;  // second table register for entries 4..7
  const uint32_t s = H ? shr_hi<16>(Qe) : Qe;
  uint32_t lo = prmt(tl[0], tl[T1], s), hi = prmt(th[0], th[T1], s);
  if constexpr (K == 4) {
    const uint32_t mh = H ? shr_hi<16>(me) : me;
    lo = prmt(lo, prmt(tl[2], tl[3], s), mh);
    hi = prmt(hi, prmt(th[2], th[3], s), mh);
  }
  a0 = prmt(lo, hi, 0x5140u);
  a1 = prmt(lo, hi, 0x7362u);
}

// group (h, e) of rows g (g0, g1) and g + 8 (h0, h1); h is a constant after unrolling
template <int K>
__device__ __forceinline__ void reg_group_rows(int h, uint32_t Qg, uint32_t mg, uint32_t Qh, uint32_t mh,
                                               const uint32_t (&tl)[4], const uint32_t (&th)[4], uint32_t& g0,
                                               uint32_t& g1, uint32_t& h0, uint32_t& h1) {
  if (h == 0) {
    reg_group<K, 0>(Qg, mg, tl, th, g0, g1);
    reg_group<K, 0>(Qh, mh, tl, th, h0, h1);
  } else {
    reg_group<K, 1>(Qg, mg, tl, th, g0, g1);
    reg_group<K, 1>(Qh, mh, tl, th, h0, h1);
  }
}

// whole row-block (host self-test): a[8h + 2e + t] = elements (16h + e + 8t, 16h + e + 8t + 4)
// K = 5 instantiates the register path (modes are run-time constants per kernel) but never runs it: it uses mode 0
template <int K>
__host__ __device__ __forceinline__ void decode_reg(const uint32_t (&w)[5], const uint32_t (&tl)[4],
                                                    const uint32_t (&th)[4], uint32_t (&a)[16]) {
  uint32_t Q[4], m[4];
  reg_selectors<K>(w, Q, m);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    reg_group<K, 0>(Q[e], m[e], tl, th, a[2 * e], a[2 * e + 1]);
    reg_group<K, 1>(Q[e], m[e], tl, th, a[8 + 2 * e], a[8 + 2 * e + 1]);
  }
}

// the K packed words of one row-block (streamed: read once). WIDE5: K = 5 as two 8-byte loads and one 4-byte load
// (the M <= 8 main loop), else five 4-byte loads (the token-tile kernel measured up to 9% slower with the wide ones)
template <int K, bool WIDE5 = false>
__device__ __forceinline__ void load_words(const uint32_t* __restrict__ p, uint32_t (&w)[5]) {
  if constexpr (K == 4) {
    const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p));
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (K == 2) {
    const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else if constexpr (K == 5 && WIDE5) {
    // a 20-byte block starts 8-byte aligned or 4 bytes past that (the words are 4-byte aligned): two 8-byte loads
    // and one 4-byte load for either case, chosen per lane by the address, and the words put in order with selects.
    // Five 32-bit loads per block keep the L1 data pipe at 71% of its peak, the busiest unit of the K = 5 kernel.
    const bool a8 = (reinterpret_cast<uintptr_t>(p) & 7) == 0;
    const uint2 a = __ldcs(reinterpret_cast<const uint2*>(p + (a8 ? 0 : 1)));
    const uint2 b = __ldcs(reinterpret_cast<const uint2*>(p + (a8 ? 2 : 3)));
    const uint32_t c = __ldcs(p + (a8 ? 4 : 0));
    w[0] = a8 ? a.x : c; w[1] = a8 ? a.y : a.x; w[2] = a8 ? b.x : a.y; w[3] = a8 ? b.y : b.x; w[4] = a8 ? c : b.y;
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = __ldcs(p + j);
  }
}

// Packed words and scale of one row-block. CHECK: blocks at or past nb give zeros. ow / oa: the row's offset (words /
// scale elements) from the CTA's base pointers wb / ab; 32 bits suffice: 16 rows of at most 5 * 2^25 words.
template <int K, bool CHECK>
__device__ __forceinline__ void load_block(const uint32_t* __restrict__ wb, uint32_t ow, const void* __restrict__ ab,
                                           uint32_t oa, int fp16, int blk, int nb, uint32_t (&w)[5], uint32_t& sc) {
#pragma unroll
  for (int j = 0; j < 5; ++j) w[j] = 0u;
  sc = 0u;
  if (CHECK && blk >= nb) return;
  load_words<K>(wb + (ow + (uint32_t)blk * K), w);
  const uint32_t ia = oa + (uint32_t)blk;
  if (fp16) sc = __ldcs(reinterpret_cast<const unsigned short*>(ab) + ia);
  else sc = __ldcs(reinterpret_cast<const unsigned char*>(ab) + ia);
}

// N pairs of activations of one token from element c0 on: xw[i] = elements (c0 + 2i, c0 + 2i + 1) (N = 16: a whole
// block, 8: a half); on == false: zeros. CHECK: element-wise bounds (and any alignment), else 16-byte loads.
template <typename T, bool CHECK, int N>
__device__ __forceinline__ void load_x(const T* __restrict__ xr, bool on, int c0, int in, uint32_t (&xw)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) xw[i] = 0u;
  if (!on) return;
  if (!CHECK) {
    const uint4* p = reinterpret_cast<const uint4*>(xr + c0);
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = __ldg(p + i);
      xw[4 * i] = v.x; xw[4 * i + 1] = v.y; xw[4 * i + 2] = v.z; xw[4 * i + 3] = v.w;
    }
  } else {
    const unsigned short* xs = reinterpret_cast<const unsigned short*>(xr);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int c = c0 + 2 * i;
      const uint32_t lo = c < in ? xs[c] : 0u;
      const uint32_t hi = c + 1 < in ? xs[c + 1] : 0u;
      xw[i] = lo | (hi << 16);
    }
  }
}

struct Buf {
  uint32_t w[2][2][5];  // [owned block][row g / g+8][plane]
  uint32_t sc[2][2];
};

// HB: block offset of the second half (the MMA's rows 8..15): 0, or STEP when folded (see gemv_kernel)
template <int K, bool CHECK, int HB>
__device__ __forceinline__ void load_step(Buf& b, const uint32_t* __restrict__ wb, uint32_t ow0, uint32_t ow1,
                                          const void* __restrict__ ab, uint32_t oa0, uint32_t oa1, int fp16, int b0,
                                          int q, int nb) {
#pragma unroll
  for (int ob = 0; ob < 2; ++ob) {
    const int blk = b0 + q + 4 * ob;
    load_block<K, CHECK>(wb, ow0, ab, oa0, fp16, blk, nb, b.w[ob][0], b.sc[ob][0]);
    load_block<K, CHECK>(wb, ow1, ab, oa1, fp16, blk + HB, nb, b.w[ob][1], b.sc[ob][1]);
  }
}

// main-loop loads of one step (no bounds checks) through pointers that the loop advances: w0 / w1 point at the first
// owned block of the MMA's rows g / g + 8 (b0 + q of rows g / g + 8; FOLD: b0 + q / b0 + 8 + q of row g), a0 / a1 at
// its block scale (bytes; 2 per scale when fp16)
template <int K, bool WIDE5>
__device__ __forceinline__ void load_step_p(Buf& b, const uint32_t* __restrict__ w0, const uint32_t* __restrict__ w1,
                                            const unsigned char* __restrict__ a0,
                                            const unsigned char* __restrict__ a1, int fp16) {
#pragma unroll
  for (int ob = 0; ob < 2; ++ob) {
#pragma unroll
    for (int j = 0; j < 5; ++j) b.w[ob][0][j] = b.w[ob][1][j] = 0u;
    load_words<K, WIDE5>(w0 + 4 * K * ob, b.w[ob][0]);
    load_words<K, WIDE5>(w1 + 4 * K * ob, b.w[ob][1]);
    if (fp16) {
      b.sc[ob][0] = __ldcs(reinterpret_cast<const unsigned short*>(a0) + 4 * ob);
      b.sc[ob][1] = __ldcs(reinterpret_cast<const unsigned short*>(a1) + 4 * ob);
    } else {
      b.sc[ob][0] = __ldcs(a0 + 4 * ob);
      b.sc[ob][1] = __ldcs(a1 + 4 * ob);
    }
  }
}

// xq (main loop only, !CHECK): the activations of block b0 + q of the lane's token (b0 includes FOLD's block offset
// xb); CHECK: xr (row of that token) and blk
template <int K, typename T, bool CHECK, int MODE>
__device__ __forceinline__ void compute_step(const Buf& b, const T* __restrict__ xr, const T* __restrict__ xq, bool xon,
                                             int fp16, int b0, int q, int nb, int in, uint32_t c4, const char* tb,
                                             const uint32_t (&tl)[4], const uint32_t (&th)[4], float (&acc)[4]) {
#pragma unroll
  for (int ob = 0; ob < 2; ++ob) {
    const int blk = b0 + q + 4 * ob;
    uint32_t xw[16];
    if constexpr (CHECK) load_x<T, true>(xr, xon && blk < nb, blk * BLOCK, in, xw);
    else load_x<T, false>(xq, xon, 4 * ob * BLOCK, in, xw);
    uint32_t ag[16], ah[16];
    if (MODE == 1 || (MODE == 2 && ob == 0)) {  // constant after unrolling
      // weights come as pairs (e, e + 4) (see decode_reg): pair the activations the same way
      // selectors first, then each group is looked up right before its MMA (fewer live registers)
      uint32_t Qg[4], mg[4], Qh[4], mh[4];
      reg_selectors<K>(b.w[ob][0], Qg, mg);
      reg_selectors<K>(b.w[ob][1], Qh, mh);
      const uint32_t dg = scale_pair<T>(b.sc[ob][0], fp16), dh = scale_pair<T>(b.sc[ob][1], fp16);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i0 = 8 * h + (e >> 1);
          const uint32_t sel = (e & 1) ? 0x7632u : 0x5410u;
          const uint32_t x0 = prmt(xw[i0], xw[i0 + 2], sel), x1 = prmt(xw[i0 + 4], xw[i0 + 6], sel);
          uint32_t g0, g1, h0, h1;
          reg_group_rows<K>(h, Qg[e], mg[e], Qh[e], mh[e], tl, th, g0, g1, h0, h1);
          Mma<T>::run(acc, Mma<T>::mul2(g0, dg), Mma<T>::mul2(h0, dh), Mma<T>::mul2(g1, dg), Mma<T>::mul2(h1, dh),
                      x0, x1);
        }
    } else {
      decode_block<K, T>(b.w[ob][0], scale_pair<T>(b.sc[ob][0], fp16), c4, tb, ag);
      decode_block<K, T>(b.w[ob][1], scale_pair<T>(b.sc[ob][1], fp16), c4, tb, ah);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const int lo = 8 * h + s, hi = lo + 4;
          Mma<T>::run(acc, ag[lo], ah[lo], ag[hi], ah[hi], xw[lo], xw[hi]);
        }
    }
  }
}

// ---- activations of one step in shared memory (NT > 1) ----
// A step's activations (8 blocks = 512 bytes per token) are copied once per row-group set (the RW warps of one k
// split share them) with cp.async into a stage of 8 * NT token rows of XS_TOKEN bytes. 16-byte chunk c of a token
// row (elements 8c .. 8c + 7; block c / 4) sits at chunk xs_chunk(c): swapping the halves of blocks 2, 3 (mod 4) and
// the 16-byte token offset make the reads conflict-free (lanes g, g + 1 and q = 0..3 of a quarter warp read the
// same chunk of blocks q + 4 ob: 8 distinct 16-byte bank groups).
constexpr int XS_TOKEN = 528;  // 512 + 16
__device__ __forceinline__ int xs_chunk(int c) { return c ^ ((c >> 2) & 2); }

// stage the activations of tokens < M, columns 256 st .. 256 st + 255 (all inside the row, x 16-byte aligned)
// (srow: the tokens' rows of x in grouped expert mode, else token t is row t)
template <typename T, int NT>
__device__ __forceinline__ void stage_x(unsigned char* xsm, const T* __restrict__ x, int64_t in, int M, int st,
                                        int gl, int gn, const int* srow) {
  for (int i = gl; i < 32 * M; i += gn) {
    const int t = i >> 5, c = i & 31;
    const int64_t r = srow ? srow[t] : t;
    cp_async16(xsm + t * XS_TOKEN + xs_chunk(c) * 16, x + r * in + (int64_t)st * (STEP * BLOCK) + 8 * c);
  }
}

// NT > 1 (M = 9..64): one step of NT token tiles. Each half of an owned row-block (16 elements) is decoded once and
// feeds NT MMAs, one per tile of 8 tokens: through the pair table (MODE 0, and the second owned block in MODE 2;
// natural pair order) or group by group in registers (MODE 1, the first block in MODE 2; pairs (e, e + 4), so the
// activations are paired by PRMT per token tile, as in compute_step). Lane (g, q) reads the 16 activations of tokens
// g, g + 8, ... from the staged step xsm (main loop) or loads them (CHECK: xr = row 0 of x; tokens
// >= M: zeros; srow as in stage_x).
template <int K, typename T, bool CHECK, int NT, int MODE>
__device__ __forceinline__ void compute_step_nt(const Buf& b, const T* __restrict__ xr, const int* srow,
                                                const unsigned char* xsm,
                                                int M, int g, int fp16, int b0, int q, int nb, int in,
                                                uint32_t c4, const char* tb, const uint32_t (&tl)[4],
                                                const uint32_t (&th)[4], float (&acc)[NT][4]) {
#pragma unroll
  for (int ob = 0; ob < 2; ++ob) {
    const int blk = b0 + q + 4 * ob;
    const uint32_t dg = scale_pair<T>(b.sc[ob][0], fp16), dh = scale_pair<T>(b.sc[ob][1], fp16);
    const bool reg = MODE == 1 || (MODE == 2 && ob == 0);  // constant after unrolling, as in compute_step
    uint32_t Qg[4], mg[4], Qh[4], mh[4];
    if (reg) {
      reg_selectors<K>(b.w[ob][0], Qg, mg);
      reg_selectors<K>(b.w[ob][1], Qh, mh);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // the 16 activations of half h of token tile nt: xw[i] = elements (16h + 2i, 16h + 2i + 1)
      auto half_x = [&](int nt, uint32_t(&xw)[8]) {
        if constexpr (CHECK) {
          const int t = 8 * nt + g;
          const int64_t r = t < M ? (srow ? srow[t] : t) : 0;
          load_x<T, true>(xr + r * in, t < M && blk < nb, blk * BLOCK + 16 * h, in, xw);
        } else {  // the step's activations in shared memory (see stage_x): two conflict-free 16-byte reads
          const unsigned char* t = xsm + (8 * nt + g) * XS_TOKEN;
          const int c = 4 * (q + 4 * ob) + 2 * h;
          const uint4 u0 = *reinterpret_cast<const uint4*>(t + xs_chunk(c) * 16);
          const uint4 u1 = *reinterpret_cast<const uint4*>(t + xs_chunk(c + 1) * 16);
          xw[0] = u0.x; xw[1] = u0.y; xw[2] = u0.z; xw[3] = u0.w;
          xw[4] = u1.x; xw[5] = u1.y; xw[6] = u1.z; xw[7] = u1.w;
        }
      };
      if (reg) {
        // register decode: group e gives the pairs (e, e + 4), (e + 8, e + 12) of half h; the activations of every
        // token tile are paired the same way with one PRMT per pair
        uint32_t xw[NT][8];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) half_x(nt, xw[nt]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          uint32_t g0, g1, h0, h1;
          reg_group_rows<K>(h, Qg[e], mg[e], Qh[e], mh[e], tl, th, g0, g1, h0, h1);
          g0 = Mma<T>::mul2(g0, dg); g1 = Mma<T>::mul2(g1, dg);
          h0 = Mma<T>::mul2(h0, dh); h1 = Mma<T>::mul2(h1, dh);
          const int i0 = e >> 1;
          const uint32_t sel = (e & 1) ? 0x7632u : 0x5410u;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
            Mma<T>::run(acc[nt], g0, h0, g1, h1, prmt(xw[nt][i0], xw[nt][i0 + 2], sel),
                        prmt(xw[nt][i0 + 4], xw[nt][i0 + 6], sel));
        }
      } else {
        uint32_t ag[16], ah[16];
        if (h == 0) {
          decode_block<K, T, 0>(b.w[ob][0], dg, c4, tb, ag);
          decode_block<K, T, 0>(b.w[ob][1], dh, c4, tb, ah);
        } else {
          decode_block<K, T, 1>(b.w[ob][0], dg, c4, tb, ag);
          decode_block<K, T, 1>(b.w[ob][1], dh, c4, tb, ah);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint32_t xw[8];
          half_x(nt, xw);
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            const int lo = 8 * h + s, hi = lo + 4;
            Mma<T>::run(acc[nt], ag[lo], ah[lo], ag[hi], ah[hi], xw[s], xw[s + 4]);
          }
        }
      }
    }
  }
}

// Which expert weight and rows a CTA works on. Dense: none (E = 1). Per-row (ids): row blockIdx.y of x and y with
// expert ids[blockIdx.y], M == 1. Grouped (order): the rows sorted by expert (expert_route_kernel); blockIdx.y is a
// work item of at most M (the launch's) rows of one expert (find_item).
struct ExpertRows {
  const int64_t* ids;
  const int* order;    // [N] rows, bucket by bucket
  const int* offsets;  // [E + 2]: bucket b holds order[offsets[b] .. offsets[b + 1]); bucket E: ids outside [0, E)
  int64_t E;
  // fused MoE experts (template FUSE): rows per token (row n is token n / top_k), the routing weights [T, top_k]
  // (activation dtype; FUSE_SUM), the gating (FUSE_GATE: KBIT_GATE_SILU or KBIT_GATE_CLAMPED) and its constants
  int top_k = 1;
  const void* coef = nullptr;
  int gate = 0;
  float alpha = 0.f, limit = 0.f;
};

// gemv_kernel's FUSE modes (per-row expert mode, M = 1): none; FUSE_GATE: the gate and up rows of output j are the
// MMA's rows g and g + 8 of a tile of 8 outputs, and the epilogue writes the gated activation; FUSE_SUM: a CTA row is
// a token, whose top_k rows the warps walk as one long row, each step weighted by its row's routing weight.
constexpr int FUSE_GATE = 1, FUSE_SUM = 2;

__device__ __forceinline__ int expert_bucket(int64_t id, int E) { return id >= 0 && id < E ? (int)id : E; }

// Counting sort of N rows by expert, for the grouped mode: one CTA of 1024 threads, the bucket counts in shared memory
// ([E + 1] ints). Inside a bucket the rows come in no particular order: a row's result does not depend on the rows
// that share its CTA (MMA columns are independent; the k-split sums run in a fixed order).
__global__ void __launch_bounds__(1024) expert_route_kernel(const int64_t* __restrict__ ids, int N, int E,
                                                            int* __restrict__ order, int* __restrict__ offsets) {
  extern __shared__ int cursor[];
  __shared__ int wsum[32];
  __shared__ int carry;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5;
  for (int b = tid; b <= E; b += nt) cursor[b] = 0;
  if (tid == 0) carry = 0;
  __syncthreads();
  for (int i = tid; i < N; i += nt) atomicAdd(&cursor[expert_bucket(ids[i], E)], 1);
  __syncthreads();
  // exclusive scan of the counts, nt buckets at a time: the cursors start at the offsets
  for (int b0 = 0; b0 <= E; b0 += nt) {
    const int b = b0 + tid;
    const int v = b <= E ? cursor[b] : 0;
    int s = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int t = __shfl_up_sync(0xFFFFFFFFu, s, d);
      if (lane >= d) s += t;
    }
    if (lane == 31) wsum[warp] = s;
    __syncthreads();
    if (warp == 0) {
      int t = lane < (nt >> 5) ? wsum[lane] : 0;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(0xFFFFFFFFu, t, d);
        if (lane >= d) t += u;
      }
      wsum[lane] = t;
    }
    __syncthreads();
    const int excl = carry + (warp ? wsum[warp - 1] : 0) + s - v;
    if (b <= E) {
      cursor[b] = excl;
      offsets[b] = excl;
    }
    __syncthreads();
    if (tid == nt - 1) carry = excl + v;
    __syncthreads();
  }
  if (tid == 0) offsets[E + 1] = N;
  for (int i = tid; i < N; i += nt) order[atomicAdd(&cursor[expert_bucket(ids[i], E)], 1)] = i;
}

// x rows: x + m * in (m < M), y rows y + m * out; expert modes: ExpertRows.
// NREG: register cap (gemv_max_regs; 128 = 2 CTAs of 8 warps or 4 of 4 warps per SM)
// NT: token tiles of 8 (M <= 8 * NT). The CTA is blockDim.y row groups (16 rows each: tile
// blockIdx.x * blockDim.y + threadIdx.y) x blockDim.x / 32 warps splitting the input dimension. With NT > 1 the row
// groups of one split walk the same steps and share each step's activations through shared memory (stage_x): every
// row tile needs all M tokens' activations, so more rows per CTA means less activation traffic.
// FOLD (NT = 1, M <= 4): a CTA owns 8 output rows, a step is 16 blocks, and the MMA's rows 8..15 hold the second
// 8 blocks of the step of the same rows 0..7: lane 4g + q owns blocks b0 + q, b0 + 4 + q ("row g") and b0 + 8 + q,
// b0 + 12 + q ("row g + 8") of row g. The B operand holds token t's activations of the first 8 blocks in column t
// and of the second 8 in column 4 + t, so D[g][t] + D[g + 8][4 + t] is row g's sum. Same decode, same bytes per
// lane, 256-byte runs per row and step instead of 128, twice the CTAs: faster only where the 16-row grid leaves SMs
// idle (gemv_fold).
template <int K, typename T, int MODE, int NREG, int NT, bool FOLD = false, bool ROWMAP = false, int FUSE = 0>
__global__ void __launch_bounds__(MAX_WARPS * 32) __maxnreg__(NREG) gemv_kernel(
    const T* __restrict__ x, int M, const uint32_t* __restrict__ packed, const void* __restrict__ absmax, int fp16,
    const float* __restrict__ scale, const float* __restrict__ codebook, const T* __restrict__ bias,
    T* __restrict__ y, int64_t out, int in, int nb, ExpertRows er, int vec) {
  using C = Cfg<K>;
  // pair table (modes 0, 2) and the cross-warp reduction; with NT > 1 the reduction reuses the table's space
  constexpr int TBL_WORDS = MODE == 1 ? 4 : C::WORDS;
  constexpr int RED_WORDS = MAX_WARPS * 4 * NT * 32;
  __shared__ __align__(16) uint32_t smem[NT > 1 ? (TBL_WORDS > RED_WORDS ? TBL_WORDS : RED_WORDS)
                                                : TBL_WORDS + RED_WORDS];
  uint32_t* tbl = smem;
  float* red = reinterpret_cast<float*>(NT > 1 ? smem : smem + TBL_WORDS);  // [warp][4 * NT][32]
  const int lane = threadIdx.x & 31, W = blockDim.x >> 5;
  const int warp = threadIdx.x >> 5;                          // k split
  const int cw = threadIdx.y * W + warp;                      // warp in the CTA
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  static_assert(!FOLD || NT == 1, "folded tiles are for M <= 4");
  static_assert(FUSE == 0 || (NT == 1 && !FOLD && !ROWMAP), "the fused modes are per-row modes");
  constexpr int TR = FOLD || FUSE == FUSE_GATE ? 8 : TILE;  // output rows (FUSE_GATE: outputs j) per row group
  constexpr int SB = FOLD ? 2 * STEP : STEP;  // blocks per step
  constexpr int HB = FOLD ? STEP : 0;         // block offset of the MMA's rows 8..15
  const int64_t o0 = ((int64_t)blockIdx.x * blockDim.y + threadIdx.y) * TR;
  int64_t e = 0;
  const T* xr = x;
  T* yr = y;
  // ROWMAP (grouped expert mode): token t of this CTA is row srow[t] of x and y; a compile-time choice, since the
  // row map's indirection cost the dense kernels up to 20% at 16-64 tokens
  __shared__ int srows[ROWMAP ? 8 * NT : 1];
  const int* const srow = ROWMAP ? srows : nullptr;
  if constexpr (ROWMAP) {
    __shared__ int item[3];
    if (tid < 32) find_item(er.offsets, (int)er.E + 1, M, (int)blockIdx.y, tid, item);
    __syncthreads();
    M = item[2];
    if (M <= 0) return;  // past the last work item
    for (int t = tid; t < M; t += nthreads) srows[t] = er.order[item[1] + t];
    __syncthreads();
    if (item[0] == er.E) {  // ids outside [0, E): zero rows
      for (int i = threadIdx.x; i < M * TR; i += blockDim.x)
        if (o0 + i % TR < out) y[(int64_t)srow[i / TR] * out + o0 + i % TR] = Cvt<T>::from_f(0.f);
      return;
    }
    e = item[0];
  } else if (FUSE == FUSE_SUM) {
    yr = y + (int64_t)blockIdx.y * out;  // token blockIdx.y: its rows' experts are looked up per step
  } else if (er.ids != nullptr) {
    const int64_t n = blockIdx.y;
    const int64_t id = er.ids[n];
    const int64_t yw = FUSE == FUSE_GATE ? out / 2 : out;
    yr = y + n * yw;
    if (id < 0 || id >= er.E) {  // whole CTA: zero rows
      if (threadIdx.x < TR && o0 + threadIdx.x < yw) yr[o0 + threadIdx.x] = Cvt<T>::from_f(0.f);
      return;
    }
    e = id;
    xr = x + (FUSE == FUSE_GATE ? n / er.top_k : n) * (int64_t)in;
  }
  const int g = lane >> 2, q = lane & 3;
  const uint32_t c4 = (uint32_t)(lane & (C::R - 1)) * 4u;
  const char* tb = reinterpret_cast<const char*>(tbl);
  // rows g and g + 8 of the tile, clamped into the matrix (rows past `out` compute garbage that is never written),
  // as 32-bit offsets from the first row read (the tile's first row, or the last row of the matrix for a row group
  // wholly past it)
  // (FUSE_GATE: offsets from the expert's first row, to the gate and up rows of output j = o0 + g, clamped)
  int64_t orow;
  uint32_t d0, d1;
  if constexpr (FUSE == FUSE_GATE) {
    const int64_t I = out >> 1, j = o0 + g < I ? o0 + g : I - 1;
    orow = 0;
    d0 = (uint32_t)(er.gate == KBIT_GATE_SILU ? j : 2 * j);
    d1 = (uint32_t)(er.gate == KBIT_GATE_SILU ? I + j : 2 * j + 1);
  } else {
    orow = o0 < out ? o0 : out - 1;
    d0 = (uint32_t)((o0 + g < out ? o0 + g : out - 1) - orow);
    d1 = FOLD ? d0 : (uint32_t)((o0 + g + 8 < out ? o0 + g + 8 : out - 1) - orow);
  }
  const int64_t rb = e * out + orow;
  const int64_t rw = (int64_t)nb * K;
  const uint32_t* __restrict__ wb = packed + rb * rw;
  const uint32_t ow0 = d0 * (uint32_t)rw, ow1 = d1 * (uint32_t)rw;
  const int as = fp16 ? 2 : 1;
  const void* ab = reinterpret_cast<const char*>(absmax) + rb * nb * as;
  const uint32_t oa0 = d0 * (uint32_t)nb, oa1 = d1 * (uint32_t)nb;
  // B column g: token g (FOLD: token g % 4, of the step's blocks 8 * (g / 4) ..)
  const int tok = FOLD ? (g & 3) : g, xb = FOLD ? (g >> 2) * STEP : 0;
  const bool xon = tok < M;
  const T* xg = xr + (int64_t)(xon ? (srow ? srow[tok] : tok) : 0) * in;

  // full steps: SB blocks whose 32 columns all lie inside the row (x 16-byte aligned); the first step's loads are
  // issued before the pair table is built
  const int nfs = vec && FUSE != FUSE_SUM ? (in / BLOCK) / SB : 0;
  int st = warp;
  Buf cur;
  // FUSE_SUM: step s is step s % spe of the token's row n0 + s / spe, whose expert's tile starts ew words / ea scale
  // bytes after expert 0's (ids outside [0, E) read expert 0 with weight 0)
  const int spe = (nb + SB - 1) / SB, total = er.top_k * spe;
  const int64_t n0 = (int64_t)blockIdx.y * er.top_k, ew = out * rw, ea = out * (int64_t)nb * as;
  const auto load_sum = [&](Buf& b, int s) {
    const int64_t id = er.ids[n0 + s / spe], ec = id >= 0 && id < er.E ? id : 0;
    load_step<K, true, 0>(b, wb + ec * ew, ow0, ow1, reinterpret_cast<const char*>(ab) + ec * ea, oa0, oa1, fp16,
                          (s % spe) * SB, q, nb);
  };
  if (FUSE == FUSE_SUM && st < total) load_sum(cur, st);
  // main-loop pointers, at step st's first owned block
  const int64_t boff = (int64_t)st * SB + q;
  const uint32_t* __restrict__ pw0 = wb + ow0 + boff * K;
  const uint32_t* __restrict__ pw1 = wb + ow1 + (boff + HB) * K;
  const unsigned char* __restrict__ pa0 = reinterpret_cast<const unsigned char*>(ab) + ((int64_t)oa0 + boff) * as;
  const unsigned char* __restrict__ pa1 =
      reinterpret_cast<const unsigned char*>(ab) + ((int64_t)oa1 + boff + HB) * as;
  const T* __restrict__ xq = xg + (boff + xb) * BLOCK;
  const int64_t dw = (int64_t)W * SB * K, da = (int64_t)W * SB * as, dx = (int64_t)W * SB * BLOCK;
  if (st < nfs) {
    load_step_p<K, NT == 1>(cur, pw0, pw1, pa0, pa1, fp16);
    pw0 += dw; pw1 += dw; pa0 += da; pa1 += da;
  }
  // NT > 1: two activation stages per k split ([W][2][8 * NT][XS_TOKEN] bytes of dynamic shared memory), shared by
  // the blockDim.y warps of that split (gl / gn: this thread's index / the thread count in the split)
  extern __shared__ __align__(16) unsigned char xstage[];
  constexpr int XS_STAGE = 8 * NT * XS_TOKEN;
  unsigned char* xs0 = xstage + (size_t)warp * 2 * XS_STAGE;
  const int gl = threadIdx.y * 32 + lane, gn = 32 * blockDim.y;
  if constexpr (NT > 1) {
    // token rows >= M are never staged: zero them once in both stages, so the MMA columns of absent tokens read 0
    const int nz = (8 * NT - M) * (XS_TOKEN / 16);
    for (int i = gl; i < 2 * nz; i += gn) {
      const int s = i / nz, r = i % nz;
      *reinterpret_cast<uint4*>(xs0 + s * XS_STAGE + M * XS_TOKEN + r * 16) = make_uint4(0u, 0u, 0u, 0u);
    }
    if (st < nfs) stage_x<T, NT>(xs0, xr, in, M, st, gl, gn, srow);
    cp_async_commit();
  }
  uint32_t tl[4] = {0u, 0u, 0u, 0u}, th[4] = {0u, 0u, 0u, 0u};
  if constexpr (MODE != 0) {
    // codebook (times PRE, in the activation dtype) as byte planes in registers: tl[n] / th[n] byte b = low / high
    // byte of entry 4n + b
#pragma unroll
    for (int i = 0; i < (1 << K); ++i) {
      const uint32_t v = Mma<T>::pack(__ldg(codebook + i) * Mma<T>::PRE, 0.f) & 0xFFFFu;
      tl[i >> 2] |= (v & 0xFFu) << (8 * (i & 3));
      th[i >> 2] |= (v >> 8) << (8 * (i & 3));
    }
  }
  if constexpr (MODE != 1) {
    // pair table: entry P holds (cb[i0], cb[i1]) * PRE, i0 / i1 = the even / odd bits of P, in R replicas
    for (int p = tid; p < C::NP; p += nthreads) {
      const uint32_t v = pair_entry<T, K>(codebook, p);
      if constexpr (C::R >= 4) {
#pragma unroll
        for (int r = 0; r < C::R; r += 4) *reinterpret_cast<uint4*>(&tbl[p * C::R + r]) = make_uint4(v, v, v, v);
      } else {
#pragma unroll
        for (int r = 0; r < C::R; ++r) tbl[p * C::R + r] = v;
      }
    }
    __syncthreads();
  }
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  if (st < nfs) {
    int it = 0;
#pragma unroll 1
    for (; st < nfs; st += W, ++it) {
      Buf nxt;
      if (st + W < nfs) {
        load_step_p<K, NT == 1>(nxt, pw0, pw1, pa0, pa1, fp16);
        pw0 += dw; pw1 += dw; pa0 += da; pa1 += da;
      }
      if constexpr (NT == 1) {
        compute_step<K, T, false, MODE>(cur, xg, xq, xon, fp16, st * SB + xb, q, nb, in, c4, tb, tl, th, acc[0]);
        xq += dx;
      } else {
        // stage the next step's activations into the other buffer (its readers passed the barrier at the end of the
        // previous step), wait for this step's, compute, and let the split's warps finish reading before the restage
        if (st + W < nfs) stage_x<T, NT>(xs0 + ((it + 1) & 1) * XS_STAGE, xr, in, M, st + W, gl, gn, srow);
        cp_async_commit();
        cp_async_wait<1>();
        bar_group(1 + warp, gn);  // the n threads of one k split (ids 1..8)
        compute_step_nt<K, T, false, NT, MODE>(cur, xr, srow, xs0 + (it & 1) * XS_STAGE, M, g, fp16, st * STEP, q, nb,
                                               in, c4, tb, tl, th, acc);
        bar_group(1 + warp, gn);
      }
      cur = nxt;
    }
  }
  if constexpr (FUSE == FUSE_SUM) {
    // the token's top_k rows as one long row, one step loaded ahead; each step's products enter the sum times its
    // row's routing weight and its expert's scale
#pragma unroll 1
    for (; st < total; st += W) {
      Buf nxt;
      if (st + W < total) load_sum(nxt, st + W);
      const int64_t n = n0 + st / spe, id = er.ids[n];
      const int b0 = (st % spe) * SB;
      const T* xn = x + n * (int64_t)in;
      float part[4] = {0.f, 0.f, 0.f, 0.f};
      if (vec && (b0 + SB) * BLOCK <= in)  // all 32 columns of the step's blocks inside the row
        compute_step<K, T, false, MODE>(cur, xn, xn + (int64_t)(b0 + q) * BLOCK, xon, fp16, b0, q, nb, in, c4, tb, tl,
                                        th, part);
      else
        compute_step<K, T, true, MODE>(cur, xn, xn, xon, fp16, b0, q, nb, in, c4, tb, tl, th, part);
      const float c =
          id >= 0 && id < er.E ? Cvt<T>::to_f(reinterpret_cast<const T*>(er.coef)[n]) * scale[id] : 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[0][i] += c * part[i];
      cur = nxt;
    }
  }
  // the remaining blocks (fewer than SB, or all of them when x is not vector-loadable): checked, strided over warps
  for (int s2 = nfs + warp; FUSE != FUSE_SUM && s2 * SB < nb; s2 += W) {
    Buf tb2;
    load_step<K, true, HB>(tb2, wb, ow0, ow1, ab, oa0, oa1, fp16, s2 * SB, q, nb);
    if constexpr (NT == 1)
      compute_step<K, T, true, MODE>(tb2, xg, xg, xon, fp16, s2 * SB + xb, q, nb, in, c4, tb, tl, th, acc[0]);
    else
      compute_step_nt<K, T, true, NT, MODE>(tb2, xr, srow, nullptr, M, g, fp16, s2 * STEP, q, nb, in, c4, tb, tl, th,
                                            acc);
  }

  // reduce the W k-split warps' tiles in a fixed order (NT > 1: the table's space, once every warp is done with it)
  if constexpr (NT > 1) __syncthreads();
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) red[(cw * 4 * NT + 4 * nt + i) * 32 + lane] = acc[nt][i];
  __syncthreads();
  if (warp != 0) return;
  const int cw0 = threadIdx.y * W;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float v = red[(cw0 * 4 * NT + 4 * nt + i) * 32 + lane];
      for (int w2 = 1; w2 < W; ++w2) v += red[((cw0 + w2) * 4 * NT + 4 * nt + i) * 32 + lane];
      acc[nt][i] = v;
    }
  // FOLD: row g's sum for token 2q + i is D[g][2q + i] (here, acc[i]) + D[g + 8][4 + 2q + i] (lane (g, q + 2)'s
  // acc[2 + i]); only lanes q < 2 and i < 2 store
  if constexpr (FOLD) {
#pragma unroll
    for (int i = 0; i < 2; ++i) acc[0][i] += __shfl_down_sync(0xFFFFFFFFu, acc[0][2 + i], 2);
  }
  if constexpr (FUSE == FUSE_GATE) {
    // lane (g, 0) holds token 0's gate (row g) and up (row g + 8) sums of output j
    const int64_t j = o0 + g;
    if (q != 0 || j >= out / 2) return;
    const float sc = scale[e] * Mma<T>::POST;
    float gt = acc[0][0] * sc, u = acc[0][2] * sc;
    if (bias != nullptr) {
      gt += Cvt<T>::to_f(bias[e * out + d0]);
      u += Cvt<T>::to_f(bias[e * out + d1]);
    }
    float h;
    if (er.gate == KBIT_GATE_SILU) {
      h = gt / (1.f + __expf(-gt)) * u;
    } else {
      gt = fminf(gt, er.limit);
      u = fminf(fmaxf(u, -er.limit), er.limit);
      h = (u + 1.f) * (gt / (1.f + __expf(-er.alpha * gt)));
    }
    yr[j] = Cvt<T>::from_f(h);
    return;
  }
  if constexpr (FUSE == FUSE_SUM) {
    // token 0 (the CTA's token) is column 0: lanes (g, 0), rows g and g + 8; the biases enter times the weights
    if (q != 0) return;
#pragma unroll
    for (int i = 0; i < 4; i += 2) {
      const int64_t o = o0 + g + 8 * (i >> 1);
      if (o >= out) continue;
      float v = acc[0][i] * Mma<T>::POST;
      if (bias != nullptr)
        for (int kk = 0; kk < er.top_k; ++kk) {
          const int64_t id = er.ids[n0 + kk];
          if (id >= 0 && id < er.E)
            v += Cvt<T>::to_f(reinterpret_cast<const T*>(er.coef)[n0 + kk]) * Cvt<T>::to_f(bias[id * out + o]);
        }
      yr[o] = Cvt<T>::from_f(v);
    }
    return;
  }
  const float sc = scale[e] * Mma<T>::POST;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < (FOLD ? 2 : 4); ++i) {
      const int m = 8 * nt + 2 * q + (i & 1);
      const int64_t o = o0 + g + 8 * (i >> 1);
      if ((!FOLD || q < 2) && m < M && o < out) {
        float v = acc[nt][i] * sc;
        if (bias != nullptr) v += Cvt<T>::to_f(bias[o]);
        yr[(int64_t)(srow ? srow[m] : m) * out + o] = Cvt<T>::from_f(v);
      }
    }
}

// M = 9..64 (grouped mode: items of at most 8 NT rows): NT token tiles in CTAs of RW row groups x KW k-split warps
// (gemv_token_cta, for `items` CTA rows of which about `busy` have work), in the decode mode and register cap of
// gemv_decode_mode and gemv_max_regs.
template <int K, typename T, int NT>
int launch_nt(int64_t M, const void* x, const uint32_t* packed, const void* absmax, int fp16, const float* scale,
              const float* cb, int64_t out, int64_t in, int64_t nb, int vec, const void* bias, void* y,
              int64_t items, int64_t busy, ExpertRows er, cudaStream_t st) {
  int dev = 0, sms = 0;
  if (!current_device_sms(dev, sms)) return (int)cudaErrorInvalidDevice;
  const GemvTokenCta cta = gemv_token_cta(out, NT, busy, sms);
  const int RW = cta.rw, KW = cta.kw;
  const int64_t tiles = (out + TILE * RW - 1) / (TILE * RW);
  if (tiles > 0x7FFFFFFF || items > 65535) return (int)cudaErrorInvalidConfiguration;
  constexpr int kMode = gemv_decode_mode(K, NT), kRegs = gemv_max_regs(NT);
  const auto dense = gemv_kernel<K, T, kMode, kRegs, NT>, grouped = gemv_kernel<K, T, kMode, kRegs, NT, false, true>;
  const auto kern = er.order != nullptr ? grouped : dense;
  // activation stages: 2 per k split, 33 KB per split at NT = 4; the opt-in limit (the largest, KW * NT =
  // GEMV_MAX_KW_NT) is set once per device
  const int dyn = KW * 2 * 8 * NT * XS_TOKEN;
  constexpr int kMaxDyn = GEMV_MAX_KW_NT * 2 * 8 * XS_TOKEN;  // 132 KB
  static bool attr_set[64] = {};
  if (!attr_set[dev]) {
    for (const auto k : {dense, grouped}) {
      const cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDyn);
      if (e != cudaSuccess) return (int)e;
    }
    attr_set[dev] = true;
  }
  kern<<<dim3((unsigned)tiles, (unsigned)items), dim3(KW * 32, RW), dyn, st>>>(
      reinterpret_cast<const T*>(x), (int)M, packed, absmax, fp16, scale, cb, reinterpret_cast<const T*>(bias),
      reinterpret_cast<T*>(y), out, (int)in, (int)nb, er, vec);
  return (int)cudaGetLastError();
}

// M <= 8 rows (per-row expert mode: one row per CTA row, `items` = N; grouped: items of at most 8 rows), 16- or
// folded 8-row tiles; expert rows of few steps in CTAs of several row groups (gemv_expert_short_rows)
template <int K, typename T>
int launch_m8(int64_t M, const void* x, const uint32_t* packed, const void* absmax, int fp16, const float* scale,
              const float* cb, int64_t out, int64_t in, int64_t nb, int vec, const void* bias, void* y,
              int64_t items, int64_t busy, ExpertRows er, cudaStream_t st) {
  int dev = 0, sms = 0;
  if (!current_device_sms(dev, sms)) return (int)cudaErrorInvalidDevice;
  const bool expert = er.ids != nullptr || er.order != nullptr;
  const bool short_rows = expert && gemv_expert_short_rows(nb);
  const int RW = short_rows ? GEMV_EXPERT_SHORT_ROW_GROUPS : 1;  // row groups per CTA
  const bool fold = er.order == nullptr && !short_rows && gemv_fold(K, M, in, ((out + TILE - 1) / TILE) * busy, sms);
  const int tr = fold ? 8 : TILE;
  const int64_t tiles = (out + tr * RW - 1) / (tr * RW);
  if (items > 65535 || tiles > 0x7FFFFFFF) return (int)cudaErrorInvalidConfiguration;
  const int W = short_rows ? 1 : gemv_warps(fold, tiles * busy, nb, sms);
  constexpr int kMode = gemv_decode_mode(K, 1), kRegs = gemv_max_regs(1);
  const auto kern = fold ? gemv_kernel<K, T, kMode, kRegs, 1, true>
                    : er.order != nullptr ? gemv_kernel<K, T, kMode, kRegs, 1, false, true>
                                          : gemv_kernel<K, T, kMode, kRegs, 1>;
  kern<<<dim3((unsigned)tiles, (unsigned)items), dim3(W * 32, RW), 0, st>>>(
      reinterpret_cast<const T*>(x), (int)M, packed, absmax, fp16, scale, cb, reinterpret_cast<const T*>(bias),
      reinterpret_cast<T*>(y), out, (int)in, (int)nb, er, vec);
  return (int)cudaGetLastError();
}

template <int K, typename T>
int launch_rows(int64_t M, const void* x, const uint32_t* packed, const void* absmax, int fp16, const float* scale,
                const float* cb, int64_t out, int64_t in, int64_t nb, int vec, const void* bias, void* y,
                int64_t items, int64_t busy, ExpertRows er, cudaStream_t st) {
  switch (token_tiles(M)) {
    case 8: return launch_nt<K, T, 8>(M, x, packed, absmax, fp16, scale, cb, out, in, nb, vec, bias, y, items, busy, er, st);
    case 4: return launch_nt<K, T, 4>(M, x, packed, absmax, fp16, scale, cb, out, in, nb, vec, bias, y, items, busy, er, st);
    case 2: return launch_nt<K, T, 2>(M, x, packed, absmax, fp16, scale, cb, out, in, nb, vec, bias, y, items, busy, er, st);
    default: return launch_m8<K, T>(M, x, packed, absmax, fp16, scale, cb, out, in, nb, vec, bias, y, items, busy, er, st);
  }
}

// Fused MoE experts at few rows (kbit_moe_gate_up / kbit_moe_down): FUSE_GATE: a CTA row per expert row, tiles of 8
// outputs (8 gate and 8 up weight rows); FUSE_SUM: a CTA row per token, 16-row tiles. CTA shapes: kbit_dispatch.h.
template <int K, typename T, int FUSE>
int launch_moe(const void* x, int64_t rows, const uint32_t* packed, const void* absmax, int fp16, const float* scale,
               const float* cb, int64_t out, int64_t in, const void* bias, void* y, const ExpertRows& er,
               cudaStream_t st) {
  int dev = 0, sms = 0;
  if (!current_device_sms(dev, sms)) return (int)cudaErrorInvalidDevice;
  const int64_t nb = (in + 31) / 32;
  // 32-bit word offsets inside an expert: its gate and up rows lie up to `out` rows apart
  if (in > (int64_t)1 << 30 || rows > 65535 || out * nb * K >= ((int64_t)1 << 32))
    return (int)cudaErrorInvalidConfiguration;
  const int vec = (in % 8 == 0) && ((reinterpret_cast<uintptr_t>(x) & 15) == 0);
  // FUSE_SUM's steps (top_k rows of ceil(nb / STEP) steps each) are counted in an int
  if (FUSE == FUSE_SUM && (int64_t)er.top_k * ((nb + STEP - 1) / STEP) > 0x7FFFFFFF)
    return (int)cudaErrorInvalidConfiguration;
  const int64_t outs = FUSE == FUSE_GATE ? out / 2 : out;
  const int tr = FUSE == FUSE_GATE ? 8 : TILE;
  const MoeCta c = FUSE == FUSE_GATE ? moe_gate_up_cta(nb)
                                     : moe_down_cta((outs + tr - 1) / tr * rows, er.top_k * nb, sms);
  const int64_t tiles = (outs + tr * c.rw - 1) / (tr * c.rw);
  if (tiles > 0x7FFFFFFF) return (int)cudaErrorInvalidConfiguration;
  constexpr int kMode = gemv_decode_mode(K, 1), kRegs = gemv_max_regs(1);
  gemv_kernel<K, T, kMode, kRegs, 1, false, false, FUSE>
      <<<dim3((unsigned)tiles, (unsigned)rows), dim3(c.warps * 32, c.rw), 0, st>>>(
          reinterpret_cast<const T*>(x), 1, packed, absmax, fp16, scale, cb, reinterpret_cast<const T*>(bias),
          reinterpret_cast<T*>(y), out, (int)in, (int)nb, er, vec);
  return (int)cudaGetLastError();
}

template <int FUSE, typename T>
int launch_moe_k(int k, const void* x, int64_t rows, const uint32_t* packed, const void* absmax, int fp16,
                 const float* scale, const float* cb, int64_t out, int64_t in, const void* bias, void* y,
                 const ExpertRows& er, cudaStream_t st) {
  switch (k) {
    case 2: return launch_moe<2, T, FUSE>(x, rows, packed, absmax, fp16, scale, cb, out, in, bias, y, er, st);
    case 3: return launch_moe<3, T, FUSE>(x, rows, packed, absmax, fp16, scale, cb, out, in, bias, y, er, st);
    case 4: return launch_moe<4, T, FUSE>(x, rows, packed, absmax, fp16, scale, cb, out, in, bias, y, er, st);
    case 5: return launch_moe<5, T, FUSE>(x, rows, packed, absmax, fp16, scale, cb, out, in, bias, y, er, st);
  }
  return (int)cudaErrorInvalidValue;
}

template <int FUSE>
int dispatch_moe(int x_dtype, int k, const void* x, int64_t rows, const uint32_t* packed, const void* absmax,
                 int fp16, const float* scale, const float* cb, int64_t out, int64_t in, const void* bias, void* y,
                 const ExpertRows& er, void* stream) {
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (x_dtype == BF16)
    return launch_moe_k<FUSE, __nv_bfloat16>(k, x, rows, packed, absmax, fp16, scale, cb, out, in, bias, y, er, st);
  if (x_dtype == F16)
    return launch_moe_k<FUSE, __half>(k, x, rows, packed, absmax, fp16, scale, cb, out, in, bias, y, er, st);
  return (int)cudaErrorInvalidValue;
}

// dense (ids == nullptr, N == 1), per-row experts or grouped experts (work: order [N] and offsets [E + 2], int32)
template <int K, typename T>
int launch(int64_t M, const void* x, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed,
           const void* absmax, int fp16, const float* scale, const float* cb, int64_t out, int64_t in,
           const void* bias, void* y, bool grouped, int* work, cudaStream_t st) {
  if (out == 0 || N == 0) return 0;
  if (M < 1 || M > GEMV_MAX_M || (ids != nullptr && M != 1)) return (int)cudaErrorInvalidValue;
  if (in > (int64_t)1 << 30) return (int)cudaErrorInvalidConfiguration;  // 32-bit in-row offsets in both kernels
  const int64_t nb = (in + 31) / 32;
  const int vec = (in % 8 == 0) && ((reinterpret_cast<uintptr_t>(x) & 15) == 0);
  if (ids == nullptr)
    return launch_rows<K, T>(M, x, packed, absmax, fp16, scale, cb, out, in, nb, vec, bias, y, 1, 1,
                             ExpertRows{nullptr, nullptr, nullptr, 1}, st);
  if (!grouped)
    return launch_rows<K, T>(1, x, packed, absmax, fp16, scale, cb, out, in, nb, vec, bias, y, N, N,
                             ExpertRows{ids, nullptr, nullptr, E}, st);
  if (N > 0x7FFFFFFF || E > EXPERT_GROUPED_MAX_E) return (int)cudaErrorInvalidValue;
  int* order = work;
  int* offsets = work + N;
  expert_route(ids, N, E, order, offsets, st);
  const int64_t mt = expert_item_rows(N, E);
  // work items: each non-empty bucket's last chunk may be partial
  const int64_t chunks = (N + mt - 1) / mt, items = chunks + (E + 1 < N ? E + 1 : N);
  return launch_rows<K, T>(mt, x, packed, absmax, fp16, scale, cb, out, in, nb, vec, bias, y, items, chunks,
                           ExpertRows{nullptr, order, offsets, E}, st);
}

template <typename T>
int launch_k(int k, int64_t M, const void* x, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed,
             const void* absmax, int fp16, const float* scale, const float* cb, int64_t out, int64_t in,
             const void* bias, void* y, bool grouped, int* work, cudaStream_t st) {
  switch (k) {
    case 2: return launch<2, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, grouped, work, st);
    case 3: return launch<3, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, grouped, work, st);
    case 4: return launch<4, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, grouped, work, st);
    case 5: return launch<5, T>(M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, grouped, work, st);
  }
  return (int)cudaErrorInvalidValue;
}

int dispatch(int x_dtype, int k, int64_t M, const void* x, int64_t N, const int64_t* ids, int64_t E,
             const uint32_t* packed, const void* absmax, int fp16, const float* scale, const float* cb, int64_t out,
             int64_t in, const void* bias, void* y, bool grouped, int* work, void* stream) {
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  if (x_dtype == BF16)
    return launch_k<__nv_bfloat16>(k, M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, grouped,
                                   work, st);
  if (x_dtype == F16)
    return launch_k<__half>(k, M, x, N, ids, E, packed, absmax, fp16, scale, cb, out, in, bias, y, grouped, work, st);
  return (int)cudaErrorInvalidValue;
}

}  // namespace

namespace kbit {
void expert_route(const int64_t* ids, int64_t N, int64_t E, int* order, int* offsets, cudaStream_t st) {
  expert_route_kernel<<<1, 1024, (size_t)(E + 1) * sizeof(int), st>>>(ids, (int)N, (int)E, order, offsets);
}
}  // namespace kbit

extern "C" {

int kbit_gemv(const void* x, int x_dtype, int64_t M, const uint32_t* packed, const void* absmax, int absmax_fp16,
              const float* scale, const float* codebook, int k, int64_t out, int64_t in, const void* bias, void* y,
              void* stream) {
  return dispatch(x_dtype, k, M, x, 1, nullptr, 1, packed, absmax, absmax_fp16, scale, codebook, out, in, bias, y,
                  false, nullptr, stream);
}

int64_t kbit_expert_gemv_workspace(int64_t N, int64_t E) {
  if (N < 0 || E < 1) return -1;
  return (N + E + 2) * (int64_t)sizeof(int);
}

int kbit_expert_gemv_kernel(const void* x, int x_dtype, int64_t N, const int64_t* ids, int64_t E,
                            const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                            const float* codebook, int k, int64_t out, int64_t in, void* y, void* workspace,
                            int64_t workspace_bytes, int kernel, void* stream) {
  if (ids == nullptr || E < 1) return (int)cudaErrorInvalidValue;
  const bool grouped = kernel == KBIT_EXPERT_GROUPED || (kernel == KBIT_EXPERT_AUTO && expert_grouped(N, E));
  if (kernel < KBIT_EXPERT_AUTO || kernel > KBIT_EXPERT_GROUPED) return (int)cudaErrorInvalidValue;
  if (grouped && (workspace == nullptr || workspace_bytes < kbit_expert_gemv_workspace(N, E)))
    return (int)cudaErrorInvalidValue;
  return dispatch(x_dtype, k, 1, x, N, ids, E, packed, absmax, absmax_fp16, scale, codebook, out, in, nullptr, y,
                  grouped, reinterpret_cast<int*>(workspace), stream);
}

int kbit_moe_gate_up(const void* x, int x_dtype, int64_t T, int64_t top_k, const int64_t* ids, int64_t E,
                     const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                     const float* codebook, int k, int64_t out, int64_t in, const void* bias, int gate, float alpha,
                     float limit, void* h, void* stream) {
  if (ids == nullptr || E < 1 || T < 0 || top_k < 1 || top_k > 65535 || out < 0 || out % 2 != 0 || in < 1 ||
      (gate != KBIT_GATE_SILU && gate != KBIT_GATE_CLAMPED))
    return (int)cudaErrorInvalidValue;
  if (T == 0 || out == 0) return 0;
  ExpertRows er{ids, nullptr, nullptr, E};
  er.top_k = (int)top_k;
  er.gate = gate;
  er.alpha = alpha;
  er.limit = limit;
  return dispatch_moe<FUSE_GATE>(x_dtype, k, x, T * top_k, packed, absmax, absmax_fp16, scale, codebook, out, in, bias,
                                 h, er, stream);
}

int kbit_moe_down(const void* h, int x_dtype, int64_t T, int64_t top_k, const int64_t* ids, const void* weights,
                  int64_t E, const uint32_t* packed, const void* absmax, int absmax_fp16, const float* scale,
                  const float* codebook, int k, int64_t out, int64_t in, const void* bias, void* y, void* stream) {
  if (ids == nullptr || weights == nullptr || E < 1 || T < 0 || top_k < 1 || top_k > 65535 || out < 0 || in < 1)
    return (int)cudaErrorInvalidValue;
  if (T == 0 || out == 0) return 0;
  ExpertRows er{ids, nullptr, nullptr, E};
  er.top_k = (int)top_k;
  er.coef = weights;
  return dispatch_moe<FUSE_SUM>(x_dtype, k, h, T, packed, absmax, absmax_fp16, scale, codebook, out, in, bias, y, er,
                                stream);
}

int kbit_expert_gemv(const void* x, int x_dtype, int64_t N, const int64_t* ids, int64_t E, const uint32_t* packed,
                     const void* absmax, int absmax_fp16, const float* scale, const float* codebook, int k,
                     int64_t out, int64_t in, void* y, void* workspace, int64_t workspace_bytes, void* stream) {
  return kbit_expert_gemv_kernel(x, x_dtype, N, ids, E, packed, absmax, absmax_fp16, scale, codebook, k, out, in, y,
                                 workspace, workspace_bytes, KBIT_EXPERT_AUTO, stream);
}

}  // extern "C"
