// One decode forward of a small Llama in one call: each token a row of its own, attending to its
// context up to itself, every linear layer on amx_linear with a bfloat16 paged KV cache, or on
// small_linear (AVX2 + FMA) with a float32 one (`plain`: CPUs without AMX). This is a draft
// model's forward in the engine's step (executor/spec/draft.py, _decode_rows), and the model
// runner's in steps of one row a token that fit the kernels' rows (executor/fused_decoder.py:
// the built-in model at 1-8 requests in float32 on a 2-core AMD EPYC, 1.26-1.47x the output
// tokens/s through the modules). Through the Python modules the same
// forward (2 layers, hidden 128) took 0.20-0.27 ms at one request on a 2-core Xeon, of which its
// kernels are about 0.04 ms: the rest was the modules' calls; here 0.06 ms. The same kernels run
// in the same order on the same tensors, so the result is the modules' bit for bit. In float32 on
// an AVX2-only AMD EPYC, the modules' forward took 0.50 ms at 1-8 rows (start-up timing).
// An EAGLE head (executor/models/llama_eagle.py) is such a model too: `fc` before its one layer,
// which has no input norm, and no final norm; its drafts read features, the target's hidden states
// or its own outputs (small_eagle_draft).
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cmath>
#include <tuple>
#include <vector>

// the kernels of this extension's other files
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
void rotary(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping, c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales);
void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, int64_t block_size, double scale,
                            c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out);
torch::Tensor small_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out);
torch::Tensor argmax_rows(torch::Tensor logits);

namespace py = pybind11;

namespace {

// a decoder layer's weights: the norms' plain, the linears' laid out by pack_bf16_pairs for
// amx_linear (or by pack_small for small_linear); its caches. No input norm in an EAGLE head's layer
struct SmallLayer {
  torch::Tensor input_norm, qkv, o, post_norm, gate_up, down, k_cache, v_cache;
};

struct SmallLlama {
  torch::Tensor embed, final_norm, cos_sin;
  std::vector<SmallLayer> layers;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, hidden = 0, intermediate = 0;
  double eps = 0.0, scale = 0.0;
  // the drafts' LM head (laid out for amx_linear, head_out logits) and the token id of each
  // logit (a token map), if any: small_llama_draft's argmax
  torch::Tensor head, head_ids;
  int64_t head_out = 0;
  bool plain = false;  // the linears' weights are small_linear's (float32 x), not amx_linear's
  // an EAGLE head's [hidden, 2 x hidden] map of (embedding, features) to its layer's input; such a
  // model has no final norm (final_norm undefined): its output is the layer's plus the residual
  torch::Tensor fc;
};

// y = x W^T, `out` columns, on the model's linear kernel
torch::Tensor linear(const SmallLlama& m, const torch::Tensor& x, const torch::Tensor& w, int64_t out) {
  return m.plain ? small_linear(x, w, c10::nullopt, out) : amx_linear(x, w, c10::nullopt, out);
}

// LlamaForCausalLM.forward of n rows (ids, positions [n] int64), row i attending over block_table[i]
// [n, max_blocks] to seq_lens[i] tokens (int32, its own included: its request's row and its
// position + 1), the new K/V into slot_mapping [n] first: the final norm's output [n, hidden]. An
// EAGLE head's (EagleLlamaForCausalLM.forward) reads `features` [n, hidden] (zeros if none)
torch::Tensor small_llama_decode(const SmallLlama& m, torch::Tensor ids, torch::Tensor positions,
                                 torch::Tensor slot_mapping, torch::Tensor block_table, torch::Tensor seq_lens,
                                 int64_t block_size, c10::optional<torch::Tensor> features) {
  TORCH_CHECK(ids.dim() == 1 && positions.sizes() == ids.sizes() && slot_mapping.sizes() == ids.sizes() &&
                  seq_lens.size(0) == ids.size(0) && block_table.size(0) == ids.size(0),
              "small_llama_decode: one id, position, slot, block table row and length a request");
  const int64_t n = ids.size(0), q_size = m.heads * m.head_dim, kv_size = m.kv_heads * m.head_dim;
  torch::Tensor x = m.embed.index_select(0, ids), residual;
  if (m.fc.defined()) {
    TORCH_CHECK(!features.has_value() || (features->dim() == 2 && features->size(0) == n &&
                                          features->size(1) == m.hidden && features->dtype() == x.dtype()),
                "small_llama_decode: features must be [", n, ", ", m.hidden, "] of the model's dtype");
    x = linear(m, torch::cat({x, features.has_value() ? *features : torch::zeros_like(x)}, 1), m.fc, m.hidden);
  }
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const SmallLayer& layer = m.layers[i];
    torch::Tensor h;
    if (i == 0) {
      residual = x;
      h = layer.input_norm.defined() ? rms_norm(x, c10::nullopt, layer.input_norm, m.eps) : x;
    } else {
      h = rms_norm(x, residual, layer.input_norm, m.eps);  // residual += x
    }
    const torch::Tensor qkv = linear(m, h, layer.qkv, q_size + 2 * kv_size);
    const torch::Tensor q = qkv.narrow(1, 0, q_size).view({n, m.heads, m.head_dim});
    const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, m.kv_heads, m.head_dim});
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, m.kv_heads, m.head_dim});
    rotary(q, positions, m.cos_sin);
    rotary(k, positions, m.cos_sin);
    write_kv(k, v, layer.k_cache, layer.v_cache, slot_mapping, c10::nullopt, c10::nullopt);
    torch::Tensor attended = torch::empty({n, m.heads, m.head_dim}, qkv.options());
    paged_decode_attention(attended, q, layer.k_cache, layer.v_cache, block_table, seq_lens, block_size, m.scale,
                           c10::nullopt, c10::nullopt);
    const torch::Tensor o = linear(m, attended.view({n, q_size}), layer.o, m.hidden);
    h = rms_norm(o, residual, layer.post_norm, m.eps);  // residual += o
    const torch::Tensor gate_up = linear(m, h, layer.gate_up, 2 * m.intermediate);
    x = linear(m, silu_and_mul(gate_up), layer.down, m.hidden);
  }
  if (!m.final_norm.defined()) return x + residual;
  return rms_norm(x, residual, m.final_norm, m.eps);
}

