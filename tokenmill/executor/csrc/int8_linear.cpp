// W8A8 INT8 linear layers on the CPU through fbgemm's packed int8 GEMM, called directly:
// per-token activation quantization, the GEMM and the rescale in one op.
//
// Through torch's quantized ops the same layer took three passes and a GEMM that split
// poorly over the cores at the engine's row counts: on a 2-core AVX2 CPU it ran the 56M
// model's layers at 0.9-1.5x float32 for 16-64 rows, against 1.4-1.9x here
// (benchmarks/int8_gemm.py, `direct`). Here the output columns are split into one packed
// part per thread, each part's GEMM runs on one thread and rescales its own columns while
// they are in cache.
//
// Activations: each row is scaled to [-qmax, qmax], rounded and offset by qmax + 1 to fbgemm's
// unsigned form; the offset comes back out as (qmax + 1) * sum_k w[n, k], kept per column.
#include "quantize.h"
#include "vec.h"

#include <memory>
#include <tuple>

#if defined(__x86_64__) && __has_include(<fbgemm/Fbgemm.h>)
#include <fbgemm/Fbgemm.h>
#define TOKENMILL_HAS_FBGEMM 1
#endif

namespace py = pybind11;

namespace {
using namespace tokenmill;

// oneDNN's int8 GEMM (torch.ops.onednn.qlinear_pointwise, AMX-INT8 where the CPU has it) takes one
// activation scale a tensor; per-token scales go around it: the rows are quantized here (signed,
// to [-qmax, qmax], padded with zero rows to the row count the caller asks, so that oneDNN's cache sees
// few shapes), the GEMM runs with scale 1, and its float32 output is rescaled per row here.
std::tuple<torch::Tensor, torch::Tensor> int8_quantize_rows(torch::Tensor x, int64_t padded_rows, int64_t qmax) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "int8_quantize_rows: x must be [rows, dim] with contiguous rows");
  const int64_t rows = x.size(0), dim = x.size(1);
  TORCH_CHECK(padded_rows >= rows, "int8_quantize_rows: padded_rows must be at least x's rows");
  TORCH_CHECK(qmax >= 1 && qmax <= 127, "int8_quantize_rows: qmax must be in [1, 127]");
  auto q = torch::empty({padded_rows, dim}, torch::kInt8);
  auto scales = torch::empty({rows}, torch::kFloat32);
  if (padded_rows > rows) q.narrow(0, rows, padded_rows - rows).zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_quantize_rows", [&] {
    quantize_rows(x.data_ptr<scalar_t>(), x.stride(0), rows, dim, static_cast<float>(qmax), 0.f, q.data_ptr<int8_t>(),
                  scales.data_ptr<float>());
  });
  return {q, scales};
}

template <typename T>
void rescale_rows(const float* acc, const float* scales, int64_t rows, int64_t N, const T* bias, T* y) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(N);
    for (int64_t r = begin; r < end; ++r) {
      const float rs = scales[r];
      const float* a = acc + r * N;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) row[j] = a[j] * rs;
      if (bias != nullptr) {
        for (int64_t j = 0; j < N; ++j) row[j] += load(bias, j);
      }
      store_row(y + r * N, row.data(), N);
    }
  });
}

// y[r] = acc[r] * scales[r] (+ bias) in `dtype`, for the first len(scales) rows of acc [rows, N] float32.
torch::Tensor int8_rescale_rows(torch::Tensor acc, torch::Tensor scales, c10::optional<torch::Tensor> bias,
                                at::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == torch::kFloat32,
              "int8_rescale_rows: acc must be contiguous float32 [rows, N]");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 && scales.numel() <= acc.size(0),
              "int8_rescale_rows: scales must be contiguous float32, at most one a row of acc");
  const int64_t rows = scales.numel(), N = acc.size(1);
  auto y = torch::empty({rows, N}, acc.options().dtype(dtype));
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == dtype && bias->numel() == N,
                "int8_rescale_rows: bias must be contiguous [N] in the output dtype");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "int8_rescale_rows", [&] {
    rescale_rows(acc.data_ptr<float>(), scales.data_ptr<float>(), rows, N,
                 bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>());
  });
  return y;
}
}  // namespace

