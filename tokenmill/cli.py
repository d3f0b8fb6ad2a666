"""tokenmill command line: `tokenmill serve`, `tokenmill router`, `tokenmill generate`,
`tokenmill quantize`, `tokenmill bench throughput|serve|sweep|sla`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from tokenmill.bench.cli import add_bench_parser, run_bench
from tokenmill.config import EngineConfig
from tokenmill.executor.huge_pages import reexec_with_malloc_tunable

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
    "--enforce-eager": ("enforce_eager", dict(
        action="store_true", help="every step through the model's modules: no CUDA graphs for decode steps, no "
        "one-call CPU forward of a small model's (executor/fused_decoder.py)")),
    "--async-scheduling": ("async_scheduling", dict(
        action=argparse.BooleanOptionalAction, default=None,
        help="schedule the next step while the GPU runs this one (default: on for CUDA, off on the CPU)")),
    "--quantization": ("quantization", dict(default="auto", choices=["auto", "none", "int8", "fp8", "compressed-tensors"],
                                            help="int8: W8A8 on load (CPU); fp8: the same in fp8 (CUDA); auto: the checkpoint's own")),
    "--kv-cache-dtype": ("kv_cache_dtype", dict(default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
                                                help="8-bit KV cache with a scale per token and head (about 1.9x the "
                                                     "tokens of bf16); auto: the model's dtype")),
    "--tensor-parallel-size": ("tensor_parallel_size", dict(
        type=int, default=1, help="ranks that split each layer (torch.distributed: gloo on the CPU, NCCL on CUDA); "
                                  "on the CPU they split --num-threads or the cores")),
    "--speculative-config": ("speculative_config", dict(
        default=None, type=lambda v: _json_object("--speculative-config", v, '(vLLM\'s keys)'),
        help='speculative decoding, JSON (method ngram, draft_model or eagle): {"method": "ngram", '
             '"num_speculative_tokens": 4, "prompt_lookup_max": 3}')),
}


_SHORT_FLAGS = {"--tensor-parallel-size": ("-tp",)}  # vLLM's


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for flag, (dest, kwargs) in ENGINE_FLAGS.items():
        group.add_argument(flag, *_SHORT_FLAGS.get(flag, ()), dest=dest, **kwargs)
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
    srv.add_argument("--distributed-executor-backend", default="mp", choices=["mp", "ray"],
                     help="ray: the engine cores (data-parallel replicas) are Ray actors, placed on any node of "
                          "the cluster (pip install 'tokenmill[ray]'); mp: processes of this machine")
    srv.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="the Ray cluster to join (auto: the one this machine is part of; default: a local one)")
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

    rt = sub.add_parser("router", help="OpenAI-compatible front for tokenmill servers on other hosts: each "
                                       "request to the one holding the longest cached prefix of its prompt")
    rt.add_argument("--backend", action="append", required=True, metavar="URL",
                    help="a `tokenmill serve`'s base URL, e.g. http://10.0.0.2:8000; repeat for each server")
    rt.add_argument("--host", default="127.0.0.1")
    rt.add_argument("--port", type=int, default=8000)
    rt.add_argument("--policy", default="prefix", choices=["prefix", "round_robin"],
                    help="prefix: to the server holding the longest cached prefix (ties and imbalance by load)")
    rt.add_argument("--poll-interval", type=float, default=1.0, metavar="S",
                    help="seconds between polls of each server's /health, /metrics and /v1/prefix_cache")
    rt.add_argument("--model", default=None,
                    help="the servers' checkpoint (directory or hub id), for its tokenizer (default: the built-in "
                         "model)")
    rt.add_argument("--tokenizer", default=None, help="the servers' tokenizer, if not --model's")
    rt.add_argument("--api-key", default=None,
                    help="the key the router's own polls of /v1/prefix_cache send, where the servers need one "
                         "(clients' Authorization headers are passed through as they are)")
    rt.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                    help="a server silent this long within a request (no answer, or no chunk of a stream) has "
                         "failed it: 502, or an error event in the stream")

    add_bench_parser(sub, add_engine_args)
    return parser


def entry() -> int:
    """The `tokenmill` command: main() in a process whose malloc gives huge pages."""
    reexec_with_malloc_tunable()
    return main()


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
        if args.command == "router":
            return _router(args)
        return run_bench(args, engine_kwargs(args) if args.bench_command == "throughput" else {})
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
                 data_parallel_size=args.data_parallel_size, data_parallel_routing=args.data_parallel_routing,
                 distributed_executor_backend=args.distributed_executor_backend, ray_address=args.ray_address)


def _router(args: argparse.Namespace) -> int:
    from tokenmill.router.server import run_router

    return run_router(args.backend, host=args.host, port=args.port, policy=args.policy,
                      poll_interval=args.poll_interval, tokenizer=args.tokenizer or args.model, api_key=args.api_key,
                      request_timeout=args.request_timeout, log_level=args.log_level.lower())


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


if __name__ == "__main__":
    sys.exit(main())
