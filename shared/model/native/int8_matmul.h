// int8 weight rows in groups of 32 inputs, a float scale each (a GGUF Q8_0 tensor's own blocks: its fp16 scales
// are exact as floats), times activations, for quantized.project and the C++ layers alike.
//
// Why: a decode step reads SmolLM2's 30 MB int8 LM head from memory, and ATen has no grouped int8 product (its
// `_weight_int8pack_mm` takes one scale per row). Here each output is one pass over its weight row, 16 lanes
// wide, 16 rows in flight with their bytes 4 KB ahead prefetched and their lane sums reduced together
// (lane_sums16), the rows split between threads:
//
//   out[m, n] = sum over groups g of scale[n, g] * (sum over k in g of x[m, k] * w[n, k])    (float32)
//
// each group's sum taken per lane (k in lane k % 16: the first 16 inputs' products, then the second 16's as fused
// multiply-adds), its scale fused into the lane's running sum, and at the end the 16 lanes added in a fixed
// pairwise tree. An output depends on its own row and column only, never on how many rows or threads the call
// has: batch-invariant, as the quantized path must be. Wherever the extension is built every int8 product in the
// process comes from here (the reference model's QuantizedLinear, the Python runner and the C++ layers), so they
// agree bit for bit; elsewhere quantized.project computes from the dequantized weights.

#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attention.h"  // invariant::Lanes, kTile
#include "bf16_rows.h"

namespace int8mm {

using invariant::kTile;
using invariant::Lanes;
typedef int8_t Bytes __attribute__((vector_size(kTile)));

constexpr int kRows = 16;            // weight rows per pass over an activation row
constexpr int64_t kPrefetch = 4096;  // bytes ahead in each row
constexpr int64_t kGroup = 32;     // inputs per scale (quantized.GROUP): two tiles

// 16 weights widened to floats (the same values on every path)
inline Lanes widen(const int8_t* from) {
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from))));
  Lanes lanes;
  std::memcpy(&lanes, &wide, sizeof lanes);
  return lanes;
#else
  Bytes bytes;
  std::memcpy(&bytes, from, sizeof bytes);
  return __builtin_convertvector(bytes, Lanes);
#endif
}

inline Lanes fused(const Lanes& a, const Lanes& b, const Lanes& c) {  // a * b + c, one rounding per lane
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);  // Lanes and __m512 are the same vector type to GCC
#else
  Lanes out;
  for (int64_t i = 0; i < kTile; ++i) out[i] = std::fma(a[i], b[i], c[i]);
  return out;
#endif
}

inline Lanes product(const Lanes& a, const Lanes& b) {  // a * b, one rounding per lane
#if defined(__AVX512F__)
  return _mm512_mul_ps(a, b);
#else
  return a * b;
#endif
}

inline Lanes splat(float value) {  // every lane `value`
#if defined(__AVX512F__)
  return _mm512_set1_ps(value);
#else
  Lanes out;
  for (int64_t i = 0; i < kTile; ++i) out[i] = value;
  return out;
#endif
}

inline float lane_sum(const Lanes& lanes) {  // the fixed pairwise tree: halves added, then quarters, ...
  float parts[kTile];
  std::memcpy(parts, &lanes, sizeof parts);
  for (int64_t width = kTile / 2; width >= 1; width /= 2)
    for (int64_t i = 0; i < width; ++i) parts[i] += parts[i + width];
  return parts[0];
}

// lane_sum of 16 accumulators at once, sums[r] of acc[r]: the same tree (lanes j and j + 8, then j and j + 4,
// j and j + 2, then the last two), every add pairing the same two partial sums, so each sum has lane_sum's bits
inline void lane_sums16(const Lanes* acc, float* sums) {
#if defined(__AVX512F__)
  __m512 v[16];
  std::memcpy(v, acc, sizeof v);
  __m512 halves[8];  // rows 2i, 2i + 1: 8 lanes each
  for (int i = 0; i < 8; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  __m512 quarters[4];  // rows 4i + c in 128-bit quarter c: 4 lanes each
  for (int i = 0; i < 4; ++i)
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  __m512d pairs[2];  // quarter c: rows 8i + c, 8i + 4 + c, 2 lanes each
  for (int i = 0; i < 2; ++i) {
    const __m512d a = _mm512_castps_pd(quarters[2 * i]), b = _mm512_castps_pd(quarters[2 * i + 1]);
    pairs[i] = _mm512_castps_pd(
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b))));
  }
  const __m512 a = _mm512_castpd_ps(pairs[0]), b = _mm512_castpd_ps(pairs[1]);
  // lane 4c + s holds row c + 4s
  const __m512 last = _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(sums, _mm512_permutexvar_ps(order, last));
