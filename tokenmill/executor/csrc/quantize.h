// Per-token symmetric int8 quantization of activations, shared by the int8 linear kernels
// (int8_linear.cpp on fbgemm and oneDNN, amx_linear.cpp on AMX tiles).
#pragma once

#include "vec.h"

namespace tokenmill {

#if defined(__AVX512F__)
// a * b and a / b rounded as IEEE says: -ffast-math may rewrite plain a * (1 / b) as a / b (or back)
// in one kernel and not in another, and a product on a rounding tie then quantizes differently
inline float exact_mul(float a, float b) {
  return _mm_cvtss_f32(_mm_mul_round_ss(_mm_set_ss(a), _mm_set_ss(b), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline float exact_div(float a, float b) {
  return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(a), _mm_set_ss(b), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// 16 of x's values times inv, rounded to the nearest integer (ties to even), plus zero into q's 16
template <typename Q>
inline void quantize16(__m512 x, __m512 inv, __m512i zero, Q* q, __mmask16 mask) {
  constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 scaled = _mm512_mul_round_ps(x, inv, nearest);
  const __m512i v = _mm512_add_epi32(_mm512_cvt_roundps_epi32(scaled, nearest), zero);
  if constexpr (std::is_signed_v<Q>) _mm512_mask_cvtsepi32_storeu_epi8(q, mask, v);
  else _mm512_mask_cvtusepi32_storeu_epi8(q, mask, v);
}
#endif

// x's row scaled to [-qmax, qmax] and rounded, plus `zero_point` (qmax + 1 for fbgemm's unsigned
// form, 0 for the signed one of oneDNN and AMX), into q; returns the row's scale. `buffer` holds
// the row widened to float where T is not float. With AVX-512 the same row quantizes the same in
// every kernel (exact_mul).
template <typename T, typename Q>
float quantize_row(const T* x, int64_t dim, float qmax, float zero_point, Q* q, float* buffer) {
#if defined(__AVX512F__)
  if constexpr (kVectorized<T>) {  // 16 lanes at a time; the tail through a zero-padded copy
    const int64_t full = dim / 16 * 16;
    alignas(64) float tail[16] = {};
    for (int64_t j = full; j < dim; ++j) tail[j - full] = load(x, j);
    __m512 vmax = _mm512_abs_ps(_mm512_load_ps(tail));
    for (int64_t i = 0; i < full; i += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + i)));
    const float amax = _mm512_reduce_max_ps(vmax);
    // floored so that 1 / scale stays finite for rows of tiny values
    const float scale = amax > 0.f ? std::max(exact_mul(amax, exact_div(1.f, qmax)),
                                              std::numeric_limits<float>::min()) : 1.f;
    const __m512 inv = _mm512_set1_ps(exact_div(1.f, scale));
    const __m512i zero = _mm512_set1_epi32(static_cast<int>(zero_point));
    for (int64_t i = 0; i < full; i += 16) quantize16(load16(x + i), inv, zero, q + i, 0xFFFF);
    if (full < dim) quantize16(_mm512_load_ps(tail), inv, zero, q + full, __mmask16((1u << (dim - full)) - 1));
    return scale;
  }
#endif
  const float* row = reinterpret_cast<const float*>(x);
  if constexpr (!std::is_same_v<T, float>) {
    load_row(x, buffer, dim);
    row = buffer;
  }
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < dim; ++i) amax = std::max(amax, std::abs(row[i]));
  // floored so that 1 / scale stays finite for rows of tiny values
  const float scale = amax > 0.f ? std::max(amax / qmax, std::numeric_limits<float>::min()) : 1.f;
  const float inv = 1.f / scale;
#pragma omp simd
  for (int64_t i = 0; i < dim; ++i) q[i] = static_cast<Q>(std::nearbyint(row[i] * inv) + zero_point);
  return scale;
}

// quantize_row for each of x's rows (q's rows are dim apart), the scales into `scales`
template <typename T, typename Q>
void quantize_rows(const T* x, int64_t stride, int64_t rows, int64_t dim, float qmax, float zero_point, Q* q,
                   float* scales) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(std::is_same_v<T, float> ? 0 : dim);
    for (int64_t r = begin; r < end; ++r)
      scales[r] = quantize_row(x + r * stride, dim, qmax, zero_point, q + r * dim, buffer.data());
  });
}

}  // namespace tokenmill
