"""CPU throughput benchmarks of the engine core, each a ratio measured in one run.

    python benchmarks/cpu_throughput.py [--only hf,static,prefix,prompts,memory,penalties,parallel,structured,int8,kv]
                                        [--output-json FILE]

hf      tokenmill vs Hugging Face transformers `generate` with static batches (its best
        batch size), both bfloat16, on a 56M-parameter random Llama (hidden 512, 8 layers,
        8 heads, 4 KV heads, intermediate 1408, vocab 32000); 64 requests, prompt and
        output lengths uniform in 32..256, ignore_eos; the median ratio of --hf-rounds
        rounds. Target: >= 4x.
static  tokenmill continuous batching vs its own `static` policy, output lengths 16..512,
        uniform and log-uniform. Target: >= 2x.
prefix  prefix caching on vs off: 64 requests sharing a 1024-token prefix. Target: >= 3x.
prompts prompt tokens/s of the native bf16 prefill attention kernel vs torch's SDPA in the
        same engine, prompts of 256, 1024 and 2000 tokens.
memory  resident memory over 5,000 requests through one engine: must stay flat.
penalties  the hf workload with presence, frequency and repetition penalties and a logit bias
        on every request vs none, rounds in turn, the median ratio. Target: >= 0.95.
parallel  n=4 on a 512-token prompt (1 and 16 output tokens each, sampled) vs the same
        four sequences as four separate requests (seeds seed + i), with prefix caching off
        (four prefills) and on (vLLM v1's way: the others hit the first one's blocks):
        prompt tokens computed and time, rounds in turn, medians. Target: >= 2x faster than
        four separate prefills.
structured  16 concurrent requests whose output must fit a JSON schema (an array of typed
        objects, so every request runs to max_tokens) vs the same requests unconstrained,
        sampled, on the built-in model (vocab 8192, the forward is cheapest there, so the mask
        weighs most) and on the 56M model (vocab 32000); rounds in turn, median ratio of
        output tokens/s. Target: >= 0.85.
int8    W8A8 INT8 (quantization="int8", made on load) vs the 16-bit model (bf16 where the CPU
        has it natively, else float32: what `dtype="auto"` runs), output tokens/s, rounds in
        turn: the 56M model with the hf workload (64 requests, 32..256 in and out), and a
        wide dummy model (hidden 2048, intermediate 5632, 16 heads, 8 KV heads, 4 layers,
        vocab 32000) with 32 requests, 32..128 in and out. Targets: >= 1.5x and >= 1.6x. Then
        one run each with timers on the linear layers: the Amdahl bound on the ratio.
kv      8-bit KV cache (kv_cache_dtype int8 and fp8) vs the 16-bit cache under a KV budget
        that holds half the workload in bfloat16: the hf workload on the 56M model (model
        dtype auto), output tokens/s, rounds in turn. The 16-bit run gets the token capacity
        a bfloat16 cache would have (where the model runs float32, its cache is float32 and
        gets twice the bytes); the 8-bit runs get the bytes of the bfloat16 cache. Not in
        the default set. Target: >= 1.3x.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import cpu_quant  # the int8 and kv sections (this folder; python puts a script's folder on its path)
import torch

from tokenmill import LLM
from tokenmill.bench.hf_baseline import hf_static_throughput
from tokenmill.bench.offline import copy_tokenizer, run_throughput
from tokenmill.bench.workloads import random_requests

SHAPE_56M = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                 num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048)


def make_checkpoint(root: Path) -> Path:
    """The 56M Llama with random weights, saved by transformers in bfloat16 (same weights for both sides)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE_56M, bos_token_id=0, eos_token_id=0)).to(torch.bfloat16)
    path = root / "llama-56m"
    model.save_pretrained(path)
    copy_tokenizer(path)
    return path


