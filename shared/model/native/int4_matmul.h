// int4 weight rows (ATen's packed CPU layout) times activations, for quantized.project and the C++ layers alike.
//
// The weights are a GGUF Q4_1 tensor's own blocks: per output row n and group g of 32 inputs, codes q in 0..15,
// an fp16 scale d and an fp16 min m, the weight being q * d + m (the f32 checkpoint's value exactly). The
// activations come as int16 codes c with a scale s per group (int16_rows.h). Then, per row n,
//
//   t[g] = sum over k in g of c[k] q[n, k]                       (an exact integer: < 32 * 32767 * 15 < 2^24)
//   acc = fma(m[g, n], s[g] sum(c over g), fma(d[g, n] s[g], t[g], acc))         (groups in order, float32)
//   out[m, n] = acc                                               (no rounding of the sum to a narrower type)
//
// Why this kernel: a decode token reads ~66 MB of packed weights, and ATen's `_weight_int4pack_mm_for_cpu` turns
// them into products at about 10 GB/s on one thread. Here a 64-row block is one stream of 32 bytes per input k
// (ATen's layout: byte j holds row j in its low nibble, row j + 32 in its high), and a pair of inputs (k, k + 1)
// costs, for 64 rows, 2 byte permutes (which lay a row's two bytes side by side in a 32-bit lane), 2 masks and 2
// shifts (the nibbles as 16-bit integers) and 4 `vpdpwssd` (VNNI: two 16-bit products added into each 32-bit
// lane; `vpmaddwd` and an add where the CPU has AVX-512 without VNNI). The sums are integers, so every path,
// the scalar one too, gives the same bits, and an output depends on its own row and column only, never on the
// call's rows or threads: batch-invariant, as the quantized path must be. Wherever the extension is built every
// int4 product in the process comes from here; a weight whose rows are not whole 64-row blocks goes to ATen's
// kernel in float32.

#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "int16_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define INT4MM_VECTOR 1
#endif

namespace int4mm {

constexpr int64_t kBlock = 64;  // rows per packed block (ATen's BLOCK_N): 32 bytes per input k
constexpr int64_t kGroup = int16rows::kGroup;  // inputs per scale and min (quantized.GROUP)
constexpr int kRowsAtOnce = 4;  // activation rows sharing one unpacking of the weights

inline bool takes(const at::Tensor& weight, const at::Tensor& scales) {
  return weight.size(0) % kBlock == 0 && scales.size(0) * kGroup == weight.size(1) * 2;
}

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

#if defined(INT4MM_VECTOR)
// the byte picks that put a pair's bytes side by side: lane j's low word gets byte j of input k, its high word
// byte j of input k + 1 (rows j and j + 32 in their nibbles)
struct PairTables {
  alignas(64) uint8_t first_rows[64];   // bytes 0-15 of both inputs: rows 0-15 and 32-47
  alignas(64) uint8_t second_rows[64];  // bytes 16-31: rows 16-31 and 48-63
};

inline const PairTables& pair_tables() {
  static const PairTables tables = [] {
    PairTables t{};
    for (int j = 0; j < 16; ++j) {
      t.first_rows[4 * j] = j, t.first_rows[4 * j + 2] = 32 + j;
      t.second_rows[4 * j] = 16 + j, t.second_rows[4 * j + 2] = 48 + j;
    }
    return t;
  }();
  return tables;
}

inline __m512i add_pair_products(__m512i sum, __m512i x, __m512i w) {  // sum + x[2i] w[2i] + x[2i+1] w[2i+1]
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(sum, x, w);
#else
  return _mm512_add_epi32(sum, _mm512_madd_epi16(x, w));
#endif
}

// M activation rows against one 64-row block: out[m][0..63]. xpairs: each row's int16 codes k, k + 1 as one
// 32-bit word; scales, sums: each row's group scales and scaled code sums, `groups` apart.
template <int M>
inline void block_rows(const uint32_t* xpairs, const float* scales, const float* sums, int64_t in,
                       const uint8_t* packed, const uint32_t* pairs, int64_t out_features, float (*out)[kBlock]) {
  const PairTables& tables = pair_tables();
  const __m512i first_rows = _mm512_load_si512(tables.first_rows), second_rows = _mm512_load_si512(tables.second_rows);
  const __mmask64 low_bytes = 0x5555555555555555ULL;  // bytes 0 and 2 of each lane; the others zeroed
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < 4; ++c) acc[m][c] = _mm512_setzero_ps();
  const int64_t groups = in / kGroup, pairs_in = in / 2;
  for (int64_t g = 0; g < groups; ++g) {
    for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(pairs + (g + 2) * out_features + c * 16), _MM_HINT_T0);
    __m512i t[M][4];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < 4; ++c) t[m][c] = _mm512_setzero_si512();
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; k += 2) {
      const uint8_t* bytes = packed + k * (kBlock / 2);  // inputs k and k + 1: 64 bytes, one line
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + 4096, _MM_HINT_T0);
      const __m512i both = _mm512_loadu_si512(bytes);
      const __m512i first = _mm512_maskz_permutexvar_epi8(low_bytes, first_rows, both);
      const __m512i second = _mm512_maskz_permutexvar_epi8(low_bytes, second_rows, both);
      // rows 0-15, 16-31 (low nibbles), 32-47, 48-63 (high nibbles): each word one row's code for k or k + 1
      const __m512i w[4] = {_mm512_and_si512(first, nibble), _mm512_and_si512(second, nibble),
                            _mm512_srli_epi16(first, 4), _mm512_srli_epi16(second, 4)};
      for (int m = 0; m < M; ++m) {
        const __m512i xk = _mm512_set1_epi32(static_cast<int>(xpairs[m * pairs_in + k / 2]));
        for (int c = 0; c < 4; ++c) t[m][c] = add_pair_products(t[m][c], xk, w[c]);
      }
    }
    for (int c = 0; c < 4; ++c) {
      // 16 rows' (scale, min) pairs, each half an fp16 widened exactly
      const __m512i pair = _mm512_loadu_si512(pairs + g * out_features + c * 16);
      const __m512 scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pair));
      const __m512 low = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
      for (int m = 0; m < M; ++m) {
        const __m512 step = _mm512_mul_ps(scale, _mm512_set1_ps(scales[m * groups + g]));
        acc[m][c] = _mm512_fmadd_ps(step, _mm512_cvtepi32_ps(t[m][c]), acc[m][c]);
        acc[m][c] = _mm512_fmadd_ps(low, _mm512_set1_ps(sums[m * groups + g]), acc[m][c]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out[m] + c * 16, acc[m][c]);
}
#endif

