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

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// element loads as float; written so that the loops below vectorize
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const double* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }

#if defined(__AVX512F__)
// 16 lanes at a time; bf16 widens by a shift, fp16 by the F16C conversion
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename T>
constexpr bool kVectorized = !std::is_same_v<T, double>;
#else
template <typename T>
constexpr bool kVectorized = false;
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (kVectorized<T>) {
    if (n % 16 == 0) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
      return _mm512_reduce_add_ps(acc);
    }
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += q[i] * load(k, i);
  return s;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (kVectorized<T>) {
    if (n % 16 == 0) {
      const __m512 va = _mm512_set1_ps(a);
      for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, load16(x + i), _mm512_loadu_ps(y + i)));
      return;
    }
  }
#endif
  for (int64_t i = 0; i < n; ++i) y[i] += a * load(x, i);
}

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_table,
                      const int32_t* seq_lens, T* out, int64_t num_reqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                      float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * head_dim;
  // Contexts differ in length, so a static split of the jobs leaves threads idle:
  // each thread takes the next job from a shared counter instead.
  const int64_t num_jobs = num_reqs * num_kv_heads;
  std::atomic<int64_t> next_job{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t job = next_job++; job < num_jobs; job = next_job++) {
      const int64_t r = job / num_kv_heads, h = job % num_kv_heads;
      const int64_t len = seq_lens[r];
      const int32_t* blocks = block_table + r * max_blocks;
      const int64_t num_blocks = (len + block_size - 1) / block_size;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const T* qg = q + (r * num_heads + h * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = load(qg, d) * scale;
      }
      // scores = q . k over the context, block by block
      for (int64_t j = 0; j < num_blocks; ++j) {
        const T* kb = k_cache + static_cast<int64_t>(blocks[j]) * block_size * slot_stride + h * head_dim;
        const int64_t n = std::min(block_size, len - j * block_size);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t g = 0; g < group; ++g) {
            scores[g * len + j * block_size + i] = dot(qf.data() + g * head_dim, kb + i * slot_stride, head_dim);
          }
        }
      }
      // softmax per query head (exp vectorizes: the build uses -ffast-math, so nothing here may be inf)
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
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
      for (int64_t j = 0; j < num_blocks; ++j) {
        const T* vb = v_cache + static_cast<int64_t>(blocks[j]) * block_size * slot_stride + h * head_dim;
        const int64_t n = std::min(block_size, len - j * block_size);
        for (int64_t i = 0; i < n; ++i) {
          for (int64_t g = 0; g < group; ++g) {
            axpy(scores[g * len + j * block_size + i], vb + i * slot_stride, acc.data() + g * head_dim, head_dim);
          }
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
