#include <torch/extension.h>

void paged_decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor block_table, torch::Tensor seq_lens, int64_t block_size, double scale);
torch::Tensor rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
void rotary(torch::Tensor x, torch::Tensor positions, torch::Tensor cos_sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention, one query token per request");
  m.def("rms_norm", &rms_norm, "residual += x (in place, optional); rmsnorm(...) * weight");
  m.def("rotary", &rotary, "rotate-half rotary embedding, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
}
