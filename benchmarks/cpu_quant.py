"""The quantization sections of cpu_throughput.py (`--only int8,kv`; their descriptions are
there): W8A8 INT8 against the 16-bit model, and the 8-bit KV cache against the 16-bit one
under a KV budget, both on the 56M random Llama that cpu_throughput.py writes."""

from __future__ import annotations

import gc
import json
import statistics
from pathlib import Path

import torch

from tokenmill import LLM
from tokenmill.bench.offline import copy_tokenizer, linear_time_split, run_throughput
from tokenmill.bench.workloads import random_requests


def vocab_size(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["vocab_size"]


SHAPE_WIDE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048)


def bench_int8(path: Path, args) -> dict:
    from transformers import LlamaConfig

    wide = path.parent / "llama-wide"
    LlamaConfig(**SHAPE_WIDE, bos_token_id=0, eos_token_id=0).save_pretrained(wide)
    copy_tokenizer(wide)
    cases = (("56m", path, {}, random_requests(64, (32, 256), (32, 256), vocab_size(path), seed=0)),
             ("wide", wide, {"load_format": "dummy"}, random_requests(32, (32, 128), (32, 128), 32000, seed=1)))
    out = {}
    for name, model, load, requests in cases:
        runs = {"16-bit": [], "int8": []}
        llms = {"16-bit": LLM(str(model), **load), "int8": LLM(str(model), quantization="int8", **load)}
        dtype = str(llms["16-bit"].engine.dtype).removeprefix("torch.")
        for llm in llms.values():
            run_throughput(llm, requests[:4], use_tqdm=False)  # warm-up
        for _ in range(args.int8_rounds):
            for key, llm in llms.items():
                runs[key].append(run_throughput(llm, requests, use_tqdm=False).output_throughput)
        ratios = [b / a for a, b in zip(runs["16-bit"], runs["int8"])]
        ratio = statistics.median(ratios)
        target = 1.5 if name == "56m" else 1.6
        print(f"[int8] {name} model, {len(requests)} requests: {statistics.median(runs['16-bit']):.0f} tok/s in "
              f"{dtype}, {statistics.median(runs['int8']):.0f} with W8A8 int8: {ratio:.2f}x (median of "
              f"{len(ratios)} rounds; target {target}x)")
        split = {key: linear_time_split(llm, requests) for key, llm in llms.items()}
        for key, t in split.items():
            print(f"[int8]   {key}: {t['total']:.2f} s = layers' linears {t['layers']:.2f} + LM head {t['lm_head']:.2f}"
                  f" + the rest {t['rest']:.2f}")
        b, fixed = split["16-bit"], split["16-bit"]["lm_head"] + split["16-bit"]["rest"]
        bound = b["total"] / fixed
        needs = (f"{target}x needs them {b['layers'] / (b['total'] / target - fixed):.1f}x faster than {dtype}"
                 if bound > target else f"{target}x is out of reach by the linears alone")
        print(f"[int8]   bound: {bound:.2f}x with the layers' linears free; {needs} (the rest unchanged)")
        out[name] = {"dtype": dtype, **runs, "ratios": ratios, "ratio": ratio, "target": target, "split": split}
        del llms
        gc.collect()
    return out


def bench_kv(path: Path, args) -> dict:
    requests = random_requests(64, (32, 256), (32, 256), vocab_size(path), seed=0)
    probe = LLM(str(path), kv_cache_memory="1MiB")
    mc, dtype = probe.engine.model_config, probe.engine.dtype
    del probe
    tokens = sum(r.prompt_len + r.output_len for r in requests)
    bf16_budget = tokens * mc.kv_bytes_per_token(torch.bfloat16) // 2
    configs = {"16-bit": dict(kv_cache_memory=bf16_budget * dtype.itemsize // 2),
               "int8": dict(kv_cache_memory=bf16_budget, kv_cache_dtype="int8"),
               "fp8": dict(kv_cache_memory=bf16_budget, kv_cache_dtype="fp8")}
    llms = {k: LLM(str(path), **c) for k, c in configs.items()}
    for llm in llms.values():
        run_throughput(llm, requests[:4], use_tqdm=False)  # warm-up
    runs = {k: [] for k in llms}
    preemptions = {}
    for _ in range(args.kv_rounds):
        for key, llm in llms.items():
            before = llm.engine.scheduler.num_preemptions
            runs[key].append(run_throughput(llm, requests, use_tqdm=False).output_throughput)
            preemptions[key] = llm.engine.scheduler.num_preemptions - before
            llm.engine.kv_cache.reset_prefix_cache()
    out = {"workload_kv_tokens": tokens, "bf16_budget_bytes": bf16_budget, "dtype": str(dtype)}
    for key, llm in llms.items():
        capacity = llm.engine.kv_capacity_tokens
        ratios = [b / a for a, b in zip(runs["16-bit"], runs[key])]
        out[key] = {"runs": runs[key], "capacity_tokens": capacity, "preemptions_last_round": preemptions[key],
                    "ratio": statistics.median(ratios)}
        print(f"[kv] {key:>6} cache ({str(llm.engine.runner.kv_cache_dtype).removeprefix('torch.')}): "
              f"{capacity} tokens of the workload's {tokens}, {statistics.median(runs[key]):.0f} tok/s, "
              f"{preemptions[key]} preemptions a round; {out[key]['ratio']:.2f}x the 16-bit cache "
              f"(median of {len(ratios)} rounds; target 1.3x)")
    return out
