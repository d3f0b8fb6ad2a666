// y = x W^T (+ b) for bfloat16 steps of at most 256 rows, on AMX tiles (Sapphire Rapids and later
// Xeons). oneDNN's packed call (which also runs on AMX there) costs 17-20 us a call at least at
// these sizes, and small_linear_bf16's AVX512-BF16 dot products grow with the rows; here a layer
// of the built-in model costs 3-8 us from 1 to 32 rows (benchmarks/linear_layout.py). Up to 64
// rows the weight is read once a call; more rows go 64 at a time.
//
// The weight is the one pack_bf16_pairs lays out for small_linear_bf16, [out / 16, in / 2, 16, 2]:
// 16 consecutive pairs of inputs of a block of 16 outputs are 16 rows of 64 bytes, one weight
// tile in the layout the tile dot product reads (pairs of inputs packed in each 32-bit lane). A
// tile of x is up to 16 rows of 32 inputs; each accumulator tile is those rows x 16 outputs in
// float32. Each output element is summed chunk by chunk of 32 inputs in the same order whatever
// the number of rows, and a tile dot product computes each row from that row of x alone, so a
// row's output does not depend on the rows computed with it (a verified draft's row equals the
// decode that would have made it). The sum, plus the bias, is rounded to bfloat16 once.
//
// Linux hands out the tiles' state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); without it
// (an older kernel, a sandbox that refuses) has_amx_linear is false and layers take
// small_linear_bf16 or oneDNN as before.
#include <torch/extension.h>

#include <algorithm>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

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

// A step's rows in R tiles of x, 16 rows each but the last (`last` rows), against P blocks of 16
// outputs at a time: accumulator tile r * P + p holds row tile r x block p (R * P <= 4). Tile 4
// holds a full tile of x, tile 7 the last one (a tile dot product takes x's tile with as many rows
// as the accumulator's), tiles 5 and 6 the blocks' weights: R = 1 or 2 with P = 2 up to 32 rows,
// R = 3 or 4 with P = 1 up to 64.
void configure(int R, int P, int last) {
  TileConfig cfg;
  for (int r = 0; r < R; r++)
    for (int p = 0; p < P; p++) cfg.rows[r * P + p] = r == R - 1 ? last : 16;
  cfg.rows[4] = 16;
  cfg.rows[7] = last;
  cfg.rows[5] = cfg.rows[6] = 16;
  for (int t = 0; t < 8; t++) cfg.colsb[t] = cfg.rows[t] ? 64 : 0;  // (a tile of no rows must have no columns)
  _tile_loadconfig(&cfg);
}

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
inline void tile_store(float* p) {
  if constexpr (T == 0) _tile_stored(0, p, 64);
  else if constexpr (T == 1) _tile_stored(1, p, 64);
  else if constexpr (T == 2) _tile_stored(2, p, 64);
  else _tile_stored(3, p, 64);
}

template <int T>
inline void tile_load(const void* p, int64_t stride) {
  if constexpr (T == 4) _tile_loadd(4, p, stride);
  else _tile_loadd(7, p, stride);
}

#define TILE_DP(C, A, B) else if constexpr (c == C && a == A && b == B) _tile_dpbf16ps(C, A, B);
template <int c, int a, int b>
inline void tile_dp() {
  if constexpr (false) {}
  TILE_DP(0, 4, 5) TILE_DP(0, 4, 6) TILE_DP(0, 7, 5) TILE_DP(0, 7, 6)
  TILE_DP(1, 4, 5) TILE_DP(1, 4, 6) TILE_DP(1, 7, 5) TILE_DP(1, 7, 6)
  TILE_DP(2, 4, 5) TILE_DP(2, 4, 6) TILE_DP(2, 7, 5) TILE_DP(2, 7, 6)
  TILE_DP(3, 4, 5) TILE_DP(3, 4, 6) TILE_DP(3, 7, 5) TILE_DP(3, 7, 6)
}
#undef TILE_DP

// `rows` rows of 16 float32 sums (+ the bias) into y's outputs o..o + 15 (fewer at the end)
void store(const float* acc, int rows, const at::BFloat16* bias, at::BFloat16* y, int64_t out, int64_t o) {
  const __mmask16 mask = out - o >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (out - o)) - 1);
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr)  // bfloat16 is a float32's upper half
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + o)), 16));
  for (int m = 0; m < rows; m++) {
    const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(acc + m * 16), b));
    _mm256_mask_storeu_epi16(y + m * out + o, mask, (__m256i)r);
  }
}

// row tile r of x (tile 4, or 7 for the last) times N blocks' weights into its accumulators
template <int R, int P, int N, int r>
void row_tile(const at::BFloat16* x, int64_t x_bytes) {
  if constexpr (r < R) {
    constexpr int A = r == R - 1 ? 7 : 4;
    tile_load<A>(x, x_bytes);
    tile_dp<r * P, A, 5>();
    if constexpr (N == 2) tile_dp<r * P + 1, A, 6>();
  }
}

