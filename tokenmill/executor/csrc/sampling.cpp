// Greedy sampling on the CPU: the index of the largest logit of each row, rows split
// across threads. torch.argmax runs a [64, 32000] float32 batch on one thread in about
// a millisecond, and a bfloat16 one three times slower; this reads each row twice
// (max, then the first index that equals it) at memory speed, in either dtype.
#include "vec.h"

#include <limits>

namespace {
using namespace tokenmill;

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  float best = std::numeric_limits<float>::lowest();  // no infinities in code built with -ffast-math
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVectorized<T>) {
    __m512 m = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, load16(row + i));
    best = _mm512_reduce_max_ps(m);
  }
#endif
  for (; i < n; ++i) best = std::max(best, load(row, i));
  // ties go to the first index, as torch.argmax does
  i = 0;
#if defined(__AVX512F__)
  if constexpr (kVectorized<T>) {
    const __m512 b = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
      const __mmask16 hit = _mm512_cmp_ps_mask(load16(row + i), b, _CMP_EQ_OQ);
      if (hit) return i + __builtin_ctz(hit);
    }
  }
#endif
  for (; i < n; ++i) {
    if (load(row, i) == best) return i;
  }
  return 0;  // only when nothing compares equal (NaN logits)
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "argmax_rows: logits must be [rows, vocab], rows contiguous");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  int64_t* ids = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    const int64_t stride = logits.stride(0);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) ids[r] = argmax_row(x + r * stride, n);
    });
  });
  return out;
}
