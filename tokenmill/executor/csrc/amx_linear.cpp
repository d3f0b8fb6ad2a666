// y = x W^T (+ b) for steps of at most 256 rows on AMX tiles (Sapphire Rapids and later Xeons),
// in two kinds that share the tile schedule:
// - amx_linear: bfloat16 x and W, float32 sums. oneDNN's packed call (which also runs on AMX
//   there) costs 17-20 us a call at least at these sizes, and small_linear_bf16's AVX512-BF16 dot
//   products grow with the rows; here a layer of the built-in model costs 3-8 us from 1 to 32
//   rows (benchmarks/linear_layout.py).
// - amx_int8_linear: W8A8, int8 W (per output channel scales) and x quantized per token here
//   (symmetric, 127), int32 sums rescaled by the row's and the column's scale: twice the tile
//   dot product's work per instruction and half the weight's bytes of bfloat16.
// Up to 64 rows the weight is read once a call; more rows go 64 at a time.
//
// Weights are laid out once (layers/linear.py: pack_bf16_pairs, pack_int8_quads) as
// [out / 16, in / G, 16, G], G = 2 inputs of bfloat16 or 4 of int8 in each 32-bit lane: 16
// consecutive groups of inputs of a block of 16 outputs are 16 rows of 64 bytes, one weight tile
// in the layout the tile dot product reads. A tile of x is up to 16 rows of 16 G inputs; each
// accumulator tile is those rows x 16 outputs. Each output element is summed chunk by chunk in
// the same order whatever the number of rows, and a tile dot product computes each row from that
// row of x alone, so a row's output does not depend on the rows computed with it (a verified
// draft's row equals the decode that would have made it). The sum is rounded to the output's
// dtype once.
//
// Linux hands out the tiles' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); without it
// (an older kernel, a sandbox that refuses), or built without AMX-BF16 and AMX-INT8 (every CPU
// with AMX has both), has_amx_linear is false and layers take small_linear_bf16, fbgemm or oneDNN.
#include <torch/extension.h>

#include <algorithm>

#if defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16_out.h"
#include "dispatch.h"
#include "quantize.h"

namespace {
using namespace tokenmill;

constexpr int64_t MAX_ROWS = 256;

bool amx_permitted() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// bfloat16 x and W, float32 sums; int8 x and W, int32 sums
struct Bf16 {
  using In = at::BFloat16;
  using Acc = float;
  static constexpr int group = 2;
};
struct Int8 {
  using In = int8_t;
  using Acc = int32_t;
  static constexpr int group = 4;
};

// A step's rows in R tiles of x, 16 rows each but the last (`last` rows), against P blocks of 16
// outputs at a time: accumulator tile r * P + p holds row tile r x block p (R * P <= 4). Full tiles
// of x alternate between tiles 4 and 5 (a tile's next load need not wait for the dot product
// reading it), the last one is tile 6 (a tile dot product takes x's tile with as many rows as the
// accumulator's); the blocks' weights are tile 7, and tile 5 for a second block (P = 2 where
// R <= 2 leaves it free): R = 1 or 2 with P = 2 up to 32 rows, R = 3 or 4 with P = 1 up to 64.
void configure(int R, int P, int last) {
  TileConfig cfg;
  for (int r = 0; r < R; r++)
    for (int p = 0; p < P; p++) cfg.rows[r * P + p] = r == R - 1 ? last : 16;
  cfg.rows[4] = cfg.rows[5] = cfg.rows[7] = 16;
  cfg.rows[6] = last;
  for (int t = 0; t < 8; t++) cfg.colsb[t] = cfg.rows[t] ? 64 : 0;  // (a tile of no rows must have no columns)
  _tile_loadconfig(&cfg);
}

template <int R, int r>
constexpr int x_tile = r == R - 1 ? 6 : 4 + r % 2;
template <int P, int p>
constexpr int w_tile = P == 2 && p == 0 ? 5 : 7;

// The tile intrinsics take literal tile numbers (they are pasted into the instruction): these
// pick the literal for a template's constant.
template <int T>
inline void tile_zero() {
  if constexpr (T == 0) _tile_zero(0);
  else if constexpr (T == 1) _tile_zero(1);
  else if constexpr (T == 2) _tile_zero(2);
  else _tile_zero(3);
}

template <int T>
inline void tile_store(void* p) {
  if constexpr (T == 0) _tile_stored(0, p, 64);
  else if constexpr (T == 1) _tile_stored(1, p, 64);
  else if constexpr (T == 2) _tile_stored(2, p, 64);
  else _tile_stored(3, p, 64);
}

template <int T>
inline void tile_load(const void* p, int64_t stride) {
  if constexpr (T == 4) _tile_loadd(4, p, stride);
  else if constexpr (T == 5) _tile_loadd(5, p, stride);
  else if constexpr (T == 6) _tile_loadd(6, p, stride);
  else _tile_loadd(7, p, stride);
}

#define TILE_DP(C, A, B)                                     \
  else if constexpr (c == C && a == A && b == B) {           \
    if constexpr (std::is_same_v<K, Int8>) _tile_dpbssd(C, A, B); \
    else _tile_dpbf16ps(C, A, B);                            \
  }
#define TILE_DPS(C) TILE_DP(C, 4, 5) TILE_DP(C, 4, 7) TILE_DP(C, 5, 7) TILE_DP(C, 6, 5) TILE_DP(C, 6, 7)
template <typename K, int c, int a, int b>
inline void tile_dp() {
  if constexpr (false) {}
  TILE_DPS(0) TILE_DPS(1) TILE_DPS(2) TILE_DPS(3)
}
#undef TILE_DPS
#undef TILE_DP

// bfloat16 sums: rows of 16 float32 sums (+ the bias) into y's outputs o..o + 15 (fewer at the end)
struct Bf16Out {
  const at::BFloat16* bias;
  at::BFloat16* y;
  int64_t out;

