// The runner's int4/int8 decoder layers over packed sessions (causal chains and tree rows), in C++.
//
// Why: at int4 a decode token is about half matmul and half small operations (norms, rotary, casts,
// views, attention's pieces), each paying Python and dispatch around a few microseconds of work. Here the
// kernels whose results depend on their implementation stay ATen's own calls: RMSNorm's sum, SiLU (the int4
// and int8 products and the attention are this extension's own, int4_matmul.h, int8_matmul.h and
// attention.h, which the reference model calls too). The elementwise steps between them (squares, RMSNorm's
// scaling, rotary, residual adds, the cache writes) are plain loops computing the
// same IEEE float operations per element, built without fused multiply-adds. So every result is the bits
// of shared/model/layers.py, attention.py and invariant_attention.py for this case.
//
// The Python runner stays the reference and the fallback (dense weights, other devices, or a machine where
// this file was not built); tests/test_native_layers.py checks the two bit for bit.

#include <torch/extension.h>

#include "attention.h"
#include "int4_matmul.h"
#include "int8_matmul.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {


struct Projection {
  at::Tensor weight;                 // int8 [out, in] or packed int4 [out, in / 2]
  at::Tensor scales;                 // int8: float [out, in / group]; int4: fp16 [in / group, out, 2]
  std::optional<at::Tensor> bias;    // float [out]

  // quantized.project's packed kernel: x [T, in] float -> float [T, out]
  at::Tensor matmul(const at::Tensor& x) const {
    return weight.scalar_type() == at::kChar ? int8mm::matmul(x, weight, scales) : int4mm::matmul(x, weight, scales);
  }
};

// project()'s result, read element by element from the kernel's float output, then the bias
struct Product {
  const float* data;
  int64_t width;
  const float* bias;  // null: no bias (adding 0 would turn -0 into +0)

  Product(const at::Tensor& out, const Projection& projection)
      : data(out.data_ptr<float>()),
        width(out.size(1)),
        bias(projection.bias.has_value() ? projection.bias->data_ptr<float>() : nullptr) {}

  float operator()(int64_t row, int64_t column) const {
    const float value = data[row * width + column];
    return bias != nullptr ? value + bias[column] : value;
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;  // RMSNorm gains [H]
  double input_eps, post_eps;
  Projection qkv, o, gate_up, down;
  int64_t num_q_heads, num_kv_heads, head_dim;
  double scaling;
};

// Work tensors of one pass, made once and reused by every layer: hidden [T, H], the MLP's width I
struct Scratch {
  at::Tensor squares, sums, normed;  // float [T, H], float [T], float [T, H]
  at::Tensor queries, attended_in;   // float [Hq, T, D], float [T, Hq D]
  at::Tensor gate, mlp_in;           // float [T, I], float [T, I]
};

// layers.rms_norm in one sweep: gain * (x * rsqrt(mean(x^2) + eps)). The mean's sum is ATen's own (its
// summation order is the kernel's), the rest is elementwise IEEE float, so the bits are F.rms_norm's.
void rms_norm(const at::Tensor& gain, const at::Tensor& x, double eps, Scratch& scratch) {
  // x: [T, H] float -> scratch.normed: [T, H] float
  const int64_t rows = x.size(0), width = x.size(1);
  const float* in = x.data_ptr<float>();
  float* squares = scratch.squares.data_ptr<float>();
  for (int64_t i = 0; i < rows * width; ++i) squares[i] = in[i] * in[i];
  at::sum_out(scratch.sums, scratch.squares, {-1});
  const float* sums = scratch.sums.data_ptr<float>();
  const float* g = gain.data_ptr<float>();
  float* out = scratch.normed.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t) {
    const float scale = 1.0f / std::sqrt(sums[t] / static_cast<float>(width) + static_cast<float>(eps));
    for (int64_t h = 0; h < width; ++h) out[t * width + h] = g[h] * (in[t * width + h] * scale);
  }
}

// attention.rotate (HF's formula) of one element of a head: x * cos + rotate_half(x) * sin, as two rounded
// products and a sum (the build turns off contraction into fused multiply-adds)
inline float rotated(const Product& qkv, int64_t row, int64_t head_start, int64_t d, int64_t half, const float* cos,
                     const float* sin) {
  const float x = qkv(row, head_start + d);
  const float partner = d < half ? -qkv(row, head_start + d + half) : qkv(row, head_start + d - half);
  return x * cos[d] + partner * sin[d];
}

