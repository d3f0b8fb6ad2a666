// Paged decode attention written out in AVX2 + FMA + F16C, for every cache element type:
// float32, bfloat16, float16 and the 8-bit caches (int8, fp8 e4m3 / e5m2, each row with its
// scale). Same arguments and results as attention.cpp's generic decode_attention; it runs
// wherever the build has these instructions and head_dim is a multiple of 16.
//
// One job = one row's kv head and the query heads that share it, or those of a run of rows that
// attend over the same blocks (speculative verification: a request's last token and its drafts,
// each attending one token more), in tiles of up to 8 query vectors; a tile's K and V rows are
// read once for all its vectors, each of which attends to its own length:
//   scores   each K row is widened to float once and multiplied into every head's query
//            (int8: the query rounded to int16 per head, q.k summed in int32 by vpmaddwd),
//            two tokens at a time where up to 4 heads share the kv head (each query load
//            serves both); 8 tokens' dot products are summed across lanes together (hsum8).
//   softmax  over the context, then each probability times its V row's scale.
//   p.v      the output tile (heads x a slice of head_dim) stays in 8 registers while the
//            context streams past; each V row is widened once per slice. int8: in int32
//            sums of int16 probabilities times the values (weigh_values_int).
// fp8 goes straight to float32 bits: e4m3 (s eeee mmm) sign-extended to 32 bits, shifted
// left 20 and masked is s 0000eeee mmm0..0, the fp8 value times 2^-120 (subnormals land on
// float32 subnormals, exactly); e5m2 shifted left 21, the value times 2^-112. Three
// instructions per 8 values, against five (e4m3) or a float16 conversion (e5m2) before:
// e4m3 1.16-1.22x the kernel's arithmetic. The power of two is made up in halves, so that
// no factor overflows: the query and the rows' scales are multiplied by 2^60 (2^56), and the
// output by 2^60 (2^56) again.
// Memory: rows are prefetched kAhead tokens ahead into L2 (with the 8-bit caches' scales),
// and p.v goes through the context in chunks that stay in L1 across the slices.
#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include <atomic>
#include <limits>

namespace {
using namespace tokenmill;

// 8 consecutive cache elements as float (e4m3: divided by 256); int8 rows never go through
// floats (vpmaddwd in q.k and p.v)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const c10::Float8_e5m2* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  // as e4m3's below, shifted left 21: eeeeemm lands in bits 27..21, the value times 2^-112
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepi8_epi32(b), 21);
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0x8FE00000u))));
}
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  // sign-extended to 32 bits and shifted left 20: eeeemmm lands in bits 26..20 (the float's
  // exponent is 0000eeee), the sign in bit 31 and copies of it in bits 30..27, which the
  // mask clears
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepi8_epi32(b), 20);
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0x87F00000u))));
}
// fp8's load8 gives the value times 2^-120 (e4m3) or 2^-112 (e5m2): the query, the rows'
// scales and the output each make up half of it (kUnit * kUnit on q.k and on p.v)
template <typename C>
constexpr float kUnit = std::is_same_v<C, c10::Float8_e4m3fn> ? 0x1p60f
                        : std::is_same_v<C, c10::Float8_e5m2> ? 0x1p56f : 1.f;

// lane i = the sum of the 8 lanes of a[i]
inline __m256 hsum8(const __m256* a) {
  const __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}
inline __m256 hsum8(const __m256i* a) {
  const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
  const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a[4], a[5]), _mm256_hadd_epi32(a[6], a[7]));
  return _mm256_cvtepi32_ps(
      _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31)));
}

// Rows are fetched into L2, not L1 (vec.h's prefetch_l2): L2 keeps more misses in flight, and the
// rows of one job fit there. Measured on a Zen 4 with a float32 cache, 32 requests x 1024
// tokens: 1.4-1.6x the kernel's speed with T0 (11% of the 56M model's whole decode run).

// rows are prefetched this many tokens ahead of their use (a memory latency's worth;
// 96 and 192 were no faster)
constexpr int64_t kAhead = 48;

