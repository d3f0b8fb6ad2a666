"""How many streamed chunks per second the `tokenmill bench serve` client takes in on one core.

    python benchmarks/bench_client.py [--num-prompts 128] [--output-len 2000] [--concurrency 64]

The known-timing test server (tests/bench/known_server.py) sends chunks without waiting:
model "flood" writes each chunk on its own (as a real server streams), "burst" writes all
of a request's chunks at once (the client's ceiling). It runs in its own process on the
second core, the client on the first (sched_setaffinity). The figure is chunks received /
duration as `bench serve` measures it (one token per chunk), and the client's CPU time per
chunk. Target: at least 5,000 chunks/s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tokenmill.cli import main as tokenmill

SERVER = Path(__file__).resolve().parent.parent / "tests" / "bench" / "known_server.py"


def start_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(SERVER), str(port)])
    os.sched_setaffinity(proc.pid, {max(os.sched_getaffinity(0))})
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1).close()
            return proc
        except OSError:
            if time.time() > deadline:
                proc.kill()
                raise RuntimeError("the known server did not start") from None
            time.sleep(0.1)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=18123)
    parser.add_argument("--output-json", default="bench_results/bench_client.json")
    args = parser.parse_args()

    server = start_server(args.port)  # on the last core
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the client: the first core
    rounds = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, model in enumerate(["flood", "burst"] * args.rounds):
                out = Path(tmp) / f"r{i}.json"
                cpu0 = cpu_seconds()
                code = tokenmill(["bench", "serve", "--base-url", f"http://127.0.0.1:{args.port}", "--model", model,
                                  "--tokenizer", "none", "--num-prompts", str(args.num_prompts), "--input-len", "16",
                                  "--output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
                                  "--no-progress", "--output-json", str(out)])
                cpu = cpu_seconds() - cpu0
                r = json.loads(out.read_text())
                if code or r["failed"]:
                    raise RuntimeError(f"the run failed: {r.get('first_error')}")
                chunks = r["total_output_tokens"]
                rounds.append({"server": model, "chunks": chunks, "duration_s": r["duration"], "chunks_per_s": chunks / r["duration"],
                               "client_cpu_us_per_chunk": 1e6 * cpu / chunks})
    finally:
        server.terminate()
        server.wait()
    for r in rounds:
        print(f"{r['server']}: {r['chunks']:,} chunks in {r['duration_s']:.2f} s = {r['chunks_per_s']:,.0f} chunks/s; "
              f"client CPU {r['client_cpu_us_per_chunk']:.1f} us/chunk (whole command)")
    best = {m: max(r["chunks_per_s"] for r in rounds if r["server"] == m) for m in ("flood", "burst")}
    print(f"client on one core, best of {args.rounds}: {best['flood']:,.0f} chunks/s with a chunk per send, "
          f"{best['burst']:,.0f} chunks/s with whole answers per send (target >= 5,000)")
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps({"rounds": rounds, "best_chunks_per_s": best, "target": 5000,
                                                  "config": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
