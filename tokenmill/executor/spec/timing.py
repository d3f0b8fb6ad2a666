"""The start-up timing of adaptive speculation's step cost (adaptive.StepCost): decode-shaped
forwards of the target (or a drafter) over its own KV cache, before any request is in it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.executor.attention import AttentionMetadata, token_rows, token_slots
from tokenmill.executor.layers.linear import Linear
from tokenmill.executor.spec.adaptive import StepCost
from tokenmill.executor.step_input import StepInput

if TYPE_CHECKING:
    from tokenmill.executor.model_runner import ModelRunner

TIMING_ROUNDS = 3  # rounds over the token counts when timing the forwards at start-up


@torch.inference_mode()
def measure_step_cost(runner: ModelRunner, max_tokens: int, repeats: int = 2, context: int = 512,
                      robust: bool = False, catch_up: bool = False, argmax=None, verify: int = 1) -> StepCost:
    """Times decode-shaped forwards (n one-token sequences, logits and argmax for each) at
    n = 1, 2, 4, ... up to max_tokens and where a linear layer changes paths, the fastest of `repeats` and of
    TIMING_ROUNDS - 1 later rounds over all the counts in turn; then 16 of them again over
    `context` tokens each: what attention adds per context token; with `verify` > 1 (the
    target of up to verify - 1 drafts a request), also what a sequence's query beyond its first
    adds (verifying `verify` tokens at once). `catch_up` (a drafter):
    also one sequence of up to 256 tokens with logits at its last, as a drafter catches up
    with a request's tokens: its seconds per token. `argmax`: the ids from the hidden states
    (default: the argmax of the model's logits). They run over the runner's own cache
    before any request is in it (no second cache: on a GPU the first takes what memory
    there is), as far as its blocks go."""
    bs = runner.block_size
    num_blocks = runner.kv_cache.num_slots // bs
    counts = [1]
    while counts[-1] * 2 <= min(max_tokens, num_blocks):
        counts.append(counts[-1] * 2)
    # past a layer's small_rows rows it leaves its small-step kernel for the packed weight
    # (layers/linear.py; with that kernel's copy alone, SMALL_ONLY, the step leaves the one-call
    # forward there), and the step's time jumps: timed on both sides, a verification of
    # 17-31 tokens (float32 with 16 rows a layer, as on a CPU with AVX-512) is not priced on the
    # line from 16 to 32, below what it costs. (In bfloat16 each layer has its own: the built-in model's 5, 6, 12 and 17.)
    changes = {m.small_rows + 1 for m in runner.model.modules() if isinstance(m, Linear) and m.small is not None}
    counts = sorted({*counts, *(n for n in changes if n <= min(max_tokens, num_blocks))})
    wide = min(16, counts[-1])
    graphs = getattr(runner, "graphs", None)  # on CUDA, steps that fit replay a graph as in the step
    if graphs is not None and graphs.buckets:  # so the verification samples below fit one, as small steps do
        wide = max(1, min(wide, graphs.buckets[-1] // verify))
    context = max(2, min(context, runner.max_model_len - 1, num_blocks // wide * bs))
    per_seq = -(-context // bs)
    backend = runner.make_backend(runner.kv_cache)
    put = runner.staging.to_device
    # forwards of up to fused_rows rows, each token a row of its own, run in one call in the engine's
    # step, and are timed so: a draft model's (DraftModel._decode_rows: no attention plan), the
    # target's (ModelRunner._forward_fused)
    one_call = getattr(runner, "fused_rows", 0)
    drafter = hasattr(runner, "decode_rows")
    if argmax is None:
        def argmax(hidden: torch.Tensor) -> torch.Tensor:
            return runner.sampler._argmax(runner.model.compute_logits(hidden))

    def forward(n: int, seq_len: int, query: int = 1, repeats: int = repeats, warm_up: bool = True,
                most: int = 6) -> float:
        query_lens = np.full(n, query, dtype=np.int32)
        block_table = np.arange(n * per_seq if seq_len > 1 else n, dtype=np.int32).reshape(n, -1)
        positions, slots = token_slots(query_lens, np.full(n, seq_len - query, dtype=np.int64), block_table, bs)
        best, runs, spent = float("inf"), 0 if warm_up else 1, 0.0
        # the first is a warm-up; short forwards run up to `most` times (timing noise is larger
        # against them, and a draft's worth is often decided by a fraction of a millisecond)
        while runs <= repeats or (runs < most and spent < 0.05):
            runs += 1
            start = time.perf_counter()
            seq_lens = np.full(n, seq_len, dtype=np.int32)
            if drafter and n * query <= one_call:  # (a catch-up too: each token a row, as in DraftModel._run)
                runner.decode_rows(positions, token_rows(block_table, query_lens), [0] * (n * query),
                                   None if query == 1 else np.arange(query - 1, n * query, query))
            else:
                runner.staging.begin()
                zeros = np.zeros(n * query, dtype=np.int64)
                if graphs is not None and graphs.can_run(query_lens, n * query):
                    hidden = graphs.run(zeros, positions, slots, seq_lens, block_table, query_lens)
                elif not drafter and runner.fits_one_call(n * query, query):
                    step = StepInput(zeros, positions, slots, query_lens, seq_lens, block_table)
                    hidden = runner._forward_fused(step, None)
                else:
                    backend.begin_step(AttentionMetadata.from_host(query_lens, seq_lens, block_table, put(slots), bs,
                                                                   put))
                    hidden = runner.model(put(zeros), put(positions), backend)
                if query > 1:
                    hidden = hidden[query - 1::query]
                ids = argmax(hidden)
                runner.sampler.to_host(ids)[0].tolist()
                runner.staging.end()
            took = time.perf_counter() - start
            spent += took
            if runs > 1:
                best = min(best, took)
        return best

    seconds = [forward(n, 1) for n in counts]
    # the counts again, in turn: a moment's load on the machine (tens of ms on a shared
    # 2-core VM) covered every run of one count when each count's runs came together, and
    # a 2-token forward once timed at 4.27 ms against 2.46 ms for 1 token. The curve never
    # falls, so the drafts of a request alone looked 1.8 ms dearer than they were, and that
    # engine's EAGLE head never drafted again at concurrency 1
    for _ in range(TIMING_ROUNDS - 1):
        seconds = [min(s, forward(n, 1, repeats=1, warm_up=False, most=3)) for s, n in zip(seconds, counts)]
    cost = StepCost(counts, seconds, robust)
    # attention: the median of 5 differences, each of two forwards timed one after the
    # other (timed far apart, a moment's load on the machine made it 0.5x-1.5x)
    # with `verify`, each sample also times the context with q queries a sequence: a
    # sequence's queries share one read of its keys and values (on a 2-core CPU the built-in
    # model's 4 sequences over 512 tokens spent 0.68 us a context token decoding one token
    # each and 1.24 us verifying 5, so a draft added 0.14 us, not 0.68); its sample is that
    # cost less the one-query cost timed with it
    q = min(verify, context - 1, max(1, max_tokens // wide))
    extra, more = [], []
    for _ in range(5):
        extra.append(forward(wide, context, repeats=1) - forward(wide, 1, repeats=1))
        if q > 1:
            more.append(forward(wide, context, q, repeats=1) - forward(wide, q, q, repeats=1) - extra[-1])
    cost.attention = max(0.0, float(np.median(extra)) / (wide * (context - 1)))
    if more:
        cost.query_attention = max(0.0, float(np.median(more)) / (wide * (q - 1) * (context - q)))
    if catch_up:
        rows = max(1, min(256, max_tokens, context))
        cost.catch_up = forward(1, rows, rows) / rows
    return cost
