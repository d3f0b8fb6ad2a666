// Paged decode attention over an int8 KV cache (kv_cache_dtype int8) with AVX512-VNNI, for
// head_dim 64 or 128 and queries in float32, bfloat16 or float16. Same arguments and results
// as attention.cpp's decode_attention; elsewhere the AVX2 kernel takes int8 caches.
//
// The layout of work is decode_attention_bf16's (attention.cpp): one job = one request, each
// kv head in turn, its GQA group's heads together.
//   scores  each head's query (times the softmax scale) rounded to int16 against its largest
//           value; q.k of 32 values a vpdpwssd (int16 pairs, int32 sums) on the K row widened
//           to int16; 16 tokens' sums reduced at once (hsum16), then times the rows' scales.
//           The K rows of a 16-token chunk are read from memory once, and where heads share
//           them (GQA) widened once into an L1 buffer for all of them.
//   softmax over the context, each probability times its V row's scale, then rounded to
//           int16 against the head's largest (an error of at most 2^-16 of it per token).
//   p.v     two tokens' V rows widened and interleaved, so one vpdpwssd adds p[t] v[t][e] +
//           p[t+1] v[t+1][e]; the group's heads (up to 8) share each row, their sums in
//           registers for a slice of the row at a time, the other slices reading the chunk's
//           rows from L1; int32 sums go to float every kIntChunk tokens, before they could
//           overflow (2 * 32767 * 127 * kIntChunk / 2 < 2^31).
// Rows are prefetched kAhead tokens ahead into L2. Against the AVX2 kernel (256-bit vpmaddwd
// and separate adds) this does twice the work an instruction.
#include "dispatch.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <atomic>

namespace {
using namespace tokenmill;

constexpr int64_t kAhead = 64;  // 8 KB of d-128 rows, as the bf16 kernel's 32 rows of twice the bytes
constexpr int64_t kIntChunk = 256;

// 32 int8 values widened to int16
inline __m512i load_i16(const int8_t* p) {
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// out[0:n] = x[0:n] rounded (to nearest, ties to even) to int16 against amax, their largest
// magnitude, n a multiple of 16; returns the scale s, x ~= out * s
inline float round_to_int16(const float* x, int16_t* out, int64_t n, float amax) {
  const float s = amax > 0.f ? amax / 32767.f : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / s);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtsepi32_epi16(r));
  }
  return s;
}

inline float absmax(const float* x, int64_t n) {
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  return _mm512_reduce_max_ps(m);
}

