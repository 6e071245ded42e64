// kbit_dispatch.h: which kernel variant a call runs and with which launch shape. Every rule that the launchers of
// kbit_gemv.cu (bit planes), kbit_tiled.cu (tiled layout) and kbit_quant.cu apply lives here, as a named constant or a
// small host function with the reason for its value. Speed figures are H100 (132 SMs) measurements unless said; the
// rules take the SM count where a grid's fill matters. Shapes are written out x in.
#pragma once

#include <cstdint>

namespace kbit {

// Tiles of 8 tokens (the MMA's n) for M activation rows, shared by both GEMV families: 1 (M <= 8), 2, 4 or 8 (M <= 64).
constexpr int token_tiles(int64_t M) { return M <= 8 ? 1 : M <= 16 ? 2 : M <= 32 ? 4 : 8; }

// ---- bit-plane GEMV (kbit_gemv.cu, gemv_kernel) ----

// The kernel geometry the rules below reason about (kbit_gemv.cu takes it from here).
constexpr int GEMV_TILE_ROWS = 16;    // output rows per row group (folded tiles: 8)
constexpr int GEMV_STEP_BLOCKS = 8;   // 32-element blocks per warp step (folded tiles: 16)
constexpr int GEMV_MAX_WARPS = 8;     // warps per CTA: the kernel's launch bounds
constexpr int GEMV_MAX_M = 64;        // activation rows of the fused kernel (more: dequantize + cuBLAS)
constexpr int GEMV_MAX_KW_NT = 16;    // k splits x token tiles: two activation stages of 8 NT token rows per split,
                                      // 132 KB of shared memory at 16

// Decode mode (template MODE; kbit_gemv.cu's header): 0 the shared-memory pair table, 1 the codebook in registers,
// 2 hybrid. K = 2, 3: registers, no shared-memory traffic for the lookups. K = 4: hybrid, the lookups split between
// the integer pipe (PRMT) and the shared-memory pipe run faster than either alone. K = 5: the table (the register
// decode covers at most 4 planes). NT = 8: the table, as the register decode would hold all 8 token tiles' paired
// activations (64 registers).
constexpr int gemv_decode_mode(int K, int NT) { return NT == 8 || K == 5 ? 0 : K == 4 ? 2 : 1; }

// Register cap (template NREG). M <= 8: 128, two CTAs of 8 warps per SM (caps of 80 and 96 spill for K = 4, where
// they are 11-30% slower, and gain nothing for K = 2, 3). Token tiles: 168, NT = 8 216, the most that run without
// spills.
constexpr int gemv_max_regs(int NT) { return NT == 1 ? 128 : NT == 8 ? 216 : 168; }

// Folded 8-row tiles (M <= 4, template FOLD): twice the CTAs of the 16-row grid, for grids that leave SMs idle: at most
// 1.5 CTAs per SM (K = 2, 3 at M = 1, whose decode is lightest: 2), on rows of at least 2048 elements (with fewer
// 16-block steps per row the folded kernel is slower). ctas16: the 16-row grid's CTAs (row tiles x expert tokens).
inline bool gemv_fold(int K, int64_t M, int64_t in, int64_t ctas16, int sms) {
  return M <= 4 && in >= 2048 && 2 * ctas16 <= (K <= 3 && M == 1 ? 4 : 3) * sms;
}

// Warps per CTA for M <= 8 (they split the input dimension): 8 on small grids of long rows (at least 16 steps), else 4.
// Small: under 2048 warps of 4-warp CTAs (about 16 per SM on 132 SMs); folded: at most one CTA per SM.
inline int gemv_warps(bool fold, int64_t ctas, int64_t nb, int sms) {
  const bool few_ctas = fold ? ctas <= sms : ctas * 4 < 2048;
  return few_ctas && nb >= 16 * GEMV_STEP_BLOCKS ? 8 : 4;
}

// Expert modes at M <= 8 on rows of at most 8 steps (in <= 2048): CTAs of GEMV_EXPERT_SHORT_ROW_GROUPS row groups x 1
// warp, no k split. Such rows give a k-split warp one or two steps, so the per-CTA start (the pair table) and the
// split's reduction cost more than the steps: on Qwen3-30B-A3B's experts (2048 / 768 inputs) one block runs 1.2-1.5x
// faster at 4-64 tokens. 4 row groups rather than 8: a CTA's warps finish their few steps at different times and hold
// its registers until the last one does, so smaller CTAs free an SM's slots sooner; the block (grouped GEMV) at 8-64
// tokens 1.03-1.05x faster than with 8, per-row 1.05-1.07x (H100, CUDA graph, one process per build); 2 row groups
// are within 2% of 4.
constexpr int GEMV_EXPERT_SHORT_ROW_GROUPS = 4;
inline bool gemv_expert_short_rows(int64_t nb) { return nb <= 8 * GEMV_STEP_BLOCKS; }
// CTA shape for M = 9..64 (NT token tiles): rw row groups x kw k-split warps. 64-row CTAs (rw = 4) for out >= 8192,
// else 32: the row groups of a split share each step's staged activations. Then the fewest k splits that give at least
// 6 warps per SM: long runs of steps per warp beat more, shorter warps.
struct GemvTokenCta {
  int rw, kw;
};
// `busy`: CTA rows with work (grouped experts: about one per work item; else 1).
inline GemvTokenCta gemv_token_cta(int64_t out, int NT, int64_t busy, int sms) {
  GemvTokenCta c = {out >= 8192 ? 4 : 2, 1};
  while (c.kw * 2 * NT <= GEMV_MAX_KW_NT && c.rw * c.kw * 2 <= GEMV_MAX_WARPS &&
         ((out + GEMV_TILE_ROWS * c.rw - 1) / (GEMV_TILE_ROWS * c.rw)) * busy * c.rw * c.kw < 6 * (int64_t)sms)
    c.kw *= 2;
  return c;
}
// ---- expert GEMV (kbit_gemv.cu, kbit_expert_gemv): per-row or grouped ----
// Per-row: one CTA row per input row, reading its expert's tile (an expert chosen by several rows is read once per
// row). Grouped: a counting sort of the rows by expert (one CTA), then CTA rows of up to expert_item_rows rows of one
// expert, each expert tile read once per item. Grouped from EXPERT_PER_ROW_MAX_N + 1 rows.
constexpr int64_t EXPERT_PER_ROW_MAX_N = 8;
constexpr int64_t EXPERT_GROUPED_MAX_E = 8192;  // the sort's bucket counts live in shared memory
inline bool expert_grouped(int64_t N, int64_t E) { return N > EXPERT_PER_ROW_MAX_N && E <= EXPERT_GROUPED_MAX_E; }
// Rows per grouped work item: the token tiles (8 rows each) that hold the mean rows per expert present.
inline int64_t expert_item_rows(int64_t N, int64_t E) {
  const int64_t present = N < E ? N : E, mean = (N + present - 1) / present;
  return 8 * (int64_t)token_tiles(mean);
}

// ---- fused MoE experts (kbit_gemv.cu, kbit_moe_gate_up / kbit_moe_down), few rows ----
// gate_up: CTAs of 2 row groups (8 outputs = 8 gate and 8 up weight rows each), 2 k-split warps on rows of at most 8
// steps, else 1. The per-row expert GEMV in these shapes on an H100, one call per layer's rows in a CUDA graph,
// microseconds, against its own rule then (8 row groups x 1 warp on short rows, else 1 x gemv_warps): Qwen3-30B-A3B's
// gate_up at 8 rows 11.0 against 14.3, gpt-oss-20b's at 4 rows 24.8 against 27.2, Mixtral-8x7B's at 2 rows 62.7
// against 67.0. down: one row group and the dense GEMV's k split (gemv_warps) over the token's top_k rows walked as
// one long row (`row_blocks` blocks; `ctas`: tiles x tokens).
struct MoeCta {
  int rw, warps;
};
inline MoeCta moe_gate_up_cta(int64_t nb) { return {2, nb <= 8 * GEMV_STEP_BLOCKS ? 2 : 1}; }
inline MoeCta moe_down_cta(int64_t ctas, int64_t row_blocks, int sms) {
  return {1, gemv_warps(false, ctas, row_blocks, sms)};
}

// ---- tiled GEMV (kbit_tiled.cu) ----

// Range kernel (gemv_tiled_kernel): one persistent CTA per SM. 16 warps for NT <= 2 (M <= 16), 8 for NT = 4 (M <= 32:
// the accumulators need the registers); a launch takes at most 32 tokens, more run as launches of 32.
constexpr int TILED_RANGE_MAX_M = 32;
constexpr int tiled_range_warps(int NT) { return NT <= 2 ? 16 : 8; }
// Ring slots per warp: one. At steady state the K = 4 reads run at the copy bandwidth; more slots are slower or even,
// on small layers too.
constexpr int TILED_RANGE_SLOTS = 1;
// K = 2: blocks of each 8-block item decoded in registers instead of the table. The shared-memory pipe binds K = 2;
// 2 of 8 are 1.01-1.10x faster than the table alone at M = 1, all 8 are slower (then the integer pipe binds).
constexpr int TILED_K2_REG_BLOCKS = 2;
// K = 3: the blocks decoded in registers (bit kb: block kb), from M = 4 on. More tokens load more activations through
// the L1 pipe that the table lookups use, which the register decode relieves: 1.01-1.15x at M = 4..32; at M <= 2 it
// gains nothing (0.95-1.05x), and all 8 blocks are slower at M = 1 (the integer pipe binds).
constexpr int TILED_K3_REG_MASK = 0x0F;
constexpr int TILED_K3_REG_MIN_M = 4;

// Batched kernel (gemv_tiled_batch_kernel), M = 9..64: 8 consumer warps per CTA, NT = 2, 4, 8 (M <= 16, 32, 64).
constexpr int TILED_BATCH_WARPS = 8;
constexpr int tiled_batch_token_tiles(int M) { return M <= 16 ? 2 : M <= 32 ? 4 : 8; }
// Ring stages: 4, 3, 2 for NT = 2, 4, 8 (smaller stages, a deeper ring; each fits sm_90's 227 KB with the table).
constexpr int tiled_batch_stages(int NT) { return NT == 2 ? 4 : NT == 4 ? 3 : 2; }
// Producer warps: two (activations, items) from NT = 4 on, where the consumers otherwise wait for full stages. At
// NT = 2 one: two are faster in isolation, but end to end at batch 16 a process then more often runs at the slower
// of two steady decode speeds.
constexpr int tiled_batch_producers(int NT) { return NT == 2 ? 1 : 2; }

// Range or batched kernel, the library's choice (M = 1..64; tiles = out / 16). The batched kernel copies each step's
// activations once per CTA for 8 warps, where the range kernel's warps each load their own from L2: it wins from
// M = 9 where its consumer warps have tiles (>= 2 tiles per SM; on 1..2 tiles per SM from the M below, in clusters of
// 2 CTAs). The range kernel keeps the smallest M where its two token tiles share each lookup: K = 2, 3 up to M = 15;
// K = 4, 5 up to 14 on layers of >= 24 items per warp or where at most half the batched kernel's consumer warps would
// have a tile and it has >= 4 items per warp, up to 10 where under 3/4 of them would (K = 5: with >= 4 items per warp),
// up to 16 where at most half would and there are >= 24 items per warp.
inline bool tiled_batch(int K, int M, int64_t tiles, int64_t in, int sms) {
  if (M <= 8) return false;
  const int64_t items_per_warp = tiles * (in / 256) / (16 * (int64_t)sms);  // the 16-warp range kernel's
  // the batched kernel's consumer-warp turns: 8 per SM and round of tiles (tiles / turns: the share that has a tile)
  const int64_t turns = 8 * (int64_t)sms * ((tiles + 8 * sms - 1) / (8 * sms));
  const bool half_idle = 2 * tiles <= turns, quarter_idle = 4 * tiles < 3 * turns;
  const bool many = items_per_warp >= 24;
  const bool range_first =
      K <= 3 ? M <= 15
             : (M <= 14 && (many || (half_idle && items_per_warp >= 4))) ||
                   (M <= 10 && quarter_idle && !(K == 5 && items_per_warp < 4)) || (M <= 16 && half_idle && many);
  // 1..2 tiles per SM (the k split over clusters and 2 or 4 warps per tile make up for the few tiles): on large layers
  // from M = 17 (K = 5: 16), 1.09-1.29x at M = 17; on small ones (< 2 items per warp) K = 3 from 16, K = 4 from 11,
  // K = 5 at every M, K = 2 from 41 (the kernels tie below)
  const bool small = items_per_warp < 2;
  const bool batch_mid = tiles >= sms && (small ? (K == 2 ? M > 40 : K == 3 ? M > 15 : K == 4 ? M > 10 : true)
                                                : M > (K == 5 ? 15 : 16));
  return !range_first && (tiles >= 2 * sms || batch_mid);
}

// The batched kernel's k split: clusters of 2 CTAs share each tile's k range on layers of <= 4 tiles per SM (one
// round of <= 8 tiles per cluster): each CTA copies half the activations for twice the tiles. 1.01-1.42x at M >= 17
// on such layers; slower on 7 tiles per SM (0.77-0.92x). Clusters of 4 are slower: only 30 fit on 132 SMs.
inline int tiled_k_split(int64_t tiles, int sms) { return tiles <= 4 * (int64_t)sms ? 2 : 1; }

// Consumer warps per tile in the batched kernel, where the busiest tile owner (CTA, or cluster with KS = 2) has `most`
// tiles for its NW warps. 4 where it has at most NW / 4 (1.00-1.47x against 1). 2 where it has at most NW / 2: without
// the k split for K = 5 at NT = 8 only (1.08-1.22x; K = 2..4 and smaller NT 0.92-1.01x), with it for K = 2..4 from
// NT = 4 on (0.96-1.15x; K = 5 and NT = 2 0.91-1.06x). Else 1.
inline int tiled_batch_split(int K, int NT, int KS, int NW, int64_t most) {
  return 4 * most <= NW                                                     ? 4
         : 2 * most <= NW && (KS == 1 ? K == 5 && NT == 8 : K < 5 && NT > 2) ? 2
                                                                             : 1;
}

// ---- dequantize grids (grid-stride beyond the cap) ----

// Bit planes: up to 128 blocks of 256 threads per SM for K = 2, 64 for K = 3..5, whose streaming loads read the most of
// the copy bandwidth with 64 (K = 5 on the H200: 86-88% of copy against 81-84% with 128).
constexpr int dequant_blocks_per_sm(int K) { return K == 2 ? 128 : 64; }
// Tiled: up to 128 blocks per SM for K = 4, 64 for K = 2, 3, 5 (K = 4 on the H200: 88.3-88.7% of copy against
// 83.3-86.1% with 64; K = 2, 3, 5 slightly slower with 128).
constexpr int dequant_tiled_blocks_per_sm(int K) { return K == 4 ? 128 : 64; }

// ---- tensor-core GEMM over the tiled layout (kbit_tiled.cu: gemm_tiled_kernel, M > 64, sm_90) ----
// Tokens per CTA: 128, or 256 above 128 tokens (each decoded weight fragment then feeds twice the MMA work).
constexpr int gemm_tokens_per_cta(int64_t M) { return M > 128 ? 256 : 128; }
// k splits: CTAs of 8 tiles x gemm_tokens_per_cta tokens; where they are fewer than the SMs, the k range is split so
// that the grid fills them (at least 2 items of 256 k per split); the splits' fp32 partial sums go through a workspace
inline int gemm_splits(int64_t tiles, int64_t M, int64_t in, int sms) {
  const int64_t bn = gemm_tokens_per_cta(M), ctas = ((tiles + 7) / 8) * ((M + bn - 1) / bn);
  int64_t s = ctas >= sms ? 1 : sms / ctas;
  const int64_t most = in / 512 > 1 ? in / 512 : 1;
  return (int)(s < most ? s : most);
}
// The workspace: x in the GEMM's k order (2 bytes an element; 256-byte aligned end), then any splits' partial sums
inline int64_t gemm_x_bytes(int64_t M, int64_t in) { return (M * in * 2 + 255) / 256 * 256; }
inline int64_t gemm_workspace_bytes(int64_t tiles, int64_t M, int64_t in, int sms) {
  const int s = gemm_splits(tiles, M, in, sms);
  return gemm_x_bytes(M, in) + (s > 1 ? (int64_t)s * M * tiles * 16 * 4 : 0);
}

// ---- tensor-core GEMM over the bit planes (kbit_gemm.cu: gemm_planes_kernel, M > 64, sm_80+) ----
// CTAs of 128 weight rows x bn tokens; `stages` shared-memory stages of 128 k; the k range split `splits` ways.
struct GemmPlanesShape {
  int bn, stages, splits;
};
// Where the CTAs are fewer than the SMs, the k range is split so that the grid fills them (at least 2 groups of 128
// per split).
inline int gemm_planes_splits(int64_t M, int64_t out, int64_t in, int sms, int bn) {
  const int64_t ctas = ((out + 127) / 128) * ((M + bn - 1) / bn), groups = (in + 127) / 128;
  int64_t sp = ctas >= sms ? 1 : sms / ctas;
  if (sp > groups / 2) sp = groups / 2;
  return sp < 1 ? 1 : (int)sp;
}
// The first shape that fits the device's shared memory per CTA (`bytes(bn, stages)`, at most `smem`): 128 tokens
// before 64 (each decoded tile then feeds twice the MMAs), 4 stages before 3. bn = 0: none fits (sm_86 / sm_89).
template <typename Bytes>
inline GemmPlanesShape gemm_planes_choose(int64_t M, int64_t out, int64_t in, int sms, int smem, Bytes bytes) {
  constexpr int order[][2] = {{128, 4}, {128, 3}, {64, 4}, {64, 3}};
  GemmPlanesShape s = {0, 0, 1};
  for (const auto& o : order)
    if (bytes(o[0], o[1]) <= smem) {
      s = {o[0], o[1], gemm_planes_splits(M, out, in, sms, o[0])};
      break;
    }
  return s;
}
inline int64_t gemm_planes_workspace_bytes(const GemmPlanesShape& s, int64_t M, int64_t out) {
  return s.splits > 1 ? (int64_t)s.splits * M * out * 4 : 0;
}

}  // namespace kbit