// row tile r's accumulators of N blocks (+ the bias) into y, from output o
template <int R, int P, int N, int r>
void store_row_tile(int last, const at::BFloat16* bias, at::BFloat16* y, int64_t out, int64_t o) {
  if constexpr (r < R) {
    const int rows = r == R - 1 ? last : 16;
    alignas(64) float acc[16 * 16];
    tile_store<r * P>(acc);
    store(acc, rows, bias, y + r * 16 * out, out, o);
    if constexpr (N == 2) {
      tile_store<r * P + 1>(acc);
      store(acc, rows, bias, y + r * 16 * out, out, o + 16);
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
template <int R, int P, int N>
void blocks(const at::BFloat16* x, int64_t x_stride, int last, const at::BFloat16* w, int64_t pairs,
            const at::BFloat16* bias, at::BFloat16* y, int64_t out, int64_t b) {
  static_assert(R * P <= 4 && N <= P && P <= 2);
  zero_row_tile<R, P, N, 0>();
  zero_row_tile<R, P, N, 1>();
  zero_row_tile<R, P, N, 2>();
  zero_row_tile<R, P, N, 3>();
  const at::BFloat16* w0 = w + b * pairs * 32;
  const int64_t x_bytes = x_stride * 2, tile = 16 * x_stride;
  for (int64_t p = 0; p < pairs; p += 16) {
    _tile_loadd(5, w0 + p * 32, 64);
    if constexpr (N == 2) _tile_loadd(6, w0 + (pairs + p) * 32, 64);
    row_tile<R, P, N, 0>(x + 2 * p, x_bytes);
    row_tile<R, P, N, 1>(x + tile + 2 * p, x_bytes);
    row_tile<R, P, N, 2>(x + 2 * tile + 2 * p, x_bytes);
    row_tile<R, P, N, 3>(x + 3 * tile + 2 * p, x_bytes);
  }
  store_row_tile<R, P, N, 0>(last, bias, y, out, b * 16);
  store_row_tile<R, P, N, 1>(last, bias, y, out, b * 16);
  store_row_tile<R, P, N, 2>(last, bias, y, out, b * 16);
  store_row_tile<R, P, N, 3>(last, bias, y, out, b * 16);
}

template <int R, int P>
void run(const at::BFloat16* x, int64_t x_stride, int last, const at::BFloat16* w, int64_t pairs,
         const at::BFloat16* bias, at::BFloat16* y, int64_t out, int64_t num_blocks) {
  const int64_t groups = (num_blocks + P - 1) / P;
#pragma omp parallel if (out * pairs >= 16384)
  {
    configure(R, P, last);  // the tile configuration is each thread's own
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
      if (P * g + P <= num_blocks)
        blocks<R, P, P>(x, x_stride, last, w, pairs, bias, y, out, P * g);
      else  // an odd number of blocks: the last one alone
        blocks<R, P, 1>(x, x_stride, last, w, pairs, bias, y, out, P * g);
    }
    _tile_release();
  }
}

}  // namespace

bool has_amx_linear() { return amx_permitted(); }

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out) {
  TORCH_CHECK(amx_permitted(), "amx_linear: the operating system did not grant this process AMX tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "amx_linear: x [rows, in], bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == torch::kBFloat16,
              "amx_linear: a weight laid out by pack_bf16_pairs, [out / 16, in / 2, 16, 2]");
  const int64_t rows = x.size(0), in = x.size(1), pairs = packed.size(1), num_blocks = packed.size(0);
  TORCH_CHECK(in % 32 == 0 && pairs == in / 2 && num_blocks == (out + 15) / 16, "amx_linear: x has ", in,
              " columns (a multiple of 32 is needed) and the weight ", out, " x ", 2 * pairs,
              " in blocks of 16 x 2");
  TORCH_CHECK(rows >= 1 && rows <= MAX_ROWS, "amx_linear: 1 to ", MAX_ROWS, " rows, got ", rows);
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == out,
                "amx_linear: a contiguous bfloat16 bias of ", out, " elements");
  if (x.stride(1) != 1) x = x.contiguous();
  auto y = torch::empty({rows, out}, x.options());
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  const auto* bp = bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t xs = x.stride(0);
  for (int64_t r0 = 0; r0 < rows; r0 += 64) {  // 64 rows at a time, the weight read again for each
    const int64_t n = std::min<int64_t>(64, rows - r0);
    const int R = (n + 15) / 16, last = n - 16 * (R - 1);
    const auto go = R == 1 ? run<1, 2> : R == 2 ? run<2, 2> : R == 3 ? run<3, 1> : run<4, 1>;
    go(xp + r0 * xs, xs, last, wp, pairs, bp, yp + r0 * out, out, num_blocks);
  }
  return y;
}

#else

bool has_amx_linear() { return false; }

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out) {
  TORCH_CHECK(false, "amx_linear: built without AMX-BF16");
}

#endif
