// kbit_tiled.cu: the tiled layout of large K = 2..5 Linear weights on sm_90 (described in Python at
// kbit_hf/backends/cuda/tiled.py, and in docs/design.md): the conversions from and to the bit planes, two fused GEMVs
// over it (M = 1..64), a tensor-core GEMM (M > 64, wgmma: its own comment at gemm_tiled_kernel) and its dequantize.
// Which GEMV a call runs, and its launch shape: kbit_dispatch.h.
//
// Layout (out % 16 == 0, in % 256 == 0; T = out / 16 tiles, C = in / 128 chunks per row): a permutation of the bits
// of the bit planes and the e4m4 block scales. 256 K bytes of weights per (tile t, chunk c), 8 K per lane l = 4 g + q.
// K = 2, 4: byte ((t * C + c) * 32 + l) * 8 K + 2 K b + K h + 2 m + rh holds the 8 / K indices of row 16 t + g + 8 rh
// from element e = 128 c + 32 b + 8 q + 4 h + (8 / K) m on (index i at bits K i). For K = 4 a byte is the pair
// idx[e] | idx[e + 1] << 4 (m picks the pair: registers a_{rh + 2 m} of lane l's m16n8k16 A fragment for the k slice
// (b, h)); for K = 2 a byte is two pairs (a_rh and a_{rh + 2}). K = 4 (and K = 5's low nibbles) swizzle a lane's two
// 16-byte halves: where g is odd, block b's bytes sit at 8 (b ^ 2) (half_swizzle). K = 3: a byte is a 6-bit pair plus
// 2 bits of a fourth pair of its word group (k3_byte). K = 5: K = 4's 32 bytes per lane of the indices' low 4 bits,
// then 8 bytes per lane of their high bits (k5_high_bit). So a lane reads its bytes of a chunk with a few 16- or 8-byte
// shared loads, and the activations of the k slices of block b are the 8 consecutive elements 128 c + 32 b + 8 q ..
// + 7 (one 16-byte load per lane and token). Block scales, 64 bytes per (t, c): byte ((t * C + c) * 16 + r) * 4 + b
// = block 4 c + b of row 16 t + r. Each k slice of an MMA lies inside one block of each row, so the block scale
// multiplies the MMA's partial sums in fp32 (4 FFMA per block and lane).
//
// GEMV by warp ranges (gemv_tiled_kernel, M <= 8 and layers of few tiles): one persistent CTA of NW warps per SM owns
// whole tiles (an even split of the tiles over the grid). Its
// items (2 chunks: 512 K bytes of weights + 128 B of scales, contiguous in the layout) are split into NW contiguous
// ranges, one per warp, so each warp streams one contiguous byte range through its own ring of S shared-memory slots,
// filled by bulk asynchronous copies (cp.async.bulk, one mbarrier per slot, lane 0 issues; TMA, sm_90). The pair table
// (build_pair_table: 256 rows, one per byte value, of 32 replicas) lies at the shared-window address 0x10000 + 256 *
// byte + ENTRY * lane, so one PRMT of a weight byte with table_lane(lane) is the whole address of a conflict-free
// lookup (K = 2: an 8-byte lookup gives two A registers; 2 of each item's 8 blocks are decoded by PRMTs from the
// codebook in registers instead, which takes load off the shared-memory pipe that binds K = 2. K = 3: a fourth of the
// pairs are gathered first, and from M = 4 on 4 of the 8 blocks are decoded in registers (K3Regs); K = 5's table is
// 128 KB, the pair's high bits adding address bits: lookup_block). NT tiles of 8 tokens share each looked-up A operand.
// Tiles inside a warp's range are stored by that warp; the partial sums of the first and last tile of each range go
// through a shared region of their own (range_partials) and are summed in warp order after the loop: deterministic, no
// atomics. Both GEMVs are launched with programmatic dependent launch (launch_gemv, pdl_wait): a GEMV starts as the
// kernel before it drains, reading no memory until that kernel is done; the range kernel meanwhile asks its first items
// into L2.
// The batched GEMV (gemv_tiled_batch_kernel, M = 9..64 on layers of many tiles) has its own comment below.
#include "kbit_api.h"
#include "kbit_common.cuh"
#include "kbit_dispatch.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <type_traits>

using namespace kbit;

