// Host self-test, no GPU: the bit-plane GEMV's register decode (decode_reg against a direct codebook lookup, K = 2..4,
// random planes and codebooks) and the launch-shape limits that kbit_dispatch.h's rules must respect. Built and run by
// tests/test_host_kernels.py:
//   nvcc -std=c++17 --expt-relaxed-constexpr -arch=sm_80 -Icsrc -o /tmp/gemv_selftest <this file> && /tmp/gemv_selftest
#include "../../csrc/kbit_gemv.cu"
#include <cstdio>
#include <initializer_list>
#include <random>

int main() {
  std::mt19937 rng(1);
  int bad = 0;
  for (int K = 2; K <= 4; ++K) {
    for (int it = 0; it < 20000; ++it) {
      uint16_t cb[16];
      for (int i = 0; i < 16; ++i) cb[i] = (uint16_t)rng();
      uint32_t tl[4] = {0,0,0,0}, th[4] = {0,0,0,0};
      for (int i = 0; i < (1 << K); ++i) { tl[i>>2] |= (uint32_t)(cb[i] & 0xFF) << (8*(i&3)); th[i>>2] |= (uint32_t)(cb[i] >> 8) << (8*(i&3)); }
      uint32_t w[5] = {0,0,0,0,0};
      for (int j = 0; j < K; ++j) w[j] = rng();
      uint32_t a[16];
      if (K == 2) decode_reg<2>(w, tl, th, a); else if (K == 3) decode_reg<3>(w, tl, th, a); else decode_reg<4>(w, tl, th, a);
      for (int h = 0; h < 2; ++h) for (int e = 0; e < 4; ++e) for (int t = 0; t < 2; ++t) {
        int el0 = 16*h + e + 8*t, el1 = el0 + 4;
        auto idx = [&](int el) { int v = 0; for (int j = 0; j < K; ++j) v |= ((w[j] >> el) & 1) << j; return v; };
        uint32_t want = cb[idx(el0)] | ((uint32_t)cb[idx(el1)] << 16);
        if (a[8*h+2*e+t] != want) { if (bad++ < 5) printf("K=%d mismatch h%d e%d t%d %08x %08x\n", K, h, e, t, a[8*h+2*e+t], want); }
      }
    }
  }
  printf("decode_reg: %d mismatches\n", bad);

  // launch shapes the kernels can take: token tiles cover M, CTAs within the launch bounds and the shared memory
  int bad2 = 0;
  auto check = [&](bool ok, const char* what, long long a, long long b) {
    if (!ok && bad2++ < 5) printf("FAIL %s (%lld, %lld)\n", what, a, b);
  };
  for (int M = 1; M <= GEMV_MAX_M; ++M) {
    check(8 * token_tiles(M) >= M && (M <= 8 || 4 * token_tiles(M) < M), "token_tiles", M, token_tiles(M));
    check(M <= 8 || 8 * tiled_batch_token_tiles(M) >= M, "tiled_batch_token_tiles", M, tiled_batch_token_tiles(M));
  }
  for (int NT : {2, 4, 8}) {
    for (int K = 2; K <= 5; ++K) check(NT != 8 || gemv_decode_mode(K, NT) == 0, "decode mode at NT = 8", K, NT);
    for (int sms : {1, 8, 78, 108, 132, 144, 170})
      for (long long out = 16; out <= (1 << 20); out = out * 3 / 2 + 16)
        for (long long busy : {1LL, 7LL, 500LL}) {
          const GemvTokenCta c = gemv_token_cta(out, NT, busy, sms);
          check(c.rw * c.kw <= GEMV_MAX_WARPS && c.kw * NT <= GEMV_MAX_KW_NT && c.kw >= 1, "gemv_token_cta", out,
                sms);
        }
  }
  // grouped expert items: whole token tiles of at most GEMV_MAX_M rows, at least the mean rows per expert present
  for (long long E : {1LL, 8LL, 128LL, 8192LL})
    for (long long N = 1; N < 1000000; N = N * 3 + 1) {
      const long long mt = expert_item_rows(N, E), present = N < E ? N : E;
      check(mt % 8 == 0 && mt >= 8 && mt <= GEMV_MAX_M && (mt >= (N + present - 1) / present || mt == GEMV_MAX_M),
            "expert_item_rows", N, E);
    }
  check(!expert_grouped(EXPERT_PER_ROW_MAX_N, 128) && expert_grouped(EXPERT_PER_ROW_MAX_N + 1, 128) &&
            !expert_grouped(1000, EXPERT_GROUPED_MAX_E + 1),
        "expert_grouped", EXPERT_PER_ROW_MAX_N, EXPERT_GROUPED_MAX_E);
  check(gemv_decode_mode(5, 1) == 0, "K = 5 decodes through the table", 5, 1);
  for (int sms : {1, 8, 132})
    for (long long ctas = 1; ctas < 100000; ctas = ctas * 2 + 1)
      for (long long nb = 1; nb < 5000; nb *= 3) {
        const int w1 = gemv_warps(false, ctas, nb, sms), w2 = gemv_warps(true, ctas, nb, sms);
        check((w1 == 4 || w1 == 8) && (w2 == 4 || w2 == 8), "gemv_warps", ctas, nb);
      }
  for (int K = 2; K <= 5; ++K)
    for (int M = 1; M <= GEMV_MAX_M; ++M)
      for (int sms : {1, 132})
        for (long long tiles : {1LL, 64LL, 256LL, 1024LL, 8192LL})
          check(M > 8 || !tiled_batch(K, M, tiles, 4096, sms), "M <= 8 runs the range kernel", K, M);
  for (int K = 2; K <= 5; ++K)
    for (int NT : {2, 4, 8})
      for (int KS = 1; KS <= 2; ++KS)
        for (long long most = 1; most <= 16; ++most) {
          const int s = tiled_batch_split(K, NT, KS, TILED_BATCH_WARPS, most);
          check((s == 1 || s == 2 || s == 4) && TILED_BATCH_WARPS % s == 0, "tiled_batch_split", most, s);
        }
  printf("dispatch: %d failures\n", bad2);
  return (bad != 0) || (bad2 != 0);
}
