"""Which float32 linear layers to pack for oneDNN: packed (`mkldnn._linear_pointwise`) against
plain (`F.linear`, MKL's GEMM) and the CPU kernels' `small_linear` (up to SMALL_ROWS rows) at
the shapes of the built-in model, its draft and the 56M benchmark model, for decode-sized
row counts:

    python benchmarks/linear_layout.py [--threads 2] [--rows 1,2,4,8,16,64,256] [--wide]

Prints microseconds per call (best of 5 runs) of weights whose values are bfloat16 ones (as a
bfloat16 checkpoint served in float32), `small_linear` with a float32 copy and a bfloat16 one,
and marks the layers that `Linear.pack` keeps plain as well as packed (fewer than
SMALL_FLOAT32_WEIGHT elements), which run steps of up to SMALL_ROWS rows through
`small_linear`; on a CPU without AVX-512 every float32 layer keeps small_linear's copy alone
and runs every step on it (SMALL_ONLY), and the kernel's column covers every row count.
`--wide` adds the wide model's shapes (hidden 2048). Where the CPU has AVX512-BF16, a second table does
the same for bfloat16 weights: oneDNN's packed call against `small_linear_bf16` (up to 16 rows,
the weight laid out by `pack_bf16_pairs`) and, where the CPU has AMX, `amx_linear` (up to
AMX_ROWS rows, the same layout), at those shapes and at a wider model's (hidden 2048), with the
rows `Linear.pack` gives each. A layer alone keeps its weights in cache; in a
model they are read from memory each forward, so the script then times whole forwards (1,
2, 5 and 8 tokens over a 450-token context, logits and argmax) of the built-in model and
its draft in float32, taking turns, with the other model's forward in between as in a
speculative step: every layer packed; small ones plain through MKL up to PLAIN_ROWS rows
(what `Linear` does without the CPU kernels); and through `small_linear` (what it does).

`--engine 1,4,16` then runs the built-in model's engine at those concurrencies with and
without its small-step kernel (and with `--engine-small-rows 16`, an engine whose layers
take it for up to 16 rows only; with SMALL_ONLY, one whose layers keep the packed weight for
steps past SMALL_ROWS) (engines in one process taking turns, benchmarks/speculative.py's
completion prompts, greedy, 128 tokens each) and prints the output tokens/s and TPOT ratios,
the median of `--engine-rounds` rounds, and whether the outputs were identical. The engine
runs in its default dtype: bfloat16 where the CPU has AVX512-BF16, where the kernel is
`small_linear_bf16` (without it, every step takes oneDNN's packed call), and where it also has
AMX, a third engine runs `amx_linear`; else float32 and `small_linear`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import numpy as np
import torch
from torch.nn import functional as F

import tokenmill.executor.layers.linear as linear
from tokenmill.executor.cpu_kernels import load_cpu_kernels
from tokenmill.executor.layers.linear import (AMX_ROWS, PLAIN_ROWS, SMALL_BFLOAT16_WEIGHT, SMALL_FLOAT32_WEIGHT,
                                              SMALL_ONLY, SMALL_ROWS, amx_linear_rows, pack_bf16_pairs, pack_small,
                                              small_bfloat16_rows)

# (out, in): built-in target, its draft, the 56M model of cpu_throughput.py
SHAPES = {"target": [(512, 256), (256, 256), (1408, 256), (256, 704), (8192, 256)],
          "draft": [(256, 128), (128, 128), (704, 128), (128, 352), (8192, 128)],
          "56m": [(1024, 512), (512, 512), (2816, 512), (512, 1408)]}
# the wide model of the quantization issue (hidden 2048, intermediate 5632, 16 heads, 8 KV heads)
WIDE = [(4096, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]


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
    parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=200, help="whole forwards per layout and size")
    parser.add_argument("--engine", type=lambda s: [int(x) for x in s.split(",")], default=[],
                        help="concurrencies of the engine A/B with and without small_linear (default: none)")
    parser.add_argument("--engine-rounds", type=int, default=4)
    parser.add_argument("--engine-small-rows", type=int, default=None,
                        help="with --engine: a further engine whose layers take small_linear up to this many rows "
                        "(SMALL_ROWS for it) and the packed weight past them, against the default")
    parser.add_argument("--wide", action="store_true", help="the float32 table at the wide model's shapes too")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = load_cpu_kernels()
    small = kernels.small_linear if kernels is not None and kernels.has_small_linear else None
    print(f"{torch.get_num_threads()} threads; us per call, packed / plain"
          + (" / small_linear, float32 copy / small_linear, bfloat16 copy" if small else "")
          + " (weights of bfloat16 values, as a bfloat16 checkpoint served in float32)\n")
    print("| model | out x in | kept | " + " | ".join(f"{m} rows" for m in args.rows) + " |")
    print("|---|---|---|" + "---|" * len(args.rows))
    for model, shapes in {**SHAPES, **({"wide": WIDE} if args.wide else {})}.items():
        for out_features, in_features in shapes:
            w = torch.randn(out_features, in_features).bfloat16().float()
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            laid_out, halved = pack_small(w), pack_small(w.bfloat16())
            cells = []
            for m in args.rows:
                x = torch.randn(m, in_features)
                calls = max(20, 4000 // m)
                a = best_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), calls)
                b = best_us(lambda: F.linear(x, w), calls)
                c = f" / {best_us(lambda: small(x, laid_out, None, out_features), calls):.0f}" \
                    f" / {best_us(lambda: small(x, halved, None, out_features), calls):.0f}" \
                    if small is not None and (m <= SMALL_ROWS or SMALL_ONLY) else ""
                cells.append(f"{a:.0f} / {b:.0f}{c}")
            kept = "packed"
            if small is not None and SMALL_ONLY:
                kept = "small_linear's bfloat16 copy alone"
            elif w.numel() < SMALL_FLOAT32_WEIGHT:
                kept = f"plain too, up to {SMALL_ROWS} rows"
            print(f"| {model} | {out_features} x {in_features} | {kept} | " + " | ".join(cells) + " |", flush=True)
    if kernels is not None and kernels.has_small_linear_bf16:
        bfloat16_table(kernels)
    whole_forwards(args.repeats, small is not None)
    if args.engine and small is not None:
        engine_ab(args.engine, args.engine_rounds, args.engine_small_rows)


def bfloat16_table(kernels) -> None:
    """bfloat16 weights: oneDNN's packed call against small_linear_bf16 (up to 16 rows) and, where
    the CPU has AMX, amx_linear (up to AMX_ROWS), us per call."""
    amx = kernels.has_amx_linear
    rows = [1, 2, 4, 5, 8, 12, 16] + ([32, AMX_ROWS] if amx else [])
    print("\nbfloat16: us per call, packed / small_linear_bf16" + (" / amx_linear" if amx else "")
          + " (* the rows Linear runs through a kernel)\n")
    print("| model | out x in | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    shapes = {**SHAPES, "wide": WIDE}
    for model, pairs in shapes.items():
        for out_features, in_features in pairs:
            w = torch.randn(out_features, in_features, dtype=torch.bfloat16)
            packed, small = torch.ops.mkldnn._reorder_linear_weight(w, 64), pack_bf16_pairs(w)
            kept = 0
            if w.numel() < SMALL_BFLOAT16_WEIGHT:
                kept = (amx and amx_linear_rows(out_features, in_features)) or small_bfloat16_rows(w.numel())
            cells = []
            for m in rows:
                x = torch.randn(m, in_features, dtype=torch.bfloat16)
                calls = max(20, 2000 // m)
                times = [best_us(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), calls)]
                times.append(best_us(lambda: kernels.small_linear_bf16(x, small, None, out_features), calls)
                             if m <= 16 else float("nan"))
                if amx:
                    times.append(best_us(lambda: kernels.amx_linear(x, small, None, out_features), calls))
                cells.append(" / ".join("-" if t != t else f"{t:.0f}" for t in times) + ("*" if m <= kept else ""))
            print(f"| {model} | {out_features} x {in_features} | " + " | ".join(cells) + " |", flush=True)


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


def without_small_linear(llm):
    """`llm` as `Linear` runs without the CPU kernels: MKL's GEMM up to PLAIN_ROWS rows over a
    plain float32 copy, oneDNN's packed call otherwise."""
    for module in llm.engine.runner.model.modules():
        if isinstance(module, linear.Linear) and module.small_kernel is not None:
            if getattr(module.small_kernel, "func", None) is load_cpu_kernels().small_linear:
                # pack_small's [out / 16, in, 16] back to [out, in]; a bfloat16 copy is not kept then
                plain = module.small.transpose(1, 2).reshape(-1, module.in_features)[:module.out_features]
                module.small = plain.contiguous() if plain.dtype == torch.float32 else None
            module.small_kernel = None
    return llm


