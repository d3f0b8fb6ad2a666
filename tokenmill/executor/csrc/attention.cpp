// Paged decode attention on the CPU: one query token per request, K/V read in place
// through the block table (no gather copy, no padding to the longest context).
//
//   q          [num_reqs, num_heads, head_dim]
//   k/v cache  [num_slots, num_kv_heads, head_dim], slot = block_id * block_size + offset
//   block_table[num_reqs, max_blocks] int32, seq_lens [num_reqs] int32
//   out        [num_reqs, num_heads, head_dim]
//
// Work is split by request; each handles every head, and with it each kv head's
// query group (GQA), so every K/V row is read once per step. Math is float32.
//
// Where the build has AVX2 (+ FMA, F16C) and head_dim is a multiple of 16, every cache dtype
// goes to decode_attention_avx2.cpp instead; decode_attention below is the portable loop.
// bfloat16 with head_dim 32, 64 or 128 on a CPU with AVX512-BF16 takes a faster path still
// (decode_attention_bf16): q.k and p.v by vdpbf16ps (bf16 products, float32 sums), 16
// scores reduced at once, the output accumulated in registers. As in PyTorch's CPU flash
// attention, the probabilities are rounded to bfloat16 before p.v (unnormalised, e^(s - max):
// the sum divides the output; softmax_weighted in vec.h). Its K rows are read once
// for all the heads of a GQA group (a 16-token chunk stays in L1 while each head's scores
// are taken) and the rows are prefetched into L2. Before (each head swept the whole context
// for its scores, nothing prefetched) it was 0.44-0.88x the AVX2 kernel's speed past 16 MB
// of K and V a step on a 2-core Xeon (32 requests of an 8B-like shape at 1,024 tokens: 24.4
// ms against 10.7); now 1.02-1.38x at every size measured
// (benchmarks/kv_cache_attention.py, contexts 64 to 4,096, both shapes).
#include "vec.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

bool paged_decode_attention_avx2(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                                 const torch::Tensor& v_cache, const float* k_scales, const float* v_scales,
                                 const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t block_size,
                                 float scale);

bool paged_decode_attention_fp8(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                                const torch::Tensor& v_cache, const float* k_scales, const float* v_scales,
                                const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t block_size,
                                float scale);
bool paged_decode_attention_int8(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                                 const torch::Tensor& v_cache, const float* k_scales, const float* v_scales,
                                 const torch::Tensor& block_table, const torch::Tensor& seq_lens, int64_t block_size,
                                 float scale);

