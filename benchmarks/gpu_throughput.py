"""Everything a device session needs, in one call: GPU tests, parity, throughput, a table last.

    python benchmarks/gpu_throughput.py [--output-dir gpu_results] [--budget-s 520] [--smoke]

On a lent device machine: `bash scripts/gpu_wheels.sh` here (the image lacks
compressed-tensors, which the FP8 checkpoint test needs), then one call of
`bash scripts/device_session.sh --budget-s 540 --only SECTIONS` carrying .whl: it installs
the wheels, runs this script under a timeout and puts the log and results in $OUT.

Sections, run in the order --only names them:
tests        pytest tests/gpu tests/kernels on the device: bf16 and float32 parity with HF
             transformers, CUDA graphs equal eager, Triton equal the torch backend on the
             same paged cache (prefix hits, chunked prefill, preemption), the Triton kernels
             against a float64 reference.
qwen3        the shape of Qwen3-0.6B's config (hidden 1024, 28 layers, 16 heads, 8 KV heads,
             head_dim 128, intermediate 3072, vocab 151936, tied embeddings, q/k norm),
             load_format=dummy, bfloat16; 256 requests, prompt and output lengths uniform in
             100..1024 random tokens, ignore_eos (nano-vllm's bench.py workload); tokenmill with
             CUDA graphs (async scheduling, the default), graphs without async scheduling, and
             enforce_eager. Each run's time per step is split (bench/steps.py StepTimeline):
             the device's (events from each step's forward to its sampling), the host's
             launches, its waits for sampled ids, and the rest of the host's work, so a run
             that is device-bound, host-bound or serialized shows which.
fp8          the qwen3 run with quantization="fp8" (W8A8 through torch._scaled_mm) against bf16,
             both with CUDA graphs; then kv_cache_dtype="fp8" (read in place by the Triton kernels); then both.
fp8_quality  benchmarks/quant_quality.py --schemes fp8: the built-in model's perplexity, greedy
             agreement and ast share against bf16.
steps        decode step time at batch 1, 64 and 256 (contexts of 512 tokens) against the
             memory roofline: weights plus KV bytes read per step over the copy bandwidth
             measured in this run, each step synced alone and steps in a row (where async
             scheduling overlaps them); graphs vs eager at batch 1; the Triton layer kernels
             (norms, rotary, activation) against torch ops; GPU idle time between steps.
profile      the same decode steps under the torch profiler (kernel time against wall time,
             the top kernels) and cProfile (the host's Python, to host_profile.txt).
hf           HF transformers `generate` in static batches against tokenmill on the same
             requests (64: HF takes about 125 s a batch of 64 on an H100).
hf_cb        HF's continuous batching (`generate_batch`) against tokenmill, every request
             with the same output length.
llama8b      one Llama-3-8B-shaped run (dummy weights, bfloat16), the same workload.
fp8_8b       FP8 W8A8 against bf16 on the Llama-3-8B shape with --fp8-8b-requests (64), where the
             weights are most of a step's bytes. Each FP8 row also gives the bytes an average step
             reads in both runs (weights, and the K/V of each decoded token's context) and their
             ratio, what fewer bytes gain a step bound by memory: on qwen3 with 256 requests the
             K/V dwarfs the weights.
spec         benchmarks/speculative.py on the device (benchmarks/gpu_spec.py): the built-in model
             with n-gram, its draft model and its EAGLE head against no speculation, at
             --spec-concurrency (1,16), both prompt sets; verification steps replay the target's
             CUDA graphs, the drafters' forwards their own. Not in the default --only (it needs
             about 4 minutes): run it as `--only spec` or beside other sections.
spec_attn    one layer's attention in a verification step of k = 4 as the graphs run it (a row a
             token), each row reading its context against each request's rows reading it once
             (gpu_spec.verify_attention). Not in the default --only.

Targets (issue 14): >= 12,000 output tok/s on an H100; >= 10x HF static and >= 3x HF
continuous batching; decode steps at batch 64 and 256 within 1.5x of the roofline; graphs
>= 1.5x eager at batch 1. Issue 16: fp8 >= 1.4x bf16. Sections that would run past --budget-s are skipped and say so.
Details go to --output-dir (results.json, tests.log); the table is printed last.
--smoke runs the same code on a tiny shape, on the CPU if there is no GPU, in a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from tokenmill import LLM  # noqa: E402
from tokenmill.bench.hf_baseline import hf_continuous, hf_model, hf_static_throughput  # noqa: E402
from tokenmill.bench.offline import copy_tokenizer, run_throughput  # noqa: E402
from tokenmill.bench.steps import (StepTimeline, bytes_per_step, copy_bandwidth, decode_step_time,  # noqa: E402
                                   profile_decode_steps, profile_host, torch_layer_ops)
from tokenmill.bench.workloads import random_requests  # noqa: E402

import gpu_quant  # noqa: E402  the FP8 sections (this folder; python puts a script's folder on its path)
import gpu_spec  # noqa: E402  the speculative section

QWEN3_06B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                 vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, hidden_act="silu", bos_token_id=0, eos_token_id=0)
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                 max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
                 bos_token_id=0, eos_token_id=0)
TINY = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=8192,
            tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
            bos_token_id=0, eos_token_id=0)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = time.perf_counter()
        self.results: dict = {"device": _device_name(), "command": " ".join(sys.argv)}
        self.rows: list[tuple[str, str, str]] = []  # (figure, value, target)
        self.cuda = torch.cuda.is_available()
        self.device_args = {} if self.cuda else {"device": "cpu", "attention_backend": "torch"}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def section(self, name: str, fn, cost_s: float) -> None:
        """Runs fn unless it would end past the budget; a failure is recorded, not raised."""
        if self.elapsed() + cost_s > self.args.budget_s:
            self.results[name] = {"skipped": f"would pass the {self.args.budget_s:.0f}s budget"}
            self.rows.append((name, "skipped (time)", ""))
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the table must still come out
            self.results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            self.rows.append((name, f"FAILED: {type(e).__name__}: {str(e)[:80]}", ""))
        print(f"[{name}] {time.perf_counter() - t0:.1f}s", flush=True)
        free_gpu()
        self.save()
        self.table()  # after every section: a run cut off at the device's limit still shows its figures

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str))

    # -- 1. tests ------------------------------------------------------------------
    def tests(self) -> None:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/gpu", "tests/kernels"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=self.args.tests_timeout_s)
        (self.out / "tests.log").write_text(proc.stdout + proc.stderr)
        summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
        self.results["tests"] = {"returncode": proc.returncode, "summary": summary}
        self.rows.append(("GPU tests (tests/gpu, tests/kernels)", summary, "all pass"))

    # -- 2. throughput ------------------------------------------------------------------
    def workload(self, n: int | None = None):
        lo, hi = self.args.lens
        return random_requests(n or self.args.num_requests, (lo, hi), (lo, hi), 8192, seed=0)

    def engine(self, shape: dict, **kwargs) -> LLM:
        return LLM(str(checkpoint(self.out / "ckpt", shape)), load_format="dummy", dtype=self.args.dtype,
                   max_num_seqs=self.args.max_num_seqs, **{**self.device_args, **kwargs})

    def throughput(self, name: str, shape: dict, num_requests: int | None = None, **kwargs) -> dict:
        llm = self.engine(shape, **kwargs)
        runner = llm.engine.runner
        requests = self.workload(num_requests)
        run_throughput(llm, requests[:16], use_tqdm=False)  # warm-up: Triton compiles
        with StepTimeline(llm) as timeline:
            result = run_throughput(llm, requests, use_tqdm=False).to_dict()
        result["timeline"] = timeline.summary(result["elapsed_s"])
        result["bytes_per_step"] = bytes_per_step(llm, requests, result["timeline"]["steps"])
        result["kv_cache_tokens"] = llm.engine.kv_capacity_tokens
        result["memory_profile"] = getattr(runner, "profile", None)
        if runner.graphs is not None:
            result["graph_capture_s"] = runner.graphs.capture_seconds
            result["graph_capture_mib"] = runner.graphs.capture_bytes / 2**20
        self.results[name] = result
        del llm, runner, timeline  # the timeline holds the runner: freed only with it (the next engine's KV budget)
        free_gpu()
        return result

    def timeline_row(self, label: str, result: dict) -> None:
        t = result["timeline"]
        self.rows.append((f"  {label} per step: run / device / launch / wait / other host",
                          f"{t['step_ms']:.2f} / {t['device_ms']:.2f} / {t['launch_ms']:.2f} / {t['finish_ms']:.2f} / "
                          f"{t['other_host_ms']:.2f} ms", ""))

    def qwen3(self) -> None:
        graphs = self.throughput("tokenmill_graphs", self.shape)
        self.rows.append(("tokenmill, CUDA graphs: output tok/s", f"{graphs['output_throughput']:,.0f}",
                          ">= 12,000 (H100)"))
        self.timeline_row("async", graphs)
        self.rows.append(("  KV cache tokens / graph capture",
                          f"{graphs['kv_cache_tokens']:,} / {graphs.get('graph_capture_s', 0):.1f}s "
                          f"{graphs.get('graph_capture_mib', 0):.0f} MiB", ""))
        in_step = self.throughput("tokenmill_sync", self.shape, async_scheduling=False)
        self.rows.append(("tokenmill, graphs, no async scheduling: tok/s",
                          f"{in_step['output_throughput']:,.0f} "
                          f"(async {graphs['output_throughput'] / in_step['output_throughput']:.2f}x)", ""))
        self.timeline_row("no async", in_step)
        eager = self.throughput("tokenmill_eager", self.shape, enforce_eager=True)
        self.rows.append(("tokenmill, enforce_eager: output tok/s", f"{eager['output_throughput']:,.0f}", ""))

    # -- 3. HF --------------------------------------------------------------------
    def hf(self) -> None:
        """HF generate in static batches (on an H100 each batch of 64 took about 125 s: its
        longest output is about 1,024 tokens, at about 120 ms a step)."""
        requests = self.workload(self.args.hf_requests)
        llm = self.engine(self.shape)
        run_throughput(llm, requests[:16], use_tqdm=False)
        ours = run_throughput(llm, requests, use_tqdm=False).to_dict()
        del llm
        free_gpu()
        model = hf_model(self.shape, self.args.dtype)
        hf_static_throughput(model, requests[:2], 2)  # warm-up: CUDA context, cuBLAS handles
        runs = []
        for bs in self.args.hf_batch_sizes:
            runs.append(hf_static_throughput(model, requests, bs))
            print(f"  HF static, batch {bs}: {runs[-1]['elapsed_s']:.1f}s, "
                  f"{runs[-1]['output_throughput']:,.0f} tok/s", flush=True)
        best = max(runs, key=lambda r: r["output_throughput"])
        ratio = ours["output_throughput"] / best["output_throughput"]
        self.results["hf_static"] = {"tokenmill": ours, "hf_runs": runs, "ratio": ratio}
        self.rows.append((f"vs HF static generate (best batch {best['batch_size']}, {len(requests)} requests)",
                          f"{ratio:.1f}x ({ours['output_throughput']:,.0f} vs {best['output_throughput']:,.0f})",
                          ">= 10x"))
        del model

    def hf_cb(self) -> None:
        """HF's continuous batching takes one max_new_tokens for all: both sides get the mean length."""
        requests = self.workload(self.args.hf_requests)
        fixed = [dataclasses.replace(r, output_len=self.args.cb_output_len) for r in requests]
        llm = self.engine(self.shape)
        run_throughput(llm, fixed[:16], use_tqdm=False)
        ours_cb = run_throughput(llm, fixed, use_tqdm=False).to_dict()
        del llm
        free_gpu()
        model = hf_model(self.shape, self.args.dtype)
        cb = hf_continuous(model, fixed, self.args.cb_output_len)
        del model
        ratio = ours_cb["output_throughput"] / cb["output_throughput"]
        self.results["hf_continuous"] = {"tokenmill": ours_cb, "hf": cb, "ratio": ratio}
        self.rows.append((f"vs HF continuous batching ({len(fixed)} requests x {self.args.cb_output_len} tokens)",
                          f"{ratio:.1f}x ({ours_cb['output_throughput']:,.0f} vs {cb['output_throughput']:,.0f})",
                          ">= 3x"))

    # -- 4. decode steps ------------------------------------------------------------
    def steps(self) -> None:
        bandwidth = copy_bandwidth() if self.cuda else float("nan")
        self.results["copy_bandwidth_gbs"] = bandwidth / 1e9
        steps = {}
        # graphs: as served; eager: enforce_eager (batch 1); torch_ops: graphs, with the layers'
        # norms, rotary and activation in torch ops instead of the Triton layer kernels
        for variant in ("graphs", "eager", "torch_ops"):
            with torch_layer_ops(variant == "torch_ops"):
                llm = self.engine(self.shape, enforce_eager=variant == "eager")
            for batch in self.args.step_batches:
                if variant == "eager" and batch != 1:
                    continue
                steps[(variant, batch)] = decode_step_time(llm, batch, self.args.step_context)
            weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
            kv_per_token = llm.engine.model_config.kv_bytes_per_token(llm.engine.runner.kv_cache_dtype)
            del llm
            free_gpu()
        detail = {}
        for batch in self.args.step_batches:
            t, idle, pipelined = steps[("graphs", batch)]
            bytes_read = weights + batch * self.args.step_context * kv_per_token
            # the copy moved `bandwidth` bytes per second, read and written together: the rate
            # at which the memory serves bytes, so a step that reads bytes_read takes at least this
            roofline = bytes_read / bandwidth
            detail[batch] = {"step_ms": t * 1e3, "gpu_ms": (t - idle) * 1e3, "roofline_ms": roofline * 1e3,
                             "ratio": t / roofline, "gpu_ratio": (t - idle) / roofline,
                             "idle_ms_between_steps": idle * 1e3, "pipelined_step_ms": pipelined * 1e3,
                             "pipelined_ratio": pipelined / roofline}
            self.rows.append((f"decode step, batch {batch}, context {self.args.step_context}",
                              f"{t * 1e3:.2f} ms = {t / roofline:.2f}x roofline ({roofline * 1e3:.2f} ms); "
                              f"GPU busy {(t - idle) * 1e3:.2f} ms, idle {idle * 1e3:.2f} ms", ""))
            self.rows.append(("  steps in a row (async scheduling overlaps them)",
                              f"{pipelined * 1e3:.2f} ms = {pipelined / roofline:.2f}x roofline",
                              "<= 1.5x at 64, 256"))
            torch_t, _, torch_pipelined = steps[("torch_ops", batch)]
            detail[batch].update(torch_ops_step_ms=torch_t * 1e3, torch_ops_pipelined_ms=torch_pipelined * 1e3)
            self.rows.append(("  Triton layer kernels vs torch ops: synced / in a row",
                              f"{torch_t / t:.2f}x / {torch_pipelined / pipelined:.2f}x "
                              f"({torch_t * 1e3:.2f} / {torch_pipelined * 1e3:.2f} ms with torch ops)", ""))
        eager_t = steps[("eager", 1)][0]
        graph_t = steps[("graphs", 1)][0]
        detail["graphs_vs_eager_batch1"] = eager_t / graph_t
        self.results["decode_steps"] = detail
        self.rows.append(("CUDA graphs vs eager, decode step at batch 1", f"{eager_t / graph_t:.2f}x", ">= 1.5x"))

    def profile(self) -> None:
        """Where a decode step's time goes (CUDA graphs on): the GPU's kernel time against
        the step's wall time, and the kernels that take most of it (--profile-quantization fp8: FP8's;
        --profile-kv-cache-dtype fp8: the 8-bit cache's; --profile-shape llama8b: the Llama-3-8B shape's)."""
        q, kv = self.args.profile_quantization, self.args.profile_kv_cache_dtype
        shape = self.big_shape if self.args.profile_shape == "llama8b" else self.shape
        llm = self.engine(shape, **({"quantization": q} if q else {}), **({"kv_cache_dtype": kv} if kv else {}))
        what = ", ".join(x for x in (self.args.profile_shape if shape is self.big_shape else "", q,
                                     kv and f"kv {kv}") if x)
        detail = {}
        host = []
        for batch in self.args.step_batches:
            wall, kernels, top = profile_decode_steps(llm, batch, self.args.step_context)
            host.append(f"== batch {batch}, context {self.args.step_context}: the host's Python, by own time\n"
                        + profile_host(llm, batch, self.args.step_context))
            detail[batch] = {"wall_ms": wall * 1e3, "kernel_ms": kernels * 1e3, "top_kernels": top}
            self.rows.append((f"profile{', ' + what if what else ''}, batch {batch}: step wall / GPU kernels",
                              f"{wall * 1e3:.2f} / {kernels * 1e3:.2f} ms; top: "
                              + ", ".join(f"{name[:28]} {ms:.2f}" for name, ms in top[:3]), ""))
        del llm
        self.results["profile"] = detail
        (self.out / "host_profile.txt").write_text("\n".join(host))

    # -- 5. Llama-3-8B ------------------------------------------------------------
    def llama8b(self) -> None:
        r = self.throughput("llama3_8b_graphs", self.big_shape)
        self.rows.append(("Llama-3-8B shape, CUDA graphs: output tok/s", f"{r['output_throughput']:,.0f}", ""))

    def table(self) -> None:
        width = max(len(r[0]) for r in self.rows)
        print(f"\n{self.results['device']}; {self.elapsed():.0f}s; details in {self.out}/results.json")
        for figure, value, target in self.rows:
            print(f"{figure:<{width}}  {value}" + (f"   [target {target}]" if target else ""))


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA device)"


