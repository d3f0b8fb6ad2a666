"""The engine's host time per decode step: what a GPU waits for between its steps.

    python benchmarks/host_overhead.py [--batches 1,64,256] [--context 512] [--steps 40]

On an H100 the GPU sat idle for about half of each decode step of the Qwen3-0.6B shape
(benchmarks/gpu_throughput.py, section profile): the step's Python, not its kernels,
set the pace. This measures that Python on the CPU. A one-layer model of hidden size 64
makes the forward cheap; its forward, logits and sampler (the work a GPU would do) are
timed apart and taken out, and what is left is the host's part: scheduling, building
the step's inputs, the sampling settings, appending tokens, stop checks and outputs
(the sampler's own Python, a list of ids, counts as device work here). Requests are
final_only, as LLM.generate and the throughput benchmarks add them, and none finishes
within the timed steps. The CPU runs no CUDA graphs, so the graph runner's part of the
host's work is not in these figures.
Prints the host time per step and per request; the median of --rounds rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill import LLM  # noqa: E402
from tokenmill.bench.offline import copy_tokenizer  # noqa: E402
from tokenmill.bench.steps import drain, fill_decode_batch  # noqa: E402
from tokenmill.executor.sampler import SampledTokens  # noqa: E402


def make_model(root: Path) -> Path:
    import torch
    import transformers

    config = transformers.Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=4096, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(root)
    copy_tokenizer(root)
    return root


def host_time(llm: LLM, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(seconds per decode step in all, of which the host's part)."""
    engine, runner = llm.engine, llm.engine.runner
    fill_decode_batch(engine, batch, context, steps + 8, final_only=True, detokenize=True)
    device_work = [0.0]
    originals = {}

    def timed(obj, name):
        fn = getattr(obj, name)
        originals[(obj, name)] = fn if name in vars(obj) else None  # None: the class's method

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                device_work[0] += time.perf_counter() - t0
        setattr(obj, name, wrapper)

    timed(runner.model, "forward")
    timed(runner.model, "compute_logits")
    timed(runner.sampler, "sample")
    timed(SampledTokens, "tokens")  # the wait for the ids, and their list
    try:
        engine.step()
        device_work[0] = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    finally:
        for (obj, name), fn in originals.items():
            if fn is None:
                delattr(obj, name)
            else:
                setattr(obj, name, fn)
    drain(engine)
    return total / steps, (total - device_work[0]) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp) / "tiny")
        llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=256, max_model_len=4096,
                  num_threads=1)
        rows = []
        for batch in [int(b) for b in args.batches.split(",")]:
            runs = [host_time(llm, batch, args.context, args.steps) for _ in range(args.rounds)]
            total = statistics.median(r[0] for r in runs)
            host = statistics.median(r[1] for r in runs)
            rows.append((batch, total, host))
            print(f"batch {batch}: step {total * 1e3:.2f} ms, host {host * 1e3:.2f} ms", flush=True)
    print(f"\nhost time per decode step (context {args.context}, median of {args.rounds} rounds)")
    for batch, total, host in rows:
        print(f"batch {batch:>4}: {host * 1e3:6.2f} ms a step, {host / batch * 1e6:6.1f} us a request "
              f"(step {total * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