namespace {
using namespace tokenmill;

bool is_8bit(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// C: the cache's element type, T's or an 8-bit one (kQuantized) whose rows are each
// multiplied by their scale ([slots, kv_heads] float32) as they are read.
template <typename T, typename C>
void decode_attention(const T* q, int64_t q_stride, const C* k_cache, const C* v_cache, const float* k_scales,
                      const float* v_scales, const int32_t* block_table, const int32_t* seq_lens, T* out,
                      int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_blocks, float scale) {
  // One job = one request, all heads: a block's K (or V) rows for every kv head are one
  // contiguous run of memory, read front to back once.
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  // Contexts differ in length, so a static split of the jobs leaves threads idle:
  // each thread takes the next request from a shared counter instead.
  std::atomic<int64_t> next_job{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim), scores, widened(head_dim);
    for (int64_t r = next_job++; r < num_reqs; r = next_job++) {
      const int64_t len = seq_lens[r];
      const int32_t* blocks = block_table + r * max_blocks;
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      scores.resize(num_heads * len);  // [head][token]
      const T* qr = q + r * q_stride;
      load_row(qr, qf.data(), num_heads * head_dim);
      for (float& x : qf) x *= scale;
      // Calls f(t, head, row) for every context token t and query head, row being the
      // head's K (or V) row in `cache`: blocks in table order, rows in slot order. A
      // quantized row is widened to float and scaled once, for all heads of its group.
      auto for_each_row = [&](const C* cache, const float* scales, auto&& f) {
        for (int64_t j = 0; j < num_blocks; ++j) {
          const int64_t first_slot = static_cast<int64_t>(blocks[j]) * block_size;
          const C* block = cache + first_slot * slot_stride;
          const int64_t n = std::min(block_size, len - j * block_size);
          if (j + 1 < num_blocks) {
            // blocks sit at random places: fetch the next one while this one is computed
            prefetch_bytes(cache + static_cast<int64_t>(blocks[j + 1]) * block_size * slot_stride,
                           block_size * slot_stride * sizeof(C));
          }
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t h = 0; h < num_kv_heads; ++h) {
              const C* row = block + i * slot_stride + h * head_dim;
              if constexpr (kQuantized<C>) {
                const float s = scales[(first_slot + i) * num_kv_heads + h];
                float* w = widened.data();
#pragma omp simd
                for (int64_t e = 0; e < head_dim; ++e) w[e] = load(row, e) * s;
                for (int64_t g = 0; g < group; ++g) f(j * block_size + i, h * group + g, w);
              } else {
                for (int64_t g = 0; g < group; ++g) f(j * block_size + i, h * group + g, row);
              }
            }
          }
        }
      };
      // scores = q . k
      for_each_row(k_cache, k_scales, [&](int64_t t, int64_t head, const auto* k) {
        scores[head * len + t] = dot(qf.data() + head * head_dim, k, head_dim);
      });
      for (int64_t head = 0; head < num_heads; ++head) softmax_inplace(scores.data() + head * len, len);
      // out = p . v
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(v_cache, v_scales, [&](int64_t t, int64_t head, const auto* v) {
        axpy(scores[head * len + t], v, acc.data() + head * head_dim, head_dim);
      });
      store_row(out + r * num_heads * head_dim, acc.data(), num_heads * head_dim);
    }
  });
}

#if defined(__AVX512BF16__)
// rows are fetched this many tokens ahead of their use, into L2
constexpr int64_t kBf16Ahead = 32;

