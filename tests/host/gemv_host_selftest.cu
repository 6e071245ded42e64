// Host self-test of the v6 GEMV register decode (decode_reg against a direct codebook lookup, K = 2..4, random
// planes and codebooks) and of the KBIT_GEMV_CFG parser. No GPU needed:
//   nvcc -std=c++17 --expt-relaxed-constexpr -arch=sm_80 -Icsrc -o /tmp/gemv_selftest tests/host/gemv_host_selftest.cu && /tmp/gemv_selftest
#include "../../csrc/kbit_gemv.cu"
#include <cstdio>
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

  int bad2 = 0;
  auto chk = [&](const char* s, int c2, int c3, int c4) {
    GemvCfg c = parse_gemv_cfg(s);
    if (c.code[2] != c2 || c.code[3] != c3 || c.code[4] != c4) { printf("FAIL %s: %d %d %d\n", s ? s : "null", c.code[2], c.code[3], c.code[4]); ++bad2; }
  };
  chk(nullptr, -1, -1, -1); chk("", -1, -1, -1); chk("*=r96", 1096, 1096, 1096); chk("*=h80", 2080, 2080, 2080);
  chk("2=r80,3=r96,4=h96", 1080, 1096, 2096); chk("4=t", -1, -1, 0); chk("*=r128,4=h128", 1128, 1128, 2128);
  chk("*=r100", -1, -1, -1); chk("5=r80", -1, -1, -1);
  printf("parse_gemv_cfg: %d failures\n", bad2);
  return (bad != 0) || (bad2 != 0);
}
