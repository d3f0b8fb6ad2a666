// One decode forward of a small Llama in one call: each token a row of its own, attending to its
// context up to itself, every linear layer on amx_linear, a bfloat16 paged KV cache. This is the
// built-in draft model's forward in the engine's step (executor/spec/draft.py, _decode_rows) and
// in its start-up timing (executor/spec/fused_draft.py). Through the Python modules the same
// forward (2 layers, hidden 128) took 0.20-0.27 ms at one request on a 2-core Xeon, of which its
// kernels are about 0.04 ms: the rest was the modules' calls; here 0.06 ms. The same kernels run
// in the same order on the same tensors, so the result is the modules' bit for bit.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cmath>
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

namespace py = pybind11;

namespace {

// a decoder layer's weights: the norms' plain, the linears' laid out by pack_bf16_pairs; its caches
struct SmallLayer {
  torch::Tensor input_norm, qkv, o, post_norm, gate_up, down, k_cache, v_cache;
};

struct SmallLlama {
  torch::Tensor embed, final_norm, cos_sin;
  std::vector<SmallLayer> layers;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, hidden = 0, intermediate = 0;
  double eps = 0.0, scale = 0.0;
};

// LlamaForCausalLM.forward of n rows (ids, positions [n] int64), row i attending over block_table[i]
// [n, max_blocks] to seq_lens[i] tokens (int32, its own included: its request's row and its
// position + 1), the new K/V into slot_mapping [n] first: the final norm's output [n, hidden]
torch::Tensor small_llama_decode(const SmallLlama& m, torch::Tensor ids, torch::Tensor positions,
                                 torch::Tensor slot_mapping, torch::Tensor block_table, torch::Tensor seq_lens,
                                 int64_t block_size) {
  TORCH_CHECK(ids.dim() == 1 && positions.sizes() == ids.sizes() && slot_mapping.sizes() == ids.sizes() &&
                  seq_lens.size(0) == ids.size(0) && block_table.size(0) == ids.size(0),
              "small_llama_decode: one id, position, slot, block table row and length a request");
  const int64_t n = ids.size(0), q_size = m.heads * m.head_dim, kv_size = m.kv_heads * m.head_dim;
  torch::Tensor x = m.embed.index_select(0, ids), residual;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const SmallLayer& layer = m.layers[i];
    torch::Tensor h;
    if (i == 0) {
      residual = x;
      h = rms_norm(x, c10::nullopt, layer.input_norm, m.eps);
    } else {
      h = rms_norm(x, residual, layer.input_norm, m.eps);  // residual += x
    }
    const torch::Tensor qkv = amx_linear(h, layer.qkv, c10::nullopt, q_size + 2 * kv_size);
    const torch::Tensor q = qkv.narrow(1, 0, q_size).view({n, m.heads, m.head_dim});
    const torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, m.kv_heads, m.head_dim});
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, m.kv_heads, m.head_dim});
    rotary(q, positions, m.cos_sin);
    rotary(k, positions, m.cos_sin);
    write_kv(k, v, layer.k_cache, layer.v_cache, slot_mapping, c10::nullopt, c10::nullopt);
    torch::Tensor attended = torch::empty({n, m.heads, m.head_dim}, qkv.options());
    paged_decode_attention(attended, q, layer.k_cache, layer.v_cache, block_table, seq_lens, block_size, m.scale,
                           c10::nullopt, c10::nullopt);
    const torch::Tensor o = amx_linear(attended.view({n, q_size}), layer.o, c10::nullopt, m.hidden);
    h = rms_norm(o, residual, layer.post_norm, m.eps);  // residual += o
    const torch::Tensor gate_up = amx_linear(h, layer.gate_up, c10::nullopt, 2 * m.intermediate);
    x = amx_linear(silu_and_mul(gate_up), layer.down, c10::nullopt, m.hidden);
  }
  return rms_norm(x, residual, m.final_norm, m.eps);
}

}  // namespace

void bind_small_decode(py::module& m) {
  py::class_<SmallLayer>(m, "SmallLayer")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                    torch::Tensor, torch::Tensor>(),
           py::arg("input_norm"), py::arg("qkv"), py::arg("o"), py::arg("post_norm"), py::arg("gate_up"),
           py::arg("down"), py::arg("k_cache"), py::arg("v_cache"));
  py::class_<SmallLlama>(m, "SmallLlama")
      .def(py::init([](torch::Tensor embed, torch::Tensor final_norm, torch::Tensor cos_sin,
                       std::vector<SmallLayer> layers, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t intermediate, double eps, double scale) {
             SmallLlama s{embed, final_norm, cos_sin, std::move(layers)};
             s.heads = heads, s.kv_heads = kv_heads, s.head_dim = head_dim, s.hidden = embed.size(1);
             s.intermediate = intermediate, s.eps = eps, s.scale = scale;
             return s;
           }),
           py::arg("embed"), py::arg("final_norm"), py::arg("cos_sin"), py::arg("layers"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"), py::arg("scale"));
  m.def("small_llama_decode", &small_llama_decode,
        "a small Llama's decode forward, one token a request, in one call (amx_linear layers, a bf16 cache)",
        py::arg("model"), py::arg("ids"), py::arg("positions"), py::arg("slot_mapping"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("block_size"));
}
