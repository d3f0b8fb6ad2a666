"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs,
banned tokens, logit bias and penalties (executor/penalties.py), and the token masks of
structured outputs (engine/grammar.py).

One pass over the [N, vocab] logits for the whole batch; per-request settings
arrive as small tensors built once per step. Greedy rows take the argmax (on the
CPU a native kernel, on the logits in the model's dtype). Random rows are drawn by
inverse transform: one uniform number per row, found in the cumulative sum of the
row's probabilities, so no host sync until the caller reads the ids. (Gumbel-max
would need a random number per vocabulary entry: 40 ms a step for 64 rows of
32,000 on a CPU, where this takes about 2 ms.) A seeded request draws its number
from a generator seeded by (seed, output position): its tokens depend on nothing
else in the batch, and survive preemption unchanged. A row that verifies a speculative
draft accepts it or draws from the residual (executor/spec/rejection.py) in the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from tokenmill.engine.request import TokenLogprobs
from tokenmill.executor.penalties import PenaltyBatch, apply_bias, apply_penalties
from tokenmill.executor.spec.rejection import rejection_sample


LOGPROB_FLOOR = -9999.0  # vLLM's: what a masked token's logprob (-inf) is reported as


@dataclass(slots=True)
class SamplingBatch:
    """Per-row settings for one step, host lists turned into tensors by the runner."""

    temperature: torch.Tensor  # [N] float32; 0 for greedy rows
    top_k: torch.Tensor | None  # [N] int64, vocab size where disabled; None if no row uses it
    top_p: torch.Tensor | None  # [N] float32; None if no row uses it
    min_p: torch.Tensor | None  # [N] float32; None if no row uses it
    all_greedy: bool
    seeds: list[tuple[int, int]]  # (row, seed for this position) of seeded rows
    unseeded_rows: torch.Tensor | None  # rows drawing from the engine's generator
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked out (min_tokens, bad words)
    num_logprobs: list[int | None]  # per row
    max_logprobs: int  # -1 when no row wants logprobs
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, token ids, values): logit_bias
    penalties: PenaltyBatch | None = None  # rows with presence / frequency / repetition penalties
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, int32 bits of allowed tokens): structured
    # speculative decoding: [N] int64, the draft token each row verifies (-1: none), and the
    # (row, seed) of seeded rows that verify one
    drafts: torch.Tensor | None = None
    draft_seeds: list[tuple[int, int]] | None = None


