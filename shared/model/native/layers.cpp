// The runner's int4/int8 decoder layers over packed sessions (causal chains and tree rows), in C++.
//
// Why: at int4 a decode token is about half matmul and half small operations (norms, rotary, casts,
// views, attention's pieces), each paying 2-3 us of Python and dispatch. These functions call the very
// same ATen operations, in the same order, as shared/model/layers.py, attention.py and
// invariant_attention.py do for this case, so every result is the same bits; only the interpreter
// between them is gone (about 0.9 us per operation instead of 2.6, measured here).
//
// The Python runner stays the reference and the fallback (dense weights, other devices, or a machine where
// this file was not built); tests/test_native_layers.py checks the two bit for bit.

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace {

constexpr int64_t kChunk = 32;  // invariant_attention.CHUNK

struct Projection {
  at::Tensor weight;                 // int8 [out, in] or packed int4 [out, in / 2]
  at::Tensor scales;                 // int8: [out]; int4: [in / group, out, 2]
  std::optional<at::Tensor> bias;    // [out]

  // quantized.project: the input rounded to the scales' dtype, the packed kernel, back to x's dtype
  at::Tensor operator()(const at::Tensor& x) const {
    // x: [T, in] -> [T, out]
    const int64_t in = x.size(-1);
    at::Tensor flat = x.reshape({-1, in}).to(scales.scalar_type());
    at::Tensor out = weight.scalar_type() == at::kChar
                         ? at::_weight_int8pack_mm(flat, weight, scales)
                         : at::_weight_int4pack_mm_for_cpu(flat, weight, in / scales.size(0), scales);
    out = out.view({x.size(0), weight.size(0)}).to(x.scalar_type());
    return bias.has_value() ? out + *bias : out;
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;  // RMSNorm gains [H]
  double input_eps, post_eps;
  Projection qkv, o, gate_up, down;
  int64_t num_q_heads, num_kv_heads, head_dim;
  double scaling;
};

// layers.rms_norm: normalised in float32, rounded to x's dtype, then scaled
at::Tensor rms_norm(const at::Tensor& gain, const at::Tensor& x, double eps) {
  return gain * at::rms_norm(x.to(at::kFloat), {x.size(-1)}, std::nullopt, eps).to(x.scalar_type());
}

// attention.rotate: HF's formula on [heads, T, D]
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  return x * cos + at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1) * sin;
}

// invariant_attention._halve_in_place: the fixed pairwise tree over [P, ...], P a power of two
at::Tensor halve_in_place(at::Tensor parts) {
  int64_t count = parts.size(0);
  while (count > 1) {
    count /= 2;
    parts.slice(0, 0, count).add_(parts.slice(0, count, 2 * count));
  }
  return parts.select(0, 0);
}

