"""The CPU decode attention kernel over a quantized KV cache (kv_cache_dtype int8 / fp8)
against the same kernel over a 16-bit cache: the kernel half of the quantized-KV measurement.

    python benchmarks/kv_cache_attention.py [--contexts 256,1024,2048,4096] [--batch 32] [--layers 1]
                                            [--shared-blocks]

One call = one layer's decode step: `batch` requests, each one query token over a context of
`ctx` tokens in scattered blocks of 16. Calls take the layers of a cache in turn, as a decode
step does: by default as many layers as the shape's model has (the built-in model 6, Llama-8B
32), up to 1 GiB of cache each, so that a layer's K and V come back from wherever a whole step's
worth of cache leaves them. `--layers 1` calls one layer over and over: its cache (8-16 MB at
the built-in shape) then stays in a large L3 between calls, which flatters the kernels that
wait on memory most. Caches: bfloat16 (the baseline, queries in bfloat16),
float32 (what this engine runs where the CPU has no native bfloat16), int8, fp8_e4m3 and
fp8_e5m2 (queries in bfloat16, each row's scale read beside it). Shapes: the built-in model's
attention (4 heads, 2 kv heads, head dim 64) and a Llama-8B-like one (32 heads, 8 kv heads,
head dim 128). The caches are allocated as the engine allocates its own, in huge pages where
Linux gives them (executor/huge_pages.py; --small-pages: as torch.zeros, 4 KB pages). Prints
the median time per call and the ratio to bfloat16.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from tokenmill.executor.attention.kv_cache import KVCache, quantize_rows
from tokenmill.executor.cpu_kernels import load_cpu_kernels
from tokenmill.executor.huge_pages import device_zeros

# heads, kv heads, head dim, the model's layers
SHAPES = {"builtin (4/2 heads, d 64)": (4, 2, 64, 6), "8b-like (32/8 heads, d 128)": (32, 8, 128, 32)}
MAX_CACHE_BYTES = 1 << 30  # a cache's layers, at most
CACHES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
BLOCK = 16


def time_calls(fns: dict, budget_s: float) -> dict:
    """Median seconds per call of each fn; the fns take turns (a few calls each, round after
    round until each has had budget_s), so that the machine's slow spells fall on all alike."""
    times = {name: [] for name in fns}
    spent = dict.fromkeys(fns, 0.0)
    for fn in fns.values():
        fn()
    while min(spent.values()) < budget_s or min(len(t) for t in times.values()) < 5:
        for name, fn in fns.items():
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                times[name].append(dt)
                spent[name] += dt
    return {name: statistics.median(t) for name, t in times.items()}


def in_pages(x: torch.Tensor, small_pages: bool) -> torch.Tensor:
    """x copied into memory allocated as the engine allocates its cache (huge pages), or as
    torch.zeros does (4 KB pages where Linux gives huge pages only when asked)"""
    y = torch.zeros_like(x) if small_pages else device_zeros(tuple(x.shape), x.dtype, "cpu")
    return y.copy_(x)


def num_layers(layers, kv_heads, dim, batch, ctx, cache_name):
    """layers, fewer where they would pass MAX_CACHE_BYTES"""
    layer_bytes = 2 * batch * -(-ctx // BLOCK) * BLOCK * kv_heads * dim * CACHES[cache_name].itemsize
    return max(1, min(layers, MAX_CACHE_BYTES // layer_bytes))


def setup(kernels, heads, kv_heads, dim, batch, ctx, cache_name, shared=False, small_pages=False, layers=1):
    """shared: every request reads the same blocks, so the context stays in the core's caches;
    the calls take the cache's `layers` in turn"""
    g = torch.Generator().manual_seed(0)
    blocks_per = -(-ctx // BLOCK)
    num_blocks = blocks_per if shared else batch * blocks_per
    num_slots = num_blocks * BLOCK
    kv = torch.randn(2, num_slots, kv_heads, dim, generator=g)
    dtype = CACHES[cache_name]
    qdtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    if dtype in (torch.bfloat16, torch.float32):
        k, v, ks, vs = kv[0].to(dtype), kv[1].to(dtype), None, None
    else:
        (k, ks), (v, vs) = quantize_rows(kv[0], dtype), quantize_rows(kv[1], dtype)
    pairs = (torch.stack((k, v)), None if ks is None else torch.stack((ks, vs)))  # [2, slots, ...]
    cache = KVCache(*(None if x is None else in_pages(x.expand(layers, *x.shape), small_pages) for x in pairs))
    each_layer = itertools.cycle([cache.layer(i) for i in range(layers)])
    table = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = table[None].expand(batch, -1).contiguous() if shared else table.view(batch, blocks_per)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, heads, dim, generator=g).to(qdtype)
    out = torch.empty_like(q)

    def call():
        k, v, ks, vs = next(each_layer)
        kernels.paged_decode_attention(out, q, k, v, table, seq_lens, BLOCK, dim ** -0.5, ks, vs)
    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="256,1024,2048,4096")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=1.0, help="timing budget per cache and context")
    parser.add_argument("--shared-blocks", action="store_true",
                        help="every request reads the same blocks: the context stays in cache, so the time is "
                             "the kernel's arithmetic (also prints ns per token and kv head per thread)")
    parser.add_argument("--layers", type=int, default=0,
                        help="layers of each cache that the calls take in turn (0: the shape's model's, up to "
                             "1 GiB of cache; 1: one layer over and over)")
    parser.add_argument("--small-pages", action="store_true",
                        help="caches in 4 KB pages (torch.zeros), not in the engine's huge pages")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels could not be built here")
    print(f"torch threads: {torch.get_num_threads()}; batch {args.batch}; block {BLOCK}")
    results = []
    for shape_name, (heads, kv_heads, dim, model_layers) in SHAPES.items():
        print(f"\n{shape_name}")
        print(f"{'ctx':>6} " + " ".join(f"{c:>18}" for c in [*CACHES, *([] if args.small_pages else ["bf16 4KB"])]))
        for ctx in [int(c) for c in args.contexts.split(",")]:
            layers = {name: 1 if args.shared_blocks else
                      num_layers(args.layers or model_layers, kv_heads, dim, args.batch, ctx, name) for name in CACHES}
            fns = {name: setup(kernels, heads, kv_heads, dim, args.batch, ctx, name, args.shared_blocks,
                               args.small_pages, layers[name]) for name in CACHES}
            if not args.small_pages:  # what the huge pages give
                fns["bf16 4KB"] = setup(kernels, heads, kv_heads, dim, args.batch, ctx, "bf16", args.shared_blocks,
                                        small_pages=True, layers=layers["bf16"])
            row = time_calls(fns, args.seconds)
            base = row["bf16"]
            print(f"{ctx:>6} " + " ".join(f"{t * 1e3:8.3f}ms {base / t:5.2f}x " for t in row.values()))
            if args.shared_blocks:
                units = args.batch * ctx * kv_heads / torch.get_num_threads()
                print(f"{'ns':>6} " + " ".join(f"{t / units * 1e9:17.1f} " for t in row.values()))
            print(f"{'layers':>6} " + " ".join(f"{layers[name.split()[0]]:>17} " for name in row))
            results.append({"shape": shape_name, "ctx": ctx, "batch": args.batch, "layers": layers,
                            "ms": {k: t * 1e3 for k, t in row.items()},
                            "speedup_vs_bf16": {k: base / t for k, t in row.items()}})
    print("\n(ratio: bf16 time / this cache's time; above 1 is faster than bf16)")
    if args.output_json:
        args.output_json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
