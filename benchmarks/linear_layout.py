"""Which float32 linear layers to pack for oneDNN: packed (`mkldnn._linear_pointwise`) against
plain (`F.linear`, MKL's GEMM) at the shapes of the built-in model, its draft and the 56M
benchmark model, for decode-sized row counts:

    python benchmarks/linear_layout.py [--threads 2] [--rows 1,4,16,64,256]

Prints microseconds per call (best of 5 runs) and marks the layers that `Linear.pack` keeps
plain as well as packed, for steps of up to PLAIN_ROWS rows (fewer than SMALL_FLOAT32_WEIGHT
elements). A layer alone keeps its weights in cache;
in a model they are read from memory each forward, so the script then times whole forwards
(1, 2, 5 and 8 tokens over a 450-token context, logits and argmax) of the built-in model
and its draft in float32, every layer packed against small ones plain up to PLAIN_ROWS
rows (what `Linear` does), taking turns, with
the other model's forward in between as in a speculative step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.nn import functional as F

import tokenmill.executor.layers.linear as linear
from tokenmill.executor.layers.linear import PLAIN_ROWS, SMALL_FLOAT32_WEIGHT

# (out, in): built-in target, its draft, the 56M model of cpu_throughput.py
SHAPES = {"target": [(512, 256), (256, 256), (1408, 256), (256, 704), (8192, 256)],
          "draft": [(256, 128), (128, 128), (704, 128), (128, 352), (8192, 128)],
          "56m": [(1024, 512), (512, 512), (2816, 512), (512, 1408)]}


def best_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=200, help="whole forwards per layout and size")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads; us per call, packed / plain\n")
    print("| model | out x in | kept | " + " | ".join(f"{m} rows" for m in args.rows) + " |")
    print("|---|---|---|" + "---|" * len(args.rows))
    for model, shapes in SHAPES.items():
        for out_features, in_features in shapes:
            w = torch.randn(out_features, in_features)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            cells = []
            for m in args.rows:
                x = torch.randn(m, in_features)
                calls = max(20, 4000 // m)
                a = best_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), calls)
                b = best_us(lambda: F.linear(x, w), calls)
                cells.append(f"{a:.0f} / {b:.0f}")
            kept = f"plain up to {PLAIN_ROWS} rows" if w.numel() < SMALL_FLOAT32_WEIGHT else "packed"
            print(f"| {model} | {out_features} x {in_features} | {kept} | " + " | ".join(cells) + " |", flush=True)
    whole_forwards(args.repeats)


def forward_fn(llm, num_tokens: int):
    """One decode-shaped forward of `num_tokens` query tokens of one request, at positions
    450.., with its logits' argmax on the host."""
    from tokenmill.executor.attention import AttentionMetadata, token_slots

    runner = llm.engine.runner
    put = runner.staging.to_device
    table = np.arange(32, dtype=np.int32).reshape(1, -1)
    query_lens, starts = np.array([num_tokens], dtype=np.int32), np.array([450])
    positions, slots = token_slots(query_lens, starts, table, runner.block_size)

    def run():
        runner.staging.begin()
        runner.attn.begin_step(AttentionMetadata.from_host(query_lens, (starts + query_lens).astype(np.int32), table,
                                                           put(slots), runner.block_size, put))
        hidden = runner.model(put(np.zeros(num_tokens, dtype=np.int64)), put(positions), runner.attn)
        runner.staging.end()
        return runner.model.compute_logits(hidden).argmax(-1).tolist()
    return run


@torch.inference_mode()
def whole_forwards(repeats: int) -> None:
    from tokenmill import LLM
    from tokenmill.config import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_MODEL_DIR

    llms = {}
    for layout, threshold in (("packed", 0), ("small plain", SMALL_FLOAT32_WEIGHT)):
        linear.SMALL_FLOAT32_WEIGHT = threshold  # read by Linear.pack when each model loads
        for model, path in (("target", DEFAULT_MODEL_DIR), ("draft", DEFAULT_DRAFT_MODEL_DIR)):
            llms[model, layout] = LLM(str(path), dtype="float32", max_num_seqs=1, kv_cache_memory="64MiB")
    linear.SMALL_FLOAT32_WEIGHT = SMALL_FLOAT32_WEIGHT
    print(f"\nwhole forwards, ms (median of {repeats}), every layer packed / small ones plain up to "
          f"{PLAIN_ROWS} rows\n")
    print("| model | 1 token | 2 tokens | 5 tokens | 8 tokens |\n|---|---|---|---|---|")
    for model in ("target", "draft"):
        other = "draft" if model == "target" else "target"
        cells = []
        for n in (1, 2, 5, 8):
            runs = {layout: forward_fn(llms[model, layout], n) for layout in ("packed", "small plain")}
            evict = forward_fn(llms[other, "packed"], 1)
            times = {layout: [] for layout in runs}
            for _ in range(repeats):
                for layout, run in runs.items():
                    evict()
                    start = time.perf_counter()
                    run()
                    times[layout].append(time.perf_counter() - start)
            cells.append(" / ".join(f"{1e3 * np.median(t):.2f}" for t in times.values()))
        print(f"| {model} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
