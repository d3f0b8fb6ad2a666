"""The script that trains the built-in tokenizer runs and produces a tokenizer transformers loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent


def test_train_tokenizer_script(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train_tokenizer.py"), "--vocab-size", "512",
                    "--output", str(tmp_path)], check=True, capture_output=True, timeout=300)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "def f(x):\n    return x  # café"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok) == 512 and tok.convert_tokens_to_ids("<|endoftext|>") == 0