template <int D, int G, typename T>
void decode_attention_int8(const T* q, int64_t q_stride, const int8_t* k_cache, const int8_t* v_cache,
                           const float* k_scales, const float* v_scales, const int32_t* block_table,
                           const int32_t* seq_lens, T* out, int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t block_size, int64_t max_blocks, float scale) {
  constexpr int C = D / 32;  // 512-bit registers of int16 per row
  constexpr int S = std::min(C, 8 / G);  // of them summed at a time: 2 S G <= 16 registers of sums
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * D;
  std::atomic<int64_t> next_job{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    PagedRows paged;
    std::vector<float> k_scale, v_scale, qf(D), scores, acc(G * D), q_scale(group), p_scale(group);
    std::vector<int16_t> qi(group * D), pi;  // queries [group][D], probabilities [group][padded]
    alignas(64) int16_t wide[16 * D];  // a chunk's K rows in int16, where a GQA group shares them
    for (int64_t r = next_job++; r < num_reqs; r = next_job++) {
      const int64_t len = seq_lens[r];
      const int64_t padded = (len + 32) / 32 * 32;  // past len: the last row again, weighed 0
      paged.prepare(block_table + r * max_blocks, len, padded + kAhead, block_size, slot_stride);
      const std::vector<int64_t>& rows = paged.rows;
      scores.resize(group * padded);
      pi.resize(group * padded);
      k_scale.resize(padded);  // past len: a real row's scale, its score dropped
      v_scale.resize(padded);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int8_t* kh = k_cache + h * D;
        const int8_t* vh = v_cache + h * D;
        const float* ksh = k_scales + h;  // slot i's scale at [i * num_kv_heads]
        const float* vsh = v_scales + h;
        paged.prefetch_first(ksh, vsh, kh, D, std::min(kAhead, padded), num_kv_heads);
        for (int64_t g = 0; g < group; ++g) {
          load_row(q + r * q_stride + (h * group + g) * D, qf.data(), D);
          q_scale[g] = round_to_int16(qf.data(), qi.data() + g * D, D, absmax(qf.data(), D)) * scale;
        }
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
          paged.chunk_scales(k_scale.data(), v_scale.data(), ksh, vsh, kh, D, t0, kAhead, num_kv_heads, 1.f);
          const __m512 ks = _mm512_loadu_ps(k_scale.data() + t0);
          if (group > 1) {  // the chunk's rows widened once for the group's heads
            for (int i = 0; i < 16; ++i)
              for (int c = 0; c < C; ++c)
                _mm512_store_si512(wide + i * D + 32 * c, load_i16(kh + rows[t0 + i] + 32 * c));
          }
          for (int64_t g = 0; g < group; ++g) {
            __m512i qv[C];
            for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_si512(qi.data() + g * D + 32 * c);
            __m512 dots[16];
            for (int i = 0; i < 16; ++i) {
              const int8_t* k = kh + rows[t0 + i];
              const int16_t* w = wide + i * D;
              auto row = [&](int c) { return group > 1 ? _mm512_load_si512(w + 32 * c) : load_i16(k + 32 * c); };
              __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), row(0), qv[0]);
              for (int c = 1; c < C; ++c) d = _mm512_dpwssd_epi32(d, row(c), qv[c]);
              dots[i] = _mm512_cvtepi32_ps(d);
            }
            const __m512 s = _mm512_mul_ps(hsum16(dots), _mm512_mul_ps(ks, _mm512_set1_ps(q_scale[g])));
            _mm512_storeu_ps(scores.data() + g * padded + t0, s);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * padded;
          const Weighted p = softmax_weighted(s, v_scale.data(), len, padded);
          p_scale[g] = round_to_int16(s, pi.data() + g * padded, padded, p.amax) * p.inv_sum;
        }
        for (int64_t head0 = 0; head0 < group; head0 += G) {
          std::fill(acc.begin(), acc.end(), 0.f);  // [G][C][lo 16 | hi 16], unpack_pairs' order
          for (int64_t c0 = 0; c0 < len; c0 += kIntChunk) {
            const int64_t c1 = std::min(len, c0 + kIntChunk);
            for (int c0s = 0; c0s < C; c0s += S) {  // a slice of S * 32 values; later slices read the chunk from L1
              __m512i lo[G][S], hi[G][S];
              for (int g = 0; g < G; ++g)
                for (int c = 0; c < S; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_si512();
              for (int64_t t = c0; t < c1; t += 2) {
                const int8_t* v0 = vh + rows[t] + 32 * c0s;
                const int8_t* v1 = vh + rows[t + 1] + 32 * c0s;
                if (c0s == 0) {
                  prefetch_l2(vh + rows[t + kAhead], D);
                  prefetch_l2(vh + rows[t + 1 + kAhead], D);
                }
                __m512i pp[G];
                for (int g = 0; g < G; ++g) {
                  int32_t pair;  // tokens t (low half) and t + 1
                  std::memcpy(&pair, pi.data() + (head0 + g) * padded + t, sizeof(pair));
                  pp[g] = _mm512_set1_epi32(pair);
                }
                for (int c = 0; c < S; ++c) {
                  const __m512i a = load_i16(v0 + 32 * c), b = load_i16(v1 + 32 * c);
                  const __m512i l = _mm512_unpacklo_epi16(a, b), u = _mm512_unpackhi_epi16(a, b);
                  for (int g = 0; g < G; ++g) {
                    lo[g][c] = _mm512_dpwssd_epi32(lo[g][c], l, pp[g]);
                    hi[g][c] = _mm512_dpwssd_epi32(hi[g][c], u, pp[g]);
                  }
                }
              }
              for (int g = 0; g < G; ++g) {
                const __m512 ps = _mm512_set1_ps(p_scale[head0 + g]);
                for (int c = 0; c < S; ++c) {
                  float* a = acc.data() + (g * C + c0s + c) * 32;
                  _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[g][c]), ps, _mm512_loadu_ps(a)));
                  _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[g][c]), ps, _mm512_loadu_ps(a + 16)));
                }
              }
            }
          }
          for (int g = 0; g < G; ++g) {
            T* o = out + (r * num_heads + h * group + head0 + g) * D;
            for (int c = 0; c < C; ++c) {
              const float* a = acc.data() + (g * C + c) * 32;
              store_unpacked(o + 32 * c, _mm512_loadu_ps(a), _mm512_loadu_ps(a + 16));
            }
          }
        }
      }
    }
  });
}

template <typename T>
void run_int8(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
              const float* k_scales, const float* v_scales, const torch::Tensor& block_table,
              const torch::Tensor& seq_lens, int64_t block_size, float scale) {
  const int64_t num_heads = q.size(1), num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  with_head_dim_and_group(q.size(2), group, [&](auto d, auto g) {
    decode_attention_int8<decltype(d)::value, decltype(g)::value, T>(
        q.data_ptr<T>(), q.stride(0), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), k_scales, v_scales,
        block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<T>(), q.size(0), num_heads,
        num_kv_heads, block_size, block_table.size(1), scale);
  });
}

}  // namespace

// Runs the decode if this build and these shapes allow it; false leaves it to the caller.
// Arguments as paged_decode_attention's (checked there).
bool paged_decode_attention_int8(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                                 const torch::Tensor& v_cache, const float* k_scales, const float* v_scales,
                                 const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t block_size,
                                 float scale) {
  if (k_cache.scalar_type() != at::kChar || (q.size(2) != 64 && q.size(2) != 128)) return false;
  return with_query_type(q.scalar_type(), [&](auto t) {
    run_int8<decltype(t)>(out, q, k_cache, v_cache, k_scales, v_scales, block_table, seq_lens, block_size, scale);
  });
}

#else

bool paged_decode_attention_int8(torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                 const float*, const float*, const torch::Tensor&, const torch::Tensor&, int64_t,
                                 float) {
  return false;
}

#endif