// One session's rows of a packed pass: rows start..stop-1, after `past` cached rows, attended block by
// block (invariant_attention.causal_blocks: each block's rows over the first `width` positions, with a bias)
struct SessionRows {
  int64_t start, stop, past;
  std::vector<at::Tensor> biases;  // [block rows, width] each: 0 where seen, -inf where not
  std::vector<int64_t> block_starts, block_stops, widths;
  int64_t shared = 0;                // tree rows: the first positions every row sees
  std::optional<at::Tensor> tails;   // tree rows: [n, Nt] the cache rows each sees after those; none for a chain
};

// One layer over packed sessions' causal rows (layers.decoder_layer_forward with attention.attention on an
// invariant plan). Every session is attended alone: rows do not depend on their call (that is the point of
// batch-invariant attention), so these are the bits of the Python runner's one padded call for them all.
// keys/values: this layer's cache of each session, holding at least its last block's width rows.
at::Tensor layer_forward(const Layer& layer, const at::Tensor& hidden, const at::Tensor* keys_of,
                         const at::Tensor* values_of, const std::vector<SessionRows>& sessions, const at::Tensor& cos,
                         const at::Tensor& sin, Scratch& scratch) {
  // hidden: [T, H] float, contiguous
  const int64_t total = hidden.size(0), width = hidden.size(1), head_dim = layer.head_dim, half = head_dim / 2;
  const int64_t q_heads = layer.num_q_heads, kv_heads = layer.num_kv_heads;
  rms_norm(layer.input_norm, hidden, layer.input_eps, scratch);
  const at::Tensor qkv_out = layer.qkv.matmul(scratch.normed);  // [T, (Hq + 2 Hkv) D]
  const Product qkv(qkv_out, layer.qkv);
  const float* cos_rows = cos.data_ptr<float>();  // [T, D]
  const float* sin_rows = sin.data_ptr<float>();
  float* queries = scratch.queries.data_ptr<float>();  // [Hq, T, D]
  for (int64_t h = 0; h < q_heads; ++h) {
    for (int64_t t = 0; t < total; ++t) {
      float* row = queries + (h * total + t) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d)
        row[d] = rotated(qkv, t, h * head_dim, d, half, cos_rows + t * head_dim, sin_rows + t * head_dim);
    }
  }
  at::Tensor grouped = scratch.queries.view({kv_heads, q_heads / kv_heads, total, head_dim});  // [Hkv, G, T, D]
  std::vector<at::Tensor> outs;  // [Hkv, G, n, D] per session with rows
  for (size_t s = 0; s < sessions.size(); ++s) {
    const SessionRows& rows = sessions[s];
    const int64_t n = rows.stop - rows.start;
    if (n == 0) continue;
    // this session's new keys (rotated) and values, written into its cache after the `past` rows it holds
    auto keys = keys_of[s].accessor<float, 3>();      // [Hkv, capacity, D]
    auto values = values_of[s].accessor<float, 3>();
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t key_start = (q_heads + h) * head_dim, value_start = (q_heads + kv_heads + h) * head_dim;
      for (int64_t t = rows.start; t < rows.stop; ++t) {
        const int64_t slot = rows.past + t - rows.start;
        for (int64_t d = 0; d < head_dim; ++d) {
          keys[h][slot][d] = rotated(qkv, t, key_start, d, half, cos_rows + t * head_dim, sin_rows + t * head_dim);
          values[h][slot][d] = qkv(t, value_start + d);
        }
      }
    }
    if (rows.tails.has_value()) {  // tails index rows anywhere in the cache, up to its new length
      const int64_t length = rows.past + n;
      outs.push_back(invariant::attend_paths(grouped.slice(2, rows.start, rows.stop), keys_of[s].slice(1, 0, length),
                                  values_of[s].slice(1, 0, length), rows.shared, *rows.tails, rows.biases[0],
                                  layer.scaling));
      continue;
    }
    at::Tensor own_keys = keys_of[s].unsqueeze(0), own_values = values_of[s].unsqueeze(0);
    at::Tensor session_queries = grouped.slice(2, rows.start, rows.stop).unsqueeze(0);  // [1, Hkv, G, n, D]
    std::vector<at::Tensor> blocks;
    for (size_t b = 0; b < rows.biases.size(); ++b) {
      const int64_t block_width = rows.widths[b];
      blocks.push_back(invariant::attend(session_queries.slice(-2, rows.block_starts[b], rows.block_stops[b]),
                              own_keys.slice(-2, 0, block_width), own_values.slice(-2, 0, block_width),
                              rows.biases[b], layer.scaling));
    }
    outs.push_back((blocks.size() == 1 ? blocks[0] : at::cat(blocks, -2)).select(0, 0));
  }
  // the heads side by side per row, for the output projection: [Hkv, G, T, D] -> [T, Hq D]
  const at::Tensor attended_heads = outs.size() == 1 ? outs[0] : at::cat(outs, 2);
  const auto heads = attended_heads.accessor<float, 4>();
  const int64_t groups = q_heads / kv_heads;
  float* attended_in = scratch.attended_in.data_ptr<float>();
  for (int64_t t = 0; t < total; ++t)
    for (int64_t h = 0; h < q_heads; ++h)
      for (int64_t d = 0; d < head_dim; ++d)
        attended_in[(t * q_heads + h) * head_dim + d] = heads[h / groups][h % groups][t][d];
  const at::Tensor o_out = layer.o.matmul(scratch.attended_in);
  const Product o(o_out, layer.o);
  at::Tensor attended = at::empty_like(hidden);  // hidden + attention
  const float* before = hidden.data_ptr<float>();
  float* after = attended.data_ptr<float>();
  for (int64_t t = 0; t < total; ++t)
    for (int64_t h = 0; h < width; ++h) after[t * width + h] = before[t * width + h] + o(t, h);
  // the MLP: silu(gate) * up into the down projection; silu is ATen's (its exp is the kernel's)
  rms_norm(layer.post_norm, attended, layer.post_eps, scratch);
  const at::Tensor gate_up_out = layer.gate_up.matmul(scratch.normed);
  const Product gate_up(gate_up_out, layer.gate_up);
  const int64_t inner = scratch.gate.size(1);
  float* gate = scratch.gate.data_ptr<float>();
  for (int64_t t = 0; t < total; ++t)
    for (int64_t j = 0; j < inner; ++j) gate[t * inner + j] = gate_up(t, j);
  at::silu_(scratch.gate);
  float* mlp_in = scratch.mlp_in.data_ptr<float>();
  for (int64_t t = 0; t < total; ++t)
    for (int64_t j = 0; j < inner; ++j) mlp_in[t * inner + j] = gate[t * inner + j] * gate_up(t, inner + j);
  const at::Tensor down_out = layer.down.matmul(scratch.mlp_in);
  const Product down(down_out, layer.down);
  at::Tensor out = at::empty_like(hidden);
  const float* residual = after;
  float* result = out.data_ptr<float>();
  for (int64_t t = 0; t < total; ++t)
    for (int64_t h = 0; h < width; ++h) result[t * width + h] = residual[t * width + h] + down(t, h);
  return out;
}

