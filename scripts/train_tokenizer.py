"""Train the tokenizer of tokenmill's built-in default model.

Trains a byte-level BPE tokenizer (Hugging Face ``tokenizers``) on the ``*.py``
source files of the running interpreter's standard library and writes
``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
so that ``transformers.AutoTokenizer.from_pretrained(DIR)`` loads it as a
``PreTrainedTokenizerFast`` with a ChatML chat template.

Special tokens get ids 0, 1, 2: ``<|endoftext|>`` (bos/eos), ``<|im_start|>``,
``<|im_end|>``. The corpus is read in sorted order, so the result is
deterministic for a given Python installation (a different stdlib version
gives a different, equally valid, tokenizer).

Usage::

    python scripts/train_tokenizer.py [--vocab-size 8192] [--output DIR]

``--output`` defaults to ``tokenmill/data/default_model`` (relative to the
repository root). Only the tokenizer files are written there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = REPO_ROOT / "tokenmill" / "data" / "default_model"
DEFAULT_VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 2048

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order matters: the trainer assigns ids 0, 1, 2 in this order.
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def stdlib_files(stdlib_dir: Path) -> list[tuple[str, str]]:
    """Return ``(path relative to stdlib_dir, UTF-8 text)`` of every ``*.py`` file under *stdlib_dir*.

    Walks directories and files in sorted order, skips ``site-packages``
    (third-party code) and any file that cannot be read or is not valid UTF-8.
    """
    files: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(stdlib_dir):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            try:
                files.append((path.relative_to(stdlib_dir).as_posix(), path.read_bytes().decode("utf-8")))
            except (OSError, UnicodeDecodeError):
                continue
    return files


def stdlib_sources(stdlib_dir: Path) -> list[str]:
    """Return the UTF-8 text of every ``*.py`` file under *stdlib_dir* (see `stdlib_files`)."""
    return [text for _, text in stdlib_files(stdlib_dir)]


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    return tokenizer


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_hf_configs(output: Path) -> None:
    special_tokens_map = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }
    write_json(output / "special_tokens_map.json", special_tokens_map)
    write_json(output / "tokenizer_config.json", tokenizer_config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="output directory")
    args = parser.parse_args(argv)

    stdlib_dir = Path(sysconfig.get_paths()["stdlib"])
    texts = stdlib_sources(stdlib_dir)
    if not texts:
        parser.error(f"no readable *.py files under {stdlib_dir}")
    print(f"training on {len(texts)} files from {stdlib_dir} "
          f"({sum(len(t) for t in texts) / 1e6:.1f}M chars)", flush=True)

    tokenizer = build_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stdout.isatty(),
    )
    start = time.perf_counter()
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    elapsed = time.perf_counter() - start

    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(tok) == i, (tok, tokenizer.token_to_id(tok))

    args.output.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.output / "tokenizer.json"))
    write_hf_configs(args.output)
    print(f"trained vocab of {tokenizer.get_vocab_size()} in {elapsed:.1f}s; "
          f"wrote {args.output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