@torch.inference_mode()
def whole_forwards(repeats: int, small: bool) -> None:
    from tokenmill import LLM
    from tokenmill.config import DEFAULT_DRAFT_MODEL_DIR, DEFAULT_MODEL_DIR

    llms = {}
    layouts = ["packed", "mkl"] + (["small_linear"] if small else [])
    for layout in layouts:
        # read by Linear.pack when each model loads (small_linear's copy alone: as the CPU has it)
        linear.SMALL_FLOAT32_WEIGHT = 0 if layout == "packed" else SMALL_FLOAT32_WEIGHT
        linear.SMALL_ONLY = SMALL_ONLY if layout == "small_linear" else False
        for model, path in (("target", DEFAULT_MODEL_DIR), ("draft", DEFAULT_DRAFT_MODEL_DIR)):
            llm = LLM(str(path), dtype="float32", max_num_seqs=1, kv_cache_memory="64MiB")
            llms[model, layout] = without_small_linear(llm) if layout == "mkl" else llm
    linear.SMALL_FLOAT32_WEIGHT, linear.SMALL_ONLY = SMALL_FLOAT32_WEIGHT, SMALL_ONLY
    print(f"\nwhole forwards, ms (median of {repeats}): every layer packed / small ones plain through MKL up to "
          f"{PLAIN_ROWS} rows" + ("" if not small else " / every layer on small_linear's copy alone" if SMALL_ONLY
                                  else f" / small ones through small_linear up to {SMALL_ROWS} rows")
          + "\n")
    print("| model | 1 token | 2 tokens | 5 tokens | 8 tokens |\n|---|---|---|---|---|")
    for model in ("target", "draft"):
        other = "draft" if model == "target" else "target"
        cells = []
        for n in (1, 2, 5, 8):
            runs = {layout: forward_fn(llms[model, layout], n) for layout in layouts}
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