def hf_static(path: Path, requests, batch_size: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    return hf_static_throughput(model, requests, batch_size)


def bench_hf(path: Path, args) -> dict:
    """HF's best batch size first, then more rounds of tokenmill and HF at that size in turn:
    the ratio is the median over rounds, each round's two runs a few seconds apart (the
    machine's load drifts over minutes)."""
    requests = random_requests(64, (32, 256), (32, 256), SHAPE_56M["vocab_size"], seed=0)
    llm = LLM(str(path), dtype="bfloat16")
    run_throughput(llm, requests[:8], use_tqdm=False)  # warm-up
    ours = [run_throughput(llm, requests, use_tqdm=False).to_dict()]
    hf_runs = [hf_static(path, requests, bs) for bs in args.hf_batch_sizes]
    best = max(hf_runs, key=lambda r: r["output_throughput"])
    hf = [best]
    for _ in range(args.hf_rounds - 1):
        ours.append(run_throughput(llm, requests, use_tqdm=False).to_dict())
        hf.append(hf_static(path, requests, best["batch_size"]))
    del llm
    gc.collect()
    ratios = [o["output_throughput"] / h["output_throughput"] for o, h in zip(ours, hf)]
    for i, (o, h, r) in enumerate(zip(ours, hf, ratios), 1):
        print(f"[hf] round {i}: tokenmill {o['output_throughput']:.1f} tok/s, HF static batching (batch size "
              f"{h['batch_size']}) {h['output_throughput']:.1f} tok/s: {r:.2f}x")
    ratio = statistics.median(ratios)
    print(f"[hf] tokenmill vs HF static batching, median of {len(ratios)} rounds: {ratio:.2f}x (target 4x)")
    return {"tokenmill": ours, "hf_static": hf_runs, "hf_rounds": hf, "ratios": ratios, "ratio": ratio,
            "target": 4.0}


def run_fresh(path: Path, requests, **engine_args) -> dict:
    """One run on a new engine (bfloat16), freed afterwards so runs do not share memory."""
    llm = LLM(str(path), dtype="bfloat16", **engine_args)
    result = run_throughput(llm, requests, use_tqdm=False).to_dict()
    result["prefix_cache_hit_rate"] = llm.engine.stats()["prefix_cache_hit_rate"]
    del llm
    gc.collect()
    return result


def bench_static(path: Path, args) -> dict:
    """Continuous vs static at each max_num_seqs, output lengths 16..512 uniform and
    log-uniform. Static batches run to their longest output, so the gain is bounded by
    E[max of a batch's outputs] / E[output]: 1.73 (8) and 1.88 (32) uniform, 2.57 and 3.25
    log-uniform. On a CPU a decode step costs about in proportion to its batch, which
    keeps the measured gain below that bound."""
    out = {}
    for dist in args.static_dists:
        requests = random_requests(args.static_requests, (32, 256), (16, 512), SHAPE_56M["vocab_size"], seed=1,
                                   output_dist=dist)
        for seqs in args.max_num_seqs:
            results = {policy: run_fresh(path, requests, scheduler=policy, max_num_seqs=seqs)
                       for policy in ("continuous", "static")}
            ratio = results["continuous"]["output_throughput"] / results["static"]["output_throughput"]
            print(f"[static] continuous {results['continuous']['output_throughput']:.1f} tok/s vs static "
                  f"{results['static']['output_throughput']:.1f} tok/s (max_num_seqs {seqs}, "
                  f"{args.static_requests} requests, outputs 16..512 {dist}): {ratio:.2f}x (target 2x)")
            out[f"{dist}_max_num_seqs_{seqs}"] = {**results, "ratio": ratio, "target": 2.0}
    return out


def bench_prefix(path: Path, args) -> dict:
    requests = random_requests(64, (16, 64), (16, 16), SHAPE_56M["vocab_size"], seed=2, prefix_len=1024)
    results = {f"prefix_caching_{'on' if caching else 'off'}": run_fresh(path, requests, enable_prefix_caching=caching)
               for caching in (True, False)}
    ratio = results["prefix_caching_off"]["elapsed_s"] / results["prefix_caching_on"]["elapsed_s"]
    print(f"[prefix] 64 requests sharing a 1024-token prefix: {results['prefix_caching_on']['elapsed_s']:.2f}s "
          f"with prefix caching vs {results['prefix_caching_off']['elapsed_s']:.2f}s without: {ratio:.2f}x "
          f"(target 3x; hit rate {results['prefix_caching_on']['prefix_cache_hit_rate']:.2f})")
    return {**results, "ratio": ratio, "target": 3.0}


def bench_prompts(path: Path, args) -> dict:
    """Prompt throughput with the native prefill attention kernel vs the same engine with
    torch's SDPA (its CPU flash kernel; a gather and a mask for later chunks), in turn."""
    llm = LLM(str(path), dtype="bfloat16", enable_prefix_caching=False)
    backend = llm.engine.runner.attn
    if not getattr(backend, "prefill_kernel", False):
        print("[prompts] skipped: the bf16 prefill kernel needs the CPU kernels on a CPU with AVX512-BF16")
        return {}
    out = {}
    for length in (256, 1024, 2000):
        requests = random_requests(16, (length, length), (1, 1), SHAPE_56M["vocab_size"], seed=3)
        run_throughput(llm, requests[:2], use_tqdm=False)  # warm-up
        runs = {"kernel": [], "sdpa": []}
        for _ in range(3):
            for name in runs:
                backend.prefill_kernel = name == "kernel"
                r = run_throughput(llm, requests, use_tqdm=False).to_dict()
                runs[name].append(r["input_tokens"] / r["elapsed_s"])
        kernel, sdpa = statistics.median(runs["kernel"]), statistics.median(runs["sdpa"])
        print(f"[prompts] 16 prompts of {length} tokens: {kernel:.0f} prompt tokens/s with the prefill kernel vs "
              f"{sdpa:.0f} with SDPA: {kernel / sdpa:.2f}x (medians of 3)")
        out[f"prompt_{length}"] = {**runs, "ratio": kernel / sdpa}
    backend.prefill_kernel = True
    return out


def bench_penalties(path: Path, args) -> dict:
    requests = random_requests(64, (32, 256), (32, 256), SHAPE_56M["vocab_size"], seed=0)
    knobs = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={7: -5.0, 11: 2.0})
    llm = LLM(str(path))  # auto: bfloat16 where the CPU has it natively, else float32
    run_throughput(llm, requests[:8], use_tqdm=False, **knobs)  # warm-up
    plain, penalised = [], []
    for _ in range(args.penalty_rounds):
        plain.append(run_throughput(llm, requests, use_tqdm=False).output_throughput)
        penalised.append(run_throughput(llm, requests, use_tqdm=False, **knobs).output_throughput)
    ratios = [b / a for a, b in zip(plain, penalised)]
    for i, (a, b, r) in enumerate(zip(plain, penalised, ratios), 1):
        print(f"[penalties] round {i}: {a:.0f} tok/s without, {b:.0f} with penalties and bias on every request: "
              f"{r:.3f}")
    ratio = statistics.median(ratios)
    print(f"[penalties] with / without, median of {len(ratios)} rounds: {ratio:.3f} (target >= 0.95)")
    return {"plain": plain, "penalised": penalised, "ratios": ratios, "ratio": ratio, "target": 0.95}


