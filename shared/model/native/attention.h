// Batch-invariant attention as plain loops: each query row's result depends only on that row, the keys and
// values it sees, in order, and their bias, never on how many rows, keys or padding positions share the call.
//
// Why: torch's CPU attention blocks its work by the call's shape, so a row's last bits change with the
// batch; at int4/int8 those bits can flip a greedy token (invariant_attention.py). The torch version there
// gets invariance from small matmuls and a chunked sum, 10-15 ATen calls a layer, which cost a decode step
// about as much as its matmuls' memory traffic. Here, per row and in a fixed order:
//   score_j = sum over d, in order, of q[d] * k_j[d]        (each pair alone, whatever tile it sits in)
//   logit_j = score_j * scale + bias_j                       (bias 0, or -inf for a position not seen)
//   e_j = exp(logit_j - max logit) (exp_nonpositive), total = sum of e_j, per lane j % 16, then across lanes
//   out[d] = (sum over j in order of e_j * v_j[d]) / total
// A masked position gives e_j = 0 and adds exact zeros, so padding, wherever a call puts it, changes no bit.
// invariant_attention.attend / attend_paths call these wherever the extension is built, so the reference
// model and every runner in the process compute the same bits; the torch version is the fallback.

#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace invariant {

constexpr int64_t kTile = 16;  // keys per transposed tile: one vector register of floats on AVX-512
typedef float Lanes __attribute__((vector_size(kTile * sizeof(float))));

#if defined(__AVX512F__)
// 16 rows of 16 floats (`stride` apart) -> out[i]: element i of each row, row j in lane j. Moves, no arithmetic.
inline void transpose16(const float* rows, int64_t stride, Lanes* out) {
  __m512 r[16], t[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(rows + j * stride);
  for (int j = 0; j < 16; j += 2) {  // per 128-bit quarter q: rows j, j + 1 at elements 4q, 4q + 1 / 4q + 2, 4q + 3
    t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
  }
  for (int j = 0; j < 16; j += 4) {  // r[j + e], quarter q: rows j..j+3 at element 4q + e
    const __m512d a = _mm512_castps_pd(t[j]), b = _mm512_castps_pd(t[j + 1]);
    const __m512d c = _mm512_castps_pd(t[j + 2]), d = _mm512_castps_pd(t[j + 3]);
    r[j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[j + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[j + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int e = 0; e < 4; ++e) {  // element 4q + e: quarter q of r[e], r[4 + e], r[8 + e], r[12 + e], in order
    const __m512 low_a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x44), high_a = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xEE);
    const __m512 low_b = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x44);
    const __m512 high_b = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xEE);
    const __m512 columns[4] = {_mm512_shuffle_f32x4(low_a, low_b, 0x88), _mm512_shuffle_f32x4(low_a, low_b, 0xDD),
                               _mm512_shuffle_f32x4(high_a, high_b, 0x88), _mm512_shuffle_f32x4(high_a, high_b, 0xDD)};
    for (int q = 0; q < 4; ++q) std::memcpy(&out[4 * q + e], &columns[q], sizeof(Lanes));
  }
}
#endif

