// int4 weight rows (ATen's packed CPU layout) times activations, for quantized.project and the C++ layers alike.
//
// Why: a decode token at int4 reads 66 MB of packed weights and scales. ATen's `_weight_int4pack_mm_for_cpu`
// turns them into products at about 10 GB/s on one thread of an AVX-512 box whose core reads 40 GB/s, so its
// decode is bound by the unpacking, not by memory. Here a 64-row block is one stream of 32 bytes per input k
// (ATen's layout: byte j holds row j in its low nibble, row j + 32 in its high), each nibble turned into
// its float code - 8 by one table lookup (a vector permute), and the dequantization moved out of the inner
// loop: per output row n and group g of 32 inputs,
//
//   t = sum over k in g, in order, of fma(x_bf16[k], q[n, k] - 8, .)          (exact codes; one rounding each)
//   acc = fma(zero[g, n], xsum[g], fma(scale[g, n], t, acc))                  (groups in order)
//   out[m, n] = bf16(acc)                                                      (xsum[g]: x_bf16 summed over g)
//
// which is the sum of x * ((q - 8) * scale + zero), the weight quantize_groups describes, in a fixed order of
// its own. An output depends on its own row and column only, never on the call's rows or threads: batch-
// invariant, as the quantized path must be. Wherever the extension is built every int4 product in the process
// comes from here (the reference model's QuantizedLinear, the Python runner and the C++ layers), so they agree
// bit for bit; elsewhere, and for a weight whose rows are not whole 64-row blocks, ATen's kernel serves.

#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "bf16_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace int4mm {

constexpr int64_t kBlock = 64;  // rows per packed block (ATen's BLOCK_N): 32 bytes per input k
constexpr int64_t kGroup = 32;  // inputs per scale and zero (quantized.INT4_GROUP)
constexpr int kRowsAtOnce = 4;  // activation rows sharing one unpacking of the weights

inline bool takes(const at::Tensor& weight, const at::Tensor& scales) {
  return weight.size(0) % kBlock == 0 && scales.size(0) * kGroup == weight.size(1) * 2;
}

// per activation row, each group's sum of its bfloat16-rounded inputs, in k order
inline std::vector<float> group_sums(const float* x, int64_t batch, int64_t in) {
  std::vector<float> sums(batch * (in / kGroup));
  for (int64_t m = 0; m < batch; ++m)
    for (int64_t g = 0; g < in / kGroup; ++g) {
      float total = 0.0f;
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) total += x[m * in + k];
      sums[m * (in / kGroup) + g] = total;
    }
  return sums;
}

#if defined(__AVX512F__)
// M activation rows against one 64-row block: out[m][0..63] (floats, before the bfloat16 rounding)
template <int M>
inline void block_rows(const float* x, const float* xsum, int64_t in, const uint8_t* packed, const uint32_t* pairs,
                       int64_t out_features, float (*out)[kBlock]) {
  const __m512 codes = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t groups = in / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(pairs + (g + 2) * out_features + c * 16), _MM_HINT_T0);
    __m512 t[M][4];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < 4; ++c) t[m][c] = _mm512_setzero_ps();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
      const uint8_t* bytes = packed + k * (kBlock / 2);
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + 4096, _MM_HINT_T0);
      const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
      const __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
      // the permute reads each lane's low 4 bits: rows 0-15, 16-31 (low nibbles), 32-47, 48-63 (high nibbles)
      const __m512 w[4] = {_mm512_permutexvar_ps(first, codes), _mm512_permutexvar_ps(second, codes),
                           _mm512_permutexvar_ps(_mm512_srli_epi32(first, 4), codes),
                           _mm512_permutexvar_ps(_mm512_srli_epi32(second, 4), codes)};
      for (int m = 0; m < M; ++m) {
        const __m512 xk = _mm512_set1_ps(x[m * in + k]);
        for (int c = 0; c < 4; ++c) t[m][c] = _mm512_fmadd_ps(xk, w[c], t[m][c]);
      }
    }
    for (int c = 0; c < 4; ++c) {
      // 16 rows' (scale, zero) bfloat16 pairs: a bfloat16 is a float's high half
      const __m512i pair = _mm512_loadu_si512(pairs + g * out_features + c * 16);
      const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pair, high_half));
      for (int m = 0; m < M; ++m) {
        acc[m][c] = _mm512_fmadd_ps(scale, t[m][c], acc[m][c]);
        acc[m][c] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[m * groups + g]), acc[m][c]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out[m] + c * 16, acc[m][c]);
}
#endif

