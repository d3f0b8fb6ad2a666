"""`tokenmill bench throughput|serve|sweep|sla`: their flags and what runs them (the rest of the
command line is tokenmill/cli.py)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from tokenmill.bench.vllm_args import add_vllm_args, add_vllm_serve_args
from tokenmill.bench.workloads import WORKLOAD_DEFAULTS, WORKLOADS


def add_online_bench_args(p: argparse.ArgumentParser) -> None:
    """Flags of every online benchmark: the server, the workload, the arrival process, cost;
    and `vllm bench serve`'s names for them (bench/vllm_args.py)."""
    d = WORKLOAD_DEFAULTS
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default http://--host:--port)")
    p.add_argument("--model", default=None, help="the model name the server expects (default: the first one the "
                                                 "server lists on /v1/models)")
    p.add_argument("--endpoint", default=None,
                   help="completions or chat (/v1/completions or /v1/chat/completions, one user message), or vLLM's "
                        "form, the path itself (default: from --backend, else completions)")
    p.add_argument("--api-key", default=None, help="default: $OPENAI_API_KEY")
    p.add_argument("--tokenizer", default=None,
                   help="the server's tokenizer (directory or hub id; default: --model; 'none': do without): "
                        "prompts of exact lengths, and token counts when the server sends no usage")
    p.add_argument("--workload", default=None, metavar="|".join(WORKLOADS),
                   help="random: random words of --input-len tokens; shared-prefix: --num-prefixes prefixes of "
                        "--prefix-len tokens, each request adds a random suffix of --input-len tokens; file:PATH: "
                        f"JSONL of {{\"prompt\", \"output_len\" (optional)}} or ShareGPT JSON (default "
                        f"{d['workload']}; or vLLM's --dataset-name)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", default=None, help="N or MIN:MAX prompt tokens (suffix tokens for shared-prefix; "
                                                     f"default {d['input_len']})")
    p.add_argument("--output-len", default=None,
                   help="N or MIN:MAX output tokens (max_tokens + ignore_eos); file workloads use the file's "
                        f"lengths where it has them (default {d['output_len']})")
    p.add_argument("--num-prefixes", type=int, default=None,
                   help=f"shared-prefix: number of distinct prefixes (default {d['num_prefixes']})")
    p.add_argument("--prefix-len", type=int, default=None,
                   help=f"shared-prefix: tokens per prefix (default {d['prefix_len']})")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    p.add_argument("--warmup", "--num-warmups", type=int, default=0,
                   help="requests sent first and left out of the figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost-per-hour", type=float, default=None, help="price of one GPU (or machine) hour, dollars")
    p.add_argument("--num-gpus", type=int, default=1)
    p.add_argument("--no-progress", "--disable-tqdm", action="store_true")
    add_vllm_args(p)


