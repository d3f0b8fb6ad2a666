// y = x W^T (+ b) for bfloat16 steps of at most 16 rows (decodes of a small batch, speculative
// verification), through AVX512-BF16's dot products. oneDNN's packed call carries about 20-30 us
// of overhead a layer at these sizes, more than the whole product at the built-in model's shapes
// (benchmarks/linear_layout.py).
//
// The weight is laid out once (pack_bf16_pairs in layers/linear.py) as [out / 16, in / 2, 16, 2]:
// for each block of 16 outputs, each pair of inputs holds the 16 outputs' two weights, which is
// what one dot product instruction takes against a pair of x broadcast to every lane. Each
// output then stays in one lane of one register over the whole input: no sums across lanes, and
// every output element is summed in the same order (pair by pair, in float32) whatever the
// number of rows, so a row's output does not depend on the rows computed with it (a verified
// draft's row equals the decode that would have made it). The sum, plus the bias, is rounded to
// bfloat16 once.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

#include "bf16_out.h"

namespace {
using namespace tokenmill;

constexpr int64_t MAX_ROWS = 16;

// the rows of x against NB blocks of 16 outputs, from block `b0` on
template <int M, int NB>
void blocks(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t pairs, const at::BFloat16* bias,
            at::BFloat16* y, int64_t out, int64_t b0) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; m++)
    for (int n = 0; n < NB; n++) acc[m][n] = _mm512_setzero_ps();
  const at::BFloat16* wb = w + b0 * pairs * 32;
  for (int64_t p = 0; p < pairs; p++) {
    __m512bh wv[NB];
    for (int n = 0; n < NB; n++) wv[n] = (__m512bh)_mm512_loadu_si512(wb + (n * pairs + p) * 32);
    for (int m = 0; m < M; m++) {
      int32_t pair;
      std::memcpy(&pair, x + m * x_stride + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int n = 0; n < NB; n++) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], wv[n], xv);
    }
  }
  for (int n = 0; n < NB; n++) {
    const int64_t o = (b0 + n) * 16;
    if (o >= out) break;
    const __mmask16 mask = block_mask(out, o);
    const __m512 b = bias16(bias, o, mask);
    for (int m = 0; m < M; m++) store_sum16(y + m * out, o, mask, acc[m][n], b);
  }
}

template <int M>
void run(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* w, int64_t pairs, const at::BFloat16* bias,
         at::BFloat16* y, int64_t out, int64_t num_blocks) {
  constexpr int NB = std::max(1, std::min(8, 31 / (M + 1)));  // accumulators, weights and x within 32 registers
  const int64_t groups = num_blocks / NB, rest = num_blocks % NB;
#pragma omp parallel for schedule(static) if (out * pairs >= 16384)
  for (int64_t g = 0; g <= groups; g++) {
    if (g < groups) {
      blocks<M, NB>(x, x_stride, w, pairs, bias, y, out, g * NB);
    } else {
      for (int64_t b = groups * NB; b < groups * NB + rest; b++) blocks<M, 1>(x, x_stride, w, pairs, bias, y, out, b);
    }
  }
}

template <int... Ms>
void dispatch(std::integer_sequence<int, Ms...>, int64_t rows, const at::BFloat16* x, int64_t x_stride,
              const at::BFloat16* w, int64_t pairs, const at::BFloat16* bias, at::BFloat16* y, int64_t out,
              int64_t num_blocks) {
  ((rows == Ms + 1 ? run<Ms + 1>(x, x_stride, w, pairs, bias, y, out, num_blocks) : void()), ...);
}

}  // namespace

bool has_small_linear_bf16() { return true; }

torch::Tensor small_linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                int64_t out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "small_linear_bf16: x [rows, in], bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == torch::kBFloat16,
              "small_linear_bf16: a weight laid out by pack_bf16_pairs, [out / 16, in / 2, 16, 2]");
  const int64_t rows = x.size(0), in = x.size(1), pairs = packed.size(1), num_blocks = packed.size(0);
  TORCH_CHECK(pairs == (in + 1) / 2 && num_blocks == (out + 15) / 16, "small_linear_bf16: x has ", in,
              " columns and the weight ", out, " x ", 2 * pairs, " in blocks of 16 x 2");
  TORCH_CHECK(rows >= 1 && rows <= MAX_ROWS, "small_linear_bf16: 1 to ", MAX_ROWS, " rows, got ", rows);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == out,
                "small_linear_bf16: a contiguous bfloat16 bias of ", out, " elements");
  if (in % 2)  // an odd input: a zero after it completes the last pair (the weight's is zero too)
    x = torch::constant_pad_nd(x, {0, 1});
  else if (x.stride(1) != 1)
    x = x.contiguous();
  auto y = torch::empty({rows, out}, x.options());
  dispatch(std::make_integer_sequence<int, MAX_ROWS>{}, rows, x.data_ptr<at::BFloat16>(), x.stride(0),
           packed.data_ptr<at::BFloat16>(), pairs, bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr,
           y.data_ptr<at::BFloat16>(), out, num_blocks);
  return y;
}

#else

bool has_small_linear_bf16() { return false; }

torch::Tensor small_linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                int64_t out) {
  TORCH_CHECK(false, "small_linear_bf16: built without AVX512-BF16");
}

#endif