// the same sums one element at a time (a machine without AVX-512): the same integer sums, the same float steps
inline void block_rows_scalar(const int16_t* x, const float* scales, const float* sums, int64_t in,
                              const uint8_t* packed, const uint32_t* pairs, int64_t out_features, float* out) {
  const int64_t groups = in / kGroup;
  for (int64_t row = 0; row < kBlock; ++row) {
    const int64_t byte = row % 32, shift = row < 32 ? 0 : 4;
    float acc = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t t = 0;
      for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k)
        t += static_cast<int32_t>(x[k]) * ((packed[k * (kBlock / 2) + byte] >> shift) & 0xF);
      const uint32_t pair = pairs[g * out_features + row];
      const float scale = half_to_float(static_cast<uint16_t>(pair & 0xFFFFu));
      const float low = half_to_float(static_cast<uint16_t>(pair >> 16));
      acc = std::fma(scale * scales[g], static_cast<float>(t), acc);
      acc = std::fma(low, sums[g], acc);
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

// x [M, K] float32 or bfloat16, weight packed by _convert_weight_to_int4pack_for_cpu [N, K / 2], scales and mins
// fp16 [K / 32, N, 2] -> float [M, N]
inline at::Tensor matmul(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2, "weight: packed int4, uint8 [N, K / 2]");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(1) == weight.size(0) &&
                  scales.size(2) == 2,
              "scales: float16 [groups, N, 2]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 2 * weight.size(1), "x: [M, K] with the weight's K");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && scales.device().is_cpu(), "tensors on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(x.size(1) > 0 && scales.size(0) * kGroup == x.size(1), "scales: one group per 32 inputs, K > 0");
  if (!takes(weight, scales)) return aten_matmul(x, weight, scales);
  const int16rows::Rows rows_in = int16rows::quantized(x);
  const at::Tensor packed_tensor = weight.contiguous(), pairs_tensor = scales.contiguous();
  const int64_t batch = x.size(0), out_features = weight.size(0), in = x.size(1);
  at::Tensor out = at::empty({batch, out_features}, x.options().dtype(at::kFloat));
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
        const float* x_scales = rows_in.scales.data() + m * groups;
        const float* x_sums = rows_in.sums.data() + m * groups;
#if defined(INT4MM_VECTOR)
        const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(rows_in.codes.data() + m * in);
        switch (count) {
          case 4: block_rows<4>(x_pairs, x_scales, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          case 3: block_rows<3>(x_pairs, x_scales, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          case 2: block_rows<2>(x_pairs, x_scales, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
          default: block_rows<1>(x_pairs, x_scales, x_sums, in, block_bytes, block_pairs, out_features, rows); break;
        }
#else
        for (int64_t r = 0; r < count; ++r)
          block_rows_scalar(rows_in.codes.data() + (m + r) * in, x_scales + r * groups, x_sums + r * groups, in,
                            block_bytes, block_pairs, out_features, rows[r]);
#endif
        for (int64_t r = 0; r < count; ++r)
          for (int64_t n = 0; n < kBlock; ++n) o[(m + r) * out_features + block * kBlock + n] = rows[r][n];
      }
    }
  });
  return out;
}

}  // namespace int4mm