  Bf16Out from(int64_t row) const { return {bias, y + row * out, out}; }

  void operator()(const float* acc, int64_t row, int rows, int64_t o) const {
    const __mmask16 mask = block_mask(out, o);
    const __m512 b = bias16(bias, o, mask);
    for (int m = 0; m < rows; m++) store_sum16(y + (row + m) * out, o, mask, _mm512_loadu_ps(acc + m * 16), b);
  }
};

// int8 sums: each times its row's and its column's scale (+ the bias), into y in T
template <typename T>
struct Int8Out {
  const float* row_scale;
  const float* col_scale;
  const T* bias;
  T* y;
  int64_t out;

  Int8Out from(int64_t row) const { return {row_scale + row, col_scale, bias, y + row * out, out}; }

  void operator()(const int32_t* acc, int64_t row, int rows, int64_t o) const {
    const __mmask16 mask = block_mask(out, o);
    const int64_t n = std::min<int64_t>(16, out - o);
    const __m512 cs = _mm512_maskz_loadu_ps(mask, col_scale + o);
    alignas(64) float b[16] = {};
    if (bias != nullptr)
      for (int64_t j = 0; j < n; j++) b[j] = load(bias, o + j);
    const __m512 bv = _mm512_load_ps(b);
    for (int m = 0; m < rows; m++) {
      const __m512 s = _mm512_mul_ps(cs, _mm512_set1_ps(row_scale[row + m]));
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + m * 16)), s, bv);
      T* dst = y + (row + m) * out + o;
      if (n == 16) {
        store16(dst, v);
      } else {
        alignas(64) float tail[16];
        _mm512_store_ps(tail, v);
        for (int64_t j = 0; j < n; j++) dst[j] = from_float<T>(tail[j]);
      }
    }
  }
};

// row tile r of x times N blocks' weights into its accumulators
template <typename K, int R, int P, int N, int r>
void row_tile(const typename K::In* x, int64_t x_bytes) {
  if constexpr (r < R) {
    constexpr int A = x_tile<R, r>;
    tile_load<A>(x, x_bytes);
    tile_dp<K, r * P, A, w_tile<P, 0>>();
    if constexpr (N == 2) tile_dp<K, r * P + 1, A, w_tile<P, 1>>();
  }
}

// row tile r's accumulators of N blocks into y through `store`, from output o
template <typename K, int R, int P, int N, int r, typename Out>
void store_row_tile(int last, const Out& store, int64_t o) {
  if constexpr (r < R) {
    const int rows = r == R - 1 ? last : 16;
    alignas(64) typename K::Acc acc[16 * 16];
    tile_store<r * P>(acc);
    store(acc, r * 16, rows, o);
    if constexpr (N == 2) {
      tile_store<r * P + 1>(acc);
      store(acc, r * 16, rows, o + 16);
    }
  }
}

