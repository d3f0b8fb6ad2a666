// Paged decode attention on the CPU: one query token per request, K/V read in place
// through the block table (no gather copy, no padding to the longest context).
//
//   q          [num_reqs, num_heads, head_dim]
//   k/v cache  [num_slots, num_kv_heads, head_dim], slot = block_id * block_size + offset
//   block_table[num_reqs, max_blocks] int32, seq_lens [num_reqs] int32
//   out        [num_reqs, num_heads, head_dim]
//
// Work is split over (request, kv head) pairs; each pair handles its whole query
// group (GQA), so every K/V row is read once per step. Math is float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_table,
                      const int32_t* seq_lens, T* out, int64_t num_reqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                      float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), row(head_dim), acc(group * head_dim), scores;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t r = job / num_kv_heads, h = job % num_kv_heads;
      const int64_t len = seq_lens[r];
      const int32_t* blocks = block_table + r * max_blocks;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        load_row(q + (r * num_heads + h * group + g) * head_dim, qf.data() + g * head_dim, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] *= scale;
      }
      // scores = q . k for every context token
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
        load_row(k_cache + slot * slot_stride + h * head_dim, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * row[d];
          scores[g * len + t] = s;
        }
      }
      // softmax per query head
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float mx = -INFINITY;
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - mx);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      // out = p . v
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = static_cast<int64_t>(blocks[t / block_size]) * block_size + t % block_size;
        load_row(v_cache + slot * slot_stride + h * head_dim, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out + (r * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
      }
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
