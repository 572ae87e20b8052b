// int8 weight rows in groups of 32 inputs with a float scale and min each (a GGUF Q8_0 tensor's own blocks, min 0,
// or a Q4_1 block's 4-bit grid: their fp16 values are exact as floats), times activations, for quantized.project
// and the C++ layers alike.
//
// Why: a decode step reads SmolLM2's 28 MB int8 LM head from memory, and ATen has no grouped int8 product (its
// `_weight_int8pack_mm` takes one scale per row, at about 7 GB/s on one thread here). The activations come as
// int16 codes c with a scale s per group (int16_rows.h), so per output row n and group g
//
//   p[g, l] = c[2l] w[n, 2l] + c[2l + 1] w[n, 2l + 1]        (lane l of 16, over the group's 32 inputs: exact)
//   acc[l] = fma(p[g, l], d[n, g] s[g], acc[l])              (groups in order)
//   low = fma(min[n, g], s[g] sum(c over g), low)             (groups in order; 0 for a Q8_0 group)
//   out[m, n] = the 16 lanes of acc added in a fixed pairwise tree, plus low (float32)
//
// one `vpmaddwd` per group and row (32 products), 16 rows in flight with their bytes 4 KB ahead prefetched and
// their lane sums reduced together (lane_sums16), the rows split between threads. An output depends on its own
// row and column only, never on how many rows or threads the call has: batch-invariant, as the quantized path
// must be. Wherever the extension is built every int8 product in the process comes from here; elsewhere
// quantized.torch_product computes the same sums in torch ops.

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
#include "int16_rows.h"

namespace int8mm {

using invariant::kTile;
using invariant::Lanes;
constexpr int kRows = 16;            // weight rows per pass over an activation row
constexpr int64_t kPrefetch = 4096;  // bytes ahead in each row
constexpr int64_t kGroup = int16rows::kGroup;  // inputs per scale (quantized.GROUP)

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

// sum over groups of d * s * (c . w over the group) + min * s * sum(c) for R weight rows (rows: R rows of `in`
// int8 weights; scales: each row's `in / kGroup` (scale, min) pairs, row after row; x: the codes, x_scales and
// x_sums: the groups' scales and scaled code sums)
template <int R>
inline void dot_rows(const int16_t* x, const float* x_scales, const float* x_sums, const int8_t* rows,
                     const float* scales, int64_t in, float* sums) {
  Lanes acc[R] = {};
  float low[R] = {};
  const int64_t groups = in / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k = g * kGroup;
#if defined(__AVX512BW__)
    const __m512i codes = _mm512_loadu_si512(x + k);  // 32 int16
#endif
    for (int r = 0; r < R; ++r) {
      const int8_t* weights = rows + r * in + k;
      if (g % 2 == 0) __builtin_prefetch(weights + kPrefetch);  // a hint, never a fault: one per 64-byte line
      const float* pair = scales + 2 * (r * groups + g);
      const float step = pair[0] * x_scales[g];
      low[r] = std::fma(pair[1], x_sums[g], low[r]);
#if defined(__AVX512BW__)
      const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights)));
      const __m512 products = _mm512_cvtepi32_ps(_mm512_madd_epi16(codes, wide));
      acc[r] = _mm512_fmadd_ps(products, _mm512_set1_ps(step), acc[r]);
#else
      for (int64_t l = 0; l < kTile; ++l) {
        const int32_t pair = static_cast<int32_t>(x[k + 2 * l]) * weights[2 * l] +
                             static_cast<int32_t>(x[k + 2 * l + 1]) * weights[2 * l + 1];
        acc[r][l] = std::fma(static_cast<float>(pair), step, acc[r][l]);
      }
#endif
    }
  }
  if constexpr (R == 16) {
    lane_sums16(acc, sums);
  } else {
    for (int r = 0; r < R; ++r) sums[r] = lane_sum(acc[r]);
  }
  for (int r = 0; r < R; ++r) sums[r] += low[r];
}

// dot_rows for B activation rows at once (x, x_scales, x_sums: each row's): a group's weights are loaded and
// widened once for all B rows instead of once per row, the step a multi-row call (a tree level's head, the
// adapter over its frontier) repeats most. Every (activation row, weight row) pair takes dot_rows' own steps in
// the same order, so each sum has its bits, however many rows the call has. sums: [B][R]
template <int R, int B>
inline void dot_rows_batch(const int16_t* const* x, const float* const* x_scales, const float* const* x_sums,
                           const int8_t* rows, const float* scales, int64_t in, float* sums) {
  Lanes acc[B * R] = {};
  float low[B * R] = {};
  const int64_t groups = in / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k = g * kGroup;
#if defined(__AVX512BW__)
    __m512i codes[B];
    for (int b = 0; b < B; ++b) codes[b] = _mm512_loadu_si512(x[b] + k);  // 32 int16 each
#endif
    for (int r = 0; r < R; ++r) {
      const int8_t* weights = rows + r * in + k;
      if (g % 2 == 0) __builtin_prefetch(weights + kPrefetch);
      const float* pair = scales + 2 * (r * groups + g);
#if defined(__AVX512BW__)
      const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights)));