// What one thread keeps between jobs
struct Scratch {
  std::vector<int64_t> slot;                  // each context token's cache slot, padded to whole 8s (+kAhead)
  std::vector<int64_t> rows;                  // its row's element offset: slot * kv_heads * head_dim
  std::vector<float> k_scale, v_scale;        // each token's row scale (times kUnit) for this kv head
  const float* ks_src = nullptr;              // 8-bit caches: this kv head's scales, slot i's at [i * kv_heads]
  const float* vs_src = nullptr;
  int64_t kv_heads = 0;
  std::vector<float> scores;                  // [NG][padded]
  std::vector<float> qf;                      // [NG][D], times the softmax scale
  std::vector<int16_t> qi;                    // int8 caches: qf rounded to int16, [NG][D]
  std::vector<float> acc;                     // [NG][D]
  std::vector<int16_t> pi;                    // int8 caches: the probabilities rounded to int16, [4][padded]
};

// 8-bit caches: tokens t0..t0+7's row scales (times kUnit); the scales kAhead tokens on are
// fetched into L2 (each block's scales sit apart from the rows: unfetched, every block
// waited on two misses)
template <typename C>
inline void gather_scales(Scratch& s, int64_t t0) {
  for (int i = 0; i < 8; ++i) {
    const int64_t now = s.slot[t0 + i] * s.kv_heads, ahead = s.slot[t0 + kAhead + i] * s.kv_heads;
    s.k_scale[t0 + i] = s.ks_src[now] * kUnit<C>;
    s.v_scale[t0 + i] = s.vs_src[now] * kUnit<C>;
    _mm_prefetch(reinterpret_cast<const char*>(s.ks_src + ahead), _MM_HINT_T1);
    _mm_prefetch(reinterpret_cast<const char*>(s.vs_src + ahead), _MM_HINT_T1);
  }
}

// scores[g][t] = q_g . k_t (times the row's scale) for the NG heads from head0, every t < len
template <int NG, typename C>
void score_tokens(Scratch& s, const C* k_head, int64_t len, int64_t padded, int64_t D, const float* q_scale) {
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    if constexpr (kQuantized<C>) gather_scales<C>(s, t0);
    if constexpr (std::is_same_v<C, int8_t>) {
      __m256i dots[NG][8];
      constexpr int P = NG <= 4 ? 2 : 1;  // tokens that share each query load (1.0-1.2x)
      for (int i = 0; i < 8; i += P) {
        const int8_t* k[P];
        __m256i a[P][NG];
        for (int p = 0; p < P; ++p) {
          k[p] = k_head + s.rows[t0 + i + p];
          prefetch_l2(k_head + s.rows[t0 + kAhead + i + p], D);
          for (int g = 0; g < NG; ++g) a[p][g] = _mm256_setzero_si256();
        }
#pragma GCC unroll 4
        for (int64_t e = 0; e < D; e += 16) {
          __m256i kw[P];
          for (int p = 0; p < P; ++p)
            kw[p] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k[p] + e)));
          for (int g = 0; g < NG; ++g) {
            const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.qi.data() + g * D + e));
            for (int p = 0; p < P; ++p) a[p][g] = _mm256_add_epi32(a[p][g], _mm256_madd_epi16(kw[p], qw));
          }
        }
        for (int p = 0; p < P; ++p)
          for (int g = 0; g < NG; ++g) dots[g][i + p] = a[p][g];
      }
      const __m256 ks = _mm256_loadu_ps(s.k_scale.data() + t0);
      for (int g = 0; g < NG; ++g)
        _mm256_storeu_ps(s.scores.data() + g * padded + t0, _mm256_mul_ps(_mm256_mul_ps(hsum8(dots[g]), ks),
                                                                          _mm256_set1_ps(q_scale[g])));
    } else {
      __m256 dots[NG][8];
      constexpr int P = NG <= 4 ? 2 : 1;  // tokens that share each query load (1.0-1.2x)
      for (int i = 0; i < 8; i += P) {
        const C* k[P];
        __m256 a[P][NG];
        for (int p = 0; p < P; ++p) {
          k[p] = k_head + s.rows[t0 + i + p];
          prefetch_l2(k_head + s.rows[t0 + kAhead + i + p], D * sizeof(C));
          for (int g = 0; g < NG; ++g) a[p][g] = _mm256_setzero_ps();
        }
#pragma GCC unroll 4
        for (int64_t e = 0; e < D; e += 8) {
          __m256 kw[P];
          for (int p = 0; p < P; ++p) kw[p] = load8(k[p] + e);
          for (int g = 0; g < NG; ++g) {
            const __m256 qv = _mm256_loadu_ps(s.qf.data() + g * D + e);
            for (int p = 0; p < P; ++p) a[p][g] = _mm256_fmadd_ps(qv, kw[p], a[p][g]);
          }
        }
        for (int p = 0; p < P; ++p)
          for (int g = 0; g < NG; ++g) dots[g][i + p] = a[p][g];
      }
      for (int g = 0; g < NG; ++g) {
        __m256 d = hsum8(dots[g]);
        if constexpr (kQuantized<C>) d = _mm256_mul_ps(d, _mm256_loadu_ps(s.k_scale.data() + t0));
        _mm256_storeu_ps(s.scores.data() + g * padded + t0, d);
      }
    }
  }
}

