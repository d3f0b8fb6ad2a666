// Fused elementwise kernels of the decoder layer on the CPU. In PyTorch each is a
// chain of ops, every one a pass over memory with 16-bit types widened and narrowed
// again; here each row is read once, computed in float32 and written once.
#include "vec.h"

#include <cmath>

namespace {
using namespace tokenmill;

constexpr int64_t kRowGrain = 8;

// residual (optional, in place) = x + residual; out = rmsnorm(that) * weight
template <typename T>
void rms_norm_rows(T* out, const T* x, T* residual, const T* weight, int64_t rows, int64_t dim, float eps,
                   int64_t x_stride) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim), tmp(dim), w(dim);
    load_row(weight, w.data(), dim);
    for (int64_t r = begin; r < end; ++r) {
      load_row(x + r * x_stride, row.data(), dim);
      if (residual != nullptr) {
        // the residual stream is kept in the model dtype, as in the reference model:
        // the sum is rounded to T, and the norm reads the rounded value back
        T* res = residual + r * dim;
        load_row(res, tmp.data(), dim);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) tmp[i] += row[i];
        store_row(res, tmp.data(), dim);
        load_row(res, row.data(), dim);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < dim; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) tmp[i] = row[i] * inv * w[i];
      store_row(out + r * dim, tmp.data(), dim);
    }
  });
}

// rotate-half rotary embedding, in place on [tokens, heads, head_dim] rows with any row stride
template <typename T>
void rotary_rows(T* x, const int64_t* positions, const float* cos_sin, int64_t tokens, int64_t heads,
                 int64_t head_dim, int64_t row_stride) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = cos_sin + positions[t] * head_dim;  // [cos(half) | sin(half)]
      const float* sin = cos + half;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * row_stride + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = load(v, i), x2 = load(v, i + half);
          v[i] = from_float<T>(x1 * cos[i] - x2 * sin[i]);
          v[i + half] = from_float<T>(x2 * cos[i] + x1 * sin[i]);
        }
      }
    }
  });
}

// out = silu(gate) * up, gate_up = [gate | up] per row
template <typename T>
void silu_and_mul_rows(T* out, const T* gate_up, int64_t rows, int64_t dim) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> g(dim), u(dim);
    for (int64_t r = begin; r < end; ++r) {
      load_row(gate_up + r * 2 * dim, g.data(), dim);
      load_row(gate_up + r * 2 * dim + dim, u.data(), dim);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) g[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      store_row(out + r * dim, g.data(), dim);
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, dim] with contiguous rows");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "rms_norm: bad residual");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(),
                            residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps), x.stride(0));
  });
  return out;
}

void rotary(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary: x must be [T, heads, d] rows");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous(), "rotary: positions int64");
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat32 && cos_sin.is_contiguous() && cos_sin.size(1) == x.size(2),
              "rotary: cos_sin must be float32 [max_pos, head_dim]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    rotary_rows<scalar_t>(x.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(), cos_sin.data_ptr<float>(),
                          x.size(0), x.size(1), x.size(2), x.stride(0));
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0, "silu_and_mul: bad input");
  const int64_t dim = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), dim}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), gate_up.data_ptr<scalar_t>(), gate_up.size(0), dim);
  });
  return out;
}