// scores [rows, count] of `rows` query rows (each head_dim floats, at queries[r]) against `count` key rows
// (each head_dim floats, key_stride apart), each dot product summed over d in order
inline void dot_scores(const std::vector<const float*>& queries, const float* keys, int64_t key_stride, int64_t count,
                       int64_t head_dim, float* scores) {
  // lanes as a vector type: the sums stay one per key and in d order (a loop over an array may instead be
  // vectorized along d, which reorders nothing here but runs the sums one lane at a time)
  const int64_t rows = static_cast<int64_t>(queries.size());
  std::vector<Lanes> tile(head_dim);  // [D] x kTile: the tile's keys, transposed (zeros past the last)
  for (int64_t start = 0; start < count; start += kTile) {
    const int64_t width = std::min(kTile, count - start);
    if (width < kTile) std::fill(tile.begin(), tile.end(), Lanes{});
    int64_t done = 0;  // head dims transposed 16 at a time in registers (a full tile), the rest one by one
#if defined(__AVX512F__)
    if (width == kTile) {
      for (; done + kTile <= head_dim; done += kTile) transpose16(keys + start * key_stride + done, key_stride, &tile[done]);
    }
#endif
    for (int64_t j = 0; j < width; ++j) {
      const float* key = keys + (start + j) * key_stride;
      for (int64_t d = done; d < head_dim; ++d) tile[d][j] = key[d];
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {  // four rows at once: four independent chains of additions in flight
      Lanes sums[4] = {};
      for (int64_t d = 0; d < head_dim; ++d)
        for (int64_t k = 0; k < 4; ++k) sums[k] += queries[r + k][d] * tile[d];
      for (int64_t k = 0; k < 4; ++k)
        for (int64_t j = 0; j < width; ++j) scores[(r + k) * count + start + j] = sums[k][j];
    }
    for (; r < rows; ++r) {
      Lanes sums = {};
      const float* query = queries[r];
      for (int64_t d = 0; d < head_dim; ++d) sums += query[d] * tile[d];
      for (int64_t j = 0; j < width; ++j) scores[r * count + start + j] = sums[j];
    }
  }
}

// e^x for x <= 0 in plain float operations, so a lane of a vector loop and a scalar epilogue give the same
// bits (a libm call may not): x = k ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial to r^7, scaled
// by 2^k through the exponent bits. Relative error about 2e-7; x below -87 (e^x < 2e-38) gives e^-87.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float k = (x * 1.44269504f + shifter) - shifter;
  const float r = (x - k * 0.693145752f) - k * 1.42860677e-6f;  // ln 2 split in a high and a low part
  float p = 1.98412698e-4f;
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k, k in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline Lanes load_lanes(const float* from, int64_t count, float past = 0.0f) {  // `past` after `count` floats
  Lanes lanes;
  if (count >= kTile) {
    std::memcpy(&lanes, from, sizeof lanes);  // one vector load
    return lanes;
  }
  for (int64_t lane = 0; lane < kTile; ++lane) lanes[lane] = lane < count ? from[lane] : past;
  return lanes;
}

// sum_j weights[j] * values[j][d] over j in order, d in [0, head_dim): the row's accumulators stay in
// registers for the head dims a model has (V vectors of kTile floats); any other head dim takes `generic`
template <int V>
inline void weighted_sum(const float* weights, const std::vector<const float*>& values, float* out) {
  Lanes sums[V] = {};
  for (size_t j = 0; j < values.size(); ++j) {
    const float weight = weights[j];
    if (weight == 0.0f) continue;  // it would add exact zeros
    for (int v = 0; v < V; ++v) sums[v] += weight * load_lanes(values[j] + v * kTile, kTile);
  }
  std::memcpy(out, sums, sizeof sums);
}

inline void weighted_sum_generic(const float* weights, const std::vector<const float*>& values, int64_t head_dim,
                                 float* out) {
  std::fill(out, out + head_dim, 0.0f);
  for (size_t j = 0; j < values.size(); ++j) {
    if (weights[j] == 0.0f) continue;
    for (int64_t d = 0; d < head_dim; ++d) out[d] += weights[j] * values[j][d];
  }
}

// One row's softmax-weighted values: logits [count] (scaled and biased; overwritten with the weights),
// value rows `values[j]` -> out [D]. The max and the weights' total are taken per lane (position j in lane
// j % kTile, zeros past the end) and then across lanes in a fixed order: a position's lane is the same in
// any call, and a masked position adds zero, so padding still changes no bit.
inline void weigh_values(float* logits, const std::vector<const float*>& values, int64_t head_dim, float* out) {
  const int64_t count = static_cast<int64_t>(values.size());
  constexpr float kNever = -std::numeric_limits<float>::infinity();
  Lanes tops = kNever - Lanes{};
  for (int64_t j = 0; j < count; j += kTile) {
    const Lanes chunk = load_lanes(logits + j, count - j, kNever);
    tops = tops > chunk ? tops : chunk;
  }
  float top = kNever;
  for (int64_t lane = 0; lane < kTile; ++lane) top = std::max(top, tops[lane]);
  if (top == kNever) {  // a row that sees nothing (padding rows of a batch): zeros
    std::fill(out, out + head_dim, 0.0f);
    return;
  }
  for (int64_t j = 0; j < count; ++j) logits[j] = logits[j] == kNever ? 0.0f : exp_nonpositive(logits[j] - top);
  Lanes totals = {};
  for (int64_t j = 0; j < count; j += kTile) totals += load_lanes(logits + j, count - j);
  float total = 0.0f;
  for (int64_t lane = 0; lane < kTile; ++lane) total += totals[lane];
  if (head_dim == 4 * kTile) {
    weighted_sum<4>(logits, values, out);
  } else if (head_dim == 8 * kTile) {
    weighted_sum<8>(logits, values, out);
  } else {
    weighted_sum_generic(logits, values, head_dim, out);
  }
  for (int64_t d = 0; d < head_dim; ++d) out[d] /= total;
}

// logits[j] = scores[j] * scale + bias[j * bias_stride]: each product rounded, then the bias added
inline void scale_and_bias(float* logits, const float* scores, int64_t count, float scale, const float* bias,
                           int64_t bias_stride) {
  for (int64_t j = 0; j < count; ++j) logits[j] = scores[j] * scale + bias[j * bias_stride];
}

// kv heads per thread at least: about 32k (row, key) pairs, so a decode step's attention stays on one thread
inline int64_t grain_for(int64_t pairs_per_head) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, pairs_per_head)); }

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, ": float on the CPU");
  TORCH_CHECK(t.size(-1) == 0 || t.stride(-1) == 1, name, ": rows contiguous in their last dim");
}