// acc[g][e] = sum over t < len of scores[g][t] * v_t[e] (the scores already weighted by
// each row's scale): a tile of NG heads x 8 * W values in registers, slice by slice
// (8 * W divides D; NG * W <= 8 leaves registers for the row and the probabilities).
// The context goes by in chunks of kValueChunk tokens, all slices of one chunk before the
// next, so that the slices after the first read the chunk's rows from L1 (whole-context
// passes read them from L2 or, past about 2,000 tokens of a bf16 d-128 head, from memory).
constexpr int64_t kValueChunk = 64;  // 32 and 128 measured the same
template <int NG, int W, typename C>
void weigh_values(Scratch& s, const C* v_head, int64_t len, int64_t padded, int64_t D) {
  for (int64_t c0 = 0; c0 < len; c0 += kValueChunk) {
    const int64_t c1 = std::min(len, c0 + kValueChunk);
    for (int64_t e0 = 0; e0 < D; e0 += 8 * W) {
      float* acc = s.acc.data() + e0;
      __m256 a[NG][W];
      for (int g = 0; g < NG; ++g)
        for (int w = 0; w < W; ++w) a[g][w] = c0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + g * D + 8 * w);
      for (int64_t t = c0; t < c1; ++t) {
        const C* v = v_head + s.rows[t] + e0;
        if (e0 == 0) prefetch_l2(v_head + s.rows[t + kAhead], D * sizeof(C));
        __m256 p[NG];
        for (int g = 0; g < NG; ++g) p[g] = _mm256_set1_ps(s.scores[g * padded + t]);
        for (int w = 0; w < W; ++w) {
          const __m256 x = load8(v + 8 * w);
          for (int g = 0; g < NG; ++g) a[g][w] = _mm256_fmadd_ps(p[g], x, a[g][w]);
        }
      }
      for (int g = 0; g < NG; ++g)
        for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + g * D + 8 * w, a[g][w]);
    }
  }
}

