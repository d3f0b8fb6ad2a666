"""`tokenmill bench serve`: load an OpenAI-compatible server and report TTFT, TPOT, ITL,
E2E, throughput, goodput and cost (definitions in bench/metrics.py). It takes
`vllm bench serve`'s flags too (bench/vllm_args.py).

The pieces here (checks, tokenizer, workload, one run) are shared with `bench sweep`
and `bench sla` (bench/sweep.py). With --tenants, requests are sent as the tenants of a
server's tenants file in the shares of --tenant-mix, and reported per tenant (bench/tenants.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import urllib.error
import urllib.request
from typing import Any

from tqdm.auto import tqdm

from tokenmill.bench.client import RequestRecord, count_tokens, run_benchmark
from tokenmill.bench.metrics import (METRICS, PERCENTILES, parse_goodput, parse_percentile_metrics, parse_percentiles,
                                     parse_slo, summarize)
from tokenmill.bench.report import print_table, write_json
from tokenmill.bench.tenants import (TenantMix, assign_tenants, fairness_index, load_tenant_mix, print_tenant_table,
                                     tenant_report, with_tenant)
from tokenmill.bench.vllm_args import resolve, result_path, vllm_header
from tokenmill.bench.workloads import (
    WORKLOADS,
    BenchRequest,
    file_requests,
    parse_range,
    shared_prefix_requests,
    text_requests,
)


def check_args(args: argparse.Namespace) -> None:
    """Raises ValueError naming the flag."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.num_gpus < 1:
        raise ValueError(f"--num-gpus must be >= 1, got {args.num_gpus}")
    if args.cost_per_hour is not None and not args.cost_per_hour > 0:
        raise ValueError(f"--cost-per-hour must be > 0, got {args.cost_per_hour}")
    if not args.base_url.startswith(("http://", "https://")):
        raise ValueError(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    if args.workload not in ("random", "shared-prefix") and not args.workload.startswith("file:"):
        raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}, got {args.workload!r}")
    if args.workload == "shared-prefix" and (args.num_prefixes < 1 or args.prefix_len < 1):
        raise ValueError(f"--num-prefixes and --prefix-len must be >= 1, got {args.num_prefixes} and {args.prefix_len}")


def tenant_mix(args: argparse.Namespace) -> TenantMix | None:
    """The mix of --tenants and --tenant-mix, or None without --tenants. ValueError naming the flag."""
    if args.tenants is None:
        if args.tenant_mix is not None:
            raise ValueError("--tenant-mix needs --tenants FILE (the tenants and their keys)")
        return None
    return load_tenant_mix(args.tenants, args.tenant_mix)


def load_tokenizer(args: argparse.Namespace) -> Any | None:
    """The server's tokenizer, or None (prompt lengths then approximate, said in the report).
    A --tokenizer given explicitly must load."""
    name = args.tokenizer or args.model
    if name.lower() == "none":
        return None
    # an HTTP client only (DESIGN.md): the tokenizer comes from transformers, not from the engine
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds here
        if args.tokenizer:
            raise ValueError(f"--tokenizer: cannot load {name!r} ({type(e).__name__}: {e})") from None
        print(f"note: no tokenizer for {name!r} (pass --tokenizer DIR for exact prompt lengths); prompts are "
              f"common English words, about one token each")
        return None


def build_workload(args: argparse.Namespace, tokenizer: Any | None) -> tuple[list[BenchRequest], str]:
    """warm-up + measured requests, and a line that says what they are."""
    input_len = parse_range(args.input_len, "--input-len")
    output_len = parse_range(args.output_len, "--output-len")
    num = args.warmup + args.num_prompts
    lengths = "exact" if tokenizer is not None else "approximate, no tokenizer"
    if args.workload == "random":
        requests = text_requests(num, input_len, output_len, tokenizer, seed=args.seed)
        note = f"random: input {args.input_len} tokens ({lengths}), output {args.output_len} tokens"
    elif args.workload == "shared-prefix":
        requests = shared_prefix_requests(num, args.num_prefixes, args.prefix_len, input_len, output_len, tokenizer,
                                          seed=args.seed)
        note = (f"shared-prefix: {args.num_prefixes} prefixes of {args.prefix_len} tokens + suffixes of "
                f"{args.input_len} tokens ({lengths}), output {args.output_len} tokens")
    else:
        path = args.workload[len("file:"):]
        flag = f"--dataset-path {path}" if args.dataset_name else None
        requests, note = file_requests(path, num, output_len, tokenizer, seed=args.seed,
                                       fixed_output_len=args.sharegpt_output_len, flag=flag)
    if not args.ignore_eos:
        note += "; without ignore_eos, outputs may stop before their length"
    return requests, note


def first_model(base_url: str, api_key: str | None) -> str:
    """vLLM's default for --model: the first model the server lists."""
    url = base_url.rstrip("/") + "/v1/models"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.load(resp)["data"][0]["id"]
    except (OSError, ValueError, LookupError, TypeError) as e:
        raise ValueError(f"--model not given, and {url} names no model ({type(e).__name__}: {e})") from None


