#include <torch/extension.h>

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, int64_t block_size, double scale,
                            c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales);
bool has_bf16_prefill_attention();
void paged_prefill_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor block_table, torch::Tensor seq_lens, torch::Tensor query_starts,
                             torch::Tensor query_lens, int64_t block_size, double scale);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping, c10::optional<torch::Tensor> k_scales, c10::optional<torch::Tensor> v_scales);
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
void rotary(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor logits);
bool has_small_linear();
bool has_small_linear_bf16();
torch::Tensor small_linear_bf16(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                int64_t out);
torch::Tensor small_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out);
bool has_amx_linear();
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t out);
torch::Tensor amx_int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              c10::optional<torch::Tensor> bias, int64_t out);
void bind_int8_linear(pybind11::module& m);
void bind_small_decode(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "paged decode attention, one query token per row; an 8-bit cache (int8, fp8) takes its row scales",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("block_size"), py::arg("scale"), py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "paged causal attention for chunks of several query tokens (bfloat16, AVX512-BF16)");
  m.attr("has_bf16_prefill_attention") = has_bf16_prefill_attention();
  m.def("write_kv", &write_kv,
        "k and v of each new token into its cache slot; an 8-bit cache (int8, fp8) also gets each row's scale",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none());
  m.def("rms_norm", &rms_norm, "residual += x (in place, optional); rmsnorm(...) * weight");
  m.def("rotary", &rotary, "rotate-half rotary embedding, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("argmax_rows", &argmax_rows, "index of the largest value of each row (first on ties)");
  m.attr("has_small_linear") = has_small_linear();
  m.def("small_linear", &small_linear,
        "x W^T (+ b), float32 (the weight float32, or bfloat16 widened exactly), for a few rows of x, 6 a pass, "
        "W laid out by pack_small (AVX2 + FMA)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out"));
  m.attr("has_small_linear_bf16") = has_small_linear_bf16();
  m.def("small_linear_bf16", &small_linear_bf16,
        "x W^T (+ b), bfloat16, for 1 to 16 rows of x, W laid out by pack_bf16_pairs (AVX512-BF16)", py::arg("x"),
        py::arg("packed"), py::arg("bias"), py::arg("out"));
  m.attr("has_amx_linear") = has_amx_linear();
  m.def("amx_linear", &amx_linear,
        "x W^T (+ b), bfloat16, for up to 256 rows of x, W laid out by pack_bf16_pairs, in a multiple of 32 (AMX)",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out"));
  m.def("amx_int8_linear", &amx_int8_linear,
        "x W^T (+ b) in x's dtype for up to 256 rows of x, quantized per token to int8, W int8 laid out by "
        "pack_int8_quads with its output channels' scales, in a multiple of 64 (AMX)",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias"), py::arg("out"));
  bind_int8_linear(m);  // where torch has fbgemm (x86-64)
  bind_small_decode(m);
}