// invariant_attention.attend: queries [B, Hkv, G, n, D] over keys/values [B, Hkv, N, D], bias broadcastable to
// [B, Hkv, G, n, N] -> [B, Hkv, G, n, D]
inline at::Tensor attend(const at::Tensor& queries_in, const at::Tensor& keys, const at::Tensor& values,
                         const at::Tensor& bias_in, double scale) {
  TORCH_CHECK(queries_in.dim() == 5 && keys.dim() == 4 && values.sizes() == keys.sizes(),
              "queries [B, Hkv, G, n, D], keys and values [B, Hkv, N, D]");
  const int64_t batch = queries_in.size(0), heads = queries_in.size(1), groups = queries_in.size(2);
  const int64_t rows = queries_in.size(3), head_dim = queries_in.size(4), count = keys.size(2);
  TORCH_CHECK(keys.size(0) == batch && keys.size(1) == heads && keys.size(3) == head_dim,
              "keys [B, Hkv, N, D] matching the queries");
  const at::Tensor queries = queries_in.contiguous();
  check_rows(queries, "queries");
  check_rows(keys, "keys");
  check_rows(values, "values");
  const at::Tensor bias = bias_in.to(at::kFloat).expand({batch, heads, groups, rows, count});
  const float* bias_data = bias.data_ptr<float>();
  at::Tensor out = at::empty({batch, heads, groups, rows, head_dim}, queries.options());
  const float* q = queries.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // kv heads split between threads where there is enough work: each row is computed by one thread, by the
  // same code, so the split changes no bit
  at::parallel_for(0, batch * heads, grain_for(groups * rows * count), [&](int64_t begin, int64_t end) {
    std::vector<float> scores(groups * rows * count);
    std::vector<const float*> query_rows(groups * rows), value_rows(count);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / heads, h = unit % heads;
      const float* k = keys.data_ptr<float>() + b * keys.stride(0) + h * keys.stride(1);
      const float* v = values.data_ptr<float>() + b * values.stride(0) + h * values.stride(1);
      const int64_t first = unit * groups * rows;  // this kv head's query rows, [G, n] in order
      for (int64_t r = 0; r < groups * rows; ++r) query_rows[r] = q + (first + r) * head_dim;
      for (int64_t j = 0; j < count; ++j) value_rows[j] = v + j * values.stride(2);
      dot_scores(query_rows, k, keys.stride(2), count, head_dim, scores.data());
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t i = 0; i < rows; ++i) {
          float* logits = &scores[(g * rows + i) * count];
          const float* row_bias =
              bias_data + b * bias.stride(0) + h * bias.stride(1) + g * bias.stride(2) + i * bias.stride(3);
          scale_and_bias(logits, logits, count, static_cast<float>(scale), row_bias, bias.stride(4));
          weigh_values(logits, value_rows, head_dim, o + (first + g * rows + i) * head_dim);
        }
      }
    }
  });
  return out;
}

