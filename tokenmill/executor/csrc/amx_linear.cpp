// y = x W^T (+ b) for bfloat16 steps of at most 32 rows, on AMX tiles (Sapphire Rapids and later
// Xeons). oneDNN's packed call (which also runs on AMX there) costs 17-20 us a call at least at
// these sizes, and small_linear_bf16's AVX512-BF16 dot products grow with the rows; here a layer
// of the built-in model costs 3-7 us from 1 to 32 rows (benchmarks/linear_layout.py).
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

constexpr int64_t MAX_ROWS = 32;

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

// tiles 0, 1: rows [0, m0) x two blocks of 16 outputs; 2, 3: rows [m0, m0 + m1) x the same blocks;
// 4, 5: those rows of x, 32 inputs; 6, 7: the two blocks' weights for those inputs
void configure(int m0, int m1) {
  TileConfig cfg;
  for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
  cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = m0;
  cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = m1 > 0 ? m1 : m0;
  cfg.rows[6] = cfg.rows[7] = 16;
  _tile_loadconfig(&cfg);
}

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

// output blocks b and (PAIR) b + 1, for rows [0, m0) and (TWO) [m0, m0 + m1)
template <bool TWO, bool PAIR>
void blocks(const at::BFloat16* x, int64_t x_stride, int m0, int m1, const at::BFloat16* w, int64_t pairs,
            const at::BFloat16* bias, at::BFloat16* y, int64_t out, int64_t b) {
  _tile_zero(0);
  if (PAIR) _tile_zero(1);
  if (TWO) {
    _tile_zero(2);
    if (PAIR) _tile_zero(3);
  }
  const at::BFloat16* w0 = w + b * pairs * 32;
  const at::BFloat16* w1 = w0 + pairs * 32;
  const at::BFloat16* x1 = x + m0 * x_stride;
  const int64_t x_bytes = x_stride * 2;
  for (int64_t p = 0; p < pairs; p += 16) {
    _tile_loadd(4, x + 2 * p, x_bytes);
    if (TWO) _tile_loadd(5, x1 + 2 * p, x_bytes);
    _tile_loadd(6, w0 + p * 32, 64);
    if (PAIR) _tile_loadd(7, w1 + p * 32, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (PAIR) _tile_dpbf16ps(1, 4, 7);
    if (TWO) {
      _tile_dpbf16ps(2, 5, 6);
      if (PAIR) _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float acc[16 * 16];
  _tile_stored(0, acc, 64);
  store(acc, m0, bias, y, out, b * 16);
  if (PAIR) {
    _tile_stored(1, acc, 64);
    store(acc, m0, bias, y, out, b * 16 + 16);
  }
  if (TWO) {
    _tile_stored(2, acc, 64);
    store(acc, m1, bias, y + m0 * out, out, b * 16);
    if (PAIR) {
      _tile_stored(3, acc, 64);
      store(acc, m1, bias, y + m0 * out, out, b * 16 + 16);
    }
  }
}

template <bool TWO>
void run(const at::BFloat16* x, int64_t x_stride, int m0, int m1, const at::BFloat16* w, int64_t pairs,
         const at::BFloat16* bias, at::BFloat16* y, int64_t out, int64_t num_blocks) {
  const int64_t groups = (num_blocks + 1) / 2;
#pragma omp parallel if (out * pairs >= 16384)
  {
    configure(m0, m1);  // the tile configuration is each thread's own
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
      if (2 * g + 1 < num_blocks)
        blocks<TWO, true>(x, x_stride, m0, m1, w, pairs, bias, y, out, 2 * g);
      else
        blocks<TWO, false>(x, x_stride, m0, m1, w, pairs, bias, y, out, 2 * g);
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
  const int m0 = std::min<int64_t>(rows, 16), m1 = rows - m0;
  (m1 > 0 ? run<true> : run<false>)(x.data_ptr<at::BFloat16>(), x.stride(0), m0, m1, packed.data_ptr<at::BFloat16>(),
                                    pairs, bias.has_value() ? bias->data_ptr<at::BFloat16>() : nullptr,
                                    y.data_ptr<at::BFloat16>(), out, num_blocks);
  return y;
}

#else

bool has_amx_linear() { return false; }

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out) {
  TORCH_CHECK(false, "amx_linear: built without AMX-BF16");
}

#endif
