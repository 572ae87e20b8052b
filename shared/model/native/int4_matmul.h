// int4 weight rows (ATen's packed CPU layout) times activations, for quantized.project and the C++ layers alike.
//
// The weights are a GGUF Q4_1 tensor's own blocks: per output row n and group g of 32 inputs, codes q in 0..15,
// an fp16 scale d and an fp16 min m, the weight being q * d + m (exactly the f32 checkpoint's value, both
// products exact in float). Why this kernel: a decode token reads ~66 MB of packed weights, and ATen's
// `_weight_int4pack_mm_for_cpu` turns them into products at about 10 GB/s on one thread, bound by its unpacking.
// Here a 64-row block is one stream of 32 bytes per input k (ATen's layout: byte j holds row j in its low nibble,
// row j + 32 in its high) and the dequantization leaves the inner loop:
//
//   t = sum over the pairs (k, k + 1) of g, in order, of x[k + 1] q[n, k + 1], then x[k] q[n, k]  (fused, float)
//   acc = fma(m[g, n], xsum[g], fma(d[g, n], t, acc))                          (groups in order)
//   out[m, n] = acc                                                            (float32: no rounding of the sum)
//
// xsum[g] is x summed over g. Float32 activations are multiplied as they are (fused multiply-adds, a float code
// per nibble by permute). Bfloat16 activations take AVX512-BF16's `vdpbf16ps` where the CPU has it (and VBMI's
// byte permute, which lays a pair's two nibbles side by side): a pair of inputs costs 4 of those, 2 byte and 4
// word permutes and 2 shifts for 64 rows. quantized.ACTIVATIONS says which the runner passes, and why.
//
// An output depends on its own row and column only, never on the call's rows or threads: batch-invariant, as
// the quantized path must be. Wherever the extension is built every int4 product in the process comes from
// here (the reference model's QuantizedLinear, the Python runner and the C++ layers), so they agree bit for
// bit; a weight whose rows are not whole 64-row blocks goes to ATen's kernel in float32.

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
constexpr int64_t kGroup = 32;  // inputs per scale and min (quantized.GROUP)
constexpr int kRowsAtOnce = 4;  // activation rows sharing one unpacking of the weights

inline bool takes(const at::Tensor& weight, const at::Tensor& scales) {
  return weight.size(0) % kBlock == 0 && scales.size(0) * kGroup == weight.size(1) * 2;
}

// per activation row, each group's sum of its inputs, in k order
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
// acc += scale * t + min * xsum for one group of M rows' sums t over a 64-row block (group_pairs: the group's
// (scale, min) fp16 pairs of the block's rows, the scale in the low half; xsum: each row's group sums, `groups` apart)
template <int M>
inline void add_group(const __m512 (&t)[M][4], const uint32_t* group_pairs, const float* xsum, int64_t groups,
                      __m512 (&acc)[M][4]) {
  for (int c = 0; c < 4; ++c) {
    // 16 rows' (scale, min) pairs, each half an fp16 widened exactly
    const __m512i pair = _mm512_loadu_si512(group_pairs + c * 16);
    const __m512 scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pair));
    const __m512 zero = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
    for (int m = 0; m < M; ++m) {
      acc[m][c] = _mm512_fmadd_ps(scale, t[m][c], acc[m][c]);
      acc[m][c] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[m * groups]), acc[m][c]);
    }
  }
}

// M float activation rows against one 64-row block: out[m][0..63], one input at a time
template <int M>
inline void block_rows(const float* x, const float* xsum, int64_t in, const uint8_t* packed, const uint32_t* pairs,
                       int64_t out_features, float (*out)[kBlock]) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t groups = in / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(pairs + (g + 2) * out_features + c * 16), _MM_HINT_T0);
    __m512 t[M][4];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < 4; ++c) t[m][c] = _mm512_setzero_ps();
    for (int64_t input = g * kGroup; input < (g + 1) * kGroup; ++input) {
      const int64_t k = input ^ 1;  // k + 1, then k: the pair order
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
    add_group<M>(t, pairs + g * out_features, xsum + g, groups, acc);
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out[m] + c * 16, acc[m][c]);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define INT4MM_PAIRS 1
// vdpbf16ps's operands, built once: the bfloat16 codes of q = 0..15, twice (a word permute reads five
// index bits; the fifth is the high nibble's lowest), and the byte picks that put a pair's bytes side by side:
// lane j's low word gets byte j of input k, its high word byte j of input k + 1 (rows j, j + 32 in their nibbles)
struct PairTables {
  alignas(64) uint16_t codes[32];
  alignas(64) uint8_t first_rows[64];  // bytes 0-15 of both inputs: rows 0-15 and 32-47
  alignas(64) uint8_t second_rows[64];  // bytes 16-31: rows 16-31 and 48-63
};