def bench_parallel(path: Path, args) -> dict:
    from tokenmill import SamplingParams

    prompt = {"prompt_token_ids": [int(t) for t in torch.randint(16, SHAPE_56M["vocab_size"], (512,),
                                                                  generator=torch.Generator().manual_seed(4))]}
    out = {}
    for caching, max_tokens in itertools.product((False, True), args.parallel_output_lens):
        base = dict(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        forked = SamplingParams(n=4, seed=11, **base)
        separate = [SamplingParams(seed=11 + i, **base) for i in range(4)]
        llm = LLM(str(path), enable_prefix_caching=caching)
        engine = llm.engine
        llm.generate(prompt, forked, use_tqdm=False)  # warm-up
        times = {"n=4": [], "separate": []}
        computed = {}
        for _ in range(args.parallel_rounds):
            for name in times:
                if caching:
                    engine.kv_cache.reset_prefix_cache()  # each round starts cold
                before = engine.stats()["num_prompt_tokens_computed"]
                t0 = time.perf_counter()
                outs = llm.generate(prompt, forked, use_tqdm=False) if name == "n=4" else \
                    llm.generate([prompt] * 4, separate, use_tqdm=False)
                times[name].append(time.perf_counter() - t0)
                computed[name] = engine.stats()["num_prompt_tokens_computed"] - before
                tokens = [c.token_ids for o in outs for c in o.outputs]
                out.setdefault(f"tokens_{name}", tokens)
        assert out.pop("tokens_n=4") == out.pop("tokens_separate"), "n=4 and separate requests sampled differently"
        fork_s, sep_s = statistics.median(times["n=4"]), statistics.median(times["separate"])
        key = f"prefix_caching_{'on' if caching else 'off'}_output_{max_tokens}"
        print(f"[parallel] n=4, 512-token prompt, {max_tokens} output tokens, prefix caching "
              f"{'on' if caching else 'off'}: {fork_s:.2f}s and {computed['n=4']} prompt tokens computed vs four "
              f"requests {sep_s:.2f}s and {computed['separate']}: {sep_s / fork_s:.2f}x (medians of "
              f"{args.parallel_rounds}; target 2x with caching off)")
        out[key] = {"times": times, "prompt_tokens_computed": computed, "ratio": sep_s / fork_s}
        del llm
        gc.collect()
    out["target"] = 2.0
    return out


STRUCTURED_SCHEMA = {"type": "array", "minItems": 32, "items": {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                   "kind": {"enum": ["cat", "dog", "bird"]}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "kind", "tags"], "additionalProperties": False}}


