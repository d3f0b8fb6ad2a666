"""Float32 layers with small_linear's copy alone (layers/linear.py's SMALL_ONLY, the default on
a CPU without AVX-512) against the same layers keeping oneDNN's packed weight for steps past
SMALL_ROWS rows (the default before): the linear layers' weights in memory, and output tokens/s
of the engines taking turns, round by round, in one process:

    python benchmarks/float32_weights.py [--models 56m,wide32,wide1] [--rounds 3]

56m         cpu_throughput.py's random 56M Llama, saved in bfloat16 and served in float32 (so
            each copy small_linear keeps is in bfloat16): 64 requests, 32..256 in and out
wideN       the wide model of the quantization issue (hidden 2048, intermediate 5632, 4 layers,
            random float32 weights, `load_format="dummy"`) with max_num_seqs N: max(N, 8)
            requests, 32..128 in and out

The engines run in the CPU's default dtype; on a CPU with AVX-512 SMALL_ONLY is off and both
engines are the packed one (the script says so and stops)."""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_quant import SHAPE_WIDE  # noqa: E402
from cpu_throughput import make_checkpoint  # noqa: E402

import tokenmill.executor.layers.linear as linear  # noqa: E402
from tokenmill import LLM  # noqa: E402
from tokenmill.bench.offline import copy_tokenizer, run_throughput  # noqa: E402
from tokenmill.bench.workloads import random_requests  # noqa: E402


def linear_mib(llm: LLM) -> float:
    """Every copy of the linear layers' weights the engine keeps (packed, small_linear's, plain)."""
    total = 0
    for m in llm.engine.runner.model.modules():
        if isinstance(m, linear.Linear):
            total += sum(t.numel() * t.element_size() for t in (m.packed, m.small, m.weight) if t is not None)
    return total / 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=lambda s: s.split(","), default=["56m", "wide32", "wide1"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not linear.SMALL_ONLY:
        print("this CPU has AVX-512: float32 layers keep the packed weight (SMALL_ONLY is off); nothing to compare")
        return
    root = Path(tempfile.mkdtemp())
    cases = {}
    for name in args.models:
        if name == "56m":
            cases[name] = (make_checkpoint(root), {}, random_requests(64, (32, 256), (32, 256), 32000, seed=0))
        elif name.startswith("wide"):
            from transformers import LlamaConfig
            wide = root / "llama-wide"
            if not wide.exists():
                LlamaConfig(**SHAPE_WIDE, bos_token_id=0, eos_token_id=0).save_pretrained(wide)
                copy_tokenizer(wide)
            n = int(name[4:] or 32)
            cases[name] = (wide, {"load_format": "dummy", "max_num_seqs": n},
                           random_requests(max(n, 8), (32, 128), (32, 128), 32000, seed=1))
        else:
            parser.error(f"--models: unknown {name!r}")
    print("| model | weights MiB, packed past SMALL_ROWS / small_linear alone | tok/s, packed past SMALL_ROWS | "
          "tok/s, small_linear alone | ratio (rounds) |\n|---|---|---|---|---|")
    for name, (path, load, requests) in cases.items():
        llms = {}
        for alone in (False, True):  # read by Linear.pack as the model loads
            linear.SMALL_ONLY = alone
            llms[alone] = LLM(str(path), **load)
        linear.SMALL_ONLY = True
        for llm in llms.values():
            run_throughput(llm, requests[:4], use_tqdm=False)  # warm-up
        runs = {alone: [] for alone in llms}
        for r in range(args.rounds):  # either first in turn
            for alone in ((False, True) if r % 2 == 0 else (True, False)):
                runs[alone].append(run_throughput(llms[alone], requests, use_tqdm=False).output_throughput)
        ratios = [b / a for a, b in zip(runs[False], runs[True])]
        print(f"| {name} | {linear_mib(llms[False]):.0f} / {linear_mib(llms[True]):.0f} | "
              f"{statistics.median(runs[False]):.0f} | {statistics.median(runs[True]):.0f} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |", flush=True)
        del llms
        gc.collect()


if __name__ == "__main__":
    main()
