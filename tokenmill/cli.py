"""tokenmill command line: `tokenmill serve`, `tokenmill generate`, `tokenmill quantize`,
`tokenmill bench throughput|serve|sweep|sla`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from tokenmill.bench.vllm_args import add_vllm_args, add_vllm_serve_args
from tokenmill.bench.workloads import WORKLOAD_DEFAULTS, WORKLOADS
from tokenmill.config import EngineConfig

# flag -> (EngineConfig field, argparse kwargs); names follow `vllm serve` where the idea is the same
ENGINE_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "--model": ("model", dict(default=None, help="checkpoint directory or hub id (default: the built-in model)")),
    "--tokenizer": ("tokenizer", dict(default=None, help="tokenizer directory (default: the model's)")),
    "--skip-tokenizer-init": ("skip_tokenizer_init", dict(
        action="store_true", help="load no tokenizer: token-id prompts in, token ids out (completions only)")),
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
    "--num-gpu-blocks-override": ("num_gpu_blocks_override", dict(type=int, default=None,
                                                                  help="CUDA: KV blocks, instead of profiling")),
    "--enable-prefix-caching": ("enable_prefix_caching", dict(action=argparse.BooleanOptionalAction,
                                                              default=True)),
    "--enable-chunked-prefill": ("enable_chunked_prefill", dict(action=argparse.BooleanOptionalAction,
                                                                default=True)),
    "--scheduler": ("scheduler", dict(default="continuous", choices=["continuous", "static"])),
    "--scheduling-policy": ("scheduling_policy", dict(default="fcfs", choices=["fcfs", "priority", "fair"],
                                                      help="priority: lanes by priority (lower first); fair: lanes, "
                                                           "then VTC fair shares between tenants (--tenants)")),
    "--fair-prompt-token-weight": ("fair_prompt_token_weight", dict(
        type=float, default=1.0, help="fair: what a prompt token adds to its tenant's virtual counter")),
    "--fair-output-token-weight": ("fair_output_token_weight", dict(
        type=float, default=2.0, help="fair: what an output token adds to its tenant's virtual counter")),
    "--num-threads": ("num_threads", dict(type=int, default=None, help="torch threads on CPU")),
    "--attention-backend": ("attention_backend", dict(default="auto", choices=["auto", "cpu", "torch", "triton"],
                                                      help="auto: triton on CUDA, the native kernels on the CPU")),
    "--enforce-eager": ("enforce_eager", dict(action="store_true", help="CUDA: no CUDA graphs for decode steps")),
    "--quantization": ("quantization", dict(default="auto", choices=["auto", "none", "int8", "fp8", "compressed-tensors"],
                                            help="int8: W8A8 on load (CPU); fp8: the same in fp8 (CUDA); auto: the checkpoint's own")),
    "--kv-cache-dtype": ("kv_cache_dtype", dict(default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
                                                help="8-bit KV cache with a scale per token and head (about 1.9x the "
                                                     "tokens of bf16); auto: the model's dtype")),
    "--speculative-config": ("speculative_config", dict(
        default=None, type=lambda v: _json_object("--speculative-config", v, '(vLLM\'s keys)'),
        help='speculative decoding, JSON: {"method": "ngram", "num_speculative_tokens": 4, '
             '"prompt_lookup_max": 3}')),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for flag, (dest, kwargs) in ENGINE_FLAGS.items():
        group.add_argument(flag, dest=dest, **kwargs)
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="same as --no-enable-prefix-caching")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {dest: getattr(args, dest) for dest, _ in ENGINE_FLAGS.values()}


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
    srv.add_argument("--tenants", default=None, metavar="FILE",
                     help="tenants, their API keys, limits, quotas, priority and weight (JSON or YAML; README)")
    srv.add_argument("--admin-key", default=None, help="a key that reads every tenant's GET /v1/usage")
    srv.add_argument("--limits-db", default=None, metavar="PATH",
                     help="SQLite file of the tenants' quota usage (default ~/.local/state/tokenmill/limits.db)")
    srv.add_argument("--limits-store", default=None, metavar="redis://HOST:PORT",
                     help="share limits and quotas between replicas through Redis (pip install 'tokenmill[redis]')")
    srv.add_argument("--limits-fail-open", action="store_true",
                     help="when the limits store is unreachable, admit requests uncounted (default: 503)")
    srv.add_argument("--restart-engine", action="store_true",
                     help="when the engine-core process dies, start a new one (its requests fail; default: "
                          "answer 503 until the server is restarted)")
    srv.add_argument("--engine-in-thread", action="store_true",
                     help="run the engine on a thread of the server process instead of a process of its own "
                          "(the HTTP loop then shares its GIL)")
    srv.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                     help="N engine-core processes behind this server, each with its own KV cache (on the CPU: "
                          "its own slice of the cores, --num-threads split between them)")
    srv.add_argument("--data-parallel-routing", default="prefix", choices=["prefix", "round_robin"],
                     help="prefix: each request to the replica holding the longest cached prefix of its prompt "
                          "(ties and imbalance by load)")
    add_engine_args(srv)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt", help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2, over the generated tokens")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2, over the generated tokens")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0, over prompt and output; 1: off")
    gen.add_argument("--logit-bias", default=None, metavar="JSON",
                     help='token id -> bias in [-100, 100], e.g. \'{"42": -100}\'')
    gen.add_argument("--bad-words", nargs="+", default=None, metavar="WORD", help="words never generated")
    gen.add_argument("--structured-outputs", default=None, metavar="JSON",
                     help='the output must fit: one of json (a schema), regex, choice, grammar or json_object, '
                          'e.g. \'{"regex": "[0-9]{3}"}\' (vLLM\'s StructuredOutputsParams)')
    add_engine_args(gen)

    quant = sub.add_parser("quantize", help="write a 16-bit checkpoint as a compressed-tensors one (8-bit weights)")
    quant.add_argument("--model", required=True, help="the 16-bit checkpoint directory")
    quant.add_argument("--scheme", required=True, choices=["w8a8-int8", "fp8-dynamic"],
                       help="w8a8-int8: int8 weights per channel, int8 activations per token (dynamic); "
                            "fp8-dynamic: the same in float8_e4m3fn (llm-compressor's W8A8 and FP8_DYNAMIC)")
    quant.add_argument("--output", required=True, help="the directory to write")

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
        if args.command == "quantize":
            return _quantize(args)
        if args.bench_command == "serve":
            from tokenmill.bench.serve import bench_serve
            return bench_serve(args)
        if args.bench_command == "sweep":
            from tokenmill.bench.sweep import bench_sweep
            return bench_sweep(args)
        if args.bench_command == "sla":
            from tokenmill.bench.sweep import bench_sla
            return bench_sla(args)
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
    tenancy = dict(tenants_file=args.tenants, api_key=args.api_key, admin_key=args.admin_key,
                   limits_db=args.limits_db, limits_store=args.limits_store, fail_open=args.limits_fail_open)
    return serve(EngineConfig(**engine_kwargs(args)), host=args.host, port=args.port,
                 served_model_name=args.served_model_name, tenancy=tenancy,
                 max_waiting_requests=args.max_waiting_requests, shutdown_timeout=args.shutdown_timeout,
                 log_level=args.log_level.lower(), access_log=not args.disable_access_log,
                 engine_process=not args.engine_in_thread, restart_engine=args.restart_engine,
                 data_parallel_size=args.data_parallel_size, data_parallel_routing=args.data_parallel_routing)


def _json_object(flag: str, value: str | None, expected: str) -> dict | None:
    """The flag's JSON object as it is (SamplingParams checks its keys and values)."""
    if value is None:
        return None
    try:
        out = json.loads(value)
    except json.JSONDecodeError:
        out = None
    if not isinstance(out, dict):
        raise ValueError(f"{flag}: expected a JSON object {expected}, got {value!r}")
    return out


def _structured_outputs(value: str | None):
    from tokenmill.sampling_params import StructuredOutputsParams

    spec = _json_object("--structured-outputs", value, 'such as \'{"regex": "[0-9]+"}\'')
    if spec is None:
        return None
    try:
        return StructuredOutputsParams(**spec)
    except TypeError as e:  # an unknown key
        raise ValueError(f"--structured-outputs: {e}") from e


def _generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.engine import Engine
    from tokenmill.sampling_params import SamplingParams

    bias = _json_object("--logit-bias", args.logit_bias, "of token id -> number")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                            logit_bias=bias, bad_words=args.bad_words,
                            structured_outputs=_structured_outputs(args.structured_outputs))
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


def _quantize(args: argparse.Namespace) -> int:
    from tokenmill.executor.layers.quantization.checkpoint import quantize_checkpoint
    from tokenmill.executor.loader import resolve_model_path

    count = quantize_checkpoint(resolve_model_path(args.model), args.scheme, Path(args.output))
    print(f"{count} linear layers quantized ({args.scheme}); written to {args.output}")
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