#else
  for (int r = 0; r < 16; ++r) sums[r] = lane_sum(acc[r]);
#endif
}

// weight rows as int8 bytes, read straight from the weight (one activation row: each weight is used once)
struct ByteRows {
  const int8_t* rows;
  int64_t in;
  Lanes lanes(int r, int64_t k) const {
    // a hint, which never faults, even past the end: one per 64-byte line (one per 16 bytes made the head's pass
    // compute-bound, 30 GB/s with its weights in cache; 0.97 against 0.78 ms from memory, one AMD EPYC core)
    if (k % 64 == 0) __builtin_prefetch(rows + r * in + k + kPrefetch);
    return widen(rows + r * in + k);
  }
};

// weight rows already widened to floats (many activation rows: each weight widened once, not once per row)
struct FloatRows {
  const float* rows;
  int64_t in;
  Lanes lanes(int r, int64_t k) const {
    Lanes out;
    std::memcpy(&out, rows + r * in + k, sizeof out);
    return out;
  }
};

// sum over groups of scale * (x . w over the group) for R weight rows (scales: each row's `in / kGroup` scales,
// row after row), per lane then over the lanes; the same values whichever form the rows come in
template <int R, typename Rows>
inline void dot_rows(const float* x, const Rows& weights, const float* scales, int64_t in, float* sums) {
  Lanes acc[R] = {};
  const int64_t groups = in / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k = g * kGroup;
    Lanes first, second;
    std::memcpy(&first, x + k, sizeof first);
    std::memcpy(&second, x + k + kTile, sizeof second);
    for (int r = 0; r < R; ++r) {
      const Lanes group = fused(second, weights.lanes(r, k + kTile), product(first, weights.lanes(r, k)));
      acc[r] = fused(splat(scales[r * groups + g]), group, acc[r]);
    }
  }
  if constexpr (R == 16) {
    lane_sums16(acc, sums);
  } else {
    for (int r = 0; r < R; ++r) sums[r] = lane_sum(acc[r]);
  }
}

// x [M, K] float32 (multiplied as it is) or bfloat16, weight int8 [N, K], scales float [N, K / 32] -> float [M, N]
inline at::Tensor matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "weight: int8 [N, K]");
  TORCH_CHECK(weight.size(1) % kGroup == 0, "weight: K a multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == weight.size(0) &&
                  scales.size(1) * kGroup == weight.size(1),
              "scales: float [N, K / 32]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1), "x: [M, K] with the weight's K");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scales.device().is_cpu(), "tensors on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  const std::vector<float> widened = bf16rows::widened(x);  // [M, K]
  const at::Tensor rows_of = weight.contiguous();
  const at::Tensor scale_of = scales.contiguous();
  const int64_t batch = x.size(0), out_features = weight.size(0), in = weight.size(1), groups = in / kGroup;
  at::Tensor out = at::empty({batch, out_features}, x.options().dtype(at::kFloat));
  const float* xs = widened.data();
  const int8_t* w = rows_of.data_ptr<int8_t>();
  const float* s = scale_of.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t blocks = (out_features + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> widened_rows(batch > 1 ? kRows * in : 0);  // [kRows, K]: this block's rows as floats
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n = block * kRows, rows = std::min<int64_t>(kRows, out_features - n);
      const float* block_scales = s + n * groups;
      if (batch > 1) {
        for (int64_t i = 0; i < rows * in; ++i) widened_rows[i] = static_cast<float>(w[n * in + i]);
      }
      for (int64_t m = 0; m < batch; ++m) {
        float sums[kRows];
        const float* row = xs + m * in;
        if (batch > 1) {
          const FloatRows block_rows{widened_rows.data(), in};
          if (rows == kRows) {
            dot_rows<kRows>(row, block_rows, block_scales, in, sums);
          } else {
            for (int64_t r = 0; r < rows; ++r)
              dot_rows<1>(row, FloatRows{widened_rows.data() + r * in, in}, block_scales + r * groups, in, &sums[r]);
          }
        } else if (rows == kRows) {
          dot_rows<kRows>(row, ByteRows{w + n * in, in}, block_scales, in, sums);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            dot_rows<1>(row, ByteRows{w + (n + r) * in, in}, block_scales + r * groups, in, &sums[r]);
        }
        for (int64_t r = 0; r < rows; ++r) o[m * out_features + n + r] = sums[r];
      }
    }
  });
  return out;
}

}  // namespace int8mm