def without_amx(llm):
    """`llm` with its bfloat16 layers on small_linear_bf16 where they had amx_linear (the same
    weight layout; the rows small_linear_bf16 takes as `Linear.pack` gives them without AMX)."""
    kernels = load_cpu_kernels()
    for module in llm.engine.runner.model.modules():
        if isinstance(module, linear.Linear) and getattr(module.small_kernel, "func", None) is kernels.amx_linear:
            module.small_kernel = partial(kernels.small_linear_bf16, out=module.out_features)
            module.small_rows = small_bfloat16_rows(module.out_features * 2 * module.small.shape[1])
    return llm


def engine_ab(concurrencies: list[int], rounds: int, small_rows: int | None = None) -> None:
    """The engine with its small-step kernels against itself without them (float32: MKL up to
    PLAIN_ROWS rows; bfloat16: oneDNN's packed call), and, where the CPU has AMX, with
    amx_linear against small_linear_bf16. `small_rows`: also an engine built with SMALL_ROWS
    set to it (the rows a float32 layer takes small_linear for, and so the one-call forward) and
    the packed weight past them. Where small_linear's copy is a float32 layer's only one
    (SMALL_ONLY), also an engine whose layers keep the packed weight for steps past SMALL_ROWS."""
    from speculative import function_prompts, run, run_turns, split_files

    from tokenmill import LLM
    _, val_files = split_files()
    prompts = [prompt for prompt, _ in function_prompts(val_files, 2 * max(max(concurrencies), 4))]
    kernels = load_cpu_kernels()
    amx = kernels.has_amx_linear
    variants = {"none": without_small_linear, "small_linear": without_amx if amx else lambda llm: llm}
    if amx:
        variants["amx_linear"] = lambda llm: llm
    # each engine's settings of layers/linear.py while it is built; the default's: as the CPU has them
    settings = {"none": {"SMALL_ONLY": False}}
    if SMALL_ONLY and not amx:
        name = f"packed past {SMALL_ROWS} rows"
        settings[name] = {"SMALL_ONLY": False}
        variants = {name: lambda llm: llm, **variants}
    if small_rows is not None:
        name = f"{small_rows} rows"
        settings[name] = {"SMALL_ROWS": small_rows, "SMALL_ONLY": False}
        variants = {name: lambda llm: llm, **variants}
    names = list(variants)
    last = names[-1]
    print("\nthe engine, output tokens/s (median of rounds): " + ", ".join(names)
          + f"; the ratios of {last}'s tok/s and TPOT to each other's\n")
    print("| concurrency | " + " | ".join(f"tok/s, {n}" for n in names) + " | "
          + " | ".join(f"vs {n}: tok/s / TPOT" for n in names[:-1]) + " | identical outputs |")
    print("|---|" + "---|" * (2 * len(names)))
    for c in concurrencies:
        batch = prompts[:max(2 * c, 8)]
        llms = {}
        for name, make in variants.items():
            defaults = {key: getattr(linear, key) for key in settings.get(name, {})}
            for key, value in settings.get(name, {}).items():
                setattr(linear, key, value)
            try:
                llms[name] = make(LLM(None, dtype="auto", max_num_seqs=c))
            finally:
                for key, value in defaults.items():
                    setattr(linear, key, value)
        for llm in llms.values():
            run(llm, batch[:2])  # warm-up
        results = []
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            results.append(run_turns({name: llms[name] for name in order}, batch, 0.5))
        tps = [statistics.median(x[name]["output_throughput"] for x in results) for name in names]
        ratios = [f"{statistics.median(x[last]['output_throughput'] / x[n]['output_throughput'] for x in results):.2f}x"
                  f" / {statistics.median(x[n]['tpot_ms'] / x[last]['tpot_ms'] for x in results):.2f}x"
                  for n in names[:-1]]
        same = all(x[n]["token_ids"] == x[last]["token_ids"] for x in results for n in names)
        print(f"| {c} | " + " | ".join(f"{t:.0f}" for t in tps) + " | " + " | ".join(ratios) + f" | {same} |",
              flush=True)
        del llms


if __name__ == "__main__":
    main()