template <int D, int G>
void decode_attention_bf16(const c10::BFloat16* q, int64_t q_stride, const c10::BFloat16* k_cache,
                           const c10::BFloat16* v_cache,
                           const int32_t* block_table, const int32_t* seq_lens, c10::BFloat16* out,
                           int64_t num_reqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                           int64_t max_blocks, float scale) {
  constexpr int C = D / 32;  // 512-bit registers per bf16 row
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * D;
  std::atomic<int64_t> next_job{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<int64_t> rows;  // element offset of each context token's slot
    std::vector<float> scores, inv_sum(group);  // [group][token], rows padded to a multiple of 32
    std::vector<uint32_t> probs;  // [group][token pair]: two bf16 probabilities per 32 bits
    for (int64_t r = next_job++; r < num_reqs; r = next_job++) {
      const int64_t len = seq_lens[r];
      const int64_t padded = (len + 32) / 32 * 32;
      slot_rows(rows, block_table + r * max_blocks, len, padded + 1 + kBf16Ahead, block_size, slot_stride);
      scores.resize(group * padded);
      probs.resize(group * padded / 2);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const c10::BFloat16* kh = k_cache + h * D;
        const c10::BFloat16* vh = v_cache + h * D;
        // scores = (q . k) * scale for every head of the group, 16 tokens at a time: the
        // chunk's K rows are read from memory once and stay in L1 for the other heads
        for (int64_t t0 = 0; t0 < len; t0 += 16) {
          for (int i = 0; i < 16; ++i) prefetch_l2(kh + rows[t0 + kBf16Ahead + i], D * 2);
          for (int64_t g = 0; g < group; ++g) {
            __m512bh qv[C];
            for (int c = 0; c < C; ++c) qv[c] = load_bh(q + r * q_stride + (h * group + g) * D + 32 * c);
            __m512 dots[16];  // past len: rows repeats the last token, its scores are dropped
            for (int i = 0; i < 16; ++i) {
              const c10::BFloat16* k = kh + rows[t0 + i];
              dots[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], load_bh(k));
              for (int c = 1; c < C; ++c) dots[i] = _mm512_dpbf16_ps(dots[i], qv[c], load_bh(k + 32 * c));
            }
            _mm512_storeu_ps(scores.data() + g * padded + t0, _mm512_mul_ps(hsum16(dots), _mm512_set1_ps(scale)));
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * padded;
          inv_sum[g] = softmax_weighted(s, nullptr, len, padded).inv_sum;  // applied to the output
          // to bf16, two per 32 bits: pair j holds tokens 2j (low half) and 2j + 1
          uint32_t* pg = probs.data() + g * padded / 2;
          for (int64_t t = 0; t < padded; t += 32) {
            const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + t + 16), _mm512_loadu_ps(s + t));
            _mm512_storeu_si512(pg + t / 2, (__m512i)b);
          }
        }
        // out = p . v over pairs of tokens: the two V rows interleaved, so each 32-bit
        // lane of vdpbf16ps is p[t] v[t][d] + p[t+1] v[t+1][d]; G heads at a time share the rows
        for (int64_t head0 = h * group; head0 < (h + 1) * group; head0 += G) {
          const uint32_t* pb = probs.data() + (head0 - h * group) * padded / 2;
          __m512 lo[G][C], hi[G][C];
          for (int g = 0; g < G; ++g)
            for (int c = 0; c < C; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
          for (int64_t t = 0; t < len; t += 2) {
            const c10::BFloat16* v0 = vh + rows[t];
            const c10::BFloat16* v1 = vh + rows[t + 1];
            prefetch_l2(vh + rows[t + kBf16Ahead], D * 2);
            prefetch_l2(vh + rows[t + 1 + kBf16Ahead], D * 2);
            __m512bh p[G];
            for (int g = 0; g < G; ++g)
              p[g] = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[g * padded / 2 + t / 2]));
            for (int c = 0; c < C; ++c) {
              __m512bh xl, xh;
              unpack_pairs(v0 + 32 * c, v1 + 32 * c, xl, xh);
              for (int g = 0; g < G; ++g) {
                lo[g][c] = _mm512_dpbf16_ps(lo[g][c], xl, p[g]);
                hi[g][c] = _mm512_dpbf16_ps(hi[g][c], xh, p[g]);
              }
            }
          }
          for (int g = 0; g < G; ++g) {
            c10::BFloat16* o = out + (r * num_heads + head0 + g) * D;
            const __m512 inv = _mm512_set1_ps(inv_sum[head0 - h * group + g]);
            for (int c = 0; c < C; ++c)
              store_unpacked(o + 32 * c, _mm512_mul_ps(lo[g][c], inv), _mm512_mul_ps(hi[g][c], inv));
          }
        }
      }
    }
  });
}
#endif

}  // namespace

