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


def verify_attention(bench, k: int = 4) -> None:
    """`--only spec_attn`: one layer's attention in a verification step as the target's CUDA
    graphs run it (a row a token, k + 1 rows a request; attention/triton.py), the model's heads,
    at --spec-attn-shapes (requests x context): each row reading its request's whole context
    (no row_spans, as before 2026-12-07) against each request's rows reading it once, and a
    decode of one row a request, the floor. Each time is the median of triton's do_bench (on the
    CPU, of a few calls under Triton's interpreter: the code runs, the times mean nothing)."""
    import os
    import time

    import numpy as np
    import torch

    if not bench.cuda and os.environ.get("TRITON_INTERPRET") != "1":
        bench.rows.append(("verification attention", "skipped: needs CUDA (or TRITON_INTERPRET=1)", ""))
        return
    from tokenmill.executor.attention import AttentionMetadata, row_spans, token_rows
    from tokenmill.executor.attention.base import default_to_device
    from tokenmill.executor.attention.kv_cache import KVCache
    from tokenmill.executor.attention.triton import TritonBackend

    shape, block = bench.shape, 16
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim = shape.get("head_dim", shape["hidden_size"] // heads)
    device = torch.device("cuda" if bench.cuda else "cpu")
    dtype = torch.bfloat16 if bench.cuda else torch.float32
    to_device = default_to_device(device)
    detail = []
    for batch, context in (tuple(map(int, s.split("x"))) for s in bench.args.spec_attn_shapes.split(",")):
        per_seq = -(-context // block)
        cache = KVCache(torch.randn(1, 2, batch * per_seq * block, kv_heads, dim, dtype=dtype, device=device))
        table = np.random.default_rng(0).permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)

        def step(query: int, spans: int):
            """A step of `query` tokens a request ending at `context`, a row a token, read in runs of
            up to `spans` rows (0: no runs, each row alone)."""
            query_lens = np.full(batch, query, dtype=np.int32)
            seq_lens = np.tile(np.arange(context - query + 1, context + 1, dtype=np.int32), batch)
            rows = token_rows(table, query_lens)
            last = seq_lens - 1  # each row's position
            slots = rows[np.arange(len(rows)), last // block].astype(np.int64) * block + last % block
            md = AttentionMetadata.from_host(np.ones(len(rows), dtype=np.int32), seq_lens, rows,
                                             torch.from_numpy(slots).to(device), block, to_device)
            if spans:
                md.row_spans, md.max_span = to_device(row_spans(query_lens, spans)), spans
            backend = TritonBackend(cache, block, heads)
            backend.begin_step(md)
            gen = torch.Generator(device).manual_seed(query)  # the same step with or without spans
            q = torch.randn(len(rows), heads, dim, dtype=dtype, device=device, generator=gen)
            kv = torch.randn(len(rows), kv_heads, dim, dtype=dtype, device=device, generator=gen)
            return lambda: backend(q, kv, kv, 0)

        def timed(fn) -> float:
            if bench.cuda:
                import triton.testing
                fn()
                return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6

        alone, at_once = step(k + 1, 0), step(k + 1, k + 1)
        diff = (alone().float() - at_once().float()).abs().max().item()  # the same outputs, either way
        each, runs = timed(alone), timed(at_once)
        # a decode step, in a graph captured for runs (its tile sized for k + 1 rows) and for decodes
        decode_in_runs, decode = timed(step(1, k + 1)), timed(step(1, 0))
        detail.append(dict(batch=batch, context=context, rows_alone_us=each, runs_us=runs, decode_us=decode,
                           decode_in_runs_kernel_us=decode_in_runs, max_diff=diff))
        bench.rows.append((f"verification attention, {batch} x {k + 1} rows, context {context}",
                           f"a row alone {each:.0f} us, a request's rows at once {runs:.0f} us ({each / runs:.2f}x); "
                           f"decode {decode:.0f} us, through the runs' kernel {decode_in_runs:.0f} us; "
                           f"max diff {diff:.1e}", ""))
        del cache
    bench.results["verification_attention"] = detail
