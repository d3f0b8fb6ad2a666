"""Float32 weights whose values are all bfloat16 ones (a bfloat16 checkpoint served in float32, as
on a CPU without AVX512-BF16) kept for small steps in bfloat16 (layers/linear.py: small_linear
widens them exactly as it reads them, half the bytes) against the same engine keeping them in
float32, output tokens/s:

    python benchmarks/bf16_copies.py [--concurrency 1,4,16] [--models builtin,56m] [--rounds 3]

builtin  the built-in model (6 layers, hidden 256, vocab 8192: its LM head's copy too), float32.
56m      the 56M random Llama of cpu_throughput.py (8 layers, hidden 512, vocab 32000), saved in
         bfloat16, served in float32; its LM head is past the copies' size (packed only).
Each concurrency runs 2 x concurrency requests (at least 8) of random prompts of 32..256
tokens and 128 output tokens (ignore_eos), both engines taking turns of 0.5 s in one run
(tokenmill.bench.interleave); the median over rounds of the ratio, and of each side's time per
output token. The outputs of both are checked equal (the same arithmetic on the same values).
On a CPU with native bfloat16 the engines run in bfloat16 unless asked (--dtype float32).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_throughput import make_checkpoint  # noqa: E402
from one_call_forward import random_prompts, rounds_of  # noqa: E402

from tokenmill import LLM  # noqa: E402
from tokenmill.executor.layers import linear  # noqa: E402


def copies(llm: LLM) -> str:
    """The small-step copies of the engine's linear layers, by dtype."""
    kept = [m.small.dtype for m in llm.engine.runner.model.modules() if isinstance(m, linear.Linear)
            and m.small is not None]
    return ", ".join(f"{kept.count(d)} {str(d).removeprefix('torch.')}" for d in sorted(set(kept), key=str)) or "none"


def compare(path: str | None, concurrency: int, rounds: int, vocab: int, dtype: str) -> dict:
    llms = {"bfloat16 copies": LLM(path, dtype=dtype, max_num_seqs=concurrency)}
    with mock.patch.object(linear, "exactly_bfloat16", lambda w: False):  # as before the bfloat16 copies
        llms["float32 copies"] = LLM(path, dtype=dtype, max_num_seqs=concurrency)
    return {"copies": copies(llms["bfloat16 copies"]), **rounds_of(llms, random_prompts(concurrency, vocab), rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["builtin", "56m"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            path, vocab = (None, 8192) if model == "builtin" else (str(make_checkpoint(Path(tmp))), 32000)
            for c in args.concurrency:
                result = compare(path, c, args.rounds, vocab, args.dtype)
                print(model, c, result, flush=True)
                table.append((model, c, result))
    print("\n| model | concurrency | small-step copies | TPOT ms, float32 copies | TPOT ms, bfloat16 copies "
          "| tok/s ratio |")
    print("|---|---|---|---|---|---|")
    for model, c, r in table:
        ratios = ", ".join(f"{x:.2f}" for x in r["ratios"])
        print(f"| {model} | {c} | {r['copies']} | {r['tpot_ms float32 copies']:.2f} | "
              f"{r['tpot_ms bfloat16 copies']:.2f} | **{r['ratio']:.2f}x** ({ratios}) |")


if __name__ == "__main__":
    main()
