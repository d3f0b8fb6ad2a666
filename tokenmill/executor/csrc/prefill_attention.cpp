// Paged attention for query chunks of several tokens (prompts, their later chunks, the
// rest of a prompt after a prefix-cache hit) on the CPU, bfloat16, head_dim 32, 64 or 128,
// AVX512-BF16. Each new token attends causally over its request's whole context, read in
// place through the block table: no gather copy, no mask tensor, one call per layer for
// every chunk of the step.
//
//   q            [tokens, num_heads, head_dim] (rows may be strided)
//   out          [tokens, num_heads, head_dim]; only the rows of these requests are written
//   k/v cache    [num_slots, num_kv_heads, head_dim], slot = block_id * block_size + offset
//   block_table  [num_reqs, max_blocks] int32, seq_lens [num_reqs] int32 (context after this step)
//   query_starts [num_reqs] int32 (first row in q and out), query_lens [num_reqs] int32
//
// A job is 16 rows of one kv head, a row being a (query token, query head of the group)
// pair. q.k multiplies a broadcast pair of k values with the 16 rows' q packed as pairs, so
// one register holds one context token's scores for all 16 rows: the mask and the softmax
// run across lanes, no horizontal sums. p.v runs 4 rows at a time over interleaved pairs of
// V rows, as in the decode kernel. As there (and in PyTorch's CPU flash attention), the
// probabilities are rounded to bfloat16 before p.v.
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {
using namespace tokenmill;
using bf16 = c10::BFloat16;

#if defined(__AVX512BF16__)
constexpr int kRows = 16;   // rows per job: one 16-lane register of scores per context token
constexpr int kPvRows = 4;  // rows per p.v pass over 64 values: 16 accumulators
constexpr float kHidden = -1e30f;  // score of a causally hidden token (finite: the build uses -ffast-math)

struct Job {
  int64_t req, kv_head, first_row, context;  // context: tokens the job's last row attends to
};

template <int D>
void prefill_attention_bf16(const bf16* q, int64_t q_stride, const bf16* k_cache, const bf16* v_cache,
                            const int32_t* block_table, const int32_t* seq_lens, const int32_t* query_starts,
                            const int32_t* query_lens, bf16* out, int64_t num_reqs, int64_t num_heads,
                            int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t slot_stride = num_kv_heads * D;
  std::vector<Job> jobs;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t rows = static_cast<int64_t>(query_lens[r]) * group, first_pos = seq_lens[r] - query_lens[r];
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t f = 0; f < rows; f += kRows) {
        jobs.push_back({r, h, f, first_pos + (std::min(f + kRows, rows) - 1) / group + 1});
      }
    }
  }
  // the longest contexts first, the short jobs fill in at the end: the threads finish together
  std::sort(jobs.begin(), jobs.end(), [](const Job& a, const Job& b) { return a.context > b.context; });
  std::atomic<int64_t> next_job{0};
  const int64_t num_jobs = static_cast<int64_t>(jobs.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<int64_t> rows;     // element offset of each context token's slot
    std::vector<float> scores;     // [token][16 rows]
    std::vector<uint32_t> probs;   // [token pair][16 rows]: bf16 of tokens 2j (low half) and 2j + 1
    alignas(64) uint32_t qp[D / 2][kRows];  // the rows' q, [pair of values][row]
    alignas(64) int32_t pos[kRows];
    alignas(64) float mx[kRows], sum[kRows];
    int64_t tok[kRows], head[kRows];
    for (int64_t i = next_job++; i < num_jobs; i = next_job++) {
      const Job& job = jobs[i];
      const int64_t r = job.req, h = job.kv_head, n = query_lens[r];
      const int64_t num_rows = std::min<int64_t>(kRows, n * group - job.first_row);
      const int64_t context = job.context, padded = (context + 15) / 16 * 16;
      // row m: token tok[m] of the chunk, at position pos[m], query head head[m]; rows past
      // num_rows repeat the last one (computed, never stored)
      for (int m = 0; m < kRows; ++m) {
        const int64_t f = job.first_row + std::min<int64_t>(m, num_rows - 1);
        tok[m] = f / group;
        head[m] = h * group + f % group;
        pos[m] = static_cast<int32_t>(seq_lens[r] - n + tok[m]);
        const auto* qr = reinterpret_cast<const uint32_t*>(q + (query_starts[r] + tok[m]) * q_stride + head[m] * D);
        for (int p = 0; p < D / 2; ++p) qp[p][m] = qr[p];
      }
      slot_rows(rows, block_table + r * max_blocks, context, padded, block_size, slot_stride);

      // scores = (k . q) * scale, 16 tokens x 16 rows at a time; hidden tokens get kHidden
      scores.resize(padded * kRows);
      const bf16* kh = k_cache + h * D;
      const __m512i posv = _mm512_load_si512(pos);
      __m512 vmax = _mm512_set1_ps(kHidden);
      for (int64_t t0 = 0; t0 < padded; t0 += 16) {
        const int32_t* k[16];
        for (int i = 0; i < 16; ++i) k[i] = reinterpret_cast<const int32_t*>(kh + rows[t0 + i]);
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int p = 0; p < D / 2; ++p) {
          const __m512bh qv = (__m512bh)_mm512_load_si512(qp[p]);
          for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_set1_epi32(k[i][p]));
        }
        for (int i = 0; i < 16; ++i) {
          const __mmask16 seen = _mm512_cmpge_epi32_mask(posv, _mm512_set1_epi32(static_cast<int32_t>(t0 + i)));
          const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(kHidden), seen, acc[i], _mm512_set1_ps(scale));
          vmax = _mm512_max_ps(vmax, s);
          _mm512_storeu_ps(scores.data() + (t0 + i) * kRows, s);
        }
      }
      // softmax per row (per lane); every row sees token 0, so its max is a real score
      _mm512_store_ps(mx, vmax);
      std::fill(sum, sum + kRows, 0.f);
      for (int64_t t = 0; t < padded; ++t) {
        float* s = scores.data() + t * kRows;
#pragma omp simd
        for (int m = 0; m < kRows; ++m) {
          s[m] = std::exp(s[m] - mx[m]);
          sum[m] += s[m];
        }
      }
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_load_ps(sum));
      // to bf16 pairs: lane m of pair j holds row m's probabilities of tokens 2j and 2j + 1
      const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                  23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      probs.resize(padded / 2 * kRows);
      for (int64_t t = 0; t < padded; t += 2) {
        const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(scores.data() + t * kRows), inv);
        const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(scores.data() + (t + 1) * kRows), inv);
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a in the low 16 halves, b in the high
        _mm512_storeu_si512(probs.data() + t / 2 * kRows, _mm512_permutexvar_epi16(interleave, both));
      }

      // out = p . v, kPvRows rows and 64 values at a time (32 at d 32), over the pairs their last row sees
      constexpr int W = D < 64 ? 1 : 2;  // 32 values a register
      const bf16* vh = v_cache + h * D;
      for (int m0 = 0; m0 < num_rows; m0 += kPvRows) {
        const int64_t pairs = (pos[std::min<int64_t>(m0 + kPvRows, num_rows) - 1] + 2) / 2;
        for (int d0 = 0; d0 < D; d0 += 32 * W) {
          __m512 lo[kPvRows][W], hi[kPvRows][W];
          for (int m = 0; m < kPvRows; ++m)
            for (int c = 0; c < W; ++c) lo[m][c] = hi[m][c] = _mm512_setzero_ps();
          for (int64_t j = 0; j < pairs; ++j) {
            __m512bh xl[W], xh[W];
            const bf16* v0 = vh + rows[2 * j] + d0;
            const bf16* v1 = vh + rows[2 * j + 1] + d0;
            for (int c = 0; c < W; ++c) unpack_pairs(v0 + 32 * c, v1 + 32 * c, xl[c], xh[c]);
            const uint32_t* pj = probs.data() + j * kRows + m0;
            for (int m = 0; m < kPvRows; ++m) {
              const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pj[m]));
              for (int c = 0; c < W; ++c) {
                lo[m][c] = _mm512_dpbf16_ps(lo[m][c], xl[c], p);
                hi[m][c] = _mm512_dpbf16_ps(hi[m][c], xh[c], p);
              }
            }
          }
          for (int m = 0; m < kPvRows && m0 + m < num_rows; ++m) {
            bf16* o = out + (query_starts[r] + tok[m0 + m]) * num_heads * D + head[m0 + m] * D + d0;
            for (int c = 0; c < W; ++c) store_unpacked(o + 32 * c, lo[m][c], hi[m][c]);
          }
        }
      }
    }
  });
}
#endif

}  // namespace