// invariant_attention.attend_paths: rows that see cache positions 0..shared-1, then their own cache rows
// (`tails` [n, Nt]) in order. queries [Hkv, G, n, D]; keys/values: the session's cache [Hkv, L, D];
// bias [n, shared + Nt] -> [Hkv, G, n, D]
inline at::Tensor attend_paths(const at::Tensor& queries_in, const at::Tensor& keys, const at::Tensor& values,
                               int64_t shared, const at::Tensor& tails_in, const at::Tensor& bias_in, double scale) {
  TORCH_CHECK(queries_in.dim() == 4 && keys.dim() == 3 && values.sizes() == keys.sizes(),
              "queries [Hkv, G, n, D], keys and values [Hkv, L, D]");
  const int64_t heads = queries_in.size(0), groups = queries_in.size(1), rows = queries_in.size(2);
  const int64_t head_dim = queries_in.size(3), length = keys.size(1);
  const at::Tensor tails = tails_in.to(at::kLong).contiguous();
  const int64_t tail_width = tails.size(1);
  TORCH_CHECK(keys.size(0) == heads && keys.size(2) == head_dim, "keys [Hkv, L, D] matching the queries");
  TORCH_CHECK(tails.dim() == 2 && tails.size(0) == rows, "tails [n, Nt]");
  TORCH_CHECK(0 <= shared && shared <= length, "the shared positions lie in the cache");
  const int64_t* tail_at = tails.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows * tail_width; ++i)
    TORCH_CHECK(0 <= tail_at[i] && tail_at[i] < length, "tail rows index the cache");
  const at::Tensor queries = queries_in.contiguous();
  check_rows(queries, "queries");
  check_rows(keys, "keys");
  check_rows(values, "values");
  const at::Tensor bias = bias_in.to(at::kFloat).expand({rows, shared + tail_width});
  const float* bias_data = bias.data_ptr<float>();
  at::Tensor out = at::empty({heads, groups, rows, head_dim}, queries.options());
  const float* q = queries.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t count = shared + tail_width;
  std::vector<float> shared_scores(groups * rows * shared), tail_scores(groups * tail_width), logits(count);
  std::vector<float> gathered(tail_width * head_dim);
  std::vector<const float*> query_rows(groups * rows), row_queries(groups), value_rows(count);
  for (int64_t h = 0; h < heads; ++h) {
    const float* k = keys.data_ptr<float>() + h * keys.stride(0);
    const float* v = values.data_ptr<float>() + h * values.stride(0);
    for (int64_t r = 0; r < groups * rows; ++r) query_rows[r] = q + (h * groups * rows + r) * head_dim;
    dot_scores(query_rows, k, keys.stride(1), shared, head_dim, shared_scores.data());
    for (int64_t j = 0; j < shared; ++j) value_rows[j] = v + j * values.stride(1);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < tail_width; ++j) {  // row i's own rows of the cache, gathered in order
        const int64_t at_row = tail_at[i * tail_width + j];
        std::copy(k + at_row * keys.stride(1), k + at_row * keys.stride(1) + head_dim, &gathered[j * head_dim]);
        value_rows[shared + j] = v + at_row * values.stride(1);
      }
      for (int64_t g = 0; g < groups; ++g) row_queries[g] = query_rows[g * rows + i];
      dot_scores(row_queries, gathered.data(), head_dim, tail_width, head_dim, tail_scores.data());
      for (int64_t g = 0; g < groups; ++g) {
        const float* row_bias = bias_data + i * bias.stride(0);
        scale_and_bias(logits.data(), &shared_scores[(g * rows + i) * shared], shared, static_cast<float>(scale),
                       row_bias, bias.stride(1));
        scale_and_bias(logits.data() + shared, &tail_scores[g * tail_width], tail_width, static_cast<float>(scale),
                       row_bias + shared * bias.stride(1), bias.stride(1));
        weigh_values(logits.data(), value_rows, head_dim, o + ((h * groups + g) * rows + i) * head_dim);
      }
    }
  }
  return out;
}

}  // namespace invariant
