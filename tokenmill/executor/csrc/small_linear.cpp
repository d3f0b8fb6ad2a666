// y = x W^T (+ b) for float32 steps, AVX2 + FMA: decodes, speculative verification, and on a CPU
// without AVX-512 prompt chunks too (layers/linear.py's SMALL_ONLY). MKL's GEMM costs about twice
// its one-row GEMV from two rows on, and oneDNN's packed call carries about 30 us of overhead, at
// the built-in model's shapes (benchmarks/linear_layout.py).
//
// The weight is laid out once (pack_small in layers/linear.py) as [out / 16, in, 16]: for each
// block of 16 outputs, each input holds the 16 outputs' weights. One x value, broadcast to every
// lane, multiplies 16 outputs' weights at once, and each output stays in one lane of one register
// over the whole input: no sums across lanes at the end (against an [out, in] weight, each output
// ended in a sum of 8 lanes, which at an input of 256 cost as much as the products at one row and
// half as much at five). Each output element is summed in the same order (input by input, one FMA
// each) whatever the number of rows, so a row's output does not depend on the rows computed with
// it: a verified draft's row equals the decode that would have made it. Up to 6 rows of x go
// against the weights a pass (4 blocks of 16 outputs against one row, 2 against two, 1 against
// 3-6: the accumulators within the 16 registers); more rows go by in passes over each thread's
// chunk of weights, which stays in L1/L2 between them. Threads take chunks of outputs, and where
// there are fewer than two a thread, groups of rows too.
//
// The weight may be bfloat16 (x and y stay float32): a float32 weight whose every value is a
// bfloat16 one (a bfloat16 checkpoint served in float32, as on a CPU without AVX512-BF16) is kept
// so (layers/linear.py), and each value is widened exactly as it is loaded (its bits in the top
// half of a float32 lane: one in-lane unpack for 8 values, which is why a bfloat16 block keeps its
// 16 outputs in the order that unpack wants), so the output is the float32 weight's bit for bit,
// from half the bytes: a decode step of a small model reads each weight once, from memory where
// the weights outgrow the cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t MAX_ROWS = 6;  // rows of x a pass
constexpr int64_t CHUNK = 4;  // blocks of 16 outputs a thread takes at a time
// a job's rows where the chunks alone leave threads idle (a narrow layer's prompt chunk): at least
// this many passes, so that each job reads its chunk of weights for many rows
constexpr int64_t GROUP_PASSES = 8;

// a block's 16 weights at one input as two vectors of 8 float32: outputs 0-7 and 8-15. Bfloat16
// ones are laid out [0-3, 8-11, 4-7, 12-15] (pack_small), so that interleaving each 128-bit lane's
// halves with zeros widens them in place
inline void load16(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}
inline void load16(const at::BFloat16* w, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

inline void store8(__m256 v, const float* bias, float* y, int64_t o, int64_t out) {
  if (o + 8 <= out) {
    if (bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + o));
    _mm256_storeu_ps(y + o, v);
    return;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int64_t j = 0; o + j < out; j++) y[o + j] = bias != nullptr ? lanes[j] + bias[o + j] : lanes[j];
}

// M rows of x against the B blocks of 16 outputs from block b0
template <int M, int B, typename W>
void tile(const float* x, int64_t x_stride, const W* w, int64_t in, const float* bias, float* y, int64_t out,
          int64_t b0) {
  __m256 acc[2 * B][M];
#pragma GCC unroll 16
  for (int j = 0; j < 2 * B; j++)
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) acc[j][m] = _mm256_setzero_ps();
  const W* wb = w + b0 * in * 16;
  for (int64_t i = 0; i < in; i++) {
#pragma GCC unroll 16
    for (int b = 0; b < B; b++) {
      __m256 lo, hi;
      load16(wb + (b * in + i) * 16, lo, hi);
#pragma GCC unroll 16
      for (int m = 0; m < M; m++) {
        const __m256 xv = _mm256_broadcast_ss(x + m * x_stride + i);
        acc[2 * b][m] = _mm256_fmadd_ps(lo, xv, acc[2 * b][m]);
        acc[2 * b + 1][m] = _mm256_fmadd_ps(hi, xv, acc[2 * b + 1][m]);
      }
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < 2 * B; j++)
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) store8(acc[j][m], bias, y + m * out, b0 * 16 + j * 8, out);
}

