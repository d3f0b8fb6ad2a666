"""`tokenmill bench serve`: load an OpenAI-compatible server and report TTFT, TPOT, ITL,
E2E, throughput, goodput and cost (definitions in bench/metrics.py)."""

from __future__ import annotations

import argparse
import asyncio
import math
import urllib.error
import urllib.request

from tqdm.auto import tqdm

from tokenmill.bench.client import RequestRecord, run_benchmark
from tokenmill.bench.metrics import parse_slo, summarize
from tokenmill.bench.report import print_table, write_json
from tokenmill.bench.workloads import parse_range, random_requests


def check_args(args: argparse.Namespace) -> dict[str, float] | None:
    """Raises ValueError naming the flag; returns the parsed SLO."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.num_gpus < 1:
        raise ValueError(f"--num-gpus must be >= 1, got {args.num_gpus}")
    if args.cost_per_hour is not None and not args.cost_per_hour > 0:
        raise ValueError(f"--cost-per-hour must be > 0, got {args.cost_per_hour}")
    if not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    return parse_slo(args.slo) if args.slo else None


def vocab_size(tokenizer: str) -> int:
    # an HTTP client only (DESIGN.md): the tokenizer comes from transformers, not from the engine
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(tokenizer))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        raise ValueError(f"--tokenizer: cannot load {tokenizer!r} to make prompts of exact lengths; pass "
                         f"--tokenizer DIR with the server's tokenizer ({type(e).__name__}: {e})") from None


def check_server(base_url: str) -> None:
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=10):
            pass
    except urllib.error.HTTPError:
        pass  # it answers (401 without a key, 404 on servers without /v1/models): requests will tell
    except OSError as e:
        raise ValueError(f"--base-url: cannot reach {base_url}: {getattr(e, 'reason', e)}") from None


def bench_serve(args: argparse.Namespace) -> int:
    slo = check_args(args)
    input_len = parse_range(args.input_len, "--input-len")
    output_len = parse_range(args.output_len, "--output-len")
    vocab = vocab_size(args.tokenizer or args.model)
    check_server(args.base_url)
    requests = random_requests(args.warmup + args.num_prompts, input_len, output_len, vocab, seed=args.seed)
    warmup, measured = requests[:args.warmup], requests[args.warmup:]
    bar = tqdm(total=len(measured), desc="bench serve", unit="req", disable=args.no_progress, dynamic_ncols=True)

    def done(_: RequestRecord) -> None:
        bar.update(1)

    try:
        records, duration = asyncio.run(run_benchmark(
            args.base_url, args.model, measured, request_rate=args.request_rate, burstiness=args.burstiness,
            seed=args.seed, api_key=args.api_key, max_concurrency=args.max_concurrency, warmup=warmup,
            on_done=done))
    finally:
        bar.close()
    result = summarize(records, duration, slo=slo, cost_per_hour=args.cost_per_hour, num_gpus=args.num_gpus)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    print_table(f"tokenmill bench serve: {args.base_url} ({args.model}), rate {rate}, "
                f"concurrency {args.max_concurrency or 'unbounded'}", result)
    failed = [r for r in records if not r.ok]
    if failed:
        print(f"{len(failed)} of {len(records)} requests failed; first error: {failed[0].error}")
    if args.output_json:
        config = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)  # JSON has no infinity
                  for k, v in vars(args).items() if k != "api_key"}
        write_json(args.output_json, {**result, "config": config}, records if args.save_detailed else None)
    return 0 if result["completed"] else 1