// A layer's shapes, checked once when its handle is made: every loop of layer_forward relies on them.
void check_layer(const Layer& layer) {
  TORCH_CHECK(layer.num_q_heads > 0 && layer.num_kv_heads > 0 && layer.num_q_heads % layer.num_kv_heads == 0,
              "head counts: positive, the query heads a multiple of the key/value heads");
  TORCH_CHECK(layer.head_dim > 0 && layer.head_dim % 2 == 0, "head_dim: positive and even (rotary halves)");
  TORCH_CHECK(layer.input_norm.dim() == 1 && layer.post_norm.sizes() == layer.input_norm.sizes(),
              "RMSNorm gains [H], both the same");
  const int64_t width = layer.input_norm.size(0);
  auto inputs = [](const Projection& p) { return p.weight.size(1) * (p.weight.scalar_type() == at::kChar ? 1 : 2); };
  const int64_t q_width = layer.num_q_heads * layer.head_dim, kv_width = layer.num_kv_heads * layer.head_dim;
  TORCH_CHECK(layer.qkv.weight.size(0) == q_width + 2 * kv_width && inputs(layer.qkv) == width,
              "qkv: [(Hq + 2 Hkv) D, H]");
  TORCH_CHECK(layer.o.weight.size(0) == width && inputs(layer.o) == q_width, "o: [H, Hq D]");
  TORCH_CHECK(inputs(layer.gate_up) == width && layer.gate_up.weight.size(0) % 2 == 0 &&
                  inputs(layer.down) == layer.gate_up.weight.size(0) / 2 && layer.down.weight.size(0) == width,
              "gate_up: [2 I, H], down: [H, I]");
  for (const Projection* p : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
    TORCH_CHECK(p->weight.dim() == 2 && p->weight.device().is_cpu() && p->scales.device().is_cpu(),
                "quantized weights and scales on the CPU");
    TORCH_CHECK(!p->bias.has_value() || (p->bias->dim() == 1 && p->bias->size(0) == p->weight.size(0) &&
                                         p->bias->device().is_cpu()),
                "a bias [out] on the CPU");
  }
}