template <int R, int P, int N, int r>
void zero_row_tile() {
  if constexpr (r < R) {
    tile_zero<r * P>();
    if constexpr (N == 2) tile_zero<r * P + 1>();
  }
}

// N (<= P) blocks of 16 outputs from block b, for all the step's rows
template <typename K, int R, int P, int N, typename Out>
void blocks(const typename K::In* x, int64_t x_stride, int last, const typename K::In* w, int64_t in,
            const Out& store, int64_t b) {
  static_assert(R * P <= 4 && N <= P && P <= 2 && (P == 1 || R <= 2));
  zero_row_tile<R, P, N, 0>();
  zero_row_tile<R, P, N, 1>();
  zero_row_tile<R, P, N, 2>();
  zero_row_tile<R, P, N, 3>();
  constexpr int64_t chunk = 16 * K::group;  // the inputs of one tile dot product
  const typename K::In* w0 = w + b * in * 16;  // a block is in x 16 weights, a chunk's tile chunk x 16
  const int64_t x_bytes = x_stride * sizeof(typename K::In), tile = 16 * x_stride;
  for (int64_t k = 0; k < in; k += chunk) {
    tile_load<w_tile<P, 0>>(w0 + k * 16, 64);
    if constexpr (N == 2) tile_load<w_tile<P, 1>>(w0 + (in + k) * 16, 64);
    row_tile<K, R, P, N, 0>(x + k, x_bytes);
    row_tile<K, R, P, N, 1>(x + tile + k, x_bytes);
    row_tile<K, R, P, N, 2>(x + 2 * tile + k, x_bytes);
    row_tile<K, R, P, N, 3>(x + 3 * tile + k, x_bytes);
  }
  store_row_tile<K, R, P, N, 0>(last, store, b * 16);
  store_row_tile<K, R, P, N, 1>(last, store, b * 16);
  store_row_tile<K, R, P, N, 2>(last, store, b * 16);
  store_row_tile<K, R, P, N, 3>(last, store, b * 16);
}

// blocks<K, R, P, N> for the runtime R, P, N (P = 2: R <= 2)
template <typename K, typename Out>
void blocks_of(int R, int P, int N, const typename K::In* x, int64_t x_stride, int last, const typename K::In* w,
               int64_t in, const Out& store, int64_t b) {
  if (P == 2 && R == 1) {
    (N == 2 ? blocks<K, 1, 2, 2, Out> : blocks<K, 1, 2, 1, Out>)(x, x_stride, last, w, in, store, b);
  } else if (P == 2) {
    (N == 2 ? blocks<K, 2, 2, 2, Out> : blocks<K, 2, 2, 1, Out>)(x, x_stride, last, w, in, store, b);
  } else {
    const auto go = R == 1 ? blocks<K, 1, 1, 1, Out> : R == 2 ? blocks<K, 2, 1, 1, Out>
                  : R == 3 ? blocks<K, 3, 1, 1, Out> : blocks<K, 4, 1, 1, Out>;
    go(x, x_stride, last, w, in, store, b);
  }
}

// All the step's rows against each group of P blocks of outputs in turn (P = 2 up to 32 rows, else
// 1), 64 rows at a time: a group's weights are read from memory once and stay in cache for the
// next 64 rows. `before` runs first in the same parallel region, an omp for of its own (its
// barrier ends it): int8 quantizes the rows there.
template <typename K, typename Out, typename Before>
void gemm(const typename K::In* x, int64_t x_stride, int64_t rows, const typename K::In* w, int64_t in, int64_t out,
          const Out& store, const Before& before) {
  const int64_t num_blocks = (out + 15) / 16;
  const int P = rows <= 32 ? 2 : 1;
  const int64_t groups = (num_blocks + P - 1) / P;
#pragma omp parallel if (out * in >= 32768)
  {
    before();
    int configured = 0;  // the tiles' configuration, as 64 R + last (each thread has its own)
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
      const int N = P * g + P <= num_blocks ? P : 1;  // (an odd number of blocks: the last one alone)
      for (int64_t r0 = 0; r0 < rows; r0 += 64) {
        const int n = static_cast<int>(std::min<int64_t>(64, rows - r0));
        const int R = (n + 15) / 16, last = n - 16 * (R - 1);
        if (64 * R + last != configured) {
          configure(R, P, last);
          configured = 64 * R + last;
        }
        blocks_of<K>(R, P, N, x + r0 * x_stride, x_stride, last, w, in, store.from(r0), P * g);
      }
    }
    _tile_release();
  }
}