bool has_bf16_prefill_attention() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor query_starts,
                             torch::Tensor query_lens, int64_t block_size, double scale) {
  TORCH_CHECK(has_bf16_prefill_attention(), "paged_prefill_attention needs a CPU with AVX512-BF16");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: q, out and the caches must be bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_prefill_attention: q must be "
              "[tokens, heads, d] with each token's heads contiguous (rows may be strided)");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_prefill_attention: out (q's shape) and the caches must be contiguous");
  for (const auto& t : {block_table, seq_lens, query_starts, query_lens}) {
    TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.is_contiguous(),
                "paged_prefill_attention: block_table, seq_lens, query_starts and query_lens must be contiguous int32");
  }
  const int64_t num_heads = q.size(1), head_dim = q.size(2), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128,
              "paged_prefill_attention: head_dim must be 32, 64 or 128, got ", head_dim);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(2) == head_dim && v_cache.sizes() == k_cache.sizes(),
              "paged_prefill_attention: caches must be [slots, kv_heads, head_dim], the same shape");
  const int64_t num_reqs = seq_lens.size(0), max_blocks = block_table.size(1);
  TORCH_CHECK(block_table.size(0) == num_reqs && query_starts.size(0) == num_reqs && query_lens.size(0) == num_reqs,
              "paged_prefill_attention: block_table, query_starts and query_lens need a row per request");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_starts.data_ptr<int32_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  for (int64_t r = 0; r < num_reqs; ++r) {  // what the kernel indexes by, checked once
    TORCH_CHECK(qlens[r] >= 1 && lens[r] >= qlens[r] && (lens[r] + block_size - 1) / block_size <= max_blocks &&
                    starts[r] >= 0 && starts[r] + qlens[r] <= q.size(0),
                "paged_prefill_attention: request ", r, " has query_len ", qlens[r], " at row ", starts[r],
                " with seq_len ", lens[r], " (", q.size(0), " rows, ", max_blocks, " blocks of ", block_size, ")");
  }
#if defined(__AVX512BF16__)
  auto run = head_dim == 32   ? prefill_attention_bf16<32>
             : head_dim == 64 ? prefill_attention_bf16<64>
                              : prefill_attention_bf16<128>;
  run(q.data_ptr<c10::BFloat16>(), q.stride(0), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
      block_table.data_ptr<int32_t>(), lens, starts, qlens, out.data_ptr<c10::BFloat16>(), num_reqs, num_heads,
      num_kv_heads, block_size, max_blocks, static_cast<float>(scale));
#endif
}