// The layers in order over a packed pass. keys/values: layer-major, keys[l * sessions + s].
at::Tensor run_layers(const std::vector<std::shared_ptr<Layer>>& layers, at::Tensor hidden,
                      const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const std::vector<SessionRows>& sessions, const at::Tensor& cos, const at::Tensor& sin) {
  const size_t count = sessions.size();
  TORCH_CHECK(count > 0 && keys.size() == layers.size() * count && values.size() == keys.size(),
              "one key and one value cache per layer and session");
  int64_t rows = 0;
  for (const SessionRows& session : sessions) {
    const size_t blocks = session.biases.size();
    TORCH_CHECK(session.start == rows && session.stop >= session.start, "sessions' rows are packed in order");
    TORCH_CHECK(session.past >= 0, "a session's past rows are not negative");
    const int64_t n = session.stop - session.start;
    TORCH_CHECK(n == 0 || (blocks > 0 && session.block_starts.size() == blocks &&
                           session.block_stops.size() == blocks && session.widths.size() == blocks),
                "one start, stop and width per block bias");
    if (n > 0 && !session.tails.has_value()) {
      // a chain's blocks cover its rows in order, each block seeing at least its own rows' positions
      int64_t covered = 0;
      for (size_t b = 0; b < blocks; ++b) {
        TORCH_CHECK(session.block_starts[b] == covered && session.block_stops[b] > covered &&
                        session.block_stops[b] <= n,
                    "a chain's attention blocks cover its rows in order, each at least one row");
        TORCH_CHECK(session.widths[b] >= session.past + session.block_stops[b],
                    "a block's width reaches its last row's position");
        covered = session.block_stops[b];
      }
      TORCH_CHECK(covered == n, "a chain's attention blocks cover all its rows");
    }
    TORCH_CHECK(session.shared >= 0, "tree rows' shared positions are not negative");
    rows = session.stop;
  }
  TORCH_CHECK(rows == hidden.size(0), "the sessions' rows add up to the packed rows");
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2, "hidden: [T, H] float");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "float cos and sin");
  for (const at::Tensor& cache : keys) TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.dim() == 3, "float caches");
  for (const at::Tensor& cache : values) TORCH_CHECK(cache.scalar_type() == at::kFloat && cache.dim() == 3, "float caches");
  if (layers.empty() || rows == 0) return hidden;  // nothing to compute (and no attention output to join)
  TORCH_CHECK(hidden.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "tensors on the CPU");
  for (const at::Tensor& cache : keys) TORCH_CHECK(cache.device().is_cpu(), "caches on the CPU");
  for (const at::Tensor& cache : values) TORCH_CHECK(cache.device().is_cpu(), "caches on the CPU");
  const Layer& first = *layers.front();
  const int64_t width = hidden.size(1), q_width = first.num_q_heads * first.head_dim;
  const int64_t inner = first.down.weight.size(1) * (first.down.weight.scalar_type() == at::kChar ? 1 : 2);
  const at::TensorOptions floats = hidden.options();
  Scratch scratch{at::empty({rows, width}, floats),   at::empty({rows}, floats),
                  at::empty({rows, width}, floats),   at::empty({first.num_q_heads, rows, first.head_dim}, floats),
                  at::empty({rows, q_width}, floats), at::empty({rows, inner}, floats),
                  at::empty({rows, inner}, floats)};
  TORCH_CHECK(width == first.input_norm.size(0), "hidden: [T, H] with H the layers' width");
  for (size_t l = 0; l < layers.size(); ++l) {
    for (size_t s = 0; s < count; ++s) {  // the pass writes each session's new rows in place: room checked here
      const SessionRows& session = sessions[s];
      int64_t needed = session.past + session.stop - session.start;
      for (int64_t block_width : session.widths) needed = std::max(needed, block_width);
      for (const at::Tensor* cache : {&keys[l * count + s], &values[l * count + s]}) {
        TORCH_CHECK(cache->size(0) == layers[l]->num_kv_heads && cache->size(2) == layers[l]->head_dim &&
                        cache->size(1) >= needed,
                    "each cache [Hkv, capacity, D] with room for its session's past and new rows");
      }
    }
  }
  hidden = hidden.contiguous();
  const at::Tensor cos_rows = cos.contiguous(), sin_rows = sin.contiguous();
  TORCH_CHECK(cos_rows.size(0) == rows && cos_rows.size(1) == first.head_dim && sin_rows.sizes() == cos_rows.sizes(),
              "cos and sin: [T, D]");
  for (size_t l = 0; l < layers.size(); ++l) {
    hidden = layer_forward(*layers[l], hidden, &keys[l * count], &values[l * count], sessions, cos_rows, sin_rows,
                           scratch);
  }
  return hidden;
}

