"""The script that trains the built-in EAGLE head runs a few steps on a tiny setting and writes a
head that the engine loads for `method: "eagle"`, with greedy outputs those of decoding
without drafts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from safetensors import safe_open

from tokenmill import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def test_train_eagle_head_script(tmp_path):
    out = tmp_path / "head"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_eagle_head.py"), "--steps", "3",
                          "--max-files", "3", "--seq-len", "64", "--batch-size", "2", "--threads", "1",
                          "--eval-starts", "4", "--output", str(out)], check=True, capture_output=True, text=True)
    assert "agreement with the target's greedy token by draft position: j=1" in run.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"] and config["num_hidden_layers"] == 1
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:  # vLLM's EAGLE-1 Llama names
        names = set(f.keys())
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    assert not any("input_layernorm" in n or n.startswith(("embed_tokens", "lm_head", "norm")) for n in names)

    prompts = ["def fibonacci(n):", "import os\nimport sys\n"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(dtype="float32", kv_cache_memory="16MiB")
    eagle = LLM(dtype="float32", kv_cache_memory="16MiB",
                speculative_config={"method": "eagle", "model": str(out), "num_speculative_tokens": 3,
                                    "adaptive": False})
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in eagle.generate(prompts, params, use_tqdm=False)] == want
    assert eagle.engine.stats()["spec_decode_num_draft_tokens"] > 0