def bench_structured(path: Path, args) -> dict:
    from tokenmill import StructuredOutputsParams
    from tokenmill.config import DEFAULT_MODEL_DIR

    spec = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    out = {}
    for name, model in (("builtin", DEFAULT_MODEL_DIR), ("56m", path)):
        llm = LLM(str(model))
        vocab = llm.engine.model_config.vocab_size
        requests = random_requests(16, (32, 128), (args.structured_output_len,) * 2, min(vocab, 8192), seed=5)
        run_throughput(llm, requests, use_tqdm=False, temperature=1.0, structured_outputs=spec)  # compiles once
        plain, constrained = [], []
        for _ in range(args.structured_rounds):
            plain.append(run_throughput(llm, requests, use_tqdm=False, temperature=1.0).output_throughput)
            constrained.append(run_throughput(llm, requests, use_tqdm=False, temperature=1.0,
                                              structured_outputs=spec).output_throughput)
        ratios = [b / a for a, b in zip(plain, constrained)]
        ratio = statistics.median(ratios)
        print(f"[structured] {name} model, 16 concurrent, {args.structured_output_len} tokens each: "
              f"{statistics.median(plain):.0f} tok/s unconstrained, {statistics.median(constrained):.0f} with a JSON "
              f"schema: {ratio:.3f} (median of {len(ratios)} rounds; target >= 0.85)")
        out[name] = {"plain": plain, "constrained": constrained, "ratios": ratios, "ratio": ratio}
        del llm
        gc.collect()
    out["target"] = 0.85
    return out


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def bench_memory(path: Path, args) -> dict:
    """5,000 short requests in waves through one engine (built-in model), RSS after each wave."""
    llm = LLM(kv_cache_memory="64MiB")
    vocab = llm.engine.model_config.vocab_size
    samples = []
    total = 0
    for wave in range(args.memory_requests // 500):
        run_throughput(llm, random_requests(500, (8, 48), (4, 24), vocab, seed=100 + wave), use_tqdm=False)
        gc.collect()
        total += 500
        samples.append((total, rss_mib()))
        print(f"[memory] {total:5d} requests: RSS {samples[-1][1]:.1f} MiB")
    growth = samples[-1][1] - samples[1][1]
    print(f"[memory] RSS growth from request {samples[1][0]} to {samples[-1][0]}: {growth:+.1f} MiB "
          f"(peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    return {"samples": samples, "growth_mib": growth, "tracked_requests_left": len(llm.engine._tracked)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="hf,static,prefix,prompts,memory,penalties,parallel,structured,int8")
    parser.add_argument("--hf-rounds", type=int, default=3, help="rounds of tokenmill vs HF at HF's best batch size")
    parser.add_argument("--hf-batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64])
    parser.add_argument("--static-requests", type=int, default=96)
    parser.add_argument("--static-dists", type=lambda s: s.split(","), default=["uniform", "loguniform"])
    parser.add_argument("--max-num-seqs", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32])
    parser.add_argument("--memory-requests", type=int, default=5000)
    parser.add_argument("--penalty-rounds", type=int, default=3)
    parser.add_argument("--parallel-rounds", type=int, default=3)
    parser.add_argument("--parallel-output-lens", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--structured-rounds", type=int, default=3)
    parser.add_argument("--structured-output-len", type=int, default=128)
    parser.add_argument("--int8-rounds", type=int, default=3)
    parser.add_argument("--kv-rounds", type=int, default=3)
    parser.add_argument("--output-json", default="bench_results/cpu_throughput.json")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp))
        for name in args.only.split(","):
            results[name] = {"hf": bench_hf, "static": bench_static, "prefix": bench_prefix,
                             "prompts": bench_prompts, "memory": bench_memory,
                             "penalties": bench_penalties, "parallel": bench_parallel,
                             "structured": bench_structured, "int8": cpu_quant.bench_int8,
                             "kv": cpu_quant.bench_kv}[name](path, args)
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(results, indent=2))
    print(f"results written to {args.output_json}")


if __name__ == "__main__":
    main()
