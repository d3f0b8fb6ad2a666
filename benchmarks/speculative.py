"""Speculative decoding on the built-in model, greedy, against decoding without drafts in the
same run:

    python benchmarks/speculative.py [--concurrency 1,4,16,64] [--methods ngram] [--rounds 2]

Prompt sets (held-out standard-library files, as the built-in model's evaluation uses):
completion  a file up to a function's signature (its last 384 tokens); the model writes the body
rewrite     input-grounded: a whole function, then "# The same function, with its variables
            renamed:" and its signature again; the model mostly copies the body it was shown

`--model 56m` runs the random 56M Llama of cpu_throughput.py instead, whose step is bound by
its GEMMs: there drafts cost time at large batches. At each concurrency c, 2c requests (at
least 8) run through an engine with max_num_seqs = c, 128 output tokens each (ignore_eos, so
both sides do the same work). Reported: TPOT (median over requests of (last token - first
token) / (tokens - 1)), output tokens/s, the acceptance rate (accepted / drafted tokens), the
mean accepted length (tokens a request gets from one verification step: 1 + accepted /
verification steps) and the share of outputs identical to decoding without drafts (always
100% with --dtype float32, which asserts it; in bfloat16 the logits of a request's k + 1
rows can round differently from one row's, so a near-tie between the top two tokens can
flip, as in any engine). In each round every engine (plain decoding and each method) runs
the workload at once, taking turns of `--turn` seconds (0.5; each step runs whole) in an
order that turns by one each round, and each is timed on its own clock, the sum of its
turns: a moment's load on the machine falls on all of them alike (tokenmill.bench.interleave). The
medians over rounds are compared, each ratio with a 95% bootstrap interval over the rounds.
`--turn 0`: each engine runs the whole workload in turn instead. Every run starts with an
empty prefix cache, so that it prefills its prompts as distinct requests would.

Methods: ngram, draft (the built-in draft model) and eagle (the built-in EAGLE head, which
drafts from the target's hidden states), each adaptive (the default) and -fixed
("adaptive": false: every draft verified), and each drafter's also -fullvocab (its LM head
over the whole vocabulary, not its built-in token map); none-2, a second engine without drafts, shows
how far two identical engines differ. `--self-baseline` (with --turn 0): each speculating
engine also runs every round with its speculation switched off (its proposer and drafter set aside, so it
steps as an engine built without them), right before or after its own run; those ratios
compare one engine instance with itself. On the 2-core development machine an engine
instance keeps a speed of its own: the same engine with speculation off ran 0.92-1.12x the
"none" engine's medians over 10-12 rounds, from one invocation to the next.
`--no-drafts` (with --self-baseline): adaptive speculation's choice always answers no drafts,
so its rests and bookkeeping are all the speculating engines add: what speculation costs
where it does not pay.

Targets (issue 17): at concurrency 1, TPOT at least 1.8x better with n-gram on the rewrite
set and 1.3x with a draft model on the completion set; adaptive speculation at least 0.97x
the throughput of no speculation at every concurrency.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from train_demo_model import function_prompts, functions, split_files  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.bench.interleave import GcTime, run_interleaved  # noqa: E402

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# ngram: adaptive (the default: each step chooses each request's drafts); ngram-fixed: always
# as many drafts as the lookup finds, up to k (vLLM's behaviour)
# draft: the built-in draft model (the default draft for the built-in model only)
DRAFT = {"method": "draft_model", "num_speculative_tokens": 4}
# eagle: the built-in EAGLE head, drafting from the target's hidden states
EAGLE = {"method": "eagle", "num_speculative_tokens": 4}
# none-2: a second engine without speculation, the control: its ratio against "none" is what
# two identical engines differ by here (on the 2-core development machine their medians over
# 5-10 rounds were 0.96-1.05x apart: an engine instance's forwards keep a speed of their own)
METHODS = {"ngram": NGRAM, "ngram-fixed": {**NGRAM, "adaptive": False},
           "draft": DRAFT, "draft-fixed": {**DRAFT, "adaptive": False},
           "eagle": EAGLE, "eagle-fixed": {**EAGLE, "adaptive": False}, "none-2": None}
# draft-fullvocab, eagle-fixed-fullvocab, ...: the drafter's LM head over the whole vocabulary,
# not cut to its built-in token map (executor/spec/vocab.py); only when named in --methods
FULL_VOCAB = {f"{m}-fullvocab": {**METHODS[m], "token_map": False}
              for m in ("draft", "draft-fixed", "eagle", "eagle-fixed")}
OUTPUT_LEN = 128
PARAMS = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)


def rewrite_prompts(files: list[tuple[str, str]], limit: int) -> list[str]:
    """A function of 300..1500 characters, then the request to write it again."""
    found = []
    for text, lines, node in functions(files):
        source = ast.get_source_segment(text, node) if node.col_offset == 0 else None
        if source and 300 <= len(source) <= 1500 and node.body[0].lineno > node.lineno:
            signature = "".join(lines[node.lineno - 1:node.body[0].lineno - 1]).rstrip()
            found.append(f"{source}\n\n\n# The same function, with its variables renamed:\n{signature}")
    return found[::max(1, len(found) // limit)][:limit]


def inputs_of(llm: LLM, prompts: list, tokenizer_limit: int = 384) -> list[dict]:
    """The prompts' last `tokenizer_limit` tokens, with `llm`'s prefix cache emptied: every run
    prefills its prompts, as distinct requests would. Hits on the runs before skip the prefill
    and the EAGLE head's catch-up, and can reuse blocks whose head entries a run with
    speculation off never wrote (the head reads stale K/V there: worse drafts, not wrong
    ones). In one 16-round run with cached prompts the head's acceptance at concurrency 1 was
    0.41, against 0.76-0.79 elsewhere (which blocks went stale there was not pinned down)."""
    llm.engine.kv_cache.reset_prefix_cache()
    return [{"prompt_token_ids": llm.tokenizer.encode(p)[-tokenizer_limit:]} for p in prompts]


def result(llm: LLM, outs: list, seconds: float, tpot: float, before: tuple[dict, int],
           collecting: GcTime) -> dict:
    """A run's figures: `outs` its outputs, `seconds` its time, `tpot` its median TPOT,
    `before` the engine's stats and verification steps when it began, `collecting` the
    garbage collector's passes during it."""
    stats = llm.engine.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafted = stats["spec_decode_num_draft_tokens"] - before[0]["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"] - before[0]["spec_decode_num_accepted_tokens"]
    verify_steps = llm.engine.scheduler.num_spec_steps - before[1]
    return {"tpot_ms": tpot * 1e3, "output_throughput": tokens / seconds,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": 1 + accepted / verify_steps if verify_steps else None,
            "gc_collections": collecting.count, "gc_seconds": collecting.seconds,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def run(llm: LLM, prompts: list, tokenizer_limit: int = 384, speculate: bool = True) -> dict:
    """The prompts through `llm`, greedy; `speculate=False`: with its speculation switched off
    for this run (the engine then steps as one built without it)."""
    engine = llm.engine
    if not speculate:
        saved = engine.proposer, engine.runner.drafter
        engine.proposer = engine.runner.drafter = None
        try:
            return run(llm, prompts, tokenizer_limit)
        finally:
            engine.proposer, engine.runner.drafter = saved
    inputs = inputs_of(llm, prompts, tokenizer_limit)
    before = engine.stats(), engine.scheduler.num_spec_steps
    collecting = GcTime()
    gc.callbacks.append(collecting)
    t0 = time.perf_counter()
    try:
        outs = llm.generate(inputs, PARAMS, use_tqdm=False)
    finally:
        elapsed = time.perf_counter() - t0
        gc.callbacks.remove(collecting)
    tpot = statistics.median((o.metrics.last_token_time - o.metrics.first_token_time)
                             / (len(o.outputs[0].token_ids) - 1) for o in outs)
    return result(llm, outs, elapsed, tpot, before, collecting)


def run_turns(llms: dict[str, LLM], prompts: list, turn: float, tokenizer_limit: int = 384) -> dict[str, dict]:
    """The prompts through every engine at once, taking turns of `turn` seconds in the order
    given (tokenmill.bench.interleave), each timed on its own clock."""
    first, *others = llms.values()  # the prompts tokenized once (one tokenizer); every prefix cache emptied
    ids = [x["prompt_token_ids"] for x in inputs_of(first, prompts, tokenizer_limit)]
    for llm in others:
        llm.engine.kv_cache.reset_prefix_cache()
    before = {name: (llm.engine.stats(), llm.engine.scheduler.num_spec_steps) for name, llm in llms.items()}
    turns = run_interleaved(llms, ids, PARAMS, turn)
    return {name: result(llms[name], t.outputs, t.seconds, statistics.median(t.time_per_output_token()),
                         before[name], t.collecting) for name, t in turns.items()}


def median_interval(ratios: list[float], resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """A 95% bootstrap interval of the median of per-round ratios (rounds resampled with
    replacement; percentiles 2.5 and 97.5 of the resampled medians). Each round's ratio pairs
    runs made back to back, so a slow minute of the machine falls on both sides of it; the
    interval says how far the rounds' spread leaves the median undecided (a target such as
    0.97x is shown met only where the interval's low end passes it)."""
    if len(ratios) < 4:
        return None
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    parser.add_argument("--methods", type=lambda s: s.split(","), default=None,
                        help=f"of {', '.join(METHODS)}, {', '.join(FULL_VOCAB)}; default: all but the -fullvocab "
                        "ones (the n-gram ones with --model)")
    parser.add_argument("--sets", type=lambda s: s.split(","), default=["completion", "rewrite"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--model", default=None, help="a checkpoint directory, or 56m: the random 56M Llama of "
                        "cpu_throughput.py with the built-in tokenizer (its step is bound by its GEMMs); "
                        "default: the built-in model")
    parser.add_argument("--draft-model", default=None, help="the draft methods' checkpoint (default: the built-in "
                        "draft, the default draft for the built-in model)")
    parser.add_argument("--eagle-model", default=None, help="the eagle methods' head (default: the built-in one)")
    parser.add_argument("--turn", type=float, default=0.5,
                        help="seconds of each engine's turn in a round's interleaved run (tokenmill.bench.interleave); "
                        "0: each engine runs the whole workload in turn")
    parser.add_argument("--self-baseline", action="store_true",
                        help="each speculating engine also runs every round with its speculation switched off; "
                        "ratios against those runs too (one engine instance, so its own forward speed on both "
                        "sides)")
    parser.add_argument("--no-drafts", action="store_true",
                        help="adaptive speculation's choice always gives no drafts (a draft model or head still "
                        "verifies its first 32, to learn its rate): the cost of speculation that does not pay")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help='more LLM arguments for every engine, as JSON (on a GPU: \'{"gpu_memory_utilization": '
                        '0.08}\', each engine taking a share of the device)')
    parser.add_argument("--output-json", default="bench_results/speculative.json")
    args = parser.parse_args()
    if args.self_baseline and args.turn:
        parser.error("--self-baseline: needs --turn 0 (an engine's runs with speculation on and off cannot interleave)")
    if args.no_drafts:
        from tokenmill.executor.spec import ngram, rests

        def no_drafts(rates, *_, **__):
            return [0] * len(rates)

        rests.choose_num_drafts = ngram.choose_num_drafts = no_drafts
    if args.draft_model:
        for name in ("draft", "draft-fixed"):
            METHODS[name] = {**METHODS[name], "model": args.draft_model}
            FULL_VOCAB[f"{name}-fullvocab"]["model"] = args.draft_model
    if args.eagle_model:
        for name in ("eagle", "eagle-fixed"):
            METHODS[name] = {**METHODS[name], "model": args.eagle_model}
            FULL_VOCAB[f"{name}-fullvocab"]["model"] = args.eagle_model
    unknown = sorted(set(args.methods or ()) - set(METHODS) - set(FULL_VOCAB))
    if unknown:
        parser.error(f"--methods: unknown {unknown[0]!r}")
    METHODS.update(FULL_VOCAB)

    _, val_files = split_files()
    most = 2 * max(max(args.concurrency), 4)
    sets = {"completion": [prompt for prompt, _ in function_prompts(val_files, most)],
            "rewrite": rewrite_prompts(val_files, most)}
    model = args.model
    if args.methods is None:
        args.methods = [m for m in METHODS
                        if m not in FULL_VOCAB and (model is None or m.startswith(("ngram", "none")))]
    if model == "56m":
        import tempfile

        from cpu_throughput import make_checkpoint
        scratch = tempfile.TemporaryDirectory()  # removed when the run ends (mkdtemp left 109 MB a run)
        model = str(make_checkpoint(Path(scratch.name)))
    rows = []
    for set_name in args.sets:
        for c in args.concurrency:
            prompts = sets[set_name][:max(2 * c, 8)]
            llms = {"none": LLM(model, dtype=args.dtype, max_num_seqs=c, **args.engine_args)}
            llms.update({m: LLM(model, dtype=args.dtype, max_num_seqs=c, speculative_config=METHODS[m],
                                **args.engine_args) for m in args.methods})
            for llm in llms.values():
                run(llm, prompts[:2])  # warm-up
            results = {name: [] for name in llms}
            names = list(llms)
            off = {name: [] for name in names if args.self_baseline and METHODS.get(name)}
            for r in range(args.rounds):  # the order turns each round: no method is always first
                order = names[r % len(names):] + names[:r % len(names)]
                if args.turn:
                    for name, res in run_turns({n: llms[n] for n in order}, prompts, args.turn).items():
                        results[name].append(res)
                    continue
                for name in order:
                    if name in off and r % 2:  # speculation off and on back to back, either first
                        off[name].append(run(llms[name], prompts, speculate=False))
                    results[name].append(run(llms[name], prompts))
                    if name in off and not r % 2:
                        off[name].append(run(llms[name], prompts, speculate=False))
            base = results["none"]
            for name, runs in results.items():
                # in float32 greedy outputs are those without drafts; in bfloat16 the logits of
                # k + 1 rows can round differently from one row's, and a near-tie can flip
                same = statistics.mean(x == y for r, b in zip(runs, base)
                                       for x, y in zip(r["token_ids"], b["token_ids"]))
                assert same == 1 or args.dtype != "float32", f"{name} changed the greedy tokens"
                row = {"set": set_name, "concurrency": c, "method": name, "requests": len(prompts),
                       "identical_outputs": same}
                for key in ("tpot_ms", "output_throughput", "acceptance_rate", "mean_accepted_length",
                            "gc_collections", "gc_seconds"):
                    values = [r[key] for r in runs if r[key] is not None]
                    row[key] = statistics.median(values) if values else None
                row["tpot_speedup"] = statistics.median(b["tpot_ms"] / r["tpot_ms"] for r, b in zip(runs, base))
                ratios = [r["output_throughput"] / b["output_throughput"] for r, b in zip(runs, base)]
                row["throughput_ratio"] = statistics.median(ratios)
                row["throughput_ratio_ci95"] = median_interval(ratios)
                if name in off:  # against the same engine with its speculation off, round by round
                    own = off[name]
                    row["self_tpot_speedup"] = statistics.median(b["tpot_ms"] / r["tpot_ms"] for r, b in zip(runs, own))
                    ratios = [r["output_throughput"] / b["output_throughput"] for r, b in zip(runs, own)]
                    row["self_throughput_ratio"] = statistics.median(ratios)
                    row["self_throughput_ratio_ci95"] = median_interval(ratios)
                rows.append(row)
                print(json.dumps(row), flush=True)
            del llms
            gc.collect()  # (on a GPU, the engines' memory goes back before the next ones take theirs)

    def interval(row: dict, key: str = "self_throughput_ratio_ci95") -> str:
        ci = row.get(key)
        return f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else ""

    print("\n| set | concurrency | method | TPOT ms | tok/s | acceptance | mean accepted length | "
          "TPOT speed-up | throughput ratio (95% interval) | identical outputs |"
          + (" vs itself off: TPOT / throughput |" if args.self_baseline else "")
          + "\n|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.self_baseline else ""))
    for r in rows:
        acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        length = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        print(f"| {r['set']} | {r['concurrency']} | {r['method']} | {r['tpot_ms']:.2f} | "
              f"{r['output_throughput']:.0f} | {acc} | {length} | {r['tpot_speedup']:.2f}x | "
              f"{r['throughput_ratio']:.2f}x{interval(r, 'throughput_ratio_ci95')} | "
              f"{100 * r['identical_outputs']:.0f}% |"
              + (f" {r['self_tpot_speedup']:.2f}x / {r['self_throughput_ratio']:.2f}x{interval(r)} |"
                 if "self_throughput_ratio" in r
                 else " - |" if args.self_baseline else ""))
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