void check_common(const char* name, const torch::Tensor& x, const torch::Tensor& packed, at::ScalarType weight_dtype,
                  const char* layout, int group, int64_t out, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(amx_permitted(), name, ": the operating system did not grant this process AMX tiles");
  const int64_t rows = x.size(0), in = x.size(1), chunk = 16 * group;
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == group && packed.is_contiguous() &&
                  packed.scalar_type() == weight_dtype,
              name, ": a weight of ", weight_dtype, " laid out by ", layout, ", [out / 16, in / ", group, ", 16, ",
              group, "]");
  TORCH_CHECK(in == group * packed.size(1), name, ": x has ", in, " columns, the weight's in_features are ",
              group * packed.size(1));
  TORCH_CHECK(in % chunk == 0 && packed.size(0) == (out + 15) / 16, name, ": the weight is ", out, " x ", in,
              " in blocks of 16 x ", group, " (in_features a multiple of ", chunk, " is needed)");
  TORCH_CHECK(rows >= 0 && rows <= MAX_ROWS, name, ": at most ", MAX_ROWS, " rows, got ", rows);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->is_contiguous() && bias->numel() == out, name,
                ": a contiguous bias of ", out, " elements in x's dtype");
}

}  // namespace

bool has_amx_linear() { return amx_permitted(); }

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "amx_linear: x [rows, in], bfloat16");
  check_common("amx_linear", x, packed, torch::kBFloat16, "pack_bf16_pairs", Bf16::group, out, bias);
  if (x.stride(1) != 1) x = x.contiguous();
  auto y = torch::empty({x.size(0), out}, x.options());
  if (x.size(0) == 0) return y;
  const Bf16Out store{bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), out};
  gemm<Bf16>(x.data_ptr<at::BFloat16>(), x.stride(0), x.size(0), packed.data_ptr<at::BFloat16>(), x.size(1), out,
             store, [] {});
  return y;
}

torch::Tensor amx_int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              c10::optional<torch::Tensor> bias, int64_t out) {
  TORCH_CHECK(x.dim() == 2, "amx_int8_linear: x [rows, in]");
  check_common("amx_int8_linear", x, packed, torch::kInt8, "pack_int8_quads", Int8::group, out, bias);
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == out,
              "amx_int8_linear: scales float32, one for each of the ", out, " outputs");
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t rows = x.size(0), in = x.size(1);
  auto y = torch::empty({rows, out}, x.options());
  if (rows == 0) return y;
  // the quantized rows and their scales, in this thread's scratch (uninitialized: `quantize` writes it)
  thread_local std::vector<int8_t> q_buffer;
  thread_local std::vector<float> scale_buffer;
  q_buffer.resize(std::max<size_t>(q_buffer.size(), rows * in));
  scale_buffer.resize(std::max<size_t>(scale_buffer.size(), rows));
  const bool known = with_query_type(x.scalar_type(), [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data_ptr<T>();
    int8_t* qp = q_buffer.data();
    float* rs = scale_buffer.data();
    const int64_t xs = x.stride(0);
    const auto quantize = [&] {
      std::vector<float> buffer(std::is_same_v<T, float> ? 0 : in);
#pragma omp for schedule(static)
      for (int64_t r = 0; r < rows; r++) rs[r] = quantize_row(xp + r * xs, in, 127.f, 0.f, qp + r * in, buffer.data());
    };
    const Int8Out<T> store{rs, scales.data_ptr<float>(), bias.has_value() ? bias->data_ptr<T>() : nullptr,
                           y.data_ptr<T>(), out};
    gemm<Int8>(qp, in, rows, packed.data_ptr<int8_t>(), in, out, store, quantize);
  });
  TORCH_CHECK(known, "amx_int8_linear: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  return y;
}

#else

bool has_amx_linear() { return false; }

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out) {
  TORCH_CHECK(false, "amx_linear: built without AMX-BF16 and AMX-INT8");
}

torch::Tensor amx_int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              c10::optional<torch::Tensor> bias, int64_t out) {
  TORCH_CHECK(false, "amx_int8_linear: built without AMX-BF16 and AMX-INT8");
}

#endif
