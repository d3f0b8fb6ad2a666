"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

One pass over the [N, vocab] logits for the whole batch; per-request settings
arrive as small tensors built once per step. Sampling is Gumbel-max in its
exponential form, argmax(p / E) with E ~ Exp(1), so no multinomial and no
host sync until the caller reads the ids. A seeded request draws its noise from
a generator seeded by (seed, output position): its tokens depend on nothing
else in the batch, and survive preemption unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.engine.request import TokenLogprobs


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
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked out (min_tokens)
    num_logprobs: list[int | None]  # per row
    max_logprobs: int  # -1 when no row wants logprobs


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> list[tuple[int, TokenLogprobs | None]]:
        """logits: [N, vocab] float32. Returns (token id, logprobs or None) per row."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs >= 0 else None
        if batch.banned is not None:
            logits[batch.banned] = float("-inf")
        if batch.all_greedy:
            ids = logits.argmax(dim=-1)
        else:
            ids = self._sample(logits, batch)
        token_ids = ids.tolist()  # the one host sync of the step
        if raw_logprobs is None:
            return [(t, None) for t in token_ids]
        return self._with_logprobs(token_ids, ids, raw_logprobs, batch)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_ids = logits.argmax(dim=-1)
        temp = batch.temperature
        greedy_rows = temp == 0
        logits = logits / torch.where(greedy_rows, 1.0, temp).unsqueeze(1)
        if batch.top_k is not None or batch.top_p is not None:
            logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        probs = torch.softmax(logits, dim=-1)
        if batch.min_p is not None:
            threshold = probs.amax(dim=-1, keepdim=True) * batch.min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        noise = torch.empty_like(probs)
        if batch.unseeded_rows is not None:
            rows = batch.unseeded_rows
            noise[rows] = torch.empty((len(rows), probs.shape[1]), device=probs.device).exponential_(
                generator=self.generator)
        for row, seed in batch.seeds:
            gen = torch.Generator(device=probs.device).manual_seed(seed)
            noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy_rows, greedy_ids, sampled)

    def _with_logprobs(self, token_ids: list[int], ids: torch.Tensor, logprobs: torch.Tensor,
                       batch: SamplingBatch) -> list[tuple[int, TokenLogprobs | None]]:
        chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
        k = batch.max_logprobs
        if k > 0:
            top_vals, top_ids = logprobs.topk(k, dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        out: list[tuple[int, TokenLogprobs | None]] = []
        for row, (token, n) in enumerate(zip(token_ids, batch.num_logprobs)):
            if n is None:
                out.append((token, None))
                continue
            top = list(zip(top_ids[row][:n], top_vals[row][:n])) if n > 0 else []
            out.append((token, (token, chosen[row], top)))
        return out


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
