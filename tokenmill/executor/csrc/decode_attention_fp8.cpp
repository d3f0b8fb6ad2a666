// Paged decode attention over an fp8 KV cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2) with
// AVX-512, for head_dim 64 or 128 and queries in float32, bfloat16 or float16. Same arguments
// and results as attention.cpp's decode_attention; elsewhere the AVX2 kernel takes fp8 caches.
//
// The layout of work is decode_attention_int8's: one job = one request, each kv head in turn,
// its GQA group's heads together, rows and scales prefetched kAhead tokens ahead into L2.
// fp8 widens straight to float32 bits, 16 values in three instructions, as the AVX2 kernel
// does with 8 (see decode_attention_avx2.cpp: e4m3 times 2^-120, e5m2 times 2^-112, made up
// by kUnit on the query, on the rows' scales and on the output).
//   scores  a 16-token chunk of K rows is widened once into a float buffer that stays in L1;
//           each head's q.k reads it by FMA, 16 scores reduced at once (hsum16), times the
//           rows' scales.
//   p.v     the probabilities (times the V rows' scales; the sum of e^(s - max) divides the
//           output) in float; each V row widened once per slice of the row and multiplied
//           into all the group's heads, whose sums stay in registers (G x S <= 16), chunks
//           of kValueChunk tokens read from L1 by the slices after the first.
#include "dispatch.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <atomic>

namespace {
using namespace tokenmill;

constexpr int64_t kAhead = 64;
constexpr int64_t kValueChunk = 64;

template <typename C>
constexpr float kUnit = std::is_same_v<C, c10::Float8_e4m3fn> ? 0x1p60f : 0x1p56f;

// 16 fp8 values as float32 bits: the value times 2^-120 (e4m3) or 2^-112 (e5m2), subnormals exact
template <typename C>
inline __m512 widen16(const C* p) {
  const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {  // s eeee mmm -> s 0000eeee mmm0...
    const __m512i mask = _mm512_set1_epi32(static_cast<int>(0x87F00000u));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(w, 20), mask));
  } else {  // s eeeee mm -> s 000eeeee mm0...
    const __m512i mask = _mm512_set1_epi32(static_cast<int>(0x8FE00000u));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(w, 21), mask));
  }
}