class Sampler:
    """`kernels`: the native CPU kernels (greedy argmax) when built for the CPU, else None."""

    def __init__(self, generator: torch.Generator, device: torch.device | None = None,
                 kernels: ModuleType | None = None) -> None:
        self.generator = generator
        self.kernels = kernels
        self.cuda = device is not None and device.type == "cuda"

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[tuple[int, TokenLogprobs | None]]:
        """logits: [N, vocab] in the model's dtype. Returns (token id, logprobs or None) per row."""
        return self.sample(logits, batch).tokens()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledTokens:
        """The rows' tokens (and logprobs) on the device, their copies to the host started: no
        host sync until SampledTokens.tokens() (async scheduling runs the next step meanwhile)."""
        if batch.max_logprobs >= 0 or not batch.all_greedy or batch.bias is not None or batch.penalties is not None:
            logits = logits.float()  # greedy alone needs no widening: bf16 -> f32 keeps the order
        if batch.grammar is not None:  # before the logprobs: they are those of the constrained distribution
            apply_token_bitmask(logits, *batch.grammar)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs >= 0 else None
        if batch.banned is not None:
            constrained = logits[batch.grammar[0]] if batch.grammar is not None else None
            # the value as a device tensor: a Python scalar would be copied over, blocking
            logits.index_put_(batch.banned, torch.full(batch.banned[0].shape, float("-inf"), dtype=logits.dtype,
                                                       device=logits.device))
            if constrained is not None:  # a row the bans left nothing in keeps what its grammar allows
                rows = batch.grammar[0]
                banned = logits[rows]
                dead = torch.isneginf(banned).all(dim=-1, keepdim=True)
                logits[rows] = torch.where(dead, constrained, banned)
        if batch.bias is not None:
            apply_bias(logits, batch.bias)
        if batch.penalties is not None:
            apply_penalties(logits, batch.penalties)
        ids = self._argmax(logits) if batch.all_greedy else self._sample(logits, batch)
        if batch.penalties is not None:
            batch.penalties.state.record(batch.penalties, ids)
        if raw_logprobs is None:
            return SampledTokens(ids, *self._start_copies(ids), num_logprobs=None)
        chosen = raw_logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).clamp(min=LOGPROB_FLOOR)
        k = batch.max_logprobs
        top_vals, top_ids = raw_logprobs.topk(k, dim=-1) if k > 0 else (chosen, ids)
        top_vals = top_vals.clamp(min=LOGPROB_FLOOR)  # a masked token's -inf: JSON has no infinity
        # ids, their logprobs and the top-k come back together: still one host sync
        return SampledTokens(ids, *self._start_copies(ids, chosen, top_vals, top_ids),
                             num_logprobs=batch.num_logprobs)

    def to_host(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """All of them on the host after one wait: non-blocking copies, then one event."""
        host, copied = self._start_copies(*tensors)
        if copied is not None:
            copied.synchronize()
        return host

    def _start_copies(self, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
        """Non-blocking copies to the host and the event that says they are done (None on the CPU)."""
        if not self.cuda:
            return list(tensors), None
        out = [t.to("cpu", non_blocking=True) for t in tensors]
        copied = torch.cuda.Event()
        copied.record()
        return out, copied

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Row-wise argmax, first index on ties (the native CPU kernel where it is built)."""
        if self.kernels is not None and logits.stride(-1) == 1:
            return self.kernels.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_ids = self._argmax(logits)
        temp = batch.temperature
        greedy_rows = temp == 0
        logits = logits / torch.where(greedy_rows, 1.0, temp).unsqueeze(1)
        if batch.top_k is not None or batch.top_p is not None:
            logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if batch.min_p is not None:
            threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        accepted = None
        if batch.drafts is not None:  # before the draws: a draft row samples from its residual
            probs, accepted = self._verify_drafts(probs, batch)
        uniform = torch.zeros(len(probs), device=probs.device)
        if batch.unseeded_rows is not None:
            rows = batch.unseeded_rows
            uniform[rows] = torch.rand(len(rows), device=probs.device, generator=self.generator)
        for row, seed in batch.seeds:
            gen = torch.Generator(device=probs.device).manual_seed(seed)
            uniform[row] = torch.rand(1, device=probs.device, generator=gen)[0]
        # the first token whose cumulative probability exceeds u * total: a token of
        # probability 0 adds nothing to the sum, so it is never the first to exceed it;
        # u * total may round up to total, hence the cap just below it
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1]
        target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
        sampled = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        if accepted is not None:
            sampled = torch.where(accepted, batch.drafts, sampled)
        # a row whose probabilities are not finite (logits near the float limit, overflowed by the
        # temperature) takes its argmax: never a token its mask or grammar left out
        return torch.where(greedy_rows | ~torch.isfinite(total), greedy_ids, sampled)

    def _verify_drafts(self, probs: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each draft row's acceptance draw (a seeded row's from (seed, position, 1)), then
        rejection sampling (spec/rejection.py): the residual probabilities and the verdicts."""
        uniform = torch.rand(len(probs), device=probs.device, generator=self.generator)
        for row, seed in batch.draft_seeds or ():
            gen = torch.Generator(device=probs.device).manual_seed(seed)
            uniform[row] = torch.rand(1, device=probs.device, generator=gen)[0]
        return rejection_sample(probs, batch.drafts, uniform)


@dataclass(slots=True)
class SampledTokens:
    """A step's sampled ids on the device (`ids`, which async scheduling feeds to the next
    step's inputs) and their copies on their way to the host."""

    ids: torch.Tensor
    host: list[torch.Tensor]  # ids, then (chosen logprob, top values, top ids) when asked
    copied: torch.cuda.Event | None  # recorded after the copies (CUDA)
    num_logprobs: list[int | None] | None  # per row; None: no row asked for logprobs

    def tokens(self) -> list[tuple[int, TokenLogprobs | None]]:
        """(token id, logprobs or None) per row: waits for the copies (the step's one host sync)."""
        if self.copied is not None:
            self.copied.synchronize()
        if self.num_logprobs is None:
            return [(t, None) for t in self.host[0].tolist()]
        token_ids, chosen, top_vals, top_ids = (t.tolist() for t in self.host)
        out: list[tuple[int, TokenLogprobs | None]] = []
        for row, (token, n) in enumerate(zip(token_ids, self.num_logprobs)):
            if n is None:
                out.append((token, None))
                continue
            top = list(zip(top_ids[row][:n], top_vals[row][:n])) if n > 0 else []
            out.append((token, (token, chosen[row], top)))
        return out


_BIT = {}  # device -> [32] int32: 1 << bit


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
    """Sets -inf where a row's mask has a 0 bit: bit t % 32 of word t // 32 of bits[k] says
    whether token t is allowed in logits[rows[k]]. One pass for the batch's constrained rows."""
    shifts = _BIT.get(bits.device)
    if shifts is None:
        shifts = _BIT[bits.device] = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(len(bits), -1)[:, :logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """Masks everything outside each row's top-k and top-p set with -inf (one sort)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # the k-th largest value is the threshold; rows with k == vocab keep everything
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
