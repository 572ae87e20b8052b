// Activation rows as floats, for the int4 and int8 products: float32 rows as they are, bfloat16 rows widened
// (exactly).
//
// Why here and not x.to(float): a decode step makes 150 products of one row each, and an ATen conversion costs
// each of them a dispatch and an allocation, more than some products' own work.

#pragma once

#include <torch/extension.h>

#include <vector>

namespace bf16rows {

// x [M, K] float32 or bfloat16 (another float dtype goes through ATen's conversion) -> M * K floats, row-major
inline std::vector<float> widened(const at::Tensor& x) {
  const at::Tensor rows = x.contiguous();  // the same tensor when it is contiguous already
  const int64_t count = rows.numel();
  if (rows.scalar_type() == at::kFloat) {
    const float* from = rows.data_ptr<float>();
    return std::vector<float>(from, from + count);
  }
  std::vector<float> out(count);
  if (rows.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* from = rows.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(from[i]);
  } else {
    const at::Tensor wide = rows.to(at::kFloat).contiguous();
    const float* from = wide.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) out[i] = from[i];
  }
  return out;
}

}  // namespace bf16rows
