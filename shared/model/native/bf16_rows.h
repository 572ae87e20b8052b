// Activation rows rounded to bfloat16, as floats: what the int4 and int8 products multiply.
//
// Why here and not x.to(bfloat16).to(float): a decode step makes 150 products of one row each, and the two
// ATen conversions cost each of them two dispatches and two allocations, more than some products' own work.
// The rounding is c10::BFloat16's, round to nearest even, the one ATen's conversion uses.

#pragma once

#include <torch/extension.h>

#include <vector>

namespace bf16rows {

// x [M, K] float32 or bfloat16 (another float dtype goes through ATen's conversions) -> M * K floats, row-major
inline std::vector<float> rounded(const at::Tensor& x) {
  const at::Tensor rows = x.contiguous();  // the same tensor when it is contiguous already
  const int64_t count = rows.numel();
  std::vector<float> out(count);
  if (rows.scalar_type() == at::kBFloat16) {
    const c10::BFloat16* from = rows.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(from[i]);
  } else if (rows.scalar_type() == at::kFloat) {
    const float* from = rows.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(c10::BFloat16(from[i]));
  } else {
    const at::Tensor wide = rows.to(at::kBFloat16).to(at::kFloat).contiguous();
    const float* from = wide.data_ptr<float>();
    for (int64_t i = 0; i < count; ++i) out[i] = from[i];
  }
  return out;
}

}  // namespace bf16rows