namespace {

#include "kbit_sm90.cuh"

// fixed shared-window addresses (the dynamic shared memory starts at or below BARS: checked in the kernel)
constexpr uint32_t BARS = 0x1000;    // NW * S mbarriers
constexpr uint32_t LOW = 0x1400;     // the first ring slots, below the table
constexpr uint32_t TABLE = 0x10000;  // the pair table (256 rows of 256 bytes, K = 3, 4 use 128 of each; K = 5 in the
                                     // range kernel: two such windows)
constexpr uint32_t ITEM_A = 128;     // block-scale bytes of an item (16 rows x 256 elements)
// Per-K sizes of the layout: per (tile, chunk) each lane holds 8 K bytes (K = 2, 4: 2 K per block; K = 3: 12 per two
// blocks; K = 5: K = 4's 32 bytes of low nibbles, then 8 bytes of high bits); an item (2 chunks) is 512 K bytes of
// weights and 128 of scales.
template <int K>
struct Tiled {
  static_assert(K >= 2 && K <= 5, "the tiled layout holds K = 2..5");
  static constexpr uint32_t CHUNK_W = 256 * K, ITEM_W = 2 * CHUNK_W, ITEM = ITEM_W + ITEM_A;
  static constexpr int WORDS = 4 * K;               // 32-bit words of weights per lane and item
  static constexpr uint32_t ENTRY = K == 2 ? 8 : 4;  // bytes per pair-table entry (4: one pair, 8: two); replica l at
                                                     // ENTRY l
};
// The pair table's end, where the other ring slots start. K = 5's table has two layouts: WIDE, 32 replicas in two 64 KB
// windows (the range kernel, which the lookups' shared-memory wavefronts bind), or 16 replicas in one window (lanes l
// and l + 16 share a replica: 2-way bank conflicts; the batched kernel, whose stages need the space and whose
// lookups each feed NT MMAs). K = 2, 4 have one layout.
template <int K, bool WIDE>
constexpr uint32_t table_end() {
  return K == 5 && WIDE ? 0x30000 : 0x20000;
}
// a stage of the batched kernel's ring: NT * 8 token rows of activations (576-byte rows, see the kernel), then NW
// items' weights and NW items' scales
constexpr uint32_t XROW = 576;
template <int K, int NW, int NT>
constexpr uint32_t batch_stage_bytes() {
  return NT * 8 * XROW + NW * Tiled<K>::ITEM;
}
// Window address of ring slot i of SB bytes (as many slots as fit below the table, the rest from the table's end
// TEND), and the end of the window that nslots need.
template <uint32_t TEND, uint32_t SB>
__host__ __device__ constexpr uint32_t ring_addr(uint32_t i) {
  constexpr uint32_t NLOW = (TABLE - LOW) / SB;
  return i < NLOW ? LOW + i * SB : TEND + (i - NLOW) * SB;
}
template <uint32_t TEND, uint32_t SB>
__host__ __device__ constexpr uint32_t ring_end(uint32_t nslots) {
  return nslots <= (TABLE - LOW) / SB ? TEND : ring_addr<TEND, SB>(nslots);
}

// The range kernel's boundary partials (its epilogue's input), [NW warps][2 sides][NT] x 512 bytes: right after the
// ring (where a slot past the last would go), unless that is below the table and the region would run into it; then
// after the ring's end. Kept out of the space above the table where possible: more shared memory leaves less L1 for
// the activations (a 32 KB region there cost up to 15% at M = 32).
// (The batched kernel's split partials go the same way: partials_addr.)
template <uint32_t TEND, uint32_t SB>
constexpr uint32_t partials_addr(uint32_t nslots, uint32_t bytes) {
  const uint32_t after = ring_addr<TEND, SB>(nslots);
  return after >= TABLE || after + bytes <= TABLE ? after : ring_end<TEND, SB>(nslots);
}
// the end of a shared window of nslots ring slots and such a region of partials
template <uint32_t TEND, uint32_t SB>
constexpr uint32_t window_end(uint32_t nslots, uint32_t bytes) {
  const uint32_t ring = ring_end<TEND, SB>(nslots), red = partials_addr<TEND, SB>(nslots, bytes) + bytes;
  return ring > red ? ring : red;
}
template <int NW, int NT>
constexpr uint32_t range_partials_bytes() {
  return NW * 2 * NT * 512;
}
template <int K, int NW, int S, int NT>
constexpr uint32_t range_partials() {
  return partials_addr<table_end<K, true>(), Tiled<K>::ITEM>(NW * S, range_partials_bytes<NW, NT>());
}
// the end of the range kernel's shared window
template <int K, int NW, int S, int NT>
constexpr uint32_t range_smem_end() {
  return window_end<table_end<K, true>(), Tiled<K>::ITEM>(NW * S, range_partials_bytes<NW, NT>());
}
// The batched kernel's ring of XS stages and, when SPLIT warps share each tile or KS CTAs split the k range, their
// partial sums: [NW warps][NT] x 512 bytes
template <int NW, int NT, int SPLIT, int KS>
constexpr uint32_t batch_partials_bytes() {
  return SPLIT > 1 || KS > 1 ? NW * NT * 512 : 0;
}
template <int K, int NW, int XS, int NT, int SPLIT, int KS>
constexpr uint32_t batch_partials() {
  return partials_addr<table_end<K, false>(), batch_stage_bytes<K, NW, NT>()>(
      XS, batch_partials_bytes<NW, NT, SPLIT, KS>());
}
template <int K, int NW, int XS, int NT, int SPLIT, int KS>
constexpr uint32_t batch_smem_end() {
  return window_end<table_end<K, false>(), batch_stage_bytes<K, NW, NT>()>(XS,
                                                                          batch_partials_bytes<NW, NT, SPLIT, KS>());
}

// the four floats at addr where p, else zeros (the load is not issued)
__device__ __forceinline__ float4 lds_f4_if(uint32_t addr, bool p) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  asm volatile(
      "{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n @q ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n}"
      : "+f"(v.x), "+f"(v.y), "+f"(v.z), "+f"(v.w)
      : "r"(addr), "r"((int)p));
  return v;
}
__device__ __forceinline__ void sts128_at(uint32_t addr, const float (&v)[4]) {
  asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3])
               : "memory");
}
__device__ __forceinline__ uint2 lds64_at(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

// The pair table: 256 rows of 256 bytes at TABLE + 256 * byte, one per value of a weight byte, each holding 32
// replicas of its entry (lane l reads replica l: conflict-free). K = 4: a byte is a pair of indices (lo | hi << 4),
// its entry (cb[lo], cb[hi]) in T (4 bytes, half the row used); K = 2: a byte is two pairs (idx[e] << 2 i, i < 4),
// its entry both pairs' values (8 bytes, the row full). K = 3: a byte's bits 0..5 are a pair, its entry (cb[lo],
// cb[hi]) as K = 4's. K = 5: a pair is its byte of low nibbles and its two high bits h0, h1; its entry is
// (cb[lo | h0 << 4], cb[hi | h1 << 4]). WIDE: at TABLE + 0x10000 h1 + 256 byte + 128 h0 + 4 l, 128 KB; otherwise (16
// replicas) at TABLE + 256 byte + 128 h1 + 64 h0 + 4 (l % 16). Built from each lane's codebook entry cb_lane =
// cb[lane % 2^K] by shuffles, times factor (TiledScales), by all NTHREADS threads of the CTA (whole rounds: the
// shuffles need full warps).
template <typename T, int K, bool WIDE, int NTHREADS>
__device__ __forceinline__ void build_pair_table(unsigned char* win, float cb_lane, float factor) {
  constexpr bool K5W = K == 5 && WIDE;
  constexpr int SPR = K == 5 ? 8 : 2 * Tiled<K>::ENTRY;  // 16-byte stores per row (K = 5: per 128 bytes)
  constexpr int ROWS = K5W ? 1024 : K == 5 ? 512 : 256;  // K = 5: 128-byte row parts
  auto cb = [&](uint32_t i) { return __shfl_sync(0xFFFFFFFFu, cb_lane, (int)i) * factor; };
  for (int i0 = 0; i0 < ROWS * SPR; i0 += NTHREADS) {
    const int i = i0 + (int)threadIdx.x;
    const uint32_t R = (uint32_t)(i / SPR) & (ROWS - 1);
    uint4 v;
    uint32_t at;
    if constexpr (K5W) {  // R = (h1, byte, h0)
      const uint32_t P = (R >> 1) & 255u, h0 = R & 1u, h1 = R >> 9;
      const uint32_t w = Mma<T>::pack(cb((P & 15u) | h0 << 4), cb((P >> 4) | h1 << 4));
      v = make_uint4(w, w, w, w);
      at = TABLE + 0x10000u * h1 + 256 * P + 128 * h0;
    } else if constexpr (K == 5) {  // R = (byte, h1); a 16-byte store (i % 8) covers 4 replicas of one h0
      const uint32_t P = R >> 1, h1 = R & 1u, h0 = (uint32_t)(i % SPR) >> 2;
      const uint32_t w = Mma<T>::pack(cb((P & 15u) | h0 << 4), cb((P >> 4) | h1 << 4));
      v = make_uint4(w, w, w, w);
      at = TABLE + 256 * P + 128 * h1;
    } else if constexpr (K == 4) {
      const uint32_t w = Mma<T>::pack(cb(R & 15u), cb(R >> 4));
      v = make_uint4(w, w, w, w);
      at = TABLE + 256 * R;
    } else if constexpr (K == 3) {  // bits 6, 7 of a K = 3 byte belong to another pair (lookup_block): ignored here
      const uint32_t w = Mma<T>::pack(cb(R & 7u), cb((R >> 3) & 7u));
      v = make_uint4(w, w, w, w);
      at = TABLE + 256 * R;
    } else {
      const uint32_t w0 = Mma<T>::pack(cb(R & 3u), cb((R >> 2) & 3u)), w1 = Mma<T>::pack(cb((R >> 4) & 3u), cb(R >> 6));
      v = make_uint4(w0, w1, w0, w1);
      at = TABLE + 256 * R;
    }
    if (i < ROWS * SPR) *reinterpret_cast<uint4*>(win + at + 16 * (i % SPR)) = v;
  }
}
// this lane's part of a table address: PRMT(weight word, table_lane, 0x6504 | j << 4) = TABLE + 256 * byte j + the
// lane's replica (K = 5 adds the high bits: lookup_block)
template <int K, bool WIDE>
__device__ __forceinline__ uint32_t table_lane(int lane) {
  return 0x0100u | (uint32_t)(K == 5 && !WIDE ? lane & 15 : lane) * Tiled<K>::ENTRY;
}
// The byte offset (16 or 0) by which lane's two 16-byte halves of a chunk are swapped: K = 4 and K = 5's low nibbles,
// odd g (blocks 2, 3 first); K = 2, 3: none. So the 16-byte loads of one half by a quarter warp, lanes l .. l + 7 at
// 32 l + 16 (g & 1), hit 8 distinct 4-bank groups; unswizzled, two lanes would share each, and every such load take 8
// wavefronts instead of 4 (15% of the range kernel's shared-memory wavefronts on the H200)
template <int K>
__host__ __device__ constexpr uint32_t half_swizzle(int lane) {
  return K >= 4 ? (uint32_t)(lane & 4) << 2 : 0u;
}

// this lane's weight words of the item in the ring slot at sl: 8 K bytes of each chunk. K = 3: words 3 i .. 3 i + 2
// are blocks 2 i and 2 i + 1 of the item. K = 5: words 0..15 are the low nibbles as K = 4's (8 per chunk), words
// 16 + 2 c, 17 + 2 c chunk c's high bits
template <int K, typename Ld64, typename Ld128>
__device__ __forceinline__ void load_item_words_by(Ld64 ld64, Ld128 ld128, int lane, uint32_t (&w)[Tiled<K>::WORDS]) {
  // ld64 / ld128: the 8 / 16 bytes at a byte offset into the item (shared or global memory)
  if constexpr (K == 3) {  // 24 bytes per lane and chunk: words 6 c .. 6 c + 5 (8-byte aligned)
#pragma unroll
    for (int i = 0; i < 6; ++i) {
      const uint2 v = ld64((i / 3) * Tiled<K>::CHUNK_W + lane * 24 + (i % 3) * 8);
      w[2 * i] = v.x;
      w[2 * i + 1] = v.y;
    }
    return;
  }
  constexpr int KL = K == 5 ? 4 : K;  // the bytes read as K = KL's
  constexpr uint32_t LANE_B = 8 * KL;
  const uint32_t sw = half_swizzle<K>(lane);
#pragma unroll
  for (int i = 0; i < KL; ++i) {
    const uint4 v = ld128((i / (KL / 2)) * Tiled<K>::CHUNK_W + lane * LANE_B + (((i % (KL / 2)) * 16) ^ sw));
    w[4 * i] = v.x;
    w[4 * i + 1] = v.y;
    w[4 * i + 2] = v.z;
    w[4 * i + 3] = v.w;
  }
  if constexpr (K == 5) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint2 v = ld64(c * Tiled<K>::CHUNK_W + 32 * 32 + lane * 8);
      w[16 + 2 * c] = v.x;
      w[17 + 2 * c] = v.y;
    }
  }
}
template <int K>
__device__ __forceinline__ void load_item_words(uint32_t sl, int lane, uint32_t (&w)[Tiled<K>::WORDS]) {
  load_item_words_by<K>([sl](uint32_t o) { return lds64_at(sl + o); }, [sl](uint32_t o) { return lds128_at(sl + o); },
                        lane, w);
}
// The words of the blocks that one of SPLIT warps sharing an item decodes, placed as blocks 0 .. 8 / SPLIT - 1 of
// load_item_words' array (so lookup_block takes them with compile-time indices): SPLIT = 2, part p: chunk p;
// SPLIT = 4, part p: blocks 2 (p & 1), + 1 of chunk p / 2 (a K = 3 block pair, k3_byte).
template <int K, int SPLIT>
__device__ __forceinline__ void load_part_words(uint32_t sl, int part, int lane, uint32_t (&w)[Tiled<K>::WORDS]) {
  if constexpr (SPLIT == 1) {
    load_item_words<K>(sl, lane, w);
  } else {
    static_assert(SPLIT == 2 || SPLIT == 4, "an item's 8 blocks split over 2 or 4 warps");
    constexpr int KL = K == 5 ? 4 : K;
    const uint32_t cs = sl + (uint32_t)(SPLIT == 2 ? part : part >> 1) * Tiled<K>::CHUNK_W;  // the chunk
    const uint32_t pr = SPLIT == 2 ? 0u : (uint32_t)(part & 1);                              // the block pair
    constexpr uint32_t PB = 16 * KL / SPLIT;  // bytes of a part per lane: a chunk's 8 KL, or half of them
    const uint32_t a = cs + lane * 8 * KL + pr * PB;
    if constexpr (K == 3) {
#pragma unroll
      for (int i = 0; i < 3; ++i) {
        if constexpr (SPLIT == 2) {
          const uint2 v = lds64_at(a + 8 * i);
          w[2 * i] = v.x;
          w[2 * i + 1] = v.y;
        } else {  // 12 bytes, 4-byte aligned
          w[i] = lds_at(a + 4 * i);
        }
      }
    } else if constexpr (PB == 8) {  // K = 2, SPLIT = 4
      const uint2 v = lds64_at(a);
      w[0] = v.x;
      w[1] = v.y;
    } else {
#pragma unroll
      for (int i = 0; i < (int)PB / 16; ++i) {
        // K = 4, 5: a = chunk + 32 lane + 16 pr with the chunk 32-byte aligned, so the XOR picks the swizzled half
        const uint4 v = lds128_at((a + 16 * i) ^ half_swizzle<K>(lane));
        w[4 * i] = v.x;
        w[4 * i + 1] = v.y;
        w[4 * i + 2] = v.z;
        w[4 * i + 3] = v.w;
      }
    }
    if constexpr (K == 5) {  // the part's words of high bits (k5_high_bit: word b / 2 of the chunk's two)
      if constexpr (SPLIT == 2) {
        const uint2 v = lds64_at(cs + 32 * 32 + lane * 8);
        w[16] = v.x;
        w[17] = v.y;
      } else {
        w[16] = lds_at(cs + 32 * 32 + lane * 8 + 4 * pr);
      }
    }
  }
}
// (a & m) | (b & ~m): one LOP3
__device__ __forceinline__ uint32_t bitsel(uint32_t a, uint32_t b, uint32_t m) { return (a & m) | (b & ~m); }
// K = 3: the word of pair bytes of registers (1, j) of a block pair's odd block, gathered from bits 6, 7 of the three
// words' bytes j (k3_byte; bits 6, 7 of the result are not the pair's, and the table ignores them)
__device__ __forceinline__ uint32_t k3_spare(uint32_t w0, uint32_t w1, uint32_t w2) {
  const uint32_t u = bitsel(w0 >> 6, w1 >> 4, 0x03030303u);
  return bitsel(u, w2 >> 2, 0x0F0F0F0Fu);
}
// K = 3: the words of pair bytes of k slices 0 and 1 of block kb (an even block's are its two words, an odd block's
// its third word and k3_spare; N: the words of an item, Tiled<3>::WORDS, left free so that the main loop of every K
// compiles the K = 3 branch)
template <int N>
__device__ __forceinline__ void k3_block_words(const uint32_t (&w)[N], int kb, uint32_t& w0, uint32_t& w1) {
  const int i = 3 * (kb >> 1);  // the block pair's three words (k3_byte)
  w0 = (kb & 1) ? w[i + 2] : w[i];
  w1 = (kb & 1) ? k3_spare(w[i], w[i + 1], w[i + 2]) : w[i + 1];
}
// the A operands of block kb of the item (k slices h = 0, 1 of m16n8k16): A[h][j] is register a_j of slice h (j & 1:
// row g + 8), straight from the table. K = 4: one lookup per register; K = 2: one 8-byte lookup per two (a_rh and
// a_rh+2: the two pairs of a byte). K = 3: one lookup per register (an even block's from its two words, an odd
// block's from its word and k3_spare: 5 integer operations per 4 pairs). K = 5: K = 4's lookup, the pair's two high
// bits added to the address: high word w[16 + kb / 2] holds register (h, j)'s bits at 16 h + 8 (kb & 1) + 2 j (+ 1),
// so one shift, mask and add put the bits of (0, j) and (1, j) into H = [lane byte | h0 << 7, 1 + h1, lane byte |
// h0' << 7, 1 + h1'] (WIDE; otherwise [lane byte | h0 << 6 | h1 << 7, 1, ..]), and a PRMT takes the address bytes
// (lane byte, weight byte j, window byte, the window byte's sign: 0) from H and the weight word.
// TOP (batched kernel, K = 5, not WIDE): cl's byte 2 is the address's top byte (a cluster CTA's window base): H's byte
// 3 carries it instead of a second 1, and the PRMT takes it from there instead of a sign.
template <int K, bool WIDE, bool TOP = false>
__device__ __forceinline__ void lookup_block(const uint32_t (&w)[Tiled<K>::WORDS], int kb, uint32_t cl,
                                             uint32_t (&A)[2][4]) {
  if constexpr (K == 5) {
    static_assert(!(WIDE && TOP), "the range kernel runs without clusters");
    const uint32_t hw = w[16 + kb / 2];
    const uint32_t base = TOP ? ((cl & 0xFFFFu) * 0x10001u & 0x00FFFFFFu) | (cl & 0x00FF0000u) << 8 : cl * 0x10001u;
    constexpr int TO = WIDE ? 7 : 6;  // where (0, j)'s h0 goes
    constexpr uint32_t MASK = WIDE ? 0x01800180u : 0x00C000C0u;
    constexpr uint32_t S0 = TOP ? 0x7504u : 0xD504u, S1 = TOP ? 0x7506u : 0xF706u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int sh = 8 * (kb & 1) + 2 * j;  // bit of (0, j)'s h0
      const uint32_t H = ((sh >= TO ? hw >> (sh - TO) : hw << (TO - sh)) & MASK) + base;
      A[0][j] = lds_at(prmt(w[2 * kb], H, S0 | (uint32_t)j << 4));
      A[1][j] = lds_at(prmt(w[2 * kb + 1], H, S1 | (uint32_t)j << 4));
    }
  } else if constexpr (K == 3) {
    uint32_t w0, w1;
    k3_block_words(w, kb, w0, w1);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      A[0][j] = lds_at(prmt(w0, cl, 0x6504u | (uint32_t)j << 4));
      A[1][j] = lds_at(prmt(w1, cl, 0x6504u | (uint32_t)j << 4));
    }
  } else {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (K == 4) {
#pragma unroll
        for (int j = 0; j < 4; ++j) A[h][j] = lds_at(prmt(w[2 * kb + h], cl, 0x6504u | (uint32_t)j << 4));
      } else {
#pragma unroll
        for (int rh = 0; rh < 2; ++rh) {
          const uint2 v = lds64_at(prmt(w[kb], cl, 0x6504u | (uint32_t)(2 * h + rh) << 4));
          A[h][rh] = v.x;
          A[h][rh + 2] = v.y;
        }
      }
    }
  }
}

// The first N codebook values (in T, times the table factor) as words of their low bytes (lo[i]: values 4 i .. 4 i + 3)
// and of their high bytes (hi): a PRMT over such words gathers values by their indices, a lookup without shared memory
// (K2Regs, K3Regs).
template <int N>
struct CodebookBytes {
  uint32_t lo[N / 4], hi[N / 4];
};
template <typename T, int N>
__device__ __forceinline__ CodebookBytes<N> codebook_bytes(float cb_lane, float factor) {
  CodebookBytes<N> r{};
#pragma unroll
  for (int c = 0; c < N; ++c) {
    const uint32_t v = Mma<T>::pack(__shfl_sync(0xFFFFFFFFu, cb_lane, c) * factor, 0.f);
    r.lo[c / 4] |= (v & 0xFFu) << (8 * (c % 4));
    r.hi[c / 4] |= ((v >> 8) & 0xFFu) << (8 * (c % 4));
  }
  return r;
}
// K = 2 without shared memory: the 4 codebook values' bytes; PRMT(lo, hi, selector nibbles i0, 4 + i0, i1, 4 + i1) is
// the pair (cb[i0], cb[i1]). Decodes the A operands of one block (word w: byte 2 h + rh holds i0..i3 of registers a_rh
// (i0, i1) and a_rh+2 (i2, i3) of k slice h) with integer operations only, to take lookups off the shared-memory pipe,
// which binds the K = 2 GEMV (the range kernel does so for TILED_K2_REG_BLOCKS of each item's 8 blocks).
using K2Regs = CodebookBytes<4>;
__device__ __forceinline__ void decode_k2_regs(uint32_t w, const K2Regs& cr, uint32_t (&A)[2][4]) {
#pragma unroll
  for (int s = 0; s < 2; ++s)      // bytes s (k slice 0) and s + 2 (k slice 1): row half rh = s
#pragma unroll
    for (int p = 0; p < 2; ++p) {  // the byte's pair p: indices 2 p, 2 p + 1
      // indices (2 p, 2 p + 1) of byte s into bytes 0, 1 and of byte s + 2 into bytes 2, 3; then the selectors
      uint32_t t = (((w >> (8 * s + 4 * p)) & 0x000F000Fu) * 0x41u) & 0x03030303u;
      t = t * 0x11u + 0x40404040u;
      A[0][s + 2 * p] = prmt(cr.lo[0], cr.hi[0], t);
      A[1][s + 2 * p] = prmt(cr.lo[0], cr.hi[0], t >> 16);
    }
}

