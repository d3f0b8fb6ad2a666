"""The script that trains the built-in models runs a few steps on a tiny setting and writes a checkpoint
that tokenmill and transformers load; its ast check cuts completions at the end of the function body."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from train_demo_model import cut_body, is_held_out, parses  # noqa: E402


def test_train_demo_model_script(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train_demo_model.py"), "--models", "draft",
                    "--threads", "1", "--steps", "3", "--hidden-size", "32", "--num-layers", "1",
                    "--seq-len", "32", "--batch-size", "2", "--max-files", "4", "--no-compile",
                    "--output-root", str(tmp_path)], check=True, capture_output=True, timeout=300)
    path = tmp_path / "default_draft_model"
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert hf.config.hidden_size == 32 and hf.config.num_hidden_layers == 1
    assert next(hf.parameters()).dtype == torch.bfloat16
    out = LLM(str(path), kv_cache_memory="8MiB").generate(
        "def f(x):", SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_distilling_a_draft_from_a_teacher(tmp_path):
    """--distill-from trains on the teacher's distributions (here the shipped draft teaches a
    tiny one), --init-from starts from a checkpoint's weights and shape, and both report how
    often the student's argmax is the teacher's."""
    teacher = ROOT / "tokenmill" / "data" / "default_draft_model"
    common = ["--models", "draft", "--threads", "1", "--steps", "2", "--seq-len", "32", "--batch-size", "2",
              "--max-files", "4", "--no-compile", "--no-bf16", "--distill-from", str(teacher)]
    first = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_demo_model.py"), *common,
                            "--hidden-size", "32", "--num-layers", "1", "--output-root", str(tmp_path / "a")],
                           check=True, capture_output=True, text=True, timeout=300)
    assert "distilled from" in first.stdout and "argmax equal to the teacher's at" in first.stdout
    second = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_demo_model.py"), *common,
                             "--init-from", str(tmp_path / "a" / "default_draft_model"),
                             "--output-root", str(tmp_path / "b")],
                            check=True, capture_output=True, text=True, timeout=300)
    assert "starting from" in second.stdout
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "default_draft_model")
    assert hf.config.hidden_size == 32 and hf.config.num_hidden_layers == 1  # the init's shape, not the default


def test_held_out_files_are_a_fixed_few_percent():
    paths = [f"pkg{i}/mod{j}.py" for i in range(20) for j in range(50)]
    held = [p for p in paths if is_held_out(p)]
    assert 0.02 < len(held) / len(paths) < 0.06 and held == [p for p in paths if is_held_out(p)]


@pytest.mark.parametrize("signature, completion, finished, body", [
    ("def f(x):", "\n    return x\n\ndef g():\n    pass\n", False, "\n    return x\n\n"),
    ("    def m(self):", "\n        a = 1\n        return a\n    def n(self):\n", False,
     "\n        a = 1\n        return a\n"),
    ("def f(x):", "\n    return x\n", True, "\n    return x\n"),  # ended with <|endoftext|>
    ("def f(x):", "\n    y = [\n        x,\n", False, None),  # still inside the body at max_tokens
])
def test_cut_body(signature, completion, finished, body):
    assert cut_body(signature, completion, finished) == body


def test_parses():
    assert parses("    def m(self):", "\n        return 1\n")
    assert not parses("def f(x):", "\n    return (x\n")
    assert not parses("def f(x):", None)
