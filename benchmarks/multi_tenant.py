"""Fairness between tenants: one floods, one is interactive; fcfs, priority and fair in one run.

    python benchmarks/multi_tenant.py [--flood 256] [--interactive 30] [--max-num-seqs 32]
                                      [--only admission|policies] [--output-json FILE]

Workload (issue 18), on the built-in model served by `tokenmill serve --tenants FILE`:
- `flood` (weight 1) sends --flood requests at once (prompts of --flood-input tokens,
  --flood-output tokens each, ignore_eos);
- `interactive` (weight 1) sends one request a second from 2 s on (prompts of 32..64
  tokens, 64 output tokens), --interactive of them.
Each policy runs in a fresh server process: `fcfs`; `priority` with the interactive
tenant in lane 0 and the flood in lane 10 (the operator set lanes); `fair` with both
in lane 0 (fairness with no lanes set). Reported: the interactive tenant's p50/p99
TTFT and TPOT, aggregate output throughput, and Jain's index over weighted service
(the interactive tenant asks for less than its share, so J < 1 is its demand, not
unfairness: J is 1 only when both are backlogged). Targets: under fair, interactive
p99 TTFT at least 5x better than under fcfs; aggregate throughput at least 95% of fcfs.

`--only admission` times the admission path itself (key lookup, lane, admit, and the
release that writes SQLite) over the local store with every limit set: target < 50 us.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tokenmill.bench.client import run_benchmark
from tokenmill.bench.tenants import fairness_index, interleave, load_tenant_mix, tenant_report, with_tenant
from tokenmill.bench.workloads import text_requests
from tokenmill.config import DEFAULT_MODEL_DIR

POLICIES = ("fcfs", "priority", "fair")


def tenants_file(root: Path, policy: str) -> Path:
    flood_lane = 10 if policy == "priority" else 0
    path = root / f"tenants-{policy}.json"
    path.write_text(json.dumps({"tenants": [
        {"name": "flood", "api_keys": ["sk-flood"], "weight": 1, "priority": flood_lane},
        {"name": "interactive", "api_keys": ["sk-interactive"], "weight": 1, "priority": 0}]}))
    return path


def serve(root: Path, policy: str, port: int, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           "--served-model-name", "m", "--tenants", str(tenants_file(root, policy)), "--limits-db",
           str(root / f"{policy}.db"), "--scheduling-policy", policy, "--max-num-seqs", str(args.max_num_seqs),
           "--disable-access-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the {policy} server did not start") from None
            time.sleep(0.2)


def run_policy(root: Path, policy: str, port: int, args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    n_flood = args.flood_input
    flood = with_tenant(text_requests(args.flood, (n_flood, n_flood), (args.flood_output, args.flood_output),
                                      tokenizer, seed=1), "flood")
    interactive = with_tenant(text_requests(args.interactive, (32, 64), (64, 64), tokenizer, seed=2), "interactive")
    requests, offsets = interleave([(flood, [0.0] * len(flood)),
                                    (interactive, [2.0 + i for i in range(len(interactive))])])
    mix = load_tenant_mix(tenants_file(root, policy))
    proc = serve(root, policy, port, args)
    try:
        records, duration = asyncio.run(run_benchmark(f"http://127.0.0.1:{port}", "m", requests, offsets=offsets,
                                                      tenant_keys=mix.keys, ignore_eos=True))
    finally:
        proc.terminate()
        proc.wait(60)
    report = tenant_report(records, duration, mix.weights)
    inter = report["interactive"]
    output = sum(t["output_tokens"] for t in report.values())
    failed = sum(t["failed"] for t in report.values())
    return {"policy": policy, "duration_s": duration, "output_throughput": output / duration, "failed": failed,
            "interactive_p50_ttft_ms": inter["median_ttft_ms"], "interactive_p99_ttft_ms": inter["p99_ttft_ms"],
            "interactive_p50_tpot_ms": inter["median_tpot_ms"], "interactive_p99_tpot_ms": inter["p99_tpot_ms"],
            "flood_p50_ttft_ms": report["flood"]["median_ttft_ms"], "jain_index": fairness_index(report),
            "tenants": report}


def admission_cost(n: int = 20000) -> dict:
    """Microseconds per request of the admission path and of the release, local store."""
    from tokenmill.server.limits import Grant, Limits, LocalLimitStore
    from tokenmill.server.serving import Origin  # noqa: F401 - the server's import path, warmed
    from tokenmill.server.tenancy import Tenancy
    from tokenmill.server.tenants import parse_tenants

    big = 10**12
    tenants = parse_tenants({"tenants": [{"name": "acme", "api_keys": ["sk-acme"], "priority": 0, "weight": 2,
                                          "requests_per_minute": big, "tokens_per_minute": big,
                                          "max_concurrent_requests": big, "token_quota": big}]})
    with tempfile.TemporaryDirectory() as tmp:
        limits = Limits(tenants, LocalLimitStore(Path(tmp) / "limits.db"))
        tenancy = Tenancy(limits)
        grants: list[Grant] = []
        start = time.perf_counter()
        for i in range(n):
            tenant = tenancy.authenticate("Bearer sk-acme")
            tenancy.origin(tenant, None, "m")
            grants.append(limits.admit(tenant, f"r{i}", 300))
        admitted = time.perf_counter()
        for g in grants:
            limits.release(g, 100, 50)
        released = time.perf_counter()
        limits.close()
    return {"admit_us": (admitted - start) / n * 1e6, "release_us": (released - admitted) / n * 1e6}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flood", type=int, default=256)
    p.add_argument("--flood-input", type=int, default=128)
    p.add_argument("--flood-output", type=int, default=128)
    p.add_argument("--interactive", type=int, default=30)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--only", choices=["admission", "policies"], default=None)
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    result: dict = {}
    if args.only != "policies":
        rounds = [admission_cost() for _ in range(3)]
        result["admission"] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"admission: {result['admission']['admit_us']:.1f} us per request (key, lane, admit; target < 50), "
              f"release {result['admission']['release_us']:.1f} us (SQLite write)")
    if args.only != "admission":
        with tempfile.TemporaryDirectory() as tmp:
            runs = [run_policy(Path(tmp), policy, args.port + i, args)
                    for i, policy in enumerate(args.policies.split(","))]
        result["policies"] = runs
        base = next((r for r in runs if r["policy"] == "fcfs"), runs[0])
        print(f"\n{'policy':<9} {'tok/s':>7} {'vs fcfs':>7} {'inter p50 TTFT':>14} {'p99 TTFT':>9} "
              f"{'p50 TPOT':>9} {'p99 TPOT':>9} {'flood p50 TTFT':>14} {'Jain':>5} {'failed':>6}")
        for r in runs:
            print(f"{r['policy']:<9} {r['output_throughput']:7.1f} {r['output_throughput'] / base['output_throughput']:7.3f}"
                  f" {r['interactive_p50_ttft_ms']:12.0f}ms {r['interactive_p99_ttft_ms']:7.0f}ms"
                  f" {r['interactive_p50_tpot_ms']:7.1f}ms {r['interactive_p99_tpot_ms']:7.1f}ms"
                  f" {r['flood_p50_ttft_ms']:12.0f}ms {r['jain_index']:5.2f} {r['failed']:6d}")
        for r in runs:
            if r is not base:
                print(f"{r['policy']}: interactive p99 TTFT {base['interactive_p99_ttft_ms'] / r['interactive_p99_ttft_ms']:.1f}x"
                      f" better than fcfs (target >= 5x for fair); throughput "
                      f"{r['output_throughput'] / base['output_throughput']:.3f} of fcfs (target >= 0.95)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