// small_llama_decode of `ids` at `positions` (int64 [n]), row i attending over block_table[i]
// (int32 [n, max_blocks]) up to itself: the slots and the lengths come from the positions here, and
// the ids come as a list. `rows`: the output's rows kept (all if none). `name`: the caller's, for errors
torch::Tensor forward_at(const SmallLlama& m, const std::vector<int64_t>& ids, torch::Tensor positions,
                         torch::Tensor block_table, int64_t block_size, const c10::optional<torch::Tensor>& rows,
                         const c10::optional<torch::Tensor>& features, const char* name) {
  TORCH_CHECK(m.head.defined(), name, ": the model was built without a head");
  const int64_t n = static_cast<int64_t>(ids.size());
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 1 && positions.size(0) == n, name,
              ": positions must be int64 [", n, "], one an id");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.dim() == 2 && block_table.size(0) == n, name,
              ": block_table must be int32 [", n, ", max_blocks], one row an id");
  TORCH_CHECK(block_size > 0, name, ": block_size must be positive, got ", block_size);
  positions = positions.contiguous();
  block_table = block_table.contiguous();
  const int64_t width = block_table.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  torch::Tensor slots = torch::empty({n}, positions.options());
  torch::Tensor seq_lens = torch::empty({n}, block_table.options());
  int64_t* slot = slots.data_ptr<int64_t>();
  int32_t* len = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] / block_size < width, name, ": position ", pos[i],
                " is outside its block table row (", width, " blocks of ", block_size, ")");
    slot[i] = static_cast<int64_t>(table[i * width + pos[i] / block_size]) * block_size + pos[i] % block_size;
    len[i] = static_cast<int32_t>(pos[i] + 1);
  }
  const torch::Tensor id_tensor = torch::tensor(ids, positions.options());
  torch::Tensor hidden =
      small_llama_decode(m, id_tensor, positions, slots, block_table, seq_lens, block_size, features);
  if (rows.has_value() && rows->size(0) != n) hidden = hidden.index_select(0, *rows);
  return hidden;
}

// the drafts of `hidden`'s rows: the argmax of the head's logits (the first on ties), mapped to token
// ids by head_ids
std::vector<int64_t> head_argmax(const SmallLlama& m, const torch::Tensor& hidden) {
  if (hidden.size(0) == 0) return {};
  torch::Tensor best = argmax_rows(linear(m, hidden, m.head, m.head_out));
  if (m.head_ids.defined()) best = m.head_ids.index_select(0, best);
  const int64_t* b = best.data_ptr<int64_t>();
  return std::vector<int64_t>(b, b + best.size(0));
}

