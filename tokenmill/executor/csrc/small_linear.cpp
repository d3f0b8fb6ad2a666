// y = x W^T (+ b) for float32 steps of at most 8 rows (decodes of a small batch, speculative
// verification), AVX2 + FMA: each weight row is read once for all the rows of x, which stay
// in L1. MKL's GEMM costs about twice its one-row GEMV from two rows on, and oneDNN's packed
// call carries about 30 us of overhead, at the built-in model's shapes
// (benchmarks/linear_layout.py).
//
// Every output element is summed in the same order whatever the number of rows (8 lanes over
// the input in order, then the lanes, then the tail), so a row's output does not depend on
// the rows computed with it: a verified draft's row equals the decode that would have made it.
#include <torch/extension.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t MAX_ROWS = 8;
constexpr int64_t CHUNK = 32;  // weight rows a thread takes at a time

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// output columns [o0, o1), R weight rows at a time against the M rows of x
template <int M, int R>
void columns(const float* x, int64_t x_stride, const float* w, int64_t in, const float* bias, float* y, int64_t out,
             int64_t o0, int64_t o1) {
  int64_t o = o0;
  for (; o + R <= o1; o += R) {
    __m256 acc[R][M];
    for (int r = 0; r < R; r++)
      for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= in; i += 8) {
      __m256 wv[R];
      for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_ps(w + (o + r) * in + i);
      for (int m = 0; m < M; m++) {
        const __m256 xv = _mm256_loadu_ps(x + m * x_stride + i);
        for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
      }
    }
    for (int r = 0; r < R; r++) {
      const float* wr = w + (o + r) * in;
      for (int m = 0; m < M; m++) {
        float s = sum_lanes(acc[r][m]);
        for (int64_t j = i; j < in; j++) s += wr[j] * x[m * x_stride + j];
        y[m * out + o + r] = bias != nullptr ? s + bias[o + r] : s;
      }
    }
  }
  if (o < o1) columns<M, 1>(x, x_stride, w, in, bias, y, out, o, o1);
}

template <int M>
void run(const float* x, int64_t x_stride, const float* w, int64_t in, const float* bias, float* y, int64_t out) {
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);  // accumulators R x M within the 16 registers
  const int64_t chunks = (out + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static) if (out * in >= 32768)
  for (int64_t c = 0; c < chunks; c++)
    columns<M, R>(x, x_stride, w, in, bias, y, out, c * CHUNK, std::min(out, (c + 1) * CHUNK));
}

}  // namespace

bool has_small_linear() { return true; }

torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_linear: x [rows, in] and weight [out, in]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat, "small_linear: float32 only");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= MAX_ROWS, "small_linear: 1 to ", MAX_ROWS, " rows, got ", x.size(0));
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
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t s = x.stride(0);
  switch (rows) {
    case 1: run<1>(xp, s, wp, in, b, yp, out); break;
    case 2: run<2>(xp, s, wp, in, b, yp, out); break;
    case 3: run<3>(xp, s, wp, in, b, yp, out); break;
    case 4: run<4>(xp, s, wp, in, b, yp, out); break;
    case 5: run<5>(xp, s, wp, in, b, yp, out); break;
    case 6: run<6>(xp, s, wp, in, b, yp, out); break;
    case 7: run<7>(xp, s, wp, in, b, yp, out); break;
    default: run<8>(xp, s, wp, in, b, yp, out); break;
  }
  return y;
}

#else

bool has_small_linear() { return false; }

torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(false, "small_linear: built without AVX2 and FMA");
}

#endif
