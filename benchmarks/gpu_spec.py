"""The speculative-decoding section of gpu_throughput.py (`--only spec`): benchmarks/speculative.py
on the device, the built-in model with its draft model and EAGLE head, and n-gram. The target's
verification steps replay its CUDA graphs (a row a token), the draft model's and the EAGLE head's
forwards replay graphs of their own. Takes the script's Bench."""

from __future__ import annotations

import json
import subprocess
import sys

from gpu_quant import ROOT

# issue 17's targets, by (set, method) at concurrency 1: TPOT speed-up
TPOT_TARGETS = {("rewrite", "ngram"): 1.8, ("completion", "draft"): 1.3}


def spec(bench) -> None:
    args = bench.args
    out = bench.out / "speculative.json"
    # several engines share the device in one process, each taking a share of its memory
    engine = {"gpu_memory_utilization": 0.08} if bench.cuda else {"device": "cpu"}
    cmd = [sys.executable, "benchmarks/speculative.py", "--concurrency", args.spec_concurrency,
           "--methods", args.spec_methods, "--sets", "completion,rewrite", "--rounds", str(args.spec_rounds),
           "--engine-args", json.dumps(engine), "--output-json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.spec_timeout_s)
    (bench.out / "speculative.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        bench.rows.append(("speculative decoding", f"failed (rc {proc.returncode}; speculative.log)", ""))
        return
    rows = json.loads(out.read_text())
    bench.results["speculative"] = rows
    bench.rows.append(("speculative (built-in model): set, concurrency, method", "TPOT speed-up / tok/s ratio / "
                       "acceptance / identical outputs", ""))
    for r in rows:
        if r["method"] == "none":
            continue
        target = TPOT_TARGETS.get((r["set"], r["method"])) if r["concurrency"] == 1 else None
        acceptance = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        bench.rows.append((f"  {r['set']}, {r['concurrency']}, {r['method']}",
                           f"{r['tpot_speedup']:.2f}x / {r['throughput_ratio']:.2f}x / {acceptance} / "
                           f"{r['identical_outputs']:.0%}",
                           f"TPOT >= {target}x; tok/s >= 0.97x" if target else "tok/s >= 0.97x"))