def add_bench_parser(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """`tokenmill bench ...` under the CLI's subcommands; `add_engine_args`: the engine flags
    (bench throughput runs the engine offline)."""
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput on random-token prompts")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", default="32:256", help="N or MIN:MAX prompt tokens")
    tp.add_argument("--output-len", default="32:256", help="N or MIN:MAX output tokens (ignore_eos)")
    tp.add_argument("--prefix-len", type=int, default=0, help="tokens of one prefix shared by every prompt")
    tp.add_argument("--output-json", default=None, help="write the results to this JSON file")
    tp.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_args(tp)

    sv = bench_sub.add_parser("serve", help="online benchmark of any OpenAI-compatible server (streamed requests)")
    add_online_bench_args(sv)
    sv.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    sv.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    sv.add_argument("--slo", default=None, help="goodput objectives, e.g. ttft_ms=500,tpot_ms=50,e2e_ms=10000")
    sv.add_argument("--output-json", default=None)
    sv.add_argument("--save-detailed", action="store_true", help="add per-request records to the JSON result")
    sv.add_argument("--tenants", default=None, metavar="FILE",
                    help="a server's tenants file (JSON or YAML): requests are sent with the first plain API key of "
                         "each tenant (not --api-key) and reported per tenant, with Jain's fairness index over "
                         "service (prompt + output tokens) per unit of weight")
    sv.add_argument("--tenant-mix", default=None, metavar="NAME=SHARE,...",
                    help="with --tenants: the share of requests each tenant sends, e.g. acme=0.7,batch-jobs=0.3 "
                         "(normalised; split exactly, order shuffled with --seed; default: every tenant, equal shares)")
    add_vllm_serve_args(sv)

    sw = bench_sub.add_parser("sweep", help="bench serve at several load levels: throughput-latency curve "
                                            "(PNG, CSV, JSON)")
    add_online_bench_args(sw)
    sw.add_argument("--concurrency", default=None, help="levels of concurrency, e.g. 1,2,4,8,16")
    sw.add_argument("--request-rates", default=None, help="levels of requests/s, e.g. 1,2,4,inf")
    sw.add_argument("--max-concurrency", type=int, default=None, help="with --request-rates: in flight at most")
    sw.add_argument("--slo", default=None, help="goodput objectives per run, as in bench serve")
    sw.add_argument("--output-dir", default="bench-sweep", help="where sweep.png, sweep.csv and sweep.json go")

    sla = bench_sub.add_parser("sla", help="the highest throughput whose run meets an SLO (searches concurrency "
                                           "or request rate)")
    add_online_bench_args(sla)
    sla.add_argument("--slo", required=True,
                     help="objectives on the run's statistics, e.g. p99_ttft_ms=1000,p99_tpot_ms=50 (mean_, median_, "
                          "p90_, p99_ of ttft, tpot, itl, e2el)")
    sla.add_argument("--search", default="concurrency", choices=["concurrency", "rate"],
                     help="concurrency: each probe sends max(--num-prompts, 4 x concurrency) requests; rate: "
                          "--num-prompts requests at that many requests/s")
    sla.add_argument("--lower", type=float, default=1, help="first level probed (default 1)")
    sla.add_argument("--upper", type=float, default=256, help="highest level probed (default 256)")
    sla.add_argument("--max-concurrency", type=int, default=None, help="with --search rate: in flight at most")
    sla.add_argument("--rate-tolerance", type=float, default=0.1,
                     help="with --search rate: stop bisecting when the bounds are this close (relative)")
    sla.add_argument("--output-json", default=None)


def run_bench(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Runs the bench subcommand `args` asks for; `engine_kwargs`: bench throughput's engine."""
    if args.bench_command == "serve":
        from tokenmill.bench.serve import bench_serve
        return bench_serve(args)
    if args.bench_command == "sweep":
        from tokenmill.bench.sweep import bench_sweep
        return bench_sweep(args)
    if args.bench_command == "sla":
        from tokenmill.bench.sweep import bench_sla
        return bench_sla(args)
    return _bench_throughput(args, engine_kwargs)


def _bench_throughput(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    from rich.console import Console
    from rich.table import Table

    from tokenmill.bench.offline import run_throughput
    from tokenmill.bench.workloads import parse_range, random_requests
    from tokenmill.llm import LLM

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    input_len = parse_range(args.input_len, "--input-len")
    output_len = parse_range(args.output_len, "--output-len")
    llm = LLM(**engine_kwargs)
    requests = random_requests(args.num_prompts, input_len, output_len, llm.engine.model_config.vocab_size,
                               seed=args.seed, prefix_len=args.prefix_len)
    result = run_throughput(llm, requests, use_tqdm=not args.no_progress)
    table = Table(title=f"tokenmill bench throughput ({args.scheduler}, {llm.engine.dtype}, {llm.engine.device})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.to_dict().items():
        table.add_row(key, f"{value:,.2f}" if isinstance(value, float) else f"{value:,}")
    Console().print(table)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({**result.to_dict(), "config": engine_kwargs}, f, indent=2)
    return 0