// K = 3 without shared memory: the 8 codebook values' bytes, lo[0], lo[1] and hi[0], hi[1]. A pair byte's 3-bit
// indices are PRMT selectors over such a register pair: from a word of 4 pair bytes, one shift and two LOP3s make the
// selectors of 4 indices, PRMTs on lo and hi gather their low and high bytes, and two more PRMTs interleave those into
// 2 pairs (cb[i0], cb[i1]): 12 integer operations per 4 pairs, against 4 PRMTs and 4 table lookups.
// (The range kernel decodes the blocks of TILED_K3_REG_MASK this way from M = TILED_K3_REG_MIN_M on.)
using K3Regs = CodebookBytes<8>;
// the A operands of a block from its words w0, w1 (k3_block_words), as lookup_block<3> gives them
__device__ __forceinline__ void decode_k3_regs(uint32_t w0, uint32_t w1, const K3Regs& cr, uint32_t (&A)[2][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const uint32_t w = h ? w1 : w0;
    // byte j: indices a (bits 0..2) and b (3..5) -> selector nibbles 2 j, 2 j + 1 (bits 6, 7 are dropped; a nibble's
    // bit 3 would select PRMT's sign mode)
    const uint32_t s = bitsel(w, w << 1, 0x0F0F0F0Fu) & 0x77777777u;
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // bytes 2 half, 2 half + 1 (PRMT reads its selector's low 16 bits)
      const uint32_t sel = half ? s >> 16 : s;
      const uint32_t lo = prmt(cr.lo[0], cr.lo[1], sel), hi = prmt(cr.hi[0], cr.hi[1], sel);
      A[h][2 * half] = prmt(lo, hi, 0x5140u);
      A[h][2 * half + 1] = prmt(lo, hi, 0x7362u);
    }
  }
}

// this lane's codebook entry cb[lane % 2^K], from which build_pair_table and codebook_bytes shuffle (after pdl_wait)
template <int K>
__device__ __forceinline__ float codebook_lane(const float* codebook, int lane) {
  return __ldg(codebook + (lane & ((1 << K) - 1)));
}
// one item (weights, then scales) into a ring slot, completing on its mbarrier (one lane)
template <int K>
__device__ __forceinline__ void fetch_item(uint32_t slot, const uint8_t* w, const uint8_t* a, uint32_t bar) {
  mbar_expect_tx(bar, Tiled<K>::ITEM);
  bulk_copy(slot, w, Tiled<K>::ITEM_W, bar);
  bulk_copy(slot + Tiled<K>::ITEM_W, a, ITEM_A, bar);
}
// the same item's bytes asked into L2 only (one lane)
template <int K>
__device__ __forceinline__ void prefetch_item_l2(const uint8_t* w, const uint8_t* a) {
#if KBIT_SM90
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(w), "r"(Tiled<K>::ITEM_W) : "memory");
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(a), "r"(ITEM_A) : "memory");
#endif
}
// 16 bytes global -> shared (cp.async, L2 only)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
#if KBIT_SM90
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#endif
}
// an arrival on bar once this thread's earlier cp.async copies have landed (counted in bar's expected arrivals)
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
#if KBIT_SM90
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
#endif
}

// How the block scales enter the two GEMVs, per activation dtype: the factor on the pair table's codebook values, the
// scale as the hot loop uses it, and the power of two the store takes back out (all exact).
// - Range kernel (SUM_*): the scale multiplies the MMA's partial sums in fp32. bf16: the table holds cb * 2^32 and
//   the scale enters as its raw bits (code << 19 read as a float is 2^-116 times the e4m4 value), so the hot loop
//   spends no multiply on decoding it; the store multiplies by 2^84. A block's product is then 2^-84 times its share
//   of the output over the tensor scale: a normal float unless that share is below 2^-42 (a subnormal then, off by
//   at most 2^-65 times the tensor scale), and the MMA sums stay finite for activations below about 2^90. fp16
//   cannot hold the scaled codebook: it decodes each scale.
// - Batched kernel (A_*): the scale multiplies the looked-up pair (one paired multiply per A register) and the MMAs
//   accumulate straight into the tile's sums, so each weight carries one more rounding (cb * scale in T, as in the
//   dequantize + cuBLAS path). bf16: the same table times the raw bits (code * 0x00080008 is the pair of bf16 bit
//   patterns) is w * 2^-84, a normal bf16 for every nonzero code. fp16: cb * 16 times 16 * scale (w * 256, inside
//   fp16's range for |cb| <= 1 and scales <= 31); the store multiplies by 2^-8.
template <typename T> struct TiledScales;
template <> struct TiledScales<__nv_bfloat16> {
  static constexpr float SUM_TABLE = 0x1p32f, SUM_POST = 0x1p84f, A_TABLE = 0x1p32f, A_POST = 0x1p84f;
  __device__ static __forceinline__ float sum_scale(uint32_t code) { return __uint_as_float(code << 19); }
  __device__ static __forceinline__ uint32_t a_scale(uint32_t code) { return code * 0x00080008u; }
};
template <> struct TiledScales<__half> {
  static constexpr float SUM_TABLE = 1.f, SUM_POST = 1.f, A_TABLE = 16.f, A_POST = 0x1p-8f;
  __device__ static __forceinline__ float sum_scale(uint32_t code) { return e4m4_decode_fast(code); }
  __device__ static __forceinline__ uint32_t a_scale(uint32_t code) {
    const float s = e4m4_decode_fast(code) * 16.f;
    return Mma<__half>::pack(s, s);
  }
};

// one tile's 16 x 8 fragment of token tile nt (this lane's 4 values) times the tensor scale, plus bias, into y
template <typename T>
__device__ __forceinline__ void store_tile(T* y, const T* bias, int64_t out, int M, int64_t t, int nt, int lane,
                                           float sc, const float (&v)[4], float post) {
  // post: the power of two the sums still carry (TiledScales)
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = 8 * nt + 2 * q + (i & 1);
    const int64_t o = 16 * t + g + 8 * (i >> 1);
    if (m < M) {
      float r = (v[i] * post) * sc;  // the first product is exact
      if (bias != nullptr) r += Cvt<T>::to_f(bias[o]);
      y[(int64_t)m * out + o] = Cvt<T>::from_f(r);
    }
  }
}

// What both tiled GEMVs start from: the shared window (win + window address = generic pointer; the dynamic shared
// memory must start at or below BARS and reach end), the lane and the warp index (through a shuffle: the compiler then
// knows it is warp-uniform and keeps the bulk-copy operands in uniform registers, no per-lane loop around each copy)
// and the CTA's tiles [t0, t1) (an even split of the tiles over the grid). No memory is read: this runs before
// pdl_wait.
struct TiledCta {
  unsigned char* win;
  uint32_t wb;  // the CTA's window base: 0, or in a cluster launch its rank << 24 (the window offsets go on top)
  int lane, warp;
  int64_t t0, t1;
  // ks > 1: the CTAs form clusters of ks (the batched kernel's k split), which own the tiles
  __device__ __forceinline__ TiledCta(unsigned char* smem, uint32_t end, int64_t out, int ks = 1) {
    uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
    wb = ks > 1 ? base & 0xFF000000u : 0u;
    base -= wb;
    win = smem - base;  // win + a: window offset a (wb + a)
    uint32_t dsz;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dsz));
    if (base > BARS || base + dsz < end) __trap();
    lane = threadIdx.x & 31;
    warp = __shfl_sync(0xFFFFFFFFu, (int)threadIdx.x >> 5, 0);
    // the split in 32 bits where it fits: a 64-bit division is a subroutine of about 70 dependent instructions, on the
    // way to the first bulk copy
    const uint64_t T_ = (uint64_t)out / 16, lo = T_ * (blockIdx.x / ks), hi = T_ * (blockIdx.x / ks + 1);
    if (hi >> 32 == 0) {
      t0 = (uint32_t)lo / (gridDim.x / ks);
      t1 = (uint32_t)hi / (gridDim.x / ks);
    } else {
      t0 = (int64_t)(lo / (gridDim.x / ks));
      t1 = (int64_t)(hi / (gridDim.x / ks));
    }
  }
};

// NT tiles of 8 tokens (M <= 8 NT); R3: the blocks that K = 3 decodes in registers (TILED_K3_REG_MASK or 0). NT = 1 loads an
// item's activations before waiting for its weights; NT > 1 loads one block's ahead (fewer registers): the first
// block's before the wait, block kb + 1's while kb computes.
template <typename T, int K, int NW, int S, int NT, int R3>
__global__ void __launch_bounds__(NW * 32, 1) gemv_tiled_kernel(const T* __restrict__ x, int M,
                                                                 const uint8_t* __restrict__ wt,
                                                                 const uint8_t* __restrict__ at,
                                                                 const float* __restrict__ scale,
                                                                 const float* __restrict__ codebook,
                                                                 const T* __restrict__ bias, int64_t out, int in,
                                                                 T* __restrict__ y) {
#if !KBIT_SM90
  __trap();  // sm_90 only: the launcher refuses other devices
#endif
  extern __shared__ __align__(128) unsigned char smem[];
  static_assert(BARS + NW * S * 8 <= LOW && range_smem_end<K, NW, S, NT>() <= 227 * 1024, "shared-memory map");
  using L = Tiled<K>;
  constexpr uint32_t TEND = table_end<K, true>(), RED = range_partials<K, NW, S, NT>();
  // Start-up. Before pdl_wait (the kernel before may still run): the mbarriers, and the first items of each warp's
  // range asked into L2 (a prefetch cannot return stale data; a bulk copy into shared memory could, were the kernel
  // before writing them). Then, each wait a round trip overlapped: this lane's codebook entry and the tensor scale,
  // the ring's first fetches (from L2 by now, unless nothing ran before), the first item's activations into L1, the
  // table.
  pdl_launch_dependents();
  const TiledCta cta(smem, range_smem_end<K, NW, S, NT>(), out);
  unsigned char* win = cta.win;
  const int lane = cta.lane, warp = cta.warp, g = lane >> 2, q = lane & 3;
  const int64_t t0 = cta.t0, t1 = cta.t1;
  const int IPT = in / 256;  // items per tile
  // item indices below are 32-bit and relative to the CTA's first item (a CTA holds far fewer than 2^31 items)
  const int n = (int)((t1 - t0) * IPT);  // the CTA's items
  auto range_begin = [&](int w2) { return (int)((int64_t)n * w2 / NW); };  // warp w2's items: [rb(w2), rb(w2 + 1))
  const int u0 = range_begin(warp), u1 = range_begin(warp + 1);
  const uint8_t* wsrc = wt + (t0 * IPT) * L::ITEM_W;
  const uint8_t* asrc = at + (t0 * IPT) * ITEM_A;
  auto item_w = [&](int u) { return wsrc + (int64_t)u * L::ITEM_W; };  // the CTA's item u: weights, scales
  auto item_a = [&](int u) { return asrc + (int64_t)u * ITEM_A; };
  const uint32_t wbar = BARS + warp * S * 8;
  if (lane == 0) {
    for (int s = 0; s < S; ++s) mbar_init(wbar + 8 * s, 1);
    for (int s = 0; s < S && u0 + s < u1; ++s) prefetch_item_l2<K>(item_w(u0 + s), item_a(u0 + s));
  }
  pdl_wait();
  const float cb_lane = codebook_lane<K>(codebook, lane);
  const float sc = __ldg(scale);
  if (lane == 0) {
    for (int s = 0; s < S && u0 + s < u1; ++s)
      fetch_item<K>(ring_addr<TEND, L::ITEM>(warp * S + s), item_w(u0 + s), item_a(u0 + s), wbar + 8 * s);
  }
  // token 8 nt + g in this lane's B column: its elements 8 q .. 8 q + 7 of each 32-element block, as 16-byte words.
  // As 32-bit indices of 16-byte words from x (a launch has M <= 32 tokens and in < 2^30: they fit).
  const uint4* x16 = reinterpret_cast<const uint4*>(x);
  uint32_t xo[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xo[nt] = (uint32_t)min(8 * nt + g, M - 1) * (uint32_t)(in / 8) + q;
  // Lanes of tokens past M load no activations: their B columns hold zeros (their output columns are never stored), so
  // less data passes the L1 pipe, which binds on the H200 (M = 1..4: 1.00-1.14x; M = 1: a fourth of the lanes load).
  // NT = 1 keeps the item's 8 blocks across items, so those lanes keep the zeros of the start; NT > 1 loads the next
  // block as a select between the load and zeros, for K = 4 only (1.00-1.14x): the selects make K = 2, 3 (which decode
  // blocks in registers) and K = 5 slower.
  const bool xon = g < M;
  constexpr bool XSEL = NT > 1 && K == 4;
  // the first tile of this warp's range (its partial sums wait in shared memory until every warp is done)
  const int tf = u0 < u1 ? u0 / IPT : -1;
  if (u0 < u1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int kb = 0; kb < 8; ++kb)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(x16 + xo[nt] + 32u * (u0 - tf * IPT) + 4 * kb));
  }
  build_pair_table<T, K, true, NW * 32>(win, cb_lane, TiledScales<T>::SUM_TABLE);
  K2Regs cr{};
  if constexpr (K == 2) cr = codebook_bytes<T, 4>(cb_lane, TiledScales<T>::SUM_TABLE);
  K3Regs cr3{};
  if constexpr (K == 3 && R3 != 0) cr3 = codebook_bytes<T, 8>(cb_lane, TiledScales<T>::SUM_TABLE);
  __syncthreads();
  const uint32_t cl = table_lane<K, true>(lane);
  // The partial sums of the first and last tile of each warp's range, for the epilogue: warp w2's at [w2][side][nt],
  // side 0 its first tile's, side 1 its last tile's; 16 bytes per lane, so one vector store and load each.
  auto red_at = [&](int w2, int side, int nt) { return RED + (((w2 * 2 + side) * NT + nt) * 32 + lane) * 16u; };
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
  // the walk: tile cur, item v inside it; ring slot s with its mbarrier phase; the next item to fetch
  int cur = tf, v = u0 - tf * IPT, unext = u0 + S;
  uint32_t s = 0, phase = 0;
  const uint8_t* wnext = item_w(unext);
  const uint8_t* anext = item_a(unext);
  uint4 xv1[NT == 1 ? 8 : 1];  // NT = 1: the activations of all 8 blocks of the item
  for (uint4& r : xv1) r = make_uint4(0u, 0u, 0u, 0u);
  for (int u = u0; u < u1; ++u, ++v) {
    if (v == IPT) {  // the previous tile is done: keep the first one for the epilogue, store a middle one
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (cur == tf) {
          sts128_at(red_at(warp, 0, nt), acc[nt]);
        } else {
          store_tile<T>(y, bias, out, M, t0 + cur, nt, lane, sc, acc[nt], TiledScales<T>::SUM_POST);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
      }
      ++cur;
      v = 0;
    }
    // activations of block kb of the item (elements 256 v + 32 kb + 8 q .. + 7), per token tile
    const uint4* xi[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) xi[nt] = x16 + (xo[nt] + 32u * v);
    auto load_x = [&](int nt, int kb) {
      if constexpr (XSEL) {
        uint4 r = make_uint4(0u, 0u, 0u, 0u);
        if (8 * nt + g < M) r = __ldg(xi[nt] + 4 * kb);
        return r;
      } else {
        return __ldg(xi[nt] + 4 * kb);
      }
    };
    uint4 xn[NT > 1 ? NT : 1];  // NT > 1: the next block
    if constexpr (NT == 1) {
#pragma unroll
      for (int kb = 0; kb < 8; ++kb)
        if (xon) xv1[kb] = load_x(0, kb);
    } else {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) xn[nt] = load_x(nt, 0);
    }
    const uint32_t bar = wbar + 8 * s, sl = ring_addr<TEND, L::ITEM>(warp * S + s);
    mbar_wait(bar, phase);
    uint32_t w[L::WORDS];
    load_item_words<K>(sl, lane, w);
    const uint32_t sa = sl + L::ITEM_W;
    const uint32_t a0 = lds_at(sa + g * 4), a1 = lds_at(sa + (g + 8) * 4);
    const uint32_t a2 = lds_at(sa + 64 + g * 4), a3 = lds_at(sa + 64 + (g + 8) * 4);
    // every lane has read the slot: refill it (generic-proxy reads before the async-proxy write)
    fence_proxy_async();
    __syncwarp();
    if (lane == 0 && unext < u1) fetch_item<K>(sl, wnext, anext, bar);
    ++unext;
    wnext += L::ITEM_W;
    anext += ITEM_A;
    if (++s == S) {
      s = 0;
      phase ^= 1u;
    }
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {  // block kb of the item: chunk kb / 4, block kb % 4
      const uint32_t sg = kb < 4 ? a0 : a2, sh = kb < 4 ? a1 : a3;
      const int bb = kb & 3;
      uint32_t A[2][4];
      if (K == 2 && kb < TILED_K2_REG_BLOCKS) {  // some blocks decoded in registers (K2Regs, K3Regs)
        decode_k2_regs(w[kb], cr, A);
      } else if (K == 3 && ((R3 >> kb) & 1)) {
        uint32_t w0, w1;
        k3_block_words(w, kb, w0, w1);
        decode_k3_regs(w0, w1, cr3, A);
      } else {
        lookup_block<K, true>(w, kb, cl, A);
      }
      const float s0 = TiledScales<T>::sum_scale((sg >> (8 * bb)) & 0xFFu);
      const float s1 = TiledScales<T>::sum_scale((sh >> (8 * bb)) & 0xFFu);
      uint4 xc[NT > 1 ? NT : 1];
      if constexpr (NT > 1) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          xc[nt] = xn[nt];
          if (kb + 1 < 8) xn[nt] = load_x(nt, kb + 1);
        }
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 xv = NT == 1 ? xv1[kb] : xc[nt];
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        Mma<T>::run(d, A[0][0], A[0][1], A[0][2], A[0][3], xv.x, xv.y);
        Mma<T>::run(d, A[1][0], A[1][1], A[1][2], A[1][3], xv.z, xv.w);
        acc[nt][0] = fmaf(s0, d[0], acc[nt][0]);
        acc[nt][1] = fmaf(s0, d[1], acc[nt][1]);
        acc[nt][2] = fmaf(s1, d[2], acc[nt][2]);
        acc[nt][3] = fmaf(s1, d[3], acc[nt][3]);
      }
    }
  }
  // The last tile's partial: side 1, or side 0 when the range lies in one tile. A warp without items writes zeros
  // at side 0 (cur == tf == -1), so the warps adding to a tile are a contiguous run.
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) sts128_at(red_at(warp, cur == tf ? 0 : 1, nt), acc[nt]);
  __syncthreads();
  // Boundary tiles: the warp whose range holds a tile's first item stores it (its first tile if its range starts
  // there, and its last tile when that is not its first), adding the first-tile partials of the later warps whose
  // ranges start inside the tile, in warp order: deterministic, no atomics. This runs once, after the loop, on the
  // critical path of the last CTAs, so it is kept short: no loops over warps to find the run (lane l holds warp l's
  // first item, a ballot counts the run) and one vector load per partial (with loops over the warps the storing warp
  // spends 1100-1800 cycles here at the end of 4096x4096 and 14336x4096, the others about 600; this way 670-770 and
  // 66).
  if (u0 >= u1 || (u0 != tf * IPT && cur == tf)) return;  // no items, or no tile whose first item is in the range
  const int rb_lane = range_begin(lane < NW ? lane : NW);  // warp lane's first item (lane NW: the CTA's end)