// k_scales / v_scales: [slots, kv_heads] float32, given exactly when the caches are 8-bit
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, int64_t block_size, double scale,
                            c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales) {
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_decode_attention: q must be [reqs, heads, d] "
              "with each request's heads contiguous (rows may be strided)");
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: out and the caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "paged_decode_attention: block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "block_table/seq_lens must be contiguous");
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode_attention: k and v caches differ in dtype");
  if (k_cache.scalar_type() != q.scalar_type()) {
    TORCH_CHECK(is_8bit(k_cache.scalar_type()), "paged_decode_attention: a cache of ", k_cache.scalar_type(),
                " with q of ", q.scalar_type(), " (the cache holds q's dtype, or int8, float8_e4m3fn, float8_e5m2)");
    TORCH_CHECK(k_scales && v_scales, "paged_decode_attention: an 8-bit cache needs k_scales and v_scales");
    for (const auto& s : {*k_scales, *v_scales}) {
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == k_cache.size(0) * num_kv_heads,
                  "paged_decode_attention: scales must be contiguous float32 [slots, kv_heads]");
    }
    const float* ks = k_scales->data_ptr<float>();
    const float* vs = v_scales->data_ptr<float>();
    if (paged_decode_attention_int8(out, q, k_cache, v_cache, ks, vs, block_table, seq_lens, block_size,
                                    static_cast<float>(scale)) ||
        paged_decode_attention_fp8(out, q, k_cache, v_cache, ks, vs, block_table, seq_lens, block_size,
                                   static_cast<float>(scale)) ||
        paged_decode_attention_avx2(out, q, k_cache, v_cache, ks, vs, block_table, seq_lens, block_size,
                                    static_cast<float>(scale))) {
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention_q", [&] {
      using T = scalar_t;
      auto run = [&](auto* kc, auto* vc) {
        decode_attention(q.data_ptr<T>(), q.stride(0), kc, vc, ks, vs, block_table.data_ptr<int32_t>(),
                         seq_lens.data_ptr<int32_t>(), out.data_ptr<T>(), num_reqs, num_heads, num_kv_heads,
                         head_dim, block_size, block_table.size(1), static_cast<float>(scale));
      };
      switch (k_cache.scalar_type()) {
        case at::kChar: run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>()); break;
        case at::kFloat8_e4m3fn:
          run(k_cache.data_ptr<c10::Float8_e4m3fn>(), v_cache.data_ptr<c10::Float8_e4m3fn>());
          break;
        case at::kFloat8_e5m2: run(k_cache.data_ptr<c10::Float8_e5m2>(), v_cache.data_ptr<c10::Float8_e5m2>()); break;
        default: TORCH_CHECK(false, "paged_decode_attention: a cache of ", k_cache.scalar_type(), " with q of ",
                             q.scalar_type(), " (8-bit caches: int8, float8_e4m3fn, float8_e5m2)");
      }
    });
    return;
  }
#if defined(__AVX512BF16__)
  if (q.scalar_type() == at::kBFloat16 && (head_dim == 32 || head_dim == 64 || head_dim == 128)) {
    const int64_t group = num_heads / num_kv_heads;
    // G query heads of a group share each V row: as many as fit in registers (8 accumulators per head at d 128)
    auto run = head_dim == 32   ? (group % 4 == 0   ? decode_attention_bf16<32, 4>
                                   : group % 2 == 0 ? decode_attention_bf16<32, 2>
                                                    : decode_attention_bf16<32, 1>)
               : head_dim == 64 ? (group % 4 == 0   ? decode_attention_bf16<64, 4>
                                   : group % 2 == 0 ? decode_attention_bf16<64, 2>
                                                    : decode_attention_bf16<64, 1>)
                                : (group % 2 == 0 ? decode_attention_bf16<128, 2> : decode_attention_bf16<128, 1>);
    run(q.data_ptr<c10::BFloat16>(), q.stride(0), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
        block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), out.data_ptr<c10::BFloat16>(), num_reqs,
        num_heads, num_kv_heads, block_size, block_table.size(1), static_cast<float>(scale));
    return;
  }
#endif
  if (paged_decode_attention_avx2(out, q, k_cache, v_cache, nullptr, nullptr, block_table, seq_lens, block_size,
                                  static_cast<float>(scale))) {
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), k_cache.data_ptr<scalar_t>(),
                               v_cache.data_ptr<scalar_t>(), nullptr, nullptr,
                               block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                               out.data_ptr<scalar_t>(), num_reqs, num_heads, num_kv_heads, head_dim, block_size,
                               block_table.size(1), static_cast<float>(scale));
  });
}