// int8 caches: acc[g][e] = sum over t < len of p[g][t] * v_t[e] in integers, for NG (<= 4)
// heads from g0. Each head's probabilities (times the V rows' scales) are rounded to int16
// against their largest, an error of at most 2^-16 of that largest per token; two tokens'
// rows are interleaved so that one vpmaddwd multiplies and adds both. The int32 sums go to
// float every kIntChunk tokens, before they could overflow (2 * 32767 * 128 * kIntChunk / 2 < 2^31),
// and the V rows of a chunk stay in L1/L2 while its slices of 16 * SL values are summed.
// Against widening each value to float for an FMA: 1.1-1.6x the whole kernel.
constexpr int64_t kIntChunk = 256;
template <int NG, int SL>
void weigh_values_int(Scratch& s, const int8_t* v_head, int64_t len, int64_t padded, int64_t D, int g0) {
  const int64_t even = (len + 1) / 2 * 2;
  float p_scale[NG];
  s.pi.resize(NG * padded);
  for (int g = 0; g < NG; ++g) {
    const float* p = s.scores.data() + (g0 + g) * padded;
    int16_t* pi = s.pi.data() + g * padded;
    float mx = 0.f;
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, p[t]);
    p_scale[g] = mx > 0.f ? mx / 32767.f : 1.f;
    const float inv = 1.f / p_scale[g];
    for (int64_t t = 0; t < len; ++t) pi[t] = static_cast<int16_t>(std::nearbyint(p[t] * inv));
    for (int64_t t = len; t < even; ++t) pi[t] = 0;
  }
  for (int g = 0; g < NG; ++g) std::fill_n(s.acc.data() + (g0 + g) * D, D, 0.f);
  for (int64_t c0 = 0; c0 < even; c0 += kIntChunk) {
    const int64_t c1 = std::min(even, c0 + kIntChunk);
    for (int64_t e0 = 0; e0 < D; e0 += 16 * SL) {
      __m256i lo[NG][SL], hi[NG][SL];
      for (int g = 0; g < NG; ++g)
        for (int w = 0; w < SL; ++w) lo[g][w] = hi[g][w] = _mm256_setzero_si256();
      for (int64_t t = c0; t < c1; t += 2) {
        const int8_t* va = v_head + s.rows[t] + e0;
        const int8_t* vb = v_head + s.rows[t + 1] + e0;
        if (e0 == 0) {
          prefetch_l2(v_head + s.rows[t + kAhead], D);
          prefetch_l2(v_head + s.rows[t + 1 + kAhead], D);
        }
        __m256i pp[NG];
        for (int g = 0; g < NG; ++g) {
          int32_t pair;
          std::memcpy(&pair, s.pi.data() + g * padded + t, sizeof(pair));
          pp[g] = _mm256_set1_epi32(pair);
        }
        for (int w = 0; w < SL; ++w) {
          const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(va + 16 * w)));
          const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vb + 16 * w)));
          const __m256i l = _mm256_unpacklo_epi16(a, b), h = _mm256_unpackhi_epi16(a, b);
          for (int g = 0; g < NG; ++g) {
            lo[g][w] = _mm256_add_epi32(lo[g][w], _mm256_madd_epi16(l, pp[g]));
            hi[g][w] = _mm256_add_epi32(hi[g][w], _mm256_madd_epi16(h, pp[g]));
          }
        }
      }
      // lo holds elements 0-3 | 8-11 of the 16, hi 4-7 | 12-15
      for (int g = 0; g < NG; ++g) {
        const __m256 sc = _mm256_set1_ps(p_scale[g]);
        float* acc = s.acc.data() + (g0 + g) * D + e0;
        for (int w = 0; w < SL; ++w) {
          const __m256 l = _mm256_cvtepi32_ps(lo[g][w]), h = _mm256_cvtepi32_ps(hi[g][w]);
          float* o = acc + 16 * w;
          _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_permute2f128_ps(l, h, 0x20), sc, _mm256_loadu_ps(o)));
          _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_permute2f128_ps(l, h, 0x31), sc, _mm256_loadu_ps(o + 8)));
        }
      }
    }
  }
}

// a query vector of a job: one query head of one row, and the context it attends to
template <typename T>
struct Query {
  const T* q;
  T* out;
  int64_t len;
};