#pragma unroll 1
  for (int side = 0; side < 2; ++side) {
    const int t = side ? cur : tf;  // cur: the range's last tile
    if (side == 1 && cur == tf) break;
    if (side == 0 && u0 != tf * IPT) continue;  // an earlier warp's range holds the tile's first item
    const int nlater = __popc(__ballot_sync(0xFFFFFFFFu, lane > warp && lane < NW && rb_lane < (t + 1) * IPT));
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float4 sum = lds_f4_if(red_at(warp, side, nt), true);
      // straight-line code, the loads predicated (zeros past the run): no loop to branch through at the end
#pragma unroll
      for (int j = 1; j < NW; ++j) {
        const float4 p = lds_f4_if(red_at(warp, 0, nt) + j * (2 * NT * 512), j <= nlater);  // = red_at(warp + j, 0, nt)
        sum.x += p.x;
        sum.y += p.y;
        sum.z += p.z;
        sum.w += p.w;
      }
      const float vv[4] = {sum.x, sum.y, sum.z, sum.w};
      store_tile<T>(y, bias, out, M, t0 + t, nt, lane, sc, vv, TiledScales<T>::SUM_POST);
    }
  }
}

// Batched decode on layers of many tiles (gemv_tiled_batch_kernel). In
// gemv_tiled_kernel each warp loads each item's activations itself (NT 16-byte loads per lane and block) at its own k:
// at M = 32..64 that is 8..16 times the weight bytes per item, from L2. Here the warps walk k in lockstep: per step v,
// two producer warps (one at NT = 2: tiled_batch_producers) fill a stage of the shared ring, one with columns 256 v .. 256 v
// + 255 of every token (cp.async, 16 bytes a lane, rows of 576 bytes: 512 + 64 keep the consumers' 16-byte reads
// conflict-free), the other with item v of each active tile (bulk copies; with one warp issuing both, the consumers
// wait for full stages in 29-33% of the kernel's stall samples). NW consumer warps each own
// one tile for the whole k range (rounds of NW tiles) and read the shared activations, and each warp stores its tile.
// Where the CTAs have few tiles (SPLIT > 1, gemv_tiled_batch_split) SPLIT warps share a tile, each decoding 8 / SPLIT
// of every item's 8 blocks (a chunk or a block pair), and after the k range the first adds the others' partial sums in
// order (shared memory, a barrier of the consumer warps; rounds of NW / SPLIT tiles). A stage: [NT * 8 token rows] [NW
// items' weights] [NW items' scales]; full barrier: the expect_tx arrival of the items' producer and the 32 lanes'
// cp.async arrivals of the activations' producer; empty barrier: the NW consumer warps. K = 5 uses its 64 KB table of
// 16 replicas here (table_end): with the 128 KB one only 4 consumer warps' stages fit, which are 1.05-1.54x slower.
// KS = 2 (layers of <= 4 tiles per SM, tiled_k_split): the CTAs form clusters of KS, a cluster owns the tiles that
// one CTA would own, and CTA rank c of it takes items [c IPT / KS, (c + 1) IPT / KS) of each. Each CTA then copies
// half the activations through its stages for twice the tiles: with one CTA per owner, a layer of 1..2 tiles per SM
// copied M x 512 bytes of activations per step next to 2 items of weights, and one of 3..4 left half the consumer
// warps without a tile. After each round the CTAs of ranks > 0 leave their tiles' sums in shared memory and rank 0
// adds them in rank order (distributed shared memory, between two cluster barriers; deterministic) and stores the
// tiles. Every thread, producers too, takes part in the cluster barriers.
template <typename T, int K, int NW, int XS, int NT, int SPLIT, int KS>
__global__ void __launch_bounds__((NW + tiled_batch_producers(NT)) * 32, 1)
    gemv_tiled_batch_kernel(const T* __restrict__ x, int M, const uint8_t* __restrict__ wt,
                            const uint8_t* __restrict__ at, const float* __restrict__ scale,
                            const float* __restrict__ codebook, const T* __restrict__ bias, int64_t out, int in,
                            T* __restrict__ y) {
#if !KBIT_SM90
  __trap();  // sm_90 only: the launcher refuses other devices
#endif
  using L = Tiled<K>;
  constexpr uint32_t XB = NT * 8 * XROW, STAGE = batch_stage_bytes<K, NW, NT>();
  static_assert(BARS + 16 * XS <= LOW, "shared-memory map");
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr uint32_t TEND = table_end<K, false>();
  pdl_launch_dependents();
  constexpr int TPR = NW / SPLIT, BPW = 8 / SPLIT;  // tiles per round; blocks of each item per consumer warp
  static_assert(KS == 1 || KS == 2, "k split");
  const TiledCta cta(smem, batch_smem_end<K, NW, XS, NT, SPLIT, KS>(), out, KS);
  // the window offsets below are the CTA's from wb on (KS > 1: its rank's part of the cluster's window)
  const uint32_t wb = KS == 1 ? 0u : cta.wb, FULL = wb + BARS, EMPTY = wb + BARS + 8 * XS;
  unsigned char* win = cta.win;
  const int lane = cta.lane, warp = cta.warp, g = lane >> 2, q = lane & 3;
  const int64_t t0 = cta.t0, t1 = cta.t1;
  const int IPT = in / 256;
  const int rank = KS == 1 ? 0 : (int)cluster_rank();
  const int v0 = rank * IPT / KS, v1 = (rank + 1) * IPT / KS;  // this CTA's items of each tile
  const int ntc = (int)(t1 - t0), rounds = (ntc + TPR - 1) / TPR;
  if (threadIdx.x == 0) {
    for (int s = 0; s < XS; ++s) {
      mbar_init(FULL + 8 * s, 33);
      mbar_init(EMPTY + 8 * s, NW);
    }
  }
  pdl_wait();  // every load below: the kernel before has finished
  const float sc = __ldg(scale);
  constexpr int NP = tiled_batch_producers(NT);
  build_pair_table<T, K, false, (NW + NP) * 32>(win, codebook_lane<K>(codebook, lane), TiledScales<T>::A_TABLE);
  __syncthreads();
  const int steps = rounds * (v1 - v0);
  if (warp >= NW) {  // the producers: NP = 2: warp NW the activations, warp NW + 1 the items; NP = 1: one warp both
    const bool acts = NP == 1 || warp == NW, items = NP == 1 || warp == NW + 1;
    const uint8_t* xb = reinterpret_cast<const uint8_t*>(x) + 16 * lane;
    // step j: item v of the round's tiles r TPR .. into stage j % XS
    auto fill = [&](int j, int r, int v) {
      const uint32_t s = j % XS, st = wb + ring_addr<TEND, STAGE>(s);
      if (j >= XS) mbar_wait(EMPTY + 8 * s, (j / XS - 1) & 1);
      fence_proxy_async();  // the consumers' reads of this stage before the copies' writes
      const int na = min(TPR, ntc - r * TPR);
      if (items) {
        if (lane == 0) mbar_expect_tx(FULL + 8 * s, na * L::ITEM);
        __syncwarp();
      }
      if (acts) {
        for (int m = 0; m < M; ++m)
          cp_async16(st + m * XROW + 16 * lane, xb + ((int64_t)m * in + 256 * v) * sizeof(T));
        cp_async_arrive(FULL + 8 * s);
      }
      if (items && lane < na) {
        const int64_t item = (t0 + r * TPR + lane) * IPT + v;
        bulk_copy(st + XB + lane * L::ITEM_W, wt + item * L::ITEM_W, L::ITEM_W, FULL + 8 * s);
        bulk_copy(st + XB + NW * L::ITEM_W + lane * ITEM_A, at + item * ITEM_A, ITEM_A, FULL + 8 * s);
      }
    };
    if constexpr (KS == 1) {  // one flat loop over the steps
      int r = 0, v = 0;
      for (int j = 0; j < steps; ++j) {
        fill(j, r, v);
        if (++v == IPT) {
          v = 0;
          ++r;
        }
      }
    } else {
      int j = 0;
      for (int r = 0; r < rounds; ++r) {
        for (int v = v0; v < v1; ++v, ++j) fill(j, r, v);
        cluster_sync();  // the consumers' two barriers of this round's sums (no stage of the next is filled between)
        cluster_sync();
      }
    }
    return;
  }
  const uint32_t cl = table_lane<K, false>(lane) | wb >> 8;  // lookup_block: wb's byte becomes the address's top byte
  // SPLIT > 1: warps tw SPLIT .. tw SPLIT + SPLIT - 1 share tile slot tw, part p taking blocks p BPW .. p BPW + BPW - 1
  // of each item (load_part_words)
  const int tw = warp / SPLIT, part = warp % SPLIT;
  const uint32_t red = wb + batch_partials<K, NW, XS, NT, SPLIT, KS>() + warp * (NT * 512) + lane * 16;
  int j = 0;
  for (int r = 0; r < rounds; ++r) {
    const bool active = r * TPR + tw < ntc;
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    for (int v = v0; v < v1; ++v, ++j) {
      const uint32_t s = j % XS, st = wb + ring_addr<TEND, STAGE>(s);
      mbar_wait(FULL + 8 * s, (j / XS) & 1);
      if (active) {
        const uint32_t iw = st + XB + tw * L::ITEM_W, ia = st + XB + NW * L::ITEM_W + tw * ITEM_A;
        uint32_t w[L::WORDS];
        load_part_words<K, SPLIT>(iw, part, lane, w);
        // the block scales of the part's chunk(s): sa[2 c], sa[2 c + 1] rows g, g + 8 of chunk c (SPLIT > 1: c = 0 is
        // the part's chunk)
        const uint32_t ca = ia + (SPLIT == 1 ? 0u : 64u * (uint32_t)(part * BPW / 4));
        uint32_t sa[4];
        sa[0] = lds_at(ca + g * 4);
        sa[1] = lds_at(ca + (g + 8) * 4);
        if constexpr (SPLIT == 1) {
          sa[2] = lds_at(ca + 64 + g * 4);
          sa[3] = lds_at(ca + 64 + (g + 8) * 4);
        }
        const int kb0 = part * BPW;  // the part's first block of the item (0 when SPLIT = 1)
#pragma unroll
        for (int kl = 0; kl < BPW; ++kl) {  // block kb0 + kl of the item: chunk (kb0 + kl) / 4, block (kb0 + kl) % 4
          const int kb = kb0 + kl, bb = kb & 3, ch = SPLIT == 1 ? kl / 4 : 0;
          const uint32_t p0 = TiledScales<T>::a_scale((sa[2 * ch] >> (8 * bb)) & 0xFFu);      // rows g
          const uint32_t p1 = TiledScales<T>::a_scale((sa[2 * ch + 1] >> (8 * bb)) & 0xFFu);  // rows g + 8
          uint32_t A[2][4];
          lookup_block<K, false, (KS > 1)>(w, kl, cl, A);
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) A[h][jj] = Mma<T>::mul2(A[h][jj], jj & 1 ? p1 : p0);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if (8 * nt < M) {
              const uint4 xv = lds128_at(st + (8 * nt + g) * XROW + kb * 64 + q * 16);
              Mma<T>::run(acc[nt], A[0][0], A[0][1], A[0][2], A[0][3], xv.x, xv.y);
              Mma<T>::run(acc[nt], A[1][0], A[1][1], A[1][2], A[1][3], xv.z, xv.w);
            }
          }
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(EMPTY + 8 * s);
    }
    if constexpr (SPLIT > 1) {
      // parts 1.. leave their sums in their region; after a barrier of the consumer warps, part 0 adds them in part
      // order (deterministic) and stores the tile; a second barrier before the next round's sums
      if (active && part > 0) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          if (8 * nt < M) sts128_at(red + nt * 512, acc[nt]);
      }
      bar_group(1, NW * 32);
      if (active && part == 0) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (8 * nt < M) {
#pragma unroll
            for (int p = 1; p < SPLIT; ++p) {
              const float4 o = lds_f4_if(red + p * (NT * 512) + nt * 512, true);
              acc[nt][0] += o.x;
              acc[nt][1] += o.y;
              acc[nt][2] += o.z;
              acc[nt][3] += o.w;
            }
          }
        }
      }
      if (r + 1 < rounds) bar_group(1, NW * 32);
    }
    if constexpr (KS > 1) {
      // ranks > 0 leave their sums (part 0's region: parts 1.. use theirs above); rank 0 adds them in rank order; the
      // second barrier keeps a region until rank 0 has read it (the next round's sums, or the CTA's exit)
      if (active && part == 0 && rank > 0) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          if (8 * nt < M) sts128_at(red + nt * 512, acc[nt]);
      }
      cluster_sync();
      if (active && part == 0 && rank == 0) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (8 * nt < M) {
#pragma unroll
            for (int c = 1; c < KS; ++c) {
              const float4 o = ld_cluster_f4(red + nt * 512, (uint32_t)c);
              acc[nt][0] += o.x;
              acc[nt][1] += o.y;
              acc[nt][2] += o.z;
              acc[nt][3] += o.w;
            }
          }
        }
      }
      cluster_sync();
    }
    if (active && part == 0 && rank == 0) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        if (8 * nt < M)
          store_tile<T>(y, bias, out, M, t0 + r * TPR + tw, nt, lane, sc, acc[nt], TiledScales<T>::A_POST);
    }
  }
}

