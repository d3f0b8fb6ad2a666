"""Draft-model proposer: a smaller model with the target's tokenizer drafts each request's
next tokens greedily, inside the runner's step, right after the target verified.

Its paged KV cache is indexed by the target's block ids, so a request's block table
serves both caches, and the scheduler's allocation, rollback and freeing apply to the
draft's K/V as to the target's. Past each drafting request's last block, scratch blocks
(beyond the shared ones) hold the K/V of the drafts themselves, which only this step's
draft forwards read.

One step, after verification:
  forward 1: each drafting request's tokens that the draft has not computed yet (usually
             the accepted drafts and the target's next token; its prompt the first time it
             drafts; after a preemption or steps without drafts, more), at most
             max_num_batched_tokens in all (a catch-up that does not fit runs as a chunk of
             what does, that request drafting in a later step); the next token's logits
             give draft 1;
  forward j: each request with more than j - 1 drafts feeds its draft j - 1 (kept on the
             device from forward 2 on, spec/chain.py, where the one-call CPU forwards are not used).
A request's draft-computed length never passes the target's num_computed_tokens (the
next token's slot may be freed by the rollback), and a preempted request starts from 0.
Drafts are the draft model's argmax, a point mass, so the verifier's rejection sampling
(executor/spec/rejection.py) keeps sampled requests' distribution exact; with a token map
(executor/spec/vocab.py), the argmax over the map's tokens.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.config import ModelConfig, SpeculativeConfig
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.executor.attention import (AttentionMetadata, row_slots, select_attention_backend, token_rows,
                                         token_slots)
from tokenmill.executor.attention.kv_cache import CacheOwner
from tokenmill.executor.cuda_graphs import CudaGraphRunner, drafter_graphs
from tokenmill.executor.loader import load_model
from tokenmill.executor.memory import scratch_blocks_per_row
from tokenmill.executor.spec.adaptive import StepCost, acceptance, continuation
from tokenmill.executor.spec.chain import DeviceChain
from tokenmill.executor.fused_decoder import fused_decoder
from tokenmill.executor.spec.proposer import Proposer, can_speculate
from tokenmill.executor.spec.rests import DraftChoice
from tokenmill.executor.spec.timing import measure_step_cost
from tokenmill.executor.spec.vocab import DraftVocab, load_token_map, token_map_file

if TYPE_CHECKING:
    from tokenmill.executor.model_runner import ModelRunner

logger = logging.getLogger("tokenmill")


CATCH_UP_ROWS = 32  # a forward of at least this many catch-up rows times a catch-up token


class DraftModel(DraftChoice, DeviceChain, Proposer, CacheOwner):
    """The draft model, its KV cache and the drafts it made this step (handed to the
    requests by `propose`, after the scheduler has taken the step's tokens); when it drafts,
    how many, and when it rests are DraftChoice's (executor/spec/rests.py)."""

    reads_features = False  # whether its forwards read the target's hidden states (an EAGLE head's do)

    def __init__(self, runner: ModelRunner, config: SpeculativeConfig, path: Path, model_config: ModelConfig,
                 num_blocks: int, max_num_batched_tokens: int, kernels) -> None:
        super().__init__(config, runner.max_model_len, runner.step_cost)
        self.block_size = bs = runner.block_size
        self.max_rows = max_num_batched_tokens  # the most tokens one draft forward computes
        self.device = runner.device
        self.staging = runner.staging
        self.sampler = runner.sampler
        self.model_config = model_config
        self.kv_cache_dtype = runner.kv_cache_dtype
        try:
            self.model = self.load(runner, path, model_config, kernels)
        except (ValueError, OSError) as e:
            raise ValueError(f"speculative_config.model: {path} does not load: {e}") from e
        self.vocab: DraftVocab | None = None  # the LM head cut to a token map, if any
        if (token_map := token_map_file(config, path)) is not None:
            ids = load_token_map(token_map, model_config.vocab_size)
            self.vocab = DraftVocab(self.model, ids, model_config.hidden_size, runner.dtype, runner.device)
            logger.info("speculative decoding: the drafter's LM head computes %d of %d tokens (%s)", len(ids),
                        model_config.vocab_size, token_map)
        self.backend_cls = select_attention_backend(runner.config.attention_backend, runner.device, runner.dtype,
                                                    model_config.head_dim, bs, runner.config.kv_cache_dtype)
        # scratch blocks for the drafts' own K/V: enough for k + 1 positions past any block
        self.scratch_per_row = scratch_blocks_per_row(config.num_speculative_tokens, bs)
        self.scratch_rows = runner.config.max_num_seqs
        self.first_scratch = num_blocks
        self.kv_cache = self.allocate_kv_cache(num_blocks + self.scratch_rows * self.scratch_per_row)
        self.attn = self.make_backend(self.kv_cache)
        # where it applies, the decode forwards of one token a request run in one native call
        self.kernels = kernels
        self.fused, self.fused_rows, self.fused_drafts = \
            fused_decoder(self.model, self.kv_cache, self.attn, kernels, self.vocab) or (None, 0, False)
        # with the target's CUDA graphs, the draft's forwards that fit replay graphs of their own
        self.graphs: CudaGraphRunner | None = drafter_graphs(self) if runner.graphs is not None else None
        self.computed: dict[str, int] = {}  # request id -> positions whose draft K/V is in the cache
        self.drafts: dict[str, list[int]] = {}  # made this step, for the next
        self.prior = 0.5  # acceptance over all requests so far: the start of each request's own
        self.later = 0.5  # a later draft's acceptance after an accepted one, over all requests (`continuation`)
        self.evidence = 0  # accepted drafts and rejecting verifications so far, over all requests
        # the last step's drafting: from the choice on, its forwards and their bookkeeping (the
        # target's step cost leaves it out); of it, the decode-shaped forwards and the others
        self.seconds = 0.0
        self.forward_seconds = 0.0
        self.catch_up_seconds = 0.0
        self.drafting_since: float | None = None  # when the step's drafting began (see `drafting`)
        self.forwards: list[int] = []  # the tokens of each decode-shaped draft forward of the last step
        self.draft_cost: StepCost | None = None
        if self.cost is not None:
            self.draft_cost = measure_step_cost(self, min(max_num_batched_tokens, 1024), robust=True, catch_up=True,
                                                argmax=self._argmax)
            logger.info("adaptive speculation: draft forward time by tokens %s", self.draft_cost)

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafts for `hidden`'s rows: the argmax of the drafter's logits (over its token map)."""
        if self.vocab is not None:
            return self.vocab.argmax(self.sampler, hidden)
        return self.sampler._argmax(self.model.compute_logits(hidden))

    @staticmethod
    def load(runner: ModelRunner, path: Path, model_config: ModelConfig, kernels):
        return load_model(path, model_config, "auto", runner.dtype, runner.device,
                          max_position=max(runner.max_model_len, model_config.max_position_embeddings),
                          seed=runner.config.seed, kernels=kernels)

    def release(self, request_id: str) -> None:
        self.computed.pop(request_id, None)
        self.drafts.pop(request_id, None)

    # -- in the runner's step, after verification ---------------------------------
    def run(self, out: SchedulerOutput, sampled: list[list[tuple[int, object]]],
            hidden: torch.Tensor | None = None) -> None:
        """Drafts for the step's sampling requests, from the tokens they have once `sampled`
        (per sampling request, in order: the accepted drafts and the target's next token).
        `hidden`: the target's hidden states of the step's tokens (what an EAGLE head reads)."""
        self._new_step()
        self._run(out, sampled, hidden)
        if self.drafting_since is not None:
            self.seconds = time.perf_counter() - self.drafting_since
        if self.draft_cost is not None and self.forwards:
            # the adaptive cost learns what a decode-shaped draft forward costs in the engine's
            # step (the start-up timing ran the draft alone, its weights in cache), and what a
            # step that drafts adds besides its forwards: the forwards' tables, the drafts'
            # lists (0.1-0.4 ms a step on a 2-core CPU). Catch-ups have their own cost.
            # What runs whether or not a request drafts (pairs, choosing) is the target step's
            # overhead (the engine leaves out `seconds`)
            curve = float(np.mean(self.draft_cost.forward(self.forwards)))
            self.draft_cost.observe_curve(curve, self.forward_seconds / len(self.forwards))
            self.draft_cost.observe_fixed(self.seconds - self.forward_seconds - self.catch_up_seconds)

    def _new_step(self) -> None:
        """The step's drafting time and forwards start from none."""
        self.forwards, self.drafting_since = [], None
        self.seconds = self.forward_seconds = self.catch_up_seconds = 0.0

    def drafting(self) -> None:
        """Marks where the step's drafting begins in `_run`: once the drafts are chosen."""
        self.drafting_since = time.perf_counter()

    def _run(self, out: SchedulerOutput, sampled: list[list[tuple[int, object]]], hidden: torch.Tensor | None) -> None:
        for request in out.preempted:
            self.release(request.request_id)
        if self._rests(len(sampled)):
            # a step that rests costs the draft nothing: its requests fall behind, and catch up
            # when they draft again. Its sampling requests stand for the candidates (none of them
            # is looked at: at 4 requests the drafter's step took 0.07 ms with the loop below,
            # 0.04 ms without, on this 2-core CPU)
            self.drafting()
            self.draft_cost.fade()
            return
        drafting = []  # (row, request, first position, new tokens, room)
        j = 0
        for i, request in enumerate(out.requests):
            if not out.samples(i):  # a prompt chunk: the draft catches up when the request drafts
                continue
            new = sampled[j]
            j += 1
            if can_speculate(request) is not None:
                continue
            room = self.room(request, len(new))
            if room > 0:
                start = min(self.computed.get(request.request_id, 0), out.num_computed_tokens[i])
                drafting.append((i, request, start, new, room))
        # the tokens the draft has not computed before this step's (the prompt, steps without drafts)
        behind = [len(d[1].all_token_ids) - d[2] - 1 for d in drafting]
        # forward 1 computes for a request its tokens since `start`: those behind, then its last
        # token before the step and the step's (new), every step it drafts
        ks = self._choose([d[1] for d in drafting], [d[4] for d in drafting], out,
                          lambda: ([len(r.all_token_ids) + len(new) for _, r, _, new, _ in drafting], behind,
                                   [1 + len(new) for _, _, _, new, _ in drafting]))
        candidates = len(drafting)
        # a forward computes at most max_rows tokens: the requests that fit draft; then the
        # catch-ups that did not fit get what room is left (a chunk each, no drafts this step)
        chosen, late_ones, rows, caught_up = [], [], 0, 0
        for (i, request, start, new, _), k, late in zip(drafting, ks, behind):
            if k == 0 or len(chosen) == self.scratch_rows:
                continue
            tokens = request.all_token_ids[start:] + [t for t, _ in new]
            if rows + len(tokens) <= self.max_rows:
                chosen.append(((i, request, start, tokens), k))
                rows += len(tokens)
                caught_up += max(0, late)
            elif late > 0:
                late_ones.append((i, request, start, tokens[:late]))
        chunks = []  # (row, request, first position, tokens)
        for i, request, start, tokens in late_ones:
            if rows >= self.max_rows:
                break
            chunks.append((i, request, start, tokens[:self.max_rows - rows]))
            rows += len(chunks[-1][3])
            caught_up += len(chunks[-1][3])
        drafting = chosen
        self.drafting()
        if candidates and not drafting and self.draft_cost is not None:
            self.draft_cost.fade()  # so that drafting is tried again some time
        if not drafting and not chunks:
            return
        # forward 1: the chunks, then the drafting requests (logits at each one's last token)
        rows = [(i, start, tokens) for i, _, start, tokens in chunks] + \
               [(i, start, tokens) for (i, _, start, tokens), _ in drafting]
        width = max(len(out.block_tables[i]) for i, _, _ in rows) + self.scratch_per_row
        table = np.zeros((len(rows), width), dtype=np.int32)
        for row, (i, _, _) in enumerate(rows):
            blocks = out.block_tables[i]
            table[row, :len(blocks)] = blocks
        for n, row in enumerate(range(len(chunks), len(rows))):  # then each drafting row's scratch blocks
            real = len(out.block_tables[rows[row][0]])
            first = self.first_scratch + n * self.scratch_per_row
            table[row, real:real + self.scratch_per_row] = np.arange(first, first + self.scratch_per_row)
        query_lens = np.array([len(t) for _, _, t in rows], dtype=np.int32)
        starts = np.array([s for _, s, _ in rows], dtype=np.int64)
        ids = [t for _, _, tokens in rows for t in tokens]
        last = np.cumsum(query_lens)[len(chunks):] - 1
        # the rows past each drafting request's last known token and the step's are a catch-up
        if self.fused is not None and len(ids) <= self.fused_rows:  # each token a row of its own
            at, _ = token_slots(query_lens, starts, table, self.block_size)
            tokens = self._decode_rows(at, token_rows(table, query_lens), ids, last, caught_up)
        else:
            tokens, _ = self._forward(query_lens, starts, table, ids, last, caught_up)
        for _, request, start, chunk in chunks:
            self.computed[request.request_id] = start + len(chunk)
        if not drafting:
            return
        drafts = [[t] for t in tokens]
        table = table[len(chunks):]
        positions = np.array([start + len(toks) for (_, _, start, toks), _ in drafting], dtype=np.int64)
        ks = np.array([k for _, k in drafting])
        if self.fused_drafts and len(drafting) <= self.fused_rows:
            self._chain(drafts, positions, table, ks)
        elif self.fused is not None:  # the CPU: the one-call forward for each forward its requests fit in
            for step in range(1, int(ks.max())):  # forward j + 1: one token each, its latest draft
                active = np.flatnonzero(ks > step)
                at, latest = positions[active] + step - 1, [drafts[a][-1] for a in active]
                if len(active) <= self.fused_rows:
                    nxt = self._decode_rows(at, table[active], latest)
                else:
                    nxt, _ = self._forward(np.ones(len(active), dtype=np.int32), at, table[active], latest,
                                           np.arange(len(active)))
                for a, t in zip(active, nxt):
                    drafts[a].append(t)
        else:  # forwards 2, 3, ... each fed the one before's drafts on the device
            self._device_chain(drafts, positions, table, ks)
        for ((_, request, start, toks), _), d in zip(drafting, drafts):
            # the draft computed every known token; the last one's slot may go with the rollback
            self.computed[request.request_id] = start + len(toks) - 1
            self.drafts[request.request_id] = d

    def _forward(self, query_lens: np.ndarray, starts: np.ndarray, table: np.ndarray, ids: list[int],
                 logits_rows: np.ndarray, caught_up: int = 0,
                 features: tuple[torch.Tensor, np.ndarray | None] | None = None) -> tuple[list[int], torch.Tensor]:
        """One draft forward; the argmax and the output hidden states at `logits_rows` (may be
        none). `caught_up`: its rows that catch up (0: each request's rows are its last few
        tokens, the forwards the adaptive cost models). `features` (an EAGLE head's input): the
        rows `features[1]` of `features[0]`, or all of them for None."""
        start = time.perf_counter()
        positions, slots = token_slots(query_lens, starts, table, self.block_size)
        put = self.staging.to_device
        self.staging.begin()
        seq_lens = (starts + query_lens).astype(np.int32)
        extra = ()
        if features is not None:
            source, rows = features
            extra = (source if rows is None or len(rows) == len(source) else source[put(rows.astype(np.int64))],)
        if self.graphs is not None and self.graphs.can_run(query_lens, len(ids)):
            hidden = self.graphs.run(np.array(ids, dtype=np.int64), positions, slots, seq_lens, table, query_lens,
                                     features=extra[0] if extra else None)
        else:
            self.attn.begin_step(AttentionMetadata.from_host(query_lens, seq_lens, table, put(slots), self.block_size,
                                                             put))
            hidden = self.model(put(np.array(ids, dtype=np.int64)), put(positions), self.attn, *extra)
        tokens = []
        if len(logits_rows) == 0:
            hidden = hidden[:0]
        elif len(logits_rows) != len(hidden):
            hidden = hidden[put(np.asarray(logits_rows, dtype=np.int64))]
        self.staging.end()
        if len(logits_rows):
            tokens = self.sampler.to_host(self._argmax(hidden))[0].tolist()
        self._timed(time.perf_counter() - start, len(ids), caught_up)
        return tokens, hidden

    def _chain(self, drafts: list[list[int]], positions: np.ndarray, table: np.ndarray, ks: np.ndarray,
               features: torch.Tensor | None = None) -> None:
        """Forwards 2, 3, ... of a step in one native call (small_draft_chain: the forwards
        _decode_rows would run one by one, the same drafts), each drafting request's drafts after
        its first (drafts[a][0], at positions[a] over table[a]) appended to drafts[a]; timed as
        those forwards. `features`: an EAGLE head's outputs for the first drafts."""
        most = int(ks.max())
        if most <= 1:
            return
        start, t = time.perf_counter(), torch.from_numpy
        more = self.kernels.small_draft_chain(self.fused, [d[0] for d in drafts], t(positions), t(table),
                                              self.block_size, ks.tolist(), features)
        self.forward_seconds += time.perf_counter() - start
        self.forwards += [int(np.count_nonzero(ks > j)) for j in range(1, most)]
        for d, later in zip(drafts, more):
            d += later

    def _timed(self, seconds: float, rows: int, caught_up: int) -> None:
        """A forward of `rows` rows, `caught_up` of them catching up, took `seconds`. Its other
        rows (the drafting requests' own) count as a decode-shaped forward at their learnt cost
        (at most `seconds`); the rest is the step's catch-up time (which adaptive speculation's
        calibration leaves out as measured: the built-in draft's catch-ups of 300-440 rows took
        4-21 ms on a 2-core CPU where the learnt rate said 4-7), and teaches what a catch-up
        token costs (from CATCH_UP_ROWS of them or more)."""
        own = rows - caught_up
        if caught_up == 0:
            self.forwards.append(rows)
            self.forward_seconds += seconds
            return
        if own > 0:
            priced = float(self.draft_cost.forward(own)) + self.draft_cost.overhead if self.draft_cost else 0.0
            self.forwards.append(own)
            self.forward_seconds += min(seconds, priced)
            seconds -= min(seconds, priced)
        self.catch_up_seconds += seconds
        if self.draft_cost is not None and caught_up >= CATCH_UP_ROWS:
            self.draft_cost.observe_catch_up(seconds / caught_up)

    def _decode_rows(self, positions: np.ndarray, table: np.ndarray, ids: list[int],
                     logits_rows: np.ndarray | None = None, caught_up: int = 0) -> list[int]:
        """A draft forward through the one-call forward, each token a row of its own (`ids` at
        `positions`, each with its request's row of `table`; a request's tokens in order, each
        attending to the context up to itself, as the decode rows of a short query do in
        _forward), with no attention plan: the slots and lengths come from the positions here
        (on the CPU, where it runs, numpy's arrays are the tensors). The drafts at
        `logits_rows` (default: every row). At one request the built-in draft's forward of a
        later draft cost 0.14 ms, against 0.26 ms through _forward and 0.40 ms through the
        modules (2-core Xeon)."""
        start = time.perf_counter()
        tokens = self.decode_rows(positions, table, ids, logits_rows)
        self._timed(time.perf_counter() - start, len(ids), caught_up)
        return tokens

    def decode_rows(self, positions: np.ndarray, table: np.ndarray, ids: list[int],
                    logits_rows: np.ndarray | None = None) -> list[int]:
        """_decode_rows's forward and drafts, without its bookkeeping (the start-up timing in
        spec/timing.py times this where fused_rows allows)."""
        bs, t = self.block_size, torch.from_numpy
        if self.fused_drafts:  # the head and the argmax in the same call, the slots computed there
            rows = None if logits_rows is None else t(np.asarray(logits_rows, dtype=np.int64))
            return self.kernels.small_llama_draft(self.fused, ids, t(positions), t(table), bs, rows)
        slots = row_slots(table, positions, bs)
        hidden = self.kernels.small_llama_decode(self.fused, t(np.array(ids, dtype=np.int64)), t(positions), t(slots),
                                                 t(table), t((positions + 1).astype(np.int32)), bs)
        if logits_rows is not None and len(logits_rows) != len(ids):
            hidden = hidden[t(np.asarray(logits_rows, dtype=np.int64))]
        return self._argmax(hidden).tolist() if len(hidden) else []

    # -- after the scheduler took the step's tokens ----------------------------------
    def propose(self, requests: list[Request], num_running: int, accepted: int, rejected: int,
                later: tuple[int, int] = (0, 0)) -> None:
        self.prior = acceptance(accepted, rejected, prior=0.5)
        self.later = continuation(later, self.prior)
        self.evidence = accepted + rejected
        if not self.drafts:
            self._propose_none(requests)
            return
        for request in requests:
            if request.is_finished:
                self.release(request.request_id)
                continue
            if can_speculate(request) is not None:
                self.num_unspeculated_steps += 1
                continue
            drafts = self.drafts.pop(request.request_id, None)
            if drafts:
                drafts = drafts[:max(0, self.room(request))]
            else:  # (most requests in a step without drafts: no room to look at)
                drafts = []
            request.spec_token_ids = drafts
            self.num_steps_by_k[len(drafts)] += 1
            self.fade(request, len(drafts))