// the NG query vectors `tile`, over the context of the longest (the others' scores past their
// own lengths are zeros: a row's output is the same whatever it is attended with)
template <int NG, typename T, typename C>
void attend(Scratch& s, const Query<T>* tile, const C* k_head, const C* v_head, int64_t D, float scale) {
  int64_t len = 0;
  for (int g = 0; g < NG; ++g) len = std::max(len, tile[g].len);
  const int64_t padded = (len + 7) / 8 * 8;
  s.scores.resize(NG * padded);
  if constexpr (kQuantized<C>) {
    s.k_scale.resize(padded);
    s.v_scale.resize(padded);
  }
  float q_scale[NG] = {};
  s.qf.resize(NG * D);
  for (int g = 0; g < NG; ++g) load_row(tile[g].q, s.qf.data() + g * D, D);
  for (int64_t i = 0; i < NG * D; ++i) s.qf[i] *= scale * kUnit<C>;
  if constexpr (std::is_same_v<C, int8_t>) {
    // each head's query rounded to int16 (|q.k| < 32767 * 127 * D fits int32 for D <= 512)
    s.qi.resize(NG * D);
    for (int g = 0; g < NG; ++g) {
      const float* qg = s.qf.data() + g * D;
      float amax = 0.f;
      for (int64_t e = 0; e < D; ++e) amax = std::max(amax, std::abs(qg[e]));
      q_scale[g] = amax > 0.f ? amax / 32767.f : 1.f;
      const float inv = 1.f / q_scale[g];
      for (int64_t e = 0; e < D; ++e) s.qi[g * D + e] = static_cast<int16_t>(std::nearbyint(qg[e] * inv));
    }
  }
  score_tokens<NG>(s, k_head, len, padded, D, q_scale);
  for (int g = 0; g < NG; ++g) {
    float* p = s.scores.data() + g * padded;
    softmax_inplace(p, tile[g].len);
    std::fill(p + tile[g].len, p + len, 0.f);
    if constexpr (kQuantized<C>) {  // each probability weighted by its V row's scale
#pragma omp simd
      for (int64_t t = 0; t < tile[g].len; ++t) p[t] *= s.v_scale[t];
    }
  }
  s.acc.resize(NG * D);
  constexpr int W = 8 / NG;
  if constexpr (std::is_same_v<C, int8_t>) {  // up to 4 heads at a time (8 int32 sums each)
    constexpr int H = NG > 4 ? 4 : NG;
    constexpr int SL = 4 / H > 2 ? 2 : 4 / H;
    for (int g0 = 0; g0 < NG; g0 += H) {
      if (D % (16 * SL) == 0) weigh_values_int<H, SL>(s, v_head, len, padded, D, g0);
      else weigh_values_int<H, 1>(s, v_head, len, padded, D, g0);
    }
  } else if (D % (8 * W) == 0) {
    weigh_values<NG, W>(s, v_head, len, padded, D);
  } else {
    weigh_values<NG, std::min(W, 2)>(s, v_head, len, padded, D);  // D is a multiple of 16
  }
  if constexpr (kUnit<C> != 1.f)
    for (int64_t i = 0; i < NG * D; ++i) s.acc[i] *= kUnit<C>;
  for (int g = 0; g < NG; ++g) store_row(tile[g].out, s.acc.data() + g * D, D);
}

// Rows attended in one job: the runs of consecutive rows whose block tables agree over the blocks
// of the run's longest context, at most `most` rows each (`first`: each run's first row, then
// num_reqs). A verification's rows share K and V this way; each row's own job read the context
// again, from beyond L2 once the contexts outgrow it. The built-in model's heads (4, 2 kv heads,
// d 64, float32) on a 2-core AMD EPYC, 5 rows a request, in 3 alternating runs: 16 requests over
// 3,000 tokens 7.9-13.5 ms as rows alone, 7.7 together; 4 requests 1.5-3.2 ms, 1.6-1.7; over 256
// tokens 0.53-0.64 ms, 0.44-0.52; one request over 1,024 tokens the same (0.13 ms).
std::vector<int64_t> row_runs(const int32_t* block_table, const int32_t* seq_lens, int64_t num_reqs,
                              int64_t max_blocks, int64_t block_size, int64_t most) {
  std::vector<int64_t> first;
  int64_t longest = 0;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t len = std::max(longest, static_cast<int64_t>(seq_lens[r]));
    const int64_t blocks = (len + block_size - 1) / block_size;
    const bool joins = !first.empty() && r - first.back() < most &&
                       std::equal(block_table + r * max_blocks, block_table + r * max_blocks + blocks,
                                  block_table + first.back() * max_blocks);
    if (joins) {
      longest = len;
    } else {
      first.push_back(r);
      longest = seq_lens[r];
    }
  }
  first.push_back(num_reqs);
  return first;
}