// Where an index sits in the layout (kbit_hf/backends/cuda/tiled.py): byte B = 2 K b + K h + 2 m + rh (b < 4, h < 2,
// m < K / 2, rh < 2) of lane l = 4 g + q's 8 K bytes of chunk c holds the 8 / K indices of row 16 t + g + 8 rh from
// element 32 b + 8 q + 4 h + (8 / K) m of the chunk on, index i at bits K i. K = 5: byte B of the lane's first 32 is
// K = 4's byte B of the low nibbles (TiledByte<4>); the high bits follow (k5_high_bit).
template <int K>
struct TiledByte {
  int b, h, m, rh;
  __device__ explicit TiledByte(int B) : b(B / (2 * K)), h((B % (2 * K)) / K), m((B % K) >> 1), rh(B & 1) {}
  __device__ int element(int q) const { return 32 * b + 8 * q + 4 * h + (8 / K) * m; }  // its first, in the chunk
};
// K = 5: the bit of a lane's 64 high bits of a chunk (bytes 32 .. 39 of its 40, read as two words) that holds bit 4 of
// index s (0, 1) of the pair in the lane's low-nibble byte 8 b + 4 h + j: word b / 2, bit 16 h + 8 (b & 1) + 2 j + s
__host__ __device__ constexpr int k5_high_bit(int b, int h, int j, int s) {
  return 32 * (b >> 1) + 16 * h + 8 * (b & 1) + 2 * j + s;
}
// k3_byte, the K = 3 layout: lane byte 12 gi + 4 wi + j of a chunk (gi < 2: blocks 2 gi, 2 gi + 1; wi < 3; j < 4)
// holds in bits 0..5 the pair idx[e] | idx[e + 1] << 3 of register (h, j) of block b, (b, h) = (2 gi, 0), (2 gi, 1),
// (2 gi + 1, 0) for wi = 0, 1, 2, and in bits 6, 7 bits 2 wi, 2 wi + 1 of the pair of register (1, j) of block
// 2 gi + 1 (k3_spare); register (h, j) of block b is the pair at element 32 b + 8 q + 4 h + 2 (j >> 1) of row
// g + 8 (j & 1), as K = 4's.
// The bits of the byte's indices that the byte itself holds (K = 2, 4, 5): K, or K = 5's low 4
template <int K>
constexpr int byte_bits() {
  return K == 5 ? 4 : K;
}

// bit planes [out][in / 32 * K] + e4m4 absmax [out][in / 32] -> tiled: one thread per 4-byte word of tiled weights
// (and, for lane 0's first word of a block, the 16 scales of its (tile, chunk, block)); K = 5's high-bit words come
// after the low-nibble words of each (tile, chunk)
template <int K>
__global__ void tile_kernel(const uint32_t* __restrict__ packed, const uint8_t* __restrict__ absmax, int64_t out,
                            int in, uint32_t* __restrict__ wt, uint8_t* __restrict__ at) {
  constexpr int KB = byte_bits<K>();
  constexpr int LW = 2 * KB;     // words per lane and chunk (K = 5: of low nibbles; K = 3: 6, its own branch)
  constexpr int CW = 64 * K;     // words per (tile, chunk)
  const int C = in / 128, nb = in / 32;
  const int64_t nwords = out * (int64_t)in * K / 32;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nwords; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t tc = i / CW;  // word i = tc * CW + r
    const int r = (int)(i % CW);
    const int c = (int)(tc % C);
    const int64_t t = tc / C;
    uint32_t word = 0;
    if constexpr (K == 3) {  // word wl = 3 gi + wi of lane l
      const int l = r / 6, wl = r % 6, gi = wl / 3, wi = wl % 3;
      const int g = l >> 2, q = l & 3;
      auto pair = [&](int b, int h, int j) {  // register (h, j) of block b, from the bit planes
        const int64_t row = 16 * t + g + 8 * (j & 1);
        const int e = 8 * q + 4 * h + 2 * (j >> 1);
        const uint32_t* p = packed + (row * nb + 4 * c + b) * 3;
        uint32_t v = 0;
#pragma unroll
        for (int pl = 0; pl < 3; ++pl) {
          const uint32_t x = __ldg(p + pl);
          v |= ((x >> e) & 1u) << pl | ((x >> (e + 1)) & 1u) << (3 + pl);
        }
        return v;
      };
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t byte = pair(2 * gi + (wi == 2), wi == 1, j) | ((pair(2 * gi + 1, 1, j) >> (2 * wi)) & 3u) << 6;
        word |= byte << (8 * j);
      }
      if (l == 0 && wl < 4)
        for (int rr = 0; rr < 16; ++rr) at[(tc * 16 + rr) * 4 + wl] = absmax[(16 * t + rr) * nb + 4 * c + wl];
    } else if (r < 32 * LW) {  // word wi of lane l
      const int wi = r % LW, l = r / LW;
      const int g = l >> 2, q = l & 3;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const TiledByte<KB> pos((4 * wi + j) ^ (int)half_swizzle<K>(l));  // the byte it holds
        const int64_t row = 16 * t + g + 8 * pos.rh;
        const int e = pos.element(q) - 32 * pos.b;  // inside block 4 c + b
        const uint32_t* p = packed + (row * nb + 4 * c + pos.b) * K;
        uint32_t byte = 0;
#pragma unroll
        for (int pl = 0; pl < KB; ++pl) {
          const uint32_t v = __ldg(p + pl);
#pragma unroll
          for (int ii = 0; ii < 8 / KB; ++ii) byte |= ((v >> (e + ii)) & 1u) << (KB * ii + pl);
        }
        word |= byte << (8 * j);
      }
      if (l == 0 && (4 * wi) % (2 * KB) == 0) {
        const int b = 4 * wi / (2 * KB);
        for (int rr = 0; rr < 16; ++rr) at[(tc * 16 + rr) * 4 + b] = absmax[(16 * t + rr) * nb + 4 * c + b];
      }
    } else {  // K = 5: high-bit word hw of lane l
      const int l = (r - 32 * LW) >> 1, hw = (r - 32 * LW) & 1;
      const int g = l >> 2, q = l & 3;
#pragma unroll
      for (int bit = 0; bit < 32; ++bit) {  // = k5_high_bit(2 hw + o, h, j, s) - 32 hw
        const int h = bit >> 4, o = (bit >> 3) & 1, j = (bit >> 1) & 3, s = bit & 1;
        const int64_t row = 16 * t + g + 8 * (j & 1);
        const uint32_t v = __ldg(packed + (row * nb + 4 * c + 2 * hw + o) * K + 4);
        word |= ((v >> (8 * q + 4 * h + 2 * (j >> 1) + s)) & 1u) << bit;
      }
    }
    wt[i] = word;
  }
}

// tiled -> bit planes: one thread per (row, block); gathers the block's 4 K bytes
template <int K>
__global__ void untile_kernel(const uint8_t* __restrict__ wt, const uint8_t* __restrict__ at, int64_t out, int in,
                              uint32_t* __restrict__ packed, uint8_t* __restrict__ absmax) {
  constexpr int KB = byte_bits<K>();
  const int C = in / 128, nb = in / 32;
  const int64_t nblk = out * (int64_t)nb;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < nblk; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / nb;
    const int blk = (int)(i - r * nb), c = blk >> 2, b = blk & 3;
    const int64_t t = r >> 4;
    const int rr = (int)(r & 15), g = rr & 7, hi = rr >> 3;
    const uint8_t* chunk = wt + (t * C + c) * Tiled<K>::CHUNK_W;
    uint32_t pl[K] = {};
    if constexpr (K == 3) {
      for (int q = 0; q < 4; ++q) {
        const uint8_t* lb = chunk + (4 * g + q) * 24 + 12 * (b >> 1);  // the lane's block pair (k3_byte)
        for (int h = 0; h < 2; ++h)
          for (int m = 0; m < 2; ++m) {
            const int j = 2 * m + hi;
            uint32_t P = 0;
            if ((b & 1) == 0 || h == 0) {
              P = lb[4 * ((b & 1) ? 2 : h) + j] & 63u;
            } else {
              for (int wi = 0; wi < 3; ++wi) P |= ((uint32_t)(lb[4 * wi + j] >> 6) & 3u) << (2 * wi);
            }
            const int e = 8 * q + 4 * h + 2 * m;
            for (int j2 = 0; j2 < 3; ++j2) pl[j2] |= ((P >> j2) & 1u) << e | ((P >> (3 + j2)) & 1u) << (e + 1);
          }
      }
    } else {
      for (int q = 0; q < 4; ++q)
        for (int h = 0; h < 2; ++h)
          for (int m = 0; m < KB / 2; ++m) {
            const int B = 2 * KB * b + KB * h + 2 * m + hi;
            const int Bs = B ^ (int)half_swizzle<K>(4 * g + q);  // where the layout keeps it
            const uint32_t byte = chunk[(4 * g + q) * (8 * KB) + Bs];
            const int e = TiledByte<KB>(B).element(q) - 32 * b;
#pragma unroll
            for (int ii = 0; ii < 8 / KB; ++ii)
#pragma unroll
              for (int j = 0; j < KB; ++j) pl[j] |= ((byte >> (KB * ii + j)) & 1u) << (e + ii);
            if constexpr (K == 5) {
              const uint8_t* high = chunk + 32 * 32 + (4 * g + q) * 8;
              for (int s = 0; s < 2; ++s) {
                const int hb = k5_high_bit(b, h, 2 * m + hi, s);
                pl[4] |= ((uint32_t)(high[hb >> 3] >> (hb & 7)) & 1u) << (e + s);
              }
            }
          }
    }
#pragma unroll
    for (int j = 0; j < K; ++j) packed[i * K + j] = pl[j];
    absmax[i] = at[((t * C + c) * 16 + rr) * 4 + b];
  }
}

