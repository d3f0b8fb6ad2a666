"""Presence, frequency and repetition penalties and logit bias, applied to a batch's logits at once.

The counts behind the penalties are kept incrementally, on the device: a request
with penalties owns a row of `counts` ([rows, vocab], how often each token was
generated; float32, so that it enters the arithmetic as it is) and of `in_prompt`
([rows, vocab] bool). The row is filled once, when the request first samples, and
each step adds the sampled ids with one scatter, before the step's host sync. A preempted request keeps its row (recompute keeps its
output); a finished one gives it back. Rows grow by doubling.

Definitions (vLLM's, OpenAI's for the first two):
  frequency: logit -= frequency_penalty * count
  presence:  logit -= presence_penalty * (count > 0)
  repetition (HF): a token in the prompt or the output has its logit divided by p
             when positive, multiplied by p when negative
Order, as in vLLM: banned tokens and logit bias first, then the penalties.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from tokenmill.engine.request import Request
from tokenmill.executor.attention.base import ToDevice


class PenaltyBatch(NamedTuple):
    """The rows of a step's batch that have penalties, and their settings."""

    batch_rows: torch.Tensor  # [M] int64, rows of the logits
    state_rows: torch.Tensor  # [M] int64, rows of PenaltyState
    presence: torch.Tensor  # [M] float32
    frequency: torch.Tensor  # [M] float32
    repetition: torch.Tensor  # [M] float32
    state: "PenaltyState"
    # known on the host: which terms any row uses, and whether every row of the logits is penalised
    use_repetition: bool
    use_counts: bool
    all_rows: bool


class PenaltyState:
    def __init__(self, vocab_size: int, device: torch.device, to_device: ToDevice) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.to_device = to_device
        self.rows: dict[str, int] = {}
        self.free: list[int] = []
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def batch(self, rows: list[int], requests: list[Request], num_rows: int) -> PenaltyBatch:
        """rows[i]: the logits row of requests[i], a request with penalties; num_rows: the logits' rows."""
        state_rows = [self.row(r) for r in requests]
        params = [r.sampling_params for r in requests]
        presence = np.array([p.presence_penalty for p in params], dtype=np.float32)
        frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)
        # in float32's normal range: 5e-324 would round to 0 (and -inf * 0 is NaN), 1e308 to inf
        f32 = np.finfo(np.float32)
        repetition = np.array([p.repetition_penalty for p in params], dtype=np.float64).clip(f32.tiny, f32.max)
        repetition = repetition.astype(np.float32)
        put = self.to_device
        return PenaltyBatch(put(np.array(rows, dtype=np.int64)), put(np.array(state_rows, dtype=np.int64)),
                            put(presence), put(frequency), put(repetition), self,
                            use_repetition=bool((repetition != 1).any()),
                            use_counts=bool(presence.any() or frequency.any()), all_rows=len(rows) == num_rows)

    def row(self, request: Request) -> int:
        row = self.rows.get(request.request_id)
        if row is not None:
            return row
        if not self.free:
            self._grow()
        row = self.rows[request.request_id] = self.free.pop()
        # the output so far (normally none: a row is taken at the first sampling step)
        counts = np.bincount(np.array(request.output_token_ids, dtype=np.int64), minlength=self.vocab_size)
        self.counts[row] = self.to_device(counts.astype(np.float32))
        in_prompt = np.zeros(self.vocab_size, dtype=np.bool_)
        in_prompt[np.array(request.prompt_token_ids, dtype=np.int64)] = True
        self.in_prompt[row] = self.to_device(in_prompt)
        return row

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free.append(row)

    def record(self, batch: PenaltyBatch, ids: torch.Tensor) -> None:
        """Adds each penalised row's sampled token to its counts (on the device, no sync)."""
        sampled = ids.index_select(0, batch.batch_rows)
        self.counts.index_put_((batch.state_rows, sampled), torch.ones_like(sampled, dtype=torch.float32),
                               accumulate=True)

    def _grow(self) -> None:
        old = len(self.counts)
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.float32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self.free.extend(range(new - 1, old - 1, -1))


def apply_penalties(logits: torch.Tensor, batch: PenaltyBatch) -> None:
    """logits: [N, vocab] float32, changed in place in the batch's penalised rows. Only the
    terms some row uses are computed: each is a pass over [rows, vocab]."""
    rows = batch.batch_rows
    sub = logits if batch.all_rows else logits.index_select(0, rows)
    counts = batch.state.counts.index_select(0, batch.state_rows)
    generated = counts > 0
    if batch.use_repetition:
        seen = generated | batch.state.in_prompt.index_select(0, batch.state_rows)
        rep = batch.repetition.unsqueeze(1)
        # HF's arithmetic, exactly, within the float range: a tiny penalty would divide a logit to
        # inf, a huge one multiply it to -inf (NaN probabilities, or a row with nothing left); the
        # largest float stands in. A masked token (-inf) stays masked.
        big = torch.finfo(sub.dtype).max
        scaled = torch.where(sub > 0, (sub / rep).clamp_(max=big), (sub * rep).clamp_(min=-big))
        sub = torch.where(seen & ~torch.isneginf(sub), scaled, sub)
    if batch.use_counts:
        sub = sub - batch.frequency.unsqueeze(1) * counts - batch.presence.unsqueeze(1) * generated
    if batch.all_rows:
        logits.copy_(sub)
    else:
        logits.index_copy_(0, rows, sub)


def apply_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """bias: (rows, token ids, values), added in place."""
    rows, ids, values = bias
    logits.index_put_((rows, ids), values, accumulate=True)