#ifdef TOKENMILL_HAS_FBGEMM
namespace {
using PackedB = fbgemm::PackBMatrix<int8_t, int32_t>;
constexpr int64_t kColumnAlign = 64;

// A weight [N, K] int8 with its per-output-channel scales, packed for fbgemm in column parts.
struct Int8Weight {
  int64_t in_features = 0, out_features = 0, qmax = 0;
  std::vector<std::unique_ptr<PackedB>> parts;
  std::vector<int64_t> starts;
  std::vector<float> scale;
  std::vector<int32_t> offset;  // (qmax + 1) * sum_k w[n, k]
};

template <typename T>
void int8_gemm(const Int8Weight& w, const T* x, int64_t x_stride, int64_t rows, const T* bias, T* y) {
  const int64_t K = w.in_features, N = w.out_features;
  // uninitialized scratch: every element is written before it is read
  auto qx = torch::empty({rows, K}, torch::kUInt8);
  auto acc = torch::empty({rows, N}, torch::kInt32);
  std::vector<float> row_scale(rows);
  const auto qmax = static_cast<float>(w.qmax);
  quantize_rows(x, x_stride, rows, K, qmax, qmax + 1.f, qx.data_ptr<uint8_t>(), row_scale.data());
  int32_t* C = acc.data_ptr<int32_t>();
  at::parallel_for(0, static_cast<int64_t>(w.parts.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out;
    for (int64_t p = begin; p < end; ++p) {
      PackedB& B = *w.parts[p];
      const int64_t start = w.starts[p], n = B.numCols();
      fbgemm::PackAMatrix<uint8_t, int32_t> A(fbgemm::matrix_op_t::NoTranspose, rows, K, qx.data_ptr<uint8_t>(), K,
                                              nullptr, 1);
      fbgemm::DoNothing<int32_t, int32_t> done;
      fbgemm::memCopy<> copy(done);
      fbgemm::fbgemmPacked(A, B, C + start, C + start, N, copy, 0, 1);
      // the rescale, on this part's columns while they are in cache
      const float* cs = w.scale.data() + start;
      const int32_t* off = w.offset.data() + start;
      out.resize(n);
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t* c = C + r * N + start;
        const float rs = row_scale[r];
        float* o = std::is_same_v<T, float> ? reinterpret_cast<float*>(y + r * N + start) : out.data();
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) o[j] = static_cast<float>(c[j] - off[j]) * (rs * cs[j]);
        if (bias != nullptr) {
          for (int64_t j = 0; j < n; ++j) o[j] += load(bias + start, j);
        }
        if constexpr (!std::is_same_v<T, float>) store_row(y + r * N + start, o, n);
      }
    }
  });
}

std::shared_ptr<Int8Weight> int8_pack(torch::Tensor weight, torch::Tensor scale, int64_t qmax) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kInt8, "int8_pack: weight must be int8 [N, K]");
  TORCH_CHECK(scale.numel() == weight.size(0), "int8_pack: one scale per output channel");
  TORCH_CHECK(qmax == 63 || qmax == 127, "int8_pack: qmax must be 63 or 127");
  weight = weight.contiguous();
  auto w = std::make_shared<Int8Weight>();
  w->out_features = weight.size(0);
  w->in_features = weight.size(1);
  w->qmax = qmax;
  auto s = scale.to(torch::kFloat32).contiguous();
  w->scale.assign(s.data_ptr<float>(), s.data_ptr<float>() + s.numel());
  const auto sums = weight.to(torch::kInt64).sum(1).contiguous();  // |sum| <= 127 K: int32 holds it times 128
  const int64_t* sum = sums.data_ptr<int64_t>();
  w->offset.resize(w->out_features);
  for (int64_t n = 0; n < w->out_features; ++n) w->offset[n] = static_cast<int32_t>((qmax + 1) * sum[n]);
  // one part per thread, in whole 64-column blocks
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per = ((w->out_features + parts - 1) / parts + kColumnAlign - 1) / kColumnAlign * kColumnAlign;
  for (int64_t start = 0; start < w->out_features; start += per) {
    const int64_t n = std::min(per, w->out_features - start);
    w->starts.push_back(start);
    w->parts.emplace_back(std::make_unique<PackedB>(fbgemm::matrix_op_t::Transpose, w->in_features, n,
                                                    weight.data_ptr<int8_t>() + start * w->in_features,
                                                    w->in_features, nullptr, 1));
  }
  return w;
}

torch::Tensor int8_linear(torch::Tensor x, const std::shared_ptr<Int8Weight>& w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == w->in_features,
              "int8_linear: x must be [rows, in_features] with contiguous rows");
  auto y = torch::empty({x.size(0), w->out_features}, x.options());
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == x.scalar_type() && bias->numel() == w->out_features,
                "int8_linear: bias must be contiguous [out_features] in x's dtype");
  }
  if (x.size(0) == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    int8_gemm<scalar_t>(*w, x.data_ptr<scalar_t>(), x.stride(0), x.size(0),
                        bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr, y.data_ptr<scalar_t>());
  });
  return y;
}
}  // namespace
#endif

void bind_int8_linear(py::module& m) {
  m.def("int8_quantize_rows", &int8_quantize_rows,
        "(q int8 [padded_rows, dim], scales float32 [rows]): each row of x symmetric to [-qmax, qmax], zero rows after",
        py::arg("x"), py::arg("padded_rows"), py::arg("qmax"));
  m.def("int8_rescale_rows", &int8_rescale_rows,
        "acc[r] * scales[r] (+ bias) in dtype, for the rows that have a scale", py::arg("acc"), py::arg("scales"),
        py::arg("bias"), py::arg("dtype"));
#ifdef TOKENMILL_HAS_FBGEMM
  py::class_<Int8Weight, std::shared_ptr<Int8Weight>>(m, "Int8Weight")
      .def_readonly("in_features", &Int8Weight::in_features)
      .def_readonly("out_features", &Int8Weight::out_features)
      .def_readonly("qmax", &Int8Weight::qmax);
  m.def("int8_pack", &int8_pack, "an int8 weight [N, K] and its per-channel scales, packed for int8_linear",
        py::arg("weight"), py::arg("scale"), py::arg("qmax"));
  m.def("int8_linear", &int8_linear, "x W^T (+ bias): x quantized per token, fbgemm's int8 GEMM, rescaled",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
#endif
}