// forward_at, then the drafts at `rows` (all rows if none). At one request the head, the argmax and
// those steps took 25-45 us a forward in Python on a 2-core Xeon, where the forward itself is 60 us
std::vector<int64_t> small_llama_draft(const SmallLlama& m, const std::vector<int64_t>& ids, torch::Tensor positions,
                                       torch::Tensor block_table, int64_t block_size,
                                       c10::optional<torch::Tensor> rows) {
  return head_argmax(m, forward_at(m, ids, positions, block_table, block_size, rows, c10::nullopt,
                                   "small_llama_draft"));
}

// an EAGLE head's small_llama_draft over `features` [n, hidden]: the drafts at `rows` and the
// head's outputs there (the features of the drafts after them)
std::tuple<std::vector<int64_t>, torch::Tensor> small_eagle_draft(const SmallLlama& m, const std::vector<int64_t>& ids,
                                                                  torch::Tensor features, torch::Tensor positions,
                                                                  torch::Tensor block_table, int64_t block_size,
                                                                  c10::optional<torch::Tensor> rows) {
  TORCH_CHECK(m.fc.defined(), "small_eagle_draft: the model is not an EAGLE head (no fc)");
  torch::Tensor hidden = forward_at(m, ids, positions, block_table, block_size, rows, features, "small_eagle_draft");
  return {head_argmax(m, hidden), hidden};
}

// A step's later drafts in one call: request a (of n) makes ks[a] drafts in all, its first given
// (firsts[a], to be written at positions[a], int64 [n]) over its block_table row (int32 [n,
// max_blocks]); forward j (j = 1, 2, ...) feeds each request with more than j drafts its draft j at
// positions[a] + j - 1, and the argmax of its head gives draft j + 1. An EAGLE head's draft 1 reads
// features[a] ([n, hidden], its output for the first draft), a later one its own output for the
// one before. Each forward is the one small_llama_draft / small_eagle_draft would run over those
// rows (a row's result does not depend on the rows beside it), without a return to Python between
// them: through Python each cost 0.05-0.08 ms more at one request of the built-in model (2-core AMD
// EPYC). Each request's drafts after its first
std::vector<std::vector<int64_t>> small_draft_chain(const SmallLlama& m, const std::vector<int64_t>& firsts,
                                                    torch::Tensor positions, torch::Tensor block_table,
                                                    int64_t block_size, const std::vector<int64_t>& ks,
                                                    c10::optional<torch::Tensor> features) {
  const int64_t n = static_cast<int64_t>(firsts.size());
  TORCH_CHECK(static_cast<int64_t>(ks.size()) == n && positions.scalar_type() == torch::kInt64 &&
                  positions.dim() == 1 && positions.size(0) == n && block_table.dim() == 2 &&
                  block_table.size(0) == n,
              "small_draft_chain: one first draft, count of drafts, position and block table row a request");
  TORCH_CHECK(m.fc.defined() == features.has_value(),
              "small_draft_chain: features for an EAGLE head (a model with fc), for no other model");
  std::vector<std::vector<int64_t>> drafts(n);
  std::vector<int64_t> active(n);
  for (int64_t a = 0; a < n; ++a) active[a] = a;
  c10::optional<torch::Tensor> feats = features;
  const auto index = positions.options();
  for (int64_t j = 1;; ++j) {
    std::vector<int64_t> keep, rows, ids;  // of `active`, the requests they are, their tokens
    for (size_t i = 0; i < active.size(); ++i) {
      const int64_t a = active[i];
      if (ks[a] > j) {
        keep.push_back(static_cast<int64_t>(i));
        rows.push_back(a);
        ids.push_back(j == 1 ? firsts[a] : drafts[a].back());
      }
    }
    if (rows.empty()) break;
    const torch::Tensor at = torch::tensor(rows, index);
    if (feats.has_value() && static_cast<int64_t>(keep.size()) != feats->size(0))
      feats = feats->index_select(0, torch::tensor(keep, index));
    const torch::Tensor hidden = forward_at(m, ids, positions.index_select(0, at) + (j - 1),
                                            block_table.index_select(0, at), block_size, c10::nullopt, feats,
                                            "small_draft_chain");
    const std::vector<int64_t> next = head_argmax(m, hidden);
    for (size_t i = 0; i < rows.size(); ++i) drafts[rows[i]].push_back(next[i]);
    if (feats.has_value()) feats = hidden;
    active = rows;
  }
  return drafts;
}

}  // namespace

