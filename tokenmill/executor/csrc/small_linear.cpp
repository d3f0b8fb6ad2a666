// y = x W^T (+ b) for float32 steps of a few rows (decodes of a small batch, speculative
// verification), AVX2 + FMA: each weight row is read once for up to 8 rows of x, which stay in
// L1; more rows go by in passes of 8 over each thread's chunk of weight rows, which stays in
// L1/L2 between them. MKL's GEMM costs about twice its one-row GEMV from two rows on, and
// oneDNN's packed call carries about 30 us of overhead, at the built-in model's shapes
// (benchmarks/linear_layout.py).
//
// Every output element is summed in the same order whatever the number of rows (8 lanes over
// the input in order, then the lanes, then the tail), so a row's output does not depend on
// the rows computed with it: a verified draft's row equals the decode that would have made it.
//
// The weight may be bfloat16 (x and y stay float32): a float32 weight whose every value is a
// bfloat16 one (a bfloat16 checkpoint served in float32, as on a CPU without AVX512-BF16) is
// kept so (layers/linear.py), and each value is widened exactly as it is loaded, so the output
// is the float32 weight's bit for bit, from half the bytes: a decode step of a small model reads
// each weight once, from memory where the weights outgrow the cache.
#include <torch/extension.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t MAX_ROWS = 8;  // rows of x a pass
constexpr int64_t CHUNK = 32;  // weight rows a thread takes at a time

// 8 weights as float32: loaded, or bfloat16 ones widened exactly (their bits, 16 places up)
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const at::BFloat16* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// s + the dot product of the n (< 8) inputs past the last 8 with their weights, in one function for
// either weight type: under -ffast-math the compiler may order a loop's sums as it likes, and did
// so differently for the two types' loops
__attribute__((noinline)) float tail(float s, const float* w, const float* x, int64_t n) {
  for (int64_t j = 0; j < n; j++) s += w[j] * x[j];
  return s;
}
inline const float* tail_weights(const float* w, int64_t, float*) { return w; }
inline const float* tail_weights(const at::BFloat16* w, int64_t n, float* widened) {
  for (int64_t j = 0; j < n; j++) widened[j] = static_cast<float>(w[j]);
  return widened;
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// output columns [o0, o1), R weight rows at a time against the M rows of x
template <int M, int R, typename W>
void columns(const float* x, int64_t x_stride, const W* w, int64_t in, const float* bias, float* y, int64_t out,
             int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    __m256 acc[R][M];
    for (int r = 0; r < R; r++)
      for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= in; i += 8) {
      __m256 wv[R];
      for (int r = 0; r < R; r++) wv[r] = load8(w + (o + r) * in + i);
      for (int m = 0; m < M; m++) {
        const __m256 xv = _mm256_loadu_ps(x + m * x_stride + i);
        for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
      }
    }
    for (int r = 0; r < R; r++) {
      float widened[8];
      const float* wt = tail_weights(w + (o + r) * in + i, in - i, widened);
      for (int m = 0; m < M; m++) {
        const float s = tail(sum_lanes(acc[r][m]), wt, x + m * x_stride + i, in - i);
        y[m * out + o + r] = bias != nullptr ? s + bias[o + r] : s;
      }
    }
  }
  if (o < o1) columns<M, 1, W>(x, x_stride, w, in, bias, y, out, o, o1);
}

// the rows of x against output columns [o0, o1), up to MAX_ROWS rows a pass
template <typename W>
void rows_against(const float* x, int64_t x_stride, int64_t rows, const W* w, int64_t in, const float* bias,
                  float* y, int64_t out, int64_t o0, int64_t o1) {
  for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
    const float* xr = x + r0 * x_stride;
    float* yr = y + r0 * out;
    // accumulators R x M, R weight vectors and an x one within the 16 registers: the more of both,
    // the fewer loads an FMA (5 rows: 1.2 with one weight row at a time, 0.7 with two)
    switch (std::min(MAX_ROWS, rows - r0)) {
      case 1: columns<1, 4, W>(xr, x_stride, w, in, bias, yr, out, o0, o1); break;
      case 2: columns<2, 4, W>(xr, x_stride, w, in, bias, yr, out, o0, o1); break;
      case 3: columns<3, 3, W>(xr, x_stride, w, in, bias, yr, out, o0, o1); break;
      case 4: columns<4, 3, W>(xr, x_stride, w, in, bias, yr, out, o0, o1); break;
      case 5: columns<5, 2, W>(xr, x_stride, w, in, bias, yr, out, o0, o1); break;
      case 6: columns<6, 2, W>(xr, x_stride, w, in, bias, yr, out, o0, o1); break;
      case 7: columns<7, 1, W>(xr, x_stride, w, in, bias, yr, out, o0, o1); break;
      default: columns<8, 1, W>(xr, x_stride, w, in, bias, yr, out, o0, o1); break;
    }
  }
}

}  // namespace

bool has_small_linear() { return true; }

torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_linear: x [rows, in] and weight [out, in]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat &&
                  (weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16),
              "small_linear: float32 x, and a float32 or bfloat16 weight");
  TORCH_CHECK(x.size(0) >= 1, "small_linear: at least one row of x");
  TORCH_CHECK(weight.is_contiguous(), "small_linear: a contiguous weight");
  if (x.stride(1) != 1) x = x.contiguous();
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() == weight.size(0),
                "small_linear: a contiguous float32 bias of out elements");
    b = bias->data_ptr<float>();
  }
  const int64_t rows = x.size(0), in = x.size(1), out = weight.size(0);
  auto y = torch::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t s = x.stride(0);
  const int64_t chunks = (out + CHUNK - 1) / CHUNK;
  if (weight.scalar_type() == torch::kBFloat16) {
    const at::BFloat16* wp = weight.data_ptr<at::BFloat16>();
#pragma omp parallel for schedule(static) if (out * in >= 32768)
    for (int64_t c = 0; c < chunks; c++)
      rows_against(xp, s, rows, wp, in, b, yp, out, c * CHUNK, std::min(out, (c + 1) * CHUNK));
  } else {
    const float* wp = weight.data_ptr<float>();
#pragma omp parallel for schedule(static) if (out * in >= 32768)
    for (int64_t c = 0; c < chunks; c++)
      rows_against(xp, s, rows, wp, in, b, yp, out, c * CHUNK, std::min(out, (c + 1) * CHUNK));
  }
  return y;
}

#else

bool has_small_linear() { return false; }

torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(false, "small_linear: built without AVX2 and FMA");
}

#endif