namespace {
// Each token's row of each kv head: its scale (max |x| / qmax, 1 for a row of zeros) and
// the row divided by it, as 8-bit elements
template <typename T, typename C>
void write_quantized(const T* src, int64_t src_stride, C* cache, float* scales, const int64_t* slots,
                     int64_t tokens, int64_t kv_heads, int64_t head_dim, float qmax) {
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* row = src + t * src_stride + h * head_dim;
        float amax = 0.f;
        for (int64_t e = 0; e < head_dim; ++e) amax = std::max(amax, std::abs(load(row, e)));
        // at least the smallest normal float: a subnormal scale could flush to 0 (-ffast-math)
        const float s = amax > 0.f ? std::max(amax / qmax, std::numeric_limits<float>::min()) : 1.f;
        const int64_t slot_head = slots[t] * kv_heads + h;
        C* dst = cache + slot_head * head_dim;
        // x / s in double: -ffast-math turns a float division by the loop's s into a product with
        // its reciprocal, one ulp off at times, which moved an exact tie between two 8-bit codes
        // (common in bf16 rows) to the other code than torch's division (kv_cache.quantize_rows);
        // the double quotient rounds to the exact float one whenever that is a tie
        const double inv = 1.0 / static_cast<double>(s);
        for (int64_t e = 0; e < head_dim; ++e) {
          dst[e] = quantize_element<C>(static_cast<float>(static_cast<double>(load(row, e)) * inv), qmax);
        }
        scales[slot_head] = s;
      }
    }
  });
}
}  // namespace

// k_scales / v_scales ([slots, kv_heads] float32): given exactly when the caches are 8-bit
// (int8, float8_e4m3fn, float8_e5m2); each written row's scale is set there
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping, c10::optional<torch::Tensor> k_scales,
              c10::optional<torch::Tensor> v_scales) {
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && k.stride(1) == k.size(2) && v.sizes() == k.sizes() &&
                  v.stride(2) == 1 && v.stride(1) == v.size(2) && v.scalar_type() == k.scalar_type(),
              "write_kv: k and v must be [tokens, kv_heads, d] with each token's heads contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == k.size(0), "write_kv: slot_mapping must be int64 [tokens]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) * k_cache.size(2) ==
                  k.size(1) * k.size(2) && v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: caches must be contiguous [slots, kv_heads, d] of one dtype");
  if (k_cache.scalar_type() != k.scalar_type()) {
    TORCH_CHECK(is_8bit(k_cache.scalar_type()), "write_kv: a cache of ", k_cache.scalar_type(), " for k of ",
                k.scalar_type(), " (the cache holds k's dtype, or int8, float8_e4m3fn, float8_e5m2)");
    TORCH_CHECK(k_scales && v_scales, "write_kv: an 8-bit cache needs k_scales and v_scales");
    const int64_t kv_heads = k.size(1), head_dim = k.size(2);
    for (const auto& s : {*k_scales, *v_scales}) {
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.numel() == k_cache.size(0) * kv_heads,
                  "write_kv: scales must be contiguous float32 [slots, kv_heads]");
    }
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv_quantized", [&] {
      auto run = [&](auto* kc, auto* vc, float qmax) {
        write_quantized(k.data_ptr<scalar_t>(), k.stride(0), kc, k_scales->data_ptr<float>(), slots, k.size(0),
                        kv_heads, head_dim, qmax);
        write_quantized(v.data_ptr<scalar_t>(), v.stride(0), vc, v_scales->data_ptr<float>(), slots, k.size(0),
                        kv_heads, head_dim, qmax);
      };
      switch (k_cache.scalar_type()) {
        case at::kChar: run(k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), 127.f); break;
        case at::kFloat8_e4m3fn:
          run(k_cache.data_ptr<c10::Float8_e4m3fn>(), v_cache.data_ptr<c10::Float8_e4m3fn>(), 448.f);
          break;
        case at::kFloat8_e5m2:
          run(k_cache.data_ptr<c10::Float8_e5m2>(), v_cache.data_ptr<c10::Float8_e5m2>(), 57344.f);
          break;
        default: TORCH_CHECK(false, "write_kv: a cache of ", k_cache.scalar_type(), " for k of ", k.scalar_type(),
                             " (8-bit caches: int8, float8_e4m3fn, float8_e5m2)");
      }
    });
    return;
  }
  const int64_t tokens = k.size(0), row = k.size(1) * k.size(2);
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  const int64_t bytes = row * k.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slots[t] * bytes, ks + t * k_stride, bytes);
      std::memcpy(vc + slots[t] * bytes, vs + t * v_stride, bytes);
    }
  });
}