template <int D, int G, typename T, typename C>
void decode_attention_fp8(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache, const float* k_scales,
                          const float* v_scales, const int32_t* block_table, const int32_t* seq_lens, T* out,
                          int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                          int64_t max_blocks, float scale) {
  constexpr int R = D / 16;                  // 512-bit registers of float per row
  constexpr int S = std::min(R, 16 / G);     // of them summed at a time in p.v: G S <= 16 registers
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * D;
  std::atomic<int64_t> next_job{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    PagedRows paged;
    std::vector<float> k_scale, v_scale, qf(group * D), scores, acc(G * D), inv_sum(group);
    alignas(64) float kw[16 * D];  // a chunk's K rows widened
    for (int64_t r = next_job++; r < num_reqs; r = next_job++) {
      const int64_t len = seq_lens[r];
      const int64_t padded = (len + 15) / 16 * 16;  // past len: the last row again, its score dropped
      paged.prepare(block_table + r * max_blocks, len, padded + kAhead, block_size, slot_stride);
      const std::vector<int64_t>& rows = paged.rows;
      scores.resize(group * padded);
      k_scale.resize(padded);
      v_scale.resize(padded);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const C* kh = k_cache + h * D;
        const C* vh = v_cache + h * D;
        const float* ksh = k_scales + h;  // slot i's scale at [i * num_kv_heads]
        const float* vsh = v_scales + h;
        paged.prefetch_first(ksh, vsh, kh, D, std::min(kAhead, padded), num_kv_heads);
        load_row(q + r * q_stride + h * group * D, qf.data(), group * D);
        for (int64_t i = 0; i < group * D; ++i) qf[i] *= scale * kUnit<C>;
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
          paged.chunk_scales(k_scale.data(), v_scale.data(), ksh, vsh, kh, D, t0, kAhead, num_kv_heads, kUnit<C>);
          for (int i = 0; i < 16; ++i) {
            const C* k = kh + rows[t0 + i];
            for (int c = 0; c < R; ++c) _mm512_store_ps(kw + i * D + 16 * c, widen16(k + 16 * c));
          }
          const __m512 ks = _mm512_loadu_ps(k_scale.data() + t0);
          for (int64_t g = 0; g < group; ++g) {
            __m512 qv[R];
            for (int c = 0; c < R; ++c) qv[c] = _mm512_loadu_ps(qf.data() + g * D + 16 * c);
            __m512 dots[16];
            for (int i = 0; i < 16; ++i) {
              dots[i] = _mm512_mul_ps(qv[0], _mm512_load_ps(kw + i * D));
              for (int c = 1; c < R; ++c) {
                dots[i] = _mm512_fmadd_ps(qv[c], _mm512_load_ps(kw + i * D + 16 * c), dots[i]);
              }
            }
            _mm512_storeu_ps(scores.data() + g * padded + t0, _mm512_mul_ps(hsum16(dots), ks));
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          inv_sum[g] = softmax_weighted(scores.data() + g * padded, v_scale.data(), len, padded).inv_sum;
        }
        for (int64_t head0 = 0; head0 < group; head0 += G) {
          std::fill(acc.begin(), acc.end(), 0.f);  // [G][D]
          for (int64_t c0 = 0; c0 < len; c0 += kValueChunk) {
            const int64_t c1 = std::min(len, c0 + kValueChunk);
            for (int s0 = 0; s0 < R; s0 += S) {  // a slice of S * 16 values; later slices read the chunk from L1
              __m512 a[G][S];
              for (int g = 0; g < G; ++g)
                for (int c = 0; c < S; ++c) a[g][c] = _mm512_loadu_ps(acc.data() + g * D + 16 * (s0 + c));
              for (int64_t t = c0; t < c1; ++t) {
                const C* v = vh + rows[t] + 16 * s0;
                if (s0 == 0) prefetch_l2(vh + rows[t + kAhead], D);
                __m512 x[S];
                for (int c = 0; c < S; ++c) x[c] = widen16(v + 16 * c);
                for (int g = 0; g < G; ++g) {
                  const __m512 p = _mm512_set1_ps(scores[(head0 + g) * padded + t]);
                  for (int c = 0; c < S; ++c) a[g][c] = _mm512_fmadd_ps(p, x[c], a[g][c]);
                }
              }
              for (int g = 0; g < G; ++g)
                for (int c = 0; c < S; ++c) _mm512_storeu_ps(acc.data() + g * D + 16 * (s0 + c), a[g][c]);
            }
          }
          for (int64_t i = 0; i < G * D; ++i) acc[i] *= kUnit<C> * inv_sum[head0 + i / D];
          store_row(out + (r * num_heads + h * group + head0) * D, acc.data(), G * D);
        }
      }
    }
  });
}

template <typename T, typename C>
void run_fp8(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
             const float* k_scales, const float* v_scales, const torch::Tensor& block_table,
             const torch::Tensor& seq_lens, int64_t block_size, float scale) {
  const int64_t num_heads = q.size(1), num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  with_head_dim_and_group(q.size(2), group, [&](auto d, auto g) {
    decode_attention_fp8<decltype(d)::value, decltype(g)::value, T, C>(
        q.data_ptr<T>(), q.stride(0), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), k_scales, v_scales,
        block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<T>(), q.size(0), num_heads,
        num_kv_heads, block_size, block_table.size(1), scale);
  });
}

}  // namespace

// Runs the decode if this build and these shapes allow it; false leaves it to the caller.
// Arguments as paged_decode_attention's (checked there).
bool paged_decode_attention_fp8(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                                const torch::Tensor& v_cache, const float* k_scales, const float* v_scales,
                                const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t block_size,
                                float scale) {
  if (q.size(2) != 64 && q.size(2) != 128) return false;
  if (k_cache.scalar_type() == at::kFloat8_e4m3fn) {
    return with_query_type(q.scalar_type(), [&](auto t) {
      run_fp8<decltype(t), c10::Float8_e4m3fn>(out, q, k_cache, v_cache, k_scales, v_scales, block_table, seq_lens,
                                              block_size, scale);
    });
  }
  if (k_cache.scalar_type() == at::kFloat8_e5m2) {
    return with_query_type(q.scalar_type(), [&](auto t) {
      run_fp8<decltype(t), c10::Float8_e5m2>(out, q, k_cache, v_cache, k_scales, v_scales, block_table, seq_lens,
                                            block_size, scale);
    });
  }
  return false;
}

#else

bool paged_decode_attention_fp8(torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                const float*, const float*, const torch::Tensor&, const torch::Tensor&, int64_t,
                                float) {
  return false;
}

#endif