// tiled -> dense weights in TO, bitwise the values of dequant_kernel ((cb * d) * scale in fp32, one rounding): one
// thread per (tile, chunk, lane, block), i.e. 8 consecutive elements of two rows (2 K bytes)
// 16-bit outputs: 8 blocks of 256 threads per SM (32 registers, the pairs packed as they are made; sm_86 / sm_89 hold
// 1536 threads per SM, so 6 there). Against 6 blocks of 40 registers, on the H200: K = 2, 3 83.2-86.0% of copy
// instead of 80.4-82.2%, K = 4 86.5-88.7% instead of 85.2-86.9%, K = 5 82.6-86.5% instead of 82.1-83.8%; H100 the
// same (86.3-90.7%).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 860 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 890)
constexpr int DQT_BLOCKS_PER_SM = 6;
#else
constexpr int DQT_BLOCKS_PER_SM = 8;
#endif
template <int K, typename TO>
__global__ void __launch_bounds__(256, sizeof(TO) == 2 ? DQT_BLOCKS_PER_SM : 1)
    dequant_tiled_kernel(const uint8_t* __restrict__ wt, const uint8_t* __restrict__ at,
                         const float* __restrict__ scale, const float* __restrict__ codebook, int64_t out, int in,
                         TO* __restrict__ y) {
  constexpr int KB = byte_bits<K>();
  const int C = in / 128;
  const float sc = scale[0];
  const float cb = codebook[threadIdx.x & ((1 << K) - 1)];  // lane l holds cb[l % 2^K]: lookups by shuffle
  const int64_t n = out * (int64_t)in / 16;                  // threads of work; uniform loop bounds per warp (shuffles)
  for (int64_t i0 = blockIdx.x * (int64_t)blockDim.x + (threadIdx.x & ~31); i0 < n;
       i0 += (int64_t)gridDim.x * blockDim.x) {
    const int64_t i = i0 + (threadIdx.x & 31);
    const bool valid = i < n;
    const int64_t ii = valid ? i : 0;  // = ((t * C + c) * 32 + l) * 4 + b
    const int b = (int)(ii & 3), l = (int)((ii >> 2) & 31);
    const int64_t tc = ii >> 7;
    // (t, c) by a 32-bit division where tc fits (any layer under 2^43 elements): the 64-bit one is a subroutine of
    // about 70 instructions
    const bool narrow = tc >> 32 == 0;
    const int c = narrow ? (int)((uint32_t)tc % (uint32_t)C) : (int)(tc % C);
    const int64_t t = narrow ? (int64_t)((uint32_t)tc / (uint32_t)C) : tc / C;
    const int g = l >> 2, q = l & 3;
    const uint32_t s0 = at[(tc * 16 + g) * 4 + b], s1 = at[(tc * 16 + g + 8) * 4 + b];
    const float d[2] = {e4m4_decode(s0), e4m4_decode(s1)};
    // [row g / g + 8][element 8 q + ..] (compile-time indices only: they stay in registers). 16-bit outputs are packed
    // in pairs as soon as a pair is made (put is called for e even, then e + 1): 8 live registers instead of 16
    float v[2][8];
    uint32_t pk[2][4];
    float even = 0.f;
    auto put = [&](int rh, int e, uint32_t idx) {
      const float c = __shfl_sync(0xFFFFFFFFu, cb, (int)idx);
      const float val = __fmul_rn(__fmul_rn(c, d[rh]), sc);
      if constexpr (sizeof(TO) == 2) {
        if (e & 1) {
          pk[rh][e >> 1] = Mma<TO>::pack(even, val);
        } else {
          even = val;
        }
      } else {
        v[rh][e] = val;
      }
    };
    if constexpr (K == 3) {  // the block pair's three words (k3_byte); an odd block reads its word and k3_spare's
      const uint32_t* lw = reinterpret_cast<const uint32_t*>(wt + tc * Tiled<K>::CHUNK_W + l * 24 + 12 * (b >> 1));
      const uint32_t w0 = lw[0], w1 = lw[1], w2 = lw[2];
      const uint32_t pw[2] = {(b & 1) ? w2 : w0, (b & 1) ? k3_spare(w0, w1, w2) : w1};
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // register (h, j): row g + 8 (j & 1), elements 4 h + 2 (j >> 1) + 0, 1
          const uint32_t P = pw[h] >> (8 * j);
          put(j & 1, 4 * h + 2 * (j >> 1), P & 7u);
          put(j & 1, 4 * h + 2 * (j >> 1) + 1, (P >> 3) & 7u);
        }
    } else {
      const uint32_t bo = (2 * KB * b) ^ half_swizzle<K>(l);
      const uint8_t* lw = wt + tc * Tiled<K>::CHUNK_W + l * (8 * KB) + bo;  // the lane's bytes of block b
      uint32_t wd[KB / 2];  // bytes 2 K b .. 2 K b + 2 K - 1 of the lane's chunk
      if constexpr (KB == 4) {
        const uint2 u = *reinterpret_cast<const uint2*>(lw);
        wd[0] = u.x;
        wd[1] = u.y;
      } else {
        wd[0] = *reinterpret_cast<const uint32_t*>(lw);
      }
      uint32_t hw = 0;  // K = 5: the block's high bits, bit 16 h + 2 j + s (k5_high_bit for b = 0)
      if constexpr (K == 5)
        hw = *reinterpret_cast<const uint32_t*>(wt + tc * Tiled<K>::CHUNK_W + 32 * 32 + l * 8 + 4 * (b >> 1)) >>
             (8 * (b & 1));
#pragma unroll
      for (int B = 0; B < 2 * KB; ++B) {  // byte 2 K b + B of the lane's chunk: its place inside the block is B's
        const TiledByte<KB> p(B);
        const uint32_t byte = (wd[B >> 2] >> (8 * (B & 3))) & 0xFFu;
#pragma unroll
        for (int k = 0; k < 8 / KB; ++k) {
          uint32_t idx = (byte >> (KB * k)) & ((1u << KB) - 1);
          if constexpr (K == 5) idx |= ((hw >> k5_high_bit(0, p.h, B & 3, k)) & 1u) << 4;
          put(p.rh, p.element(0) + k, idx);
        }
      }
    }
    if (!valid) continue;
#pragma unroll
    for (int row = 0; row < 2; ++row) {
      TO* dst = y + (16 * t + g + 8 * row) * (int64_t)in + 128 * c + 32 * b + 8 * q;
      if constexpr (sizeof(TO) == 2) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(pk[row][0], pk[row][1], pk[row][2], pk[row][3]);
      } else {
        *reinterpret_cast<float4*>(dst) = make_float4(v[row][0], v[row][1], v[row][2], v[row][3]);
        *reinterpret_cast<float4*>(dst + 4) = make_float4(v[row][4], v[row][5], v[row][6], v[row][7]);
      }
    }
  }
}

bool tiled_shape(int64_t out, int64_t in) {
  return out > 0 && in > 0 && out % 16 == 0 && in % 256 == 0 && in < (1 << 30);
}

// Launches a tiled GEMV with programmatic stream serialization (pdl_wait: kbit_common.cuh): it may start while the
// kernel before it drains. Both GEMVs are persistent, one CTA per SM, so an early start only takes SMs that the kernel
// before has left.
// launch_config: the launch configuration of a GEMV or of the GEMM's kernels (pdl: with programmatic stream
// serialization; cluster > 1: in clusters of that many CTAs, the batched kernel's k split), its attributes in attr.
cudaLaunchConfig_t launch_config(dim3 grid, unsigned threads, int dyn, cudaStream_t st, unsigned cluster, bool pdl,
                                 cudaLaunchAttribute (&attr)[2]) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = (size_t)dyn;
  cfg.stream = st;
  unsigned n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n++].val.clusterDim = {cluster, 1, 1};
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cfg;
}
template <typename Kernel, typename... Args>
int launch_gemv(Kernel kernel, unsigned grid, unsigned threads, int dyn, cudaStream_t st, unsigned cluster,
                Args... args) {
  cudaLaunchAttribute attr[2];
  const cudaLaunchConfig_t cfg = launch_config(grid, threads, dyn, st, cluster, true, attr);
  return (int)cudaLaunchKernelEx(&cfg, kernel, args...);
}

// One instantiation's launch (its dynamic shared-memory limit is raised once per device).
template <typename T, int K, int NW, int S, int NT, int R3>
int gemv_tiled_go(const T* x, int M, const uint8_t* wt, const uint8_t* at, const float* scale, const float* cb,
                  const T* bias, int64_t out, int64_t in, T* y, int dev, int sms, cudaStream_t st) {
  static bool attr_set[64] = {};  // current_device_sms: dev < 64
  const int dyn = (int)range_smem_end<K, NW, S, NT>();
  if (!attr_set[dev]) {
    const cudaError_t e = cudaFuncSetAttribute(gemv_tiled_kernel<T, K, NW, S, NT, R3>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
    if (e != cudaSuccess) return (int)e;
    attr_set[dev] = true;
  }
  return launch_gemv(gemv_tiled_kernel<T, K, NW, S, NT, R3>, (unsigned)sms, NW * 32, dyn, st, 1u, x, M, wt, at, scale,
                     cb, bias, out, (int)in, y);
}

// The batched kernel's launch: NW consumer warps and tiled_batch_producers producer warps, XS stages, SPLIT consumer warps
// per tile, grid CTAs in clusters of KS (batch_owners).
template <typename T, int K, int NW, int XS, int NT, int SPLIT, int KS>
int gemv_tiled_batch_go(const T* x, int M, const uint8_t* wt, const uint8_t* at, const float* scale, const float* cb,
                        const T* bias, int64_t out, int64_t in, T* y, int dev, unsigned grid, cudaStream_t st) {
  static bool attr_set[64] = {};
  constexpr uint32_t dyn = batch_smem_end<K, NW, XS, NT, SPLIT, KS>();
  static_assert(dyn <= 227 * 1024, "the batched kernel's shared window exceeds sm_90's 227 KB");
  if (!attr_set[dev]) {
    const cudaError_t e = cudaFuncSetAttribute(gemv_tiled_batch_kernel<T, K, NW, XS, NT, SPLIT, KS>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn);
    if (e != cudaSuccess) return (int)e;
    attr_set[dev] = true;
  }
  return launch_gemv(gemv_tiled_batch_kernel<T, K, NW, XS, NT, SPLIT, KS>, grid, (NW + tiled_batch_producers(NT)) * 32,
                     (int)dyn, st, (unsigned)KS, x, M, wt, at, scale, cb, bias, out, (int)in, y);
}
// The batched kernel's tile owners: KS = 1 a CTA per SM; else the clusters of KS CTAs that fit at once
// (cudaOccupancyMaxActiveClusters, once per device; the same for every SPLIT: their shared windows are equal). 0 and
// an error code in rc if the query fails.
template <typename T, int K, int NW, int XS, int NT, int KS>
int batch_owners(int dev, int sms, int& rc) {
  if (KS == 1) return sms;
  static int owners[64] = {};
  if (owners[dev] == 0) {
    auto kernel = gemv_tiled_batch_kernel<T, K, NW, XS, NT, 1, KS>;
    constexpr uint32_t dyn = batch_smem_end<K, NW, XS, NT, 1, KS>();
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn);
    cudaLaunchAttribute attr[2];
    const cudaLaunchConfig_t cfg =
        launch_config(KS * sms, (NW + tiled_batch_producers(NT)) * 32, (int)dyn, nullptr, KS, false, attr);
    int n = 0;
    if (e == cudaSuccess) e = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
    if (e != cudaSuccess || n < 1) {
      rc = e != cudaSuccess ? (int)e : (int)cudaErrorInvalidConfiguration;
      return 0;
    }
    owners[dev] = n;
  }
  return owners[dev];
}
// SPLIT warps per tile: tiled_batch_split's choice for the busiest tile owner, or split > 0 (forced: tests).
template <typename T, int K, int NW, int XS, int NT, int KS>
int gemv_tiled_batch_split(const T* x, int M, const uint8_t* wt, const uint8_t* at, const float* scale, const float* cb,
                           const T* bias, int64_t out, int64_t in, T* y, int dev, int sms, int split,
                           cudaStream_t st) {
  int rc = 0;
  const int owners = batch_owners<T, K, NW, XS, NT, KS>(dev, sms, rc);
  if (owners == 0) return rc;
  const unsigned grid = (unsigned)(KS * owners);
  const int64_t most = (out / 16 + owners - 1) / owners;  // tiles of the busiest owner (TiledCta: an even split)
  if (split == 0) split = tiled_batch_split(K, NT, KS, NW, most);
  if (split == 4)
    return gemv_tiled_batch_go<T, K, NW, XS, NT, 4, KS>(x, M, wt, at, scale, cb, bias, out, in, y, dev, grid, st);
  if (split == 2)
    return gemv_tiled_batch_go<T, K, NW, XS, NT, 2, KS>(x, M, wt, at, scale, cb, bias, out, in, y, dev, grid, st);
  return gemv_tiled_batch_go<T, K, NW, XS, NT, 1, KS>(x, M, wt, at, scale, cb, bias, out, in, y, dev, grid, st);
}
// ks = 2: the k range split over clusters of 2 CTAs (gemv_tiled_batch_kernel)
template <typename T, int K, int NT>
int gemv_tiled_batch_ks(const T* x, int M, const uint8_t* wt, const uint8_t* at, const float* scale, const float* cb,
                        const T* bias, int64_t out, int64_t in, T* y, int dev, int sms, int split, int ks,
                        cudaStream_t st) {
  constexpr int NW = TILED_BATCH_WARPS, XS = tiled_batch_stages(NT);
  if (ks == 2)
    return gemv_tiled_batch_split<T, K, NW, XS, NT, 2>(x, M, wt, at, scale, cb, bias, out, in, y, dev, sms, split, st);
  return gemv_tiled_batch_split<T, K, NW, XS, NT, 1>(x, M, wt, at, scale, cb, bias, out, in, y, dev, sms, split, st);
}
// The range kernel at NT token tiles (M <= 8 NT <= 32): tiled_range_warps warps of TILED_RANGE_SLOTS ring slots; K = 3
// decodes the blocks of TILED_K3_REG_MASK in registers from M = TILED_K3_REG_MIN_M on (so at NT > 1 always).
template <typename T, int K, int NT>
int gemv_tiled_range(const T* x, int M, const uint8_t* wt, const uint8_t* at, const float* scale, const float* cb,
                     const T* bias, int64_t out, int64_t in, T* y, int dev, int sms, cudaStream_t st) {
  constexpr int NW = tiled_range_warps(NT), S = TILED_RANGE_SLOTS, R3 = K == 3 ? TILED_K3_REG_MASK : 0;
  static_assert(NT == 1 || TILED_K3_REG_MIN_M <= 9, "NT > 1 (M >= 9) decodes K = 3 in registers unconditionally");
  if constexpr (NT == 1) {
    if (M < TILED_K3_REG_MIN_M)
      return gemv_tiled_go<T, K, NW, S, NT, 0>(x, M, wt, at, scale, cb, bias, out, in, y, dev, sms, st);
  }
  return gemv_tiled_go<T, K, NW, S, NT, R3>(x, M, wt, at, scale, cb, bias, out, in, y, dev, sms, st);
}

