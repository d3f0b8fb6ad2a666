"""`vllm bench serve`'s flags, taken as they are, so that a command copied from vLLM's docs
runs unchanged (`vllm bench serve ...` -> `tokenmill bench serve ...`).

`resolve` maps them onto tokenmill's own flags once, before the checks; the rest of the
benchmark sees tokenmill's flags only. The workload is chosen either tokenmill's way
(--workload, --num-prefixes, --prefix-len) or vLLM's (--dataset-name and its flags);
a flag of each is an error that names both. --input-len and --output-len belong to both:
with a vLLM dataset they are vLLM's general lengths (one integer, over the dataset's own).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from tokenmill.bench.workloads import WORKLOAD_DEFAULTS

BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
# vLLM's datasets -> their flags (argparse dests) and vLLM's defaults for them
DATASETS: dict[str, dict[str, Any]] = {
    "random": {"random_input_len": 1024, "random_output_len": 128, "random_range_ratio": 0.0,
               "random_prefix_len": 0, "input_len": None, "output_len": None},
    "sharegpt": {"dataset_path": None, "sharegpt_output_len": None, "output_len": None},
    "prefix_repetition": {"prefix_repetition_prefix_len": 256, "prefix_repetition_suffix_len": 256,
                          "prefix_repetition_num_prefixes": 10, "prefix_repetition_output_len": 128,
                          "output_len": None},
}
GENERAL_LENGTHS = ("input_len", "output_len")
VLLM_WORKLOAD_FLAGS = ("dataset_name", *dict.fromkeys(d for flags in DATASETS.values() for d in flags
                                                      if d not in GENERAL_LENGTHS))
TOKENMILL_WORKLOAD_FLAGS = ("workload", "num_prefixes", "prefix_len")


def add_vllm_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for the server, the endpoint and the workload (every online benchmark)."""
    g = p.add_argument_group("vllm bench serve's flags")
    g.add_argument("--backend", default=None, choices=list(BACKENDS),
                   help="openai (or vllm): /v1/completions; openai-chat: /v1/chat/completions")
    g.add_argument("--host", default=None, help="the server when --base-url is not given (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=None, help="the server when --base-url is not given (default 8000)")
    g.add_argument("--dataset-name", default=None, choices=list(DATASETS),
                   help="vLLM's workloads: random (--random-*), sharegpt (--dataset-path), prefix_repetition "
                        "(--prefix-repetition-*, mapped onto shared-prefix)")
    g.add_argument("--dataset-path", default=None, help="sharegpt: the ShareGPT JSON file")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: output tokens of every request, instead of the reply's length")
    g.add_argument("--random-input-len", type=int, default=None, help="random: prompt tokens (default 1024)")
    g.add_argument("--random-output-len", type=int, default=None, help="random: output tokens (default 128)")
    g.add_argument("--random-range-ratio", type=float, default=None,
                   help="random: lengths uniform in [len x (1 - r), len x (1 + r)], 0 <= r < 1 (default 0)")
    g.add_argument("--random-prefix-len", type=int, default=None,
                   help="random: tokens of one random prefix put before every prompt (default 0)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=None, help="tokens per prefix (default 256)")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=None,
                   help="tokens of each request's own suffix (default 256)")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=None,
                   help="distinct prefixes, at most --num-prompts (default 10)")
    g.add_argument("--prefix-repetition-output-len", type=int, default=None, help="output tokens (default 128)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="send ignore_eos: true, so that every output has its full length (default: on, except "
                        "with --dataset-name sharegpt or prefix_repetition, as in vLLM)")
    g.add_argument("--trust-remote-code", action="store_true", help="passed to the tokenizer's loader")


def add_vllm_serve_args(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for what `bench serve` reports and where it writes it."""
    g = p.add_argument_group("vllm bench serve's flags: the report")
    g.add_argument("--percentile-metrics", default=None,
                   help="comma-separated metrics among ttft,tpot,itl,e2el whose mean, median, std and percentiles "
                        "are reported (default: all four)")
    g.add_argument("--metric-percentiles", default=None, help="comma-separated percentiles, e.g. 25,50,99.9 "
                                                               "(default 50,90,99)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="goodput objectives, KEY among ttft, tpot, e2el, e.g. --goodput ttft:500 tpot:50 "
                        "(the same as --slo)")
    g.add_argument("--save-result", action="store_true", help="write the JSON result to --result-dir / "
                                                              "--result-filename")
    g.add_argument("--result-dir", default=None, help="default: the current directory")
    g.add_argument("--result-filename", default=None,
                   help="default {backend}-{request_rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json")


def resolve(args: argparse.Namespace) -> None:
    """Maps vLLM's flags onto tokenmill's, in place: --base-url, --endpoint (a kind, with
    `endpoint_path` the URL path), the workload flags, `ignore_eos`, --api-key (from
    OPENAI_API_KEY, as vLLM). ValueError naming the flags at fault."""
    if args.base_url is None:
        if args.port is not None and not 0 < args.port < 65536:
            raise ValueError(f"--port must be in [1, 65535], got {args.port}")
        host = args.host or "127.0.0.1"
        args.base_url = f"http://{f'[{host}]' if ':' in host else host}:{args.port or 8000}"
    _resolve_endpoint(args)
    vllm_flag = _first_given(args, VLLM_WORKLOAD_FLAGS)
    tokenmill_flag = _first_given(args, TOKENMILL_WORKLOAD_FLAGS)
    if vllm_flag and tokenmill_flag:
        raise ValueError(f"{tokenmill_flag} (tokenmill's workload) and {vllm_flag} (vLLM's) both choose the "
                         f"workload; give one or the other")
    if vllm_flag:
        _resolve_dataset(args)
    for dest, default in WORKLOAD_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if args.ignore_eos is None:
        args.ignore_eos = args.dataset_name not in ("sharegpt", "prefix_repetition")
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")


def _resolve_endpoint(args: argparse.Namespace) -> None:
    from tokenmill.bench.client import ENDPOINTS  # the client pulls in aiohttp: only when a benchmark runs

    endpoint, path = args.endpoint, None
    if endpoint is not None and endpoint not in ENDPOINTS:
        # vLLM's form: the path itself, which says the API by its end
        if not (endpoint.startswith("/") and endpoint.endswith("completions")):
            raise ValueError(f"--endpoint must be completions, chat or a path ending in /completions or "
                             f"/chat/completions, got {endpoint!r}")
        endpoint, path = ("chat" if endpoint.endswith("chat/completions") else "completions"), endpoint
    backend = BACKENDS.get(args.backend) if args.backend else None
    if backend and endpoint and backend != endpoint:
        raise ValueError(f"--backend {args.backend} and --endpoint {args.endpoint} disagree: {args.backend} speaks "
                         f"to {ENDPOINTS[backend]}")
    args.endpoint = backend or endpoint or "completions"
    args.endpoint_path = path or ENDPOINTS[args.endpoint]


def _resolve_dataset(args: argparse.Namespace) -> None:
    name = args.dataset_name = args.dataset_name or "random"  # vLLM's default dataset
    flags = DATASETS[name]
    stray = _first_given(args, [d for d in (*VLLM_WORKLOAD_FLAGS[1:], *GENERAL_LENGTHS) if d not in flags])
    if stray:
        raise ValueError(f"{stray} does not apply to --dataset-name {name}")
    v = {dest: _value(args, dest, default) for dest, default in flags.items()}
    output_len = v["output_len"] or v.get(f"{name}_output_len")  # vLLM's general --output-len comes first
    if name == "random":
        ratio = v["random_range_ratio"]
        if not 0 <= ratio < 1:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
        input_len = v["input_len"] or v["random_input_len"]
        low, high = math.floor(input_len * (1 - ratio)), math.ceil(input_len * (1 + ratio))
        if low < 1:
            raise ValueError(f"--random-input-len {input_len} with --random-range-ratio {ratio} allows empty prompts")
        args.input_len = _span(low, high)
        args.output_len = _span(max(1, math.floor(output_len * (1 - ratio))), math.ceil(output_len * (1 + ratio)))
        args.workload = "shared-prefix" if v["random_prefix_len"] else "random"
        args.num_prefixes, args.prefix_len = 1, v["random_prefix_len"]  # one prefix before every prompt
    elif name == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
        args.workload, args.sharegpt_output_len = f"file:{args.dataset_path}", output_len
    else:
        args.workload = "shared-prefix"
        args.num_prefixes, args.prefix_len = v["prefix_repetition_num_prefixes"], v["prefix_repetition_prefix_len"]
        args.input_len, args.output_len = str(v["prefix_repetition_suffix_len"]), str(output_len)
        if args.num_prefixes > args.num_prompts:
            raise ValueError(f"--prefix-repetition-num-prefixes ({args.num_prefixes}) must be at most --num-prompts "
                             f"({args.num_prompts})")


def _value(args: argparse.Namespace, dest: str, default: Any) -> Any:
    """The flag's value, else vLLM's default. Lengths are integers >= 1 (a prefix >= 0); vLLM's
    --input-len and --output-len are one integer."""
    value = getattr(args, dest)
    if value is None:
        return default
    flag = "--" + dest.replace("_", "-")
    if dest in GENERAL_LENGTHS:
        if not value.isdigit():
            raise ValueError(f"{flag}: with a vLLM --dataset-name, expected one integer, got {value!r}")
        value = int(value)
    minimum = 0 if dest == "random_prefix_len" else 1
    if isinstance(value, int) and value < minimum:
        raise ValueError(f"{flag} must be >= {minimum}, got {value}")
    return value


def _first_given(args: argparse.Namespace, dests: Iterable[str]) -> str | None:
    """The first of `dests` given on the command line, as its flag."""
    return next(("--" + d.replace("_", "-") for d in dests if getattr(args, d) is not None), None)


def _span(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}:{high}"


def result_path(args: argparse.Namespace, date: str) -> str:
    """--save-result's file: vLLM's name unless --result-filename, in --result-dir."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or (f"{backend_name(args)}-{args.request_rate}qps{concurrency}-"
                                    f"{args.model.split('/')[-1]}-{date}.json")
    return os.path.join(args.result_dir, name) if args.result_dir else name


def backend_name(args: argparse.Namespace) -> str:
    return args.backend or ("openai-chat" if args.endpoint == "chat" else "openai")


def vllm_header(args: argparse.Namespace) -> dict[str, Any]:
    """The keys that open vLLM's result file."""
    backend = backend_name(args)
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
            "model_id": args.model, "tokenizer_id": args.tokenizer or args.model, "num_prompts": args.num_prompts,
            "request_rate": args.request_rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency}
