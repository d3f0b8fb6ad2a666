// Shared helpers of the CPU kernels: element loads as float, 16-lane AVX-512 loads and
// stores where the build has AVX-512, scalar code everywhere else.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tokenmill {

// element loads as float; written so that the loops below vectorize
inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const double* p, int64_t i) { return static_cast<float>(p[i]); }
inline float load(const c10::BFloat16* p, int64_t i) {
  const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load(const c10::Half* p, int64_t i) { return static_cast<float>(p[i]); }

// The 8-bit elements of a quantized KV cache (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2): each
// row of head_dim values is stored as value / scale, its scale kept beside the cache.
template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn> ||
                            std::is_same_v<T, c10::Float8_e5m2>;

inline float float_from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}
inline uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}
inline float load(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }
// fp8 by bit arithmetic, so that the loops vectorize (no table lookups): a normal number's
// exponent is rebiased by adding to the exponent field; a subnormal is its mantissa times
// the smallest step. `mantissa` bits, exponent bias `bias`.
template <int mantissa, int bias>
inline float fp8_to_float(uint8_t x) {
  const uint32_t mag = x & 0x7f;
  const float normal = float_from_bits((mag << (23 - mantissa)) + (static_cast<uint32_t>(127 - bias) << 23));
  constexpr float step = 1.f / static_cast<float>(1u << (bias + mantissa - 1));  // 2^(1 - bias - mantissa)
  const float subnormal = static_cast<float>(mag) * step;
  const float f = mag >= (1u << mantissa) ? normal : subnormal;
  return float_from_bits(bits_of(f) | (static_cast<uint32_t>(x & 0x80) << 24));
}
inline float load(const c10::Float8_e4m3fn* p, int64_t i) {
  return fp8_to_float<3, 7>(reinterpret_cast<const uint8_t*>(p)[i]);
}
inline float load(const c10::Float8_e5m2* p, int64_t i) {
  return fp8_to_float<2, 15>(reinterpret_cast<const uint8_t*>(p)[i]);
}

// x (already divided by its row's scale, within +-qmax) as the cache element: int8 rounds to
// nearest even, fp8 by c10's conversion (also to nearest even)
template <typename C>
inline C quantize_element(float x, float qmax) {
  x = std::min(std::max(x, -qmax), qmax);
  if constexpr (std::is_same_v<C, int8_t>) {
    return static_cast<int8_t>(std::nearbyint(x));
  } else {
    return C(x);
  }
}

#if defined(__AVX512F__)
// 16 lanes at a time; bf16 widens by a shift, fp16 by the F16C conversion
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <typename T>
constexpr bool kVectorized = !std::is_same_v<T, double> && !kQuantized<T>;
#else
template <typename T>
constexpr bool kVectorized = false;
#endif

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (kVectorized<T>) {
    if (n % 16 == 0) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
      return _mm512_reduce_add_ps(acc);
    }
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += q[i] * load(k, i);
  return s;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (kVectorized<T>) {
    if (n % 16 == 0) {
      const __m512 va = _mm512_set1_ps(a);
      for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, load16(x + i), _mm512_loadu_ps(y + i)));
      return;
    }
  }
#endif
  for (int64_t i = 0; i < n; ++i) y[i] += a * load(x, i);
}

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

#if defined(__AVX512F__)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  // round to nearest even, as c10::BFloat16 does
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
#endif
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif

// s[0:len] = softmax(s[0:len]), in place (exp vectorizes: the build uses -ffast-math,
// so nothing here may be inf)
inline void softmax_inplace(float* s, int64_t len) {
  float mx = -std::numeric_limits<float>::max();
  for (int64_t t = 0; t < len; ++t) mx = std::max(mx, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

// rows[t] = element offset of context token t's slot in a [slots, kv_heads, d] cache, for
// t < len, block by block (no division per token); rows[len:end] repeat the last real row,
// so that padded tails read real memory
inline void slot_rows(std::vector<int64_t>& rows, const int32_t* blocks, int64_t len, int64_t end,
                      int64_t block_size, int64_t slot_stride) {
  rows.resize(end);
  for (int64_t j = 0, t = 0; t < len; ++j) {
    const int64_t base = static_cast<int64_t>(blocks[j]) * block_size * slot_stride;
    for (int64_t i = 0; i < block_size && t < len; ++i, ++t) rows[t] = base + i * slot_stride;
  }
  for (int64_t t = len; t < end; ++t) rows[t] = rows[len - 1];
}

// into L2 (prefetcht1)
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 2);
}

