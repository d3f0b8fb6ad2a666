"""Quality of the quantized paths on the built-in model (the only trained model here), each
scheme against the 16-bit model, all through tokenmill's engine:

    python benchmarks/quant_quality.py [--schemes int8,kv-int8,kv-fp8] [--windows 48] [--output-json FILE]

Schemes: int8 / fp8 (W8A8 weights and activations; fp8 on CUDA only), kv-int8 / kv-fp8 /
kv-fp8_e5m2 (the 16-bit model over an 8-bit KV cache, kv_cache_dtype); float32 / bfloat16
(no quantization, the model in that dtype: how far two unquantized runs differ).

perplexity  on the held-out standard-library files of the model's training split
            (scripts/train_demo_model.py), in 512-token windows, from the engine's own
            prompt logprobs
agreement   the share of greedy tokens equal to the 16-bit model's, position by position,
            over 64 held-out function signatures x 64 tokens (one changed token changes
            the rest of its sequence, so this mostly measures where the first change is)
next-token  the share of positions of the held-out windows where the most likely next token
            (given the same true prefix) is the 16-bit model's: each choice alone
ast         the share of held-out function completions (cut at the end of the body) that
            parse with `ast`

Targets: perplexity within +3% for W8A8 INT8 (+1% for a quantized KV cache); agreement
at least 90% for a quantized KV cache.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]  # runs from a checkout, installed or not

from train_demo_model import cut_body, function_prompts, load_tokenizer, parses, split_files, token_stream  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.config import DEFAULT_MODEL_DIR  # noqa: E402

SCHEMES = {"int8": {"quantization": "int8"}, "fp8": {"quantization": "fp8"},  # fp8 weights: CUDA
           "kv-int8": {"kv_cache_dtype": "int8"}, "kv-fp8": {"kv_cache_dtype": "fp8"},
           "kv-fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
           # the metric's noise floor: the unquantized model in another 16/32-bit dtype
           "float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}}
WINDOW = 512


def perplexity(llm: LLM, windows: list[list[int]]) -> tuple[float, list[int]]:
    """The windows' perplexity and the most likely next token at each position."""
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)
    total, count, top = 0.0, 0, []
    for window, out in zip(windows, outs):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            total += entry[token]
            count += 1
            top.append(max(entry, key=entry.get))
    return math.exp(-total / count), top


def evaluate(llm: LLM, windows, prompts, signatures) -> dict:
    greedy = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    completions = llm.generate(prompts, SamplingParams(max_tokens=160, temperature=0), use_tqdm=False)
    parsed = [parses(sig, cut_body(sig, o.outputs[0].text, o.outputs[0].finish_reason == "stop"))
              for sig, o in zip(signatures, completions)]
    ppl, top = perplexity(llm, windows)
    return {"perplexity": ppl, "top": top, "greedy": [o.outputs[0].token_ids for o in greedy],
            "ast": sum(parsed) / len(parsed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", type=lambda s: s.split(","), default=list(SCHEMES))
    parser.add_argument("--dtype", default="bfloat16", help="the 16-bit baseline's and the schemes' activations")
    parser.add_argument("--windows", type=int, default=48, help="512-token windows of held-out text")
    parser.add_argument("--functions", type=int, default=64)
    parser.add_argument("--output-json", default="bench_results/quant_quality.json")
    args = parser.parse_args()

    _, val_files = split_files()
    ids = token_stream(load_tokenizer(DEFAULT_MODEL_DIR), val_files).tolist()
    windows = [ids[i * WINDOW:(i + 1) * WINDOW] for i in range(min(args.windows, len(ids) // WINDOW))]
    items = function_prompts(val_files, args.functions)
    engine_args = dict(dtype=args.dtype, kv_cache_memory="256MiB", max_model_len=1024)
    results = {}
    base = None
    for name in ["16-bit", *args.schemes]:
        llm = LLM(str(DEFAULT_MODEL_DIR), **{**engine_args, **SCHEMES.get(name, {})})
        tok = llm.tokenizer
        prompts = [{"prompt_token_ids": tok.encode(p)[-384:]} for p, _ in items]
        r = evaluate(llm, windows, prompts, [sig for _, sig in items])
        if base is None:
            base = r
        same = sum(a == b for g, w in zip(r["greedy"], base["greedy"]) for a, b in zip(g, w))
        r["agreement"] = same / sum(len(w) for w in base["greedy"])
        r["next_token_agreement"] = sum(a == b for a, b in zip(r["top"], base["top"])) / len(base["top"])
        r["perplexity_change"] = r["perplexity"] / base["perplexity"] - 1
        print(f"{name:8s} perplexity {r['perplexity']:.3f} ({r['perplexity_change']:+.2%}), greedy agreement "
              f"{r['agreement']:.3f}, next-token agreement {r['next_token_agreement']:.4f}, ast {r['ast']:.3f} "
              f"({len(windows) * (WINDOW - 1)} tokens, {len(items)} functions)", flush=True)
        results[name] = {k: v for k, v in r.items() if k not in ("greedy", "top")}
        del llm
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
