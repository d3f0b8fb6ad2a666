"""How far an 8-bit KV cache moves greedy decoding by its number format alone: Hugging Face
transformers runs the built-in model with K and V rounded as they enter its cache (a cache
that quantizes and dequantizes what it stores), none of tokenmill's kernels involved.

    python benchmarks/kv_quant_reference.py [--functions 64] [--dtype bfloat16]

Each variant's greedy tokens are compared with the unrounded run's, position by position, over
the held-out function prompts and 64 tokens of benchmarks/quant_quality.py (its "agreement"):
- int8, fp8_e4m3, fp8_e5m2: a scale per token and kv head (max |x| over the head's values to
  the format's largest), rounded by tokenmill's own `quantize_rows`, as its engine stores them;
- fp8_e4m3 scale 1: K and V cast to e4m3 as they are (clamped to +-448), what an fp8 cache
  with a per-tensor scale of 1.0 stores (vLLM's fp8 cache when the checkpoint has no
  calibrated scales);
- float32: no rounding, the model in float32 against the baseline's dtype: how often two
  unquantized runs part, the metric's floor.
Where the engine's own figures (quant_quality.py) match these, its kernels add nothing to the
format's error, and a greedy-agreement target the format itself misses is out of reach.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from train_demo_model import function_prompts, split_files  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from transformers.cache_utils import DynamicCache  # noqa: E402

from tokenmill.config import DEFAULT_MODEL_DIR  # noqa: E402
from tokenmill.executor.attention.kv_cache import dequantize_rows, quantize_rows  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS, BATCH = 384, 64, 16


def per_row(dtype: torch.dtype):
    """x [batch, kv_heads, tokens, d] rounded through `dtype` with a scale per token and head"""
    def rnd(x: torch.Tensor) -> torch.Tensor:
        rows = x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])  # [tokens, kv_heads, d]
        q, s = quantize_rows(rows, dtype)
        return dequantize_rows(q, s, x.dtype).view(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2)
    return rnd


def unit_scale(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)


VARIANTS = {"int8": per_row(torch.int8), "fp8_e4m3": per_row(torch.float8_e4m3fn),
            "fp8_e5m2": per_row(torch.float8_e5m2), "fp8_e4m3 scale 1": unit_scale}


class RoundingCache(DynamicCache):
    """A DynamicCache that stores K and V rounded by `fn` (attention then reads them rounded,
    the new tokens' own included, as from an 8-bit paged cache)"""

    def __init__(self, fn, config) -> None:
        super().__init__(config=config)
        self.fn = fn

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self.fn(key_states), self.fn(value_states), layer_idx, *args, **kwargs)


def greedy(model, batches, fn=None) -> list[list[int]]:
    out = []
    for ids, mask in batches:
        cache = RoundingCache(fn, model.config) if fn else None
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask, cache=cache, do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        out += gen[:, ids.shape[1]:].tolist()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--functions", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", help="the model's dtype (K and V arrive in it)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    prompts = [tok.encode(p)[-PROMPT_TOKENS:] for p, _ in function_prompts(split_files()[1], args.functions)]
    batches = []
    for i in range(0, len(prompts), BATCH):  # left-padded, as generate expects
        chunk = prompts[i:i + BATCH]
        width = max(map(len, chunk))
        batches.append((torch.tensor([[0] * (width - len(p)) + p for p in chunk]),
                        torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])))
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=dtype).eval()
    base = greedy(model, batches)
    total = sum(map(len, base))

    def report(name: str, tokens: list[list[int]]) -> None:
        same = sum(a == b for g, w in zip(tokens, base) for a, b in zip(g, w))
        print(f"{name:18s} greedy agreement {same / total:.3f} ({len(prompts)} functions x {NEW_TOKENS} tokens, "
              f"transformers, {args.dtype})", flush=True)

    for name, fn in VARIANTS.items():
        report(name, greedy(model, batches, fn))
    if dtype != torch.float32:
        report("float32", greedy(AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval(),
                                 batches))


if __name__ == "__main__":
    main()
