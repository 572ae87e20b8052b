// Activation rows quantized to int16 in groups of 32 inputs, for the int4 and int8 products.
//
// Why: the weights are integers (int4 codes, int8 codes) with a float scale per group, so with integer
// activations a group's dot product is an exact integer sum, taken two products per 32-bit lane by AVX-512's
// `vpmaddwd` / VNNI's `vpdpwssd` (16 bits by 16 bits), and the floats come in once per group. Each group of a
// row keeps its own scale, max |x| / 32767, so an input is off by at most 1 / 65534 of its group's largest:
// finer than float32's bfloat16 rounding (1 / 512 of each input) for all but inputs far below their group's
// largest, and far finer in the sum (make bench-engine's quality table measures it against f32). The sums being
// exact integers, every path (AVX-512 or scalar) gives the same bits.

#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace int16rows {

constexpr int64_t kGroup = 32;      // inputs per activation scale: the weights' group
constexpr float kLevels = 32767.0f;  // the largest |code|

struct Rows {
  std::vector<int16_t> codes;  // [M, K]
  std::vector<float> scales;   // [M, K / 32]: a group's inputs are codes * scale
  std::vector<float> sums;     // [M, K / 32]: scale * (sum of the group's codes), exact before the product
};

// x [M, K] float32 or bfloat16 (another float dtype goes through ATen's conversion), K a multiple of 32
inline Rows quantized(const at::Tensor& x) {
  const at::Tensor rows = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  const int64_t count = rows.numel(), groups = count / kGroup;
  const float* from = rows.data_ptr<float>();
  Rows out{std::vector<int16_t>(count), std::vector<float>(groups), std::vector<float>(groups)};
  for (int64_t g = 0; g < groups; ++g) {
    const float* in = from + g * kGroup;
    float largest = 0.0f;
    bool finite = true;
    for (int64_t k = 0; k < kGroup; ++k) {
      finite = finite && std::isfinite(in[k]);
      largest = std::max(largest, std::fabs(in[k]));
    }
    // a group with a NaN or an infinity: codes 0 and a NaN scale, so the outputs it reaches are NaN, as float
    // arithmetic would make them (an error here would fail every session of a packed pass, not just this row's)
    const float scale = finite ? largest / kLevels : std::numeric_limits<float>::quiet_NaN();
    const float inverse = finite && largest > 0.0f ? kLevels / largest : 0.0f;
    int32_t total = 0;
    for (int64_t k = 0; k < kGroup; ++k) {
      const float code = std::min(kLevels, std::max(-kLevels, std::nearbyint(in[k] * inverse)));
      out.codes[g * kGroup + k] = static_cast<int16_t>(code);
      total += static_cast<int32_t>(code);
    }
    out.scales[g] = scale;
    out.sums[g] = scale * static_cast<float>(total);
  }
  return out;
}

}  // namespace int16rows
