"""Prompt logprobs (SamplingParams.prompt_logprobs): which rows of a step's hidden states
predict which prompt tokens, and their logprobs. The rows are known before the forward, so
that tensor-parallel workers make the same logits calls as the driver (StepInput.logits_rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.engine.request import Request, TokenLogprobs
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.executor.sampler import Sampler
from tokenmill.executor.staging import Staging

if TYPE_CHECKING:
    from tokenmill.executor.models.llama import LlamaForCausalLM

PROMPT_LOGPROB_ROWS = 512  # prompt positions whose full-vocabulary logits exist at once


@dataclass(slots=True)
class PromptLogprobRows:
    chunks: list[np.ndarray]  # rows of the hidden states, PROMPT_LOGPROB_ROWS at most each
    targets: list[int]  # the prompt token each row predicts
    owners: list[tuple[Request, int]]  # (request, how many of the rows are its), in row order


def prompt_logprob_rows(out: SchedulerOutput, query_lens: np.ndarray) -> PromptLogprobRows | None:
    """The rows whose logits give the logprobs of the prompt tokens this step's chunks
    predict, for the requests that ask (SamplingParams.prompt_logprobs): the row of
    position p gives those of token p + 1. None: no request asks."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[Request, int]] = []  # (request, number of its rows), in row order
    row_start = 0
    for request, start, n in zip(out.requests, out.num_computed_tokens, query_lens.tolist()):
        if request.needs_prompt_logprobs:
            # a recompute after preemption skips the positions already done
            first = max(start, len(request.prompt_logprobs) - 1)
            end = min(start + n, request.num_prompt_tokens - 1)
            if first < end:
                rows.extend(range(row_start + first - start, row_start + end - start))
                targets.extend(request.all_token_ids[first + 1:end + 1])
                owners.append((request, end - first))
        row_start += n
    if not rows:
        return None
    chunks = [np.array(rows[lo:lo + PROMPT_LOGPROB_ROWS], dtype=np.int64)
              for lo in range(0, len(rows), PROMPT_LOGPROB_ROWS)]
    return PromptLogprobRows(chunks, targets, owners)

def compute_prompt_logprobs(model: LlamaForCausalLM, staging: Staging, sampler: Sampler, hidden: torch.Tensor,
                        plp: PromptLogprobRows) -> dict[str, list[TokenLogprobs]]:
    """The prompt logprobs of `plp`'s rows; such a step waits for the device once more than others."""
    targets, owners = plp.targets, plp.owners
    k = max(r.sampling_params.prompt_logprobs for r, _ in owners)
    chosen, top_vals, top_ids = [], [], []
    lo = 0
    for part in plp.chunks:
        target = staging.to_device(np.array(targets[lo:lo + len(part)], dtype=np.int64))
        lo += len(part)
        logprobs = torch.log_softmax(model.compute_logits(hidden[staging.to_device(part)]).float(),
                                     dim=-1)
        chosen.append(logprobs.gather(1, target.unsqueeze(1)).squeeze(1))
        if k > 0:
            vals, ids = logprobs.topk(k, dim=-1)
            top_vals.append(vals)
            top_ids.append(ids)
    host = sampler.to_host(torch.cat(chosen), *((torch.cat(top_vals), torch.cat(top_ids)) if k else ()))
    chosen_list = host[0].tolist()
    top_vals_list, top_ids_list = (host[1].tolist(), host[2].tolist()) if k else ([], [])
    result: dict[str, list[TokenLogprobs]] = {}
    i = 0
    for request, count in owners:
        n_top = request.sampling_params.prompt_logprobs
        result[request.request_id] = [
            (targets[j], chosen_list[j], list(zip(top_ids_list[j][:n_top], top_vals_list[j][:n_top])) if n_top
             else []) for j in range(i, i + count)]
        i += count
    return result
