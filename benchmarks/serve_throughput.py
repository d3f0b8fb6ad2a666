"""Serving overhead: output tokens/s of `tokenmill serve` at 64 concurrent streams against
the offline engine (`tokenmill bench throughput`) on the same requests, in one run.

    python benchmarks/serve_throughput.py [--rounds 2] [--num-prompts 64] [--layouts process,thread]

Workload: the random Llama of cpu_throughput.py (hidden 512, 8 layers) with the built-in
tokenizer's 8192-token vocabulary (every token is text to stream), dummy weights, bf16,
64 random-token prompts of 32..256 tokens, outputs of 32..256 tokens with ignore_eos,
greedy. Each round runs the offline engine and then the server, each in a fresh
process; the client (aiohttp, streamed completions, `usage` for token counts) runs in
this process on the same machine. The server runs in each layout asked for: `process`
(the default of `tokenmill serve`: the engine core in a process of its own) and `thread`
(`--engine-in-thread`: the engine on a thread of the HTTP process, sharing its GIL).
Target: the process layout >= 98% of offline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tokenmill.bench.client import run_benchmark
from tokenmill.bench.offline import copy_tokenizer
from tokenmill.bench.workloads import random_requests

# the 56M shape of cpu_throughput.py with the built-in tokenizer's vocabulary, so that every
# generated token decodes to text and the server streams a chunk for it
SHAPE = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=8192, hidden_size=512,
                 intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                 max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=0,
                 eos_token_id=0, tie_word_embeddings=False)


def make_model_dir(root: Path) -> Path:
    path = root / "llama-bench"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(SHAPE))
    copy_tokenizer(path)
    return path


def tokenmill_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", *args]


def run_offline(model: Path, args, out: Path) -> dict:
    subprocess.run(tokenmill_cmd("bench", "throughput", "--model", str(model), "--load-format", "dummy",
                                 "--num-prompts", str(args.num_prompts), "--input-len", args.input_len,
                                 "--output-len", args.output_len, "--seed", "0", "--no-progress",
                                 "--output-json", str(out)), check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def launch_server(model: Path, port: int, *flags: str) -> tuple[subprocess.Popen, str]:
    """`tokenmill serve` of the benchmark model (dummy weights, served as "bench"); returns the
    process and its URL once /health answers."""
    proc = subprocess.Popen(tokenmill_cmd("serve", "--model", str(model), "--load-format", "dummy",
                                          "--port", str(port), "--served-model-name", "bench",
                                          "--disable-access-log", *flags),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1):
                return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError(f"the server did not start ({' '.join(flags)})") from None
            time.sleep(0.2)


def run_server(model: Path, args, port: int, layout: str) -> dict:
    proc, url = launch_server(model, port, *(["--engine-in-thread"] if layout == "thread" else []))
    try:
        vocab = SHAPE["vocab_size"]
        requests = random_requests(args.num_prompts, _range(args.input_len), _range(args.output_len), vocab, seed=0)
        cores = children(proc.pid)  # the engine-core process, in the process layout
        server0, core0, client0 = thread_cpu(proc.pid), _cpu(cores), cpu_seconds()
        records, elapsed = asyncio.run(run_benchmark(url, "bench", requests, max_concurrency=args.concurrency))
        server1, core1, client1 = thread_cpu(proc.pid), _cpu(cores), cpu_seconds()
        failed = [r.error for r in records if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0]}")
        output_tokens = sum(r.output_tokens for r in records)
        ttfts = [r.ttft for r in records if r.ttft is not None]
        return {"elapsed_s": elapsed, "output_tokens": output_tokens, "output_throughput": output_tokens / elapsed,
                "median_ttft_ms": 1000 * statistics.median(ttfts) if ttfts else float("nan"),
                "text_chunks": sum(len(r.chunk_times) for r in records),
                # CPU seconds during the run: the server's main thread is the HTTP event loop; its
                # other threads (thread layout: the engine thread and the OpenMP workers; process
                # layout: the output thread) and the engine-core process are the engine
                "cpu_s_http_loop": server1.get(proc.pid, 0.0) - server0.get(proc.pid, 0.0),
                "cpu_s_engine_threads": sum(v - server0.get(t, 0.0) for t, v in server1.items() if t != proc.pid)
                + core1 - core0,
                "cpu_s_client": client1 - client0}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of a process, from /proc."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cpu(pids: list[int]) -> float:
    return sum(sum(thread_cpu(pid).values()) for pid in pids)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _range(value: str) -> tuple[int, int]:
    lo, _, hi = value.partition(":")
    return int(lo), int(hi or lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", default="32:256")
    parser.add_argument("--output-len", default="32:256")
    parser.add_argument("--port", type=int, default=18000)
    parser.add_argument("--layouts", default="process,thread", help="process, thread, or both (comma-separated)")
    parser.add_argument("--output-json", default="bench_results/serve_throughput.json")
    args = parser.parse_args()

    layouts = args.layouts.split(",")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model_dir(Path(tmp))
        for i in range(args.rounds):
            offline = run_offline(model, args, Path(tmp) / f"offline{i}.json")
            entry = {"offline": offline}
            for layout in layouts:
                served = run_server(model, args, args.port, layout)
                ratio = served["output_throughput"] / offline["output_throughput"]
                entry[layout] = {**served, "ratio": ratio}
                print(f"round {i + 1}: offline {offline['output_throughput']:,.1f} tok/s, server ({layout}) "
                      f"{served['output_throughput']:,.1f} tok/s (median TTFT {served['median_ttft_ms']:,.0f} ms): "
                      f"server/offline = {ratio:.3f}; CPU s: engine {served['cpu_s_engine_threads']:.2f}, "
                      f"HTTP loop {served['cpu_s_http_loop']:.2f}, client {served['cpu_s_client']:.2f} for "
                      f"{served['text_chunks']:,} chunks in {served['elapsed_s']:.2f} s", flush=True)
            rounds.append(entry)
    result = {"rounds": rounds, "cpu_count": os.cpu_count(), "target": 0.98,
              "mean_ratio": {layout: statistics.mean(r[layout]["ratio"] for r in rounds) for layout in layouts}}
    for layout in layouts:
        print(f"server ({layout}) / offline, mean of {args.rounds} rounds: {result['mean_ratio'][layout]:.3f}"
              + (" (target >= 0.98)" if layout == "process" else ""))
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(result, indent=2))

if __name__ == "__main__":
    main()
