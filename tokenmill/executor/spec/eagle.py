"""EAGLE proposer: a one-layer head drafts from the target's own hidden states
(executor/models/llama_eagle.py), inside the runner's step, right after verification.

The head's paged KV cache is indexed by the target's block ids, as a draft model's is
(executor/spec/draft.py: scratch blocks past each drafting request's last block hold the
drafts' own K/V). Its entry at position p is made from the pair (the token after p, the
target's hidden state at p), so it can only be written in the step whose target forward
computed p: the head keeps up with every token the target computes for requests that
may speculate, prompt chunks included, whether or not they draft this step.

One step, after verification, per request that may speculate:
  forward 1: a pair for each of its positions whose hidden state is valid (a verifying
             request's accepted drafts, not its rejected ones) with the token after it
             (the next prompt token, an accepted draft, the target's next token); the last
             pair's output gives draft 1 where the request drafts;
  forward j: each request with more than j - 1 drafts feeds (draft j - 1, the head's own
             output for it).
Where the head's cache has no pair for a position (a prefix-cache hit across a block's
last position, steps served without speculation), its drafts are worse, not wrong:
verification decides what is kept.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.config import ModelConfig
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.executor.attention import token_rows, token_slots
from tokenmill.executor.loader import building, fill_weights, safetensors_files
from tokenmill.executor.models.llama_eagle import EagleLlamaForCausalLM
from tokenmill.executor.spec.draft import DraftModel
from tokenmill.executor.spec.eagle_pairs import Rest, Waiting
from tokenmill.executor.spec.proposer import can_speculate

if TYPE_CHECKING:
    from tokenmill.executor.model_runner import ModelRunner


# the waiting decode rows' hidden states are copied into slabs of this many rows, one after
# another (a slab lives while any of its rows waits)
SLAB_ROWS = 256
# resting decode steps logged (EagleProposer._log_rest) since the head last drafted; later ones
# of a batch of at least IDLE_BATCH requests keep no pairs and the runner skips the head
# altogether (EagleProposer.idle)
MAX_LOGGED_REST = 64
IDLE_BATCH = 4


class EagleProposer(DraftModel):
    """DraftModel's cache, cost learning and proposing; the head's forwards read features.
    `pending`: per request not drafting lately, its pairs not yet in the head's cache."""

    reads_features = True

    def __init__(self, *args, **kwargs) -> None:
        self.pending: dict[str, Waiting] = {}
        self._slab: torch.Tensor | None = None  # where waiting decode rows' hidden states are copied
        self._slab_used = 0
        self.log: list[Rest] = []  # resting steps whose pairs are not handed out yet (see _log_rest)
        self.rested = 0  # resting decode steps since the head last drafted
        super().__init__(*args, **kwargs)

    @staticmethod
    def load(runner: ModelRunner, path: Path, model_config: ModelConfig, kernels) -> EagleLlamaForCausalLM:
        from safetensors import safe_open
        names = set()
        for f in safetensors_files(path):
            with safe_open(str(f), framework="pt") as st:
                names.update(n.removeprefix("model.") for n in st.keys())
        with building(runner.dtype, runner.device):
            head = EagleLlamaForCausalLM(model_config, runner.model,
                                         max(runner.max_model_len, model_config.max_position_embeddings),
                                         kernels, fc_bias="fc.bias" in names)
        return fill_weights(head, path, "auto")

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._hand_out()
        self.pending.pop(request_id, None)

    def idle(self, out: SchedulerOutput, num_sampling: int) -> bool:
        """A resting decode step of IDLE_BATCH requests or more, after MAX_LOGGED_REST logged
        ones, keeps no pairs, so the head does nothing in it. The requests' pairs from then on
        are missing from the head's cache when they draft again: their drafts there are worse,
        not wrong, and no catch-up is due. (Logging a step took 0.03 ms and the drafter's call
        0.05 ms of a 2.1 ms step at 4 EAGLE requests of the built-in model whose drafts did not
        pay, on a 2-core CPU.) A smaller batch keeps logging: there drafts pay soonest after a
        rest, and the gaps cost them: EAGLE at one request on the rewrite set of
        benchmarks/speculative.py fell to 0.99x the TPOT of no speculation, against 1.03-1.26x."""
        if (self.rested < MAX_LOGGED_REST or len(out.requests) < IDLE_BATCH
                or out.total_num_scheduled_tokens != len(out.requests)):
            return False
        return super().idle(out, num_sampling)

    def _run(self, out: SchedulerOutput, sampled: list[list[tuple[int, object]]], hidden: torch.Tensor | None) -> None:
        for request in out.preempted:
            self.release(request.request_id)
        if hidden is None:
            return
        # a resting step (see DraftChoice._choose) keeps every pair and asks nothing: its sampling
        # requests stand for the candidates, whose rooms and waiting pairs are not looked at
        resting = self._rests(len(sampled))
        if resting and len(hidden) == len(out.requests):  # one token each (a full batch's usual step)
            self._log_rest(out, hidden)
            return
        self._hand_out()
        pairs: list[tuple[int, Request, int, int, list[int]]] = []  # (request index, request, row, position, tokens)
        candidates: list[tuple[int, int]] = []  # (in `pairs`, room)
        row, next_sample = 0, iter(sampled)
        # one pass over the step's lists (this runs in every step, drafting or not: at 64
        # requests each Python call here costs a few percent of a millisecond)
        for i, (request, n, computed, samples, spec) in enumerate(zip(out.requests, out.num_scheduled_tokens,
                                                                       out.num_computed_tokens, out.sampling,
                                                                       out.spec_token_ids)):
            first, row = row, row + n
            new = [t for t, _ in next(next_sample)] if samples else None
            why = can_speculate(request)
            if why is not None and why != "min_tokens":  # (one held back by min_tokens speculates later)
                continue
            if new is None:  # a prompt chunk: each position pairs with the prompt token after it
                tokens = request.all_token_ids[computed:computed + n + 1]
            else:  # the tokens it computed, less rejected drafts, then the accepted ones and the next token
                tokens = request.all_token_ids[computed:computed + n - len(spec)] + new
            if len(tokens) < 2:
                continue
            pairs.append((i, request, first, computed, tokens[1:n + 1]))
            if new is not None and why is None and not resting and (room := self.room(request, len(new))) > 0:
                candidates.append((len(pairs) - 1, room))
        if resting:
            self.draft_cost.fade()
            if pairs:
                self._keep(pairs, hidden)
                self.drafting()
            return
        if not pairs:
            return
        behind = [self._behind(pairs[c][1].request_id, pairs[c][3]) for c, _ in candidates]

        def inputs() -> tuple[list[int], list[int], list[int]]:
            """Forward 1 computes a request's waiting pairs and this step's. A decode step's
            (its accepted drafts and the next token) are rows it has every step it drafts;
            the others are a catch-up (after a prompt's last chunk, the whole prompt)."""
            most = 1 + self.config.num_speculative_tokens
            steps = [len(pairs[c][4]) for c, _ in candidates]
            return ([pairs[c][3] + n + 1 for (c, _), n in zip(candidates, steps)],
                    [late + (n - 1 if n > most else 0) for late, n in zip(behind, steps)],
                    [n if n <= most else 1 for n in steps])

        ks = self._choose([pairs[c][1] for c, _ in candidates], [room for _, room in candidates], out, inputs)
        chosen, rows = {}, 0  # forward 1 computes at most max_rows pairs (the first request's all);
        for (c, _), k, late in zip(candidates, ks, behind):  # the others' pairs wait
            fits = not chosen or rows + late + len(pairs[c][4]) <= self.max_rows
            if k > 0 and len(chosen) < self.scratch_rows and fits:
                chosen[c] = k
                rows += late + len(pairs[c][4])
        if candidates and not chosen and self.draft_cost is not None:
            self.draft_cost.fade()  # so that drafting is tried again some time
        waiting = [p for c, p in enumerate(pairs) if c not in chosen]
        if waiting:  # their pairs wait, with copies of their hidden states, until they draft
            self._keep(waiting, hidden)
        self.drafting()
        if not chosen:
            return
        self.rested = 0
        drafting = [pairs[c] for c in chosen]
        ks = np.array(list(chosen.values()))
        # forward 1: each drafting request's waiting pairs and this step's; logits at the last
        width = max(len(out.block_tables[d[0]]) for d in drafting) + self.scratch_per_row
        table = np.zeros((len(drafting), width), dtype=np.int32)
        query_lens = np.zeros(len(drafting), dtype=np.int32)
        starts = np.zeros(len(drafting), dtype=np.int64)
        ids: list[int] = []
        parts: list[torch.Tensor] = []
        for r, (i, request, row, position, tokens) in enumerate(drafting):
            blocks = out.block_tables[i]
            table[r, :len(blocks)] = blocks
            scratch = self.first_scratch + r * self.scratch_per_row + np.arange(self.scratch_per_row)
            table[r, len(blocks):len(blocks) + self.scratch_per_row] = scratch
            start, waited, feats = self._waiting(request.request_id, position)
            starts[r], query_lens[r] = start, len(waited) + len(tokens)
            ids += waited + tokens
            parts += feats + [hidden[row:row + len(tokens)]]
        # a request's own rows: this step's pairs, or its last one after more than 1 + k (see `inputs`)
        most = 1 + self.config.num_speculative_tokens
        caught_up = len(ids) - sum(n if n <= most else 1 for n in (len(d[4]) for d in drafting))
        tokens, feats = self._forward(query_lens, starts, table, ids, np.cumsum(query_lens) - 1, caught_up,
                                      (torch.cat(parts), None))
        drafts = [[t] for t in tokens]
        last = starts + query_lens - 1  # each drafting request's last pair's position
        if self.fused_drafts and len(drafting) <= self.fused_rows:
            self._chain(drafts, last + 1, table, ks, feats)
        elif self.fused is not None and len(drafting) <= self.fused_rows:
            active = np.arange(len(drafting))
            for step in range(1, int(ks.max())):  # forward j + 1: (draft j, the head's output for it)
                keep = np.flatnonzero(ks[active] > step)
                active = active[keep]
                nxt, feats = self._forward(np.ones(len(active), dtype=np.int32), last[active] + step, table[active],
                                           [drafts[a][-1] for a in active], np.arange(len(active)), 0, (feats, keep))
                for a, t in zip(active, nxt):
                    drafts[a].append(t)
        else:  # (draft j, the head's output for it) on the device, forward after forward
            self._device_chain(drafts, last + 1, table, ks, feats)
        for piece, d in zip(drafting, drafts):
            self.drafts[piece[1].request_id] = d

    def _forward(self, query_lens: np.ndarray, starts: np.ndarray, table: np.ndarray, ids: list[int],
                 logits_rows: np.ndarray, caught_up: int = 0,
                 features: tuple[torch.Tensor, np.ndarray | None] | None = None) -> tuple[list[int], torch.Tensor]:
        """DraftModel._forward, in one native call where the head has one (executor/fused_decoder.py)
        and the forward fits its rows: each token a row of its own, attending to the context up to
        itself, as a short query's decode rows do. At one request of the built-in model, a later
        draft's forward took 0.17 ms so, against 0.73 ms through the modules (2-core AMD EPYC,
        float32)."""
        if self.fused is None or len(ids) > self.fused_rows or features is None:
            return super()._forward(query_lens, starts, table, ids, logits_rows, caught_up, features)
        start, t = time.perf_counter(), torch.from_numpy
        source, rows = features
        if rows is not None and len(rows) != len(source):
            source = source[t(rows.astype(np.int64))]
        positions, slots = token_slots(query_lens, starts, table, self.block_size)
        if len(ids) != len(table):
            table = token_rows(table, query_lens)
        at = t(np.asarray(logits_rows, dtype=np.int64))
        if self.fused_drafts:
            tokens, hidden = self.kernels.small_eagle_draft(self.fused, ids, source, t(positions), t(table),
                                                            self.block_size, at)
        else:  # the head over the whole vocabulary: its argmax here
            hidden = self.kernels.small_llama_decode(self.fused, t(np.array(ids, dtype=np.int64)), t(positions),
                                                     t(slots), t(table), t((positions + 1).astype(np.int32)),
                                                     self.block_size, source)[at]
            tokens = self._argmax(hidden).tolist() if len(hidden) else []
        self._timed(time.perf_counter() - start, len(ids), caught_up)
        return tokens, hidden

    def _log_rest(self, out: SchedulerOutput, hidden: torch.Tensor) -> None:
        """A resting step in which every request computes one token and samples the next (most
        steps of a full batch whose drafts do not pay): its hidden states go into the slab in
        row order, in one copy, and the step is logged, not each request's pair: its token is
        the one the request samples (in `all_token_ids` once the step's tokens are taken). The
        log is handed out to the requests (`_hand_out`) before any other step and when one is
        released: at most MAX_REST steps. (Keeping each request's pair every step, the drafter
        took 1.5-1.7% of the engine's step time at 16 and 64 requests of the built-in model on
        this 2-core CPU, resting; logging the steps and handing them out, 0.4% at 16.)"""
        self.draft_cost.fade()
        self.rested += 1
        slab, base = self._rows(len(hidden), hidden)
        slab[base:base + len(hidden)].copy_(hidden)
        self.log.append(Rest(out.requests, out.num_computed_tokens, slab, base))
        self.drafting()

    def _rows(self, n: int, like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(slab, first row) of `n` rows for hidden states like `like`'s, after those taken
        before; a new slab when the current one has no room."""
        if self._slab is None or self._slab_used + n > len(self._slab):
            self._slab = like.new_empty((max(SLAB_ROWS, n), like.shape[1]))
            self._slab_used = 0
        base, self._slab_used = self._slab_used, self._slab_used + n
        return self._slab, base

    def _hand_out(self) -> None:
        """Adds the logged resting steps' pairs to their requests' waiting ones: over a run of
        steps with the same requests, each one position further, in one slab one after another,
        a request's rows are every n-th of the slab's from its own, so one piece a request and
        run (a strided view). Finished requests and those that do not speculate get none."""
        log, self.log = self.log, []
        pending, i = self.pending, 0
        while i < len(log):
            first = log[i]
            n, j = len(first.requests), i + 1
            while j < len(log) and log[j].continues(first, j - i):
                j += 1
            steps = j - i
            for r, (request, position) in enumerate(zip(first.requests, first.positions)):
                if request.is_finished or can_speculate(request) not in (None, "min_tokens"):
                    continue
                w = pending.get(request.request_id)
                if w is None or w.end != position:
                    w = pending[request.request_id] = Waiting(position)
                # its rows: every n-th from its own over a run, or the one row of a single step
                source, row = (first.slab[first.base + r::n], 0) if steps > 1 else (first.slab, first.base + r)
                w.add(request.all_token_ids[position + 1:position + 1 + steps], source, row)
            i = j

    def _keep(self, waiting: list[tuple[int, Request, int, int, list[int]]], hidden: torch.Tensor) -> None:
        """Adds each request's pairs to those waiting for its next drafting step, with a copy
        of their hidden states (the step's buffer is reused), at most MAX_WAITING positions a
        request (older ones are dropped: the head's cache has no pair for them, so its drafts
        there are worse, not wrong). The decode-shaped pieces (at most 1 + k rows each) are
        copied in one gather (with a copy a request, the step's bookkeeping at 64 requests
        took 2.6 ms, with one 1.5 ms on this CPU) into the current slab, after the steps
        before: with a new small tensor every step, each living while its rows wait, the
        target's forward ran 2-7% slower at 4 requests of the built-in model, in an engine
        whose head drafted nothing. A prompt chunk's rows get a copy of their own, so that
        another request's few rows never hold a long chunk."""
        most = 1 + self.config.num_speculative_tokens
        offsets: dict[int, int] = {}  # a decode-shaped piece -> its first row in the slab
        total, in_order = 0, True
        for j, piece in enumerate(waiting):
            if len(piece[4]) <= most:
                in_order = in_order and piece[2] == total
                offsets[j] = total
                total += len(piece[4])
        shared: torch.Tensor | None = None
        if offsets:
            shared, base = self._rows(total, hidden)
            into = shared[base:base + total]
            if in_order and total == len(hidden):  # every row (a decode batch in which none drafts)
                into.copy_(hidden)
            else:  # plain Python, not numpy: run after the forward, each numpy call costs 4-5 us here
                rows = [r for j in offsets for r in range(waiting[j][2], waiting[j][2] + len(waiting[j][4]))]
                self.staging.begin()
                torch.index_select(hidden, 0, self.staging.to_device(np.array(rows, dtype=np.int64)), out=into)
                self.staging.end()
            offsets = {j: base + first for j, first in offsets.items()}
        pending = self.pending
        for j, (_, request, row, position, tokens) in enumerate(waiting):
            w = pending.get(request.request_id)
            if w is None or w.end != position:
                w = pending[request.request_id] = Waiting(position)
            first = offsets.get(j)
            if first is None:
                w.add(tokens, hidden[row:row + len(tokens)].clone(), 0)
            else:
                w.add(tokens, shared, first)

    def _leading_to(self, request_id: str, position: int) -> Waiting | None:
        """The pairs waiting for the request whose next pair is at `position`, if they lead up to it."""
        w = self.pending.get(request_id)
        return w if w is not None and w.end == position else None

    def _behind(self, request_id: str, position: int) -> int:
        """How many pairs wait for the request whose next pair is at `position`."""
        w = self._leading_to(request_id, position)
        return 0 if w is None else w.end - w.start

    def _waiting(self, request_id: str, position: int) -> tuple[int, list[int], list[torch.Tensor]]:
        """(first position, tokens, hidden-state pieces) of the pairs waiting for the request
        whose next pair is at `position`; none if they do not lead up to it."""
        w = self._leading_to(request_id, position)
        self.pending.pop(request_id, None)
        if w is None:
            return position, [], []
        return w.start, w.ids.tolist(), [source[first:first + n] for n, source, first
                                         in zip(w.lengths, w.sources, w.firsts)]