// The tiled GEMV. kernel: KBIT_TILED_AUTO, the library's choice (tiled_batch, tiled_k_split, tiled_batch_split), or
// KBIT_TILED_RANGE / KBIT_TILED_BATCH* (+ KBIT_TILED_KS2) to force one (kbit_gemv_tiled_kernel: tests, benchmarks).
// The range kernel runs launches of at most TILED_RANGE_MAX_M tokens.
template <typename T, int K>
int gemv_tiled_launch(const T* x, int M, const uint8_t* wt, const uint8_t* at, const float* scale, const float* cb,
                      const T* bias, int64_t out, int64_t in, T* y, int kernel, cudaStream_t st) {
  int dev = 0, sms = 0, major = 0;
  if (!current_device_sms(dev, sms) || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != 0)
    return (int)cudaErrorInvalidDevice;
  if (major < 9) return (int)cudaErrorNotSupported;
  const int64_t tiles = out / 16;
  const int base = kernel & 7;
  const bool batch = kernel == KBIT_TILED_AUTO ? tiled_batch(K, M, tiles, in, sms) : base >= KBIT_TILED_BATCH;
  if (batch) {
    const int ks = kernel == KBIT_TILED_AUTO ? tiled_k_split(tiles, sms) : kernel & KBIT_TILED_KS2 ? 2 : 1;
    const int split = base == KBIT_TILED_BATCH1   ? 1
                      : base == KBIT_TILED_BATCH2 ? 2
                      : base == KBIT_TILED_BATCH4 ? 4
                                                  : 0;  // 0: tiled_batch_split's choice
    switch (tiled_batch_token_tiles(M)) {
      case 2: return gemv_tiled_batch_ks<T, K, 2>(x, M, wt, at, scale, cb, bias, out, in, y, dev, sms, split, ks, st);
      case 4: return gemv_tiled_batch_ks<T, K, 4>(x, M, wt, at, scale, cb, bias, out, in, y, dev, sms, split, ks, st);
      default: return gemv_tiled_batch_ks<T, K, 8>(x, M, wt, at, scale, cb, bias, out, in, y, dev, sms, split, ks, st);
    }
  }
  switch (token_tiles(M)) {
    case 1: return gemv_tiled_range<T, K, 1>(x, M, wt, at, scale, cb, bias, out, in, y, dev, sms, st);
    case 2: return gemv_tiled_range<T, K, 2>(x, M, wt, at, scale, cb, bias, out, in, y, dev, sms, st);
    case 4: return gemv_tiled_range<T, K, 4>(x, M, wt, at, scale, cb, bias, out, in, y, dev, sms, st);
    default: break;
  }
  for (int m0 = 0; m0 < M; m0 += TILED_RANGE_MAX_M) {
    const int m = M - m0 < TILED_RANGE_MAX_M ? M - m0 : TILED_RANGE_MAX_M;
    const int rc = gemv_tiled_launch<T, K>(x + m0 * in, m, wt, at, scale, cb, bias, out, in, y + m0 * out,
                                           KBIT_TILED_RANGE, st);
    if (rc != 0) return rc;
  }
  return 0;
}

// ---- tensor-core GEMM over the tiled layout (gemm_tiled_kernel: M > 64 tokens; sm_90a, wgmma) ----
// The product is computed transposed: y^T [out, M] = W [out, in] x^T, so the weight is wgmma's A operand, decoded into
// registers, and the activations are its B operand, read by the tensor cores from shared memory.
// CTA: GEMM_WARPS = 8 consumer warps (two warpgroups) and a producer warpgroup; its tile is 128 weight rows (consumer
// warp w decodes tile blockIdx.x * 8 + w, warpgroup w / 4 rows 64 (w / 4) ..) by BN = 128 or 256 tokens (blockIdx.y),
// over items [v0, v1) of the k range (blockIdx.z of `splits`; splits > 1 leave fp32 partial sums in a workspace,
// summed in split order by gemm_reduce_kernel). Producer: one lane fills GEMM_STAGES stages of 32 KB, TMA boxes of
// 64 k x BN tokens (128-byte rows, 128-byte swizzle: wgmma's K-major canonical layout; tokens past M are
// zero-filled), 128 k per stage at BN = 128, 64 at 256. Consumers: each lane reads its own weight words and block
// scales of the next item straight from global memory (a register double buffer; no other warp needs them), decodes a
// block with the pair table (lookup_block) times its block scale (a_scale): the GEMVs' m16n8k16 A operands, whose k
// order inside a block (lane q holds elements 8 q .. 8 q + 7) is not wgmma's natural order of B in shared memory, so
// x is first copied permuted to match into the workspace (gemm_k_order_kernel). Then one m64nBNk16 wgmma per k
// slice, A from registers, B from the stage (descriptor: the slice's 32-byte column of the swizzled rows). Epilogue:
// wgmma_store_staged (kbit_sm90.cuh) through stages 1 and 2. The k-order copy, the GEMM and the split reduction are
// launched with programmatic dependent launch: each starts (barriers, launch) while the one before drains.
constexpr int GEMM_WARPS = 8, GEMM_THREADS = GEMM_WARPS * 32 + 128, GEMM_STAGES = 4;
// registers per thread after setmaxnreg: the producer warpgroup gives its own to the consumers' accumulators
constexpr int GEMM_PRODUCER_REGS = 40, GEMM_CONSUMER_REGS = 232;
static_assert((GEMM_PRODUCER_REGS + 2 * GEMM_CONSUMER_REGS) * 128 <= 65536, "register file");
// a stage: 32 KB of x, BN tokens by 128 (BN = 128: two 64-element boxes) or 64 (BN = 256: one box) k
constexpr uint32_t GEMM_STAGE = 0x8000;
constexpr uint32_t gemm_box(int BN) { return (uint32_t)BN * 128; }
constexpr int gemm_stage_blocks(int BN) { return (int)(GEMM_STAGE / gemm_box(BN)) * 2; }  // 32-element blocks
// stage 0 below the pair table, the others above it (1024-byte aligned: the swizzle's period)
__host__ __device__ constexpr uint32_t gemm_stage_addr(int s) {
  return s == 0 ? 0x2000u : 0x20000u + (uint32_t)(s - 1) * GEMM_STAGE;
}
constexpr uint32_t GEMM_FULL = BARS, GEMM_EMPTY = BARS + 8 * GEMM_STAGES;
constexpr uint32_t GEMM_SMEM_END = gemm_stage_addr(GEMM_STAGES - 1) + GEMM_STAGE;
static_assert(gemm_stage_addr(0) + GEMM_STAGE <= TABLE && GEMM_EMPTY + 8 * GEMM_STAGES <= gemm_stage_addr(0) &&
                  GEMM_SMEM_END <= 227 * 1024,
              "GEMM shared-memory map");

// wgmma's A registers of the two k slices of block kb of the item (words w, block-scale words sa as the batched GEMV
// reads them): the GEMV's m16n8k16 A operands (lookup_block) times the rows' block scales. Slice h holds elements
// 8 q + 4 h + j of the block at the MMA's k index 2 q + j (j < 2) or 8 + 2 q + j - 2: x is given in that order
// (kbit_api.h, kbit_gemm_tiled)
template <typename T, int K>
__device__ __forceinline__ void gemm_block_a(const uint32_t (&w)[Tiled<K>::WORDS], const uint32_t (&sa)[4], int kb,
                                             uint32_t cl, uint32_t (&a)[2][4]) {
  const int bb = kb & 3, ch = kb >> 2;
  const uint32_t p0 = TiledScales<T>::a_scale((sa[2 * ch] >> (8 * bb)) & 0xFFu);      // rows g
  const uint32_t p1 = TiledScales<T>::a_scale((sa[2 * ch + 1] >> (8 * bb)) & 0xFFu);  // rows g + 8
  lookup_block<K, false>(w, kb, cl, a);
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < 4; ++j) a[h][j] = Mma<T>::mul2(a[h][j], j & 1 ? p1 : p0);
}

template <typename T, int K, int BN>
__global__ void __launch_bounds__(GEMM_THREADS, 1)
    gemm_tiled_kernel(const __grid_constant__ CUtensorMap xmap, int M, const uint8_t* __restrict__ wt,
                      const uint8_t* __restrict__ at, const float* __restrict__ scale,
                      const float* __restrict__ codebook, const T* __restrict__ bias, int64_t out, int in,
                      T* __restrict__ y, float* __restrict__ ws, int splits) {
#if !KBIT_WGMMA
  __trap();  // sm_90a only: the launcher refuses other devices (the rest compiles everywhere, its wgmmas to nothing)
#endif
  using L = Tiled<K>;
  extern __shared__ __align__(128) unsigned char smem[];  // window addresses: 1024-aligned stages
  const uint32_t base = (uint32_t)__cvta_generic_to_shared(smem);
  unsigned char* win = smem - base;
  {
    uint32_t dsz;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dsz));
    if (base > BARS || base + dsz < GEMM_SMEM_END) __trap();
  }
  const int lane = threadIdx.x & 31, warp = __shfl_sync(0xFFFFFFFFu, (int)threadIdx.x >> 5, 0);
  const int g = lane >> 2, q = lane & 3;
  const int IPT = in / 256, split = blockIdx.z;
  const int v0 = (int)((int64_t)split * IPT / splits), v1 = (int)((int64_t)(split + 1) * IPT / splits);
  constexpr uint32_t BOX = gemm_box(BN);
  constexpr int SB = gemm_stage_blocks(BN);  // blocks per stage
  const int steps = 8 / SB * (v1 - v0), n0 = blockIdx.y * BN;
  if (threadIdx.x == 0) {
    for (int s = 0; s < GEMM_STAGES; ++s) {
      mbar_init(GEMM_FULL + 8 * s, 1);
      mbar_init(GEMM_EMPTY + 8 * s, GEMM_WARPS);
    }
  }
  pdl_wait();  // every global read below: the kernel before (gemm_k_order_kernel) has finished
  build_pair_table<T, K, false, GEMM_THREADS>(win, codebook_lane<K>(codebook, lane), TiledScales<T>::A_TABLE);
  __syncthreads();
  if (warp >= GEMM_WARPS) {  // the producer warpgroup: one lane issues the copies
#if KBIT_WGMMA
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(GEMM_PRODUCER_REGS));
#endif
    if (warp == GEMM_WARPS && lane == 0) {
      for (int j = 0; j < steps; ++j) {
        const int s = j % GEMM_STAGES;
        if (j >= GEMM_STAGES) mbar_wait(GEMM_EMPTY + 8 * s, (j / GEMM_STAGES - 1) & 1);
        mbar_expect_tx(GEMM_FULL + 8 * s, GEMM_STAGE);
        const int k0 = 256 * v0 + 32 * SB * j;
#pragma unroll
        for (int b = 0; b < SB / 2; ++b)
          tma_load_2d(gemm_stage_addr(s) + b * BOX, &xmap, k0 + 64 * b, n0, GEMM_FULL + 8 * s);
      }
    }
    return;
  }