def check_server(base_url: str) -> None:
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=10):
            pass
    except urllib.error.HTTPError:
        pass  # it answers (401 without a key, 404 on servers without /v1/models): requests will tell
    except OSError as e:
        raise ValueError(f"--base-url: cannot reach {base_url}: {getattr(e, 'reason', e)}") from None


def run_once(args: argparse.Namespace, requests: list[BenchRequest], tokenizer: Any | None, *, request_rate: float,
             max_concurrency: int | None, slo: dict[str, float] | None = None, desc: str = "bench serve",
             metrics: tuple[str, ...] = METRICS, percentiles: tuple[float, ...] = PERCENTILES,
             mix: TenantMix | None = None) -> tuple[dict[str, Any], list[RequestRecord]]:
    """One run of the workload (the first --warmup requests left out); the summary (with the
    statistics of `metrics` at `percentiles`) and the records. With a tenant `mix` (the
    requests carry their tenants), each tenant's figures under `tenants` and Jain's index
    over weighted service as `jain_fairness_index`."""
    warmup, measured = requests[:args.warmup], requests[args.warmup:]
    bar = tqdm(total=len(measured), desc=desc, unit="req", disable=args.no_progress, dynamic_ncols=True)
    try:
        records, duration = asyncio.run(run_benchmark(
            args.base_url, args.model, measured, endpoint=args.endpoint, path=args.endpoint_path,
            ignore_eos=args.ignore_eos, request_rate=request_rate,
            burstiness=args.burstiness, seed=args.seed, api_key=args.api_key, max_concurrency=max_concurrency,
            warmup=warmup, on_done=lambda _: bar.update(1), tenant_keys=mix.keys if mix else None))
    finally:
        bar.close()
    token_counts = count_tokens(records, measured, tokenizer)
    result: dict[str, Any] = summarize(records, duration, slo=slo, cost_per_hour=args.cost_per_hour,
                                       num_gpus=args.num_gpus, metrics=metrics, percentiles=percentiles)
    result["token_counts"] = token_counts
    if mix is not None:
        result["tenants"] = tenant_report(records, duration, mix.weights, mix.shares)
        result["jain_fairness_index"] = fairness_index(result["tenants"])
    failed = [r for r in records if not r.ok]
    if failed:
        result["first_error"] = failed[0].error
    return result, records


def describe(args: argparse.Namespace, request_rate: float, max_concurrency: int | None) -> str:
    rate = "inf" if math.isinf(request_rate) else f"{request_rate:g}/s"
    return (f"{args.base_url} ({args.model}, {args.endpoint}), rate {rate}, "
            f"concurrency {max_concurrency or 'unbounded'}")


def config_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "api_key"}  # the key stays out of the file


def print_result(title: str, result: dict[str, Any], workload: str) -> None:
    print_table(title, result)
    if "tenants" in result:
        print_tenant_table(result["tenants"], result["jain_fairness_index"])
    print(f"workload: {workload}")
    print(f"token counts from {result['token_counts']}")
    if result["failed"]:
        print(f"{result['failed']} of {result['failed'] + result['completed']} requests failed; first error: "
              f"{result['first_error']}")


def prepare(args: argparse.Namespace, mix: TenantMix | None = None) -> tuple[list[BenchRequest], str, Any | None]:
    """Checks the flags; the workload (its requests sent as the tenants of `mix`, the
    warm-up and the measured requests each split by it), a line saying what it is, the
    tokenizer."""
    resolve(args)
    check_args(args)
    if args.model is None:
        args.model = first_model(args.base_url, args.api_key or (next(iter(mix.keys.values())) if mix else None))
    tokenizer = load_tokenizer(args)
    requests, workload = build_workload(args, tokenizer)
    if mix is not None:
        names = (assign_tenants(args.warmup, mix.shares, args.seed)
                 + assign_tenants(args.num_prompts, mix.shares, args.seed))
        requests = with_tenant(requests, names)
        workload += f"; tenants from {args.tenants}: {mix.describe()}"
    if args.endpoint == "chat" and tokenizer is not None:
        workload += "; the chat template adds tokens around each prompt"
    check_server(args.base_url)
    return requests, workload, tokenizer


def bench_serve(args: argparse.Namespace) -> int:
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.goodput and args.slo:
        raise ValueError("--goodput and --slo both set the goodput objectives; give one")
    if args.save_result and args.output_json:
        raise ValueError("--save-result and --output-json both write the result; give one")
    slo = parse_goodput(args.goodput) if args.goodput else parse_slo(args.slo) if args.slo else None
    stats = {"metrics": parse_percentile_metrics(args.percentile_metrics),
             "percentiles": parse_percentiles(args.metric_percentiles)}
    mix = tenant_mix(args)
    requests, workload, tokenizer = prepare(args, mix)
    result, records = run_once(args, requests, tokenizer, request_rate=args.request_rate,
                               max_concurrency=args.max_concurrency, slo=slo, mix=mix, **stats)
    print_result(f"tokenmill bench serve: {describe(args, args.request_rate, args.max_concurrency)}", result, workload)
    header = vllm_header(args)
    path = result_path(args, header["date"]) if args.save_result else args.output_json
    if path:
        write_json(path, {**header, **result, "workload": workload, "config": config_json(args)},
                   records if args.save_detailed else None)
        print(f"wrote {os.path.abspath(path)}")
    return 0 if result["completed"] else 1
