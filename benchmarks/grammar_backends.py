"""llguidance vs xgrammar, the two structured-output libraries vLLM and SGLang use: the
measurement behind tokenmill's choice (engine/grammar.py).

    pip install xgrammar   # not a tokenmill dependency
    python benchmarks/grammar_backends.py

For each tokenizer (the built-in model's, vocab 8192, and a 64k byte-level BPE trained
here on the Python standard library, as large vocabularies are where masks cost most):
the time to compile a JSON schema and the any-JSON grammar (cold, caches off), and, for
16 matchers walking 64 tokens (random logits through the mask, as a sampling batch does),
the time per step to fill the 16 masks and to advance the matchers.
"""

from __future__ import annotations

import glob
import json
import sys
import tempfile
import time

import torch

from tokenmill.config import DEFAULT_MODEL_DIR

SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                   "kind": {"enum": ["cat", "dog", "bird"]}},
    "required": ["name", "age", "tags", "kind"], "additionalProperties": False})
BATCH, STEPS = 16, 64


def trained_tokenizer(vocab: int, root: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(f"{sys.base_prefix}/lib/python3*/**/*.py", recursive=True))[:6000]

    def texts():
        for path in files:
            try:
                yield open(path, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                pass

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(root)
    return fast


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def walk(new_matcher, fill, accept, done, vocab: int, apply) -> tuple[float, float]:
    """(ms per step filling BATCH masks, ms per step advancing them) over STEPS steps."""
    matchers = [new_matcher() for _ in range(BATCH)]
    gen = torch.Generator().manual_seed(0)
    fill_s = accept_s = 0.0
    for _ in range(STEPS):
        live = [i for i, m in enumerate(matchers) if not done(m)]
        t0 = time.perf_counter()
        mask = fill([matchers[i] for i in live])
        fill_s += time.perf_counter() - t0
        logits = torch.randn(len(live), vocab, generator=gen)
        apply(logits, mask)
        ids = logits.argmax(-1).tolist()
        t0 = time.perf_counter()
        for i, token in zip(live, ids):
            assert accept(matchers[i], token)
        accept_s += time.perf_counter() - t0
    return fill_s / STEPS * 1e3, accept_s / STEPS * 1e3


def bench_xgrammar(tok, vocab: int) -> dict:
    import xgrammar as xgr

    info, info_s = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    schema, schema_s = timed(lambda: compiler.compile_json_schema(SCHEMA, any_whitespace=False))
    any_json, json_s = timed(compiler.compile_builtin_json_grammar)

    def fill(matchers):
        mask = xgr.allocate_token_bitmask(len(matchers), vocab)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        return mask

    out = {"tokenizer_s": info_s, "compile_schema_s": schema_s, "compile_json_s": json_s}
    for name, grammar in (("schema", schema), ("json", any_json)):
        out[name] = walk(lambda: xgr.GrammarMatcher(grammar), fill, lambda m, t: m.accept_token(t),
                         lambda m: m.is_terminated(), vocab, xgr.apply_token_bitmask_inplace)
    return out


def bench_llguidance(tok, vocab: int) -> dict:
    import llguidance
    import llguidance.hf

    from tokenmill.executor.sampler import apply_token_bitmask

    ll_tok, tok_s = timed(lambda: llguidance.hf.from_tokenizer(tok, n_vocab=vocab))
    options = {"whitespace_flexible": False}
    grammars = {"schema": llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=options),
                "json": llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options)}
    _, schema_s = timed(lambda: llguidance.LLMatcher(ll_tok, grammars["schema"]))
    _, json_s = timed(lambda: llguidance.LLMatcher(ll_tok, grammars["json"]))
    words = (vocab + 31) // 32

    def fill(matchers):
        mask = torch.empty((len(matchers), words), dtype=torch.int32)
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(mask[i].data_ptr(), words * 4)
        return mask

    def apply(logits, mask):
        apply_token_bitmask(logits, torch.arange(len(mask)), mask)

    out = {"tokenizer_s": tok_s, "compile_schema_s": schema_s, "compile_json_s": json_s}
    for name, grammar in grammars.items():
        out[name] = walk(lambda: llguidance.LLMatcher(ll_tok, grammar, log_level=0), fill,
                         lambda m, t: m.consume_token(t), lambda m: m.is_stopped(), vocab, apply)
    return out


def main() -> None:
    from transformers import AutoTokenizer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in (("built-in 8192", lambda: AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)),
                           ("BPE 65536", lambda: trained_tokenizer(65536, tmp))):
            tok = make()
            for lib, bench in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
                r = bench(tok, len(tok))
                rows.append((name, lib, r))
                print(f"{name:14s} {lib:10s} tokenizer {r['tokenizer_s'] * 1e3:7.1f} ms | compile schema "
                      f"{r['compile_schema_s'] * 1e3:7.1f} ms, any JSON {r['compile_json_s'] * 1e3:6.1f} ms | "
                      f"per step of {BATCH}: schema fill {r['schema'][0]:.2f} ms + advance {r['schema'][1]:.2f} ms, "
                      f"any JSON fill {r['json'][0]:.2f} ms + advance {r['json'][1]:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