#if defined(__AVX512F__)
// x[0], x[stride], ..., x[15 * stride]: a load, two loads and a permute, or a gather
inline __m512 strided16(const float* x, int64_t stride) {
  if (stride == 1) return _mm512_loadu_ps(x);
  if (stride == 2) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    // x[16 .. 30] only: x[31] may lie past the scales' last slot
    return _mm512_permutex2var_ps(_mm512_loadu_ps(x), even, _mm512_maskz_loadu_ps(0x7fff, x + 16));
  }
  const __m512i index = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(static_cast<int32_t>(stride)));
  return _mm512_i32gather_ps(index, x, 4);
}

// e^x in 16 lanes, to about 1 ulp: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^6
// (error under r^7 / 7! = 2e-7 of it), times 2^n by vscalefps; x clamped at -87 (e^-87 is near
// float's smallest normal)
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts: n ln2 exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

struct Weighted {
  float inv_sum;  // 1 / the sum of e^(s - max): the softmax's normalisation, left to the caller
  float amax;     // the largest p
};

// p[t] = e^(s[t] - max s) w[t] in place for t < len, 0 from len to padded (a multiple of 16):
// the softmax of a head's scores unnormalised, each probability times its V row's scale (w
// null: none, as for a 16-bit cache), in
// three passes over AVX-512 registers (max; exp, sum, scale and largest; what is left of the
// padding) where a loop per step (max, exp, normalise, scale, largest) ran in 256-bit ones
inline Weighted softmax_weighted(float* s, const float* w, int64_t len, int64_t padded) {
  __m512 mx[4];
  for (auto& m : mx) m = _mm512_set1_ps(-std::numeric_limits<float>::max());
  int64_t t = 0;
  for (; t + 64 <= len; t += 64)
    for (int j = 0; j < 4; ++j) mx[j] = _mm512_max_ps(mx[j], _mm512_loadu_ps(s + t + 16 * j));
  for (; t < len; t += 16) {
    const __mmask16 m = len - t >= 16 ? 0xffff : (1u << (len - t)) - 1;
    mx[0] = _mm512_mask_max_ps(mx[0], m, mx[0], _mm512_maskz_loadu_ps(m, s + t));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(mx[0], mx[1]),
                                                                         _mm512_max_ps(mx[2], mx[3]))));
  __m512 sum = _mm512_setzero_ps(), amax = _mm512_setzero_ps();
  for (t = 0; t < padded; t += 16) {
    const __mmask16 m = len - t >= 16 ? 0xffff : len > t ? (1u << (len - t)) - 1 : 0;
    const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), top)));
    const __m512 p = w == nullptr ? e : _mm512_mul_ps(e, _mm512_maskz_loadu_ps(m, w + t));
    sum = _mm512_add_ps(sum, e);
    amax = _mm512_max_ps(amax, p);
    _mm512_storeu_ps(s + t, p);
  }
  return {1.f / _mm512_reduce_add_ps(sum), _mm512_reduce_max_ps(amax)};
}
#endif