def checkpoint(root: Path, shape: dict) -> Path:
    """A config.json of the shape plus the built-in tokenizer; weights are dummy."""
    path = root / f"{shape['model_type']}-{shape['hidden_size']}x{shape['num_hidden_layers']}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**shape, "torch_dtype": "bfloat16"}))
    copy_tokenizer(path)
    return path


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", default="gpu_results")
    p.add_argument("--budget-s", type=float, default=520.0, help="skip sections that would end later than this")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--hf-requests", type=int, default=64)
    p.add_argument("--hf-batch-sizes", default="64", help="HF static batch sizes to try (32 gave 241 tok/s, 64 gave 304 on an H100)")
    p.add_argument("--cb-output-len", type=int, default=256)
    p.add_argument("--step-batches", default="1,64,256")
    p.add_argument("--step-context", type=int, default=512)
    p.add_argument("--fp8-8b-requests", type=int, default=64)
    p.add_argument("--profile-quantization", default=None, help="section profile with this quantization (fp8)")
    p.add_argument("--profile-kv-cache-dtype", default=None, help="section profile with this KV cache dtype (fp8)")
    p.add_argument("--profile-shape", default="qwen3", choices=["qwen3", "llama8b"], help="section profile's model")
    p.add_argument("--tests-timeout-s", type=float, default=240.0)
    p.add_argument("--only", default="tests,qwen3,fp8,fp8_quality,steps,profile,hf,hf_cb,llama8b,fp8_8b")
    p.add_argument("--spec-concurrency", default="1,16", help="section spec's concurrencies")
    p.add_argument("--spec-rounds", type=int, default=2, help="section spec's rounds")
    p.add_argument("--spec-methods", default="ngram,draft,eagle", help="section spec's methods (speculative.py's)")
    p.add_argument("--spec-timeout-s", type=float, default=300.0)
    p.add_argument("--spec-attn-shapes", default="1x1024,16x1024,64x2048",
                   help="section spec_attn's requests x context")
    p.add_argument("--smoke", action="store_true", help="a tiny shape and workload, to check the script itself")
    args = p.parse_args()
    args.hf_batch_sizes = [int(x) for x in args.hf_batch_sizes.split(",")]
    args.step_batches = [int(x) for x in args.step_batches.split(",")]
    args.lens = (100, 1024)
    bench = Bench(args)
    bench.shape, bench.big_shape = QWEN3_06B, LLAMA3_8B
    if args.smoke:
        bench.shape = bench.big_shape = TINY
        args.lens = (16, 48)
        args.num_requests, args.hf_requests, args.max_num_seqs, args.cb_output_len = 24, 8, 8, 16
        args.fp8_8b_requests = 8
        args.hf_batch_sizes, args.step_batches, args.step_context = [4, 8], [1, 4], 64
        args.spec_concurrency, args.spec_rounds, args.spec_attn_shapes = "1", 1, "2x40"
        if not torch.cuda.is_available():
            args.dtype = "float32"
    # cost estimates (s) on an H100, so a section that cannot finish is skipped, not cut off; they run
    # in the order --only names them (the first ones are the ones a short budget keeps)
    sections = {"tests": (bench.tests, 150), "qwen3": (bench.qwen3, 130), "steps": (bench.steps, 60),
                "fp8": (partial(gpu_quant.fp8, bench), 150), "fp8_quality": (partial(gpu_quant.fp8_quality, bench), 60),
                "profile": (bench.profile, 40), "hf": (bench.hf, 170), "hf_cb": (bench.hf_cb, 150),
                "llama8b": (bench.llama8b, 90), "fp8_8b": (partial(gpu_quant.fp8_8b, bench), 180),
                "spec": (partial(gpu_spec.spec, bench), 240),
                "spec_attn": (partial(gpu_spec.verify_attention, bench), 20)}
    if unknown := [name for name in args.only.split(",") if name not in sections]:
        p.error(f"--only: unknown sections {unknown}; the sections are {list(sections)}")
    for name in dict.fromkeys(args.only.split(",")):
        fn, cost = sections[name]
        bench.section(name, fn, 0 if args.smoke else cost)
    bench.table()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