// split.OutputSubmodel's pass over float rows: the final RMSNorm (an HF RMSNorm's bits, as the layers' norms), then
// the int8 LM head's product: float logits.
// In Python its norm and the calls around the product cost a decode step about 0.15 ms, run cold.
at::Tensor head_forward(const at::Tensor& hidden, const at::Tensor& gain, double eps, const at::Tensor& weight,
                        const at::Tensor& scales) {
  TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.device().is_cpu(),
              "hidden: [T, H] float on the CPU");
  TORCH_CHECK(gain.scalar_type() == at::kFloat && gain.dim() == 1 && gain.size(0) == hidden.size(1),
              "a float RMSNorm gain [H]");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.size(1) == hidden.size(1),
              "an int8 head [V, H]");
  const at::Tensor rows = hidden.contiguous();
  const int64_t count = rows.size(0), width = rows.size(1);
  const at::TensorOptions floats = rows.options();
  Scratch scratch{at::empty({count, width}, floats), at::empty({count}, floats),
                  at::empty({count, width}, floats)};
  rms_norm(gain.contiguous(), rows, eps, scratch);
  return int8mm::matmul(scratch.normed, weight, scales);
}

// module.<name> as nn.Module.__getattr__ finds a registered parameter, buffer or submodule, read from its dicts
// (a borrowed reference), or null where it is none of those
PyObject* registered(PyObject* module, PyObject* name) {
  static PyObject* const kinds[3] = {PyUnicode_InternFromString("_parameters"), PyUnicode_InternFromString("_buffers"),
                                     PyUnicode_InternFromString("_modules")};
  if (module == nullptr) return nullptr;
  PyObject* attributes = PyObject_GenericGetDict(module, nullptr);  // a new reference, or null (error set)
  if (attributes == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  PyObject* found = nullptr;
  for (PyObject* kind : kinds) {
    PyObject* members = PyDict_GetItemWithError(attributes, kind);
    found = members != nullptr && PyDict_Check(members) ? PyDict_GetItemWithError(members, name) : nullptr;
    if (found != nullptr && found != Py_None) break;
    found = nullptr;
  }
  PyErr_Clear();
  Py_DECREF(attributes);  // the module's own dict: what it holds stays alive with the module
  return found;
}

// Whether each decoder layer's q_proj, gate_proj, o_proj and down_proj weights (in that order) still start at
// `addresses` (what fused.FusedLayer.is_current checks, for a whole layer range in one call). A pass makes this
// check before every use of its cached handles; in Python it cost about 0.3 ms of a decode step, run cold (the
// weights the step streams push the modules out of the caches).
bool weights_at(const std::vector<py::handle>& layers, const std::vector<int64_t>& addresses) {
  static PyObject* const names[7] = {
      PyUnicode_InternFromString("self_attn"), PyUnicode_InternFromString("mlp"),
      PyUnicode_InternFromString("q_proj"),    PyUnicode_InternFromString("gate_proj"),
      PyUnicode_InternFromString("o_proj"),    PyUnicode_InternFromString("down_proj"),
      PyUnicode_InternFromString("weight")};
  constexpr int kParent[4] = {0, 1, 0, 1}, kLinear[4] = {2, 3, 4, 5};
  if (addresses.size() != 4 * layers.size()) return false;
  for (size_t l = 0; l < layers.size(); ++l) {
    for (int p = 0; p < 4; ++p) {
      PyObject* weight = registered(registered(registered(layers[l].ptr(), names[kParent[p]]), names[kLinear[p]]), names[6]);
      if (weight == nullptr || !THPVariable_Check(weight)) return false;
      if (reinterpret_cast<int64_t>(THPVariable_Unpack(weight).data_ptr()) != addresses[4 * l + p]) return false;
    }
  }
  return true;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Layer, std::shared_ptr<Layer>>(m, "Layer")
      .def(py::init([](at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps,
                       std::vector<std::optional<at::Tensor>> projections, int64_t num_q_heads, int64_t num_kv_heads,
                       int64_t head_dim, double scaling) {
             TORCH_CHECK(projections.size() == 12, "qkv, o, gate_up, down: weight, scales, bias each");
             TORCH_CHECK(input_norm.scalar_type() == at::kFloat && post_norm.scalar_type() == at::kFloat,
                         "float RMSNorm gains");
             auto projection = [&](size_t i) {
               TORCH_CHECK(projections[3 * i].has_value() && projections[3 * i + 1].has_value(),
                           "a quantized weight and its scales");
               const bool int8 = projections[3 * i]->scalar_type() == at::kChar;
               TORCH_CHECK(projections[3 * i + 1]->scalar_type() == (int8 ? at::kFloat : at::kHalf),
                           "int8 weights with float scales, int4 with fp16 scales and mins");
               TORCH_CHECK(!projections[3 * i + 2].has_value() || projections[3 * i + 2]->scalar_type() == at::kFloat,
                           "a float bias");
               return Projection{*projections[3 * i], *projections[3 * i + 1], projections[3 * i + 2]};
             };
             Layer layer{input_norm,    post_norm,     input_eps,     post_eps,    projection(0), projection(1),
                         projection(2), projection(3), num_q_heads, num_kv_heads, head_dim,      scaling};
             check_layer(layer);
             return std::make_shared<Layer>(layer);
           }));
  py::class_<SessionRows>(m, "SessionRows")
      .def(py::init<int64_t, int64_t, int64_t, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, int64_t, std::optional<at::Tensor>>(),
           py::arg("start"), py::arg("stop"), py::arg("past"), py::arg("biases"), py::arg("block_starts"),
           py::arg("block_stops"), py::arg("widths"), py::arg("shared") = 0, py::arg("tails") = py::none());
  m.def("int8_matmul", &int8mm::matmul, "quantized.project's int8 product: sum over groups of scale * (x . w), float [M, N]",
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_matmul", &int4mm::matmul,
        "quantized.project's int4 product: sum over groups of scale * (x . q) + min * sum x, float [M, N]",
        py::call_guard<py::gil_scoped_release>());
  m.def("attend", &invariant::attend, "invariant_attention.attend: rows over keys at positions 0..N-1 with a bias",
        py::call_guard<py::gil_scoped_release>());
  m.def("attend_paths", &invariant::attend_paths,
        "invariant_attention.attend_paths: rows over a shared prefix, then their own cache rows",
        py::call_guard<py::gil_scoped_release>());
  m.def("head_forward", &head_forward, "OutputSubmodel's RMSNorm and int8 LM head: logits [T, V] float",
        py::call_guard<py::gil_scoped_release>());
  m.def("weights_at", &weights_at,
        "whether each layer's q_proj, gate_proj, o_proj, down_proj weights start at these addresses (4 per layer)");
  // the GIL is released for the pass, as torch's own kernels release it: the caller's event loop runs meanwhile
  m.def("run_layers", &run_layers, "decoder layers over packed sessions' causal rows, batch-invariant attention",
        py::call_guard<py::gil_scoped_release>());
}