inline const PairTables& pair_tables() {
  static const PairTables tables = [] {
    PairTables t{};
    for (int e = 0; e < 32; ++e) {
      const float code = static_cast<float>(e % 16);
      uint32_t bits;
      std::memcpy(&bits, &code, sizeof bits);
      t.codes[e] = static_cast<uint16_t>(bits >> 16);  // exact: a small integer's float has a zero low half
    }
    for (int j = 0; j < 16; ++j) {
      t.first_rows[4 * j] = j, t.first_rows[4 * j + 2] = 32 + j;
      t.second_rows[4 * j] = 16 + j, t.second_rows[4 * j + 2] = 48 + j;
    }
    return t;
  }();
  return tables;
}

// M activation rows against one 64-row block, a pair of inputs at a time (xpairs: each row's bfloat16 inputs
// k, k + 1 as one 32-bit word, k in the low half)
template <int M>
inline void block_rows_pairs(const uint32_t* xpairs, const float* xsum, int64_t in, const uint8_t* packed,
                             const uint32_t* pairs, int64_t out_features, float (*out)[kBlock]) {
  const PairTables& tables = pair_tables();
  const __m512i codes = _mm512_load_si512(tables.codes);
  const __m512i first_rows = _mm512_load_si512(tables.first_rows), second_rows = _mm512_load_si512(tables.second_rows);
  const __mmask64 low_bytes = 0x5555555555555555ULL;  // bytes 0 and 2 of each lane; the others zeroed
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t groups = in / kGroup, pairs_in = in / 2;
  for (int64_t g = 0; g < groups; ++g) {
    for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(pairs + (g + 2) * out_features + c * 16), _MM_HINT_T0);
    __m512 t[M][4];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < 4; ++c) t[m][c] = _mm512_setzero_ps();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 2) {
      const uint8_t* bytes = packed + k * (kBlock / 2);  // inputs k and k + 1: 64 bytes, one line
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + 4096, _MM_HINT_T0);
      const __m512i both = _mm512_loadu_si512(bytes);
      const __m512i first = _mm512_maskz_permutexvar_epi8(low_bytes, first_rows, both);
      const __m512i second = _mm512_maskz_permutexvar_epi8(low_bytes, second_rows, both);
      // rows 0-15, 16-31 (low nibbles), 32-47, 48-63 (high nibbles): lane j holds its row's two codes
      const __m512i w[4] = {_mm512_permutexvar_epi16(first, codes), _mm512_permutexvar_epi16(second, codes),
                            _mm512_permutexvar_epi16(_mm512_srli_epi16(first, 4), codes),
                            _mm512_permutexvar_epi16(_mm512_srli_epi16(second, 4), codes)};
      for (int m = 0; m < M; ++m) {
        const __m512bh xk = (__m512bh)_mm512_set1_epi32(static_cast<int>(xpairs[m * pairs_in + k / 2]));
        for (int c = 0; c < 4; ++c) t[m][c] = _mm512_dpbf16_ps(t[m][c], xk, (__m512bh)w[c]);
      }
    }
    add_group<M>(t, pairs + g * out_features, xsum + g, groups, acc);
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
      for (int64_t input = g * kGroup; input < (g + 1) * kGroup; ++input) {
        const int64_t k = input ^ 1;  // k + 1, then k: the pair order
        const int code = (packed[k * (kBlock / 2) + byte] >> shift) & 0xF;
        t = std::fma(x[k], static_cast<float>(code), t);
      }
      const uint32_t pair = pairs[g * out_features + row];
      const float scale = static_cast<float>(c10::Half(static_cast<uint16_t>(pair & 0xFFFFu), c10::Half::from_bits()));
      const float zero = static_cast<float>(c10::Half(static_cast<uint16_t>(pair >> 16), c10::Half::from_bits()));
      acc = std::fma(zero, xsum[g], std::fma(scale, t, acc));
    }
    out[row] = acc;
  }
}