// M rows of x against blocks [b0, b1), B at a time
template <int M, int B, typename W>
void blocks(const float* x, int64_t x_stride, const W* w, int64_t in, const float* bias, float* y, int64_t out,
            int64_t b0, int64_t b1) {
  int64_t b = b0;
  for (; b + B <= b1; b += B) tile<M, B, W>(x, x_stride, w, in, bias, y, out, b);
  for (; b < b1; b++) tile<M, 1, W>(x, x_stride, w, in, bias, y, out, b);
}

// the rows of x against blocks [b0, b1), up to MAX_ROWS rows a pass
template <typename W>
void rows_against(const float* x, int64_t x_stride, int64_t rows, const W* w, int64_t in, const float* bias,
                  float* y, int64_t out, int64_t b0, int64_t b1) {
  for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
    const float* xr = x + r0 * x_stride;
    float* yr = y + r0 * out;
    // accumulators (2B x M), a block's two weight vectors, an x one and a zero within the 16
    // registers; past 12 accumulators the compiler spilled some in the loop
    switch (std::min(MAX_ROWS, rows - r0)) {
      case 1: blocks<1, 4, W>(xr, x_stride, w, in, bias, yr, out, b0, b1); break;
      case 2: blocks<2, 2, W>(xr, x_stride, w, in, bias, yr, out, b0, b1); break;
      case 3: blocks<3, 1, W>(xr, x_stride, w, in, bias, yr, out, b0, b1); break;
      case 4: blocks<4, 1, W>(xr, x_stride, w, in, bias, yr, out, b0, b1); break;
      case 5: blocks<5, 1, W>(xr, x_stride, w, in, bias, yr, out, b0, b1); break;
      default: blocks<6, 1, W>(xr, x_stride, w, in, bias, yr, out, b0, b1); break;
    }
  }
}

}  // namespace

bool has_small_linear() { return true; }

torch::Tensor small_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == 16 && x.size(1) == packed.size(1),
              "small_linear: x [rows, in] and a weight laid out by pack_small [out / 16, in, 16]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat &&
                  (packed.scalar_type() == torch::kFloat || packed.scalar_type() == torch::kBFloat16),
              "small_linear: float32 x, and a float32 or bfloat16 weight");
  TORCH_CHECK(x.size(0) >= 1, "small_linear: at least one row of x");
  TORCH_CHECK(packed.is_contiguous(), "small_linear: a contiguous weight");
  const int64_t num_blocks = packed.size(0);
  TORCH_CHECK(out >= 1 && (out + 15) / 16 == num_blocks,
              "small_linear: out (", out, ") within the weight's ", num_blocks, " blocks of 16 outputs");
  if (x.stride(1) != 1) x = x.contiguous();
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == out,
                "small_linear: a contiguous float32 bias of out elements");
    b = bias->data_ptr<float>();
  }
  const int64_t rows = x.size(0), in = x.size(1);
  auto y = torch::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t s = x.stride(0);
  const int64_t chunks = (num_blocks + CHUNK - 1) / CHUNK;
  // jobs: a chunk of blocks against a group of rows; the rows are split only where there are
  // fewer than two chunks a thread, in whole passes (a row's output is the same in any group)
  const int64_t threads = at::get_num_threads(), most_groups = (rows + GROUP_PASSES * MAX_ROWS - 1) /
                                                               (GROUP_PASSES * MAX_ROWS);
  const int64_t want = chunks < 2 * threads ? std::min(most_groups, (2 * threads + chunks - 1) / chunks) : 1;
  const int64_t per = ((rows + want - 1) / want + MAX_ROWS - 1) / MAX_ROWS * MAX_ROWS;
  const int64_t groups = (rows + per - 1) / per, jobs = chunks * groups;
  // threads for a layer of 32768 weights (at one row) or a step of 2^20 products
  const bool parallel = jobs > 1 && (out * in >= 32768 || rows * out * in >= (int64_t{1} << 20));
  auto run = [&](const auto* wp) {
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t j = 0; j < jobs; j++) {
      const int64_t c = j % chunks, r0 = j / chunks * per;
      rows_against(xp + r0 * s, s, std::min(per, rows - r0), wp, in, b, yp + r0 * out, out, c * CHUNK,
                   std::min(num_blocks, (c + 1) * CHUNK));
    }
  };
  if (packed.scalar_type() == torch::kBFloat16) run(packed.data_ptr<at::BFloat16>());
  else run(packed.data_ptr<float>());
  return y;
}

#else

bool has_small_linear() { return false; }

torch::Tensor small_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out) {
  TORCH_CHECK(false, "small_linear: built without AVX2 and FMA");
}

#endif
