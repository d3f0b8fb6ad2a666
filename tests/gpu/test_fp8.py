"""FP8 W8A8 on a CUDA device (torch._scaled_mm): made on load, and loaded from a
compressed-tensors FP8_DYNAMIC checkpoint written by `tokenmill quantize`, on the built-in
model against bf16. Skipped without CUDA (benchmarks/gpu_throughput.py runs them)."""

from __future__ import annotations

import gc

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA device with fp8 (Ada, Hopper or later)")

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):"]
PARAMS = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=2)


def run(model, **engine_args):
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(str(model), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, **engine_args)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def test_fp8_on_load_stays_close_to_bf16():
    _, ref = run(DEFAULT_MODEL_DIR)
    llm, got = run(DEFAULT_MODEL_DIR, quantization="fp8")
    assert type(llm.engine.runner.model.layers[0].mlp.down_proj.quant_method).__name__ == "Fp8LinearMethod"
    same = sum(a == b for g, w in zip(got, ref) for a, b in zip(g.token_ids, w.token_ids))
    assert same / (32 * len(PROMPTS)) >= 0.7
    assert all(-9999.0 <= v <= 0 for c in got for entry in c.logprobs for v in entry.values())


def test_fp8_checkpoint_equals_fp8_on_load(tmp_path):
    from tokenmill.cli import main

    assert main(["quantize", "--model", str(DEFAULT_MODEL_DIR), "--scheme", "fp8-dynamic",
                 "--output", str(tmp_path / "fp8")]) == 0
    llm, loaded = run(tmp_path / "fp8")
    assert type(llm.engine.runner.model.layers[0].mlp.down_proj.quant_method).__name__ == "Fp8LinearMethod"
    from_checkpoint = quantized_weights(llm)
    del llm
    llm, on_load = run(DEFAULT_MODEL_DIR, quantization="fp8")
    made_on_load = quantized_weights(llm)
    assert from_checkpoint.keys() == made_on_load.keys() and len(made_on_load) == 6 * 4  # qkv, o, gate_up, down
    for name, (weight, scale) in made_on_load.items():  # the same bytes, quantized on the CPU or the GPU
        assert torch.equal(from_checkpoint[name][1], scale), name
        assert torch.equal(from_checkpoint[name][0].view(torch.uint8), weight.view(torch.uint8)), name
    assert [c.token_ids for c in loaded] == [c.token_ids for c in on_load]


def test_fp8_layers_read_activations_quantized_by_the_kernels_before_them():
    """The norms before qkv and gate/up and the activation before down quantize their output
    in their own launch (Fp8Rows); eagerly, turning that off gives the same tokens and logprobs."""
    llm, fused = run(DEFAULT_MODEL_DIR, quantization="fp8", enforce_eager=True)
    layers = llm.engine.runner.model.layers
    assert all(x.input_layernorm.fp8_output and x.post_attention_layernorm.fp8_output and x.mlp.fp8_down
               for x in layers)
    for layer in layers:
        layer.input_layernorm.fp8_output = layer.post_attention_layernorm.fp8_output = layer.mlp.fp8_down = False
    apart = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert [c.token_ids for c in fused] == [c.token_ids for c in apart]
    assert [c.logprobs for c in fused] == [c.logprobs for c in apart]


def quantized_weights(llm) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every fp8 layer's weight and scale row, on the host."""
    return {name: (m.weight.detach().cpu(), m.weight_scale_row.cpu())
            for name, m in llm.engine.runner.model.named_modules() if hasattr(m, "weight_scale_row")}
