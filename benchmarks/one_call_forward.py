"""A small model's steps in one native call (executor/fused_decoder.py) against the same engine
running every step through the Python modules (`enforce_eager`), output tokens/s.

    python benchmarks/one_call_forward.py [--concurrency 1,2,4,8] [--models builtin,56m] [--rounds 3]

builtin  the built-in model (6 layers, hidden 256, vocab 8192), dtype auto: float32 on a CPU
         without native bfloat16 (every linear layer on small_linear, up to SMALL_ROWS rows a
         step: 256 without AVX-512),
         bfloat16 on one with AMX (amx_linear, up to 64 rows).
56m      the 56M random Llama of cpu_throughput.py (8 layers, hidden 512, vocab 32000), dtype
         auto; its LM head runs apart from the call.
Each concurrency runs 2 x concurrency requests (at least 8) of random prompts of 32..256
tokens and 128 output tokens (ignore_eos), both engines taking turns of 0.5 s in one run
(tokenmill.bench.interleave); the median over rounds of the ratio, and of each side's time per
output token. The outputs of both are checked equal (the call runs the modules' kernels in
their order).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_throughput import make_checkpoint  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.interleave import run_interleaved  # noqa: E402

PARAMS = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)


def random_prompts(concurrency: int, vocab: int) -> list[list[int]]:
    """2 x concurrency (at least 8) prompts of 32..256 random tokens."""
    rng = random.Random(concurrency)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(32, 256))] for _ in range(max(8, 2 * concurrency))]


def rounds_of(llms: dict[str, LLM], prompts: list[list[int]], rounds: int) -> dict:
    """The two engines taking turns over `prompts`, `rounds` times (the order turned each round):
    the median of the first's output tokens/s over the second's, each round's, and each one's
    median time per output token. Their outputs must be equal."""
    first, second = llms
    ratios, tpot = [], {name: [] for name in llms}
    for r in range(rounds):
        order = dict(reversed(llms.items())) if r % 2 else llms
        turns = run_interleaved(order, prompts, PARAMS, 0.5)
        tokens = {name: sum(len(o.outputs[0].token_ids) for o in t.outputs) for name, t in turns.items()}
        rate = {name: tokens[name] / turns[name].seconds for name in turns}
        for name, t in turns.items():
            tpot[name].append(1e3 * statistics.median(t.time_per_output_token()))
        outputs = {name: [o.outputs[0].token_ids for o in t.outputs] for name, t in turns.items()}
        assert outputs[first] == outputs[second], f"{first} changed the outputs"
        ratios.append(rate[first] / rate[second])
    return {"ratio": statistics.median(ratios), "ratios": ratios,
            **{f"tpot_ms {name}": statistics.median(v) for name, v in tpot.items()}}


def compare(path: str | None, concurrency: int, rounds: int, vocab: int) -> dict:
    llms = {"one call": LLM(path, max_num_seqs=concurrency),
            "modules": LLM(path, max_num_seqs=concurrency, enforce_eager=True)}
    if llms["one call"].engine.runner.fused is None:
        return {"skipped": "the model's layers do not run on one small-step kernel here"}
    return {"rows": llms["one call"].engine.runner.fused_rows,
            **rounds_of(llms, random_prompts(concurrency, vocab), rounds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["builtin", "56m"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            path, vocab = (None, 8192) if model == "builtin" else (str(make_checkpoint(Path(tmp))), 32000)
            for c in args.concurrency:
                result = compare(path, c, args.rounds, vocab)
                print(model, c, result, flush=True)
                table.append((model, c, result))
    print("\n| model | concurrency | rows in one call | TPOT ms, modules | TPOT ms, one call | tok/s ratio |")
    print("|---|---|---|---|---|---|")
    for model, c, r in table:
        if "skipped" in r:
            print(f"| {model} | {c} | - | - | - | {r['skipped']} |")
        else:
            print(f"| {model} | {c} | {r['rows']} | {r['tpot_ms modules']:.2f} | {r['tpot_ms one call']:.2f} | "
                  f"**{r['ratio']:.2f}x** ({', '.join(f'{x:.2f}' for x in r['ratios'])}) |")


if __name__ == "__main__":
    main()
