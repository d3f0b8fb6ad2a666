"""The Triton decode-attention kernel's launch settings against the HBM roofline, on a GPU.

    python benchmarks/triton_decode_tune.py [--shapes 64x512,256x512,256x1024] [--output-json F]

For each batch x context (Qwen3-0.6B's attention: 16 query heads, 8 KV heads, head dim 128,
bfloat16, block size 16, scattered blocks), every combination of key tile, warps, pipeline
stages and split count runs the backend's decode path for one layer; the time is the median
of triton.testing.do_bench over four layers' caches in turn (more bytes than the L2 holds).
Achieved bandwidth = K/V bytes read / time; every setting's output is checked against the
default setting's (max |diff|). The table is printed last, fastest first per shape.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

HEADS, KV_HEADS, DIM, BLOCK = 16, 8, 128, 16
LAYERS = 4


def make_step(batch: int, context: int, device: str = "cuda"):
    from tokenmill.executor.attention.base import AttentionMetadata, default_to_device
    from tokenmill.executor.attention.kv_cache import KVCache

    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    data = torch.randn((LAYERS, 2, num_blocks * BLOCK, KV_HEADS, DIM), dtype=torch.bfloat16, device=device)
    rng = np.random.default_rng(0)
    table = rng.permutation(num_blocks)[:batch * blocks_per_seq].reshape(batch, blocks_per_seq).astype(np.int32)
    seq_lens = np.full(batch, context, dtype=np.int32)
    pos = context - 1
    slots = torch.tensor(table[:, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK, device=device)
    md = AttentionMetadata.from_host(np.ones(batch, dtype=np.int32), seq_lens, table, slots, BLOCK,
                                     default_to_device(torch.device(device)))
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device=device)
    k = torch.randn(batch, KV_HEADS, DIM, dtype=torch.bfloat16, device=device)
    v = torch.randn(batch, KV_HEADS, DIM, dtype=torch.bfloat16, device=device)
    return KVCache(data), md, q, k, v


def run(cache, md, q, k, v, tile_n, warps, stages, splits):
    from tokenmill.executor.attention.triton import TritonBackend

    backend = TritonBackend(cache, BLOCK, HEADS, num_splits=splits)
    backend.decode_tile_n, backend.num_warps, backend.num_stages = tile_n, warps, stages
    backend.begin_step(md)
    layer = [0]

    def step():
        layer[0] = (layer[0] + 1) % LAYERS
        return backend(q, k, v, layer[0])

    return backend, step


def main() -> None:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="64x512,256x512,256x1024")
    p.add_argument("--tiles", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--splits", default="auto,1,2")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    splits = [None if s == "auto" else int(s) for s in args.splits.split(",")]
    results = []
    for shape in args.shapes.split(","):
        batch, context = map(int, shape.split("x"))
        cache, md, q, k, v = make_step(batch, context)
        kv_bytes = batch * context * KV_HEADS * DIM * 2 * 2
        _, ref_step = run(cache, md, q, k, v, 64, 4, 2, None)
        ref = ref_step().float()  # layer 1
        for tile_n, warps, stages, split in itertools.product(ints(args.tiles), ints(args.warps), ints(args.stages),
                                                              splits):
            row = dict(batch=batch, context=context, tile_n=tile_n, warps=warps, stages=stages,
                       splits=split or "auto")
            try:
                backend, step = run(cache, md, q, k, v, tile_n, warps, stages, split)
                step()  # compile; layer 1 again on the 4th call
                step(), step(), step()
                diff = (step().float() - ref).abs().max().item()  # layer 1
                ms = triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")
                row.update(us=ms * 1e3, gbs=kv_bytes / (ms * 1e-3) / 1e9, max_diff=diff,
                           used_splits=backend.plan.decodes.num_splits)
            except Exception as e:  # noqa: BLE001 - a setting the GPU refuses (shared memory) is a row too
                row.update(error=f"{type(e).__name__}: {str(e)[:120]}")
            results.append(row)
            print(row, flush=True)
        del cache
        torch.cuda.empty_cache()
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1))
    print(f"\n{torch.cuda.get_device_name()}: decode attention, {HEADS} heads / {KV_HEADS} KV heads, d {DIM}, bf16")
    for shape in args.shapes.split(","):
        batch, context = map(int, shape.split("x"))
        rows = sorted((r for r in results if (r["batch"], r["context"]) == (batch, context) and "us" in r),
                      key=lambda r: r["us"])
        default = next((r for r in rows if (r["tile_n"], r["warps"], r["stages"], r["splits"]) == (64, 4, 2, "auto")),
                       None)
        print(f"batch {batch} x context {context}: tile 64 warps 4 stages 2 {default['us']:.0f} us, "
              f"{default['gbs']:.0f} GB/s"
              if default else f"batch {batch} x context {context}")
        for r in rows[:5]:
            print(f"  tile {r['tile_n']:>3} warps {r['warps']} stages {r['stages']} splits {r['splits']}"
                  f" ({r['used_splits']}): {r['us']:.0f} us, {r['gbs']:.0f} GB/s, max diff {r['max_diff']:.1e}")


if __name__ == "__main__":
    main()