// The forwards release the GIL while they run (a step's whole forward, 0.2-10 ms, as torch's own
// ops release it): a server's event loop keeps answering and streaming while the engine's thread
// is in the call
void bind_small_decode(py::module& m) {
  py::class_<SmallLayer>(m, "SmallLayer")
      .def(py::init([](c10::optional<torch::Tensor> input_norm, torch::Tensor qkv, torch::Tensor o,
                       torch::Tensor post_norm, torch::Tensor gate_up, torch::Tensor down, torch::Tensor k_cache,
                       torch::Tensor v_cache) {
             return SmallLayer{input_norm.value_or(torch::Tensor()), qkv, o, post_norm, gate_up, down, k_cache,
                               v_cache};
           }),
           py::arg("input_norm"), py::arg("qkv"), py::arg("o"), py::arg("post_norm"), py::arg("gate_up"),
           py::arg("down"), py::arg("k_cache"), py::arg("v_cache"));
  py::class_<SmallLlama>(m, "SmallLlama")
      .def(py::init([](torch::Tensor embed, c10::optional<torch::Tensor> final_norm, torch::Tensor cos_sin,
                       std::vector<SmallLayer> layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t intermediate, double eps, double scale, c10::optional<torch::Tensor> head,
                       int64_t head_out, c10::optional<torch::Tensor> head_ids, bool plain,
                       c10::optional<torch::Tensor> fc) {
             TORCH_CHECK(final_norm.has_value() != fc.has_value(),
                         "SmallLlama: a final norm (a Llama) or fc (an EAGLE head), one of them");
             SmallLlama s{embed, final_norm.value_or(torch::Tensor()), cos_sin, std::move(layers)};
             if (fc.has_value()) s.fc = *fc;
             s.heads = heads, s.kv_heads = kv_heads, s.head_dim = head_dim, s.hidden = embed.size(1);
             s.intermediate = intermediate, s.eps = eps, s.scale = scale, s.plain = plain;
             if (head.has_value()) {
               TORCH_CHECK(head_out > 0, "SmallLlama: head_out must be the head's logits a row, got ", head_out);
               TORCH_CHECK(!head_ids.has_value() || (head_ids->dim() == 1 && head_ids->size(0) == head_out &&
                                                     head_ids->scalar_type() == torch::kInt64),
                           "SmallLlama: head_ids must be head_out (", head_out, ") int64 token ids");
               s.head = *head, s.head_out = head_out;
               if (head_ids.has_value()) s.head_ids = *head_ids;
             }
             return s;
           }),
           py::arg("embed"), py::arg("final_norm"), py::arg("cos_sin"), py::arg("layers"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"), py::arg("scale"),
           py::arg("head") = py::none(), py::arg("head_out") = 0, py::arg("head_ids") = py::none(),
           py::arg("plain") = false, py::arg("fc") = py::none());
  m.def("small_llama_decode", &small_llama_decode,
        "a small Llama's decode forward, one token a request, in one call (amx_linear layers and a bf16 cache, or "
        "small_linear ones and a float32 cache)",
        py::arg("model"), py::arg("ids"), py::arg("positions"), py::arg("slot_mapping"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("block_size"), py::arg("features") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("small_llama_draft", &small_llama_draft,
        "small_llama_decode (slots and lengths from the positions), then the argmax of the model's head at the "
        "given rows, as token ids",
        py::arg("model"), py::arg("ids"), py::arg("positions"), py::arg("block_table"), py::arg("block_size"),
        py::arg("rows") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("small_eagle_draft", &small_eagle_draft,
        "an EAGLE head's small_llama_draft over the given features: the drafts at the given rows and the head's "
        "outputs there",
        py::arg("model"), py::arg("ids"), py::arg("features"), py::arg("positions"), py::arg("block_table"),
        py::arg("block_size"), py::arg("rows") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("small_draft_chain", &small_draft_chain,
        "a step's later drafts in one call (small_llama_draft's or small_eagle_draft's forwards, one after another): "
        "each request's drafts after its first",
        py::arg("model"), py::arg("firsts"), py::arg("positions"), py::arg("block_table"), py::arg("block_size"),
        py::arg("ks"), py::arg("features") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