int64_t next_power_of_two(int64_t n) {  // 1 << (n - 1).bit_length()
  int64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// invariant_attention._chunk_products: probs [X, M, N] and values [X, N, D] -> out [N / CHUNK, X, D, M], the
// values^T @ probs^T of each CHUNK positions
void chunk_products(const at::Tensor& probs, const at::Tensor& values, const at::Tensor& out) {
  const int64_t batch = probs.size(0), rows = probs.size(1), chunks = probs.size(2) / kChunk;
  const int64_t head_dim = values.size(-1);
  at::Tensor chunk_probs = probs.view({batch, rows, chunks, kChunk}).permute({2, 0, 3, 1}).reshape({-1, kChunk, rows});
  at::Tensor chunk_values =
      values.reshape({batch, chunks, kChunk, head_dim}).transpose(0, 1).reshape({-1, kChunk, head_dim});
  at::Tensor target = out.view({-1, head_dim, rows});
  at::bmm_out(target, chunk_values.mT(), chunk_probs);
}

// invariant_attention.attend for one block: queries [B, Hkv, G, n, D], keys/values [B, Hkv, N, D],
// bias broadcastable to [B, Hkv, G, n, N] -> a [B, Hkv, G, n, D] view
at::Tensor attend(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& bias,
                  double scale) {
  const int64_t batch = queries.size(0), heads = queries.size(1), groups = queries.size(2), rows = queries.size(3),
                head_dim = queries.size(4);
  const int64_t width = keys.size(-2), flat = batch * heads, columns = groups * rows;
  at::Tensor scores_t = at::bmm(keys.flatten(0, 1), queries.reshape({flat, columns, head_dim}).mT());  // [X, N, M]
  at::Tensor logits = queries.new_empty({batch, heads, groups, rows, width});
  at::add_out(logits, bias, scores_t.mT().view(logits.sizes()), scale);
  at::Tensor probs = at::softmax(logits.view({flat, columns, width}), -1);  // [X, M, N]
  const int64_t chunks = width / kChunk;
  at::Tensor parts = queries.new_zeros({next_power_of_two(chunks), flat, head_dim, columns});  // [P, X, D, M]
  chunk_products(probs, values.flatten(0, 1), parts.slice(0, 0, chunks));
  at::Tensor out = halve_in_place(parts).view({batch, heads, head_dim, groups, rows});
  return out.permute({0, 1, 3, 4, 2});
}

// invariant_attention.attend_paths: tree rows that see cache positions 0..shared-1, then their own rows of the
// cache (`tails`, [n, Nt]) in order. queries [Hkv, G, n, D]; keys/values: the session's cache [Hkv, L, D];
// bias [n, shared + Nt] -> [Hkv, G, n, D]
at::Tensor attend_paths(const at::Tensor& queries, const at::Tensor& keys, const at::Tensor& values, int64_t shared,
                        const at::Tensor& tails, const at::Tensor& bias, double scale) {
  TORCH_CHECK(shared % kChunk == 0 && tails.size(1) % kChunk == 0, "shared and tail positions in whole chunks");
  const int64_t heads = queries.size(0), groups = queries.size(1), rows = queries.size(2), head_dim = queries.size(3);
  const int64_t tail_width = tails.size(1);
  at::Tensor flat_tails = tails.reshape({-1});
  at::Tensor tail_keys = keys.index_select(1, flat_tails).view({heads * rows, tail_width, head_dim});  // [Hkv n, Nt, D]
  at::Tensor tail_values = values.index_select(1, flat_tails).view({heads * rows, tail_width, head_dim});
  at::Tensor row_queries = queries.transpose(1, 2).reshape({heads * rows, groups, head_dim});  // [Hkv n, G, D]
  at::Tensor tail_scores =
      at::bmm(tail_keys, row_queries.mT()).view({heads, rows, tail_width, groups}).permute({0, 3, 1, 2});
  at::Tensor shared_scores =
      at::bmm(keys.slice(1, 0, shared), queries.reshape({heads, groups * rows, head_dim}).mT());  // [Hkv, shared, G n]
  at::Tensor scores = at::cat({shared_scores.mT().view({heads, groups, rows, shared}), tail_scores}, -1);
  at::Tensor probs = at::softmax(at::add(bias, scores, scale), -1);  // [Hkv, G, n, shared + Nt]
  const int64_t shared_chunks = shared / kChunk, tail_chunks = tail_width / kChunk;
  at::Tensor parts = queries.new_zeros({next_power_of_two(shared_chunks + tail_chunks), heads, head_dim, groups, rows});
  if (shared_chunks > 0) {
    at::Tensor shared_out = parts.new_empty({shared_chunks, heads, head_dim, groups * rows});
    chunk_products(probs.slice(-1, 0, shared).reshape({heads, groups * rows, shared}), values.slice(1, 0, shared),
                   shared_out);
    parts.slice(0, 0, shared_chunks).copy_(shared_out.view({shared_chunks, heads, head_dim, groups, rows}));
  }
  at::Tensor tail_out = parts.new_empty({tail_chunks, heads * rows, head_dim, groups});
  at::Tensor tail_probs = probs.slice(-1, shared).permute({0, 2, 1, 3}).reshape({heads * rows, groups, tail_width});
  chunk_products(tail_probs, tail_values, tail_out);
  parts.slice(0, shared_chunks, shared_chunks + tail_chunks)
      .copy_(tail_out.view({tail_chunks, heads, rows, head_dim, groups}).permute({0, 1, 3, 4, 2}));
  return halve_in_place(parts).permute({0, 2, 3, 1});
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
                         const at::Tensor& sin) {
  // hidden: [T, H]
  const int64_t total = hidden.size(0), head_dim = layer.head_dim;
  const int64_t q_size = layer.num_q_heads * head_dim, kv_size = layer.num_kv_heads * head_dim;
  at::Tensor normed = rms_norm(layer.input_norm, hidden, layer.input_eps);
  std::vector<at::Tensor> qkv = layer.qkv(normed).split_with_sizes({q_size + kv_size, kv_size}, -1);
  at::Tensor turned = rotate(qkv[0].view({total, -1, head_dim}).transpose(0, 1), cos, sin);  // [Hq + Hkv, T, D]
  at::Tensor keys = turned.slice(0, layer.num_q_heads);                                      // [Hkv, T, D]
  at::Tensor values = qkv[1].view({total, -1, head_dim}).transpose(0, 1);                    // [Hkv, T, D]
  at::Tensor grouped = turned.slice(0, 0, layer.num_q_heads).view({layer.num_kv_heads, -1, total, head_dim});
  std::vector<at::Tensor> outs;  // [Hkv, G, n, D] per session with rows
  for (size_t s = 0; s < sessions.size(); ++s) {
    const SessionRows& rows = sessions[s];
    const int64_t n = rows.stop - rows.start;
    if (n == 0) continue;
    keys_of[s].slice(1, rows.past, rows.past + n).copy_(keys.slice(1, rows.start, rows.stop));
    values_of[s].slice(1, rows.past, rows.past + n).copy_(values.slice(1, rows.start, rows.stop));
    if (rows.tails.has_value()) {  // tails index rows anywhere in the cache, up to its new length
      const int64_t length = rows.past + n;
      outs.push_back(attend_paths(grouped.slice(2, rows.start, rows.stop), keys_of[s].slice(1, 0, length),
                                  values_of[s].slice(1, 0, length), rows.shared, *rows.tails, rows.biases[0],
                                  layer.scaling));
      continue;
    }
    at::Tensor own_keys = keys_of[s].unsqueeze(0), own_values = values_of[s].unsqueeze(0);
    at::Tensor queries = grouped.slice(2, rows.start, rows.stop).unsqueeze(0);  // [1, Hkv, G, n, D]
    std::vector<at::Tensor> blocks;
    for (size_t b = 0; b < rows.biases.size(); ++b) {
      const int64_t width = rows.widths[b];
      blocks.push_back(attend(queries.slice(-2, rows.block_starts[b], rows.block_stops[b]),
                              own_keys.slice(-2, 0, width), own_values.slice(-2, 0, width), rows.biases[b],
                              layer.scaling));
    }
    outs.push_back((blocks.size() == 1 ? blocks[0] : at::cat(blocks, -2)).select(0, 0));
  }
  at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs, 2);  // [Hkv, G, T, D]
  at::Tensor attended = hidden + layer.o(out.permute({2, 0, 1, 3}).reshape({total, -1}));
  std::vector<at::Tensor> gate_up = layer.gate_up(rms_norm(layer.post_norm, attended, layer.post_eps)).chunk(2, -1);
  return attended + layer.down(at::silu(gate_up[0]) * gate_up[1]);
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
    TORCH_CHECK(session.stop == session.start || (blocks > 0 && session.block_starts.size() == blocks &&
                                                  session.block_stops.size() == blocks && session.widths.size() == blocks),
                "one start, stop and width per block bias");
    rows = session.stop;
  }
  TORCH_CHECK(rows == hidden.size(0), "the sessions' rows add up to the packed rows");
  for (size_t l = 0; l < layers.size(); ++l) {
    hidden = layer_forward(*layers[l], hidden, &keys[l * count], &values[l * count], sessions, cos, sin);
  }
  return hidden;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Layer, std::shared_ptr<Layer>>(m, "Layer")
      .def(py::init([](at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps,
                       std::vector<std::optional<at::Tensor>> projections, int64_t num_q_heads, int64_t num_kv_heads,
                       int64_t head_dim, double scaling) {
             TORCH_CHECK(projections.size() == 12, "qkv, o, gate_up, down: weight, scales, bias each");
             auto projection = [&](size_t i) {
               TORCH_CHECK(projections[3 * i].has_value() && projections[3 * i + 1].has_value(),
                           "a quantized weight and its scales");
               return Projection{*projections[3 * i], *projections[3 * i + 1], projections[3 * i + 2]};
             };
             return std::make_shared<Layer>(Layer{input_norm, post_norm, input_eps, post_eps, projection(0),
                                                  projection(1), projection(2), projection(3), num_q_heads,
                                                  num_kv_heads, head_dim, scaling});
           }));
  py::class_<SessionRows>(m, "SessionRows")
      .def(py::init<int64_t, int64_t, int64_t, std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, int64_t, std::optional<at::Tensor>>(),
           py::arg("start"), py::arg("stop"), py::arg("past"), py::arg("biases"), py::arg("block_starts"),
           py::arg("block_stops"), py::arg("widths"), py::arg("shared") = 0, py::arg("tails") = py::none());
  m.attr("CHUNK") = kChunk;  // checked against invariant_attention.CHUNK when the build is loaded
  // the GIL is released for the pass, as torch's own kernels release it: the caller's event loop runs meanwhile
  m.def("run_layers", &run_layers, "decoder layers over packed sessions' causal rows, batch-invariant attention",
        py::call_guard<py::gil_scoped_release>());
}