#endif
      for (int b = 0; b < B; ++b) {
        const float step = pair[0] * x_scales[b][g];
        low[b * R + r] = std::fma(pair[1], x_sums[b][g], low[b * R + r]);
#if defined(__AVX512BW__)
        const __m512 products = _mm512_cvtepi32_ps(_mm512_madd_epi16(codes[b], wide));
        acc[b * R + r] = _mm512_fmadd_ps(products, _mm512_set1_ps(step), acc[b * R + r]);
#else
        for (int64_t l = 0; l < kTile; ++l) {
          const int32_t both = static_cast<int32_t>(x[b][k + 2 * l]) * weights[2 * l] +
                               static_cast<int32_t>(x[b][k + 2 * l + 1]) * weights[2 * l + 1];
          acc[b * R + r][l] = std::fma(static_cast<float>(both), step, acc[b * R + r][l]);
        }
#endif
      }
    }
  }
  static_assert(B * R == 16, "lane_sums16 reduces 16 accumulators");
  lane_sums16(acc, sums);
  for (int i = 0; i < B * R; ++i) sums[i] += low[i];
}

// activation rows m.. of `rows` as B-row batches against one full block of kRows weight rows (n..): B * R = 16
// accumulators per call, kRows / R calls; returns the first row left for dot_rows
template <int B>
inline int64_t batched_rows(const int16rows::Rows& rows_in, int64_t m, int64_t batch, int64_t in, const int8_t* w,
                            const float* s, int64_t n, int64_t out_features, float* o) {
  constexpr int R = kRows / B;
  const int64_t groups = in / kGroup;
  for (; m + B <= batch; m += B) {
    const int16_t* codes[B];
    const float* code_scales[B];
    const float* code_sums[B];
    for (int b = 0; b < B; ++b) {
      codes[b] = rows_in.codes.data() + (m + b) * in;
      code_scales[b] = rows_in.scales.data() + (m + b) * groups;
      code_sums[b] = rows_in.sums.data() + (m + b) * groups;
    }
    for (int64_t part = 0; part < kRows; part += R) {
      float sums[B * R];
      dot_rows_batch<R, B>(codes, code_scales, code_sums, w + (n + part) * in, s + 2 * (n + part) * groups, in, sums);
      for (int b = 0; b < B; ++b)
        for (int r = 0; r < R; ++r) o[(m + b) * out_features + n + part + r] = sums[b * R + r];
    }
  }
  return m;
}

// x [M, K] float32 or bfloat16, weight int8 [N, K], scales and mins float [N, K / 32, 2] -> float [M, N]
inline at::Tensor matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2, "weight: int8 [N, K]");
  TORCH_CHECK(weight.size(1) > 0 && weight.size(1) % kGroup == 0, "weight: K a positive multiple of 32");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.size(0) == weight.size(0) &&
                  scales.size(1) * kGroup == weight.size(1) && scales.size(2) == 2,
              "scales: float [N, K / 32, 2]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1), "x: [M, K] with the weight's K");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scales.device().is_cpu(), "tensors on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  const int16rows::Rows rows_in = int16rows::quantized(x);
  const at::Tensor rows_of = weight.contiguous();
  const at::Tensor scale_of = scales.contiguous();
  const int64_t batch = x.size(0), out_features = weight.size(0), in = weight.size(1), groups = in / kGroup;
  at::Tensor out = at::empty({batch, out_features}, x.options().dtype(at::kFloat));
  const int8_t* w = rows_of.data_ptr<int8_t>();
  const float* s = scale_of.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t blocks = (out_features + kRows - 1) / kRows;
  at::parallel_for(0, blocks, 64, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n = block * kRows, rows = std::min<int64_t>(kRows, out_features - n);
      int64_t first = 0;  // rows before it went through batched_rows
      if (rows == kRows) {
        first = batched_rows<4>(rows_in, first, batch, in, w, s, n, out_features, o);
        first = batched_rows<2>(rows_in, first, batch, in, w, s, n, out_features, o);
      }
      for (int64_t m = first; m < batch; ++m) {
        float sums[kRows];
        const int16_t* codes = rows_in.codes.data() + m * in;
        const float* code_scales = rows_in.scales.data() + m * groups;
        const float* code_sums = rows_in.sums.data() + m * groups;
        if (rows == kRows) {
          dot_rows<kRows>(codes, code_scales, code_sums, w + n * in, s + 2 * n * groups, in, sums);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            dot_rows<1>(codes, code_scales, code_sums, w + (n + r) * in, s + 2 * (n + r) * groups, in, &sums[r]);
        }
        for (int64_t r = 0; r < rows; ++r) o[m * out_features + n + r] = sums[r];
      }
    }
  });
  return out;
}

}  // namespace int8mm
