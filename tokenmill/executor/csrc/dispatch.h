// Runtime shapes and dtypes to the kernels' template arguments.
#pragma once

#include <torch/extension.h>

#include <type_traits>

namespace tokenmill {

// f(T{}) for the query's element type T (float, bfloat16 or float16); false for another dtype
template <typename F>
inline bool with_query_type(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); return true;
    case at::kBFloat16: f(c10::BFloat16{}); return true;
    case at::kHalf: f(c10::Half{}); return true;
    default: return false;
  }
}

// f(D, G) with D = head_dim (64 or 128) and G the largest of 8, 4, 2 and 1 that divides the
// GQA group, both std::integral_constant<int, ...> (decltype(D)::value in f's body): the
// 8-bit decode kernels' G query heads share each V row, in slices that fit the registers
template <typename F>
inline void with_head_dim_and_group(int64_t head_dim, int64_t group, F&& f) {
  auto by_group = [&](auto d) {
    if (group % 8 == 0) return f(d, std::integral_constant<int, 8>{});
    if (group % 4 == 0) return f(d, std::integral_constant<int, 4>{});
    if (group % 2 == 0) return f(d, std::integral_constant<int, 2>{});
    f(d, std::integral_constant<int, 1>{});
  };
  if (head_dim == 64) return by_group(std::integral_constant<int, 64>{});
  by_group(std::integral_constant<int, 128>{});
}

}  // namespace tokenmill