// the same sums one element at a time (a machine without AVX-512): the same fused operations in the same order
inline void block_rows_scalar(const float* x, const float* xsum, int64_t in, const uint8_t* packed,
                              const uint32_t* pairs, int64_t out_features, float* out) {
  const int64_t groups = in / kGroup;
  for (int64_t row = 0; row < kBlock; ++row) {
    const int64_t byte = row % 32, shift = row < 32 ? 0 : 4;
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      float t = 0.0f;
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) {
        const int code = (packed[k * (kBlock / 2) + byte] >> shift) & 0xF;
        t = std::fma(x[k], static_cast<float>(code - 8), t);
      }
      const uint32_t pair = pairs[g * out_features + row];
      float scale, zero;
      const uint32_t scale_bits = pair << 16, zero_bits = pair & 0xFFFF0000u;
      std::memcpy(&scale, &scale_bits, sizeof scale);
      std::memcpy(&zero, &zero_bits, sizeof zero);
      acc = std::fma(zero, xsum[g], std::fma(scale, t, acc));
    }
    out[row] = acc;
  }
}

// x [M, K] (any float dtype; rounded to bfloat16 first), weight packed by _convert_weight_to_int4pack_for_cpu
// [N, K / 2], scales and zeros bfloat16 [K / 32, N, 2] -> bf16 [M, N]
inline at::Tensor matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2, "weight: packed int4, uint8 [N, K / 2]");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 3 && scales.size(1) == weight.size(0) &&
                  scales.size(2) == 2,
              "scales: bfloat16 [groups, N, 2]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * weight.size(1), "x: [M, K] with the weight's K");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scales.device().is_cpu(), "tensors on the CPU");
  TORCH_CHECK(x.is_floating_point(), "x: a float dtype");
  if (!takes(weight, scales))
    return at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), weight, x.size(1) / scales.size(0), scales);
  const std::vector<float> rounded = bf16rows::rounded(x);  // [M, K]
  const at::Tensor packed_tensor = weight.contiguous(), pairs_tensor = scales.contiguous();
  const int64_t batch = x.size(0), out_features = weight.size(0), in = x.size(1);
  at::Tensor out = at::empty({batch, out_features}, x.options().dtype(at::kBFloat16));
  const float* xs = rounded.data();
  const std::vector<float> sums = group_sums(xs, batch, in);
  const uint8_t* packed = packed_tensor.data_ptr<uint8_t>();
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(pairs_tensor.data_ptr<c10::BFloat16>());
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const int64_t groups = in / kGroup, blocks = out_features / kBlock;
  at::parallel_for(0, blocks, 2, [&](int64_t begin, int64_t end) {
    float rows[kRowsAtOnce][kBlock];
    for (int64_t block = begin; block < end; ++block) {
      const uint8_t* block_bytes = packed + block * kBlock * (in / 2);
      const uint32_t* block_pairs = pairs + block * kBlock;
      for (int64_t m = 0; m < batch; m += kRowsAtOnce) {
        const int64_t count = std::min<int64_t>(kRowsAtOnce, batch - m);
        const float* x_rows = xs + m * in;
        const float* x_sums = sums.data() + m * groups;
#if defined(__AVX512F__)
        switch (count) {
          case 4: block_rows<4>(x_rows, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          case 3: block_rows<3>(x_rows, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          case 2: block_rows<2>(x_rows, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          default: block_rows<1>(x_rows, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
        }
#else
        for (int64_t r = 0; r < count; ++r)
          block_rows_scalar(x_rows + r * in, x_sums + r * groups, in, block_bytes, block_pairs, out_features, rows[r]);
#endif
        for (int64_t r = 0; r < count; ++r)
          for (int64_t n = 0; n < kBlock; ++n) o[(m + r) * out_features + block * kBlock + n] = c10::BFloat16(rows[r][n]);
      }
    }
  });
  return out;
}

}  // namespace int4mm