// ATen's kernel for a weight the blocks here do not cover: its codes are q - 8, so its zero is min + 8 * scale
inline at::Tensor aten_matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  const at::Tensor wide = scales.to(at::kFloat);  // [groups, N, 2]
  const at::Tensor scale = wide.select(2, 0), low = wide.select(2, 1);
  const at::Tensor aten_scales = at::stack({scale, low + 8 * scale}, 2).contiguous();
  return at::_weight_int4pack_mm_for_cpu(x.to(at::kFloat).contiguous(), weight, x.size(1) / scales.size(0), aten_scales);
}

// x [M, K] float32 (multiplied as it is) or bfloat16, weight packed by _convert_weight_to_int4pack_for_cpu
// [N, K / 2], scales and mins fp16 [K / 32, N, 2] -> float [M, N]
inline at::Tensor matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2, "weight: packed int4, uint8 [N, K / 2]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(1) == weight.size(0) &&
                  scales.size(2) == 2,
              "scales: float16 [groups, N, 2]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * weight.size(1), "x: [M, K] with the weight's K");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scales.device().is_cpu(), "tensors on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(scales.size(0) * kGroup == x.size(1), "scales: one group per 32 inputs");
  if (!takes(weight, scales)) return aten_matmul(x, weight, scales);
  const bool bf16_inputs = x.scalar_type() == at::kBFloat16;
  const std::vector<float> widened = bf16rows::widened(x);  // [M, K]
  const at::Tensor packed_tensor = weight.contiguous(), pairs_tensor = scales.contiguous();
  const int64_t batch = x.size(0), out_features = weight.size(0), in = x.size(1);
  at::Tensor out = at::empty({batch, out_features}, x.options().dtype(at::kFloat));
  const float* xs = widened.data();
  const std::vector<float> sums = group_sums(xs, batch, in);
#if defined(INT4MM_PAIRS)
  std::vector<uint32_t> xpairs(bf16_inputs ? batch * in / 2 : 0);  // [M, K / 2]: inputs 2i, 2i + 1 as bfloat16
  for (int64_t i = 0; i < static_cast<int64_t>(xpairs.size()); ++i) {
    uint32_t even, odd;  // a bfloat16 widened is its float's high half, exactly
    std::memcpy(&even, xs + 2 * i, sizeof even);
    std::memcpy(&odd, xs + 2 * i + 1, sizeof odd);
    xpairs[i] = (even >> 16) | (odd & 0xFFFF0000u);
  }
#endif
  const uint8_t* packed = packed_tensor.data_ptr<uint8_t>();
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(pairs_tensor.data_ptr<c10::Half>());
  float* o = out.data_ptr<float>();
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
#if defined(INT4MM_PAIRS)
        if (bf16_inputs) {
          const uint32_t* x_pairs = xpairs.data() + m * (in / 2);
          switch (count) {
          case 4: block_rows_pairs<4>(x_pairs, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          case 3: block_rows_pairs<3>(x_pairs, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          case 2: block_rows_pairs<2>(x_pairs, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          default: block_rows_pairs<1>(x_pairs, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          }
        } else
#endif
#if defined(__AVX512F__)
        {
          switch (count) {
          case 4: block_rows<4>(x_rows, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          case 3: block_rows<3>(x_rows, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          case 2: block_rows<2>(x_rows, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          default: block_rows<1>(x_rows, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          }
        }
#else
        for (int64_t r = 0; r < count; ++r)
          block_rows_scalar(x_rows + r * in, x_sums + r * groups, in, block_bytes, block_pairs, out_features, rows[r]);
#endif
        for (int64_t r = 0; r < count; ++r)
          for (int64_t n = 0; n < kBlock; ++n) o[(m + r) * out_features + block * kBlock + n] = rows[r][n];
      }
    }
  });
  return out;
}

}  // namespace int4mm
