"""Shared fixtures: tiny random checkpoints in the Hugging Face layout, made on the spot."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from tokenmill.config import DEFAULT_MODEL_DIR

# Triton kernels run under the interpreter where there is no GPU; it must be set before
# any kernel is defined, so before tokenmill's Triton module is first imported
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# small shapes that still exercise GQA, biases, q/k norm, tying and rope scaling
ARCHS = {
    "llama": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    "llama_tied_llama3rope": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=1,
                                  tie_word_embeddings=True,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama_linear_rope": dict(arch="LlamaForCausalLM", num_attention_heads=4, num_key_value_heads=4,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(arch="MistralForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    "qwen2": dict(arch="Qwen2ForCausalLM", num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(arch="Qwen3ForCausalLM", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def make_checkpoint(path: Path, name: str, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Saves a random model of the named architecture with transformers, plus the built-in tokenizer."""
    import transformers

    spec = dict(ARCHS[name])
    arch = spec.pop("arch")
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(vocab_size=8192, hidden_size=hidden, intermediate_size=2 * hidden + 32,
                        num_hidden_layers=layers, max_position_embeddings=512, rms_norm_eps=1e-6,
                        bos_token_id=0, eos_token_id=0, initializer_range=0.1, **spec)
    if arch == "MistralForCausalLM":
        config.sliding_window = None
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    if arch == "Qwen2ForCausalLM":  # random biases: zeros would not test that they load
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(path)
    for f in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / f, path / f)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> directory of a tiny random checkpoint, built once per test session."""
    root = tmp_path_factory.mktemp("ckpt")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = make_checkpoint(root / name, name)
        return cache[name]

    return get
