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
#include "vec.h"

#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

namespace {
using namespace tokenmill;

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_table,
                      const int32_t* seq_lens, T* out, int64_t num_reqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                      float scale) {
  // One job = one request, all heads: a block's K (or V) rows for every kv head are one
  // contiguous run of memory, read front to back once.
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  // Contexts differ in length, so a static split of the jobs leaves threads idle:
  // each thread takes the next request from a shared counter instead.
  std::atomic<int64_t> next_job{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(num_heads * head_dim), acc(num_heads * head_dim), scores;
    for (int64_t r = next_job++; r < num_reqs; r = next_job++) {
      const int64_t len = seq_lens[r];
      const int32_t* blocks = block_table + r * max_blocks;
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      scores.resize(num_heads * len);  // [head][token]
      const T* qr = q + r * num_heads * head_dim;
      load_row(qr, qf.data(), num_heads * head_dim);
      for (float& x : qf) x *= scale;
      // Calls f(t, head, row) for every context token t and query head, row being the
      // head's K (or V) row in `cache`: blocks in table order, rows in slot order.
      auto for_each_row = [&](const T* cache, auto&& f) {
        for (int64_t j = 0; j < num_blocks; ++j) {
          const T* block = cache + static_cast<int64_t>(blocks[j]) * block_size * slot_stride;
          const int64_t n = std::min(block_size, len - j * block_size);
          if (j + 1 < num_blocks) {
            // blocks sit at random places: fetch the next one while this one is computed
            prefetch_bytes(cache + static_cast<int64_t>(blocks[j + 1]) * block_size * slot_stride,
                           block_size * slot_stride * sizeof(T));
          }
          for (int64_t i = 0; i < n; ++i) {
            for (int64_t h = 0; h < num_kv_heads; ++h) {
              const T* row = block + i * slot_stride + h * head_dim;
              for (int64_t g = 0; g < group; ++g) f(j * block_size + i, h * group + g, row);
            }
          }
        }
      };
      // scores = q . k
      for_each_row(k_cache, [&](int64_t t, int64_t head, const T* k) {
        scores[head * len + t] = dot(qf.data() + head * head_dim, k, head_dim);
      });
      // softmax per query head (exp vectorizes: the build uses -ffast-math, so nothing here may be inf)
      for (int64_t head = 0; head < num_heads; ++head) {
        float* s = scores.data() + head * len;
        float mx = -std::numeric_limits<float>::max();
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - mx);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // out = p . v
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(v_cache, [&](int64_t t, int64_t head, const T* v) {
        axpy(scores[head * len + t], v, acc.data() + head * head_dim, head_dim);
      });
      store_row(out + r * num_heads * head_dim, acc.data(), num_heads * head_dim);
    }
  });
}

}  // namespace

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: tensors must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "paged_decode_attention: block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "block_table/seq_lens must be contiguous");
  const int64_t num_reqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                               block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                               out.data_ptr<scalar_t>(), num_reqs, num_heads, num_kv_heads, head_dim, block_size,
                               block_table.size(1), static_cast<float>(scale));
  });
}

