"""Write the built-in drafters' token maps (executor/spec/vocab.py): the token ids that occur
most in the built-in model's training files (the standard library's files that are not held
out, encoded with the shipped tokenizer), most frequent first, as a JSON list.

    python scripts/make_token_map.py                 # both built-in drafters' maps
    python scripts/make_token_map.py --sizes 2048,4096

The sizes were chosen by acceptance on the completion set of benchmarks/speculative.py
(4 requests, 4 drafts each verified, 32 prompts, float32; the whole vocabulary is 8,192):
the draft model accepted 0.369, 0.369, 0.365 and 0.360 of its drafts with 8,192, 4,096,
2,048 and 1,024 tokens, the EAGLE head 0.679, 0.661, 0.609 and 0.591. The draft model keeps
2,048; the head, whose drafts follow the target more closely and lose more with a smaller
map, 4,096.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from train_demo_model import load_tokenizer, split_files, token_stream  # noqa: E402

from tokenmill.config import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_MODEL_DIR, DEFAULT_MODEL_DIR  # noqa: E402
from tokenmill.executor.spec.vocab import BUILT_IN_TOKEN_MAP  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2048,4096", help="the draft model's map size, then the EAGLE head's")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    train, _ = split_files()
    ids = token_stream(load_tokenizer(DEFAULT_MODEL_DIR), train).long()
    counts = torch.bincount(ids)
    order = torch.argsort(counts, descending=True, stable=True)  # ties: the lower id first
    for directory, n in zip((DEFAULT_DRAFT_MODEL_DIR, DEFAULT_EAGLE_MODEL_DIR), sizes):
        top = order[:n]
        share = counts[top].sum().item() / counts.sum().item()
        (directory / BUILT_IN_TOKEN_MAP).write_text(json.dumps(top.tolist()) + "\n")
        print(f"{directory / BUILT_IN_TOKEN_MAP}: {n} tokens, {share:.1%} of the {len(ids):,} training tokens")


if __name__ == "__main__":
    main()