#if KBIT_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(GEMM_CONSUMER_REGS));
#endif
  const int64_t t = (int64_t)blockIdx.x * GEMM_WARPS + warp;  // this warp's tile
  const bool active = t < out / 16;
  const uint32_t cl = table_lane<K, false>(lane);
  const uint8_t* witem = wt + (active ? t : 0) * IPT * (int64_t)L::ITEM_W;
  const uint8_t* aitem = at + (active ? t : 0) * IPT * (int64_t)ITEM_A;
  // (volatile loads: the compiler would otherwise move these read-only loads down to the registers' use, an item
  // later, and every item would wait for its weights)
  auto load_item = [&](int v, uint32_t(&w)[L::WORDS], uint32_t(&sa)[4]) {
    const uint8_t* wi = witem + (int64_t)v * L::ITEM_W;
    load_item_words_by<K>([wi](uint32_t o) { return ldg64_now(wi + o); }, [wi](uint32_t o) { return ldg128_now(wi + o); },
                          lane, w);
    const uint8_t* ai = aitem + (int64_t)v * ITEM_A;
    sa[0] = ldg32_now(ai + 4 * g);
    sa[1] = ldg32_now(ai + 4 * (g + 8));
    sa[2] = ldg32_now(ai + 4 * (16 + g));
    sa[3] = ldg32_now(ai + 4 * (24 + g));
  };
  // the A registers of block kb of the item in w, sa (zeros for a warp past the layer's last tile: the wgmmas are
  // the warpgroup's, every warp takes part)
  auto decode = [&](const uint32_t(&w)[L::WORDS], const uint32_t(&sa)[4], int kb, uint32_t(&a)[2][4]) {
    if (active) {
      gemm_block_a<T, K>(w, sa, kb, cl, a);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i >> 2][i & 3] = 0u;
    }
  };
  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  // Software pipeline by block: block kb's two wgmmas run while block kb + 1 is decoded into the other register set
  // (wgmma.wait_group 1 first: the set's last readers, block kb - 1's wgmmas, are done). Two register sets of words
  // and scales alternate by item (no copies between them: a register copy would wait for the loads), so item v + 1's
  // are loaded a whole item ahead; item v + 2's are asked into L2.
  uint32_t wA[L::WORDS], saA[4], wB[L::WORDS], saB[4], a[2][2][4];
  if (active) {
    load_item(v0, wA, saA);
    if (v0 + 1 < v1) load_item(v0 + 1, wB, saB);
  }
  decode(wA, saA, 0, a[0]);
  auto item = [&](int v, uint32_t(&w)[L::WORDS], uint32_t(&sa)[4], uint32_t(&wn)[L::WORDS], uint32_t(&san)[4]) {
    if (active && lane < (int)L::ITEM_W / 128 && v + 2 < v1) prefetch_l2(witem + (int64_t)(v + 2) * L::ITEM_W + 128 * lane);
#pragma unroll
    for (int kb = 0; kb < 8; ++kb) {
      const int j = 8 / SB * (v - v0) + kb / SB;  // the stage's step
      if (kb % SB == 0) mbar_wait(GEMM_FULL + 8 * (j % GEMM_STAGES), (j / GEMM_STAGES) & 1);
      wgmma_fence();
      const uint32_t st = gemm_stage_addr(j % GEMM_STAGES) + ((kb % SB) >> 1) * BOX + (kb & 1) * 64;
      wgmma_tokens<T, BN>(acc, a[kb & 1][0], swizzled_desc(st));
      wgmma_tokens<T, BN>(acc, a[kb & 1][1], swizzled_desc(st + 32));
      wgmma_commit();
      wgmma_wait<1>();
      // the step before j is done with when its last block's wgmmas are (its first block's wgmmas just issued)
      if (kb % SB == 0 && j > 0) {
        __syncwarp();
        if (lane == 0) mbar_arrive(GEMM_EMPTY + 8 * ((j - 1) % GEMM_STAGES));
      }
      if (kb < 7) {
        decode(w, sa, kb + 1, a[(kb + 1) & 1]);
      } else if (v + 1 < v1) {
        decode(wn, san, 0, a[0]);
        if (active && v + 2 < v1) load_item(v + 2, w, sa);  // this item's registers are free now
      }
    }
  };
  for (int v = v0; v < v1; v += 2) {
    item(v, wA, saA, wB, saB);
    if (v + 1 < v1) item(v + 1, wB, saB, wA, saA);
  }
  wgmma_wait<0>();
  fence_acc(acc);
  // with a k split, the reduction may be scheduled now (its launch overlaps the epilogues). Without, the next kernel
  // waits for this grid to end: started early, a k-order copy after it crowds onto the SMs a partial wave leaves idle
  // (6144x4096 at 512 tokens, back to back, 0.94x)
  if (splits > 1) pdl_launch_dependents();
  __syncwarp();
  if (lane == 0) mbar_arrive(GEMM_EMPTY + 8 * ((steps - 1) % GEMM_STAGES));
  // acc[4 nt + i]: row 16 t + g + 8 (i >> 1), token n0 + 8 nt + 2 q + (i & 1) (store_tile's fragment)
  const float post = TiledScales<T>::A_POST;
  if (splits == 1) {
    // past this barrier no wgmma of either warpgroup reads the stages: warpgroup w stages its outputs in stage 1 + w
    static_assert(2 * BN * 128 <= 3 * GEMM_STAGE, "the epilogue's staging fits stages 1..3");
    bar_group(1, GEMM_WARPS * 32);
    const int wg = warp >> 2;
    const int64_t row0 = (int64_t)blockIdx.x * GEMM_WARPS * 16 + 64 * wg, r0 = row0 + 16 * (warp & 3) + g;
    float b0 = 0.f, b1 = 0.f;
    if (bias != nullptr && r0 < out) {
      b0 = Cvt<T>::to_f(bias[r0]);
      b1 = Cvt<T>::to_f(bias[r0 + 8]);
    }
    wgmma_store_staged<T, BN>(acc, gemm_stage_addr(1) + (uint32_t)(wg * BN * 128), post * __ldg(scale), b0, b1,
                              warp & 3, lane, (int)threadIdx.x & 127, 2 + wg, [&](int n, int c) -> T* {
                                const int64_t row = row0 + 8 * c;
                                return n0 + n < M && row < out ? y + (int64_t)(n0 + n) * out + row : nullptr;
                              });
  } else {
    if (!active) return;
    float* part = ws + ((int64_t)split * M + n0) * out;
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) {
      const int m = 8 * (i >> 2) + 2 * q + (i & 1);
      if (n0 + m < M) part[(int64_t)m * out + 16 * t + g + 8 * ((i >> 1) & 1)] = acc[i] * post;
    }
  }
}
// xs = x [M, in] in the GEMM's k order: inside each block of 32, element 8 q + 4 h + 2 m + jl goes to 16 h + 8 m + 2 q +
// jl (the pair table hands lane q of an MMA quad elements 8 q .. 8 q + 7 of a block; wgmma pairs them with B's k
// indices 2 q + jl and 8 + 2 q + jl of slice h). In 4-byte pairs, a 4 x 4 transpose between the block's four 16-byte
// chunks: word o of chunk q goes to word q of chunk o. One thread per 64-byte block; 16-byte loads and stores.
__global__ void gemm_k_order_kernel(const uint4* __restrict__ x, int64_t blocks, uint4* __restrict__ xs) {
  pdl_launch_dependents();
  pdl_wait();
  for (int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; b < blocks; b += (int64_t)gridDim.x * blockDim.x) {
    uint32_t c[4][4], o[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) *reinterpret_cast<uint4*>(c[i]) = __ldg(x + 4 * b + i);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) o[i][j] = c[j][i];
#pragma unroll
    for (int i = 0; i < 4; ++i) xs[4 * b + i] = *reinterpret_cast<const uint4*>(o[i]);
  }
}

template <typename T, int K>
int gemm_tiled_launch(const T* x_natural, int64_t M, const uint8_t* wt, const uint8_t* at, const float* scale,
                      const float* cb, const T* bias, int64_t out, int64_t in, T* y, unsigned char* workspace,
                      int64_t ws_bytes, cudaStream_t st) {
  int dev = 0, sms = 0;
  if (!current_device_sms(dev, sms)) return (int)cudaErrorInvalidDevice;
  if (!wgmma_gemm_available(dev)) return (int)cudaErrorNotSupported;
  const EncodeTiledFn encode = encode_tiled();
  const int splits = gemm_splits(out / 16, M, in, sms);
  if (workspace == nullptr || ((uintptr_t)workspace & 255) || ws_bytes < gemm_workspace_bytes(out / 16, M, in, sms))
    return (int)cudaErrorInvalidValue;
  const int BN = gemm_tokens_per_cta(M);
  if ((M + BN - 1) / BN > 65535) return (int)cudaErrorInvalidConfiguration;  // grid.y
  T* x = reinterpret_cast<T*>(workspace);
  float* ws = reinterpret_cast<float*>(workspace + gemm_x_bytes(M, in));
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg = launch_config(grid_for_threads(M * in / 32, 256, 8), 256, 0, st, 1u, true, attr);
  cudaError_t e = cudaLaunchKernelEx(&cfg, gemm_k_order_kernel, reinterpret_cast<const uint4*>(x_natural), M * in / 32,
                                     reinterpret_cast<uint4*>(x));
  if (e != cudaSuccess) return (int)e;
  CUtensorMap map;
  const cuuint64_t dims[2] = {(cuuint64_t)in, (cuuint64_t)M}, strides[1] = {(cuuint64_t)in * sizeof(T)};
  const cuuint32_t box[2] = {64, (cuuint32_t)BN}, estr[2] = {1, 1};
  if (encode(&map, std::is_same<T, __half>::value ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
             2, const_cast<T*>(x), dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
    return (int)cudaErrorInvalidValue;
  const auto kernel = BN == 256 ? gemm_tiled_kernel<T, K, 256> : gemm_tiled_kernel<T, K, 128>;
  static bool attr_set[2][64] = {};
  if (!attr_set[BN == 256][dev]) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)GEMM_SMEM_END);
    if (e != cudaSuccess) return (int)e;
    attr_set[BN == 256][dev] = true;
  }
  const dim3 grid((unsigned)((out / 16 + GEMM_WARPS - 1) / GEMM_WARPS), (unsigned)((M + BN - 1) / BN), (unsigned)splits);
  cfg = launch_config(grid, GEMM_THREADS, (int)GEMM_SMEM_END, st, 1u, true, attr);
  e = cudaLaunchKernelEx(&cfg, kernel, map, (int)M, wt, at, scale, cb, bias, out, (int)in, y, ws, splits);
  if (e != cudaSuccess || splits == 1) return (int)e;
  cfg = launch_config(grid_for_threads(M * out, 256, 8), 256, 0, st, 1u, true, attr);
  return (int)cudaLaunchKernelEx(&cfg, gemm_reduce_kernel<T>, (const float*)ws, splits, M * out, out, scale, bias, y);
}

template <int K, typename TO>
int dequantize_tiled_go(const void* wt, const void* at, const float* scale, const float* codebook, int64_t out,
                        int64_t in, void* y, cudaStream_t st) {
  dequant_tiled_kernel<K, TO><<<grid_for_threads(out * in / 16, 256, dequant_tiled_blocks_per_sm(K)), 256, 0, st>>>(
      (const uint8_t*)wt, (const uint8_t*)at, scale, codebook, out, (int)in, (TO*)y);
  return (int)cudaGetLastError();
}

template <int K>
int dequantize_tiled_k(const void* wt, const void* at, const float* scale, const float* codebook, int64_t out,
                       int64_t in, void* y, int y_dtype, cudaStream_t st) {
  switch (y_dtype) {
    case F32: return dequantize_tiled_go<K, float>(wt, at, scale, codebook, out, in, y, st);
    case F16: return dequantize_tiled_go<K, __half>(wt, at, scale, codebook, out, in, y, st);
    case BF16: return dequantize_tiled_go<K, __nv_bfloat16>(wt, at, scale, codebook, out, in, y, st);
    default: return (int)cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

KBIT_API int kbit_tile(const uint32_t* packed, const void* absmax, int k, int64_t out, int64_t in, void* wt, void* at,
                       void* stream) {
  if (!tiled_shape(out, in)) return (int)cudaErrorInvalidValue;
  return with_k(k, [&](auto kc) {
    tile_kernel<kc.value><<<grid_for_threads(out * in * kc.value / 32), 256, 0, (cudaStream_t)stream>>>(
        packed, (const uint8_t*)absmax, out, (int)in, (uint32_t*)wt, (uint8_t*)at);
    return (int)cudaGetLastError();
  });
}

KBIT_API int kbit_untile(const void* wt, const void* at, int k, int64_t out, int64_t in, uint32_t* packed, void* absmax,
                         void* stream) {
  if (!tiled_shape(out, in)) return (int)cudaErrorInvalidValue;
  return with_k(k, [&](auto kc) {
    untile_kernel<kc.value><<<grid_for_threads(out * in / 32), 256, 0, (cudaStream_t)stream>>>(
        (const uint8_t*)wt, (const uint8_t*)at, out, (int)in, packed, (uint8_t*)absmax);
    return (int)cudaGetLastError();
  });
}

KBIT_API int kbit_dequantize_tiled(const void* wt, const void* at, const float* scale, const float* codebook, int k,
                                   int64_t out, int64_t in, void* y, int y_dtype, void* stream) {
  if (!tiled_shape(out, in)) return (int)cudaErrorInvalidValue;
  return with_k(k, [&](auto kc) {
    return dequantize_tiled_k<kc.value>(wt, at, scale, codebook, out, in, y, y_dtype, (cudaStream_t)stream);
  });
}

KBIT_API int kbit_gemv_tiled_kernel(const void* x, int x_dtype, int64_t M, const void* wt, const void* at,
                                    const float* scale, const float* codebook, int k, int64_t out, int64_t in,
                                    const void* bias, void* y, int kernel, void* stream) {
  const int base = kernel & 7, ks = kernel >> 3;
  if (!tiled_shape(out, in) || M < 1 || M > 64 || kernel < 0 || base > KBIT_TILED_BATCH4 || ks > 1 ||
      (ks > 0 && base < KBIT_TILED_BATCH))
    return (int)cudaErrorInvalidValue;
  cudaStream_t st = (cudaStream_t)stream;
  const uint8_t *w = (const uint8_t*)wt, *a = (const uint8_t*)at;
  return with_k(k, [&](auto kc) {
    constexpr int K = kc.value;
    if (x_dtype == BF16)
      return gemv_tiled_launch<__nv_bfloat16, K>((const __nv_bfloat16*)x, (int)M, w, a, scale, codebook,
                                                 (const __nv_bfloat16*)bias, out, in, (__nv_bfloat16*)y, kernel, st);
    if (x_dtype == F16)
      return gemv_tiled_launch<__half, K>((const __half*)x, (int)M, w, a, scale, codebook, (const __half*)bias, out,
                                          in, (__half*)y, kernel, st);
    return (int)cudaErrorInvalidValue;
  });
}

KBIT_API int kbit_gemv_tiled(const void* x, int x_dtype, int64_t M, const void* wt, const void* at, const float* scale,
                             const float* codebook, int k, int64_t out, int64_t in, const void* bias, void* y,
                             void* stream) {
  return kbit_gemv_tiled_kernel(x, x_dtype, M, wt, at, scale, codebook, k, out, in, bias, y, KBIT_TILED_AUTO, stream);
}

KBIT_API int kbit_wgmma_available(void) {
  int dev = 0, sms = 0;
  return current_device_sms(dev, sms) && wgmma_gemm_available(dev) ? 1 : 0;
}

KBIT_API int64_t kbit_gemm_tiled_workspace(int64_t M, int64_t out, int64_t in) {
  int dev = 0, sms = 0;
  if (!tiled_shape(out, in) || M < 1 || !current_device_sms(dev, sms)) return -1;
  return gemm_workspace_bytes(out / 16, M, in, sms);
}

KBIT_API int kbit_gemm_tiled(const void* x, int x_dtype, int64_t M, const void* wt, const void* at, const float* scale,
                             const float* codebook, int k, int64_t out, int64_t in, const void* bias, void* y,
                             void* workspace, int64_t workspace_bytes, void* stream) {
  if (!tiled_shape(out, in) || M < 1 || M > (int64_t)1 << 30 || ((uintptr_t)x & 15) || ((uintptr_t)y & 15))
    return (int)cudaErrorInvalidValue;
  cudaStream_t st = (cudaStream_t)stream;
  const uint8_t *w = (const uint8_t*)wt, *a = (const uint8_t*)at;
  unsigned char* ws = (unsigned char*)workspace;
  return with_k(k, [&](auto kc) {
    constexpr int K = kc.value;
    if (x_dtype == BF16)
      return gemm_tiled_launch<__nv_bfloat16, K>((const __nv_bfloat16*)x, M, w, a, scale, codebook,
                                                 (const __nv_bfloat16*)bias, out, in, (__nv_bfloat16*)y, ws,
                                                 workspace_bytes, st);
    if (x_dtype == F16)
      return gemm_tiled_launch<__half, K>((const __half*)x, M, w, a, scale, codebook, (const __half*)bias, out, in,
                                          (__half*)y, ws, workspace_bytes, st);
    return (int)cudaErrorInvalidValue;
  });
}

}  // extern "C"

