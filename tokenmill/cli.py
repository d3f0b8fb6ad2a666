"""tokenmill command line: `tokenmill serve`, `tokenmill generate`, `tokenmill bench throughput`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from tokenmill.config import EngineConfig

# flag -> (EngineConfig field, argparse kwargs); names follow `vllm serve` where the idea is the same
ENGINE_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--model": ("model", dict(default=None, help="checkpoint directory or hub id (default: the built-in model)")),
    "--tokenizer": ("tokenizer", dict(default=None, help="tokenizer directory (default: the model's)")),
    "--dtype": ("dtype", dict(default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                              help="auto: bfloat16 on CUDA and on CPUs with native bf16, else float32")),
    "--load-format": ("load_format", dict(default="auto", choices=["auto", "safetensors", "dummy"],
                                          help="dummy: random weights from config.json")),
    "--device": ("device", dict(default="auto", choices=["auto", "cpu", "cuda"])),
    "--seed": ("seed", dict(type=int, default=0)),
    "--max-model-len": ("max_model_len", dict(type=int, default=None)),
    "--max-num-seqs": ("max_num_seqs", dict(type=int, default=256)),
    "--max-num-batched-tokens": ("max_num_batched_tokens", dict(type=int, default=None,
                                                                help="token budget per step")),
    "--block-size": ("block_size", dict(type=int, default=16)),
    "--kv-cache-memory": ("kv_cache_memory", dict(default=None, help="KV cache size on CPU, e.g. 2GiB")),
    "--gpu-memory-utilization": ("gpu_memory_utilization", dict(type=float, default=0.9)),
    "--enable-prefix-caching": ("enable_prefix_caching", dict(action=argparse.BooleanOptionalAction,
                                                              default=True)),
    "--enable-chunked-prefill": ("enable_chunked_prefill", dict(action=argparse.BooleanOptionalAction,
                                                                default=True)),
    "--scheduler": ("scheduler", dict(default="continuous", choices=["continuous", "static"])),
    "--scheduling-policy": ("scheduling_policy", dict(default="fcfs", choices=["fcfs", "priority"])),
    "--num-threads": ("num_threads", dict(type=int, default=None, help="torch threads on CPU")),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for flag, (dest, kwargs) in ENGINE_FLAGS.items():
        group.add_argument(flag, dest=dest, **kwargs)
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="same as --no-enable-prefix-caching")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {dest: getattr(args, dest) for dest, _ in ENGINE_FLAGS.values()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="A throughput-first LLM inference engine.")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, /metrics)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients send (default: --model, or tokenmill-default)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/*")
    srv.add_argument("--max-waiting-requests", type=int, default=1024,
                     help="requests queued beyond this get 503 with Retry-After")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests get to finish after SIGTERM")
    srv.add_argument("--disable-access-log", action="store_true", help="no log line per HTTP request")
    add_engine_args(srv)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)

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

    sv = bench_sub.add_parser("serve", help="online benchmark of any OpenAI-compatible server (streamed completions)")
    sv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    sv.add_argument("--model", required=True, help="the model name the server expects")
    sv.add_argument("--api-key", default=None)
    sv.add_argument("--tokenizer", default=None,
                    help="the server's tokenizer (directory or hub id; default: --model): prompts are random token "
                         "ids of exactly --input-len tokens from its vocabulary")
    sv.add_argument("--num-prompts", type=int, default=100)
    sv.add_argument("--input-len", default="32:256", help="N or MIN:MAX prompt tokens")
    sv.add_argument("--output-len", default="32:256", help="N or MIN:MAX output tokens (max_tokens + ignore_eos)")
    sv.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    sv.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    sv.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    sv.add_argument("--warmup", type=int, default=0, help="requests sent first and left out of the figures")
    sv.add_argument("--seed", type=int, default=0)
    sv.add_argument("--slo", default=None, help="goodput objectives, e.g. ttft_ms=500,tpot_ms=50,e2e_ms=10000")
    sv.add_argument("--cost-per-hour", type=float, default=None, help="price of one GPU (or machine) hour, dollars")
    sv.add_argument("--num-gpus", type=int, default=1)
    sv.add_argument("--output-json", default=None)
    sv.add_argument("--save-detailed", action="store_true", help="add per-request records to --output-json")
    sv.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "generate":
            return _generate(args)
        if args.bench_command == "serve":
            from tokenmill.bench.serve import bench_serve
            return bench_serve(args)
        return _bench_throughput(args)
    except ValueError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _serve(args: argparse.Namespace) -> int:
    from tokenmill.server.launch import serve

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    if args.max_waiting_requests < 1:
        raise ValueError(f"--max-waiting-requests must be >= 1, got {args.max_waiting_requests}")
    return serve(EngineConfig(**engine_kwargs(args)), host=args.host, port=args.port,
                 served_model_name=args.served_model_name, api_key=args.api_key,
                 max_waiting_requests=args.max_waiting_requests, shutdown_timeout=args.shutdown_timeout,
                 log_level=args.log_level.lower(), access_log=not args.disable_access_log)


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.engine import Engine
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed)
    engine = Engine(EngineConfig(**engine_kwargs(args)))
    request, text = engine.make_request(args.prompt, params)
    engine.add_request(request, text)
    sys.stdout.write(args.prompt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _bench_throughput(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tokenmill.bench.offline import run_throughput
    from tokenmill.bench.workloads import parse_range, random_requests
    from tokenmill.llm import LLM

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    input_len = parse_range(args.input_len, "--input-len")
    output_len = parse_range(args.output_len, "--output-len")
    llm = LLM(**engine_kwargs(args))
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
            json.dump({**result.to_dict(), "config": engine_kwargs(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