// One request's context in an 8-bit paged cache, for decode_attention_int8.cpp and
// decode_attention_fp8.cpp: each token's slot, and its row's offset (slot * slot_stride
// elements, one byte each), up to `end` (past len: the last row again).
struct PagedRows {
  std::vector<int64_t> slots, rows;
  bool whole_chunks = false;  // every 16-token chunk (t0 a multiple of 16) lies in one block
  void prepare(const int32_t* blocks, int64_t len, int64_t end, int64_t block_size, int64_t slot_stride) {
    slot_rows(slots, blocks, len, end, block_size, 1);
    rows.resize(end);
    for (int64_t t = 0; t < end; ++t) rows[t] = slots[t] * slot_stride;
    whole_chunks = block_size % 16 == 0;
  }
  // the first n tokens' K rows and scales of a kv head fetched into L2, before its first chunk
  void prefetch_first(const float* ks, const float* vs, const void* kh, int64_t row_bytes, int64_t n,
                      int64_t kv_heads) const {
    for (int64_t t = 0; t < n; ++t) {
      prefetch_l2(ks + slots[t] * kv_heads, 1);
      prefetch_l2(vs + slots[t] * kv_heads, 1);
      prefetch_l2(static_cast<const char*>(kh) + rows[t], row_bytes);
    }
  }
  // k_scale / v_scale[t0 .. t0 + 15] = the rows' scales times `unit` (ks, vs: one kv head's,
  // slot i's at [i * kv_heads]); the K rows of `row_bytes` from kh and the scales `ahead`
  // tokens on (a multiple of 16) are fetched into L2 (the scales sit apart from the rows:
  // unfetched, each block waited on two more misses). Where a chunk lies in one block its
  // slots follow each other: two gathers and a prefetch per line of scales. Otherwise a slot
  // at a time, a scale line fetched when it changes (a division per token to find them took
  // a fifth of the int8 kernel's time). Past a context's end a chunk's scales are its block's
  // other slots' (their scores are dropped).
  void chunk_scales(float* k_scale, float* v_scale, const float* ks, const float* vs, const void* kh,
                    int64_t row_bytes, int64_t t0, int64_t ahead, int64_t kv_heads, float unit) const {
    for (int64_t i = 0; i < 16; ++i) prefetch_l2(static_cast<const char*>(kh) + rows[t0 + ahead + i], row_bytes);
#if defined(__AVX512F__)
    if (whole_chunks) {
      const int64_t now = slots[t0] * kv_heads, next = slots[t0 + ahead] * kv_heads;
      _mm512_storeu_ps(k_scale + t0, _mm512_mul_ps(strided16(ks + now, kv_heads), _mm512_set1_ps(unit)));
      _mm512_storeu_ps(v_scale + t0, _mm512_mul_ps(strided16(vs + now, kv_heads), _mm512_set1_ps(unit)));
      prefetch_l2(ks + next, 16 * kv_heads * sizeof(float));
      prefetch_l2(vs + next, 16 * kv_heads * sizeof(float));
      return;
    }
#endif
    uintptr_t fetched = 0;
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t now = slots[t0 + i] * kv_heads, next = slots[t0 + ahead + i] * kv_heads;
      k_scale[t0 + i] = ks[now] * unit;
      v_scale[t0 + i] = vs[now] * unit;
      const uintptr_t line = reinterpret_cast<uintptr_t>(ks + next) >> 6;
      if (line != fetched) {
        fetched = line;
        prefetch_l2(ks + next, 1);
        prefetch_l2(vs + next, 1);
      }
    }
  }
};

#if defined(__AVX512F__)
// r[i] = sum of the 16 lanes of a[i], for i < 16 (a transpose-and-add tree: 45 ops for
// 16 sums where one reduce_add per sum would take about 8 each)
inline __m512 hsum16(const __m512* a) {
  __m512 b[8], c[4];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3], x = a[2k], y = a[2k+1]
    b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
  }
  for (int k = 0; k < 4; ++k) {  // per 128-bit lane: the lane's partial sums of a[4k..4k+3]
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * k]), _mm512_castps_pd(b[2 * k + 1]));
    c[k] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // add the four 128-bit lanes of each c[k]; lane q of the result holds a[4q..4q+3]
  const __m512 e01 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 e23 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(e01, e23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// unpack_pairs interleaves two rows of 32 16-bit values per 128-bit lane: lane 4L+i of lo is
// value 8L+i, of hi 8L+4+i. The 32 sums accumulated against such lo and hi, stored back in
// value order.
template <typename T>
inline void store_unpacked(T* o, __m512 lo, __m512 hi) {
  const __m512 first = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512 second = _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
  store16(o, _mm512_shuffle_f32x4(first, first, _MM_SHUFFLE(3, 1, 2, 0)));
  store16(o + 16, _mm512_shuffle_f32x4(second, second, _MM_SHUFFLE(3, 1, 2, 0)));
}
#endif

#if defined(__AVX512BF16__)
inline __m512bh load_bh(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// p.v over a pair of tokens in one vdpbf16ps: lane i of the result is p0 v0[i] + p1 v1[i],
// p0 and p1 two bf16 in one 32-bit broadcast, v0 and v1 interleaved 16 bits at a time.
// unpack_pairs interleaves two rows of 32 values: lane 4L+i of lo is value 8L+i, of hi 8L+4+i.
inline void unpack_pairs(const c10::BFloat16* v0, const c10::BFloat16* v1, __m512bh& lo,
                         __m512bh& hi) {
  const __m512i x = _mm512_loadu_si512(v0), y = _mm512_loadu_si512(v1);
  lo = (__m512bh)_mm512_unpacklo_epi16(x, y);
  hi = (__m512bh)_mm512_unpackhi_epi16(x, y);
}

#endif

// dst[0:n] = src[0:n] narrowed to T (16 lanes at a time where possible)
template <typename T>
inline void store_row(T* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVectorized<T>) {
    for (; i + 16 <= n; i += 16) store16(dst + i, _mm512_loadu_ps(src + i));
  }
#endif
  for (; i < n; ++i) dst[i] = from_float<T>(src[i]);
}

// dst[0:n] = src[0:n] widened to float
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (kVectorized<T>) {
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
  }
#endif
  for (; i < n; ++i) dst[i] = load(src, i);
}

}  // namespace tokenmill