template <typename T, typename C>
void decode_attention_avx2(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache, const float* k_scales,
                           const float* v_scales, const int32_t* block_table, const int32_t* seq_lens, T* out,
                           int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t D,
                           int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * D;
  // runs of rows as long as leaves every thread a job (a run's rows are one thread's), at most 16
  const int64_t threads = at::get_num_threads();
  const int64_t most = std::clamp<int64_t>(num_reqs * num_kv_heads / threads, 1, 16);
  const std::vector<int64_t> runs = row_runs(block_table, seq_lens, num_reqs, max_blocks, block_size, most);
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  std::atomic<int64_t> next_job{0};
  const int64_t num_jobs = num_runs * num_kv_heads;
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch s;
    std::vector<Query<T>> queries;
    int64_t prepared = -1;  // the run whose rows are in s.rows
    for (int64_t job = next_job++; job < num_jobs; job = next_job++) {
      const int64_t run = job / num_kv_heads, h = job % num_kv_heads;
      const int64_t r0 = runs[run], r1 = runs[run + 1];
      int64_t len = 0;  // the run's longest context, over the first row's blocks
      for (int64_t r = r0; r < r1; ++r) len = std::max(len, static_cast<int64_t>(seq_lens[r]));
      const int64_t padded = (len + 7) / 8 * 8;
      if (prepared != run) {
        // each token's slot (past len the last one again: real memory) and its row's element offset
        slot_rows(s.slot, block_table + r0 * max_blocks, len, padded + kAhead, block_size, 1);
        s.rows.resize(padded + kAhead);
        for (int64_t t = 0; t < padded + kAhead; ++t) s.rows[t] = s.slot[t] * slot_stride;
        prepared = run;
      }
      if constexpr (kQuantized<C>) {
        s.ks_src = k_scales + h;
        s.vs_src = v_scales + h;
        s.kv_heads = num_kv_heads;
        for (int64_t t = 0; t < std::min(kAhead, padded); ++t) {
          _mm_prefetch(reinterpret_cast<const char*>(s.ks_src + s.slot[t] * num_kv_heads), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(s.vs_src + s.slot[t] * num_kv_heads), _MM_HINT_T1);
        }
      }
      queries.clear();
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t head = h * group; head < (h + 1) * group; ++head)
          queries.push_back({q + r * q_stride + head * D, out + (r * num_heads + head) * D, seq_lens[r]});
      const C* kh = k_cache + h * D;
      const C* vh = v_cache + h * D;
      // tiles of 8 query vectors, the rest in 4, 2 and 1 (the register tile: 8 x 8 values of V)
      for (size_t i = 0; i < queries.size();) {
        const size_t left = queries.size() - i;
        if (left >= 8) attend<8>(s, queries.data() + i, kh, vh, D, scale), i += 8;
        else if (left >= 4) attend<4>(s, queries.data() + i, kh, vh, D, scale), i += 4;
        else if (left >= 2) attend<2>(s, queries.data() + i, kh, vh, D, scale), i += 2;
        else attend<1>(s, queries.data() + i, kh, vh, D, scale), i += 1;
      }
    }
  });
}

}  // namespace

// Runs the decode if this build and these shapes allow it; false leaves it to the caller.
// Arguments as paged_decode_attention's (checked there); scales null for a 16/32-bit cache.
bool paged_decode_attention_avx2(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                                 const torch::Tensor& v_cache, const float* k_scales, const float* v_scales,
                                 const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t block_size,
                                 float scale) {
  const int64_t D = q.size(2);
  if (D % 16 != 0 || D > 512) return false;
  auto with_q = [&](auto* q_data) -> bool {
    using T = std::remove_pointer_t<decltype(q_data)>;
    auto run = [&](auto* kc, auto* vc) {
      decode_attention_avx2(q_data, q.stride(0), kc, vc, k_scales, v_scales, block_table.data_ptr<int32_t>(),
                            seq_lens.data_ptr<int32_t>(), out.data_ptr<T>(), q.size(0), q.size(1), k_cache.size(1), D,
                            block_size, block_table.size(1), scale);
      return true;
    };
    switch (k_cache.scalar_type()) {
      case at::kChar: return run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>());
      case at::kFloat8_e4m3fn:
        return run(k_cache.data_ptr<c10::Float8_e4m3fn>(), v_cache.data_ptr<c10::Float8_e4m3fn>());
      case at::kFloat8_e5m2: return run(k_cache.data_ptr<c10::Float8_e5m2>(), v_cache.data_ptr<c10::Float8_e5m2>());
      default:
        return k_cache.scalar_type() == q.scalar_type() && run(k_cache.data_ptr<T>(), v_cache.data_ptr<T>());
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat: return with_q(q.data_ptr<float>());
    case at::kBFloat16: return with_q(q.data_ptr<c10::BFloat16>());
    case at::kHalf: return with_q(q.data_ptr<c10::Half>());
    default: return false;
  }
}

#else

bool paged_decode_attention_avx2(torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                 const float*, const float*, const torch::Tensor&, const torch::Tensor&, int64_t,
                                 float) {
  return false;
}

#endif
