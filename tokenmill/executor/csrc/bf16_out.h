// The bfloat16 linear kernels' epilogue (small_linear_bf16.cpp, amx_linear.cpp): a row's 16
// float32 sums of a block of outputs, plus the bias, rounded to bfloat16 once.
#pragma once

#include <torch/extension.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>

namespace tokenmill {

// the lanes of outputs o..o + 15 that exist (fewer in the last block)
inline __mmask16 block_mask(int64_t out, int64_t o) {
  return out - o >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (out - o)) - 1);
}

// the bias of those outputs as float32, 0 without one (bfloat16 is a float32's upper half)
inline __m512 bias16(const at::BFloat16* bias, int64_t o, __mmask16 mask) {
  if (bias == nullptr) return _mm512_setzero_ps();
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + o)), 16));
}

// sum + bias rounded to bfloat16 into y's outputs o..o + 15 of one row (y points at the row)
inline void store_sum16(at::BFloat16* y, int64_t o, __mmask16 mask, __m512 sum, __m512 bias) {
  const __m256bh r = _mm512_cvtneps_pbh(_mm512_add_ps(sum, bias));
  _mm256_mask_storeu_epi16(y + o, mask, (__m256i)r);
}

}  // namespace tokenmill

#endif
