"""Data parallel on this machine: the prefix-aware router against round-robin, and two
1-core replicas against one engine on 2 cores, each served by `tokenmill serve` in a fresh
process and measured by `bench serve`'s client from this process.

    python benchmarks/data_parallel.py [--only router,scaling] [--kv-cache-memory 96MiB]

router: 2 replicas (1 core each), the shared-prefix workload of issue 19: 8 random prefixes
of 1,024 tokens, 256 requests each taking a prefix at random plus a random suffix of 32..64
tokens, 32 output tokens, 32 in flight. Each replica's KV cache (--kv-cache-memory, float32)
holds about 6 of the 8 prefixes next to the running requests: routed by prefix, a replica
needs only its share of them; round-robin needs all 8 in each. Reports the prefix-cache hit
rate (hit tokens / looked-up tokens, from /metrics), output tokens/s and p99 TTFT.
Targets: hit rate >= 1.8x round-robin's, throughput >= 1.3x.

scaling: serve_throughput.py's random workload (64 prompts, 32..256 in and out, all in
flight) on one engine with both cores, on --data-parallel-size 2 (1 core each) and on
--tensor-parallel-size 2 (two gloo ranks of 1 core each). No target: see the README for
what this machine can and cannot show.

Model: serve_throughput.py's random Llama (hidden 512, 8 layers, vocabulary 8,192), dummy
weights, max_model_len 2,048.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from serve_throughput import SHAPE, launch_server, make_model_dir  # noqa: E402

from tokenmill.bench.client import run_benchmark  # noqa: E402
from tokenmill.bench.workloads import BenchRequest, random_requests  # noqa: E402


def shared_prefix_workload(num: int = 256, num_prefixes: int = 8, prefix_len: int = 1024,
                           seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    vocab = SHAPE["vocab_size"]
    prefixes = [[rng.randrange(16, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    out = []
    for _ in range(num):
        tokens = rng.choice(prefixes) + [rng.randrange(16, vocab) for _ in range(rng.randint(32, 64))]
        out.append(BenchRequest(tokens, 32, len(tokens)))
    return out


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics") as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels
            or set(s.labels) == {"model_name"}}


def serve(model: Path, port: int, flags: list[str], requests: list[BenchRequest], concurrency: int) -> dict:
    proc, url = launch_server(model, port, "--max-model-len", "2048", *flags)
    try:
        before = scrape(url)
        records, elapsed = asyncio.run(run_benchmark(url, "bench", requests, max_concurrency=concurrency))
        after = scrape(url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
    queries = after["tokenmill:prefix_cache_queries_total"] - before["tokenmill:prefix_cache_queries_total"]
    hits = after["tokenmill:prefix_cache_hits_total"] - before["tokenmill:prefix_cache_hits_total"]
    ttfts = [r.ttft for r in records if r.ttft is not None]
    output = sum(r.output_tokens for r in records)
    return {"elapsed_s": elapsed, "output_tokens": output, "output_throughput": output / elapsed,
            "hit_rate": hits / queries if queries else 0.0, "p99_ttft_ms": 1000 * float(np.percentile(ttfts, 99)),
            "median_ttft_ms": 1000 * float(np.percentile(ttfts, 50))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="router,scaling")
    parser.add_argument("--kv-cache-memory", default="96MiB", help="per replica, float32 (router part)")
    parser.add_argument("--port", type=int, default=18100)
    parser.add_argument("--output-json", default="bench_results/data_parallel.json")
    args = parser.parse_args()
    only = set(args.only.split(","))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model_dir(Path(tmp))
        if "router" in only:
            requests = shared_prefix_workload()
            common = ["--data-parallel-size", "2", "--kv-cache-memory", args.kv_cache_memory, "--dtype", "float32"]
            for policy in ("round_robin", "prefix"):
                r = serve(model, args.port, [*common, "--data-parallel-routing", policy], requests, 32)
                results[f"router_{policy}"] = r
                print(f"router {policy:11s}: hit rate {r['hit_rate']:.3f}, {r['output_throughput']:,.1f} output "
                      f"tok/s, p99 TTFT {r['p99_ttft_ms']:,.0f} ms, median TTFT {r['median_ttft_ms']:,.0f} ms, "
                      f"{r['elapsed_s']:.1f} s", flush=True)
            rr, px = results["router_round_robin"], results["router_prefix"]
            print(f"prefix / round-robin: hit rate {px['hit_rate'] / max(rr['hit_rate'], 1e-9):.2f}x (target 1.8x), "
                  f"throughput {px['output_throughput'] / rr['output_throughput']:.2f}x (target 1.3x), p99 TTFT "
                  f"{rr['p99_ttft_ms'] / px['p99_ttft_ms']:.2f}x better")
        if "scaling" in only:
            requests = random_requests(64, (32, 256), (32, 256), SHAPE["vocab_size"], seed=0)
            for name, flags in (("one_engine_2_cores", []), ("dp2_1_core_each", ["--data-parallel-size", "2"]),
                                ("tp2_1_core_each", ["--tensor-parallel-size", "2"])):
                r = serve(model, args.port, flags, requests, 64)
                results[name] = r
                print(f"{name:18s}: {r['output_throughput']:,.1f} output tok/s, median TTFT "
                      f"{r['median_ttft_ms']:,.0f} ms, {r['elapsed_s']:.1f} s", flush=True)
            base = results["one_engine_2_cores"]["output_throughput"]
            print(f"data parallel 2x1 / one engine on 2 cores: {results['dp2_1_core_each']['output_throughput'] / base:.3f}; "
                  f"tensor parallel 2x1 / one engine: {results['tp2_1_core_each']['output_throughput'] / base:.3f}")
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
